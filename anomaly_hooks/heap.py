"""Freed host memory kept for reuse while a job runs on the CPU (glibc).

PyTorch allocates CPU tensors with the C library's ``malloc``. glibc serves every block above
its mmap threshold (adaptive, at most 32 MiB) with a fresh ``mmap`` and unmaps it when freed,
so a backbone whose activations are tens of MB each faults in new zeroed pages at every
batch: a PaDiM EfficientNet-Lite0 fit on 200 of visa_macaroni1's images took 1.5 million minor
page faults and 2.6 of its 9.2 CPU seconds in the kernel. :func:`keep_freed_memory` raises the
mmap and trim thresholds (to 1 GiB) while a job runs, so that freed blocks stay in the heap and
the next batch reuses them; when the last job ends it gives the free memory back
(``malloc_trim``) and sets the thresholds to where glibc's adaptive ones settle in such a
process (32 and 64 MiB; any ``mallopt`` ends the adaptation). ``benchmarks/bench_heap.py``,
fresh processes: that fit 4.0 s against 5.2 s, scoring 100 images 1.5 s against 1.9 s, the
same scores to the bit, a peak 6 % higher (2264 against 2138 MB) and less kept after the job
(1627 against 1805 MB); a PatchCore fit 22.3 against 25.5 s, its peak 16 % higher.
Transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``) did not help on the same machine, with or
without it (a fit 5.4 and 4.1 s).

``Detector.fit``, ``update``, ``recalibrate`` and the scoring calls of more than one batch
(``predict``, ``decision_function``, ``iter_predict``) run inside it, as do a Ray fit's shards
and passes on its workers and its merge on the driver; ``Detector.infer`` (the service's
batches) does not, but with ``--keep-heap`` the service holds one job from start to stop (a
WRN50 batch of 16 images 0.83 against 0.91 s, the peak RSS 12 % higher: opt-in). Jobs may
nest and overlap across threads: the thresholds go up with the first and down after the last.
Elsewhere than glibc (macOS, musl, Windows) it does nothing; ``ANOMALY_HOOKS_KEEP_HEAP=0`` in
the environment turns it off.
"""
from __future__ import annotations

import ctypes
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# what the thresholds return to: where glibc's adaptive threshold settles in a process that
# frees large blocks (its ceiling on 64-bit, and twice that for trimming), since setting
# either, as any mallopt does, ends the adaptation for the process
RESTORED_MMAP_THRESHOLD = 32 << 20
RESTORED_TRIM_THRESHOLD = 64 << 20
# the largest block kept in the heap: larger ones (a fit's sample store of thousands of
# images) still come from mmap, page by page, and leave at free
KEPT_BLOCK_BYTES = 1 << 30
ENV = "ANOMALY_HOOKS_KEEP_HEAP"

_lock = threading.Lock()
_depth = 0
_libc: Optional[Any] = None
_probed = False


def glibc() -> Optional[Any]:
    """The process's C library where it is glibc (``mallopt`` and ``malloc_trim``), else
    None."""
    global _libc, _probed
    if not _probed:
        _probed = True
        try:
            libc = ctypes.CDLL(None)
            libc.gnu_get_libc_version  # glibc only  # noqa: B018
            libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
            _libc = libc
        except (OSError, AttributeError, TypeError):
            _libc = None
    return _libc


def release_free_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``); False where
    there is no such call (a no-op there).

    The service calls it every few seconds after a batch: in its 10-minute soak, batches of
    varying size, allocated on the model thread and freed from others, left the server's RSS
    one step (~200 MB, 11 %) higher after 5 minutes and there it stayed (freed memory kept in
    glibc's per-thread arenas, not a leak)."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def enabled() -> bool:
    """Whether jobs keep freed memory: glibc, and not turned off by ``ANOMALY_HOOKS_KEEP_HEAP=0``
    (read at each job's start)."""
    return glibc() is not None and os.environ.get(ENV, "1").strip().lower() not in {
        "0", "false", "no", "off"}


def active() -> bool:
    """Whether a job is keeping freed memory now."""
    return _depth > 0


@contextmanager
def keep_freed_memory(when: bool = True) -> Iterator[None]:
    """Keep freed host memory in the heap while the block runs (see the module docstring);
    after the last running block, return it to the system. ``when`` False: nothing (a call
    of one batch, where nothing freed waits for a next batch and the trim at the end would
    cost the next call the blocks glibc keeps by itself: a single-image ``predict`` took 93
    against 89 ms inside it)."""
    global _depth
    if not (when and enabled()):
        yield
        return
    libc = glibc()
    with _lock:
        if _depth == 0:
            libc.mallopt(M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES)
            libc.mallopt(M_TRIM_THRESHOLD, KEPT_BLOCK_BYTES)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                libc.mallopt(M_MMAP_THRESHOLD, RESTORED_MMAP_THRESHOLD)
                libc.mallopt(M_TRIM_THRESHOLD, RESTORED_TRIM_THRESHOLD)
                release_free_memory()
