"""The uvicorn server that ``anomaly-hooks serve`` runs (:func:`build_server`):

* its HTTP/1.1 protocol, uvicorn's h11 protocol with the limits of
  :class:`~anomaly_hooks.serve.connections.ConnectionGuard` (header and idle timeouts,
  per-client and total connection caps) -- and no ``limit_concurrency``, which answers every
  request with a 503 once that many connections are open, idle ones included;
* request heads arriving in pieces of at most :data:`MAX_HEAD_BYTES` (a longer one: 400; one
  that arrives whole is refused by the app's middleware: 431);
* a shutdown that first tells the service to stop long work (a model reload hashing a big
  file), so that uvicorn's graceful wait for running requests is not spent waiting for it.

Only the CLI imports this module (it imports uvicorn, of the ``[serve]`` extra).
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import Any, Callable, List, Optional

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from anomaly_hooks.serve.connections import ConnectionGuard
from anomaly_hooks.serve.middleware import MAX_HEAD_BYTES

log = logging.getLogger("anomaly_hooks.serve")

FD_RESERVE = 256            # open files besides the connections: results log, pools, uploads

# what a refused connection reads (it may not have sent its request yet: the answer is ready)
_REFUSED_BODY = json.dumps({
    "code": "too_many_connections", "status": 503,
    "message": "this client (or the server) holds as many connections as it may, all of them "
               "busy with requests: retry later, or reuse a connection"}).encode()
REFUSED_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                    b"retry-after: 1\r\nconnection: close\r\n"
                    b"content-length: " + str(len(_REFUSED_BODY)).encode() + b"\r\n\r\n"
                    + _REFUSED_BODY)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol whose connections a :class:`ConnectionGuard` admits and times:
    a connection waiting for a request head has ``header_timeout_s`` to complete it and may
    not stay silent for ``idle_timeout_s`` (uvicorn's keep-alive timer, armed here for a new
    connection too: uvicorn arms it only after a first response)."""

    def __init__(self, config: Any, server_state: Any, app_state: dict,
                 _loop: Optional[asyncio.AbstractEventLoop] = None, *,
                 guard: ConnectionGuard) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.guard = guard
        self._head_timer: Optional[asyncio.TimerHandle] = None

    # -- the connection's life -------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self, self.client[0] if self.client else None):
            transport.write(REFUSED_RESPONSE)
            transport.close()
            return
        self._await_head()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_head_timer()
        self.guard.forget(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request head arrived: the request is the app's now
            self._cancel_head_timer()
            self.guard.active(self)

    def on_response_complete(self) -> None:
        answered = self.cycle
        super().on_response_complete()  # may start a pipelined request at once
        if self.cycle is answered and not self.transport.is_closing():
            self._await_head()

    # -- timers ----------------------------------------------------------------------------
    def _await_head(self) -> None:
        """Wait for the next request head, within the header timeout; silent for at most the
        idle timeout (any byte stops that timer; only a complete head stops the first)."""
        self.guard.waiting(self)
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.guard.header_timeout_s,
                                                self._close_timed_out, "header_timeout")
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.guard.idle_timeout_s, self.timeout_keep_alive_handler)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def timeout_keep_alive_handler(self) -> None:
        """The idle timeout (uvicorn's keep-alive timer): nothing sent while waiting."""
        if not self.transport.is_closing():
            self.guard.timed_out(self, "idle_timeout")
        super().timeout_keep_alive_handler()

    def _close_timed_out(self, reason: str) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.guard.timed_out(self, reason)
            self.transport.close()

    def close_waiting(self, reason: str) -> None:
        """Close at once (the guard makes room for a newer connection)."""
        self._cancel_head_timer()
        if not self.transport.is_closing():
            self.transport.close()


def protocol_factory(guard: ConnectionGuard) -> Callable[..., GuardedH11Protocol]:
    """uvicorn's ``http=``: the guarded protocol bound to ``guard``."""
    return functools.partial(GuardedH11Protocol, guard=guard)


class ServiceServer(uvicorn.Server):
    """uvicorn's server, calling ``before_shutdown()`` as soon as a shutdown begins."""

    def __init__(self, config: uvicorn.Config, before_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._before_shutdown = before_shutdown

    async def shutdown(self, sockets: Optional[List[Any]] = None) -> None:
        self._before_shutdown()
        await super().shutdown(sockets=sockets)


def build_server(app: Any, settings: Any, log_level: str) -> ServiceServer:
    """The uvicorn server of ``app`` (whose ``state.service`` is the running
    :class:`~anomaly_hooks.serve.service.Service`) with the connection limits of ``settings``."""
    service = app.state.service
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=log_level,
        access_log=log_level == "debug", server_header=False,
        http=protocol_factory(service.connections),  # type: ignore[arg-type]
        # no WebSocket routes: an upgrade would leave the guarded protocol, and its timers
        ws="none",
        timeout_keep_alive=settings.idle_timeout_s,  # type: ignore[arg-type]
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        timeout_graceful_shutdown=int(settings.request_timeout_s) + 5)
    return ServiceServer(config, before_shutdown=service.begin_shutdown)


def fit_open_files(settings: Any) -> None:
    """Raise this process's soft limit of open files so that ``max_connections`` fit (up to
    the hard limit); where they cannot, lower ``settings.max_connections`` (a server out of
    file descriptors stops accepting anyone) and say so. Call it before the app is built."""
    try:
        import resource
    except ImportError:  # not POSIX: the system decides
        return
    needed = settings.max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    except (ValueError, OSError):
        pass
    if settings.max_connections and soft < needed:
        settings.max_connections = max(1, soft - FD_RESERVE)
        log.warning("only %d open files allowed (ulimit -n): --max-connections lowered to %d",
                    soft, settings.max_connections)
