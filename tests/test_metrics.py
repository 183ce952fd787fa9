"""Tests of anomaly_hooks.evaluation.metrics.

References: hand-computed cases, scikit-learn and a brute-force PRO.
"""
from __future__ import annotations

import tracemalloc
from bisect import bisect

import numpy as np
import pytest
from conftest import f64_tol
from scipy import ndimage
from sklearn.metrics import precision_recall_curve, roc_auc_score, roc_curve

from anomaly_hooks.evaluation import metrics as M


# --------------------------------------------------------------------------------------------
# helpers / references
# --------------------------------------------------------------------------------------------
def _sk_f1_max(labels, scores) -> float:
    p, r, _ = precision_recall_curve(labels, scores)
    with np.errstate(invalid="ignore", divide="ignore"):
        f1 = np.where(p + r > 0, 2 * p * r / (p + r), 0.0)
    return float(f1.max())


def _random_images(rng, sizes, p_defect=0.25, decimals=1, dtype=np.float32):
    """Masks with several blobs each (some all-normal) and rounded (tied) maps."""
    masks, maps = [], []
    for k, (h, w) in enumerate(sizes):
        if k % 3 == 2:
            mask = np.zeros((h, w), dtype=bool)
        else:
            mask = ndimage.binary_opening(rng.random((h, w)) < p_defect * 2.5) | (
                rng.random((h, w)) < p_defect / 4)
        amap = rng.random((h, w)) + 0.6 * mask
        masks.append(mask)
        maps.append(np.round(amap, decimals).astype(dtype))
    return masks, maps


def _official_trapezoid(x, y, x_max=None):
    """Transcription of ``trapezoid`` from the MVTec AD evaluation code (generic_util.py)."""
    x = np.array(x)
    y = np.array(y)
    correction = 0.0
    if x_max is not None:
        if x_max not in x:
            ins = bisect(x, x_max)
            assert 0 < ins < len(x)
            y_interp = y[ins - 1] + ((y[ins] - y[ins - 1]) * (x_max - x[ins - 1])
                                     / (x[ins] - x[ins - 1]))
            correction = 0.5 * (y_interp + y[ins - 1]) * (x_max - x[ins - 1])
        mask = x <= x_max
        x = x[mask]
        y = y[mask]
    return np.sum(0.5 * (y[1:] + y[:-1]) * (x[1:] - x[:-1])) + correction


def _brute_pro_curve(masks, maps):
    """At every distinct score t (descending): FPR and mean region overlap, computed directly."""
    regions = []                                   # (image index, boolean region mask)
    for i, m in enumerate(masks):
        labeled, n = ndimage.label(np.asarray(m) > 0, structure=np.ones((3, 3), dtype=int))
        regions += [(i, labeled == k) for k in range(1, n + 1)]
    n_normal = sum(int((np.asarray(m) == 0).sum()) for m in masks)
    thresholds = np.unique(np.concatenate([np.asarray(a, np.float64).ravel() for a in maps]))[::-1]
    fprs, pros = [0.0], [0.0]
    for t in thresholds:
        fp = sum(int(((np.asarray(a) >= t) & (np.asarray(m) == 0)).sum())
                 for m, a in zip(masks, maps))
        overlaps = [(np.asarray(maps[i])[r] >= t).mean() for i, r in regions]
        fprs.append(fp / n_normal)
        pros.append(float(np.mean(overlaps)))
    return np.array(fprs + [1.0]), np.array(pros + [1.0])


def _brute_aupro(masks, maps, limit):
    fpr, pro = _brute_pro_curve(masks, maps)
    return _official_trapezoid(fpr, pro, limit) / limit


# --------------------------------------------------------------------------------------------
# image level
# --------------------------------------------------------------------------------------------
def test_image_auroc_hand_computed():
    # float64 sums of 4 pairs' counts, divided: a few roundings of numbers <= 1
    assert M.image_auroc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == pytest.approx(0.75,
                                                                             abs=f64_tol(4))
    assert M.image_auroc([False, True], [0.2, 0.9]) == 1.0
    assert M.image_auroc([1, 0], [0.2, 0.9]) == 0.0
    assert M.image_auroc([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5]) == pytest.approx(0.5)
    # one tie between the classes counts a half
    assert M.image_auroc([0, 1, 1], [0.3, 0.3, 0.9]) == pytest.approx(0.75)


@pytest.mark.parametrize("seed", range(5))
def test_image_metrics_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 300))
    labels = rng.random(n) < rng.uniform(0.1, 0.9)
    labels[:2] = [False, True]
    scores = np.round(rng.normal(size=n) + labels, int(rng.integers(0, 3)))   # many ties
    # float64 on both sides: an AUROC sums at most n trapezoids of rates in [0, 1]; a rate is
    # an integer count divided once (counts are exact); an F1 a few operations on two rates
    tol = f64_tol(n)
    assert M.image_auroc(labels, scores) == pytest.approx(roc_auc_score(labels, scores),
                                                          abs=tol)
    fpr, tpr, thr = M.roc_curve_points(labels.astype(int), scores)
    sk_fpr, sk_tpr, sk_thr = roc_curve(labels, scores, drop_intermediate=False)
    np.testing.assert_allclose(fpr, sk_fpr, rtol=0, atol=f64_tol(1))
    np.testing.assert_allclose(tpr, sk_tpr, rtol=0, atol=f64_tol(1))
    assert np.isinf(thr[0]) and np.array_equal(thr[1:], sk_thr[1:])
    best, t = M.f1_max(labels, scores)
    assert best == pytest.approx(_sk_f1_max(labels, scores), abs=f64_tol(8))
    p, r = M.precision_recall_at(labels, scores, t)
    assert 2 * p * r / (p + r) == pytest.approx(best, abs=f64_tol(8))


def test_f1_max_hand_computed():
    # threshold 0.8 -> TP 2, FP 0, FN 1: F1 = 4/5; threshold 0.4 -> TP 3, FP 1: F1 = 6/7
    labels = [1, 1, 0, 1, 0, 0]
    scores = [0.9, 0.8, 0.5, 0.4, 0.3, 0.1]
    best, t = M.f1_max(labels, scores)
    assert best == pytest.approx(6 / 7) and t == 0.4
    # all anomalous: F1 = 1 at the lowest score
    assert M.f1_max([1, 1], [0.2, 0.7]) == (1.0, 0.2)


def test_precision_recall_at():
    labels = [1, 1, 0, 1, 0, 0]
    scores = [0.9, 0.8, 0.5, 0.4, 0.3, 0.1]
    assert M.precision_recall_at(labels, scores, 0.5) == pytest.approx((2 / 3, 2 / 3))
    assert M.precision_recall_at(labels, scores, 0.8) == pytest.approx((1.0, 2 / 3))
    assert M.precision_recall_at(labels, scores, 2.0) == (0.0, 0.0)     # nothing predicted
    assert M.precision_recall_at([0, 0], [0.1, 0.2], 0.0) == (0.0, 0.0)  # no positives


# --------------------------------------------------------------------------------------------
# pixel AUROC / F1
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_pixel_metrics_match_sklearn_on_concatenation(seed):
    rng = np.random.default_rng(seed)
    sizes = [tuple(rng.integers(3, 20, size=2)) for _ in range(6)]
    masks, maps = _random_images(rng, sizes, decimals=int(rng.integers(1, 4)))
    masks = [m.astype(np.uint8) * (255 if seed % 2 else 1) for m in masks]   # 0/1 and 0/255
    labels = np.concatenate([m.ravel() > 0 for m in masks])
    scores = np.concatenate([a.ravel() for a in maps])
    tol = f64_tol(len(scores))  # n trapezoids of rates in [0, 1], as for images
    assert M.pixel_auroc(masks, maps) == pytest.approx(roc_auc_score(labels, scores), abs=tol)
    best, t = M.pixel_f1_max(masks, maps)
    assert best == pytest.approx(_sk_f1_max(labels, scores), abs=f64_tol(8))
    assert (best, t) == pytest.approx(M.f1_max(labels, scores), abs=f64_tol(8))
    # defect-majority data takes the swapped-class path
    inv = [(m == 0) for m in masks]
    assert M.pixel_auroc(inv, maps) == pytest.approx(roc_auc_score(~labels, scores), abs=tol)


def test_pixel_auroc_stacked_array_and_perfect_and_constant():
    mask = np.zeros((2, 4, 4), dtype=bool)
    mask[0, 1:3, 1:3] = True
    assert M.pixel_auroc(mask, mask.astype(float)) == 1.0
    assert M.pixel_auroc(mask, np.ones(mask.shape)) == pytest.approx(0.5)
    assert M.pixel_f1_max(mask, mask.astype(float)) == (1.0, 1.0)


def test_pixel_auroc_memory_is_bounded():
    rng = np.random.default_rng(0)
    masks, maps = [], []
    for _ in range(20):
        m = np.zeros((300, 300), dtype=bool)
        m[100:130, 100:130] = True                        # 1% defect pixels
        masks.append(m)
        maps.append(rng.random((300, 300), dtype=np.float32))
    concat_bytes = 20 * 300 * 300 * (4 + 8)               # float32 scores + an int64 argsort
    tracemalloc.start()
    try:
        M.pixel_auroc(masks, maps)
        M.aupro(masks, maps)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < concat_bytes / 3


# --------------------------------------------------------------------------------------------
# PRO / AUPRO
# --------------------------------------------------------------------------------------------
def test_pro_hand_computed_4x4():
    mask = np.zeros((4, 4), dtype=np.uint8)
    mask[0:2, 0:2] = 255                                   # one region of 4 pixels
    amap = np.full((4, 4), 0.1)
    amap[0, 0], amap[0, 1], amap[1, 0], amap[1, 1] = 0.9, 0.8, 0.3, 0.2
    amap[3, 3], amap[3, 2] = 0.6, 0.25
    fpr, pro = _brute_pro_curve([mask], [amap])
    # thresholds 0.9, 0.8, 0.6, 0.3, 0.25, 0.2, 0.1 (12 normal pixels)
    # counts divided (one rounding), overlaps averaged over one region (a few)
    np.testing.assert_allclose(fpr, [0, 0, 0, 1 / 12, 1 / 12, 2 / 12, 2 / 12, 1, 1], rtol=0,
                               atol=f64_tol(1))
    np.testing.assert_allclose(pro, [0, .25, .5, .5, .75, .75, 1, 1, 1], rtol=0, atol=f64_tol(4))
    # the library's compact curve keeps a subset of these points (same polyline)
    points = set(zip(np.round(fpr, 12), np.round(pro, 12)))
    c_fpr, c_pro = M.pro_curve([mask], [amap])
    assert set(zip(np.round(c_fpr, 12), np.round(c_pro, 12))) <= points
    # area to FPR 0.3: 1/12 * 0.5 + 1/12 * 0.75 + (0.3 - 2/12) * 1
    expected = (1 / 12 * 0.5 + 1 / 12 * 0.75 + (0.3 - 2 / 12)) / 0.3
    # 3 trapezoids of a few roundings each, divided by the limit
    assert M.aupro([mask], [amap], fpr_limit=0.3) == pytest.approx(expected,
                                                                   abs=f64_tol(16) / 0.3)


def test_aupro_hand_computed_interpolated_segment():
    # region of 2 pixels, 4 normal pixels; curve (0,0) (0,.5) (.25,.5) (.25,1) (1,1)
    mask = np.array([[1, 1, 0], [0, 0, 0]])
    amap = np.array([[0.9, 0.5, 0.7], [0.1, 0.1, 0.1]])
    assert M.aupro([mask], [amap], fpr_limit=0.3) == pytest.approx((0.125 + 0.05) / 0.3)
    assert M.aupro([mask], [amap], fpr_limit=1.0) == pytest.approx(0.875)
    # interpolation inside a diagonal segment: region pixels tie with a normal pixel
    amap2 = np.array([[0.5, 0.5, 0.5], [0.1, 0.1, 0.1]])
    # curve (0,0) -> (.25, 1) -> (1, 1); at 0.2 the PRO is 0.8
    assert M.aupro([mask], [amap2], fpr_limit=0.2) == pytest.approx(0.5 * 0.8 * 0.2 / 0.2)


def test_pro_mean_over_regions_of_all_images():
    m1 = np.zeros((5, 5), dtype=bool)
    m1[0, 0:4] = True                                     # region A: 4 pixels
    m1[3:5, 3:5] = True                                   # region B: 4 pixels
    m1[4, 0] = True                                       # region C: 1 pixel
    m2 = np.zeros((3, 3), dtype=bool)
    m2[1, 1] = True                                       # region D: 1 pixel, other image
    a1 = np.zeros((5, 5))
    a1[0, 0:3] = 1.0                                      # 3/4 of A
    a1[3, 3] = 1.0                                        # 1/4 of B
    a2 = np.zeros((3, 3))
    a2[0, 0] = 1.0                                        # a false positive; D missed
    fpr, pro = M.pro_curve([m1, m2], [a1, a2])
    # at t = 1: PRO = (3/4 + 1/4 + 0 + 0) / 4, FPR = 1 / (16 + 8)
    k = int(np.flatnonzero(fpr > 0)[0])
    assert (fpr[k], pro[k]) == pytest.approx((1 / 24, 0.25))
    # 8-connectivity: a diagonal pair is one region
    diag = np.eye(3, dtype=bool)
    _, pro_d = M.pro_curve([diag], [np.array([[1., 0, 0], [0, 0, 0], [0, 0, 0]])])
    assert 1 / 3 in pro_d


def test_aupro_perfect_and_constant_maps():
    rng = np.random.default_rng(1)
    masks, _ = _random_images(rng, [(12, 9), (7, 15), (10, 10)])
    perfect = [m.astype(np.float32) for m in masks]
    assert M.aupro(masks, perfect) == pytest.approx(1.0)
    const = [np.full(m.shape, 0.5) for m in masks]
    # constant map: a single straight segment (0,0)-(1,1): area 0.3^2 / 2, normalised 0.15
    assert M.aupro(masks, const, fpr_limit=0.3) == pytest.approx(0.15)
    assert M.aupro(masks, const, fpr_limit=1.0) == pytest.approx(0.5)
    inverted = [1.0 - p for p in perfect]
    assert M.aupro(masks, inverted) == pytest.approx(0.0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("limit", [0.3, 0.05, 1.0])
def test_aupro_matches_brute_force(seed, limit):
    rng = np.random.default_rng(seed)
    sizes = [tuple(rng.integers(4, 16, size=2)) for _ in range(5)]
    masks, maps = _random_images(rng, sizes, decimals=int(rng.integers(1, 3)),
                                 dtype=np.float64 if seed % 2 else np.float32)
    assert any(m.any() for m in masks)
    expected = _brute_aupro(masks, maps, limit)
    # float64 areas: at most one trapezoid a pixel (a few roundings each, of numbers <= 1),
    # then divided by the limit
    n = sum(m.size for m in masks)
    tol = f64_tol(4 * n) / limit
    assert M.aupro(masks, maps, fpr_limit=limit) == pytest.approx(expected, abs=tol)
    # the compact curve is a subset of the brute-force points with the same area
    b_fpr, b_pro = _brute_pro_curve(masks, maps)
    c_fpr, c_pro = M.pro_curve(masks, maps)
    points = set(zip(np.round(b_fpr, 9), np.round(b_pro, 9)))
    assert set(zip(np.round(c_fpr, 9), np.round(c_pro, 9))) <= points
    assert np.all(np.diff(c_fpr) >= 0) and c_fpr[0] == 0 and c_fpr[-1] == 1
    assert _official_trapezoid(c_fpr, c_pro, limit) == pytest.approx(
        _official_trapezoid(b_fpr, b_pro, limit), abs=tol * limit)
    # one-pass pixel_metrics gives the same values as the separate functions
    allm = M.pixel_metrics(masks, maps, fpr_limit=limit)
    assert allm["aupro"] == M.aupro(masks, maps, fpr_limit=limit)
    assert allm["pixel_auroc"] == pytest.approx(M.pixel_auroc(masks, maps), abs=f64_tol(n))
    assert (allm["pixel_f1_max"], allm["pixel_f1_threshold"]) == M.pixel_f1_max(masks, maps)
    np.testing.assert_array_equal(allm["pro_curve"][0], c_fpr)
    np.testing.assert_array_equal(allm["pro_curve"][1], c_pro)


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------
def test_errors_image_level():
    with pytest.raises(ValueError, match="length mismatch"):
        M.image_auroc([0, 1, 1], [0.1, 0.2])
    with pytest.raises(ValueError, match="one class"):
        M.image_auroc([1, 1, 1], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="one class"):
        M.roc_curve_points([0, 0], [0.1, 0.2])
    with pytest.raises(ValueError, match="empty"):
        M.image_auroc([], [])
    with pytest.raises(ValueError, match="NaN"):
        M.image_auroc([0, 1], [0.1, np.nan])
    with pytest.raises(ValueError, match="0/1"):
        M.image_auroc([0, 2], [0.1, 0.2])
    with pytest.raises(ValueError, match="no anomalous"):
        M.f1_max([0, 0], [0.1, 0.2])
    with pytest.raises(ValueError, match="length mismatch"):
        M.precision_recall_at([0, 1], [0.1], 0.5)


def test_errors_pixel_level():
    good = np.zeros((4, 4), dtype=bool)
    bad = np.zeros((4, 4), dtype=bool)
    bad[1, 1] = True
    with pytest.raises(ValueError, match="length mismatch"):
        M.pixel_auroc([good, bad], [np.zeros((4, 4))])
    with pytest.raises(ValueError, match=r"image 1: mask shape \(4, 4\) != anomaly map shape"):
        M.pixel_auroc([good, bad], [np.zeros((4, 4)), np.zeros((4, 5))])
    with pytest.raises(ValueError, match="image 1"):
        M.aupro([good, bad], [np.zeros((4, 4)), np.zeros((5, 4))])
    with pytest.raises(ValueError, match="one class"):
        M.pixel_auroc([good, good], [np.zeros((4, 4)), np.ones((4, 4))])
    with pytest.raises(ValueError, match="no defect"):
        M.aupro([good, good], [np.zeros((4, 4)), np.ones((4, 4))])
    with pytest.raises(ValueError, match="no defect"):
        M.pro_curve([good], [np.zeros((4, 4))])
    with pytest.raises(ValueError, match="no defect"):
        M.pixel_f1_max([good], [np.zeros((4, 4))])
    with pytest.raises(ValueError, match="empty"):
        M.pixel_auroc([], [])
    nan_map = np.zeros((4, 4))
    nan_map[2, 2] = np.nan
    with pytest.raises(ValueError, match="image 1: anomaly map contains NaN"):
        M.pixel_auroc([good, bad], [np.zeros((4, 4)), nan_map])
    with pytest.raises(ValueError, match="mask values"):
        M.pixel_auroc([bad.astype(np.uint8) * 7], [np.zeros((4, 4))])
    with pytest.raises(ValueError, match="fpr_limit"):
        M.aupro([bad], [np.zeros((4, 4))], fpr_limit=0.0)
    with pytest.raises(ValueError, match="no defect"):
        M.pixel_metrics([good], [np.zeros((4, 4))])
    with pytest.raises(ValueError, match="no normal"):
        M.aupro([np.ones((2, 2), bool)], [np.zeros((2, 2))])
