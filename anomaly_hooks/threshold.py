"""The decision threshold, what it was chosen from, and the normalised score.

Good images' scores (out of sample: the model did not see the image or its group) and,
optionally, labelled defects' scores give the threshold (``threshold.objective``):

* ``far`` with ``threshold.false_alarm_rate`` set: the finite-sample rule or a tail model
  (:mod:`anomaly_hooks.calibration`) places the threshold at that rate; with
  ``false_alarm_rate: null``: ``threshold = q + margin * (q - median)`` where ``q`` is the
  ``quantile`` of the scores: a margin in units of the good scores' own spread.
* ``f1`` / ``recall``: an operating point from the labelled defects
  (:mod:`anomaly_hooks.operating`).

The model file records the rule, the expected false-alarm rate and recall with their 90 %
intervals, the smallest rate the good images support, the scores themselves (recalibration
without refit: :meth:`Threshold.recalibrate`, ``anomaly-hooks threshold``) and the provenance:
which images, which objective, which model it was recalibrated from. Every field added after
the first model files is optional: older files load with the defaults.

``normalized_score = sigmoid((score - threshold) / scale)`` with
``scale`` the good scores' standard deviation: 0.5 at the threshold, in (0, 1).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import numpy as np

from anomaly_hooks.errors import FitError

if TYPE_CHECKING:
    from anomaly_hooks.operating import OperatingPoint
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
    source: str = "holdout"  # all-images | holdout | folder | images: the good scores' origin
    false_alarm_rate: Optional[float] = None  # the rate asked for (None: quantile + margin)
    tail: Optional[str] = None  # the tail model fitted (calibration.TAILS)
    tail_params: Dict[str, float] = field(default_factory=dict)
    # 90 % interval of the false-alarm rate: Clopper-Pearson on the good scores above the
    # threshold (far_interval_method); files before it hold the tail bootstrap's here
    far_interval: Optional[List[float]] = None
    tail_gap: Optional[float] = None  # largest |empirical - fitted| exceedance, upper half
    scores: Optional[List[float]] = None  # the good scores (recalibration, reports)
    objective: str = "far"  # far | f1 | recall (operating.OBJECTIVES)
    expected_far: Optional[float] = None  # the rule's estimate (far: the rate asked for)
    far_interval_method: Optional[str] = None  # clopper-pearson (None: older files' bootstrap)
    tail_far_interval: Optional[List[float]] = None  # tail models: the bootstrap interval
    supported_rate: Optional[float] = None  # 1 / (n + 1): below it the rate is extrapolated
    recall: Optional[float] = None  # on the labelled defects, when there were any
    recall_interval: Optional[List[float]] = None  # Clopper-Pearson 90 %
    n_defects: Optional[int] = None
    defect_scores: Optional[List[float]] = None
    target_recall: Optional[float] = None  # objective recall
    prevalence: Optional[float] = None  # objective f1: the share of defective parts used
    # whether that share was given (threshold.prevalence, --prevalence): a recalibration keeps
    # a given share and derives "the labelled images as given" again from its own images
    prevalence_given: Optional[bool] = None
    provenance: Optional[Dict[str, Any]] = None  # which images, which objective, parent model

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

    def recalibrate(self, false_alarm_rate: Optional[float] = None, tail: Optional[str] = None,
                    *, objective: Optional[str] = None, target_recall: Optional[float] = None,
                    prevalence: Optional[float] = None,
                    good_scores: Optional[Sequence[float]] = None,
                    defect_scores: Optional[Sequence[float]] = None,
                    source: Optional[str] = None,
                    provenance: Optional[Dict[str, Any]] = None) -> "Threshold":
        """Another threshold from scores, without refitting the model: by default the stored
        good (out-of-sample) and defect scores, the stored objective and its settings.

        Args:
            false_alarm_rate: objective ``far``'s rate (given alone: objective ``far``).
            tail: the rule for ``far`` (default ``auto``).
            objective: ``far``, ``f1`` or ``recall`` (:mod:`anomaly_hooks.operating`).
            prevalence: objective ``f1``'s share of defective parts. Default: the stored share
                where it was given, else the labelled images as given, ``m / (n + m)`` of the
                scores this choice uses (not the stored share derived from other images).
            good_scores / defect_scores: scores of other good / labelled defective images, as
                the fitted model gives them (``Detector.decision_function``); good images
                scored by the fitted model must not be training images.
            source: where ``good_scores`` came from (default ``images``).
        """
        good = self.scores if good_scores is None else list(good_scores)
        if not good:
            raise ValueError("this threshold stored no good scores: give good_scores or refit "
                             "to recalibrate")
        if objective is None:
            objective = "far" if false_alarm_rate is not None else self.objective
        cfg = SimpleNamespace(
            objective=objective, tail=tail or "auto", quantile=self.quantile,
            margin=self.margin,
            false_alarm_rate=(false_alarm_rate if false_alarm_rate is not None
                              else self.false_alarm_rate if self.false_alarm_rate is not None
                              else 0.01),
            target_recall=target_recall if target_recall is not None else self.target_recall,
            prevalence=prevalence if prevalence is not None else (
                self.prevalence if objective == self.objective == "f1" and self.prevalence_given
                else None))
        defects = self.defect_scores if defect_scores is None else list(defect_scores)
        src = self.source if good_scores is None else (source or "images")
        return calibrate_threshold(good, cfg, src, defects=defects or None,
                                   provenance=provenance or self.provenance)

    def trade_off(self, tail: str = "auto") -> List["OperatingPoint"]:
        """The operating points of other thresholds from the stored scores
        (:func:`anomaly_hooks.operating.trade_off`), this one marked ``chosen``; its F1-max
        row at this threshold's ``prevalence`` where objective ``f1`` recorded one (the share
        the chosen point was optimised for), else the labelled images as given."""
        from anomaly_hooks.operating import ScoreSets, trade_off

        if not self.scores:
            raise ValueError("this threshold stored no good scores: refit to see its "
                             "trade-off")
        sets = ScoreSets(self.scores, self.defect_scores)
        chosen = sets.point(self.value, f"chosen ({self.objective})",
                            expected_far=self.expected_far)
        prevalence = self.prevalence if self.objective == "f1" else None
        return trade_off(sets, chosen, tail, prevalence)

    def describe(self) -> str:
        """Where the threshold came from, in words (printed by ``fit``)."""
        where = {"all-images": "every good image in the model, scored out of sample",
                 "holdout": "held-out good images", "folder": "threshold.folder",
                 "images": "good images given for recalibration"}
        text = where.get(self.source, self.source)
        if self.objective != "far":
            goal = (f"F1-max at {100 * self.prevalence:.3g} % defective"
                    if self.objective == "f1" and self.prevalence is not None else
                    f"recall {self.target_recall:g}" if self.objective == "recall" else "F1-max")
            text += f" and {self.n_defects} labelled defects; objective {goal}"
        elif self.false_alarm_rate is None:
            text += f"; quantile {self.quantile:g} + margin {self.margin:g}"
        else:
            text += f"; {self.tail} at a {100 * self.false_alarm_rate:.3g} % false-alarm rate"
        return text + self._rates()

    def _rates(self) -> str:
        """The expected false-alarm rate and recall with their intervals, in words."""
        out = ""
        if self.far_interval:
            lo, hi = self.far_interval
            kind = ("Clopper-Pearson" if self.far_interval_method == "clopper-pearson"
                    else "bootstrap")
            far = "" if self.expected_far is None else f"{100 * self.expected_far:.3g} %, "
            out += f"; false alarms {far}90 % {kind} interval {100 * lo:.3g}-{100 * hi:.3g} %"
        if self.recall is not None and self.recall_interval:
            lo, hi = self.recall_interval
            out += (f"; recall {100 * self.recall:.3g} % on {self.n_defects} defects "
                    f"(90 % interval {100 * lo:.3g}-{100 * hi:.3g} %)")
        return out

    def extrapolated(self) -> bool:
        """Whether the stated rate is below what the good images support (a tail model's
        extrapolation, not a finite-sample guarantee)."""
        return (self.objective == "far" and self.false_alarm_rate is not None
                and self.supported_rate is not None
                and self.false_alarm_rate < self.supported_rate * (1 - 1e-9))

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


def from_tail(scores: Sequence[float], false_alarm_rate: float, tail: str = "auto",
              source: str = "all-images") -> Threshold:
    """The threshold at ``false_alarm_rate`` under ``tail`` fitted to good ``scores``
    (``auto``: the finite-sample rule where the scores support the rate, else the Gumbel
    tail), with its Clopper-Pearson interval and, for tail models, the bootstrap one."""
    from anomaly_hooks.calibration import (
        clopper_pearson,
        far_interval,
        fit_tail,
        goodness_of_fit,
        resolve_tail,
        supported_rate,
    )

    arr = np.asarray(scores, dtype=np.float64)
    fit = fit_tail(arr, false_alarm_rate, resolve_tail(tail, arr.size, false_alarm_rate))
    tail = fit.name  # the rule used (auto resolved)
    boot = None
    if tail in ("gumbel", "gumbel_upper"):
        boot = list(far_interval(arr, fit.threshold, tail))
    return Threshold(value=fit.threshold, quantile=1.0 - false_alarm_rate, margin=0.0,
                     source=source, false_alarm_rate=false_alarm_rate, tail=tail,
                     tail_params=dict(fit.params),
                     far_interval=list(clopper_pearson(int((arr > fit.threshold).sum()),
                                                       arr.size)),
                     far_interval_method="clopper-pearson", tail_far_interval=boot,
                     expected_far=false_alarm_rate, supported_rate=supported_rate(arr.size),
                     tail_gap=goodness_of_fit(arr, fit), scores=[float(v) for v in arr],
                     **_summary(arr, fit.threshold))


def with_operating_point(thr: Threshold, defects: Optional[Sequence[float]],
                         **fields: Any) -> Threshold:
    """``thr`` with the recall of its value on the ``defects`` scores (and their 90 %
    Clopper-Pearson interval) and the other ``fields`` replaced."""
    from anomaly_hooks.calibration import clopper_pearson

    if defects is not None and len(defects):
        d = np.asarray(defects, dtype=np.float64)
        caught = int((d > thr.value).sum())
        fields.update(recall=caught / d.size, recall_interval=list(clopper_pearson(caught, d.size)),
                      n_defects=int(d.size), defect_scores=[float(v) for v in d])
    return replace(thr, **fields)


def calibrate_threshold(scores: Sequence[float], cfg: Any, source: str,
                        defects: Optional[Sequence[float]] = None,
                        provenance: Optional[Dict[str, Any]] = None) -> Threshold:
    """The threshold the config asks for (``cfg``: the ``threshold`` section) from good
    ``scores`` and, for the objectives ``f1`` and ``recall`` (or to record a recall), labelled
    ``defects`` scores. Warns where the good images are too few for the asked rate."""
    from anomaly_hooks.calibration import clopper_pearson, supported_rate

    objective = str(getattr(cfg, "objective", "far"))
    arr = np.asarray(scores, dtype=np.float64)
    if objective != "far":
        thr = operating_threshold(arr, defects, objective, cfg, source)
    elif cfg.false_alarm_rate is None:
        thr = Threshold.from_good_scores(arr, cfg.quantile, cfg.margin)
        k = int((arr > thr.value).sum())
        thr = replace(thr, source=source, scores=[float(v) for v in arr],
                      far_interval=list(clopper_pearson(k, arr.size)),
                      far_interval_method="clopper-pearson", expected_far=k / arr.size,
                      supported_rate=supported_rate(arr.size))
    else:
        thr = from_tail(arr, float(cfg.false_alarm_rate), str(cfg.tail), source)
    thr = with_operating_point(thr, defects, objective=objective, provenance=provenance)
    if not (math.isfinite(thr.value) and thr.value > 0):
        # a model file refuses it (modelmeta.check_threshold): a threshold <= 0 flags every
        # part that is not a copy of training patches
        raise FitError(f"the good images' scores (min {arr.min():.4g}, median "
                       f"{np.median(arr):.4g}) give a threshold of {thr.value:.4g}, which would "
                       "flag every part: the good images look like copies of the training "
                       "images; use good images of other parts (threshold.folder) or, with "
                       "threshold.false_alarm_rate: null, a smaller threshold.margin")
    if thr.extrapolated():
        warnings.warn(
            f"{thr.n_images} good images support false-alarm rates down to "
            f"{100 * thr.supported_rate:.2g} % (1 / (n + 1)); the threshold for "
            f"{100 * thr.false_alarm_rate:.3g} % is the {thr.tail} tail's extrapolation, and "
            f"what the images themselves show is a rate of at most "
            f"{100 * thr.far_interval[1]:.2g} % (90 % interval). Add good images (at least "
            f"{math.ceil(1 / thr.false_alarm_rate) - 1}) to certify "
            f"{100 * thr.false_alarm_rate:.3g} %", UserWarning, stacklevel=2)
    return thr


def operating_threshold(good: np.ndarray, defects: Optional[Sequence[float]], objective: str,
                        cfg: Any, source: str) -> Threshold:
    """The threshold of objective ``f1`` or ``recall`` (:mod:`anomaly_hooks.operating`)."""
    from anomaly_hooks.calibration import supported_rate
    from anomaly_hooks.operating import (
        ScoreSets,
        choose_f1,
        choose_recall,
        warn_if_most_good_flagged,
    )

    sets = ScoreSets(good, defects)
    if objective == "f1":
        value = choose_f1(sets, getattr(cfg, "prevalence", None))
        given = getattr(cfg, "prevalence", None) is not None
        prevalence = float(cfg.prevalence) if given else sets.m / (sets.n + sets.m)
        extra: Dict[str, Any] = {"prevalence": prevalence, "prevalence_given": given}
    elif objective == "recall":
        if getattr(cfg, "target_recall", None) is None:
            from anomaly_hooks.errors import ConfigError

            raise ConfigError("threshold.objective=recall needs threshold.target_recall "
                              "(e.g. 0.9)")
        value = choose_recall(sets, float(cfg.target_recall))
        extra = {"target_recall": float(cfg.target_recall)}
    else:
        from anomaly_hooks.errors import ConfigError

        raise ConfigError(f"threshold.objective={objective!r}: one of far, f1, recall")
    point = sets.point(value, objective)
    labelled = extra["prevalence"] if objective == "f1" and not extra["prevalence_given"] else None
    warn_if_most_good_flagged(sets, point, objective, labelled)
    k = point.false_alarms
    return Threshold(value=float(value), quantile=1.0 - k / good.size, margin=0.0, source=source,
                     far_interval=list(point.far_interval),
                     far_interval_method="clopper-pearson", expected_far=point.expected_far,
                     supported_rate=supported_rate(good.size),
                     scores=[float(v) for v in good], **extra, **_summary(good, value))
