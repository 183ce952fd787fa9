"""The verdict on one image and the prediction that carries it (torch-free: the ONNX runtime,
the service, ``score`` and the evaluation all build on these two records).

* :class:`Verdict`: the numbers a line acts on (score, normalised score, decision, threshold,
  anomalous pixels). ``Threshold.verdict`` makes it; the service's response, its results log,
  ``score``'s ``results.csv`` and the distributed score all take their verdict columns from
  :data:`VERDICT_FIELDS`.
* :class:`Prediction`: a verdict plus the heatmap and mask in the image's own frame.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional

import numpy as np


@dataclass
class Verdict:
    """The decision on one image. Scores: higher = more anomalous.

    Attributes:
        score: raw image score (max of the heatmap, or the method's re-weighted max).
        normalized_score: in (0, 1); the threshold maps to 0.5.
        is_anomalous: ``score > threshold``.
        threshold: the raw threshold used.
        anomalous_pixels: pixels of the full-size heatmap above the threshold (None where the
            heatmap was not made).
    """

    score: float
    normalized_score: float
    is_anomalous: bool
    threshold: float
    anomalous_pixels: Optional[int] = None

    def as_dict(self) -> Dict[str, Any]:
        """The verdict's fields as JSON-able values; a non-finite float becomes ``None`` (a
        strict JSON encoder refuses NaN and infinities)."""
        return {k: _finite_or_none(v) for k, v in asdict(self).items()}


VERDICT_FIELDS = [f.name for f in fields(Verdict)]


@dataclass
class Prediction(Verdict):
    """A :class:`Verdict` plus where: the heatmap and its thresholded mask.

    Attributes:
        heatmap: float32 ``[H, W]`` patch-score map in the frame of the input image.
        mask: bool ``[H, W]``, ``heatmap > threshold``.
    """

    heatmap: np.ndarray = None  # type: ignore[assignment]
    mask: np.ndarray = None  # type: ignore[assignment]

    @property
    def verdict(self) -> Verdict:
        """The verdict alone (no pictures)."""
        return Verdict(**{k: getattr(self, k) for k in VERDICT_FIELDS})


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
