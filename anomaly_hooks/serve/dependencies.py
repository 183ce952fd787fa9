"""FastAPI dependencies of the routes: the service, its serving model, its results log, and the
admin gate. Each raises the service's error (a JSON answer) when what it provides is missing."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from anomaly_hooks.serve.engine import ModelEngine
from anomaly_hooks.serve.errors import ServeError
from anomaly_hooks.serve.results import ResultStore
from anomaly_hooks.serve.service import Service
from anomaly_hooks.serve.settings import TOKEN_ENV
from anomaly_hooks.serve.slots import ModelSlot


def get_service(request: Request) -> Service:
    """The app's :class:`Service`."""
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]


def serving_engine(service: ServiceDep) -> ModelEngine:
    """The serving model; 503 ``not_ready`` while none is loaded."""
    return service.require_engine()


EngineDep = Annotated[ModelEngine, Depends(serving_engine)]


def named_slot(service: ServiceDep, name: Annotated[str, Path(
        max_length=64, description="the model's name (GET /v1/models)")]) -> ModelSlot:
    """The model ``name`` of ``/v1/models/{name}/...``; 404 ``not_found`` for another."""
    return service.slot(name)


SlotDep = Annotated[ModelSlot, Depends(named_slot)]


def result_store(service: ServiceDep) -> ResultStore:
    """The results log; 404 on a server without one."""
    if service.store is None:
        raise ServeError(404, "not_found", "the results log is disabled on this server "
                         "(--no-results)")
    return service.store


StoreDep = Annotated[ResultStore, Depends(result_store)]


def admin_enabled(service: ServiceDep) -> None:
    """Admin routes answer only on a server with a token (the auth middleware has checked it
    by then): without one, anyone who reaches the port could load files as the model."""
    if not service.settings.token:
        raise ServeError(403, "admin_disabled",
                         "admin routes are disabled on a server without a token: start it with "
                         f"--token (or the {TOKEN_ENV} environment variable) to enable them; "
                         "SIGHUP reloads the model file without one")
