"""PatchCore at high resolution: the per-image pre-reduction of the coreset (against the exact
greedy and brute-force coverage radii) and the index choice by bank size (recall)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import textured_images

from anomaly_hooks import Detector
from anomaly_hooks.config import load_config
from anomaly_hooks.errors import ConfigError
from anomaly_hooks.extractor import LayerInfo
from anomaly_hooks.scorers.patchcore.coreset import coreset_size, coverage_radius, greedy_coreset
from anomaly_hooks.scorers.patchcore.prereduce import PerImageReduction
from anomaly_hooks.scorers.patchcore.scorer import PatchCoreScorer


def image_patches(n_images: int, per_image: int = 400, d: int = 48, clusters: int = 30,
                  seed: int = 0) -> torch.Tensor:
    """``[n_images, per_image, d]``: every image a draw from the same mixture (the training
    images of one part: alike, never equal), with a few rare patches of its own."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, d, generator=gen) * 3
    weights = torch.linspace(1.0, 0.05, clusters)
    pick = torch.multinomial(weights, n_images * per_image, replacement=True, generator=gen)
    x = centres[pick] + 0.7 * torch.randn(n_images * per_image, d, generator=gen)
    return x.view(n_images, per_image, d)


def reduced_bank(patches: torch.Tensor, ratio: float, oversample: float, seed: int = 3):
    """The scorer's two steps: per-image reduction, then the greedy over what was kept."""
    red = PerImageReduction(oversample, ratio, None, patches.shape[0], 32, seed)
    red.add(patches, 0)
    kept, images = red.take()
    k = coreset_size(patches.shape[0] * patches.shape[1], ratio, None)
    idx = greedy_coreset(kept, k, 32, seed)
    return kept, images, kept[idx], images[idx]


def test_keep_count_is_the_images_share_times_the_oversampling():
    red = PerImageReduction(8, 0.01, None, 200, 128, 0)
    assert red.keep_count(9600) == math.ceil(8 * 0.01 * 9600)
    assert PerImageReduction(200, 0.01, None, 10, None, 0).keep_count(500) == 500  # all of it
    assert PerImageReduction(4, None, 1000, 100, None, 0).keep_count(5000) == 40
    # images not announced: a count is shared as if by one image (more points, never fewer)
    assert PerImageReduction(4, None, 1000, None, None, 0).keep_count(5000) == 4000
    with pytest.raises(ValueError, match="oversample"):
        PerImageReduction(0.5, 0.1, None, 1, None, 0)


def test_each_image_is_reduced_by_the_greedy_rule_and_remembers_its_image():
    patches = image_patches(3)
    red = PerImageReduction(5, 0.02, None, 3, 32, 7)
    out = red.add(patches, first_image=10)
    kept, images = red.take()
    m = red.keep_count(400)
    assert torch.equal(out, kept) and kept.shape == (3 * m, 48)
    for i in range(3):
        idx = greedy_coreset(patches[i], m, 32, 7)
        assert torch.equal(kept[i * m:(i + 1) * m], patches[i][idx])
    assert images.tolist() == [10] * m + [11] * m + [12] * m
    with pytest.raises(ValueError, match="no patches"):
        red.take()


def test_coverage_radius_bound_and_closeness_to_the_exact_greedy():
    """Every training patch is within max(r_i) + r_u of the bank (r_i: an image's coverage by
    what it kept, r_u: the kept points' coverage by the bank; brute force, full space), and on
    images alike the radius stays within 1.1 x the exact greedy's at the same size."""
    patches = image_patches(24, seed=1)
    flat = patches.reshape(-1, patches.shape[-1])
    ratio, oversample = 0.02, 8.0
    kept, images, bank, _ = reduced_bank(patches, ratio, oversample)
    r_i = max(coverage_radius(patches[i], kept[images == i]) for i in range(24))
    r_u = coverage_radius(kept, bank)
    radius = coverage_radius(flat, bank)
    assert radius <= (r_i + r_u) * (1 + 1e-5)
    exact = flat[greedy_coreset(flat, bank.shape[0], 32, 3)]
    assert bank.shape == exact.shape
    assert radius <= 1.1 * coverage_radius(flat, exact)


def _scorer(**section) -> PatchCoreScorer:
    cfg = load_config({"method": "patchcore", "patchcore": section}).patchcore
    return PatchCoreScorer.create(cfg, [LayerInfo("a", 48, 8)], "custom", seed=0)


def _embeddings(patches: torch.Tensor, side: int = 20) -> torch.Tensor:
    """``[n, P, D]`` patches as embeddings ``[n, D, side, P / side]``."""
    n, p, d = patches.shape
    return patches.view(n, side, p // side, d).permute(0, 3, 1, 2)


def test_a_prereduced_fit_selects_from_the_kept_points_and_knows_their_images():
    patches = image_patches(6)
    scorer = _scorer(coreset_ratio=0.05, prereduce=4, projection_dim=32)
    scorer.begin(6)
    scorer.partial_fit(_embeddings(patches[:4]))
    scorer.partial_fit(_embeddings(patches[4:]))
    scorer.finalize()
    assert scorer.bank.shape[0] == coreset_size(6 * 400, 0.05, None)
    assert scorer.n_patches == 2400 and scorer.take_out_of_sample_scores() is None
    for row, image in zip(scorer.bank, scorer.bank_image.tolist()):
        # each bank point is one of its own image's patches
        assert float((patches[image] - row).abs().sum(dim=1).min()) == 0.0
    # the same seed: the same bank
    again = _scorer(coreset_ratio=0.05, prereduce=4, projection_dim=32)
    again.begin(6)
    again.partial_fit(_embeddings(patches))
    again.finalize()
    assert torch.equal(again.bank, scorer.bank)


def test_an_oversampling_that_keeps_every_patch_is_the_exact_fit():
    patches = _embeddings(image_patches(4))
    exact = _scorer(coreset_ratio=0.1, projection_dim=32)
    reduced = _scorer(coreset_ratio=0.1, projection_dim=32, prereduce=10)
    for s in (exact, reduced):
        s.begin(4)
        s.partial_fit(patches)
        s.finalize()
    assert torch.equal(exact.bank, reduced.bank)
    assert torch.equal(exact.bank_image, reduced.bank_image)


def test_a_bounded_fit_counts_the_patches_the_kept_points_stand_for():
    patches = _embeddings(image_patches(6))
    scorer = _scorer(coreset_ratio=0.05, prereduce=2, max_bank_points=400, projection_dim=32)
    scorer.begin(6)
    scorer.partial_fit(patches)
    scorer.finalize()
    assert scorer.bank.shape[0] == coreset_size(2400, 0.05, None)  # of all, not of the kept


def test_a_prereduced_shard_merges_like_a_single_fit():
    patches = _embeddings(image_patches(6))
    single = _scorer(coreset_ratio=0.05, prereduce=4, projection_dim=32)
    single.begin(6)
    single.partial_fit(patches)
    single.finalize()
    shard = _scorer(coreset_ratio=0.05, prereduce=4, projection_dim=32)
    shard.begin_shard(6, 6)
    shard.partial_fit(patches)
    merged = PatchCoreScorer.merge_states([shard.partial_state()])
    fresh = _scorer(coreset_ratio=0.05, prereduce=4, projection_dim=32)
    fresh.finalize_merged(merged, torch.device("cpu"))
    assert torch.equal(fresh.bank, single.bank)
    assert torch.equal(fresh.bank_image, single.bank_image)
    halves = []
    for lo in (0, 3):  # two shards: the images' ids stay fit-wide
        part = _scorer(coreset_ratio=0.05, prereduce=4, projection_dim=32)
        part.begin_shard(6, 3)
        part.partial_fit(patches[lo:lo + 3])
        halves.append(part.partial_state())
    both = PatchCoreScorer.merge_states(halves)
    assert both["n_train"] == 6 and set(np.unique(both["image"]).tolist()) <= set(range(6))
    assert np.unique(both["image"][both["image"] >= 3]).size > 0


def test_prereduce_is_checked_and_lowers_the_memory_estimate():
    with pytest.raises(ConfigError, match=r"patchcore\.prereduce"):
        load_config({"method": "patchcore", "patchcore": {"prereduce": 0.5}})
    layers = [LayerInfo("a", 100, 8), LayerInfo("b", 52, 16)]
    plain = load_config({"method": "patchcore", "patchcore": {"coreset_ratio": 0.01}})
    reduced = load_config({"method": "patchcore",
                           "patchcore": {"coreset_ratio": 0.01, "prereduce": 8}})
    a = PatchCoreScorer.estimate_memory(plain, layers, (640, 960), 200)
    b = PatchCoreScorer.estimate_memory(reduced, layers, (640, 960), 200)
    part = "patch features before the coreset"
    assert b[part] < 0.1 * a[part] and b["model"] == a["model"]


def test_a_prereduced_detector_scores_its_training_images_out_of_sample(small_cfg):
    cfg = {**small_cfg, "method": "patchcore", "threshold": {"mode": "all-images"},
           "patchcore": {"coreset_ratio": 0.05, "prereduce": 4}}
    det = Detector.from_config(cfg).fit(textured_images(8), progress=False)
    assert det.threshold_.n_images == 8 and det.scorer_.bank_image is not None
    assert np.isfinite(det.threshold_.value)


# -- the index by bank size ---------------------------------------------------------------------
@pytest.mark.parametrize("shape, queries, expected", [
    ((19_200, 152), 9_600, "faiss-ivf"),     # a 0.6 MP frame's grid, 1 % bank of 200 images
    ((16_386, 152), 784, "faiss-flat"),      # the 224-px default (EfficientNet-Lite0, 10 %)
    ((30_600, 1536), 784, "projected"),      # the published WRN50 protocol, 391 images, 10 %
    ((19_200, 152), None, "faiss-flat"),     # no query count given: the exact rule as before
    ((3_000, 152), 1_000_000, "faiss-flat"),  # too few rows to train an IVF index
])
def test_auto_index_by_the_cost_of_one_images_exact_search(shape, queries, expected):
    from anomaly_hooks.scorers.patchcore.knn import resolve_backend

    assert resolve_backend("auto", torch.device("cpu"), shape, torch.float32,
                           queries) == expected
    assert resolve_backend("faiss-flat", torch.device("cpu"), shape, torch.float32,
                           queries) == "faiss-flat"  # an explicit choice is kept


def test_the_auto_chosen_index_of_a_large_grid_has_high_recall():
    """A scorer whose grid makes the exact search costly gets IVF; its recall@1 against brute
    force on clustered data, and its distances never below the exact ones."""
    gen = torch.Generator().manual_seed(4)
    centres = torch.randn(200, 64, generator=gen) * 2
    bank = centres[torch.randint(200, (20_000,), generator=gen)] + \
        torch.randn(20_000, 64, generator=gen)
    queries = centres[torch.randint(200, (3_000,), generator=gen)] + \
        torch.randn(3_000, 64, generator=gen)
    scorer = _scorer(coreset_ratio=0.5, k=1)
    scorer.grid = (160, 160)  # 25,600 queries per image: 3.3e10 multiply-adds exactly
    scorer.set_bank(bank)
    assert scorer.index.backend == "faiss-ivf"
    dist, idx = scorer.index.search(queries, 1)
    ref = torch.cdist(queries.double(), bank.double()).min(dim=1)
    assert float((idx[:, 0] == ref.indices).float().mean()) >= 0.99
    assert bool((dist[:, 0].double() >= ref.values - 1e-4).all())
