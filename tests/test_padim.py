"""PaDiM statistics and distances (dense and low-rank forms) against numpy/scipy float64
references."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import F16_EPS, f32_tol
from gaussian_bounds import accumulation_tolerances, batches, mahalanobis_rtol, shifts_of_splits
from scipy.spatial.distance import mahalanobis

from anomaly_hooks.config import ConfigError, load_config
from anomaly_hooks.embedding import PatchEmbedder, random_channel_subset
from anomaly_hooks.errors import ExportError, FitError
from anomaly_hooks.extractor import LayerInfo
from anomaly_hooks.scorers.padim.gaussians import (
    GaussianAccumulator,
    LowRankGaussians,
    SampleStore,
    cholesky_factor_,
    choose_covariance,
    inverse_cholesky,
    lowrank_capacity,
)
from anomaly_hooks.scorers.padim.scorer import PadimScorer


def _embeddings(n=23, d=6, h=3, w=2, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(d, d))
    x = rng.normal(size=(n, h * w, d)) @ base + 50.0  # correlated, large offset
    return torch.from_numpy(x.transpose(0, 2, 1).reshape(n, d, h, w))


@pytest.mark.parametrize("buffer_samples", [4, 128])
def test_streaming_mean_cov_equal_numpy(buffer_samples, device):
    """float32 embeddings (what the backbone gives); the reference is float64 numpy on the same
    values. Samples are centred on the first batch's mean, so the float32 sums of outer products
    hold small numbers: relative error ~1e-6 despite the large offset."""
    emb = _embeddings().float()
    acc = GaussianAccumulator(buffer_samples=buffer_samples)
    for chunk in torch.split(emb.to(device), [5, 1, 9, 8]):
        acc.update(chunk.flatten(2).permute(2, 0, 1))
    x = emb.double().flatten(2).numpy()  # [N, D, P]
    chunks = list(acc.covariances())
    assert [lo for lo, _ in chunks] == [0]  # all 6 positions are in the first chunk
    cov = chunks[0][1].cpu()
    # the accumulator's float32 roundings (gaussian_bounds), batches as fed
    mean_tol, cov_tol = accumulation_tolerances(torch.from_numpy(x).permute(2, 0, 1),
                                                shifts_of_splits(23, [5, 6, 15]))
    for p in range(x.shape[2]):
        np.testing.assert_allclose(acc.mean()[p].cpu().numpy(), x[:, :, p].mean(0), rtol=0,
                                   atol=mean_tol)
        ref = np.cov(x[:, :, p], rowvar=False)
        assert np.all(np.abs(cov[p].numpy() - ref) <= cov_tol[p].numpy())
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
    # the accumulator's float32 roundings (gaussian_bounds): the far-off first batch's mean is
    # the shift, so the second moments about it (variance + 3 sd squared) set the scale
    _, cov_tol = accumulation_tolerances(torch.from_numpy(x32).permute(1, 0, 2),
                                         batches(2000, 32))
    for p in range(3):
        ref = np.cov(x32[:, p], rowvar=False)
        assert np.all(np.abs(cov[p].numpy() - ref) <= cov_tol[p].numpy())


def test_accumulator_rejects_a_different_grid():
    acc = GaussianAccumulator()
    acc.update(torch.rand(6, 3, 4))
    with pytest.raises(ValueError, match="does not match the first batch"):
        acc.update(torch.rand(5, 3, 4))


def _reference(train: torch.Tensor, test: torch.Tensor, eps: float = 0.01) -> np.ndarray:
    """scipy's Mahalanobis distance in float64 of ``test`` [T, D, h, w] to the Gaussians of
    ``train`` [N, D, h, w] (unbiased covariance + eps I), ``[T, h * w]``."""
    x = train.double().flatten(2).numpy()
    t = test.double().flatten(2).numpy()
    out = np.empty((t.shape[0], x.shape[2]))
    for p in range(x.shape[2]):
        vi = np.linalg.inv(np.cov(x[:, :, p], rowvar=False) + eps * np.eye(x.shape[1]))
        mu = x[:, :, p].mean(0)
        for b in range(t.shape[0]):
            out[b, p] = mahalanobis(t[b, :, p], mu, vi)
    return out


def _fit(emb: torch.Tensor, covariance: str, splits=(12,), begin: bool = True,
         factor_dtype: str = "float32", device: torch.device | str = "cpu") -> PadimScorer:
    d = emb.shape[1]
    scorer = PadimScorer(PatchEmbedder([LayerInfo("a", d, 4)], channel_idx=torch.arange(d)),
                         0.01, factor_dtype, covariance)
    if begin:
        scorer.begin(emb.shape[0])
    for chunk in torch.tensor_split(emb.float().to(device), list(splits)):
        scorer.partial_fit(chunk)
    scorer.finalize()
    return scorer


def _distance_rtol(train: torch.Tensor, test: torch.Tensor, splits, ref: np.ndarray) -> np.ndarray:
    """gaussian_bounds.mahalanobis_rtol for ``[N, D, h, w]`` embeddings fed in ``splits``,
    as ``[T, h * w]`` like _reference's distances ``ref``."""
    x = train.double().flatten(2).permute(2, 0, 1)
    t = test.double().flatten(2).permute(2, 0, 1)
    dist = torch.from_numpy(ref).t()
    rtol = mahalanobis_rtol(x, t, shifts_of_splits(x.shape[1], splits), 0.01, dist)
    return rtol.t().numpy()


@pytest.mark.parametrize("covariance", ["dense", "lowrank", "auto"])
def test_mahalanobis_equals_scipy(covariance, device):
    """23 images of 6 dimensions: more images than dimensions, every form still exact."""
    emb = _embeddings()
    scorer = _fit(emb, covariance, device=device)
    assert scorer.gaussians.kind == ("lowrank" if covariance == "lowrank" else "dense")
    test = _embeddings(n=3, seed=1)
    got = scorer.score(test.float().to(device)).flatten(1).cpu().numpy()
    ref = _reference(emb, test)
    assert np.all(np.abs(got - ref) <= _distance_rtol(emb, test, (12,), ref) * ref)


@pytest.mark.parametrize("covariance", ["dense", "lowrank"])
def test_fewer_images_than_dimensions(covariance, device):
    """PaDiM's usual case (e.g. 167 images, 550 channels): a rank-deficient covariance that
    only eps I makes invertible. Low-rank is as exact as the reference allows (the two
    non-negative terms never cancel); dense float32 is within its float32 sums' rounding."""
    rng = np.random.default_rng(3)
    n, d = 9, 40
    x = rng.normal(size=(n, 6, d)) @ rng.normal(size=(d, d)) * 0.3 + 20.0
    emb = torch.from_numpy(x.transpose(0, 2, 1).reshape(n, d, 3, 2))
    test = emb[:3] + torch.from_numpy(rng.normal(size=(3, d, 3, 2)))
    test = torch.cat([test, emb[3:4]])  # a training image too (small distances)
    scorer = _fit(emb, covariance, splits=(4, 5), device=device)
    got = scorer.score(test.float().to(device)).flatten(1).cpu().numpy()
    ref = _reference(emb.float(), test.float())
    rtol = _distance_rtol(emb.float().double(), test.float().double(), (4, 5), ref)
    assert np.all(np.abs(got - ref) <= rtol * ref)


def test_auto_picks_lowrank_for_few_images_and_dense_for_many():
    assert lowrank_capacity(550) == 220
    assert choose_covariance("auto", 167, 550, "float32") == "lowrank"
    assert choose_covariance("auto", 221, 550, "float32") == "dense"
    assert choose_covariance("auto", 167, 550, "float16") == "dense"  # float16 is dense only
    assert choose_covariance("lowrank", 5000, 550, "float32") == "lowrank"
    emb = _embeddings(n=23, d=60)  # capacity 24 for D = 60
    assert _fit(emb, "auto").gaussians.kind == "lowrank"
    assert _fit(torch.cat([emb, emb[:2]]), "auto").gaussians.kind == "dense"


def test_auto_without_begin_switches_to_dense_when_the_images_outnumber_lowrank():
    """Fed batch by batch with no count announced, auto keeps samples until they exceed the
    low-rank capacity, then goes on with dense sums: same distances as a dense fit."""
    emb = _embeddings(n=30, d=20)  # capacity 8
    switched = _fit(emb, "auto", splits=(5, 8, 20), begin=False)
    assert switched.gaussians.kind == "dense"
    small = _fit(emb[:8], "auto", splits=(3,), begin=False)
    assert small.gaussians.kind == "lowrank"
    test = _embeddings(n=2, d=20, seed=4)
    ref = _reference(emb, test)
    got = switched.score(test.float()).flatten(1).numpy()
    assert np.all(np.abs(got - ref) <= _distance_rtol(emb, test, (5, 8, 20), ref) * ref)


def test_sample_store_grows_and_keeps_every_sample():
    store = SampleStore()
    data = torch.randn(5, 37, 3)
    for part in torch.split(data, [1, 2, 13, 21], dim=1):
        store.update(part)
    assert store.n == 37 and store.buf.shape[1] >= 37
    assert torch.equal(store.samples(), data)
    with pytest.raises(ValueError, match="does not match the first batch"):
        store.update(torch.randn(4, 2, 3))


def test_fewer_images_than_announced():
    """begin() announced more images than came (e.g. some were unreadable and skipped)."""
    emb = _embeddings(n=10, d=30)
    d = emb.shape[1]
    scorer = PadimScorer(PatchEmbedder([LayerInfo("a", d, 4)], channel_idx=torch.arange(d)),
                         0.01)
    scorer.begin(12)
    scorer.partial_fit(emb.float())
    scorer.finalize()
    assert scorer.gaussians.kind == "lowrank" and scorer.gaussians.y.shape[1] == 10
    assert scorer.gaussians.y.is_contiguous()
    test = _embeddings(n=2, d=30, seed=6)
    ref = _reference(emb, test)
    got = scorer.score(test.float()).flatten(1).numpy()
    assert np.all(np.abs(got - ref) <= _distance_rtol(emb, test, (), ref) * ref)
    with pytest.raises(RuntimeError, match="already fitted"):
        scorer.partial_fit(emb.float())


def test_begin_after_partial_fit_is_refused():
    scorer = PadimScorer(PatchEmbedder([LayerInfo("a", 4, 4)]), epsilon=0.01)
    scorer.partial_fit(torch.rand(2, 4, 2, 2))
    with pytest.raises(RuntimeError, match="before the first partial_fit"):
        scorer.begin(10)


def _inverse_factor64(mat: torch.Tensor) -> torch.Tensor:
    chol = torch.linalg.cholesky(mat.double())
    return torch.linalg.solve_triangular(chol, torch.eye(mat.shape[-1], dtype=torch.float64)
                                         .expand_as(chol), upper=False)


@pytest.mark.parametrize("m", [5, 32, 100, 167])
def test_inverse_cholesky_equals_float64_lapack(m, device):
    """The recursive blocked factor (batched products) against float64 LAPACK."""
    y = torch.randn(4, m, 3 * m, generator=torch.Generator().manual_seed(m)) * 0.3
    gram = torch.baddbmm(0.01 * torch.eye(m), y, y.transpose(1, 2))
    got = inverse_cholesky(gram.to(device)).cpu()
    ref = _inverse_factor64(gram)
    assert bool((got.triu(1) == 0).all())
    # normwise first-order bounds: the float32 factorisation's backward error (m + 1 roundings
    # of |G|) moves C by |dC| / |C| <= kappa(G) m eps (Sun); the inversion, X = C^-1, moves by
    # |X| kappa(C) times that, plus its own m roundings: |dX| <= f32_tol(2 m, kappa(G)^1.5) |X|
    # with kappa(C) = sqrt(kappa(G)) and |X| = 1 / sqrt(lambda_min) (2-norms, bounding entries)
    lam = torch.linalg.eigvalsh(gram.double())
    kappa = lam[:, -1] / lam[:, 0]
    atol = float((f32_tol(2 * m) * kappa ** 1.5 / lam[:, 0].sqrt()).max())
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=atol)


@pytest.mark.parametrize("m", [40, 150])
def test_dense_factor_equals_float64_lapack(m, device):
    """The dense form's factor (blocked on the CPU above 64) against float64 LAPACK."""
    y = torch.randn(4, 3 * m, m, generator=torch.Generator().manual_seed(m)) * 0.3
    cov = torch.bmm(y.transpose(1, 2), y) / (3 * m)
    work = torch.empty(4, m, m, device=device)
    got = cholesky_factor_(cov.clone().to(device), 0.01, work).cpu()
    ref = torch.linalg.cholesky(cov.double() + 0.01 * torch.eye(m, dtype=torch.float64))
    assert bool((got.triu(1) == 0).all())
    # normwise (Sun): |dL| / |L| <= kappa(A) (m + 1) eps, |L| = sqrt(lambda_max) (2-norms)
    lam = torch.linalg.eigvalsh(ref @ ref.transpose(1, 2))
    atol = float((f32_tol(m + 1) * lam[:, -1] / lam[:, 0] * lam[:, -1].sqrt()).max())
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=atol)


def test_inverse_cholesky_falls_back_to_float64_and_refuses_what_is_not_positive_definite():
    # rank 15 + 1e-6 I, rounded to float32: positive definite, but the float32 factorisation
    # of this seeded draw breaks down (float64 does not)
    v = torch.randn(16, 15, generator=torch.Generator().manual_seed(183), dtype=torch.float64)
    near = (v @ v.T + 1e-6 * torch.eye(16, dtype=torch.float64)).float()
    mats = torch.stack([torch.eye(16), near])
    if int(torch.linalg.cholesky_ex(mats)[1][1]) == 0:
        pytest.skip("float32 factorised the near-singular matrix with this BLAS")
    inv = inverse_cholesky(mats)
    assert torch.equal(inv[0], torch.eye(16))
    assert torch.equal(inv[1], _inverse_factor64(near).float())
    with pytest.raises(ValueError, match="Gram matrix is not positive definite"):
        inverse_cholesky(-mats)
    big = torch.eye(40).repeat(2, 1, 1)
    big[1, 30, 30] = -1.0  # fails in a trailing block of the recursion
    with pytest.raises(ValueError, match="Gram matrix is not positive definite"):
        inverse_cholesky(big)


def test_lowrank_with_float16_is_a_config_error():
    with pytest.raises(ConfigError, match="padim.factor_dtype"):
        load_config(None, padim__covariance="lowrank", padim__factor_dtype="float16")
    with pytest.raises(ConfigError, match="padim.covariance"):
        load_config(None, padim__covariance="diagonal")


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


def test_float16_factors_score_close_to_float32(device):
    emb = _embeddings(n=40, d=8, h=4, w=4).float().to(device)
    test = _embeddings(n=3, d=8, h=4, w=4, seed=2).float()
    layers = [LayerInfo("a", 8, 4)]
    scores = {}
    for dtype in ("float32", "float16"):
        scorer = PadimScorer(PatchEmbedder(layers, channel_idx=torch.arange(8)), 0.01, dtype,
                             "dense")
        scorer.partial_fit(emb)
        scorer.finalize()
        assert scorer.gaussians.chol.dtype == getattr(torch, dtype)
        scores[dtype] = scorer.score(test.to(device)).cpu()
    # the factor's entries rounded to float16 (relative F16_EPS / 2 each), then solved in
    # float32: first order, d**2 = |L^-1 v|**2 moves by 2 |z^T L^-1 dL z| <= F16_EPS |w|^T |L| |z|
    # (z = L^-1 v, w = L^-T z, from the float64 fit), d by that over 2 d; plus both paths'
    # float32 roundings (gaussian_bounds.mahalanobis_rtol)
    x = emb.double().cpu().flatten(2).permute(2, 0, 1)  # [P, n, D]
    t = test.double().cpu().flatten(2).permute(2, 0, 1)  # [P, T, D]
    mean = x.mean(dim=1, keepdim=True)
    centred = x - mean
    chol = torch.linalg.cholesky(centred.transpose(1, 2) @ centred / (x.shape[1] - 1)
                                 + 0.01 * torch.eye(8, dtype=torch.float64))
    v = (t - mean).transpose(1, 2)
    z = torch.linalg.solve_triangular(chol, v, upper=False)
    w = torch.cholesky_solve(v, chol)
    d64 = z.norm(dim=1)  # [P, T]
    half = F16_EPS * (w.abs() * (chol.abs() @ z.abs())).sum(1) / (2 * d64 ** 2)
    rtol = half + 2 * mahalanobis_rtol(x, t, [(0, x.shape[1])], 0.01, d64)
    got, ref = scores["float16"].double().flatten(1).t(), scores["float32"].double().flatten(1).t()
    assert bool(((got - ref).abs() <= rtol * ref).all())


def test_fit_under_inference_mode_then_finalize_outside():
    """A service may feed embeddings produced (and accumulated) under inference_mode."""
    layers = [LayerInfo("a", 6, 4)]
    scorer = PadimScorer(PatchEmbedder(layers, channel_idx=torch.arange(6)), 0.01)
    with torch.inference_mode():
        scorer.partial_fit(_embeddings().float())
    scorer.finalize()
    assert scorer.score(_embeddings(n=2, seed=3).float()).shape == (2, 3, 2)


def test_float16_factors_are_widened_in_large_chunks_on_a_gpu(device):
    """Float16 factors are widened to float32 a chunk of positions at a time: 8 on the CPU
    (cache-sized), on a GPU as many as fit in 256 MB (221 for D = 550; 8 made ~3k small
    launches per batch there). The chunk size does not change the distances."""
    from anomaly_hooks.scorers.padim.gaussians import SCORE_CHUNK, _chunked_distances, half_chunk

    cuda = torch.device("cuda")
    assert half_chunk(550, torch.device("cpu")) == 8
    assert (half_chunk(550, cuda), half_chunk(1792, cuda), half_chunk(64, cuda)) == \
        (221, 20, SCORE_CHUNK)
    layers = [LayerInfo("a", 8, 4)]
    scorer = PadimScorer(PatchEmbedder(layers, channel_idx=torch.arange(8)), 0.01, "float16",
                         "dense")
    scorer.partial_fit(_embeddings(n=40, d=8, h=4, w=4).float().to(device))
    scorer.finalize()
    g = scorer.gaussians
    x = _embeddings(n=3, d=8, h=4, w=4, seed=2).float().to(device).flatten(2).permute(2, 0, 1)
    by_one = _chunked_distances(x, g.mean, 1, g._squared)
    whole = _chunked_distances(x, g.mean, 16, g._squared)  # all 16 positions at once
    torch.testing.assert_close(whole, by_one)
    torch.testing.assert_close(g.distances(x), by_one)


@pytest.mark.parametrize("covariance", ["dense", "lowrank"])
@pytest.mark.parametrize("radius", [1, 2])
def test_neighbourhood_scores_the_least_distance_of_the_nearby_gaussians(covariance, radius):
    """padim.neighbourhood: each patch's least distance to the Gaussians within ``radius``
    cells inside the grid, against scipy distances of every (patch, nearby position) pair."""
    emb = _embeddings(h=4, w=3)
    scorer = _fit(emb, covariance)
    test = _embeddings(n=3, h=4, w=3, seed=1)
    scorer.neighbourhood = radius
    got = scorer.score(test.float()).numpy()  # [T, h, w]
    lo = np.full(got.shape, np.inf)
    hi = np.full(got.shape, np.inf)
    h, w = 4, 3
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            # moved[:, :, q] = test[:, :, q - o] where q - o lies inside the grid
            moved = test.clone()
            for qy in range(h):
                for qx in range(w):
                    py, px = qy - dy, qx - dx
                    if 0 <= py < h and 0 <= px < w:
                        moved[:, :, qy, qx] = test[:, :, py, px]
            ref = _reference(emb, moved)  # [T, h * w]: d(x_{q-o}, G_q) at q
            tol = _distance_rtol(emb, moved, (12,), ref) * ref
            for qy in range(h):
                for qx in range(w):
                    py, px = qy - dy, qx - dx
                    if 0 <= py < h and 0 <= px < w:
                        q = qy * w + qx
                        lo[:, py, px] = np.minimum(lo[:, py, px], ref[:, q] - tol[:, q])
                        hi[:, py, px] = np.minimum(hi[:, py, px], ref[:, q] + tol[:, q])
    assert np.all((lo <= got) & (got <= hi))
    own = _reference(emb, test).reshape(got.shape)
    assert np.all(got <= own * (1 + _distance_rtol(emb, test, (12,), own.reshape(3, -1))
                                .reshape(got.shape)))
    assert np.any(got < 0.9 * own)  # the neighbours do lower some scores


def test_neighbourhood_is_checked_saved_and_not_exported(tmp_path):
    with pytest.raises(ConfigError, match="padim.neighbourhood"):
        load_config(None, padim__neighbourhood=-1)
    with pytest.raises(ConfigError, match="padim.neighbourhood"):
        load_config(None, padim__neighbourhood=5)
    cfg = load_config(None, padim__neighbourhood=1)
    layers = [LayerInfo("a", 6, 4)]
    scorer = PadimScorer.create(cfg.padim, layers, "resnet18", 0)
    assert scorer.neighbourhood == 1
    emb = _embeddings()
    scorer.begin(emb.shape[0])
    scorer.partial_fit(emb.float())
    scorer.finalize()
    assert scorer.summary()["neighbourhood"] == 1
    tensors, meta = scorer.state()
    again = PadimScorer.from_state(cfg.padim, layers, tensors, meta, torch.device("cpu"))
    test = _embeddings(n=2, seed=4).float()
    assert torch.equal(again.score(test), scorer.score(test))
    with pytest.raises(ExportError, match="padim.neighbourhood=1 has no ONNX export"):
        scorer.export_module()


def test_position_chunks_on_threads_give_the_sequential_results_and_their_errors():
    """The fit's per-position work on Python threads (one intra-op thread each) makes what
    the chunks make one after the other, bit for bit; a chunk's error reaches the caller and
    the thread setting comes back."""
    from anomaly_hooks.scorers.padim.loo import loo_distances_from_samples, map_position_chunks

    x = torch.randn(300, 30, 20, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the sequential path
        seq = loo_distances_from_samples(x, 0.01)
        torch.set_num_threads(2)  # the threaded path, whatever the machine's cores
        par = loo_distances_from_samples(x, 0.01)
        assert torch.equal(seq, par)

        def fail(lo: int, hi: int) -> None:
            if lo >= 128:
                raise FitError(f"chunk {lo}")

        with pytest.raises(FitError, match="chunk 128"):
            map_position_chunks(fail, 300, 128, torch.device("cpu"))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("grouped", [False, True])
def test_lowrank_fit_chunks_are_sized_without_the_covariance_and_give_the_same_bits(
        monkeypatch, grouped):
    """The low-rank form has no ``D x D`` work, so its chunks hold more positions than the
    dense form's; whatever the chunk, its Gaussians and leave-one(-group)-out distances are
    the same to the bit."""
    from anomaly_hooks.scorers.padim import gaussians, loo

    cpu = torch.device("cpu")
    for n, d in ((37, 176), (70, 176), (20, 550)):  # low-rank forms: n <= 0.4 D
        per_position = 20 * n * n + 4 * n * d
        assert loo.fit_chunk(n, d, cpu, covariance=False) == min(
            loo.CHUNK_POSITIONS, loo.CHUNK_CACHE_BYTES // per_position)
        assert loo.fit_chunk(n, d, cpu) == max(1, loo.CHUNK_CACHE_BYTES // (
            per_position + 8 * d * d))
    n, d = 12, 64
    x = torch.randn(200, n, d, generator=torch.Generator().manual_seed(4))
    groups = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 5, 6, 6, 7]) if grouped else None

    def fit(chunk: int) -> tuple:
        monkeypatch.setattr(gaussians, "fit_chunk", lambda *a, **k: chunk)
        store = SampleStore(capacity=n)
        store.update(x)
        g = LowRankGaussians.from_samples(store, 0.01, loo=True, groups=groups)
        return g.mean, g.y, g.cinv, g.loo

    first = fit(1)
    for chunk in (7, 64, 200):
        assert all(torch.equal(a, b) for a, b in zip(first, fit(chunk)))
