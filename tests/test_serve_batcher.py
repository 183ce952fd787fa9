"""Dynamic batching and admission (batcher.py), with a fake engine."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from anomaly_hooks.serve.batcher import Admission, Batcher
from anomaly_hooks.serve.errors import ServeError


class FakeEngine:
    """infer() records batch sizes; the first call can be held until released."""

    def __init__(self, name="e1", hold_first=False, fail=False):
        self.name = name
        self.batches = []
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self.fail = fail

    def infer(self, tensors):
        self.batches.append(len(tensors))
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("model exploded")
        values = np.array([float(t) for t in tensors])
        return values, torch.zeros(len(tensors), 2, 2)


def _run(coro):
    return asyncio.run(coro)


def test_batcher_gathers_waiting_requests_up_to_max_batch():
    async def main():
        eng = FakeEngine(hold_first=True)
        pool = ThreadPoolExecutor(1)
        b = Batcher(max_batch=4, max_wait_s=0.05, max_queue=64, executor=pool)
        b.start()
        first = b.submit(torch.tensor(0.0), eng)
        await asyncio.sleep(0.2)            # the first batch (of 1) is running and held
        rest = [b.submit(torch.tensor(float(i)), eng) for i in range(1, 10)]
        assert b.depth == 9
        eng.release.set()
        results = await asyncio.gather(first, *rest)
        await b.stop()
        return eng.batches, results

    batches, results = _run(main())
    assert batches == [1, 4, 4, 1]
    assert [r[0] for r in results] == [float(i) for i in range(10)]  # each gets its own row
    assert [r[2].size for r in results] == [1, 4, 4, 4, 4, 4, 4, 4, 4, 1]


def test_batcher_waits_max_wait_for_more():
    async def main():
        eng = FakeEngine()
        b = Batcher(max_batch=8, max_wait_s=0.3, max_queue=64, executor=ThreadPoolExecutor(1))
        b.start()
        a = b.submit(torch.tensor(1.0), eng)
        await asyncio.sleep(0.05)
        c = b.submit(torch.tensor(2.0), eng)
        await asyncio.gather(a, c)
        d = b.submit(torch.tensor(3.0), eng)   # alone: runs after max_wait
        started = time.perf_counter()
        await d
        waited = time.perf_counter() - started
        await b.stop()
        return eng.batches, waited

    batches, waited = _run(main())
    assert batches == [2, 1]
    assert 0.25 < waited < 5


def test_batcher_never_mixes_engines_and_skips_cancelled():
    async def main():
        old, new = FakeEngine("old", hold_first=True), FakeEngine("new")
        b = Batcher(max_batch=8, max_wait_s=0.05, max_queue=64, executor=ThreadPoolExecutor(1))
        b.start()
        first = b.submit(torch.tensor(0.0), old)
        await asyncio.sleep(0.2)
        jobs = [b.submit(torch.tensor(1.0), old), b.submit(torch.tensor(2.0), old),
                b.submit(torch.tensor(3.0), new), b.submit(torch.tensor(4.0), old)]
        cancelled = b.submit(torch.tensor(5.0), new)
        cancelled.cancel()
        old.release.set()
        await asyncio.gather(first, *jobs)
        await b.stop()
        return old.batches, new.batches

    old_batches, new_batches = _run(main())
    assert old_batches == [1, 2, 1] and new_batches == [1]


def test_batcher_full_queue_and_failing_model():
    async def main():
        eng = FakeEngine(hold_first=True)
        b = Batcher(max_batch=2, max_wait_s=0.0, max_queue=3, executor=ThreadPoolExecutor(1))
        b.start()
        running = b.submit(torch.tensor(0.0), eng)
        await asyncio.sleep(0.2)
        queued = [b.submit(torch.tensor(1.0), eng) for _ in range(3)]
        with pytest.raises(ServeError) as info:
            b.submit(torch.tensor(1.0), eng)
        assert info.value.status == 503 and info.value.code == "overloaded"
        assert int(info.value.headers["Retry-After"]) >= 1
        eng.release.set()
        await asyncio.gather(running, *queued)
        bad = FakeEngine(fail=True)
        with pytest.raises(ServeError) as info:
            await b.submit(torch.tensor(1.0), bad)
        assert info.value.status == 500 and "model exploded" in info.value.message
        assert (await b.submit(torch.tensor(7.0), eng))[0] == 7.0  # still running
        await b.stop()

    _run(main())


def test_admission_bounds_images_in_progress():
    adm = Admission(4)
    adm.acquire(3, lambda: 2)
    with pytest.raises(ServeError) as info:
        adm.acquire(2, lambda: 2)
    assert info.value.code == "overloaded" and info.value.headers["Retry-After"] == "2"
    adm.release(3)
    adm.acquire(4, lambda: 2)
