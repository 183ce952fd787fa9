"""Probes and metrics: ``/healthz`` and ``/readyz`` (open, no token: for orchestrators) and
``/metrics`` (Prometheus text format)."""
from __future__ import annotations

import time
from typing import Any, Dict

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from anomaly_hooks.serve.dependencies import ServiceDep
from anomaly_hooks.serve.schemas import Health, Ready, error_responses, media

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness",
            responses=error_responses(500))
async def healthz(service: ServiceDep) -> Dict[str, Any]:
    """The process answers (whether or not a model is loaded)."""
    return {"status": "ok", "uptime_s": round(time.time() - service.started, 1)}


@router.get("/readyz", response_model=Ready, response_model_exclude_unset=True,
            summary="Readiness",
            responses=error_responses(500, 503))
async def readyz(service: ServiceDep) -> Dict[str, Any]:
    """Every model is loaded and warm (503 ``not_ready`` while one loads, or why it was
    refused) and the results log can record (503 ``results_unavailable`` and why, while it
    cannot: every prediction would be refused). ``/healthz`` stays 200 meanwhile."""
    engines = {name: service.require_engine(slot) for name, slot in service.slots.items()}
    await service.require_store()
    out: Dict[str, Any] = {"ready": True, "model_id": engines[service.default.name].model_id}
    if len(engines) > 1:
        out["models"] = {name: engine.model_id for name, engine in engines.items()}
    return out


@router.get("/metrics", response_class=Response, summary="Prometheus metrics",
            responses={**media(CONTENT_TYPE_LATEST.split(";")[0], "Prometheus text format"),
                       **error_responses(401, 500)})
async def metrics(service: ServiceDep) -> Response:
    """Requests, predictions, batches, the model and the drift monitor, for a scraper."""
    data = await service.loop.run_in_executor(service.aux, generate_latest,
                                              service.metrics.registry)
    return Response(data, media_type=CONTENT_TYPE_LATEST)
