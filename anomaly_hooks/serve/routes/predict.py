"""``POST /v1/predict`` (one image, raw body or multipart) and ``POST /v1/predict/batch`` (a
multipart request of several images, each answered on its own), scored by the default model;
``POST /v1/models/{name}/predict`` and ``.../predict/batch``: the same, by the model
``name``."""
from __future__ import annotations

import time
from typing import Annotated, Any, Dict, List, Literal, Optional, Tuple

from fastapi import APIRouter, Query, Request
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect

from anomaly_hooks.serve.dependencies import EngineDep, ServiceDep, SlotDep
from anomaly_hooks.serve.errors import ServeError, client_gone
from anomaly_hooks.serve.forms import read_form
from anomaly_hooks.serve.schemas import BatchResponse, Prediction, error_responses
from anomaly_hooks.serve.service import Service
from anomaly_hooks.serve.slots import ModelSlot

router = APIRouter(tags=["predict"])

PART_ID_MAX = 200
SOURCE_MAX = 500
# form parts a request may carry besides its images (a part_id per image, and a few more)
BATCH_EXTRA_FIELDS = 8
SINGLE_MAX_FILES = 4    # the first file part is the image
SINGLE_MAX_FIELDS = 16
Heatmap = Annotated[Literal["none", "png", "url"], Query(
    description="none; png: the overlay and mask as base64 PNGs in the answer; url: kept in "
    "the results log, their URLs in the answer")]
PartId = Annotated[Optional[str], Query(max_length=PART_ID_MAX,
                                        description="the part's id, kept with the result")]
Source = Annotated[Optional[str], Query(max_length=SOURCE_MAX,
                                        description="where the image came from (default: the "
                                        "upload's file name)")]

_BINARY = {"type": "string", "format": "binary"}
_IMAGE_BODY = {"requestBody": {"required": True, "content": {
    "application/octet-stream": {"schema": _BINARY},
    "image/*": {"schema": _BINARY},
    "multipart/form-data": {"schema": {
        "type": "object", "required": ["file"], "properties": {
            "file": _BINARY,
            "part_id": {"type": "string", "maxLength": PART_ID_MAX},
            "source": {"type": "string", "maxLength": SOURCE_MAX}}}}}}}
_BATCH_BODY = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {
        "type": "object", "required": ["files"], "properties": {
            "files": {"type": "array", "items": _BINARY},
            "part_id": {"type": "array", "items": {"type": "string"},
                        "description": "one per file, in order"}}}}}}}
_PREDICT_ERRORS = (400, 401, 413, 415, 422, 500, 503)


@router.post("/v1/predict", response_model=Prediction, response_model_exclude_unset=True,
             summary="Score one image", openapi_extra=_IMAGE_BODY,
             responses=error_responses(*_PREDICT_ERRORS))
async def predict(request: Request, service: ServiceDep, _: EngineDep, heatmap: Heatmap = "none",
                  part_id: PartId = None, source: Source = None) -> Dict[str, Any]:
    """The image as the raw body (any image Content-Type) or as a multipart file field (with
    optional ``part_id`` / ``source`` form fields; the query's win). The format is told by the
    bytes: PNG, JPEG, TIFF, BMP or WebP."""
    return await _predict(request, service, service.default, heatmap, part_id, source)


@router.post("/v1/models/{name}/predict", response_model=Prediction,
             response_model_exclude_unset=True, summary="Score one image with one model",
             openapi_extra=_IMAGE_BODY, responses=error_responses(404, *_PREDICT_ERRORS))
async def predict_with(request: Request, service: ServiceDep, slot: SlotDep,
                       heatmap: Heatmap = "none", part_id: PartId = None,
                       source: Source = None) -> Dict[str, Any]:
    """As ``POST /v1/predict``, scored by the model ``name`` (404 for a name the server does
    not serve)."""
    service.require_engine(slot)
    return await _predict(request, service, slot, heatmap, part_id, source)


async def _predict(request: Request, service: Service, slot: ModelSlot, heatmap: str,
                   part_id: Optional[str], source: Optional[str]) -> Dict[str, Any]:
    t_start = time.perf_counter()
    _check_heatmap(service, heatmap)
    with service.admit(1):
        async def run() -> Dict[str, Any]:
            data, name, fields = await _read_upload(request, service.settings.max_upload_bytes)
            read_ms = (time.perf_counter() - t_start) * 1000
            pid = part_id if part_id is not None else _field(fields, "part_id", PART_ID_MAX)
            src = source if source is not None else (
                _field(fields, "source", SOURCE_MAX) or name)
            return await service.predict_bytes(data, part_id=pid, source=src, heatmap=heatmap,
                                               t_start=t_start, read_ms=read_ms, slot=slot)
        return await service.with_timeout(run())


@router.post("/v1/predict/batch", response_model=BatchResponse,
             response_model_exclude_unset=True, summary="Score several images",
             openapi_extra=_BATCH_BODY, responses=error_responses(*_PREDICT_ERRORS))
async def predict_batch(request: Request, service: ServiceDep, _: EngineDep,
                        heatmap: Heatmap = "none") -> Dict[str, Any]:
    """One multipart file part per image (``-F files=@a.png -F files=@b.png``), optional
    ``part_id`` fields in the same order. Each image is answered in its place: its prediction,
    or its ``error`` (refused, failed, or not done within the request timeout); the others
    are scored (in shared batches). When no image could be scored because of the server (all
    failed with a 5xx), the request answers that error instead."""
    return await _predict_batch(request, service, service.default, heatmap)


@router.post("/v1/models/{name}/predict/batch", response_model=BatchResponse,
             response_model_exclude_unset=True, summary="Score several images with one model",
             openapi_extra=_BATCH_BODY, responses=error_responses(404, *_PREDICT_ERRORS))
async def predict_batch_with(request: Request, service: ServiceDep, slot: SlotDep,
                             heatmap: Heatmap = "none") -> Dict[str, Any]:
    """As ``POST /v1/predict/batch``, scored by the model ``name``."""
    service.require_engine(slot)
    return await _predict_batch(request, service, slot, heatmap)


async def _predict_batch(request: Request, service: Service, slot: ModelSlot,
                         heatmap: str) -> Dict[str, Any]:
    t_start = time.perf_counter()
    _check_heatmap(service, heatmap)
    settings = service.settings
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ServeError(415, "unsupported_media_type",
                         "the batch endpoint takes multipart/form-data with one file part "
                         "per image (e.g. -F files=@a.png -F files=@b.png)")
    with service.admit(1):  # the body's slot, taken before a byte of it is read
        deadline = service.loop.time() + settings.request_timeout_s
        form = await service.with_timeout(read_form(
            request, max_files=settings.max_batch_files,
            max_fields=settings.max_batch_files + BATCH_EXTRA_FIELDS,
            max_file_bytes=settings.max_upload_bytes))
        try:
            uploads = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
            if not uploads:
                raise ServeError(400, "empty_body", "the batch request has no file parts")
            part_ids = [v for k, v in form.multi_items() if k == "part_id" and isinstance(v, str)]
            read_ms = (time.perf_counter() - t_start) * 1000
            with service.admit(len(uploads) - 1):  # one slot per image from now on
                outcomes = await service.each_within(
                    [_one_of_batch(service, slot, i, upload, part_ids, heatmap, t_start,
                                   read_ms) for i, upload in enumerate(uploads)],
                    deadline - service.loop.time())
        finally:
            await form.close()
    return _batch_answer(uploads, outcomes)


async def _one_of_batch(service: Service, slot: ModelSlot, i: int, upload: UploadFile,
                        part_ids: List[str], heatmap: str, t_start: float, read_ms: float
                        ) -> Dict[str, Any]:
    """One image of a batch: its prediction (raises its error)."""
    data = await upload.read()
    _check_size(data, service.settings.max_upload_bytes)
    pid = part_ids[i][:PART_ID_MAX] if i < len(part_ids) else None
    return await service.predict_bytes(data, part_id=pid, source=upload.filename,
                                       heatmap=heatmap, t_start=t_start, read_ms=read_ms,
                                       slot=slot)


def _batch_answer(uploads: List[UploadFile], outcomes: List[Any]) -> Dict[str, Any]:
    """The batch's answer: each image's prediction or error, in order; the first error itself
    when every image failed because of the server (nothing was scored or recorded)."""
    errors = [o for o in outcomes if isinstance(o, ServeError)]
    if errors and len(errors) == len(outcomes) and all(e.status >= 500 for e in errors):
        raise errors[0]
    results = [{"index": i, "filename": upload.filename,
                **({"error": out.as_dict()} if isinstance(out, ServeError) else out)}
               for i, (upload, out) in enumerate(zip(uploads, outcomes))]
    return {"count": len(results), "failed": len(errors), "results": results}


# ---- reading the request --------------------------------------------------------------------
def _check_size(data: bytes, max_bytes: int) -> None:
    """413 for one image over the upload limit."""
    if len(data) > max_bytes:
        raise ServeError(413, "payload_too_large", f"image of {len(data):,} bytes exceeds the "
                         f"limit of {max_bytes:,} bytes (the server's --max-upload-mb)")


def _check_heatmap(service: Service, heatmap: str) -> None:
    """422 for ``heatmap=url`` on a server without a results log (the URL would not exist)."""
    if heatmap == "url" and service.files is None:
        raise ServeError(422, "invalid_parameter", "heatmap=url needs the results log (the "
                         "server runs with --no-results); use heatmap=png")


async def _read_upload(request: Request, max_bytes: int
                       ) -> Tuple[bytes, Optional[str], Dict[str, str]]:
    """(bytes, file name, other form fields) of a raw-body or multipart single-image upload."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        try:
            data = await request.body()
        except ClientDisconnect:
            raise client_gone() from None
        _check_size(data, max_bytes)
        return data, None, {}
    form = await read_form(request, max_files=SINGLE_MAX_FILES, max_fields=SINGLE_MAX_FIELDS,
                           max_file_bytes=max_bytes)
    try:
        upload = next((v for _, v in form.multi_items() if isinstance(v, UploadFile)), None)
        if upload is None:
            raise ServeError(400, "empty_body", "the multipart request has no file part: "
                             "send the image as a file field (e.g. -F file=@part.png)")
        data = await upload.read()
        fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
        _check_size(data, max_bytes)
        return data, upload.filename, fields
    finally:
        await form.close()


def _field(fields: Dict[str, str], name: str, max_len: int) -> Optional[str]:
    """A form field's value (None when absent or empty; 422 when too long)."""
    value = fields.get(name)
    if value is None or value == "":
        return None
    if len(value) > max_len:
        raise ServeError(422, "invalid_parameter", f"form field {name!r} is longer than "
                         f"{max_len} characters")
    return value
