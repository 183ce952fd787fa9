"""PaDiM statistics and distances against numpy/scipy float64 references."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.spatial.distance import mahalanobis

from anomaly_hooks.embedding import PatchEmbedder, random_channel_subset
from anomaly_hooks.extractor import LayerInfo
from anomaly_hooks.scorers.padim import GaussianAccumulator, PadimScorer


def _embeddings(n=23, d=6, h=3, w=2, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(d, d))
    x = rng.normal(size=(n, h * w, d)) @ base + 50.0  # correlated, large offset
    return torch.from_numpy(x.transpose(0, 2, 1).reshape(n, d, h, w))


@pytest.mark.parametrize("buffer_samples", [4, 128])
def test_streaming_mean_cov_equal_numpy(buffer_samples):
    """float32 embeddings (what the backbone gives); the reference is float64 numpy on the same
    values. Samples are centred on the first batch's mean, so the float32 sums of outer products
    hold small numbers: relative error ~1e-6 despite the large offset."""
    emb = _embeddings().float()
    acc = GaussianAccumulator(buffer_samples=buffer_samples)
    for chunk in torch.split(emb, [5, 1, 9, 8]):
        acc.update(chunk.flatten(2).permute(2, 0, 1))
    x = emb.double().flatten(2).numpy()  # [N, D, P]
    chunks = list(acc.covariances())
    assert [lo for lo, _ in chunks] == [0]  # all 6 positions are in the first chunk
    cov = chunks[0][1]
    for p in range(x.shape[2]):
        # the model keeps the mean in float32: float32 precision is what matters
        np.testing.assert_allclose(acc.mean()[p].numpy(), x[:, :, p].mean(0), rtol=1e-7)
        ref = np.cov(x[:, :, p], rowvar=False)
        np.testing.assert_allclose(cov[p].numpy(), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    with pytest.raises(RuntimeError, match="already computed"):
        list(acc.covariances())
    with pytest.raises(RuntimeError, match="already computed"):
        acc.update(emb[:2].flatten(2).permute(2, 0, 1))


def test_many_images_keep_float32_sums_accurate():
    """2000 samples with a large offset that drifts after the first batch (so the shift is not
    the mean): the float32 in-place sums still match float64 numpy to ~1e-5."""
    rng = np.random.default_rng(5)
    d = 8
    x = rng.normal(size=(2000, 3, d)) @ rng.normal(size=(d, d)) + 100.0
    x[32:] += 3.0  # the first batch's mean is off by 3 standard deviations
    acc = GaussianAccumulator()
    for lo in range(0, 2000, 32):
        acc.update(torch.from_numpy(x[lo:lo + 32]).float().permute(1, 0, 2))
    x32 = torch.from_numpy(x).float().double().numpy()
    cov = dict(acc.covariances())[0]
    for p in range(3):
        ref = np.cov(x32[:, p], rowvar=False)
        np.testing.assert_allclose(cov[p].numpy(), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


def test_accumulator_rejects_a_different_grid():
    acc = GaussianAccumulator()
    acc.update(torch.rand(6, 3, 4))
    with pytest.raises(ValueError, match="does not match the first batch"):
        acc.update(torch.rand(5, 3, 4))


def test_mahalanobis_equals_scipy():
    emb = _embeddings()
    d = emb.shape[1]
    layers = [LayerInfo("a", d, 4)]
    scorer = PadimScorer(PatchEmbedder(layers, channel_idx=torch.arange(d)), epsilon=0.01)
    scorer.partial_fit(emb[:12].float())
    scorer.partial_fit(emb[12:].float())
    scorer.finalize()
    test = _embeddings(n=3, seed=1)
    got = scorer.score(test.float()).numpy()
    x = emb.flatten(2).numpy()
    for p in range(x.shape[2]):
        cov = np.cov(x[:, :, p], rowvar=False) + 0.01 * np.eye(d)
        vi = np.linalg.inv(cov)
        mu = x[:, :, p].mean(0)
        for b in range(3):
            ref = mahalanobis(test[b].flatten(1)[:, p].numpy(), mu, vi)
            assert got[b].ravel()[p] == pytest.approx(ref, rel=2e-4)


def test_needs_two_images():
    scorer = PadimScorer(PatchEmbedder([LayerInfo("a", 4, 4)]), epsilon=0.01)
    scorer.partial_fit(torch.rand(1, 4, 2, 2))
    with pytest.raises(ValueError, match="at least 2"):
        scorer.finalize()


def test_channel_subset_seeded_and_checked():
    a = random_channel_subset(1792, 550, seed=3)
    assert torch.equal(a, random_channel_subset(1792, 550, seed=3))
    assert not torch.equal(a, random_channel_subset(1792, 550, seed=4))
    assert a.unique().numel() == 550 and bool((a[1:] > a[:-1]).all())
    with pytest.raises(ValueError, match="cannot pick 600 channels out of 448"):
        random_channel_subset(448, 600, seed=0)


def test_subset_before_upsampling_equals_after():
    layers = [LayerInfo("l1", 4, 4), LayerInfo("l2", 6, 8)]
    feats = {"l1": torch.rand(2, 4, 8, 8), "l2": torch.rand(2, 6, 4, 4)}
    idx = torch.tensor([1, 3, 4, 8, 9])
    got = PatchEmbedder(layers, channel_idx=idx)(feats)
    full = PatchEmbedder(layers)(feats)
    assert torch.equal(got, full[:, idx])
    up = torch.nn.functional.interpolate(feats["l2"], size=(8, 8), mode="nearest")
    assert torch.equal(full, torch.cat([feats["l1"], up], dim=1))


def test_float16_factors_score_close_to_float32():
    emb = _embeddings(n=40, d=8, h=4, w=4).float()
    layers = [LayerInfo("a", 8, 4)]
    scores = {}
    for dtype in ("float32", "float16"):
        scorer = PadimScorer(PatchEmbedder(layers, channel_idx=torch.arange(8)), 0.01, dtype)
        scorer.partial_fit(emb)
        scorer.finalize()
        assert scorer.chol.dtype == getattr(torch, dtype)
        scores[dtype] = scorer.score(_embeddings(n=3, d=8, h=4, w=4, seed=2).float())
    torch.testing.assert_close(scores["float16"], scores["float32"], rtol=2e-3, atol=1e-3)


def test_fit_under_inference_mode_then_finalize_outside():
    """A service may feed embeddings produced (and accumulated) under inference_mode."""
    layers = [LayerInfo("a", 6, 4)]
    scorer = PadimScorer(PatchEmbedder(layers, channel_idx=torch.arange(6)), 0.01)
    with torch.inference_mode():
        scorer.partial_fit(_embeddings().float())
    scorer.finalize()
    assert scorer.score(_embeddings(n=2, seed=3).float()).shape == (2, 3, 2)
