"""The drift monitor behind the inspection service's seam (``anomaly_hooks.serve.monitoring``):
``anomaly-hooks serve`` uses :func:`build_auto` by default (``--monitor auto``), i.e. this
monitor whenever the model file has a drift reference.

The service hands each scored batch over as an ``ObservedBatch``: the normalised network inputs
``[B, 3, h, w]``, the image scores ``[B]`` and each tapped layer's per-image channel means
``{layer: [B, C_l]}`` from the scoring pass's own hooks -- exactly the statistics the reference
was fitted on (no second forward pass). numpy only.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Optional

from anomaly_hooks.monitor.monitor import DriftMonitor
from anomaly_hooks.monitor.stats import block_statistics


class ServiceMonitor:
    """``observe(ObservedBatch)`` / ``status()`` around a :class:`DriftMonitor` of one model.

    ``status()`` is the monitor's (see :meth:`DriftMonitor.status`) plus what the service's
    page and metrics read: ``state`` (``warming up`` until a window is full, then ``ok`` or
    ``drift``), ``message`` (the one-line summary), ``model_id`` (the model whose reference is
    used; batches of another model -- after a reload -- are counted in ``ignored_batches``,
    not mixed in).
    """

    def __init__(self, monitor: DriftMonitor) -> None:
        self.monitor = monitor
        self._lock = threading.Lock()
        self.model_id: Optional[str] = None
        self.ignored_batches = 0

    def observe(self, batch: Any) -> None:
        with self._lock:
            if self.model_id is None:
                self.model_id = batch.model_id
            if batch.model_id != self.model_id:
                self.ignored_batches += 1
                return
        vectors: Dict[str, Any] = dict(batch.features or {})  # the layers' channel means
        vectors.update(block_statistics(None, batch.inputs, batch.mean, batch.std,
                                        blocks=self.monitor.reference.blocks,
                                        boxes=getattr(batch, "boxes", None)))
        self.monitor.update(vectors, batch.scores)

    def status(self) -> Dict[str, Any]:
        st = self.monitor.status()
        state = ("warming up" if st["images_seen"] < st["window"]
                 else "drift" if st["alarm"] else "ok")
        return {**st, "state": state, "message": self.monitor.summary(st),
                "model_id": self.model_id, "ignored_batches": self.ignored_batches}


def build(detector: Any) -> ServiceMonitor:
    """The service's drift monitor for ``detector`` (a loaded ``Detector``); raises
    ``NotFittedError`` when its model file has no drift reference."""
    return ServiceMonitor(DriftMonitor.from_detector(detector))


def build_auto(detector: Any) -> Optional[ServiceMonitor]:
    """:func:`build` when the model file has a drift reference, else None (no monitor)."""
    if getattr(detector, "drift_reference_", None) is None:
        return None
    return build(detector)
