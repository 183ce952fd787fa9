"""Dynamic batching: concurrent requests are gathered into one backbone batch.

A single batcher task takes the first waiting job, then gathers more until ``max_batch`` jobs or
``max_wait`` seconds after the first, and runs the batch in the model thread (one batch at a time:
on a CPU a second concurrent batch would only compete for the same cores). Jobs wait in a bounded
queue; while a batch runs, the next one forms, so under load the model thread never waits.

``max_wait_s=None`` (the default of the service) adapts the wait to the model: 5 % of the time a
full batch takes (measured, a moving average), between 5 ms and 1 s. A fixed wait is either too
short for a slow CPU model (clients that get their answers together come back a few hundred ms
later and miss the next batch: the load splits into small, costlier batches that never merge
again) or pure added latency for a fast GPU model; 5 % of a batch bounds the added latency to 5 %
of the inference time while letting the returning clients join.

Each job carries the :class:`~anomaly_hooks.serve.engine.ModelEngine` that preprocessed it: a batch
only holds jobs of one engine, so requests admitted before a model reload finish on the old model
(same preprocessing, same threshold) and the new model takes the later ones.

:class:`Admission` bounds the number of images anywhere in the request path (being decoded,
waiting, in the running batch, being post-processed): a request that would exceed it gets a 503
with Retry-After before its body is read.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from anomaly_hooks.serve.errors import ServeError, overloaded

log = logging.getLogger("anomaly_hooks.serve")


@dataclass
class BatchInfo:
    """What the requests of one batch learn about it."""

    size: int
    started: float      # perf_counter at the start of inference
    seconds: float      # inference wall time


@dataclass
class Job:
    tensor: Any
    engine: Any
    future: "asyncio.Future[Any]"
    size: Optional[Tuple[int, int]] = None  # the image's own (H, W): where its padding is


class Admission:
    """A counter of images in the request path, with a hard limit (event-loop only)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def acquire(self, n: int, retry_after: Callable[[], int]) -> None:
        if self.used + n > self.limit:
            raise overloaded(f"the server is at its limit of {self.limit} images in progress "
                             f"({self.used} now; this request needs {n}): retry later",
                             retry_after())
        self.used += n

    def release(self, n: int) -> None:
        self.used = max(0, self.used - n)


class Batcher:
    """Gathers jobs into batches and runs them on ``executor`` (one thread)."""

    AUTO_WAIT_FRACTION = 0.05
    AUTO_WAIT_MIN_S = 0.005
    AUTO_WAIT_MAX_S = 1.0
    AUTO_WAIT_START_S = 0.025

    def __init__(self, *, max_batch: int, max_wait_s: Optional[float], max_queue: int,
                 executor: Executor,
                 on_batch: Optional[Callable[[Any, List[Job], Any, BatchInfo,
                                             Optional[Dict[str, Any]]], None]] = None,
                 collect_features: bool = False
                 ) -> None:
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.executor = executor
        self.on_batch = on_batch
        self.collect_features = collect_features
        self._items: Deque[Job] = collections.deque()
        self._wakeup: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self.running = 0            # jobs in the batch being computed
        self.batches = 0
        self.seconds_per_image = 0.0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        while self._items:
            job = self._items.popleft()
            if not job.future.done():
                job.future.set_exception(ServeError(503, "shutting_down",
                                                    "the server is shutting down"))

    # -- submitting ------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Jobs waiting for a batch (not counting the running one)."""
        return len(self._items)

    @property
    def wait_s(self) -> float:
        """The wait after a batch's first job (fixed, or adapted to the model's speed)."""
        if self.max_wait_s is not None:
            return self.max_wait_s
        if not self.seconds_per_image:
            return self.AUTO_WAIT_START_S
        full_batch = self.seconds_per_image * self.max_batch
        return min(self.AUTO_WAIT_MAX_S, max(self.AUTO_WAIT_MIN_S,
                                             self.AUTO_WAIT_FRACTION * full_batch))

    def retry_after(self) -> int:
        """Seconds after which the queue has likely drained (for Retry-After)."""
        waiting = self.depth + self.running
        per_image = self.seconds_per_image or 1.0
        return int(min(60, max(1, math.ceil(waiting * per_image))))

    def submit(self, tensor: Any, engine: Any, size: Optional[Tuple[int, int]] = None
               ) -> "asyncio.Future[Any]":
        """Queue one prepared image (``size``: its own (H, W)); the future gets ``(score,
        heatmap, BatchInfo)``."""
        if self._task is None or self._task.done():
            raise ServeError(503, "shutting_down", "the batcher is not running")
        if len(self._items) >= self.max_queue:
            raise overloaded(f"the inference queue is full ({self.max_queue} images)",
                             self.retry_after())
        fut = asyncio.get_running_loop().create_future()
        self._items.append(Job(tensor, engine, fut, size))
        assert self._wakeup is not None
        self._wakeup.set()
        return fut

    # -- the loop --------------------------------------------------------------------------
    async def _wait_for_items(self, timeout: Optional[float]) -> bool:
        assert self._wakeup is not None
        while not self._items:
            self._wakeup.clear()
            if timeout is None:
                await self._wakeup.wait()
            else:
                if timeout <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout)
                except asyncio.TimeoutError:
                    return bool(self._items)
        return True

    def _pop_live(self) -> Optional[Job]:
        while self._items:
            job = self._items.popleft()
            if not job.future.done():  # skip requests that timed out or disconnected
                return job
        return None

    async def _gather(self) -> List[Job]:
        loop = asyncio.get_running_loop()
        first = None
        while first is None:
            await self._wait_for_items(None)
            first = self._pop_live()
        batch = [first]
        deadline = loop.time() + self.wait_s
        while len(batch) < self.max_batch:
            if not self._items and not await self._wait_for_items(deadline - loop.time()):
                break
            job = self._items[0]
            if job.future.done():
                self._items.popleft()
                continue
            if job.engine is not first.engine:
                break  # a reload happened: this job and the later ones go in the next batch
            batch.append(self._items.popleft())
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._gather()
            engine = batch[0].engine
            self.running = len(batch)
            started = time.perf_counter()
            # the layers' channel means only when someone (a drift monitor) reads them
            features: Optional[Dict[str, Any]] = {} if self.collect_features else None
            extra: Dict[str, Any] = {} if features is None else {"features": features}
            if all(j.size is not None for j in batch):  # where each image's padding is
                extra["sizes"] = [j.size for j in batch]
            infer = functools.partial(engine.infer, **extra)
            try:
                scores, maps = await loop.run_in_executor(
                    self.executor, infer, [j.tensor for j in batch])
            except asyncio.CancelledError:
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(ServeError(503, "shutting_down",
                                                            "the server is shutting down"))
                raise
            # broad: whatever the model raises is a fault of the model, not of the inputs; its
            # requests get a 500 and the batcher goes on with the next batch
            except Exception as exc:
                log.exception("inference failed on a batch of %d", len(batch))
                err = ServeError(500, "internal_error",
                                 f"inference failed: {type(exc).__name__}: {exc}")
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(err)
                self.running = 0
                continue
            seconds = time.perf_counter() - started
            self.running = 0
            self.batches += 1
            per_image = seconds / len(batch)
            self.seconds_per_image = (per_image if not self.seconds_per_image
                                      else 0.8 * self.seconds_per_image + 0.2 * per_image)
            info = BatchInfo(len(batch), started, seconds)
            for i, job in enumerate(batch):
                if not job.future.done():
                    job.future.set_result((float(scores[i]), maps[i], info))
            if self.on_batch is not None:
                try:
                    self.on_batch(engine, batch, scores, info, features)
                except Exception:  # metrics/monitor must never stop the batcher
                    log.exception("batch callback failed")
