"""Shared pieces of the fuzz tests: reproducible Hypothesis settings and byte mutations of a
valid file (flip, set, cut, insert)."""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st


def fuzz_settings(max_examples: int) -> settings:
    """Reproducible (derandomised, no example database), no deadline, function-scoped fixtures
    allowed (each example writes its own files under the same tmp_path)."""
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


mutation = st.tuples(st.sampled_from(["flip", "cut", "insert", "set"]),
                     st.integers(0, 10**9), st.integers(0, 255))


def mutate(raw: bytes, ops) -> bytes:
    """``raw`` with each ``mutation`` applied in turn (positions wrap around the length)."""
    data = bytearray(raw)
    for op, pos, val in ops:
        pos %= max(1, len(data))
        if op == "flip" and data:
            data[pos] ^= val or 1
        elif op == "set" and data:
            data[pos] = val
        elif op == "cut":
            del data[pos:]
        else:
            data[pos:pos] = bytes([val]) * (1 + val % 16)
    return bytes(data)
