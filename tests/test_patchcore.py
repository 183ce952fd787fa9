"""PatchCore: coreset selection and kNN search against brute-force float64 references."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from conftest import f32_tol, knn_distance_tol, textured_images, with_defect

from anomaly_hooks import Detector
from anomaly_hooks.config import load_config
from anomaly_hooks.devices import CUDA_BLOCK_ELEMENTS
from anomaly_hooks.extractor import LayerInfo
from anomaly_hooks.scorers.patchcore.coreset import (
    StreamingCoreset,
    coreset_size,
    coverage_radius,
    first_index,
    greedy_batched,
    greedy_coreset,
    greedy_dense,
    random_projection,
)
from anomaly_hooks.scorers.patchcore.knn import WIDEN_BYTES, NearestNeighbors
from anomaly_hooks.scorers.patchcore.scorer import PatchCoreScorer


def clustered(n: int = 3000, d: int = 96, clusters: int = 40, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, d, generator=gen) * 4
    pick = torch.randint(clusters, (n,), generator=gen)
    return centres[pick] + torch.randn(n, d, generator=gen)


def brute_force_greedy(features: torch.Tensor, k: int, projection_dim, seed: int) -> list[int]:
    """The greedy k-center rule in float64, one full pass per selection."""
    x = random_projection(features, projection_dim, seed).double()
    selected = [first_index(len(x), seed)]
    min_d = torch.linalg.vector_norm(x - x[selected[0]], dim=1)
    min_d[selected] = -1
    while len(selected) < k:
        idx = int(torch.argmax(min_d))
        selected.append(idx)
        min_d = torch.minimum(min_d, torch.linalg.vector_norm(x - x[idx], dim=1))
        min_d[selected] = -1
    return selected


# -- coreset ------------------------------------------------------------------------------
@pytest.mark.parametrize("projection_dim", [None, 32])
@pytest.mark.parametrize("k", [1, 7, 300])
def test_fast_selection_equals_brute_force(projection_dim, k, device):
    x = clustered()
    ref = brute_force_greedy(x, k, projection_dim, seed=5)
    for method in ("batched", "pruned", "dense"):
        got = greedy_coreset(x.to(device), k, projection_dim, seed=5, method=method)
        assert got.device.type == device.type and got.tolist() == ref, method


def brute_force_points(x: np.ndarray, k: int, start: int) -> list[int]:
    """The greedy rule in float64 on given float32 points (no projection, no centring)."""
    x64 = x.astype(np.float64)
    m = np.full(len(x), np.inf)
    idx, out = start, []
    for _ in range(k):
        out.append(idx)
        m = np.minimum(m, ((x64 - x64[idx]) ** 2).sum(1))
        m[idx] = -1.0
        idx = int(np.argmax(m))
    return out


@pytest.mark.parametrize("pool,dims", [(2, None), (16, 4), (2048, None), (2048, 24)])
def test_batched_equals_brute_force_with_duplicates_and_small_pools(pool, dims):
    # exact duplicates (ties broken by the lowest index), near-ties and a few far outliers
    rng = np.random.default_rng(0)
    base = rng.normal(size=(400, 24)).astype(np.float32)
    x = np.concatenate([base, base[:150], base[:50] + np.float32(1e-3),
                        rng.normal(size=(5, 24)).astype(np.float32) * 20])
    st = {}
    got = greedy_batched(x, 500, 3, stats=st, pool=pool, dims=dims)
    assert got.tolist() == brute_force_points(x, 500, 3)
    assert st["batches"] >= 1 and st["exact_fraction"] <= 1.0
    assert st["bound_dims"] == (dims or st["bound_dims"]) and 1 <= st["bound_dims"] <= 24


def test_batched_falls_back_to_plain_steps_when_the_pool_cannot_certify():
    # every point but one is a duplicate of two others: the pool's top values tie with the
    # points left outside, so picks come from plain steps; still the brute-force order
    rng = np.random.default_rng(1)
    x = np.repeat(rng.normal(size=(60, 8)).astype(np.float32), 3, axis=0)
    st = {}
    got = greedy_batched(x, 150, 0, stats=st, pool=8)
    assert got.tolist() == brute_force_points(x, 150, 0)
    assert st["plain_steps"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dense_coreset_never_synchronises_on_cuda():
    x = clustered(n=2000).cuda()
    ref = greedy_coreset(x.cpu(), 50, 32, seed=1, method="dense")
    xp = x - x.mean(dim=0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = greedy_dense(xp, 50, 7)
        greedy_dense(xp, 50, 7, dtype=torch.float32)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.is_cuda and got.cpu().unique().numel() == 50
    assert greedy_coreset(x, 50, 32, seed=1).cpu().tolist() == ref.tolist()


def test_plain_loop_in_float64_is_the_batched_selection():
    x = clustered(n=1500, d=16).numpy()
    dense = greedy_dense(torch.from_numpy(x), 200, 11).numpy()
    assert greedy_batched(x, 200, 11).tolist() == dense.tolist()
    f32 = greedy_dense(torch.from_numpy(x), 200, 11, dtype=torch.float32)
    assert f32.dtype == torch.long and f32.unique().numel() == 200


def test_selection_is_seeded_and_includes_the_first_point():
    x = clustered(n=2000)
    a = greedy_coreset(x, 100, 16, seed=3)
    assert torch.equal(a, greedy_coreset(x, 100, 16, seed=3))
    assert not torch.equal(a, greedy_coreset(x, 100, 16, seed=4))
    assert int(a[0]) == first_index(2000, 3)
    assert a.unique().numel() == 100


def test_all_points_selectable_without_repeats():
    x = clustered(n=50, d=8)
    idx = greedy_coreset(x, 50, None, seed=0)
    assert sorted(idx.tolist()) == list(range(50))


def test_coverage_radius_far_below_a_random_subset():
    # patch-like data: low intrinsic dimension, a few large modes and many rare ones
    gen = torch.Generator().manual_seed(0)
    sizes = [1500, 1000, 800] + [10] * 70
    centres = torch.randn(len(sizes), 4, generator=gen) * 6
    latent = torch.cat([c + torch.randn(n, 4, generator=gen) for c, n in zip(centres, sizes)])
    x = latent @ torch.randn(4, 96, generator=gen)
    k = 200
    core = greedy_coreset(x, k, 32, seed=0)
    rand = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:k]
    r_core, r_rand = coverage_radius(x, x[core]), coverage_radius(x, x[rand])
    mins = torch.cdist(x.double(), x[core].double()).min(dim=1).values
    ref = mins.max().item()
    # a max of float32 nearest distances: within the largest of their tolerances
    assert r_core == pytest.approx(ref, rel=0,
                                   abs=float(knn_distance_tol(x, x[core], mins[:, None]).max()))
    assert r_core < 0.75 * r_rand, (r_core, r_rand)


def test_coreset_size_and_errors():
    assert coreset_size(1000, 0.1, None) == 100
    assert coreset_size(1001, 0.1, None) == 101
    assert coreset_size(5, 0.01, None) == 1
    assert coreset_size(1000, 0.1, 30) == 30
    assert coreset_size(10, None, 30) == 10
    with pytest.raises(ValueError, match="ratio"):
        coreset_size(10, 0.0, None)
    with pytest.raises(ValueError, match="empty"):
        coreset_size(0, 0.1, None)
    with pytest.raises(ValueError, match="k=0"):
        greedy_coreset(torch.rand(5, 3), 0)


@pytest.mark.slow
def test_streaming_coreset_bounded_and_close_to_one_shot():
    x = clustered(n=6000, d=64)
    stream = StreamingCoreset(ratio=0.05, count=None, max_points=600, projection_dim=None, seed=0)
    peak = 0
    for chunk in torch.split(x, 500):
        stream.add(chunk)
        peak = max(peak, stream.n_kept)
    bank = stream.finalize()
    assert peak <= 600 and stream.reductions >= 5
    assert bank.shape == (300, 64)
    # every bank row is a training row
    assert float(NearestNeighbors(x).search(bank, 1)[0].max()) == 0.0
    one_shot = x[greedy_coreset(x, 300, None, seed=0)]
    r_stream, r_once = coverage_radius(x, bank), coverage_radius(x, one_shot)
    r_rand = coverage_radius(x, x[torch.randperm(6000, generator=torch.Generator()
                                                  .manual_seed(1))[:300]])
    assert r_stream < 1.5 * r_once and r_stream < r_rand


def test_streaming_count_larger_than_budget_is_refused():
    with pytest.raises(ValueError, match="max_bank_points"):
        StreamingCoreset(ratio=None, count=60, max_points=100)


# -- nearest neighbours -------------------------------------------------------------------
def _brute_knn(q: torch.Tensor, bank: torch.Tensor, k: int):
    # on the differences: the matrix-product form would err by ~1e-5 at zero distance
    d = torch.cdist(q.double(), bank.double(), compute_mode="donot_use_mm_for_euclid_dist")
    return d.topk(k, dim=1, largest=False)


@pytest.mark.parametrize("backend", ["faiss-flat", "torch", "auto", "projected"])
@pytest.mark.parametrize("k", [1, 3])
def test_exact_knn_equals_brute_force_float64(backend, k, device):
    bank, q = clustered(n=1500, seed=1), clustered(n=200, seed=2)
    dist, idx = NearestNeighbors(bank.to(device), backend=backend).search(q.to(device), k)
    assert dist.device.type == idx.device.type == device.type
    ref_d, ref_i = _brute_knn(q, bank, k)
    assert bool(((dist.cpu().double() - ref_d).abs() <= knn_distance_tol(q, bank, ref_d)).all())
    assert torch.equal(idx.cpu(), ref_i)


def _low_rank(n: int, d: int = 256, rank: int = 12, seed: int = 0) -> torch.Tensor:
    """Features like a CNN's: most variance in a few directions, a little noise in all."""
    basis = torch.randn(rank, d, generator=torch.Generator().manual_seed(0))  # shared
    gen = torch.Generator().manual_seed(seed)
    signal = (torch.randn(n, rank, generator=gen) * 3) @ basis
    return signal + 0.3 * torch.randn(n, d, generator=gen)


@pytest.mark.parametrize("kind", ["low_rank", "isotropic"])
@pytest.mark.parametrize("k", [1, 4])
def test_projected_search_is_exact_whether_or_not_the_subspace_settles_it(kind, k):
    """Low-rank data: the PCA subspace certifies almost every query, and ``auto`` picks this
    search. Isotropic data: the subspace (capped at D / 4 dimensions) bounds little, so many
    queries go to the full search, and ``auto`` keeps faiss flat. Both must give the float64
    brute-force neighbours."""
    if kind == "low_rank":
        bank = _low_rank(3000, seed=1)
        q = torch.cat([_low_rank(400, seed=2), bank[:50]])  # some queries are bank rows
    else:
        gen = torch.Generator().manual_seed(3)
        bank, q = torch.randn(2500, 256, generator=gen), torch.randn(300, 256, generator=gen)
        assert NearestNeighbors(bank, backend="auto").backend == "faiss-flat"
    index = NearestNeighbors(bank, backend="auto" if kind == "low_rank" else "projected")
    assert index.backend == "projected"
    assert index.projected.dims <= 256 // 4 if kind == "isotropic" else index.projected.dims < 64
    assert index.projected.tight == (kind == "low_rank")
    full_rows = []
    original = index._torch_search
    index._torch_search = lambda queries, k: full_rows.append(len(queries)) or original(queries, k)
    dist, idx = index.search(q, k)
    ref_d, ref_i = _brute_knn(q, bank, k)
    assert bool(((dist.double() - ref_d).abs() <= knn_distance_tol(q, bank, ref_d)).all())
    assert torch.equal(idx, ref_i)
    if kind == "isotropic":  # the full-search stage was exercised
        assert sum(full_rows) > 0.3 * len(q)


def test_projected_search_certifies_most_queries_on_low_rank_data():
    """The point of the projection: on low-rank features nearly all queries are settled by the
    subspace, so the full search runs for few of them (counted through a spy)."""
    bank, q = _low_rank(3000, seed=1), _low_rank(500, seed=2)
    index = NearestNeighbors(bank, backend="projected")
    full_rows = []
    original = index._torch_search
    index._torch_search = lambda queries, k: full_rows.append(len(queries)) or original(queries, k)
    index.search(q, 1)
    assert sum(full_rows) < 0.05 * len(q)


@pytest.mark.parametrize("k", [1, 3])
def test_projected_refinement_checks_only_rows_below_the_bound(monkeypatch, k):
    """With a single candidate per query most queries are not certified: the refinement checks
    every row whose lower bound is below the query's k-th distance (few rows on low-rank data,
    no full search) and still returns the float64 brute-force neighbours."""
    import anomaly_hooks.scorers.patchcore.knn as knn

    monkeypatch.setattr(knn, "PROJECTED_CANDIDATES", 0)
    bank = _low_rank(3000, seed=1)
    q = torch.cat([_low_rank(300, seed=2), bank[:20]])
    index = NearestNeighbors(bank, backend="projected")
    refined, full = [], []
    refine, search = index.projected._refine, index._torch_search
    monkeypatch.setattr(index.projected, "_refine",
                        lambda queries, qa, rows, *a: refined.append(rows.numel())
                        or refine(queries, qa, rows, *a))
    monkeypatch.setattr(index, "_torch_search",
                        lambda queries, kk: full.append(len(queries)) or search(queries, kk))
    dist, idx = index.search(q, k)
    ref_d, ref_i = _brute_knn(q, bank, k)
    assert bool(((dist.double() - ref_d).abs() <= knn_distance_tol(q, bank, ref_d)).all())
    assert torch.equal(idx, ref_i)
    assert sum(refined) > 0.3 * len(q) and sum(full) < 0.05 * len(q)


def test_augmented_bound_never_exceeds_the_distance():
    """The subspace coordinates plus the residual norm: a lower bound of every distance, and
    tighter than the subspace alone."""
    from anomaly_hooks.scorers.patchcore.knn import ProjectedSearch

    bank, q = _low_rank(2500, seed=1), _low_rank(200, seed=2)
    ps = ProjectedSearch(bank)
    lb = torch.cdist(ps._augment(q).double(), ps.points.double())
    sub = torch.cdist(ps._augment(q)[:, :-1].double(), ps.points[:, :-1].double())
    true = torch.cdist(q.double(), bank.double(), compute_mode="donot_use_mm_for_euclid_dist")
    assert bool((lb <= true * (1 + 1e-5) + 1e-5).all())
    assert bool((lb >= sub - 1e-5).all()) and float((lb - sub).mean()) > 0


@pytest.mark.parametrize("backend", ["faiss-ivf", "faiss-hnsw"])
def test_approximate_indexes_have_high_recall(backend):
    bank, q = clustered(n=4000, seed=1), clustered(n=300, seed=2)
    dist, idx = NearestNeighbors(bank, backend=backend, nlist=16, nprobe=8).search(q, 1)
    ref_d, ref_i = _brute_knn(q, bank, 1)
    assert (idx == ref_i).float().mean() > 0.9
    # never closer than the true nearest, up to the float32 distance's rounding
    assert bool((dist.double() >= ref_d - knn_distance_tol(q, bank, ref_d)).all())


def test_float16_bank_is_searched_on_its_own_values(device):
    bank, q = clustered(n=800, seed=1), clustered(n=50, seed=2)
    half = bank.half()
    dist, idx = NearestNeighbors(half.to(device)).search(q.to(device), 1)
    ref_d, ref_i = _brute_knn(q, half.float(), 1)
    tol = knn_distance_tol(q, half.float(), ref_d)
    assert bool(((dist.cpu().double() - ref_d).abs() <= tol).all())
    assert torch.equal(idx.cpu(), ref_i)


def test_self_distance_is_zero_and_errors():
    bank = clustered(n=500)
    index = NearestNeighbors(bank)
    dist, idx = index.search(bank[:50], 1)
    assert torch.equal(idx[:, 0], torch.arange(50))
    assert float(dist.max()) == 0.0
    with pytest.raises(ValueError, match="queries must be"):
        index.search(torch.rand(3, 5), 1)
    with pytest.raises(ValueError, match="k=501"):
        index.search(bank[:2], 501)
    with pytest.raises(ValueError, match="unknown knn backend"):
        NearestNeighbors(bank, backend="annoy")


# -- scorer -------------------------------------------------------------------------------
def _scorer(**overrides) -> PatchCoreScorer:
    cfg = load_config({"method": "patchcore", "patchcore": overrides}).patchcore
    return PatchCoreScorer.create(cfg, [LayerInfo("a", 16, 8)], "custom", seed=0)


def test_training_patches_score_zero_and_an_outlier_scores_highest():
    gen = torch.Generator().manual_seed(0)
    train = torch.rand(6, 16, 5, 5, generator=gen)
    scorer = _scorer(coreset_ratio=1.0)
    scorer.partial_fit(train[:3])
    scorer.partial_fit(train[3:])
    scorer.finalize()
    # a point's distance to itself by the float32 fast form: at most sqrt of d**2's rounding
    patches = train.permute(0, 2, 3, 1).reshape(-1, 16)
    zero = torch.zeros(len(patches), 1, dtype=torch.float64)
    assert float(scorer.score(train).max()) <= float(knn_distance_tol(patches, patches, zero).max())
    test = train[:2].clone()
    test[1, :, 2, 3] += 3.0
    scores = scorer.score(test)
    assert scores.flatten().argmax().item() == 1 * 25 + 2 * 5 + 3


def test_reweighting_is_a_factor_between_zero_and_one():
    gen = torch.Generator().manual_seed(1)
    train = torch.rand(8, 16, 4, 4, generator=gen)
    scorer = _scorer(coreset_ratio=0.5, reweight=True, reweight_neighbors=5)
    scorer.partial_fit(train)
    scorer.finalize()
    test = torch.rand(3, 16, 4, 4, generator=gen) * 2
    patch = scorer.score(test)
    factors = scorer.reweight_factors(test, patch)
    assert factors.shape == (3,) and bool(((factors > 0) & (factors < 1)).all())


@pytest.fixture(scope="module")
def patchcore_cfg(small_cfg):
    return {**small_cfg, "method": "patchcore", "backbone": {"name": "resnet18", "weights": None},
            "patchcore": {"coreset_ratio": 0.25}}


def test_detector_save_load_identical_and_detects(patchcore_cfg, tmp_path, device):
    det = Detector.from_config(patchcore_cfg, device=str(device))
    det.fit(textured_images(12), progress=False)
    good = textured_images(3, seed=31)
    bad = [with_defect(img) for img in textured_images(3, seed=32)]
    before = det.predict(good + bad)
    assert min(p.score for p in bad and before[3:]) > max(p.score for p in before[:3])
    loaded = Detector.load(det.save(tmp_path / "pc.safetensors"))
    assert loaded.device.type == device.type
    after = loaded.predict(good + bad)
    assert [p.score for p in after] == [p.score for p in before]
    assert loaded.scorer_.bank.shape == det.scorer_.bank.shape


def test_bounded_fit_and_float16_bank(patchcore_cfg, tmp_path):
    imgs = textured_images(12)
    full = Detector.from_config(patchcore_cfg).fit(imgs, progress=False)
    bounded = Detector.from_config(patchcore_cfg, patchcore__max_bank_points=150,
                                   patchcore__bank_dtype="float16").fit(imgs, progress=False)
    assert bounded.scorer_.bank.dtype == torch.float16
    assert bounded.scorer_.bank.shape[0] <= 150
    test = textured_images(2, seed=40) + [with_defect(textured_images(1, seed=41)[0])]
    a, b = full.predict(test), bounded.predict(test)
    assert b[2].score > max(b[0].score, b[1].score)
    loaded = Detector.load(bounded.save(tmp_path / "half.safetensors"))
    assert loaded.scorer_.bank.dtype == torch.float16
    assert [p.score for p in loaded.predict(test)] == [p.score for p in b]
    assert a[2].score > max(a[0].score, a[1].score)


# -- the GPU paths: each runs on the CPU, and on CUDA where present -------------
def test_principal_basis_lives_on_the_banks_device(device):
    """The variance target is made on the eigenvalues' device: a CPU scalar beside CUDA
    eigenvalues made ``knn_backend=projected`` raise at fit and at load on a GPU."""
    from anomaly_hooks.scorers.patchcore.knn import principal_basis

    bank = _low_rank(3000, seed=1)
    ref_mean, ref_basis, ref_tight = principal_basis(bank)
    mean, basis, tight = principal_basis(bank.to(device))
    assert mean.device.type == basis.device.type == device.type
    assert basis.shape == ref_basis.shape and tight == ref_tight
    # the same directions whatever the device (eigenvector signs may differ), as far as
    # float32 determines them: each device's covariance of m rows errs by a matrix of 2-norm
    # at most f32_tol(m) trace(Q) (entries c sqrt(Q_ii Q_jj), Q the rows' second moments);
    # an eigenvector then turns by sin t <= 2 |dA| / (its gap to the other eigenvalues), so
    # |cos t| >= 1 - sin^2 t (Davis-Kahan), less the float32 dot product's D roundings
    x = bank.double()
    centred = x - x.mean(dim=0)
    lam = torch.linalg.eigvalsh(centred.t() @ centred).flip(0)
    d_a = f32_tol(len(x)) * float((centred ** 2).sum())
    r = basis.shape[1]
    gaps = torch.stack([(lam[:r] - lam[1:r + 1]).abs(),
                        torch.cat([torch.tensor([float("inf")], dtype=lam.dtype),
                                   (lam[1:r] - lam[:r - 1]).abs()])]).amin(0)
    slack = (2 * d_a / gaps) ** 2 + f32_tol(bank.shape[1])
    proj = basis.cpu().t().double() @ ref_basis.double()
    assert bool((proj.abs().diagonal() >= 1 - slack).all())


@pytest.mark.parametrize("backend", ["faiss-ivf", "faiss-hnsw"])
def test_approximate_indexes_on_the_device(backend, device):
    """faiss IVF and HNSW serve a bank on any device (on a GPU the queries are copied to
    wherever the index lives: HNSW always stays on the CPU)."""
    bank, q = clustered(n=4000, seed=1), clustered(n=300, seed=2)
    index = NearestNeighbors(bank.to(device), backend=backend, nlist=16, nprobe=8)
    dist, idx = index.search(q.to(device), 1)
    assert dist.device.type == idx.device.type == device.type
    ref_d, ref_i = _brute_knn(q, bank, 1)
    assert (idx.cpu() == ref_i).float().mean() > 0.9
    assert bool((dist.cpu().double() >= ref_d - 1e-4).all())


class _FakeGpuIndex:
    """A faiss GPU index stand-in around a CPU index. Its ``search`` counts the calls that
    found another thread already inside: a real GPU index shares one StandardGpuResources
    (scratch memory, stream) between them, so such overlaps are races."""

    def __init__(self, cpu_index, device: int) -> None:
        self.cpu, self.device = cpu_index, device
        self.inside = self.overlaps = self.calls = 0
        self._count = threading.Lock()

    def search(self, q, k):
        with self._count:
            self.calls += 1
            self.inside += 1
            self.overlaps += self.inside > 1
        try:
            time.sleep(0.005)  # widen the window a race needs
            return self.cpu.search(q, k)
        finally:
            with self._count:
                self.inside -= 1


@pytest.fixture
def fake_gpu_faiss(monkeypatch):
    """faiss as a GPU build with one GPU would look, for a bank on the CPU: indexes are
    "cloned" to :class:`_FakeGpuIndex`, except HNSW, which (as in faiss) raises."""
    import faiss

    import anomaly_hooks.scorers.patchcore.knn as knn

    def index_cpu_to_gpu(resources, device, index, options=None):
        if isinstance(index, faiss.IndexHNSW):
            raise RuntimeError("Error in virtual faiss::Index* faiss::gpu::ToGpuCloner::"
                               "clone_Index(const faiss::Index*): This index type is not "
                               "implemented on GPU.")
        return _FakeGpuIndex(index, device)

    monkeypatch.setattr(faiss, "StandardGpuResources", object, raising=False)
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1)
    monkeypatch.setattr(faiss, "index_cpu_to_gpu", index_cpu_to_gpu, raising=False)
    monkeypatch.setattr(knn, "_gpu_index_wanted", lambda device: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return index_cpu_to_gpu


def _search_from_threads(index: NearestNeighbors, q: torch.Tensor, threads: int = 8) -> list:
    chunks = list(torch.chunk(q, threads))
    out: list = [None] * len(chunks)

    def work(i: int) -> None:
        for _ in range(3):
            out[i] = index.search(chunks[i], 2)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(len(chunks))]
    [t.start() for t in pool]
    [t.join() for t in pool]
    return out


def test_faiss_gpu_index_searches_take_turns(fake_gpu_faiss):
    """A faiss GPU index is not thread-safe even for searching: concurrent searches (threaded
    predict) go through a lock, one at a time, and give the serial results. Without the lock
    the stand-in sees overlapping searches (so this test would catch its removal)."""
    bank, q = clustered(n=1500, seed=1), clustered(n=400, seed=2)
    index = NearestNeighbors(bank, backend="faiss-flat")
    assert isinstance(index.index, _FakeGpuIndex) and index._search_lock is not None
    serial = [index.search(c, 2) for c in torch.chunk(q, 8)]
    got = _search_from_threads(index, q)
    assert index.index.overlaps == 0 and index.index.calls == 8 + 24
    for (d, i), (ref_d, ref_i) in zip(got, serial):
        assert torch.equal(i, ref_i) and torch.equal(d, ref_d)
    index._search_lock = None  # what the index did before: the stand-in sees the race
    _search_from_threads(index, q)
    assert index.index.overlaps > 0


def test_faiss_gpu_clone_goes_to_the_banks_gpu(fake_gpu_faiss):
    import faiss

    from anomaly_hooks.scorers.patchcore.knn import to_gpu

    flat = faiss.IndexFlatL2(8)
    index, resources = to_gpu(faiss, flat, "faiss-flat", torch.device("cuda", 1))
    assert isinstance(index, _FakeGpuIndex) and index.device == 1 and resources is not None


def test_faiss_hnsw_stays_on_the_cpu_with_a_gpu_build(fake_gpu_faiss):
    """faiss has no GPU HNSW (``index_cpu_to_gpu`` raises "not implemented on GPU"): with a
    GPU build the HNSW index stays on the CPU, unlocked (CPU searches are thread-safe)."""
    import faiss

    with pytest.raises(RuntimeError, match="not implemented on GPU"):  # the faiss behaviour
        fake_gpu_faiss(None, 0, faiss.IndexHNSWFlat(8, 16))
    bank, q = clustered(n=2000, seed=1), clustered(n=200, seed=2)
    index = NearestNeighbors(bank, backend="faiss-hnsw")
    assert isinstance(index.index, faiss.IndexHNSW) and index._search_lock is None
    _, idx = index.search(q, 1)
    assert (idx == _brute_knn(q, bank, 1)[1]).float().mean() > 0.9


def test_a_float16_bank_is_not_auto_searched_by_faiss_on_a_gpu(fake_gpu_faiss):
    """On a GPU, faiss's float16 flat index rounds the queries to float16 too: ``auto`` keeps
    the torch search, exact on the bank's own values; float32 banks get the faiss index."""
    from anomaly_hooks.scorers.patchcore.knn import resolve_backend

    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, (500, 64), torch.float16) == "torch"
    assert resolve_backend("auto", cuda, (500, 64), torch.float32) == "faiss-flat"


@pytest.mark.parametrize("k", [1, 3])
def test_torch_search_widens_a_float16_bank_block_by_block(monkeypatch, k, device):
    """A float16 bank is searched in blocks widened to float32 one at a time (tiny blocks
    here, so the running top-k is merged across many), exactly on its own values."""
    import anomaly_hooks.scorers.patchcore.knn as knn

    bank, q = clustered(n=900, seed=1).half(), clustered(n=120, seed=2)
    monkeypatch.setattr(knn, "WIDEN_BYTES", 37 * 96 * 4)  # 37 rows per block
    index = NearestNeighbors(bank.to(device), backend="torch")
    dist, idx = index.search(q.to(device), k)
    ref_d, ref_i = _brute_knn(q, bank.float(), k)
    tol = knn_distance_tol(q, bank.float(), ref_d)
    assert bool(((dist.cpu().double() - ref_d).abs() <= tol).all())
    assert torch.equal(idx.cpu(), ref_i)
    assert index._sq is not None and index._sq.shape == (900,)  # norms computed once, kept


@pytest.mark.parametrize("backend", ["auto", "torch", "faiss-flat"])
def test_float16_bank_holds_no_float32_copy(backend, device):
    """``bank_dtype=float16``: the index is given the float16 bank itself (it was handed a
    float32 copy: 1.5x a float32 bank instead of 0.5x), faiss flat stores float16 on the
    CPU, and scores are those of a search over the float16 values."""
    import faiss

    gen = torch.Generator().manual_seed(3)
    train = torch.rand(6, 16, 5, 5, generator=gen).to(device)
    scorer = _scorer(coreset_ratio=0.5, bank_dtype="float16", knn_backend=backend)
    scorer.partial_fit(train)
    scorer.finalize()
    assert scorer.bank.dtype == torch.float16 and scorer.index.bank is scorer.bank
    if scorer.index.backend == "faiss-flat" and device.type == "cpu":
        assert isinstance(scorer.index.index, faiss.IndexScalarQuantizer)
    test = torch.rand(2, 16, 5, 5, generator=gen).to(device)
    patches = test.permute(0, 2, 3, 1).reshape(-1, 16).cpu()
    ref_d, _ = _brute_knn(patches, scorer.bank.float().cpu(), 1)
    tol = knn_distance_tol(patches, scorer.bank.float(), ref_d)[:, 0]
    got = scorer.score(test).flatten().cpu().double()
    assert bool(((got - ref_d[:, 0]).abs() <= tol).all())


def test_reweighting_with_a_float16_bank_equals_its_float32_values(device):
    """Re-weighting widens only the rows it reads: the same factors as a float32 bank holding
    the float16 values."""
    gen = torch.Generator().manual_seed(1)
    train = torch.rand(8, 16, 4, 4, generator=gen).to(device)
    half = _scorer(coreset_ratio=0.5, reweight=True, reweight_neighbors=5,
                   bank_dtype="float16", knn_backend="torch")
    half.partial_fit(train)
    half.finalize()
    full = _scorer(coreset_ratio=0.5, reweight=True, reweight_neighbors=5, knn_backend="torch")
    full.grid, full.fitted = half.grid, True
    full.set_bank(half.bank.float())
    test = (torch.rand(3, 16, 4, 4, generator=gen) * 2).to(device)
    patch = half.score(test)
    torch.testing.assert_close(half.reweight_factors(test, patch),
                               full.reweight_factors(test, patch))


def _fit_with_spy(monkeypatch, begin, n_batches: int = 3):
    """A one-shot PatchCore fit of ``n_batches`` batches of 2 images; returns the scorer and
    the features tensor the coreset selection was given."""
    import anomaly_hooks.scorers.patchcore.scorer as pc

    seen = {}
    real = pc.greedy_coreset

    def spy(features, k, **kw):
        seen["features"] = features
        return real(features, k, **kw)

    monkeypatch.setattr(pc, "greedy_coreset", spy)
    gen = torch.Generator().manual_seed(4)
    scorer = _scorer(coreset_ratio=0.3)
    if begin is not None:
        scorer.begin(begin)
    for _ in range(n_batches):
        scorer.partial_fit(torch.rand(2, 16, 5, 5, generator=gen))
        if begin is not None and scorer._buffer is not None:
            seen.setdefault("buffer", scorer._buffer)
    scorer.finalize()
    return scorer, seen


def test_one_shot_fit_writes_every_patch_into_one_buffer(monkeypatch):
    """With ``begin(n)`` the patches go into one preallocated ``[n * h * w, D]`` buffer, and the
    coreset selection reads that buffer itself (no concatenation: on a GPU, where a new block
    is reserved whole, that copy doubled the peak). Fewer images than announced use its head;
    more fall back to joining the batches. The bank is the same in every case."""
    ref, ref_seen = _fit_with_spy(monkeypatch, begin=None)
    assert "buffer" not in ref_seen
    exact, seen = _fit_with_spy(monkeypatch, begin=6)
    buffer = seen["buffer"]
    assert buffer.shape == (6 * 25, 16) and exact._chunks == []
    assert seen["features"].data_ptr() == buffer.data_ptr()
    assert seen["features"].shape == (6 * 25, 16)
    fewer, seen = _fit_with_spy(monkeypatch, begin=10)
    assert seen["buffer"].shape == (10 * 25, 16) and seen["features"].shape == (6 * 25, 16)
    assert seen["features"].data_ptr() == seen["buffer"].data_ptr()
    more, seen = _fit_with_spy(monkeypatch, begin=3)
    assert seen["features"].shape == (6 * 25, 16)
    for scorer in (exact, fewer, more):
        assert torch.equal(scorer.bank, ref.bank)
    with pytest.raises(RuntimeError, match="before the first partial_fit"):
        exact.begin(3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: measures the GPU "
                    "allocator's peak")
def test_cuda_fit_peak_is_one_copy_of_the_patches(monkeypatch):
    """On CUDA the patch features are held once: the peak when the coreset selection starts
    is the buffer plus one batch, not twice the features."""
    import anomaly_hooks.scorers.patchcore.scorer as pc

    dev = torch.device("cuda")
    n, b, d, h, w = 64, 8, 1024, 14, 14
    features_bytes = n * h * w * d * 4
    peak = {}

    def spy(features, k, **kw):
        torch.cuda.synchronize()
        peak["bytes"] = torch.cuda.max_memory_allocated() - base
        return torch.arange(k, device=features.device)

    monkeypatch.setattr(pc, "greedy_coreset", spy)
    scorer = PatchCoreScorer.create(load_config({"method": "patchcore"}).patchcore,
                                    [LayerInfo("a", d, 8)], "custom", seed=0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    scorer.begin(n)
    for _ in range(n // b):
        scorer.partial_fit(torch.randn(b, d, h, w, device=dev))
    scorer.finalize()
    # the buffer, the batch in and its embedding out, and the caching allocator's rounding
    # of each live block to 2 MiB; twice the features would be 51 MB more
    batch_bytes = features_bytes * b // n
    assert peak["bytes"] < features_bytes + 2 * batch_bytes + 4 * (2 << 20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: measures the GPU "
                    "allocator's peak")
def test_cuda_float16_bank_search_holds_no_float32_copy():
    """Searching a float16 bank on CUDA peaks below one float32 copy of it (1 GB here): the
    search's working set is fixed (0.6 GB measured on an H100), whatever the bank's size."""
    bank = torch.randn(1_000_000, 256, device="cuda").half()
    index = NearestNeighbors(bank, backend="torch")
    q = torch.randn(4096, 256, device="cuda")
    index.search(q, 1)  # the norms, computed once
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    index.search(q, 1)
    torch.cuda.synchronize()
    # one widened bank block, one query x block distance matrix and topk's workspace of the
    # same size: a fixed working set, below one float32 copy of the bank (1 GB)
    working_set = WIDEN_BYTES + 2 * CUDA_BLOCK_ELEMENTS * 4
    assert working_set < bank.numel() * 4
    slack = 64 << 20  # the queries, the allocator rounding
    assert torch.cuda.max_memory_allocated() - base < working_set + slack
