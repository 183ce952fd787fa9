"""A decision threshold from good images only, and the normalised score.

Two rules, both from good images' scores (out of sample: the model did not see the image):

* ``threshold.false_alarm_rate`` set: a tail model fitted to the scores
  (:mod:`anomaly_hooks.calibration`) places the threshold at that exceedance probability; the
  model file records the tail, its parameters, a bootstrap interval of the false-alarm rate at
  the stored threshold, and the scores themselves (:meth:`Threshold.recalibrate`).
* ``false_alarm_rate: null``: ``threshold = q + margin * (q - median)`` where ``q`` is the
  ``quantile`` of the scores: a margin in units of the good scores' own spread.

``normalized_score = sigmoid((score - threshold) / scale)`` with
``scale`` the good scores' standard deviation: 0.5 at the threshold, in (0, 1).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import numpy as np

if TYPE_CHECKING:
    from anomaly_hooks.prediction import Verdict

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
    source: str = "holdout"  # all-images | holdout | folder: where the good scores came from
    false_alarm_rate: Optional[float] = None  # the rate asked for (None: quantile + margin)
    tail: Optional[str] = None  # the tail model fitted (calibration.TAILS)
    tail_params: Dict[str, float] = field(default_factory=dict)
    far_interval: Optional[List[float]] = None  # bootstrap 90 % interval of the false-alarm rate
    tail_gap: Optional[float] = None  # largest |empirical - fitted| exceedance, upper half
    scores: Optional[List[float]] = None  # the good scores (recalibration, reports)

    @classmethod
    def from_good_scores(cls, scores: Sequence[float], quantile: float,
                         margin: float) -> "Threshold":
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
        return cls(value=value, quantile=quantile, margin=margin, **_summary(arr, value))

    def recalibrate(self, false_alarm_rate: float, tail: Optional[str] = None) -> "Threshold":
        """The threshold for another false-alarm rate from the same stored good scores."""
        if not self.scores:
            raise ValueError("this threshold stored no good scores: refit to recalibrate")
        return from_tail(self.scores, false_alarm_rate, tail or self.tail or "gumbel_upper",
                         self.source)

    def describe(self) -> str:
        """Where the threshold came from, in words (printed by ``fit``)."""
        where = {"all-images": "every good image in the model, scored out of sample",
                 "holdout": "held-out good images", "folder": "threshold.folder"}
        text = where.get(self.source, self.source)
        if self.false_alarm_rate is None:
            return f"{text}; quantile {self.quantile:g} + margin {self.margin:g}"
        text += f"; {self.tail} tail at a {100 * self.false_alarm_rate:.3g} % false-alarm rate"
        if self.far_interval:
            lo, hi = self.far_interval
            text += f" (90 % interval {100 * lo:.2g}-{100 * hi:.2g} %)"
        return text

    def verdict(self, score: float, anomalous_pixels: Optional[int] = None) -> "Verdict":
        """The decision on one image score: ``is_anomalous = score > value``, the normalised
        score, this threshold; ``anomalous_pixels`` as counted on the full-size heatmap."""
        from anomaly_hooks.prediction import Verdict

        score = float(score)
        return Verdict(score=score, normalized_score=self.normalize(score),
                       is_anomalous=bool(score > self.value), threshold=float(self.value),
                       anomalous_pixels=anomalous_pixels)

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
        """Inverse of :meth:`as_dict` (fields added later take their defaults: older files),
        checked by :func:`anomaly_hooks.modelmeta.check_threshold` (finite, positive value and
        scale, ...): a :class:`~anomaly_hooks.modelmeta.MetadataError` naming the field
        otherwise."""
        from anomaly_hooks.modelmeta import check_threshold

        checked = check_threshold(data)
        return cls(**{k: checked[k] for k in cls.__dataclass_fields__ if k in checked})


def out_of_sample(thr_cfg: Any) -> bool:
    """Whether a fit with this ``threshold`` config section scores every training image out of
    sample (``mode=all-images`` and no separate ``folder`` of threshold images)."""
    return str(thr_cfg.mode) == "all-images" and not thr_cfg.folder


def _summary(arr: np.ndarray, value: float) -> Dict[str, Any]:
    spread = float(arr.std()) if arr.size > 1 else 0.0
    return {"scale": max(spread, 1e-3 * abs(value), 1e-12), "n_images": int(arr.size),
            "good_min": float(arr.min()), "good_median": float(np.median(arr)),
            "good_max": float(arr.max())}


def from_tail(scores: Sequence[float], false_alarm_rate: float, tail: str = "gumbel_upper",
              source: str = "all-images") -> Threshold:
    """The threshold at ``false_alarm_rate`` under ``tail`` fitted to good ``scores``."""
    from anomaly_hooks.calibration import far_interval, fit_tail, goodness_of_fit

    arr = np.asarray(scores, dtype=np.float64)
    fit = fit_tail(arr, false_alarm_rate, tail)
    lo, hi = far_interval(arr, fit.threshold, tail)
    return Threshold(value=fit.threshold, quantile=1.0 - false_alarm_rate, margin=0.0,
                     source=source, false_alarm_rate=false_alarm_rate, tail=tail,
                     tail_params=dict(fit.params), far_interval=[lo, hi],
                     tail_gap=goodness_of_fit(arr, fit), scores=[float(v) for v in arr],
                     **_summary(arr, fit.threshold))


def calibrate_threshold(scores: Sequence[float], cfg: Any, source: str) -> Threshold:
    """The threshold the config asks for (``cfg``: the ``threshold`` section) from good
    ``scores``: a tail model at ``false_alarm_rate``, or quantile + margin when it is null."""
    if cfg.false_alarm_rate is None:
        thr = Threshold.from_good_scores(scores, cfg.quantile, cfg.margin)
        return replace(thr, source=source, scores=[float(v) for v in scores])
    return from_tail(scores, float(cfg.false_alarm_rate), str(cfg.tail), source)
