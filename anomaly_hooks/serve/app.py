"""The ASGI app of the inspection service: :func:`create_app` puts together the
:class:`~anomaly_hooks.serve.service.Service`, the middleware (metrics, auth, body limit), the
JSON error handlers, the routers of :mod:`.routes`, the operator page's files and the API docs.

The API docs (``/docs``: Swagger UI, and ``/openapi.json``) load their scripts and styles from
this server (``/docs/assets``, the ``fastapi-offline`` package's copies), never from a CDN:
production lines are often air-gapped. (No ReDoc page: it fetches its logo from its CDN.)
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException

from anomaly_hooks import __version__
from anomaly_hooks.serve.errors import ServeError, code_for_status, results_unavailable
from anomaly_hooks.serve.middleware import (
    DOCS_ASSETS,
    AuthMiddleware,
    BodyLimitMiddleware,
    HeadLimitMiddleware,
    RequestMetricsMiddleware,
)
from anomaly_hooks.serve.results import ResultStore, StoreUnavailableError
from anomaly_hooks.serve.routes import ROUTERS
from anomaly_hooks.serve.routes.page import STATIC
from anomaly_hooks.serve.service import Service, error_text
from anomaly_hooks.serve.settings import ServeSettings

MULTIPART_SLACK = 64 * 1024  # multipart framing around the image bytes
ADMIN_BODY_LIMIT = 1 << 20   # a reload body is {"path": ...}, a label's {"label", "note"}
DESCRIPTION = """Visual anomaly detection over HTTP: score images (`/v1/predict`), query the
results log (`/v1/results`), watch the model and its drift (`/v1/model`, `/v1/drift`).

Every error answers `{"code", "status", "message"}`; the codes are listed under each status.
With a token (`--token`), every route but `/healthz` and `/readyz` needs
`Authorization: Bearer <token>` (a browser may send it as the Basic password); admin routes
answer only on a server with a token."""


def create_app(settings: ServeSettings, *, monitor: Any = None,
               store: Optional[ResultStore] = None,
               on_fatal: Optional[Callable[[str], None]] = None) -> FastAPI:
    """The ASGI app. ``monitor``: a drift-monitor object (see :mod:`.monitoring`); ``store``: a
    results store other than the default SQLite file; ``on_fatal(message)``: called when the
    model cannot be loaded at start (the CLI stops the server then)."""
    settings.validate()
    service = Service(settings, monitor=monitor, store=store, on_fatal=on_fatal)
    app = FastAPIOffline(title="anomaly_hooks inspection service", version=__version__,
                         description=DESCRIPTION, lifespan=service.lifespan,
                         docs_url="/docs", redoc_url=None, static_url=DOCS_ASSETS,
                         # no spec validator badge: Swagger UI would send the spec to its site
                         swagger_ui_parameters={"validatorUrl": None})
    app.state.service = service
    # last added = outermost
    app.add_middleware(BodyLimitMiddleware, limit_for=body_limits(settings))
    app.add_middleware(AuthMiddleware, token=settings.token)
    app.add_middleware(HeadLimitMiddleware)
    app.add_middleware(RequestMetricsMiddleware, metrics_getter=lambda: service.metrics)
    app.add_exception_handler(ServeError, _serve_error)
    app.add_exception_handler(StoreUnavailableError, _store_unavailable)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    for router in ROUTERS:
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def body_limits(settings: ServeSettings) -> Callable[[str], int]:
    """The request-body limit of each path (bytes)."""
    def limit_for(path: str) -> int:
        if path == "/v1/predict/batch" or (path.startswith("/v1/models/")
                                           and path.endswith("/predict/batch")):
            return settings.max_upload_bytes * settings.max_batch_files + MULTIPART_SLACK
        if path.startswith(("/v1/admin/", "/v1/results/")):  # a reload or a label: JSON
            return ADMIN_BODY_LIMIT
        return settings.max_upload_bytes + MULTIPART_SLACK
    return limit_for


async def _serve_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServeError)
    return JSONResponse(exc.as_dict(), status_code=exc.status, headers=exc.headers)


async def _store_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """503 ``results_unavailable`` for a read of the results log while it cannot be reached."""
    error = results_unavailable(exc)
    return JSONResponse(error.as_dict(), status_code=error.status, headers=error.headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 ``invalid_parameter`` naming each bad parameter (FastAPI's own body differs)."""
    assert isinstance(exc, RequestValidationError)
    parts = []
    for err in exc.errors():
        loc = err.get("loc", ()) or ("",)  # (where: query, path, body; the name, ...)
        name = ".".join(str(x) for x in loc[1:])
        parts.append(f"{loc[0]} parameter {name!r}: {err.get('msg')}")
    return JSONResponse({"code": "invalid_parameter", "status": 422,
                         "message": "; ".join(parts) or "invalid parameters"}, status_code=422)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """The framework's own errors (404 no route, 405 wrong method) in the service's body."""
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse({"code": code_for_status(exc.status_code), "status": exc.status_code,
                         "message": str(exc.detail)}, status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """Any other exception is a fault of the server: 500 ``internal_error`` in the service's
    JSON body, never the framework's plain text (the traceback goes to the log)."""
    return JSONResponse({"code": "internal_error", "status": 500,
                         "message": f"an unexpected error on the server: {error_text(exc)}"},
                        status_code=500)
