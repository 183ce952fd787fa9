"""The served models: ``GET /v1/model`` (the default model), ``GET /v1/models`` (all of them),
``GET /v1/models/{name}`` (one), and the admin routes ``POST /v1/admin/reload`` (the default
model) and ``POST /v1/admin/models/{name}/reload``.

Admin routes answer only on a server with a token (403 ``admin_disabled`` otherwise), and a
reload loads files from the models folder only (403 ``path_not_allowed``): see
:func:`~anomaly_hooks.serve.dependencies.admin_enabled` and
:meth:`~anomaly_hooks.serve.service.Service.reload_target`.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Dict, Optional

from fastapi import APIRouter, Depends, Query, Request
from starlette.requests import ClientDisconnect

from anomaly_hooks.serve.dependencies import EngineDep, ServiceDep, SlotDep, admin_enabled
from anomaly_hooks.serve.errors import ServeError, client_gone
from anomaly_hooks.serve.schemas import ModelInfo, ModelList, ReloadResult, error_responses
from anomaly_hooks.serve.service import Service
from anomaly_hooks.serve.slots import ModelSlot

router = APIRouter(tags=["model"])

# a reload body is {"path": "..."}: deeper JSON is refused before it is parsed (a parser
# recursing through 100,000 levels would exhaust the stack)
MAX_JSON_DEPTH = 32
PATH_MAX = 4096
_RELOAD_BODY = {"requestBody": {"required": False, "content": {"application/json": {"schema": {
    "type": "object", "properties": {"path": {"type": "string", "maxLength": PATH_MAX}}}}}}}


@router.get("/v1/model", response_model=ModelInfo, response_model_exclude_unset=True,
            summary="The serving model", responses=error_responses(401, 500, 503))
async def model_info(service: ServiceDep, engine: EngineDep) -> Dict[str, Any]:
    """Its identity (file checksum), method, backbone, layers, preprocessing, threshold, fit,
    the server's settings, the batcher's state, the last reload and, with ``--models-dir``,
    its version."""
    return describe(service, service.default)


@router.get("/v1/models", response_model=ModelList, summary="The served models",
            responses=error_responses(401, 500))
async def model_list(service: ServiceDep) -> Dict[str, Any]:
    """Every model of the server, the default one first: name, whether it is ready, its id
    and file (or why it could not be loaded)."""
    out = []
    for slot in service.slots.values():
        engine = slot.engine
        out.append({"name": slot.name, "default": slot.default, "ready": engine is not None,
                    "model_id": engine.model_id if engine else None,
                    "file_sha256": engine.sha256 if engine else None, "path": slot.path,
                    "engine": engine.kind if engine else None,
                    "method": engine.method if engine else None, "error": slot.load_error})
    return {"count": len(out), "default": service.default.name, "models": out}


@router.get("/v1/models/{name}", response_model=ModelInfo, response_model_exclude_unset=True,
            summary="One served model", responses=error_responses(401, 404, 422, 500, 503))
async def named_model_info(service: ServiceDep, slot: SlotDep) -> Dict[str, Any]:
    """As ``GET /v1/model``, for the model ``name`` (404 for a name the server does not
    serve; 503 while it loads)."""
    return describe(service, slot)


def describe(service: Service, slot: ModelSlot) -> Dict[str, Any]:
    """``GET /v1/model``'s answer for the model of ``slot``."""
    engine = service.require_engine(slot)
    b = slot.batcher
    assert b is not None
    return {**engine.info(), "name": slot.name, "serving": service.settings.public(),
            "batching": {"wait_ms": round(b.wait_s * 1000, 3), "batches": b.batches,
                         "seconds_per_image": round(b.seconds_per_image, 6)},
            "last_reload": slot.last_reload,
            "version": service.serving_version(slot),
            "drift_monitor": slot.monitor is not None}


@router.post("/v1/admin/reload", response_model=ReloadResult, summary="Reload the model",
             dependencies=[Depends(admin_enabled)], openapi_extra=_RELOAD_BODY,
             responses=error_responses(400, 401, 403, 409, 413, 422, 500))
async def reload(request: Request, service: ServiceDep,
                 path: Annotated[Optional[str], Query(
                     max_length=PATH_MAX, description="the model file (default: the serving "
                     "one's path again); inside the models folder")] = None) -> Dict[str, Any]:
    """Load a model file beside the serving model, warm it up, then swap: requests admitted
    before finish on the old model. The path comes as ``?path=`` or as ``{"path": ...}``; a
    refused file (422 ``reload_failed``) leaves the old model serving."""
    if path is None:
        path = await service.with_timeout(body_field(request, "path", PATH_MAX))
    return await service.reload(service.reload_target(path) if path else None)


@router.post("/v1/admin/models/{name}/reload", response_model=ReloadResult,
             summary="Reload one model", dependencies=[Depends(admin_enabled)],
             openapi_extra=_RELOAD_BODY,
             responses=error_responses(400, 401, 403, 404, 409, 413, 422, 500))
async def reload_model(request: Request, service: ServiceDep, slot: SlotDep,
                       path: Annotated[Optional[str], Query(
                           max_length=PATH_MAX, description="the model file (default: the "
                           "model's path again); inside the models folder")] = None
                       ) -> Dict[str, Any]:
    """As ``POST /v1/admin/reload``, for the model ``name``: the others serve on untouched."""
    if path is None:
        path = await service.with_timeout(body_field(request, "path", PATH_MAX))
    return await service.reload(service.reload_target(path) if path else None, slot=slot)


async def body_field(request: Request, name: str, max_length: int,
                     strict: bool = False) -> Optional[str]:
    """The string ``name`` of a JSON body ``{name: "..."}`` (None without one); 422
    ``invalid_parameter`` for a body that is not such an object (``strict``: one with other
    keys too)."""
    if not request.headers.get("content-type", "").startswith("application/json"):
        return None
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise client_gone() from None
    if not raw.strip():
        return None
    shape = f'{{"{name}": "..."}}'
    if nested_deeper_than(raw, MAX_JSON_DEPTH):
        raise ServeError(422, "invalid_parameter", f"the JSON body is nested deeper than "
                         f"{MAX_JSON_DEPTH} levels; send {shape}")
    try:
        payload = json.loads(raw)
    except ValueError:  # JSONDecodeError, and bytes that are not UTF-8
        raise ServeError(422, "invalid_parameter", "the body is not valid JSON") from None
    if (payload is not None and not isinstance(payload, dict)
            or strict and set(payload or {}) - {name}):
        raise ServeError(422, "invalid_parameter", f"the body must be {shape}")
    value = (payload or {}).get(name)
    if value is not None and (not isinstance(value, str) or len(value) > max_length):
        raise ServeError(422, "invalid_parameter",
                         f"{name} must be a string of at most {max_length} characters")
    return value


def nested_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether the arrays and objects of a JSON text nest deeper than ``limit`` (brackets
    inside strings do not count)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # it cannot nest deeper than it has brackets
    depth = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return False
