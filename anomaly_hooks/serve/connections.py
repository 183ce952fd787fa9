"""Who may hold a connection, and for how long, before sending a request.

uvicorn closes a keep-alive connection that idles after a response, but a *new* connection that
sends nothing, or trickles its request head a byte at a time, stays open for ever; and its only
connection bound (``limit_concurrency``) answers *every* request with a plain-text 503 once that
many connections are open, so a few hundred idle sockets take the whole service down. The
service's own HTTP protocol (:mod:`.protocol`) consults a :class:`ConnectionGuard` instead:

* a connection waiting for a request head (a new one, or one whose previous response is sent)
  is closed when that head is not complete ``header_timeout_s`` after it began to wait --
  trickled bytes do not extend it -- or when it sends nothing for ``idle_timeout_s``;
* a client address (an IPv6 /64 counts as one address: one host owns the whole prefix) holds at
  most ``max_per_client`` connections, and the server at most ``max_connections``. At either
  cap the connection that has waited longest for its request head is closed to make room: a
  client that sends its request promptly always gets in, however many idle connections
  others (or the same address) hold. Only when no connection is waiting -- every one is inside
  a request, whose body and processing the request timeout bounds -- is the new one refused.

Once its head is complete a request belongs to the app (its body: ``request_timeout_s``).
This module only counts (no uvicorn import); :mod:`.protocol` does the closing.
"""
from __future__ import annotations

import ipaddress
from collections import Counter
from typing import Dict, Optional, Protocol

CLOSE_REASONS = ("header_timeout", "idle_timeout", "evicted", "refused")


class Waiter(Protocol):
    """A connection as the guard sees it: something that can be closed."""

    def close_waiting(self, reason: str) -> None:
        """Close this connection, which is still waiting for a request head."""


def client_key(host: Optional[str]) -> Optional[str]:
    """The address a per-client cap counts by: the IP, an IPv6 address's /64 network, an
    IPv4-mapped IPv6 address as its IPv4 address; None for no address (a Unix socket)."""
    if not host:
        return None
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


class ConnectionGuard:
    """Counts the open connections by client and which of them wait for a request head; at a
    cap, closes the one that has waited longest (event-loop only)."""

    def __init__(self, *, header_timeout_s: float, idle_timeout_s: float,
                 max_connections: int, max_per_client: int) -> None:
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections      # 0: no cap
        self.max_per_client = max_per_client        # 0: no cap
        self._client: Dict[Waiter, Optional[str]] = {}
        self._per_client: Counter = Counter()
        # dicts keep insertion order: the first waiter is the one that has waited longest
        self._waiting: Dict[Waiter, None] = {}
        self.closed: Counter = Counter({reason: 0 for reason in CLOSE_REASONS})

    @property
    def open(self) -> int:
        """Connections open now."""
        return len(self._client)

    @property
    def waiting_count(self) -> int:
        """Connections waiting for a request head now."""
        return len(self._waiting)

    def admit(self, conn: Waiter, host: Optional[str]) -> bool:
        """Count a new connection (it waits for its first request head); False: refuse it (a
        cap is reached and every connection under it is inside a request)."""
        key = client_key(host)
        if (key is not None and self.max_per_client
                and self._per_client[key] >= self.max_per_client
                and not self._evict(key)):
            self.closed["refused"] += 1
            return False
        if (self.max_connections and self.open >= self.max_connections
                and not self._evict(None)):
            self.closed["refused"] += 1
            return False
        self._client[conn] = key
        self._per_client[key] += 1
        self._waiting[conn] = None
        return True

    def waiting(self, conn: Waiter) -> None:
        """``conn`` waits for a request head again (its previous response is sent)."""
        if conn in self._client:
            self._waiting.pop(conn, None)
            self._waiting[conn] = None  # now the newest waiter

    def active(self, conn: Waiter) -> None:
        """``conn`` has sent a complete request head."""
        self._waiting.pop(conn, None)

    def forget(self, conn: Waiter) -> None:
        """``conn`` is closed (idempotent)."""
        self._waiting.pop(conn, None)
        if conn in self._client:
            key = self._client.pop(conn)
            self._per_client[key] -= 1
            if self._per_client[key] <= 0:
                del self._per_client[key]

    def timed_out(self, conn: Waiter, reason: str) -> None:
        """``conn`` is being closed by one of its timeouts."""
        self.closed[reason] += 1
        self.forget(conn)

    def _evict(self, key: Optional[str]) -> bool:
        """Close the longest-waiting connection (of client ``key``, or of anyone for None);
        False when there is none."""
        victim = next((c for c in self._waiting if key is None or self._client.get(c) == key),
                      None)
        if victim is None:
            return False
        self.closed["evicted"] += 1
        self.forget(victim)
        victim.close_waiting("evicted")
        return True

    def stats(self) -> Dict[str, int]:
        """Open and waiting connections, and those closed so far by reason (for metrics)."""
        return {"open": self.open, "waiting": self.waiting_count, **self.closed}
