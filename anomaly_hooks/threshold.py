"""A decision threshold from good images only, and the normalised score.

``threshold = q + margin * (q - median)`` where ``q`` is the ``quantile`` of the held-out good
images' scores: a margin in units of the good scores' own spread, so it works on any score scale
and needs no defective image. ``normalized_score = sigmoid((score - threshold) / scale)`` with
``scale`` the good scores' standard deviation: 0.5 at the threshold, in (0, 1).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

# Good images whose scores spread less than this fraction of the median score (of 1 for
# scores below 1; PaDiM and PatchCore scores are distances of order 1 and more) are (near)
# copies of training images: their threshold says nothing about new parts.
MIN_RELATIVE_SPREAD = 1e-3


@dataclass(frozen=True)
class Threshold:
    """The fitted threshold and what it was computed from."""

    value: float
    scale: float
    quantile: float
    margin: float
    n_images: int
    good_min: float
    good_median: float
    good_max: float

    @classmethod
    def from_good_scores(cls, scores: Sequence[float], quantile: float, margin: float) -> "Threshold":
        """Compute from image scores of good images (at least one)."""
        arr = np.asarray(scores, dtype=np.float64)
        if arr.size == 0:
            raise ValueError("no good images to set the threshold from: set "
                             "threshold.holdout_fraction > 0 or threshold.folder")
        if not np.isfinite(arr).all():
            raise ValueError("non-finite scores among the threshold images")
        q = float(np.quantile(arr, quantile))
        med = float(np.median(arr))
        value = q + margin * (q - med)
        spread = float(arr.std()) if arr.size > 1 else 0.0
        if arr.size > 1 and spread <= MIN_RELATIVE_SPREAD * max(abs(med), 1.0):
            warnings.warn(
                f"the {arr.size} threshold images' scores hardly differ (spread {spread:.3g} "
                f"around {med:.4g}): they look like copies of the training images, so the "
                f"threshold {value:.4g} is not a measure of normal variation; use good images "
                "of other parts (threshold.folder) or more varied training images",
                UserWarning, stacklevel=2)
        scale = max(spread, 1e-3 * abs(value), 1e-12)
        return cls(value, scale, quantile, margin, int(arr.size), float(arr.min()), med,
                   float(arr.max()))

    def normalize(self, score: float) -> float:
        """Map a raw score to (0, 1); the threshold maps to 0.5."""
        z = (score - self.value) / self.scale
        if z >= 0:
            return 1.0 / (1.0 + math.exp(-min(z, 700.0)))
        e = math.exp(max(z, -700.0))
        return e / (1.0 + e)

    def as_dict(self) -> dict:
        """JSON-serialisable form (stored with the model)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Threshold":
        """Inverse of :meth:`as_dict`."""
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})
