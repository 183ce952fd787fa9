"""``GET /v1/drift``: the drift monitor's status (see :mod:`anomaly_hooks.serve.monitoring`)."""
from __future__ import annotations

from typing import Any, Dict

from fastapi import APIRouter

from anomaly_hooks.serve.dependencies import ServiceDep
from anomaly_hooks.serve.errors import ServeError
from anomaly_hooks.serve.schemas import DriftStatus, error_responses

router = APIRouter(tags=["drift"])


@router.get("/v1/drift", response_model=DriftStatus, response_model_exclude_unset=True,
            summary="Drift monitor status", responses=error_responses(401, 409, 500))
async def drift(service: ServiceDep) -> Dict[str, Any]:
    """The monitor's ``status()`` as it returns it (plus ``enabled``), or ``{"enabled":
    false}`` on a server without a monitor (``--monitor none``). A 409 ``drift_unavailable``
    says why the serving model cannot feed the monitor asked for (an ONNX export: its graph
    gives no layer statistics)."""
    monitor = service.monitor
    if monitor is None:
        reason = service.drift_unavailable
        if reason is not None:
            raise ServeError(409, "drift_unavailable", reason)
        return {"enabled": False}
    return await service.loop.run_in_executor(service.aux, monitor.status)
