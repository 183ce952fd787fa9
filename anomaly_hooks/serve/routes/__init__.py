"""The HTTP routes, one :class:`fastapi.APIRouter` per area (thin handlers over
:class:`~anomaly_hooks.serve.service.Service`, reached through :mod:`..dependencies`)."""
from __future__ import annotations

from anomaly_hooks.serve.routes import drift, health, model, page, predict, results, versions

# versions before model: /v1/models/versions is not a model named "versions"
ROUTERS = [health.router, predict.router, results.router, versions.router, model.router,
           drift.router, page.router]

__all__ = ["ROUTERS"]
