"""The results log: ``GET /v1/results`` (JSON pages), ``/v1/results.csv`` (everything that
matches, streamed), ``/v1/results/{id}`` and its stored pictures, and the operator's label
``POST /v1/results/{id}/label`` (an admin route: a server with a token only)."""
from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
from datetime import datetime, timezone
from typing import Annotated, Any, Dict, Iterator, Literal, Optional

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import FileResponse, StreamingResponse

from anomaly_hooks.errors import AnomalyHooksError
from anomaly_hooks.serve.dependencies import ServiceDep, StoreDep, admin_enabled
from anomaly_hooks.serve.errors import ServeError
from anomaly_hooks.serve.results import MAX_ID, PICTURES, Record, csv_lines
from anomaly_hooks.serve.schemas import (
    LabelRequest,
    ResultPage,
    ResultRecord,
    error_responses,
    media,
)

router = APIRouter(tags=["results"])
log = logging.getLogger("anomaly_hooks.serve")

TIME_HELP = "Unix seconds or ISO 8601 (2026-11-23T10:00:00Z; a time without zone is UTC)"
Since = Annotated[Optional[str], Query(max_length=64,
                                       description=f"from this time on; {TIME_HELP}")]
Until = Annotated[Optional[str], Query(max_length=64,
                                       description=f"before this time; {TIME_HELP}")]
Anomalous = Annotated[Optional[bool], Query(description="only anomalous (true) or normal (false)")]
PartId = Annotated[Optional[str], Query(max_length=200, description="only this part id")]
RecordId = Annotated[int, Path(ge=1, le=MAX_ID, description="the result's id")]
Label = Annotated[Optional[Literal["good", "defect", "none"]], Query(
    description="only results an operator labelled good, or defect; none: not labelled")]
Model = Annotated[Optional[str], Query(max_length=64, description="only the results of the "
                                       "model of this name (GET /v1/models)")]
_ERRORS = error_responses(401, 404, 422, 500, 503)


@router.get("/v1/results", response_model=ResultPage, summary="Query the results log",
            responses=_ERRORS)
async def results(service: ServiceDep, store: StoreDep, since: Since = None, until: Until = None,
                  anomalous: Anomalous = None, part_id: PartId = None,
                  before_id: Annotated[Optional[int], Query(
                      ge=1, le=MAX_ID, description="only ids below this (paging)")] = None,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                  label: Label = None, model: Model = None) -> Dict[str, Any]:
    """Newest first, at most ``limit``; ``next_before_id`` pages on."""
    f = _filters(since, until, anomalous, part_id, label, model)
    rows = await service.loop.run_in_executor(
        service.aux, functools.partial(store.query, before_id=before_id, limit=limit, **f))
    return {"count": len(rows), "results": [r.as_json() for r in rows],
            "next_before_id": rows[-1].id if len(rows) == limit else None}


@router.get("/v1/results.csv", response_class=StreamingResponse, summary="Export as CSV",
            responses={**media("text/csv", "every matching result, newest first"), **_ERRORS})
async def results_csv(service: ServiceDep, store: StoreDep, since: Since = None,
                      until: Until = None, anomalous: Anomalous = None, part_id: PartId = None,
                      limit: Annotated[Optional[int], Query(ge=1, le=MAX_ID)] = None,
                      label: Label = None, model: Model = None) -> StreamingResponse:
    """The same filters as ``/v1/results``; cells that a spreadsheet would run as a formula
    are neutralised. A log that cannot be read before the first rows are sent answers 503
    ``results_unavailable``; one that fails later aborts the transfer (the chunked body never
    ends), so a client never takes a cut export for a whole one."""
    rows = _Counted(store.iter_query(limit=limit, **_filters(since, until, anomalous, part_id,
                                                             label, model)))
    chunks = csv_lines(rows)
    # the header and the first rows before the answer starts: a log that cannot be read is
    # still a status code here
    first = await service.loop.run_in_executor(service.aux, next, chunks)
    return StreamingResponse(_cut_loudly(first, chunks, rows), media_type="text/csv; "
                             "charset=utf-8",
                             headers={"Content-Disposition": 'attachment; filename="results.csv"'})


class CsvExportCutError(AnomalyHooksError):
    """The results log failed after a CSV export had started: the transfer is aborted."""


class _Counted:
    """An iterator of records that counts what it gave."""

    def __init__(self, records: Iterator[Record]) -> None:
        self._records = records
        self.count = 0

    def __iter__(self) -> "_Counted":
        return self

    def __next__(self) -> Record:
        record = next(self._records)
        self.count += 1
        return record


def _cut_loudly(first: str, chunks: Iterator[str], rows: _Counted) -> Iterator[str]:
    """``first``, then the rest of ``chunks``. An error of the store once the answer has
    started is logged in one line and raised as :class:`CsvExportCutError`: the server then
    closes the connection without the chunked body's last chunk, so every HTTP client reports
    an incomplete download (raised as the store's own error, the framework would log a second
    traceback trying to answer it)."""
    yield first
    try:
        yield from chunks
    # broad: whatever stopped the store (unreachable, locked, a plug-in's error) cuts the file
    except Exception as exc:  # noqa: BLE001
        log.error("the CSV export was cut after %d rows had been read, the transfer is "
                  "aborted: %s", rows.count, exc)
        raise CsvExportCutError(f"the CSV export was cut after {rows.count} rows had been "
                                f"read: {exc}") from None


@router.get("/v1/results/{record_id}", response_model=ResultRecord, summary="One result",
            responses=_ERRORS)
async def result(service: ServiceDep, store: StoreDep, record_id: RecordId) -> Dict[str, Any]:
    rec = await service.loop.run_in_executor(service.aux, store.get, record_id)
    if rec is None:
        raise ServeError(404, "not_found", f"no result with id {record_id}")
    return rec.as_json()


@router.get("/v1/results/{record_id}/{picture}", response_class=FileResponse,
            summary="A stored picture of a result",
            responses={200: {"description": "the picture", "content": {
                "image/png": {"schema": {"type": "string", "format": "binary"}},
                "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
                "image/*": {"schema": {"type": "string", "format": "binary"}}}},
                **_ERRORS})
async def result_picture(service: ServiceDep, store: StoreDep, record_id: RecordId,
                         picture: Annotated[str, Path(
                             description=", ".join(PICTURES.values()))]) -> FileResponse:
    """The overlay or mask PNG (kept by ``--keep-images``), the thumbnail JPEG, or the
    original upload as sent (kept by ``--keep-originals``; its own format)."""
    kinds = {v: k for k, v in PICTURES.items()}
    if picture not in kinds:
        raise ServeError(404, "not_found", f"no picture {picture!r}: use one of "
                         f"{', '.join(PICTURES.values())}")
    rec = await service.loop.run_in_executor(service.aux, store.get, record_id)
    rel = getattr(rec, f"{kinds[picture]}_path", None) if rec else None
    path = service.files.resolve(rel) if (rel and service.files is not None) else None
    if path is None:
        raise ServeError(404, "not_found", f"result {record_id} has no stored {picture} "
                         "(not kept, or removed by retention)")
    return FileResponse(path, headers={"Cache-Control": "private, max-age=86400"})


@router.post("/v1/results/{record_id}/label", response_model=ResultRecord,
             summary="Label a result (admin)", dependencies=[Depends(admin_enabled)],
             responses=error_responses(400, 401, 403, 404, 413, 422, 500, 501))
async def label_result(service: ServiceDep, store: StoreDep, record_id: RecordId,
                       body: LabelRequest) -> Dict[str, Any]:
    """An operator's verdict on a result, ``good`` or ``defect``, with an optional note; it
    replaces an earlier label. Like the other admin routes it answers only on a server with a
    token; ``label_by`` is that token's fingerprint (never the token)."""
    assert service.recorder is not None  # there is a store: there is its writer
    try:  # on the writer thread, as every write of the log
        rec = await asyncio.wrap_future(service.recorder.call(
            store.set_label, record_id, body.label, body.note,
            token_fingerprint(service.settings.token)))
    except NotImplementedError as exc:
        raise ServeError(501, "not_implemented", f"this server's results store keeps no "
                         f"labels ({exc})") from None
    if rec is None:
        raise ServeError(404, "not_found", f"no result with id {record_id}")
    return rec.as_json()


def token_fingerprint(token: Optional[str]) -> str:
    """Who labels: ``token:`` and the first 12 hex digits of the token's SHA-256 (the token
    itself is never stored); ``anonymous`` without one (admin routes then answer 403)."""
    if not token:
        return "anonymous"
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:12]


def _filters(since: Optional[str], until: Optional[str], anomalous: Optional[bool],
             part_id: Optional[str], label: Optional[str] = None,
             model: Optional[str] = None) -> Dict[str, Any]:
    """The store's query filters of the routes' parameters (``label`` and ``model`` only when
    given: a store plug-in written before them takes no such filter)."""
    out: Dict[str, Any] = {"since": parse_time(since, "since"),
                           "until": parse_time(until, "until"), "anomalous": anomalous,
                           "part_id": part_id}
    if label is not None:
        out["label"] = label
    if model is not None:
        out["model"] = model
    return out


def parse_time(value: Optional[str], name: str) -> Optional[float]:
    """Unix seconds or ISO 8601 (``2026-11-23T10:00:00Z``; naive times are UTC) -> Unix
    seconds; 422 for anything else, NaN and infinities included."""
    if value is None or value == "":
        return None
    try:
        number: Optional[float] = float(value)
    except ValueError:
        number = None
    if number is not None:
        if not math.isfinite(number):
            raise ServeError(422, "invalid_parameter", f"{name}={value!r} is not a time")
        return number
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    if "T" in text and " " in text.split("T", 1)[1]:  # a '+' offset decoded as a space
        head, tail = text.split("T", 1)
        text = head + "T" + tail.replace(" ", "+")
    try:
        dt = datetime.fromisoformat(text)
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=timezone.utc)
        return dt.timestamp()
    except (ValueError, OverflowError):
        raise ServeError(422, "invalid_parameter",
                         f"{name}={value!r} is neither Unix seconds nor an ISO 8601 time "
                         "(e.g. 2026-11-23T10:00:00Z)") from None
