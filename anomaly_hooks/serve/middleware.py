"""ASGI middleware: request metrics (outermost), request-head size limit, bearer-token auth,
upload size limit."""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import time
from typing import Any, Callable, Optional

from anomaly_hooks.serve.errors import ServeError

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
# the request line and headers together; the server's HTTP parser refuses a longer head that
# arrives in pieces (400), this middleware one that arrived whole (431)
MAX_HEAD_BYTES = 16 * 1024
DOCS_ASSETS = "/docs/assets"  # the API docs' scripts and styles
# what a browser opens: their 401 asks for Basic credentials (the token as the password)
PAGE_PATHS = frozenset({"/", "/docs", "/docs/oauth2-redirect"})
PAGE_PREFIXES = ("/static/", DOCS_ASSETS + "/")
API_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/v1/model",
                       "/v1/predict", "/v1/predict/batch", "/v1/results", "/v1/results.csv",
                       "/v1/drift", "/v1/admin/reload", "/v1/models", "/v1/models/versions",
                       "/v1/admin/promote", "/v1/admin/rollback"})
# the routes of one model, /v1/models/{name}/... and /v1/admin/models/{name}/...: labelled by
# their template (the name is the client's: it never makes a label)
MODEL_TAILS = ("", "/predict", "/predict/batch", "/drift")
ADMIN_MODEL_TAILS = ("/reload",)


def endpoint_label(path: str) -> str:
    """A bounded set of labels for metrics (never the raw path: ids would explode them)."""
    if path in API_PATHS or path in PAGE_PATHS:
        return path
    if path.startswith("/v1/results/"):
        return "/v1/results/{id}"
    for prefix, tails in (("/v1/models/", MODEL_TAILS), ("/v1/admin/models/", ADMIN_MODEL_TAILS)):
        if path.startswith(prefix):
            rest = path[len(prefix):]
            name, _, tail = rest.partition("/")
            tail = "/" + tail if tail else ""
            if name and tail in tails:
                return f"{prefix}{{name}}{tail}"
            return "other"
    if path.startswith("/static/"):
        return "/static"
    if path.startswith(DOCS_ASSETS + "/"):
        return DOCS_ASSETS
    return "other"


async def send_json(send: Callable, status: int, body: dict, headers: Optional[dict] = None
                    ) -> None:
    raw = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw})


def _header(scope: dict, name: bytes) -> Optional[str]:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class RequestMetricsMiddleware:
    def __init__(self, app: Any, metrics_getter: Callable[[], Any]) -> None:
        self.app = app
        self.metrics_getter = metrics_getter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            metrics = self.metrics_getter()
            if metrics is not None:
                label = endpoint_label(scope.get("path", ""))
                metrics.requests.labels(label, str(status[0])).inc()
                metrics.latency.labels(label).observe(time.perf_counter() - start)


class HeadLimitMiddleware:
    """431 ``headers_too_large`` for a request whose line and headers exceed ``limit`` bytes:
    thousands of headers or a huge one never reach the routes."""

    def __init__(self, app: Any, limit: int = MAX_HEAD_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and head_bytes(scope) > self.limit:
            return await send_json(send, 431, {
                "code": "headers_too_large", "status": 431,
                "message": f"the request line and headers take more than {self.limit:,} "
                           "bytes"}, {"Connection": "close"})
        return await self.app(scope, receive, send)


def head_bytes(scope: dict) -> int:
    """The size of a request's line and headers as sent (``name: value`` lines)."""
    line = (len(scope.get("method", "")) + len(scope.get("raw_path") or b"")
            + len(scope.get("query_string") or b"") + 12)
    return line + sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))


class AuthMiddleware:
    """Bearer token on everything but the health probes (the page and the API docs included).

    ``Authorization: Bearer <token>`` for API clients; ``Basic`` with the token as the password
    (any user name) is accepted too, so that a browser can open the operator page: the page's
    401 asks for Basic credentials and the browser then sends them with every request it makes.
    """

    def __init__(self, app: Any, token: Optional[str]) -> None:
        self.app = app
        self.token = token.encode() if token else None

    def _ok(self, header: Optional[str]) -> bool:
        if not header or self.token is None:
            return False
        scheme, _, value = header.partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer":
            return hmac.compare_digest(value.encode(), self.token)
        if scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                return False
            _, _, password = decoded.partition(b":")
            return hmac.compare_digest(password, self.token)
        return False

    async def __call__(self, scope, receive, send):
        if (self.token is None or scope["type"] != "http"
                or scope.get("path") in OPEN_PATHS or scope.get("method") == "OPTIONS"):
            return await self.app(scope, receive, send)
        if self._ok(_header(scope, b"authorization")):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        page = path in PAGE_PATHS or path.startswith(PAGE_PREFIXES)
        challenge = ('Basic realm="anomaly-hooks", charset="UTF-8"' if page
                     else 'Bearer realm="anomaly-hooks"')
        given = _header(scope, b"authorization")
        message = ("wrong token" if given else
                   "this server needs a token: send 'Authorization: Bearer <token>'")
        await send_json(send, 401, {"code": "unauthorized", "message": message, "status": 401},
                        {"WWW-Authenticate": challenge})


class BodyLimitMiddleware:
    """Refuse request bodies over the limit with a 413: at once from Content-Length, else while
    reading (the endpoint then gets a 413 ServeError from ``receive``).

    Before answering, up to ``drain_cap`` further bytes of the refused body are read and
    discarded, for at most ``drain_timeout_s``, so that an HTTP client still sending its body
    can read the 413 (otherwise most clients see a broken connection instead of the answer);
    beyond that the connection is closed."""

    def __init__(self, app: Any, limit_for: Callable[[str], int],
                 drain_cap: int = 64 * 1024 * 1024, drain_timeout_s: float = 10.0) -> None:
        self.app = app
        self.limit_for = limit_for
        self.drain_cap = drain_cap
        self.drain_timeout_s = drain_timeout_s

    async def _drain(self, receive: Callable, already: int, limit: int) -> None:
        received = already
        while received <= limit + self.drain_cap:
            message = await receive()
            if message["type"] != "http.request":
                return
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope.get("path", ""))
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return await send_json(send, 400, {"code": "malformed_request", "status": 400,
                                                   "message": "bad Content-Length header"},
                                       {"Connection": "close"})
            if size > limit:
                if size <= limit + self.drain_cap:
                    # bounded in time too: a client may announce a body it never sends
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._drain(receive, 0, size),
                                               self.drain_timeout_s)
                return await send_json(send, 413, too_large(size, limit).as_dict(),
                                       {"Connection": "close"})
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    if message.get("more_body", False):
                        await self._drain(receive, received, limit)
                    raise too_large(received, limit, at_least=True)
            return message

        await self.app(scope, limited_receive, send)


def too_large(size: int, limit: int, at_least: bool = False) -> ServeError:
    what = f"more than {limit:,}" if at_least else f"{size:,}"
    return ServeError(413, "payload_too_large",
                      f"request body of {what} bytes exceeds the limit of {limit:,} bytes "
                      "(the server's --max-upload-mb)")
