"""Out-of-sample scores that hold for new parts: groups of images left out together (file
names, near-duplicates), PaDiM's exact leave-one-group-out, PatchCore's cross-fitted folds,
the sharded fit's second pass, and the re-shot scenario that leave-one-out gets wrong."""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import backbone_rtol, f32_tol, f64_tol, knn_distance_tol, textured_images
from PIL import Image

from anomaly_hooks import Detector
from anomaly_hooks.errors import ConfigError, FitError
from anomaly_hooks.fitting import (
    FitRun,
    describe_cross_fit,
    fit_shard,
    out_of_sample_scores,
    second_pass_units,
)
from anomaly_hooks.grouping import (
    blocked_folds,
    duplicate_pairs,
    find_groups,
    median_pair_distance,
    name_pairs,
)
from anomaly_hooks.scorers.padim.loo import (
    DENSE_TOLERANCE,
    covariance_group_out_squared,
    dense_group_out_squared,
    gram_group_out_squared,
    gram_loo_squared,
    group_members,
)

EPS = 0.01


def samples(p: int, n: int, d: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=gen) / math.sqrt(d)
    x = torch.randn(p, n, d, generator=gen) @ mix + 3.0
    x[:, 1] = x[:, 0] + 1e-3 * torch.randn(p, d, generator=gen)  # a near-duplicate pair
    return x.double()


def brute_group_out(x: torch.Tensor, groups: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Float64 refit without each group: squared distances ``[P, n]`` of ``x`` ``[P, n, D]``."""
    p, n, d = x.shape
    out = torch.empty(p, n, dtype=torch.float64)
    for g in torch.unique(groups):
        inside = groups == g
        rest = x[:, ~inside]
        mu = rest.mean(dim=1, keepdim=True)
        u = rest - mu
        cov = u.transpose(1, 2) @ u / (rest.shape[1] - 1) + eps * torch.eye(d, dtype=x.dtype)
        v = (x[:, inside] - mu).transpose(1, 2)
        out[:, inside] = (v * torch.cholesky_solve(v, torch.linalg.cholesky(cov))).sum(dim=1)
    return out


# -- PaDiM: exact leave-one-group-out --------------------------------------------------------
@pytest.mark.parametrize("n, d", [(10, 20), (12, 40), (30, 12), (100, 24)])  # n < D and n > D;
# n = 100 > BLOCK_BASE64: the blocked float64 factor
def test_group_formulas_equal_a_float64_refit(n, d):
    """Formula (4) from the Gram matrix and the series (3) from the dense factor equal a
    refit without the group; singletons equal the leave-one-out formula exactly."""
    x = samples(3, n, d)
    groups = torch.tensor([0, 0, 1, 2, 2, 2] + list(range(3, n - 3)))
    ref = brute_group_out(x, groups)
    mu = x.mean(dim=1, keepdim=True)
    y = (x - mu) / math.sqrt(n - 1)
    gram = torch.baddbmm(EPS * torch.eye(n, dtype=torch.float64), y, y.transpose(1, 2))
    got = gram_group_out_squared(gram, groups, EPS).double()
    u = x - mu
    cov = u.transpose(1, 2) @ u / (n - 1) + EPS * torch.eye(d, dtype=torch.float64)
    # float64 maths (its solves lose the condition number kappa = lambda_max / EPS in digits,
    # over n + d roundings), then the float32 result's own rounding
    f64 = f64_tol(n + d, float(torch.linalg.eigvalsh(cov)[:, -1].max()) / EPS)
    torch.testing.assert_close(got, ref, rtol=f64 + f32_tol(1), atol=0)
    single = torch.arange(n)
    torch.testing.assert_close(gram_group_out_squared(gram, single, EPS),  # two such results
                               gram_loo_squared(gram.clone(), EPS), rtol=2 * f64 + f32_tol(1),
                               atol=0)
    # (3) from the covariance: I - C H cancels, by up to kappa more float64 units
    kappa = float(torch.linalg.eigvalsh(cov)[:, -1].max()) / EPS
    by_cov = covariance_group_out_squared(u, u.transpose(1, 2) @ u / (n - 1), EPS, groups)
    torch.testing.assert_close(by_cov.double(), ref,
                               rtol=f64_tol(n + d, kappa * kappa) + f32_tol(1), atol=0)
    chol = torch.linalg.cholesky(cov)
    for members in group_members(groups).values():
        dense = dense_group_out_squared(u[:, members], chol, n, EPS).double()
        torch.testing.assert_close(dense.reshape(3, -1), ref[:, members.reshape(-1)],
                                   rtol=f64 + f32_tol(1) + DENSE_TOLERANCE, atol=0)


def test_group_members_lists_each_group_by_size():
    got = group_members(torch.tensor([3, 0, 3, 1, 0, 3]))
    assert sorted(got) == [1, 2, 3]
    assert got[1].tolist() == [[3]] and got[2].tolist() == [[1, 4]]
    assert got[3].tolist() == [[0, 2, 5]]


def write_parts(folder: Path, n_parts: int, shots: int, seed: int, prefix: str = "part") -> list:
    """``n_parts`` parts (textured images) photographed ``shots`` times each (a little noise),
    saved as ``{prefix}{k}_shot{s}.png``; returns the paths in name order."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for k, img in enumerate(textured_images(n_parts, seed=seed)):
        for s in range(shots):
            shot = np.clip(img.astype(np.float64) + rng.normal(0, 2.0, img.shape), 0, 255)
            Image.fromarray(shot.astype(np.uint8)).save(folder / f"{prefix}{k:02d}_shot{s}.png")
    return sorted(folder.glob("*.png"))


GROUPED = {"mode": "all-images", "false_alarm_rate": 0.05, "groups": r"^part\d+",
           "near_duplicates": None}


@pytest.mark.parametrize("covariance, keep, dim", [("lowrank", None, 40), ("dense", 2.0, 40),
                                                 ("dense", 0.0, 40), ("dense", 2.0, 8)])
def test_padim_scores_equal_refits_without_the_group(small_cfg, tmp_path, covariance, keep,
                                                     dim, monkeypatch):
    """Each training image's threshold score equals its score from a detector fitted without
    its group (threshold.groups): low-rank and dense from the kept samples (their Gram
    matrices; with more images than dimensions, dim 8, their covariances), and dense from
    the factor in a second pass over whole groups (keep=0)."""
    if keep is not None:
        monkeypatch.setattr("anomaly_hooks.scorers.padim.scorer.DENSE_KEEP_SAMPLES", keep)
    paths = write_parts(tmp_path / "train", 4, 2, seed=3) + \
        write_parts(tmp_path / "more", 3, 1, seed=4, prefix="single")
    cfg = {**small_cfg, "threshold": GROUPED,
           "padim": {"n_features": dim, "covariance": covariance}}
    det = Detector.from_config(cfg).fit(paths, progress=False)
    assert det.scorer_.gaussians.kind == covariance
    oos = det.threshold_.provenance["good"]["out_of_sample"]
    assert oos["scheme"] == "leave-one-group-out" and oos["grouped_by_name"] == 8
    for i in (2, 9):  # part01_shot0 (its twin part01_shot1 goes with it), a singleton
        group = [j for j, p in enumerate(paths)
                 if p.stem.split("_")[0] == paths[i].stem.split("_")[0]]
        refit = Detector.from_config(cfg).fit([p for j, p in enumerate(paths)
                                               if j not in group], progress=False)
        want = refit.predict(paths[i]).score
        # the refit scores image i in another batch (backbone_rtol) and from float32
        # statistics summed in another order (a change of the same kind and size)
        assert det.threshold_.scores[i] == pytest.approx(want, rel=2 * backbone_rtol())


# -- PatchCore: cross-fitted folds ------------------------------------------------------------
def test_patchcore_cross_fit_equals_refits_without_the_fold(small_cfg, tmp_path):
    """A fold's threshold scores equal the scores of a detector fitted on the other folds'
    images (the same coreset rule, seed and index: the coreset never saw the fold)."""
    paths = write_parts(tmp_path / "train", 6, 1, seed=8)
    cfg = {**small_cfg, "method": "patchcore", "patchcore": {"coreset_ratio": 0.25},
           "threshold": {"mode": "all-images", "folds": 3, "near_duplicates": None}}
    det = Detector.from_config(cfg).fit(paths, progress=False)
    assert det.threshold_.provenance["good"]["out_of_sample"]["scheme"].startswith("3 blocked")
    folds = blocked_folds(np.arange(6), 3)
    assert folds.tolist() == [0, 0, 1, 1, 2, 2]
    for f in (0, 2):
        mine = [i for i in range(6) if folds[i] == f]
        refit = Detector.from_config(cfg).fit([p for i, p in enumerate(paths) if i not in mine],
                                              progress=False)
        want = refit.decision_function([paths[i] for i in mine])
        # other batches and other float32 sums, as above
        np.testing.assert_allclose([det.threshold_.scores[i] for i in mine], want,
                                   rtol=2 * backbone_rtol())


def test_folds_of_one_image_are_described_as_leave_one_image_out(small_cfg, tmp_path):
    """Fewer images than folds: every fold holds one image, the scorer gets no groups and
    leaves one image out (the foreign-neighbour search); the provenance says so, not "K
    blocked folds"."""
    paths = write_parts(tmp_path / "train", 4, 1, seed=9)
    cfg = {**small_cfg, "method": "patchcore", "patchcore": {"coreset_ratio": 0.25},
           "threshold": {"mode": "all-images", "near_duplicates": None}}  # PatchCore's 5 folds
    det = Detector.from_config(cfg).fit(paths, progress=False)
    assert det.scorer_.oos_groups is None  # the leave-one-image-out rule ran
    scheme = det.threshold_.provenance["good"]["out_of_sample"]["scheme"]
    assert scheme.startswith("leave-one-image-out") and "folds" not in scheme
    grouping = find_groups(4, None, None, None, None, 0)
    assert describe_cross_fit(grouping, blocked_folds(grouping.groups, 5), None)[
        "scheme"].startswith("leave-one-image-out")
    assert describe_cross_fit(grouping, blocked_folds(grouping.groups, 2), None)[
        "scheme"] == "2 blocked folds of whole groups (cross-fit)"


def test_patchcore_leave_one_image_out_search_equals_brute_force(small_cfg):
    """Without groups the second pass scores each patch by the nearest bank point of another
    image (the rule the folds replaced; still the scorer's default without groups)."""
    imgs = textured_images(6, seed=11)
    cfg = {**small_cfg, "method": "patchcore", "patchcore": {"coreset_ratio": 0.25},
           "threshold": {"mode": "all-images", "near_duplicates": None}}
    det = Detector.from_config(cfg).fit(imgs, progress=False)
    sc = det.scorer_
    sc.set_out_of_sample_groups(None)
    batch, _ = det.prepare([imgs[2]])
    emb = det.embed(batch, scorer=sc)
    patches = emb.permute(0, 2, 3, 1).reshape(-1, emb.shape[1]).double()  # [h w, D] rows
    others = sc.bank[sc.bank_image != 2].double()
    brute = torch.cdist(patches, others).min(dim=1).values
    with torch.inference_mode():
        got = sc.out_of_sample_scores(emb, [2]).flatten()
    tol = knn_distance_tol(patches, others, brute[:, None])[:, 0]
    assert bool(((got.double() - brute).abs() <= tol).all())


# -- the sharded fit's steps, in one process --------------------------------------------------
def sharded(cfg, paths, bounds) -> Detector:
    """The steps of ``distributed.fit`` on the shards ``bounds`` (``[lo, hi)`` ranges of the
    training list), in this process (no Ray): shard states, merge, groups, finalize, the
    second pass over units from a payload, defects, complete."""
    from anomaly_hooks.distributed.fitting import scorer_from_payload, scorer_payload

    det = Detector.from_config(cfg)
    run = FitRun(det, paths, progress=False)
    results = [fit_shard(det, run.plan.train[lo:hi], len(run.plan.train), descriptors=True)
               for lo, hi in bounds]
    merged = run.add_shards(results)
    run.set_groups()
    run.finalize(merged)

    def second_pass(scorer, units):
        payload = scorer_payload(scorer)
        worker = Detector.from_config(cfg)
        return [out_of_sample_scores(worker, scorer_from_payload(worker, payload),
                                     run.unit_items(u), u) for u in units]

    good = run.threshold_scores(second_pass)
    run.defect_scores()
    run.complete(good)
    return det


@pytest.mark.parametrize("method, section", [
    ("padim", {"n_features": 40, "covariance": "dense"}),
    ("patchcore", {"coreset_ratio": 0.25})])
def test_sharded_steps_equal_the_single_process_fit(small_cfg, tmp_path, method, section,
                                                    monkeypatch):
    """PaDiM dense (second pass over whole groups on the workers) and PatchCore (fold banks
    from the merged candidates; shards keep every patch at a 0.25 ratio) give the
    single-process fit's threshold scores."""
    monkeypatch.setattr("anomaly_hooks.scorers.padim.scorer.DENSE_KEEP_SAMPLES", 0.0)
    paths = write_parts(tmp_path / "train", 5, 2, seed=5)
    cfg = {**small_cfg, "method": method, method: section,
           "threshold": {**GROUPED, "near_duplicates": 0.5}}
    single = Detector.from_config(cfg).fit(paths, progress=False)
    dist = sharded(cfg, paths, [(0, 4), (4, len(paths))])
    # the shards' batches and sums against the single fit's: other kernels in the backbone
    # (backbone_rtol) and float32 statistics in another order (a change of the same size);
    # the threshold, a smooth function of the scores, moves as they do
    rtol = 2 * backbone_rtol()
    np.testing.assert_allclose(dist.threshold_.scores, single.threshold_.scores, rtol=rtol)
    assert dist.threshold_.provenance == single.threshold_.provenance
    assert dist.threshold_.value == pytest.approx(single.threshold_.value, rel=rtol)


def test_second_pass_units_keep_groups_whole(small_cfg):
    det = Detector.from_config({**small_cfg, "padim": {"covariance": "dense"}})
    sc = det.new_scorer()
    sc.set_out_of_sample_groups([0, 0, 1, 2, 2, 2, 3, 4, 4])
    assert sc.out_of_sample_whole_groups
    assert second_pass_units(sc, 9, 4) == [[0, 1, 2], [3, 4, 5, 6], [7, 8]]
    sc.set_out_of_sample_groups(None)
    assert second_pass_units(sc, 9, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]


# -- groups ------------------------------------------------------------------------------------
def test_name_groups_use_the_first_capture_group():
    names = ["a_1.png", "b_1.png", "a_2.png", "c.png", "b_2.png"]
    assert name_pairs(names, r"^([a-z])_") == [(0, 2), (1, 4)]
    g = find_groups(5, names, r"^([a-z])_", None, None, 0)
    assert g.groups.tolist() == [0, 1, 0, 2, 1] and g.by_name == 4
    with pytest.raises(ConfigError, match="not a regular expression"):
        name_pairs(names, "(")
    with pytest.raises(ConfigError, match="file paths"):
        find_groups(5, None, r"^a", None, None, 0)
    with pytest.raises(FitError, match="all 3 training images fall in one group"):
        find_groups(3, ["x1", "x2", "x3"], "x", None, None, 0)


def test_near_duplicates_are_pairs_closer_than_a_fraction_of_the_median():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 64))
    x[7] = x[3] + 1e-3 * rng.normal(size=64)  # a re-shot
    x[8] = x[7] + 1e-3 * rng.normal(size=64)  # and another (linked through 7)
    d = np.linalg.norm(x[:, None] - x[None], axis=2)
    med = float(np.median(d[np.triu_indices(40, 1)]))
    # float64 distances by another formula: |a|^2 + |b|^2 - 2 a.b rounds 64 + 3 times at
    # magnitudes up to twice the largest squared norm, the square root halves that over d
    big = 2 * float((x ** 2).sum(1).max())
    assert median_pair_distance(x, 0) == pytest.approx(med, rel=0,
                                                       abs=f64_tol(64 + 3, big) / (2 * med))
    pairs, got_med = duplicate_pairs(x, 0.5, 0)
    brute = [(i, j) for i in range(40) for j in range(i + 1, 40) if d[i, j] < 0.5 * med]
    assert sorted(pairs) == brute == [(3, 7), (3, 8), (7, 8)]
    g = find_groups(40, None, None, x, 0.5, 0)
    assert g.groups[3] == g.groups[7] == g.groups[8] and g.grouped_images == 3
    assert g.n_groups == 38 and g.summary([f"{i}.png" for i in range(40)])[
        "near_duplicate_examples"][0] == ["3.png", "7.png"]


def test_near_duplicate_links_that_chain_across_parts_are_tightened():
    """Images along a smooth drift (one texture, a slowly moving pose): every image is within
    half the median distance of its neighbours, so the links chain into one group of all of
    them. The ratio is halved until no group holds more than half the images, with a
    warning; real re-shots (at 1e-3 of the spacing) stay grouped."""
    n = 40
    t = np.linspace(0.0, 1.0, n)
    x = np.stack([np.cos(3 * t), np.sin(3 * t), t], axis=1) * 10.0  # a curve: spacing ~0.8
    x[7] = x[3] + 1e-3  # a re-shot of image 3
    with pytest.warns(UserWarning, match="linked 40 of the 40 training images") as said:
        g = find_groups(n, None, None, x, 0.5, 0)
    sizes = np.bincount(g.groups)
    assert sizes.max() <= n // 2
    assert g.groups[3] == g.groups[7] and g.ratio_used < 0.5
    assert g.summary()["near_duplicate_ratio"] == g.ratio_used
    # the warning says what the fraction used links
    assert (f"used {g.ratio_used:g}, at which {sizes[sizes > 1].sum()} images link into "
            f"groups of at most {sizes.max()}") in str(said[0].message)
    # equal steps along a line: the links chain until the fraction drops below one step,
    # where every link goes at once
    line = np.outer(np.arange(n), [1.0, 2.0, 0.5])
    with pytest.warns(UserWarning, match="at which no two images are near-duplicates"):
        h = find_groups(n, None, None, line, 0.5, 0)
    assert h.grouped_images == 0 and h.ratio_used < 0.5
    # without chaining nothing changes and nothing is said
    rng = np.random.default_rng(0)
    y = rng.normal(size=(n, 64))
    y[7] = y[3] + 1e-3 * rng.normal(size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h = find_groups(n, None, None, y, 0.5, 0)
    assert h.ratio_used == 0.5 and h.grouped_images == 2


def test_sampled_median_is_close_to_the_exact_one(monkeypatch):
    x = np.random.default_rng(1).normal(size=(300, 16))
    exact = median_pair_distance(x, 0)
    monkeypatch.setattr("anomaly_hooks.grouping.MEDIAN_PAIRS", 5000)
    # sampling, not rounding: the median of m random pairs has a standard error of about
    # sqrt(pi / 2) sd / sqrt(m) (the distances' sd); allow 6 of them
    d = np.linalg.norm(x[:, None] - x[None], axis=2)[np.triu_indices(300, 1)]
    se = math.sqrt(math.pi / 2) * float(d.std()) / math.sqrt(5000)
    assert median_pair_distance(x, 0) == pytest.approx(exact, rel=0, abs=6 * se)


def test_blocked_folds_keep_groups_whole_and_balance_images():
    groups = np.array([0, 0, 0, 1, 2, 3, 3, 4, 5, 6, 7, 7])
    folds = blocked_folds(groups, 3)
    for g in np.unique(groups):
        assert len(set(folds[groups == g])) == 1
    assert np.bincount(folds).tolist() == [4, 4, 4]
    assert (np.diff(folds) >= 0).all()  # consecutive stretches of the fit order
    assert blocked_folds(np.array([0, 0, 1]), 5).tolist() == [0, 0, 1]  # fewer groups


# -- the scenario leave-one-out gets wrong -----------------------------------------------------
@pytest.mark.parametrize("method", ["padim", "patchcore"])
def test_reshots_of_a_part_do_not_lower_the_threshold(small_cfg, tmp_path, method):
    """Twelve parts photographed three times each: leave-one-out scores a shot with its twins
    in the model, so its 5 % threshold flags most new parts (PaDiM); with the shots grouped as
    near-duplicates (the default) the false alarms on new parts are consistent with the
    recorded interval's upper end (binomial test), for both methods."""
    from scipy.stats import binom

    paths = write_parts(tmp_path / "train", 12, 3, seed=20)
    new_parts = textured_images(40, seed=21)
    cfg = {**small_cfg, "method": method, "threshold": {"mode": "all-images",
                                                         "false_alarm_rate": 0.05}}
    det = Detector.from_config(cfg).fit(paths, progress=False)
    flagged = int((det.decision_function(new_parts) > det.threshold_.value).sum())
    assert det.threshold_.provenance["good"]["out_of_sample"]["grouped_images"] == 36
    assert binom.sf(flagged - 1, 40, det.threshold_.far_interval[1]) >= 0.05
    if method == "padim":
        plain = Detector.from_config({**cfg, "threshold": {**cfg["threshold"],
                                                           "near_duplicates": None}})
        plain.fit(paths, progress=False)
        loo = int((plain.decision_function(new_parts) > plain.threshold_.value).sum())
        assert binom.sf(loo - 1, 40, plain.threshold_.far_interval[1]) < 0.001
