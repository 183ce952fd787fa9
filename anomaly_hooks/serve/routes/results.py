"""The results log: ``GET /v1/results`` (JSON pages), ``/v1/results.csv`` (everything that
matches, streamed), ``/v1/results/{id}`` and its stored pictures."""
from __future__ import annotations

import functools
import math
from datetime import datetime, timezone
from typing import Annotated, Any, Dict, Optional

from fastapi import APIRouter, Path, Query
from fastapi.responses import FileResponse, StreamingResponse

from anomaly_hooks.serve.dependencies import ServiceDep, StoreDep
from anomaly_hooks.serve.errors import ServeError
from anomaly_hooks.serve.results import MAX_ID, PICTURES, csv_lines
from anomaly_hooks.serve.schemas import ResultPage, ResultRecord, error_responses, media

router = APIRouter(tags=["results"])

TIME_HELP = "Unix seconds or ISO 8601 (2026-11-23T10:00:00Z; a time without zone is UTC)"
Since = Annotated[Optional[str], Query(max_length=64,
                                       description=f"from this time on; {TIME_HELP}")]
Until = Annotated[Optional[str], Query(max_length=64,
                                       description=f"before this time; {TIME_HELP}")]
Anomalous = Annotated[Optional[bool], Query(description="only anomalous (true) or normal (false)")]
PartId = Annotated[Optional[str], Query(max_length=200, description="only this part id")]
RecordId = Annotated[int, Path(ge=1, le=MAX_ID, description="the result's id")]
_ERRORS = error_responses(401, 404, 422, 500)


@router.get("/v1/results", response_model=ResultPage, summary="Query the results log",
            responses=_ERRORS)
async def results(service: ServiceDep, store: StoreDep, since: Since = None, until: Until = None,
                  anomalous: Anomalous = None, part_id: PartId = None,
                  before_id: Annotated[Optional[int], Query(
                      ge=1, le=MAX_ID, description="only ids below this (paging)")] = None,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> Dict[str, Any]:
    """Newest first, at most ``limit``; ``next_before_id`` pages on."""
    f = _filters(since, until, anomalous, part_id)
    rows = await service.loop.run_in_executor(
        service.aux, functools.partial(store.query, before_id=before_id, limit=limit, **f))
    return {"count": len(rows), "results": [r.as_json() for r in rows],
            "next_before_id": rows[-1].id if len(rows) == limit else None}


@router.get("/v1/results.csv", response_class=StreamingResponse, summary="Export as CSV",
            responses={**media("text/csv", "every matching result, newest first"), **_ERRORS})
async def results_csv(store: StoreDep, since: Since = None, until: Until = None,
                      anomalous: Anomalous = None, part_id: PartId = None,
                      limit: Annotated[Optional[int], Query(ge=1, le=MAX_ID)] = None
                      ) -> StreamingResponse:
    """The same filters as ``/v1/results``; cells that a spreadsheet would run as a formula
    are neutralised."""
    rows = store.iter_query(limit=limit, **_filters(since, until, anomalous, part_id))
    return StreamingResponse(csv_lines(rows), media_type="text/csv; charset=utf-8",
                             headers={"Content-Disposition": 'attachment; filename="results.csv"'})


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
                "image/jpeg": {"schema": {"type": "string", "format": "binary"}}}},
                **_ERRORS})
async def result_picture(service: ServiceDep, store: StoreDep, record_id: RecordId,
                         picture: Annotated[str, Path(
                             description=", ".join(PICTURES.values()))]) -> FileResponse:
    """The overlay or mask PNG (kept by ``--keep-images``) or the thumbnail JPEG."""
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


def _filters(since: Optional[str], until: Optional[str], anomalous: Optional[bool],
             part_id: Optional[str]) -> Dict[str, Any]:
    """The store's query filters of the routes' parameters."""
    return {"since": parse_time(since, "since"), "until": parse_time(until, "until"),
            "anomalous": anomalous, "part_id": part_id}


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
