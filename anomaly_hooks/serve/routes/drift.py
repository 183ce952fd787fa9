"""``GET /v1/drift``: the drift monitor's status (see :mod:`anomaly_hooks.serve.monitoring`)."""
from __future__ import annotations

from typing import Any, Dict

from fastapi import APIRouter

from anomaly_hooks.serve.dependencies import ServiceDep, SlotDep
from anomaly_hooks.serve.errors import ServeError
from anomaly_hooks.serve.schemas import DriftStatus, error_responses
from anomaly_hooks.serve.service import Service
from anomaly_hooks.serve.slots import ModelSlot

router = APIRouter(tags=["drift"])


@router.get("/v1/drift", response_model=DriftStatus, response_model_exclude_unset=True,
            summary="Drift monitor status", responses=error_responses(401, 409, 500))
async def drift(service: ServiceDep) -> Dict[str, Any]:
    """The monitor's ``status()`` as it returns it (plus ``enabled``), or ``{"enabled":
    false}`` on a server without a monitor (``--monitor none``). A 409 ``drift_unavailable``
    says why the serving model cannot feed the monitor asked for (an ONNX export: its graph
    gives no layer statistics). The default model's monitor; ``/v1/models/{name}/drift``
    another model's."""
    return await _status(service, service.default)


@router.get("/v1/models/{name}/drift", response_model=DriftStatus,
            response_model_exclude_unset=True, summary="One model's drift monitor status",
            responses=error_responses(401, 404, 409, 422, 500))
async def named_drift(service: ServiceDep, slot: SlotDep) -> Dict[str, Any]:
    """As ``GET /v1/drift``, for the model ``name`` (each model has its own monitor)."""
    return await _status(service, slot)


async def _status(service: Service, slot: ModelSlot) -> Dict[str, Any]:
    monitor = slot.monitor
    if monitor is None:
        reason = service.drift_unavailable_for(slot)
        if reason is not None:
            raise ServeError(409, "drift_unavailable", reason)
        return {"enabled": False}
    return await service.loop.run_in_executor(service.aux, monitor.status)
