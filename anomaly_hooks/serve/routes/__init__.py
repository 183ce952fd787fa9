"""The HTTP routes, one :class:`fastapi.APIRouter` per area (thin handlers over
:class:`~anomaly_hooks.serve.service.Service`, reached through :mod:`..dependencies`)."""
from __future__ import annotations

from anomaly_hooks.serve.routes import drift, health, model, page, predict, results, versions

ROUTERS = [health.router, predict.router, results.router, model.router, versions.router,
           drift.router, page.router]

__all__ = ["ROUTERS"]
