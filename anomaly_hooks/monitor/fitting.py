"""What the detector calls at fit, save and load time: the seam between ``Detector`` and the
drift monitor, so that detector.py holds no drift logic (numpy only)."""
from __future__ import annotations

import logging
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from anomaly_hooks.monitor.reference import MIN_REFERENCE_IMAGES, DriftReference
from anomaly_hooks.monitor.stats import StatisticsCollector

log = logging.getLogger(__name__)

META_KEY = "drift"  # the model file's metadata key of the reference (absent: no reference)
NO_REFERENCE = ("this model has no drift reference (saved before drift monitoring existed, or "
                "fitted with monitor.enabled=false): refit it with monitor.enabled=true (the "
                "default) to monitor drift")


def fit_collector(mon_cfg: Any, mean: Sequence[float], std: Sequence[float], seed: int
                  ) -> Optional[StatisticsCollector]:
    """The collector the fit pass feeds (every good image's layer outputs and input), or
    None when ``monitor.enabled`` is false."""
    if not mon_cfg.enabled:
        return None
    return StatisticsCollector(mean, std, max_images=mon_cfg.max_images, seed=seed)


def fit_reference(collector: Optional[StatisticsCollector], good_scores: Sequence[float],
                  mon_cfg: Any, seed: int) -> Optional[DriftReference]:
    """The calibrated reference from what ``collector`` saw and the out-of-sample good scores
    (the threshold images'), or None without a collector."""
    if collector is None:
        return None
    if collector.n_seen < MIN_REFERENCE_IMAGES:  # a tiny fit still works, without a monitor
        log.warning("no drift reference: %d good image(s) are too few (%d at least); this "
                    "model will have no drift monitor", collector.n_seen, MIN_REFERENCE_IMAGES)
        return None
    return DriftReference.fit(collector.vectors(), np.asarray(good_scores, dtype=np.float64),
                              window=mon_cfg.window, alpha=mon_cfg.alpha,
                              components=mon_cfg.components,
                              n_windows=mon_cfg.calibration_windows,
                              min_shift=mon_cfg.min_shift, seed=seed)


def update_reference(reference: Optional[DriftReference],
                     collector: Optional[StatisticsCollector], good_scores: Sequence[float],
                     mon_cfg: Any, seed: int) -> Optional[DriftReference]:
    """``reference`` with the images ``collector`` saw pooled in (a model update,
    :meth:`DriftReference.updated`) and its score block fitted again on ``good_scores``; None
    without a reference, unchanged without new statistics."""
    if reference is None or collector is None or collector.n_seen == 0:
        return reference
    return reference.updated(collector.vectors(), np.asarray(good_scores, dtype=np.float64),
                             n_windows=mon_cfg.calibration_windows, seed=seed)


def describe_update(before: Optional[DriftReference], after: Optional[DriftReference]) -> str:
    """One line saying what a model update did to the drift reference (``before`` and
    ``after`` the update): pooled the new images in, left it (no statistics of them), or
    none in the model."""
    if after is None:
        return ("drift reference: none in the model (refit with monitor.enabled=true to "
                "monitor drift)")
    if after is before:
        return "drift reference: unchanged (no statistics of the new images)"
    n_old, n_all = int(before.info.get("n_images", 0)), int(after.info.get("n_images", 0))
    scores = after.info.get("n_scores")
    score = (f", the score statistic recalibrated on {scores} out-of-sample scores"
             if scores is not None else "")
    return (f"drift reference: updated with {n_all - n_old} images ({n_all} in all; the layer "
            f"and input thresholds kept from the fit's calibration{score})")


def reference_state(reference: Optional[DriftReference]
                    ) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
    """float32 arrays (``drift.*``) and ``{META_KEY: ...}`` to merge into a model file's
    tensors and metadata; both empty without a reference."""
    if reference is None:
        return {}, {}
    tensors, meta = reference.state()
    return tensors, {META_KEY: meta}


def reference_from_saved(tensors: Mapping[str, Any], meta: Mapping[str, Any]
                         ) -> Optional[DriftReference]:
    """The reference stored in a model file, or None for a file without one (older files)."""
    if META_KEY not in meta:
        return None
    return DriftReference.from_state(tensors, meta[META_KEY])

