"""Model versions of ``--models-dir``: ``GET /v1/models/versions`` and the admin routes
``POST /v1/admin/promote`` and ``POST /v1/admin/rollback`` (the default model), and the same
for one model of a server of several (``--model NAME=PATH``): ``GET /v1/models/{name}/versions``,
``POST /v1/admin/models/{name}/promote`` and ``POST /v1/admin/models/{name}/rollback``. Each
model has its own serving version and rollback stack; the versions are the folder's files,
which any model may serve.

A promote is a reload of the version's file (:meth:`~anomaly_hooks.serve.service.Service.
promote`: the one loader, the one atomic swap); the version it replaces goes on the rollback
stack, kept in the models folder's versions record (:mod:`anomaly_hooks.serve.versions`). Admin
routes answer only on a server with a token (403 ``admin_disabled`` otherwise).
"""
from __future__ import annotations

from typing import Any, Dict

from fastapi import APIRouter, Depends, Request

from anomaly_hooks.serve.dependencies import ServiceDep, SlotDep, admin_enabled
from anomaly_hooks.serve.errors import ServeError
from anomaly_hooks.serve.routes.model import body_field
from anomaly_hooks.serve.schemas import PromoteResult, VersionList, error_responses
from anomaly_hooks.serve.service import Service

router = APIRouter(tags=["model"])

VERSION_MAX = 255  # a file name, or a checksum prefix
_PROMOTE_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["version"], "additionalProperties": False,
    "properties": {"version": {"type": "string", "minLength": 1, "maxLength": VERSION_MAX,
                               "description": "a file name of the models folder, or at "
                               "least 6 hex digits of its checksum"}}}}}}}


@router.get("/v1/models/versions", response_model=VersionList, summary="The model versions",
            responses=error_responses(401, 404, 500))
async def versions(service: ServiceDep) -> Dict[str, Any]:
    """The model files of ``--models-dir`` (``*.safetensors``, ``*.onnx``), newest first: name,
    SHA-256, size, modification time, method, lineage summary, whether it serves; and the
    rollback stack. 404 on a server without ``--models-dir``."""
    return await service.list_versions()


@router.get("/v1/models/{name}/versions", response_model=VersionList,
            summary="The model versions, for one model",
            responses=error_responses(401, 404, 422, 500))
async def model_versions(service: ServiceDep, slot: SlotDep) -> Dict[str, Any]:
    """As ``GET /v1/models/versions``, with the serving flags, serving version and rollback
    stack of the model ``name`` (404 for a name the server does not serve)."""
    return await service.list_versions(slot)


@router.post("/v1/admin/promote", response_model=PromoteResult, summary="Promote a version",
             dependencies=[Depends(admin_enabled)], openapi_extra=_PROMOTE_BODY,
             responses=error_responses(400, 401, 403, 404, 409, 413, 422, 500, 503))
async def promote(request: Request, service: ServiceDep) -> Dict[str, Any]:
    """Serve a version of the models folder: ``{"version": "<file name or checksum
    prefix>"}``. Loaded, verified and swapped in exactly as a reload; the serving version goes
    on the rollback stack. 404 for an unknown version; a file that is incomplete, damaged or
    still being written is refused (422 ``reload_failed``) and the serving model stays."""
    return await service.promote(await _version_ref(request, service))


@router.post("/v1/admin/models/{name}/promote", response_model=PromoteResult,
             summary="Promote a version, for one model", dependencies=[Depends(admin_enabled)],
             openapi_extra=_PROMOTE_BODY,
             responses=error_responses(400, 401, 403, 404, 409, 413, 422, 500, 503))
async def promote_model(request: Request, service: ServiceDep, slot: SlotDep
                        ) -> Dict[str, Any]:
    """As ``POST /v1/admin/promote``, for the model ``name``: the others serve on untouched,
    and the version it replaces goes on that model's rollback stack."""
    return await service.promote(await _version_ref(request, service), slot)


async def _version_ref(request: Request, service: Service) -> str:
    """The ``version`` of a promote's body; 422 without one."""
    ref = await service.with_timeout(body_field(request, "version", VERSION_MAX, strict=True))
    if not ref:
        raise ServeError(422, "invalid_parameter", 'the body must be {"version": "<a file name '
                         'of the models folder, or at least 6 hex digits of its checksum>"} '
                         "(Content-Type: application/json)")
    return ref


@router.post("/v1/admin/rollback", response_model=PromoteResult, summary="Roll back",
             dependencies=[Depends(admin_enabled)],
             responses=error_responses(401, 403, 404, 409, 422, 500, 503))
async def rollback(service: ServiceDep) -> Dict[str, Any]:
    """Serve the version before the serving one again (the rollback stack's top); 409
    ``no_previous_version`` when there is none or its file is gone."""
    return await service.rollback()


@router.post("/v1/admin/models/{name}/rollback", response_model=PromoteResult,
             summary="Roll back one model", dependencies=[Depends(admin_enabled)],
             responses=error_responses(401, 403, 404, 409, 422, 500, 503))
async def rollback_model(service: ServiceDep, slot: SlotDep) -> Dict[str, Any]:
    """As ``POST /v1/admin/rollback``, for the model ``name`` (its own rollback stack)."""
    return await service.rollback(slot)
