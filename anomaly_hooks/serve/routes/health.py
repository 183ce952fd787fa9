"""Probes and metrics: ``/healthz`` and ``/readyz`` (open, no token: for orchestrators) and
``/metrics`` (Prometheus text format)."""
from __future__ import annotations

import time
from typing import Any, Dict

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from anomaly_hooks.serve.dependencies import EngineDep, ServiceDep
from anomaly_hooks.serve.schemas import Health, Ready, error_responses, media

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness",
            responses=error_responses(500))
async def healthz(service: ServiceDep) -> Dict[str, Any]:
    """The process answers (whether or not a model is loaded)."""
    return {"status": "ok", "uptime_s": round(time.time() - service.started, 1)}


@router.get("/readyz", response_model=Ready, summary="Readiness",
            responses=error_responses(500, 503))
async def readyz(engine: EngineDep) -> Dict[str, Any]:
    """A model is loaded and warm (503 ``not_ready`` while loading, or why it was refused)."""
    return {"ready": True, "model_id": engine.model_id}


@router.get("/metrics", response_class=Response, summary="Prometheus metrics",
            responses={**media(CONTENT_TYPE_LATEST.split(";")[0], "Prometheus text format"),
                       **error_responses(401, 500)})
async def metrics(service: ServiceDep) -> Response:
    """Requests, predictions, batches, the model and the drift monitor, for a scraper."""
    data = await service.loop.run_in_executor(service.aux, generate_latest,
                                              service.metrics.registry)
    return Response(data, media_type=CONTENT_TYPE_LATEST)
