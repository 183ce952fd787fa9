"""Who may hold a connection (connections.py): per-client and total caps, the longest-waiting
connection making room, refusal only when every connection is inside a request. The timeouts
and the protocol over real sockets: tests/test_serve_attacks.py."""
from __future__ import annotations

from typing import List

import pytest

from anomaly_hooks.serve.connections import ConnectionGuard, client_key


class Conn:
    """A connection as the guard sees it; records how it was closed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.closed: List[str] = []

    def close_waiting(self, reason: str) -> None:
        self.closed.append(reason)

    def __repr__(self) -> str:
        return self.name


def guard(total: int = 0, per_client: int = 0) -> ConnectionGuard:
    return ConnectionGuard(header_timeout_s=10, idle_timeout_s=5, max_connections=total,
                           max_per_client=per_client)


@pytest.mark.parametrize("host, key", [
    ("10.0.0.7", "10.0.0.7"), ("::ffff:10.0.0.7", "10.0.0.7"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"), ("2001:db8:1:2:ffff::9", "2001:db8:1:2::/64"),
    ("2001:db8:1:3::1", "2001:db8:1:3::/64"), (None, None), ("", None), ("unix", "unix")])
def test_client_key_groups_an_ipv6_64_as_one_client(host, key):
    assert client_key(host) == key


def test_a_client_at_its_cap_makes_room_by_closing_its_longest_waiting_connection():
    g = guard(per_client=2)
    a, b, c = Conn("a"), Conn("b"), Conn("c")
    other = Conn("other")
    assert g.admit(a, "10.0.0.1") and g.admit(b, "10.0.0.1") and g.admit(other, "10.0.0.2")
    assert g.admit(c, "10.0.0.1")  # a waited longest: closed for c
    assert a.closed == ["evicted"] and not b.closed and not other.closed
    assert g.stats() == {"open": 3, "waiting": 3, "header_timeout": 0, "idle_timeout": 0,
                         "evicted": 1, "refused": 0}


def test_connections_inside_a_request_are_never_closed_to_make_room():
    g = guard(per_client=2)
    a, b, c, d = (Conn(n) for n in "abcd")
    g.admit(a, "10.0.0.1")
    g.admit(b, "10.0.0.1")
    g.active(a)                    # its request head arrived
    assert g.admit(c, "10.0.0.1")  # b (waiting) makes room, not a
    assert b.closed == ["evicted"] and not a.closed
    g.active(c)
    assert not g.admit(d, "10.0.0.1")  # all busy: refused
    assert g.closed["refused"] == 1 and g.open == 2
    g.waiting(a)                   # a's response is sent: it waits again, as the newest
    g.admit(d, "10.0.0.1")
    assert a.closed == ["evicted"]


def test_the_total_cap_closes_the_longest_waiting_connection_of_anyone():
    g = guard(total=3, per_client=0)
    conns = [Conn(f"c{i}") for i in range(4)]
    for i, conn in enumerate(conns[:3]):
        assert g.admit(conn, f"10.0.0.{i}")
    g.waiting(conns[0])  # c0 waits again after a response: now the newest waiter
    assert g.admit(conns[3], "10.0.0.9")
    assert conns[1].closed == ["evicted"] and not conns[0].closed


def test_forget_and_timeouts_keep_the_counts():
    g = guard(per_client=1)
    a, b = Conn("a"), Conn("b")
    g.admit(a, "10.0.0.1")
    g.timed_out(a, "header_timeout")
    g.forget(a)  # the close that follows: counted once
    assert g.open == 0 and g.closed["header_timeout"] == 1
    assert g.admit(b, "10.0.0.1") and not b.closed
    g.forget(b)
    assert g.stats()["open"] == 0 and g.stats()["waiting"] == 0


def test_no_caps_admit_everyone_and_unix_sockets_have_no_client_cap():
    g = guard(total=0, per_client=1)
    assert all(g.admit(Conn(str(i)), None) for i in range(100))
    assert g.closed["evicted"] == 0
