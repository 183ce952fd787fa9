"""Anomaly-detection metrics: image and pixel AUROC, F1-max, and the MVTec AD PRO curve / AUPRO.

Conventions
-----------
* A *score* is "higher = more anomalous"; a sample is predicted anomalous when
  ``score >= threshold``.
* Image level: ``labels`` is a ``[N]`` array of 0/1 (or bool), ``scores`` a ``[N]`` float array.
* Pixel level: ``masks`` and ``maps`` are sequences (or stacked arrays) of per-image arrays;
  image ``i`` has a ground-truth mask ``masks[i]`` of shape ``[H_i, W_i]`` (bool, 0/1 or 0/255;
  non-zero = defect) and an anomaly map ``maps[i]`` of the *same* shape. Images may differ in
  size. An image whose mask is all zero counts as all-normal.
* Every metric is exact (no sampled thresholds); ties between scores are handled like
  scikit-learn (all samples with the same score switch together).

Memory
------
The pixel-level metrics never concatenate every pixel of the test set (the MVTec bottle test
set at 900x900 is 67M pixels). They materialise only the *defect* pixels (their scores,
float64, plus a per-pixel weight), sorted once, and then stream over the normal pixels one image
at a time, binning each normal pixel between the distinct defect scores with ``searchsorted``.
Between two consecutive distinct defect scores the TPR / PRO does not change, so these bin counts
give the exact piecewise-linear ROC / PRO curve (the same curve as sorting every pixel, minus
collinear points on its horizontal runs). Peak memory is ``O(#defect pixels + one image)``;
:func:`pixel_auroc` materialises whichever class is smaller. Each pixel metric makes one such
pass (~3 s for the 67M-pixel case); :func:`pixel_metrics` computes them all from one pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from scipy import ndimage

__all__ = [
    "roc_curve_points",
    "image_auroc",
    "pixel_auroc",
    "f1_max",
    "pixel_f1_max",
    "pixel_metrics",
    "precision_recall_at",
    "pro_curve",
    "aupro",
]

ArrayLike = Union[np.ndarray, Sequence[float], Sequence[bool], Sequence[int]]
ImageList = Union[np.ndarray, Sequence[np.ndarray]]

# 8-connectivity, as in the MVTec AD reference evaluation (scipy.ndimage.label, 3x3 ones).
_STRUCTURE = np.ones((3, 3), dtype=int)


# --------------------------------------------------------------------------------------------
# input checking
# --------------------------------------------------------------------------------------------
def _check_labels_scores(labels: ArrayLike, scores: ArrayLike) -> Tuple[np.ndarray, np.ndarray]:
    """``[N]`` labels (0/1/bool) and ``[N]`` finite scores -> (bool ``[N]``, float64 ``[N]``)."""
    y = np.asarray(labels)
    s = np.asarray(scores)
    if y.ndim != 1 or s.ndim != 1:
        raise ValueError(f"labels and scores must be 1-D, got shapes {y.shape} and {s.shape}")
    if y.shape[0] != s.shape[0]:
        raise ValueError(f"length mismatch: {y.shape[0]} labels but {s.shape[0]} scores")
    if y.shape[0] == 0:
        raise ValueError("empty input: no labels / scores")
    if y.dtype != np.bool_:
        if not np.issubdtype(y.dtype, np.number):
            raise ValueError(f"labels must be 0/1 or bool, got dtype {y.dtype}")
        if not np.isin(y, (0, 1)).all():
            raise ValueError("labels must be 0/1 or bool, found other values")
        y = y != 0
    if not np.issubdtype(s.dtype, np.number) or np.issubdtype(s.dtype, np.complexfloating):
        raise ValueError(f"scores must be real numbers, got dtype {s.dtype}")
    s = s.astype(np.float64, copy=False)
    if not np.isfinite(s).all():
        raise ValueError("scores contain NaN or infinite values")
    return y, s


def _check_mask(mask: np.ndarray, i: int) -> np.ndarray:
    """A ground-truth mask (bool, 0/1 or 0/255) -> bool array (``True`` = defect)."""
    if mask.dtype == np.bool_:
        return mask
    if not np.issubdtype(mask.dtype, np.number) or np.issubdtype(mask.dtype, np.complexfloating):
        raise ValueError(f"image {i}: mask dtype {mask.dtype} is not bool or numeric")
    if not ((mask == 0) | (mask == 1) | (mask == 255)).all():
        raise ValueError(f"image {i}: mask values must be bool, 0/1 or 0/255")
    return mask != 0


def _check_map(amap: np.ndarray, i: int) -> None:
    if not np.issubdtype(amap.dtype, np.number) or np.issubdtype(amap.dtype, np.complexfloating):
        raise ValueError(f"image {i}: anomaly map dtype {amap.dtype} is not real-valued")
    if not np.isfinite(amap).all():
        raise ValueError(f"image {i}: anomaly map contains NaN or infinite values")


def _check_images(masks: ImageList, maps: ImageList, need_2d: bool = False
                  ) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Validate per-image (mask, map) pairs.

    Returns a list of ``(mask_bool [H_i, W_i], map [H_i, W_i])``; maps are not copied.
    Raises ValueError for an empty input, a count mismatch, a shape mismatch (naming the image
    index), bad mask values or NaN / infinite map values.
    """
    masks_l = list(masks)
    maps_l = list(maps)
    if len(masks_l) != len(maps_l):
        raise ValueError(f"length mismatch: {len(masks_l)} masks but {len(maps_l)} anomaly maps")
    if not masks_l:
        raise ValueError("empty input: no masks / anomaly maps")
    pairs = []
    for i, (m, a) in enumerate(zip(masks_l, maps_l)):
        m = np.asarray(m)
        a = np.asarray(a)
        if m.shape != a.shape:
            raise ValueError(f"image {i}: mask shape {m.shape} != anomaly map shape {a.shape}")
        if need_2d and m.ndim != 2:
            raise ValueError(f"image {i}: expected a 2-D [H, W] mask / map, got shape {m.shape}")
        _check_map(a, i)
        pairs.append((_check_mask(m, i), a))
    if sum(m.size for m, _ in pairs) == 0:
        raise ValueError("empty input: the masks / anomaly maps have no pixels")
    return pairs


# --------------------------------------------------------------------------------------------
# the exact compact curve shared by pixel AUROC, pixel F1-max and PRO
# --------------------------------------------------------------------------------------------
@dataclass
class _BinnedCurve:
    """Exact curve of "positive" weight vs "negative" count as the threshold decreases.

    ``values`` ``[D]``: distinct scores of the positive pixels, descending.
    ``pos_count`` ``[D]``: number of positive pixels at each value.
    ``pos_region`` ``[D]`` or None: summed PRO weight (``1 / region size``) at each value.
    ``neg_open`` ``[D + 1]``: negatives strictly above ``values[0]``, strictly between
    ``values[j]`` and ``values[j + 1]``, ..., strictly below ``values[-1]``.
    ``neg_eq`` ``[D]``: negatives equal to ``values[j]``.
    ``n_regions``: number of connected defect regions (0 unless ``pos_region`` is set).
    """

    values: np.ndarray
    pos_count: np.ndarray
    pos_region: Optional[np.ndarray]
    neg_open: np.ndarray
    neg_eq: np.ndarray
    n_regions: int

    def vertices(self, region: bool = False) -> Tuple[np.ndarray, np.ndarray]:
        """``(x, y)``, each ``[2D + 2]``: (cumulative negatives, cumulative positive weight).

        ``y`` counts positive pixels, or sums PRO weights if ``region``. Vertex 0 is (0, 0);
        vertex ``2j + 1`` follows the open bin above ``values[j]``; vertex ``2j + 2`` is at
        threshold ``values[j]`` (all pixels ``>= values[j]``).
        """
        w = self.pos_region if region else self.pos_count
        if w is None:
            raise RuntimeError("curve was built without region weights")
        d = self.values.shape[0]
        steps = np.empty(2 * d + 1, dtype=np.float64)
        steps[0::2] = self.neg_open
        steps[1::2] = self.neg_eq
        x = np.concatenate(([0.0], np.cumsum(steps)))
        y = np.concatenate(([0.0, 0.0], np.repeat(np.cumsum(w, dtype=np.float64), 2)))
        return x, y


def _binned_curve(pairs: Sequence[Tuple[np.ndarray, np.ndarray]], region: bool = False,
                  invert: bool = False) -> _BinnedCurve:
    """Build the :class:`_BinnedCurve` of validated ``(mask, map)`` pairs in two streaming passes.

    Pass 1 materialises the positive (defect) pixels' scores, float64 ``[P]`` (plus their PRO
    weights if ``region``: ``1 / size of the pixel's 8-connected region``), sorted once.
    Pass 2 bins each image's negative pixels between the distinct positive scores.
    ``invert``: swap the classes and negate the scores (the ROC area is unchanged; used to
    materialise the smaller class; not with ``region``). Requires >= 1 positive pixel.
    """
    pos_vals: List[np.ndarray] = []
    pos_w: List[np.ndarray] = []
    n_regions = 0
    for mask, amap in pairs:
        pos = ~mask if invert else mask
        if not pos.any():
            continue
        v = amap[pos].astype(np.float64)
        if invert:
            np.negative(v, out=v)
        pos_vals.append(v)
        if region:
            labeled, n = ndimage.label(mask, structure=_STRUCTURE)
            sizes = np.bincount(labeled.ravel())
            pos_w.append(1.0 / sizes[labeled[pos]])
            n_regions += n
    if not pos_vals:
        raise ValueError("no positive pixels")
    vals = np.concatenate(pos_vals)
    del pos_vals
    order = np.argsort(vals, kind="stable")
    vals = vals[order]
    starts = np.concatenate(([0], np.flatnonzero(np.diff(vals)) + 1))
    asc = vals[starts]                       # [D] distinct positive scores, ascending
    count_asc = np.diff(np.append(starts, vals.shape[0]))
    del vals
    region_asc = None
    if region:
        region_asc = np.add.reduceat(np.concatenate(pos_w)[order], starts)
    del order, pos_w
    d = asc.shape[0]

    open_asc = np.zeros(d + 1, dtype=np.int64)
    eq_asc = np.zeros(d, dtype=np.int64)
    for mask, amap in pairs:
        neg = mask if invert else ~mask
        if not neg.any():
            continue
        v = amap[neg].astype(np.float64)
        if invert:
            np.negative(v, out=v)
        v.sort()                    # sorted queries make searchsorted ~10x faster (cache)
        idx = np.searchsorted(asc, v, side="left")     # number of positive values < v
        is_eq = asc[np.minimum(idx, d - 1)] == v
        open_asc += np.bincount(idx[~is_eq], minlength=d + 1)
        eq_asc += np.bincount(idx[is_eq], minlength=d)
    return _BinnedCurve(values=asc[::-1].copy(), pos_count=count_asc[::-1].copy(),
                        pos_region=None if region_asc is None else region_asc[::-1].copy(),
                        neg_open=open_asc[::-1].copy(), neg_eq=eq_asc[::-1].copy(),
                        n_regions=n_regions)


def _trapezoid(x: np.ndarray, y: np.ndarray, x_max: Optional[float] = None) -> float:
    """Trapezoid area under ``y(x)`` for non-decreasing ``x``, from ``x[0]`` up to ``x_max``.

    Like the MVTec AD reference ``trapezoid(x, y, x_max)``: where ``x_max`` falls inside a
    segment, ``y`` is linearly interpolated at ``x_max`` and the partial trapezoid is added.
    """
    if x_max is None or x_max >= x[-1]:
        return float(np.sum(0.5 * (y[1:] + y[:-1]) * np.diff(x)))
    k = int(np.searchsorted(x, x_max, side="right"))  # first vertex with x > x_max
    if k == 0:
        return 0.0
    area = float(np.sum(0.5 * (y[1:k] + y[:k - 1]) * np.diff(x[:k])))
    x0, y0, x1, y1 = x[k - 1], y[k - 1], x[k], y[k]
    y_interp = y0 + (y1 - y0) * (x_max - x0) / (x1 - x0)
    return area + float(0.5 * (y0 + y_interp) * (x_max - x0))


# --------------------------------------------------------------------------------------------
# image level: scikit-learn's, behind the same input checks as the pixel metrics
# --------------------------------------------------------------------------------------------
def _both_classes(y: np.ndarray, what: str) -> None:
    n_pos = int(y.sum())
    if n_pos == 0 or n_pos == y.shape[0]:
        raise ValueError(f"only one class present in labels: {what} is undefined")


def roc_curve_points(labels: ArrayLike, scores: ArrayLike
                     ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``sklearn.metrics.roc_curve(labels, scores, drop_intermediate=False)``: ``(fpr, tpr,
    thresholds)``, one point per distinct score (descending) after ``(0, 0)`` at ``+inf``.

    ``labels`` ``[N]`` (0/1 or bool, 1 = anomalous), ``scores`` ``[N]`` (higher = anomalous).
    Raises ValueError for empty / mismatched / non-finite input or when only one class is present.
    """
    from sklearn.metrics import roc_curve

    y, s = _check_labels_scores(labels, scores)
    _both_classes(y, "the ROC curve")
    return roc_curve(y, s, drop_intermediate=False)


def image_auroc(labels: ArrayLike, scores: ArrayLike) -> float:
    """``sklearn.metrics.roc_auc_score(labels, scores)``; ``labels`` ``[N]`` (0/1 or bool),
    ``scores`` ``[N]``. Raises ValueError when only one class is present, for empty, mismatched
    or non-finite input."""
    from sklearn.metrics import roc_auc_score

    y, s = _check_labels_scores(labels, scores)
    _both_classes(y, "AUROC")
    return float(roc_auc_score(y, s))


def f1_max(labels: ArrayLike, scores: ArrayLike) -> Tuple[float, float]:
    """Maximum F1 over all thresholds (anomalous when ``score >= threshold``), from
    ``sklearn.metrics.precision_recall_curve``.

    ``labels`` ``[N]`` (0/1 or bool), ``scores`` ``[N]``. Returns ``(best_f1, threshold)``; the
    threshold is one of the scores, the highest where several thresholds reach the maximum.
    Raises ValueError if there is no anomalous sample (F1 is undefined), for empty, mismatched
    or non-finite input.
    """
    from sklearn.metrics import precision_recall_curve

    y, s = _check_labels_scores(labels, scores)
    if not y.any():
        raise ValueError("no anomalous samples (label 1): F1 is undefined")
    precision, recall, thresholds = precision_recall_curve(y, s)
    p, r = precision[:-1], recall[:-1]  # the last point (recall 0) has no threshold
    denom = p + r
    f1 = np.divide(2 * p * r, denom, out=np.zeros_like(denom), where=denom > 0)
    best = np.flatnonzero(f1 == f1.max())[-1]  # thresholds ascend: the highest among ties
    return float(f1[best]), float(thresholds[best])


def precision_recall_at(labels: ArrayLike, scores: ArrayLike, threshold: float
                        ) -> Tuple[float, float]:
    """Precision and recall when predicting anomalous for ``score >= threshold``
    (``sklearn.metrics.precision_score`` / ``recall_score`` with ``zero_division=0``).

    ``labels`` ``[N]`` (0/1 or bool), ``scores`` ``[N]``. Returns ``(precision, recall)``.
    """
    from sklearn.metrics import precision_score, recall_score

    y, s = _check_labels_scores(labels, scores)
    if np.isnan(threshold):
        raise ValueError("threshold is NaN")
    pred = s >= threshold
    return (float(precision_score(y, pred, zero_division=0)),
            float(recall_score(y, pred, zero_division=0)))


# --------------------------------------------------------------------------------------------
# pixel level
# --------------------------------------------------------------------------------------------
def _roc_area(curve: _BinnedCurve) -> float:
    x, y = curve.vertices()
    return _trapezoid(x / x[-1], y / y[-1])


def _f1_from_curve(curve: _BinnedCurve) -> Tuple[float, float]:
    x, y = curve.vertices()
    tps = y[2::2]                                   # at thresholds curve.values (descending)
    fps = x[2::2]
    f1 = 2.0 * tps / (y[-1] + tps + fps)
    best = int(np.argmax(f1))                       # first = highest threshold among ties
    return float(f1[best]), float(curve.values[best])


def _pro_from_curve(curve: _BinnedCurve) -> Tuple[np.ndarray, np.ndarray]:
    """Compact exact PRO curve ``(fpr [K], pro [K])`` from ``(0, 0)`` to ``(1, 1)``."""
    x, y = curve.vertices(region=True)
    fpr = np.concatenate((x / x[-1], [1.0]))
    pro = np.concatenate((np.minimum(y / curve.n_regions, 1.0), [1.0]))
    keep = np.ones(fpr.shape[0], dtype=bool)        # drop repeated vertices
    keep[1:] = (np.diff(fpr) != 0) | (np.diff(pro) != 0)
    return fpr[keep], pro[keep]


def _class_counts(pairs: Sequence[Tuple[np.ndarray, np.ndarray]]) -> Tuple[int, int]:
    """(number of defect pixels, number of normal pixels) over all images."""
    n_pos = sum(int(np.count_nonzero(m)) for m, _ in pairs)
    return n_pos, sum(m.size for m, _ in pairs) - n_pos


def _require_pro_classes(pairs: Sequence[Tuple[np.ndarray, np.ndarray]]) -> None:
    n_pos, n_neg = _class_counts(pairs)
    if n_pos == 0:
        raise ValueError("no defect pixel in any mask: the PRO curve is undefined")
    if n_neg == 0:
        raise ValueError("no normal pixel in any mask: the PRO curve's FPR is undefined")


def pixel_auroc(masks: ImageList, maps: ImageList) -> float:
    """Pixel-level AUROC over all pixels of all images.

    ``masks[i]`` ``[H_i, W_i]`` (bool / 0-1 / 0-255), ``maps[i]`` ``[H_i, W_i]`` float. Equals
    ``roc_auc_score(concat(mask.ravel() > 0), concat(map.ravel()))`` without concatenating the
    pixels: memory is ``O(min(#defect, #normal) pixels + one image)`` (see module docstring).
    Raises ValueError for empty / mismatched input (a shape mismatch names the image index),
    NaN maps, or when all pixels are of one class.
    """
    pairs = _check_images(masks, maps)
    n_pos, n_neg = _class_counts(pairs)
    if n_pos == 0 or n_neg == 0:
        raise ValueError("only one class present in the masks: pixel AUROC is undefined")
    return _roc_area(_binned_curve(pairs, invert=n_pos > n_neg))


def pixel_f1_max(masks: ImageList, maps: ImageList) -> Tuple[float, float]:
    """Maximum F1 over all thresholds, over all pixels of all images.

    ``masks[i]`` ``[H_i, W_i]``, ``maps[i]`` ``[H_i, W_i]``. Returns ``(best_f1, threshold)``,
    the same as :func:`f1_max` on the concatenated flattened pixels (memory
    ``O(#defect pixels + one image)``). Raises ValueError if no mask has a defect pixel.
    """
    pairs = _check_images(masks, maps)
    if _class_counts(pairs)[0] == 0:
        raise ValueError("no defect pixel in any mask: F1 is undefined")
    return _f1_from_curve(_binned_curve(pairs))


def pixel_metrics(masks: ImageList, maps: ImageList, fpr_limit: float = 0.3
                  ) -> Dict[str, Any]:
    """All pixel metrics from a single pass over the images (about 4x cheaper than separately).

    ``masks[i]`` ``[H_i, W_i]``, ``maps[i]`` ``[H_i, W_i]`` (2-D). Returns a dict with
    ``pixel_auroc``, ``aupro`` (at ``fpr_limit``), ``pixel_f1_max``, ``pixel_f1_threshold``
    (floats) and ``pro_curve`` (the default :func:`pro_curve` output ``(fpr, pro)``); each
    value is identical to the corresponding function's. Raises ValueError as :func:`aupro`.
    """
    _check_fpr_limit(fpr_limit)
    pairs = _check_images(masks, maps, need_2d=True)
    _require_pro_classes(pairs)
    curve = _binned_curve(pairs, region=True)
    fpr, pro = _pro_from_curve(curve)
    f1, thr = _f1_from_curve(curve)
    return {"pixel_auroc": _roc_area(curve),
            "aupro": _trapezoid(fpr, pro, fpr_limit) / fpr_limit,
            "pixel_f1_max": f1,
            "pixel_f1_threshold": thr,
            "pro_curve": (fpr, pro)}


def pro_curve(masks: ImageList, maps: ImageList) -> Tuple[np.ndarray, np.ndarray]:
    """The MVTec AD per-region-overlap (PRO) curve, exact.

    ``masks[i]`` ``[H_i, W_i]`` (bool / 0-1 / 0-255), ``maps[i]`` ``[H_i, W_i]`` float. The
    8-connected components of every mask are the regions. At threshold ``t``: PRO = mean over all
    regions of all images of the fraction of the region's pixels with ``map >= t``; FPR = the
    fraction of all normal pixels (mask == 0) of all images with ``map >= t``.

    Returns ``(fpr, pro)``, each ``[K]``, FPR non-decreasing, starting at ``(0, 0)`` and ending
    at ``(1, 1)`` (both clipped to 1), as ``compute_pro`` of the MVTec AD evaluation code, in
    ``O(#defect pixels + one image)`` memory. Points where only normal pixels change (collinear
    points on a horizontal run) are dropped: the polyline and its area are unchanged.

    Raises ValueError for empty / mismatched input, NaN maps, no defect pixel in any mask,
    or no normal pixel at all.
    """
    pairs = _check_images(masks, maps, need_2d=True)
    _require_pro_classes(pairs)
    return _pro_from_curve(_binned_curve(pairs, region=True))


def aupro(masks: ImageList, maps: ImageList, fpr_limit: float = 0.3) -> float:
    """Normalised area under the PRO curve for FPR in ``[0, fpr_limit]``.

    ``masks[i]`` ``[H_i, W_i]``, ``maps[i]`` ``[H_i, W_i]`` (see :func:`pro_curve`). The exact
    curve is integrated with the trapezoid rule, interpolated at exactly ``fpr_limit`` like the
    MVTec AD reference ``trapezoid(fprs, pros, x_max=fpr_limit)``, then divided by
    ``fpr_limit`` (1.0 = perfect). Raises ValueError if no mask has a defect pixel, if there is
    no normal pixel, or if ``fpr_limit`` is not in ``(0, 1]``.
    """
    _check_fpr_limit(fpr_limit)
    pairs = _check_images(masks, maps, need_2d=True)
    _require_pro_classes(pairs)
    fpr, pro = _pro_from_curve(_binned_curve(pairs, region=True))
    return _trapezoid(fpr, pro, fpr_limit) / fpr_limit


def _check_fpr_limit(fpr_limit: float) -> None:
    if not 0.0 < fpr_limit <= 1.0:
        raise ValueError(f"fpr_limit must be in (0, 1], got {fpr_limit}")
