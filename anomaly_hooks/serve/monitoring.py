"""The seam between the service and a drift monitor (``anomaly_hooks.monitor``, built apart).

A monitor is any object with

* ``observe(batch: ObservedBatch) -> None``: called once per inference batch, on a background
  thread of its own (never on the request path; while one call runs, newer batches are dropped
  and counted rather than queued, so a slow monitor cannot hold memory or slow requests);
* ``status() -> dict``: a JSON-serialisable summary. ``GET /v1/drift`` returns it as is (plus
  ``"enabled": true``); ``/metrics`` exports every numeric leaf as
  ``anomaly_hooks_drift{key="a.b.c"}`` (booleans as 0/1) and a string ``state`` as
  ``anomaly_hooks_drift_state{state="..."} 1``; the operator page shows ``state`` (``ok``,
  ``warning``, ``drift``, ...), ``message`` and the numeric leaves.

It is built by a factory ``module:callable`` (``anomaly-hooks serve --monitor module:callable``)
that the service calls with the loaded ``Detector``. Without one, ``/v1/drift`` says
``{"enabled": false}``.

Each :class:`ObservedBatch` carries, besides the inputs and scores, ``features``: each tapped
layer's per-image channel means ``{layer: [B, C_l]}``, taken by the scorer's own forward hooks in
the scoring pass (collected only while a monitor is configured). This interface is what a
monitor may rely on: fields are only ever added.
"""
from __future__ import annotations

import importlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np

from anomaly_hooks.errors import ConfigError

log = logging.getLogger("anomaly_hooks.serve")


@dataclass
class ObservedBatch:
    """What the service shows a monitor after each inference batch.

    Attributes:
        inputs: ``[B, 3, h, w]`` float32 network inputs (normalised with ``mean``/``std``;
            a torch tensor from the PyTorch engine, a numpy array from the ONNX one).
        scores: ``[B]`` raw image scores (higher = more anomalous).
        normalized_scores: ``[B]`` in (0, 1), 0.5 at the threshold.
        is_anomalous: ``[B]`` bool verdicts.
        threshold: the raw threshold of the model that scored the batch.
        model_id: that model's id (changes on reload).
        mean, std: the preprocessing's normalisation.
        timestamp: Unix seconds when the batch finished.
        features: per tapped layer, each image's channel means ``{layer: [B, C_l]}`` float32,
            recorded by the scorer's own forward hooks in the same pass (no second forward);
            None when the service was built without a monitor; empty from an engine that
            cannot tap its layers (the ONNX engine).
        boxes: ``[B, 2]`` int64, each image's own part of a tiled model's working frame
            (``(h, w)`` network pixels at the top-left; the rest of ``inputs`` is padding),
            None for an untiled model (the layer means above are over the boxes already).
    """

    inputs: Any
    scores: np.ndarray
    normalized_scores: np.ndarray
    is_anomalous: np.ndarray
    threshold: float
    model_id: str
    mean: Tuple[float, float, float]
    std: Tuple[float, float, float]
    timestamp: float
    features: Optional[Dict[str, np.ndarray]] = None
    boxes: Optional[np.ndarray] = None


AUTO_FACTORY = "anomaly_hooks.monitor.service:build_auto"  # None for a model without reference


def load_factory(spec: str):
    """``module:callable`` (or ``auto``: :data:`AUTO_FACTORY`) -> the callable (raises
    ConfigError with a clear message). A factory may return None: no monitor."""
    spec = AUTO_FACTORY if spec == "auto" else spec
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--monitor {spec!r}: give module:callable, e.g. "
                         "anomaly_hooks.monitor:create_monitor")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--monitor {spec!r}: cannot import {module_name} ({exc})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"--monitor {spec!r}: {module_name} has no callable {attr!r}")
    return factory


class MonitorRunner:
    """Feeds a monitor from the batcher without ever blocking it."""

    def __init__(self, monitor: Any) -> None:
        if not (callable(getattr(monitor, "observe", None))
                and callable(getattr(monitor, "status", None))):
            raise TypeError(f"{type(monitor).__name__} is not a drift monitor: it needs "
                            "observe(batch) and status() -> dict")
        self.monitor = monitor
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="drift-monitor")
        self._busy = threading.Lock()
        self.observed = 0

    def offer(self, make_batch: Callable[[], ObservedBatch]) -> bool:
        """Observe the batch ``make_batch()`` builds (on the monitor's thread), or drop it
        when the monitor is still busy with an earlier one. Returns False when dropped."""
        if not self._busy.acquire(blocking=False):
            return False
        self._pool.submit(self._observe, make_batch)
        return True

    def _observe(self, make_batch: Callable[[], ObservedBatch]) -> None:
        try:
            self.monitor.observe(make_batch())
            self.observed += 1
        # broad: a monitor is the user's code; whatever it raises is logged, and the next
        # batch is offered to it again
        except Exception:
            log.exception("drift monitor observe() failed")
        finally:
            self._busy.release()

    def status(self) -> Dict[str, Any]:
        try:
            status = dict(self.monitor.status())
        except Exception as exc:  # broad: the user's code; /v1/drift then says "error"
            log.exception("drift monitor status() failed")
            return {"enabled": True, "state": "error", "message": f"status() failed: {exc}"}
        status.setdefault("enabled", True)
        return status

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def numeric_leaves(data: Any, prefix: str = "") -> Iterator[Tuple[str, float]]:
    """(dotted key, value) for every int/float/bool leaf of nested dicts (lists by index)."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield from numeric_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(data, (list, tuple)):
        for i, value in enumerate(data):
            yield from numeric_leaves(value, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(data, (bool, int, float, np.integer, np.floating, np.bool_)):
        value = float(data)
        if np.isfinite(value):
            yield prefix, value


def observed_batch(engine: Any, tensors: Any, scores: np.ndarray, timestamp: float,
                   features: Optional[Dict[str, np.ndarray]] = None,
                   sizes: Optional[Sequence[Optional[Tuple[int, int]]]] = None
                   ) -> ObservedBatch:
    """The :class:`ObservedBatch` of one inference batch (built on the monitor's thread;
    ``inputs`` stacked by the engine: a torch tensor, or a numpy array on the ONNX engine;
    ``sizes``: each image's own (H, W), for a tiled model's boxes)."""
    inputs = engine.stack(list(tensors))
    thr = engine.detector.threshold_
    pre = engine.detector.preprocessor
    norm = np.array([thr.normalize(float(s)) for s in scores])
    return ObservedBatch(inputs=inputs, scores=np.asarray(scores, dtype=np.float64),
                         normalized_scores=norm, is_anomalous=np.asarray(scores) > thr.value,
                         threshold=float(thr.value), model_id=engine.model_id,
                         mean=tuple(pre.mean), std=tuple(pre.std), timestamp=timestamp,
                         features=features,
                         boxes=engine.boxes(sizes if sizes is not None
                                            else [None] * len(scores)))


def monitor_enabled(spec: Optional[str]) -> bool:
    """Whether ``--monitor`` names a factory (not empty and not ``none``)."""
    return bool(spec) and spec != "none"


def optional_monitor(spec: Optional[str], detector: Any) -> Optional[MonitorRunner]:
    if not monitor_enabled(spec):
        return None
    monitor = load_factory(spec)(detector)
    return MonitorRunner(monitor) if monitor is not None else None
