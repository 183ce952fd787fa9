"""Errors of the HTTP service: an HTTP status, a stable machine-readable ``code`` and a message
that says what was wrong. The JSON body of every error response is
``{"code": ..., "message": ..., "status": ...}``.

:data:`CODES` lists the stable codes (clients may switch on them) with their status and meaning;
the OpenAPI document (``/openapi.json``, ``/docs``) lists them under each error status.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from anomaly_hooks.errors import AnomalyHooksError

CODES = (
    (400, "empty_body", "the request carried no image bytes"),
    (400, "unreadable_image", "the bytes are of a supported type but cannot be decoded"),
    (400, "malformed_request", "broken multipart body, bad Content-Length, ..."),
    (401, "unauthorized", "missing or wrong bearer token"),
    (403, "admin_disabled", "admin routes answer only on a server with a token"),
    (403, "path_not_allowed", "a reload path outside the models folder"),
    (404, "not_found", "no such route, result or picture; or the results log is off"),
    (405, "method_not_allowed", "wrong HTTP method for the route"),
    (409, "reload_in_progress", "another model reload is running"),
    (409, "no_previous_version", "a rollback without an earlier version, or whose file is no "
     "longer in the models folder"),
    (409, "drift_unavailable", "the serving model cannot feed the drift monitor asked for (an "
     "ONNX export); the message says why"),
    (413, "payload_too_large", "the upload (or request body) exceeds the byte limit"),
    (413, "too_many_pixels", "the image exceeds the pixel limit (decompression-bomb guard)"),
    (413, "too_many_images", "more images in one batch request than allowed"),
    (415, "unsupported_media_type", "not PNG, JPEG, TIFF, BMP or WebP"),
    (431, "headers_too_large", "the request line and headers exceed 16 KiB"),
    (422, "invalid_parameter", "a path, query, form or body parameter is invalid"),
    (422, "reload_failed", "the new model file was refused; the old model keeps serving"),
    (500, "internal_error", "a fault of the server, never of the input"),
    (501, "not_implemented", "the results store of this server keeps no labels"),
    (503, "not_ready", "the model is not loaded (yet); Retry-After"),
    (503, "overloaded", "the bounded queue is full; Retry-After"),
    (503, "timeout", "the request took longer than the request timeout; Retry-After"),
    (503, "shutting_down", "the server is stopping"),
    (503, "results_unavailable", "the results log cannot be reached (its database server is "
     "down, or the SQLite file stays locked): the prediction was not acknowledged, or /readyz "
     "is not ready; Retry-After (the service reconnects by itself)"),
    (503, "too_many_connections", "this client (or the server) holds as many connections as "
     "it may, all busy; Retry-After"),
)


class ServeError(AnomalyHooksError, ValueError):
    """An error with its HTTP status, stable code and message (and optional headers). Like
    every error the library raises on purpose, an :class:`AnomalyHooksError`; the library's
    own errors met on the request path (an unreadable upload, a refused model file) are
    translated into one of these with the status that fits."""

    def __init__(self, status: int, code: str, message: str,
                 headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "status": self.status}

    def __repr__(self) -> str:
        return f"ServeError({self.status}, {self.code!r}, {self.message!r})"


def overloaded(message: str, retry_after: int) -> ServeError:
    return ServeError(503, "overloaded", message, {"Retry-After": str(max(1, int(retry_after)))})


def client_gone() -> ServeError:
    """The client went away before its request body was complete."""
    return ServeError(400, "malformed_request", "the client disconnected before the request "
                      "body was complete")


def not_ready(message: str, retry_after: int = 5) -> ServeError:
    return ServeError(503, "not_ready", message, {"Retry-After": str(max(1, int(retry_after)))})


# seconds a client is told to wait while the results log is unavailable (a restarting
# PostgreSQL server takes a few seconds of crash recovery)
RESULTS_RETRY_AFTER_S = 2


def results_unavailable(exc: Exception) -> ServeError:
    """503 ``results_unavailable``: the results log cannot be reached (``exc`` says why), so
    nothing is acknowledged."""
    return ServeError(503, "results_unavailable",
                      f"the results log is unavailable, the request was not recorded: {exc}; "
                      "retry later", {"Retry-After": str(RESULTS_RETRY_AFTER_S)})


def results_not_ready(reason: Any) -> ServeError:
    """503 ``results_unavailable`` of ``/readyz``: the results log cannot record now
    (``reason``), so predictions would be refused."""
    return ServeError(503, "results_unavailable",
                      f"not ready: the results log is unavailable, predictions would be "
                      f"refused: {reason}", {"Retry-After": str(RESULTS_RETRY_AFTER_S)})


STATUS_CODES = {400: "malformed_request", 401: "unauthorized", 403: "forbidden",
                404: "not_found", 405: "method_not_allowed", 409: "conflict",
                413: "payload_too_large", 415: "unsupported_media_type",
                422: "invalid_parameter", 503: "not_ready"}


def code_for_status(status: int) -> str:
    """The code used for framework-raised HTTP errors of a given status."""
    return STATUS_CODES.get(status, "internal_error" if status >= 500 else "http_error")
