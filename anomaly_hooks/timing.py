"""One timer and one peak-memory sampler for the whole toolkit: the fit's step timings, the
per-stage timings of :meth:`Detector.infer`, the sharded fit and every benchmark use these.

* :class:`Stopwatch` adds wall seconds to named steps. With a CUDA device it waits for the
  device before reading the clock, so queued GPU work is charged to the step that queued it.
* :class:`PeakMemory` samples the resident memory of this process from a thread (and reads the
  CUDA allocator's exact peak) during a ``with`` block.
* :func:`peak_rss_mb`: the process's peak RSS since it started (``VmHWM``).

torch is imported only when a CUDA device is given.
"""
from __future__ import annotations

import contextlib
import resource
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional


def _sync(device: Any) -> None:
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)


class Stopwatch:
    """Wall seconds per named step, in the order first seen.

    ``lap(name)`` charges the time since the previous mark to ``name``; ``step(name)`` is the
    same as a ``with`` block. ``device``: a ``torch.device`` whose queued work is waited for
    before each reading (CUDA; a no-op elsewhere).
    """

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self.seconds: Dict[str, float] = {}
        _sync(device)
        self.started = self._mark = time.perf_counter()

    def mark(self) -> float:
        """Restart the current lap (time until the next :meth:`lap` is charged from now)."""
        _sync(self.device)
        self._mark = time.perf_counter()
        return self._mark

    def lap(self, name: str) -> float:
        """Charge the seconds since the last mark to ``name``; returns them."""
        _sync(self.device)
        now = time.perf_counter()
        seconds = now - self._mark
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self._mark = now
        return seconds

    def add(self, name: str, seconds: float) -> None:
        """Charge ``seconds`` measured elsewhere to ``name``."""
        self.seconds[name] = self.seconds.get(name, 0.0) + float(seconds)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Charge the block's wall time to ``name``."""
        self.mark()
        yield
        self.lap(name)

    @property
    def total(self) -> float:
        """Seconds since construction (not synchronised)."""
        return time.perf_counter() - self.started

    def as_dict(self, *, total: bool = False) -> Dict[str, float]:
        """The steps' seconds; with ``total``, also the seconds from construction to the last
        mark (the sum of the laps, when every lap followed the one before)."""
        out = dict(self.seconds)
        if total:
            out["total"] = self._mark - self.started
        return out


class PeakMemory:
    """Peak memory during a ``with`` block, above the level at entry.

    ``peak_mb``: resident memory of this process, sampled every ``interval`` seconds by a
    thread (and once more at exit). ``gpu_peak_mb`` (CUDA ``device`` only): the allocator's
    exact peak of allocated memory minus what was allocated at entry. ``start_mb`` and
    ``peak_rss_mb`` are the absolute levels.
    """

    def __init__(self, device: Any = None, interval: float = 0.005) -> None:
        import psutil

        self.proc = psutil.Process()
        self.device = device
        self.interval = interval
        self.peak_mb = 0.0
        self.gpu_peak_mb: Optional[float] = None
        self._peak = self._base = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "PeakMemory":
        self._base = self._peak = self.proc.memory_info().rss
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        if getattr(self.device, "type", None) == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._gpu_base = torch.cuda.memory_allocated(self.device)
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self.proc.memory_info().rss)
            self._stop.wait(self.interval)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._peak = max(self._peak, self.proc.memory_info().rss)
        self.peak_mb = (self._peak - self._base) / 2**20
        if getattr(self.device, "type", None) == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
            self.gpu_peak_mb = (torch.cuda.max_memory_allocated(self.device)
                                - self._gpu_base) / 2**20

    @property
    def start_mb(self) -> float:
        return self._base / 2**20

    @property
    def peak_rss_mb(self) -> float:
        """The highest resident memory seen, absolute (MB)."""
        return max(self._peak, self._base) / 2**20


def peak_rss_mb() -> float:
    """This process's peak resident memory since it started, in MB (``VmHWM``: unlike
    ``ru_maxrss``, not inherited from the parent across ``exec``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass  # not Linux: ru_maxrss (kB on Linux and BSD, bytes on macOS; close enough here)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
