"""Operating points: where the threshold goes, and what it will do (torch-free).

Inputs: the out-of-sample scores of ``n`` good images (each from a model fitted without the
image and its group, or held-out images) and the scores of ``m`` labelled defective images
(from the fitted model, which never saw them). At a threshold ``t`` (``score > t`` is
anomalous):

* the false-alarm rate is the share of good scores above ``t``; its interval is Clopper-Pearson
  on that count (:func:`anomaly_hooks.calibration.clopper_pearson`, 90 %);
* the recall is the share of defect scores above ``t``, with the same interval on that count.

Objectives (``threshold.objective``):

* ``far``: the good-only rule at ``threshold.false_alarm_rate`` (:mod:`anomaly_hooks.threshold`).
* ``f1``: the threshold of largest F1 at a share ``pi`` of defective parts
  (``threshold.prevalence``; null: the labelled images as given, ``pi = m / (n + m)``)::

      F1(t) = 2 pi R(t) / (pi + pi R(t) + (1 - pi) F(t))

  with ``R``, ``F`` the recall and false-alarm curves *smoothed* by a Gaussian kernel on each
  class's scores (Silverman's bandwidth, :func:`bandwidth`). With ten defects the empirical
  curves are steps and the empirical F1-max sits just below one of the labelled defects, where
  an unseen defect scoring a little lower is missed; the smoothed curves weigh each class's
  spread (measured on the shared data sets with ten defects drawn 20 times: the gap to the
  F1-max of the test images fell from 0.03-0.26 to 0.01-0.03 on average).
* ``recall``: the highest threshold whose smoothed recall reaches ``threshold.target_recall``:
  the lowest false-alarm rate that does.

Every choice records its expected false-alarm rate and recall with their intervals; the
trade-off table (:func:`trade_off`) lists the same for the thresholds of other rates and
recalls, so that an operator sees what moving the threshold costs.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from anomaly_hooks.calibration import clopper_pearson, fit_tail
from anomaly_hooks.errors import ConfigError, ThresholdError

OBJECTIVES = ("far", "f1", "recall")
GRID = 2001  # points of the threshold grid the smoothed curves are evaluated on
TABLE_RATES = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)  # false-alarm rates of the table
TABLE_RECALLS = (0.5, 0.8, 0.9, 0.95, 0.99)  # recalls of the table (with defects)


def _normal_sf(z: np.ndarray) -> np.ndarray:
    """``P(Z > z)`` of a standard normal (scipy's ``ndtr``: exact in the far tails)."""
    from scipy.special import ndtr

    return ndtr(-z)


def bandwidth(scores: np.ndarray) -> float:
    """Silverman's rule-of-thumb bandwidth ``0.9 min(sd, IQR / 1.349) n^(-1/5)`` of a Gaussian
    kernel on ``scores`` (a positive fallback for constant or single scores)."""
    x = np.asarray(scores, dtype=np.float64)
    sd = float(x.std(ddof=1)) if x.size > 1 else 0.0
    iqr = float(np.subtract(*np.quantile(x, [0.75, 0.25]))) / 1.349 if x.size > 1 else 0.0
    spread = min(v for v in (sd, iqr) if v > 0) if max(sd, iqr) > 0 else 0.0
    h = 0.9 * spread * x.size ** -0.2
    return h if h > 0 else 1e-3 * max(abs(float(np.median(x))), 1.0)


def smooth_sf(scores: np.ndarray, t: np.ndarray, h: float) -> np.ndarray:
    """Kernel-smoothed ``P(score > t)`` ``[len(t)]`` of ``scores``: the mean of
    ``Phi((s - t) / h)``."""
    s = np.asarray(scores, dtype=np.float64)
    out = np.empty(len(t))
    for lo in range(0, len(t), 512):  # [512, n] blocks
        out[lo:lo + 512] = _normal_sf((t[lo:lo + 512, None] - s[None, :]) / h).mean(axis=1)
    return out


@dataclass(frozen=True)
class OperatingPoint:
    """What a threshold does: expected false-alarm rate and recall with their 90 % intervals
    (Clopper-Pearson on the counts), and the counts themselves."""

    threshold: float
    label: str
    expected_far: float
    far_interval: Tuple[float, float]
    false_alarms: int
    n_good: int
    expected_recall: Optional[float] = None
    recall_interval: Optional[Tuple[float, float]] = None
    caught: Optional[int] = None
    n_defects: Optional[int] = None

    def as_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["far_interval"] = list(self.far_interval)
        if self.recall_interval is not None:
            out["recall_interval"] = list(self.recall_interval)
        return out


class ScoreSets:
    """The good images' out-of-sample scores and the labelled defects' scores, with their
    smoothed false-alarm and recall curves."""

    def __init__(self, good: Sequence[float], defects: Optional[Sequence[float]] = None) -> None:
        self.good = np.asarray(good, dtype=np.float64)
        self.defects = None if defects is None or len(defects) == 0 else np.asarray(
            defects, dtype=np.float64)
        for what, arr in (("good", self.good), ("defect", self.defects)):
            if arr is not None and not np.isfinite(arr).all():
                raise ThresholdError(f"non-finite {what} image scores: the model file or the "
                                     "images are damaged")
        if self.good.size == 0:
            raise ThresholdError("no good image scores to set a threshold from")
        self.h_good = bandwidth(self.good)
        self.h_defects = None if self.defects is None else bandwidth(self.defects)

    @property
    def n(self) -> int:
        return int(self.good.size)

    @property
    def m(self) -> int:
        return 0 if self.defects is None else int(self.defects.size)

    def smooth_far(self, t: np.ndarray) -> np.ndarray:
        return smooth_sf(self.good, np.atleast_1d(t), self.h_good)

    def smooth_recall(self, t: np.ndarray) -> np.ndarray:
        return smooth_sf(self.defects, np.atleast_1d(t), self.h_defects)

    def grid(self) -> np.ndarray:
        """Thresholds spanning both classes and their kernels' reach."""
        both = self.good if self.defects is None else np.concatenate([self.good, self.defects])
        reach = 4.0 * max(self.h_good, self.h_defects or 0.0)
        return np.linspace(both.min() - reach, both.max() + reach, GRID)

    def point(self, t: float, label: str, expected_far: Optional[float] = None,
              expected_recall: Optional[float] = None) -> OperatingPoint:
        """The operating point of threshold ``t``; the expected rates default to the observed
        shares."""
        k = int((self.good > t).sum())
        out: Dict[str, Any] = {
            "threshold": float(t), "label": label,
            "expected_far": k / self.n if expected_far is None else float(expected_far),
            "far_interval": clopper_pearson(k, self.n), "false_alarms": k, "n_good": self.n}
        if self.defects is not None:
            c = int((self.defects > t).sum())
            out.update(expected_recall=c / self.m if expected_recall is None
                       else float(expected_recall),
                       recall_interval=clopper_pearson(c, self.m), caught=c, n_defects=self.m)
        return OperatingPoint(**out)


def check_defects(sets: ScoreSets, objective: str) -> None:
    """Objectives ``f1`` and ``recall`` need labelled defects that the model tells apart from
    the good images at least somewhat: none, or all scoring at or below every good image, is a
    :class:`ThresholdError`; scoring lower than the good images on the whole is a warning."""
    if sets.defects is None:
        raise ConfigError(f"threshold.objective={objective} needs labelled defective images: "
                          "set threshold.defects to a folder of them (or --defects DIR)")
    if sets.defects.max() <= sets.good.min():
        raise ThresholdError(
            f"every one of the {sets.m} labelled defects scores at or below every good image "
            f"(defects at most {sets.defects.max():.4g}, good images at least "
            f"{sets.good.min():.4g}): the model does not see these defects. Check that the "
            "folder holds defects of this product, or use threshold.objective=far")
    auroc = auc(sets.good, sets.defects)
    if auroc < 0.5:
        warnings.warn(f"the {sets.m} labelled defects score lower than the good images on the "
                      f"whole (AUROC {auroc:.2f}): an operating point from them is unreliable; "
                      "check the defects folder", UserWarning, stacklevel=3)


MOST_GOOD = 0.5  # an operating point flagging this share of the good images or more warns


def warn_if_most_good_flagged(sets: ScoreSets, point: OperatingPoint, objective: str,
                              labelled_share: Optional[float] = None) -> None:
    """Warn where ``point`` (:meth:`ScoreSets.point` of the threshold ``objective`` chose:
    ``f1``, ``recall``) flags at least :data:`MOST_GOOD` of the good images: the line would
    reject most good parts, because the labelled defects score among the good images (or the
    recall asked for lies deep inside them). Not an error: the choice is what the objective
    asks, and a line may sort flagged parts by hand. ``labelled_share``: the share of defects
    ``f1`` took from the labelled images themselves (no ``threshold.prevalence`` given); the
    warning then names it, since a line's own, smaller share puts the F1 point higher."""
    k, n = point.false_alarms, point.n_good
    if k < MOST_GOOD * n:
        return
    low, high = point.far_interval
    lower = "lower threshold.target_recall, " if objective == "recall" else ""
    share = "" if labelled_share is None else (
        f"F1 took the labelled images' share of defects ({100 * labelled_share:.0f} %): set "
        "threshold.prevalence to your line's share (a smaller one flags fewer good parts), ")
    warnings.warn(
        f"the {objective} operating point flags {k} of the {n} good images "
        f"({100 * k / n:.0f} %, 90 % interval {100 * low:.0f}-{100 * high:.0f} %): a line "
        f"would reject most good parts. The {sets.m} labelled defects score among the good "
        f"images (AUROC {auc(sets.good, sets.defects):.2f}); {share}label more defects, check "
        f"that they are defects of this product, {lower}or use threshold.objective=far",
        UserWarning, stacklevel=3)


def auc(good: np.ndarray, defects: np.ndarray) -> float:
    """Mann-Whitney AUROC of defects against good scores (ties count half): the share of
    (good, defect) pairs where the defect scores higher, counted exactly."""
    g = np.sort(np.asarray(good, dtype=np.float64))
    d = np.asarray(defects, dtype=np.float64)
    below = np.searchsorted(g, d, side="left")  # good scores under each defect's
    ties = np.searchsorted(g, d, side="right") - below
    return float((below.sum() + 0.5 * ties.sum()) / (d.size * g.size))


def _refine(sets: ScoreSets, f: Any, grid: np.ndarray) -> float:
    """The argmax of ``f`` on ``grid``, refined on a grid of the two neighbouring steps."""
    i = int(np.argmax(f(grid)))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
    fine = np.linspace(lo, hi, GRID)
    return float(fine[int(np.argmax(f(fine)))])


def f1_curve(sets: ScoreSets, prevalence: Optional[float]) -> Any:
    """``t -> F1(t)`` on the smoothed curves at the share ``prevalence`` of defective parts
    (None: ``m / (n + m)``, the labelled images as given)."""
    pi = sets.m / (sets.n + sets.m) if prevalence is None else float(prevalence)

    def f1(t: np.ndarray) -> np.ndarray:
        r, f = sets.smooth_recall(t), sets.smooth_far(t)
        return 2 * pi * r / (pi + pi * r + (1 - pi) * f)

    return f1


def choose_f1(sets: ScoreSets, prevalence: Optional[float] = None) -> float:
    """The threshold of largest smoothed F1 (see the module docstring)."""
    check_defects(sets, "f1")
    return _refine(sets, f1_curve(sets, prevalence), sets.grid())


def choose_recall(sets: ScoreSets, target: float) -> float:
    """The highest threshold whose smoothed recall is at least ``target``; a
    :class:`ThresholdError` where that threshold would flag every good image."""
    check_defects(sets, "recall")
    lower, _ = clopper_pearson(sets.m, sets.m)
    if lower < target:
        warnings.warn(f"{sets.m} labelled defects cannot show a recall of {target:g}: even with "
                      f"all of them caught the 90 % interval starts at {lower:.2f}; label more "
                      f"defects (about {math.ceil(math.log(0.05) / math.log(target))} for "
                      "this target)", UserWarning, stacklevel=2)
    grid = sets.grid()
    lo, hi = float(grid[0]), float(grid[-1])  # recall ~1 at lo, ~0 at hi
    for _ in range(100):  # bisection: the smoothed recall falls with t
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if sets.smooth_recall(np.array([mid]))[0] >= target else (lo, mid)
    if sets.smooth_far(np.array([lo]))[0] >= 1.0 - 0.5 / sets.n:
        raise ThresholdError(
            f"no threshold reaches a recall of {target:g} while any good image passes: the "
            f"labelled defects score below the good images (lowest defect "
            f"{sets.defects.min():.4g}, lowest good {sets.good.min():.4g}); lower "
            "threshold.target_recall or check the defects folder")
    return lo


def trade_off(sets: ScoreSets, chosen: OperatingPoint, tail: str,
              prevalence: Optional[float] = None) -> List[OperatingPoint]:
    """The table an operator chooses from: the thresholds of the rates in
    :data:`TABLE_RATES` (the good-only rule, ``tail``), with defects the F1-max at the share
    ``prevalence`` of defective parts (None: the labelled images as given, as
    :func:`choose_f1`) and the thresholds of the recalls in :data:`TABLE_RECALLS`, and the
    chosen point; highest threshold first."""
    rows = [chosen]
    for rate in TABLE_RATES:
        if sets.n >= 3:
            t = fit_tail(sets.good, rate, tail).threshold
            rows.append(sets.point(t, f"far {100 * rate:g} %", expected_far=rate))
    if sets.defects is not None and sets.defects.max() > sets.good.min():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the table is a survey, not a choice
            rows.append(sets.point(choose_f1(sets, prevalence), "F1-max"))
            for r in TABLE_RECALLS:
                try:
                    rows.append(sets.point(choose_recall(sets, r), f"recall {r:g}"))
                except ThresholdError:
                    continue
    return sorted(rows, key=lambda p: -p.threshold)


def format_table(rows: Sequence[OperatingPoint]) -> str:
    """The trade-off table in fixed-width text (the chosen row marked ``*``)."""
    def pct(v: Optional[float]) -> str:
        return "-" if v is None else f"{100 * v:.2f}"

    def span(iv: Optional[Tuple[float, float]]) -> str:
        return "-" if iv is None else f"{pct(iv[0])}-{pct(iv[1])}"

    lines = [f"  {'':<12} {'threshold':>11} {'FAR %':>7} {'90 % interval':>14} "
             f"{'recall %':>9} {'90 % interval':>14}"]
    for p in rows:
        mark = "*" if p.label.startswith("chosen") else " "
        lines.append(f"{mark} {p.label:<12} {p.threshold:>11.5g} {pct(p.expected_far):>7} "
                     f"{span(p.far_interval):>14} {pct(p.expected_recall):>9} "
                     f"{span(p.recall_interval):>14}")
    return "\n".join(lines)
