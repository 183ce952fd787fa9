"""Greedy k-center coreset selection (PatchCore's "approximate greedy" coreset), exact and fast.

The rule (Sener & Savarese 2018; Roth et al. 2022): features are projected to a small seeded
random dimension for the selection only; a seeded first point is selected; then, repeatedly,
the point farthest from the selected set is selected (ties: the lowest index). Only a running
vector ``m`` of each point's squared distance to the selected set is kept, never an N x N matrix.

Two implementations of the same rule:

* :func:`greedy_dense` — the plain loop: one pass over all points per selected point
  (memory-bound). Used on CUDA, where a pass is cheap; it never synchronises with the host
  (the selected index stays on the device: ``index_select`` / ``index_fill_``). Distances in
  float64 by default (float32 passes resolve near-ties differently about once per 1000
  centres on real banks: measured on 61k EfficientNet patches).
* :func:`greedy_batched` — the CPU path, exact in float64. A pass per selected point is
  memory-bound (~12 ms for 227k x 128 on this kind of machine), so the passes are *batched*:

  1. *Pool.* The ``M`` points of largest ``m`` form a pool; ``T`` is the largest ``m`` outside
     it. Points outside the pool are updated lazily, so their stored ``m`` only over-estimates
     the true value and ``T`` bounds every outside point. Inside the pool the greedy rule runs
     as usual (each pick updates the pool's ``m``); as long as the pool's largest ``m`` exceeds
     ``T`` it *is* the global farthest point, so the pick is the brute-force pick. When it no
     longer exceeds ``T`` the batch ends (typically after tens to hundreds of picks).
  2. *Apply.* The batch's ``B`` centres are applied to every point with one float32 matrix
     product per block of rows: ``[y, |y|^2, 1, -limit] @ [-2 y_c, 1, |y_c|^2 - slack, 1]``,
     where ``y`` are the coordinates along the leading principal directions of the bank (those
     holding all but ``RESIDUAL`` of its variance; all ``p`` on spread-out banks), so the product
     is a lower bound of ``|x - c|^2 - m(x)`` up to rounding: a compute-bound GEMM instead of
     ``B`` memory-bound passes (both cores through BLAS). A pair can lower ``m`` only where the
     product is negative; the slack (``REL`` x (|x|^2 + |c|^2 + m), six times the worst-case
     float32 error of the product) keeps that test conservative. Only those pairs are
     recomputed exactly in float64 (0.05-0.5 % of the points per centre on real banks), so
     ``m`` always holds exact float64 values.

  The selection is therefore the one of the brute-force float64 greedy on the float32 projected
  features (same indices, same order); it could differ only where two different distances agree
  to within float64 rounding (~1e-16 relative, a different summation order); exact ties
  (duplicate points) go to the lowest index, as in the brute force. When the pool certifies
  fewer than ``MIN_BATCH`` picks (data whose farthest points all sit together), the following
  picks are plain steps (argmax over all points, one pass each, as the plain loop) and the pool
  is retried after exponentially more of them, so the method adapts and does not fall far
  behind the plain loop.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import numpy as np
import torch

try:  # tqdm is a core dependency; the fallback only keeps imports cheap in odd environments
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
    tqdm = None

REL = 1e-4  # float32 slack on squared distances, relative to |x|^2 + |c|^2 (bound: 1.6e-5)
POOL = 2048  # pool size of the batched selection
MIN_BATCH = 4  # a pool certifying fewer picks is followed by one plain step
CHUNK = 8192  # rows per GEMM block when applying a batch
RESIDUAL = 0.01  # bounds use the leading principal directions holding all but 1 % of the variance
METHODS = ("auto", "dense", "batched")


def coreset_size(n: int, ratio: Optional[float], count: Optional[int]) -> int:
    """Number of points to keep out of ``n``: ``count`` if given, else ``ceil(ratio * n)``;
    at least 1 and at most ``n``."""
    if n < 1:
        raise ValueError("cannot select a coreset from an empty set of features")
    if count is not None:
        if count < 1:
            raise ValueError(f"coreset count must be >= 1, got {count}")
        return min(n, int(count))
    if ratio is None or not 0.0 < ratio <= 1.0:
        raise ValueError(f"coreset ratio must be in (0, 1], got {ratio}")
    return max(1, min(n, math.ceil(ratio * n)))


def projection_matrix(in_dim: int, out_dim: int, seed: int) -> torch.Tensor:
    """Seeded Gaussian matrix ``[in_dim, out_dim]`` scaled by ``1/sqrt(out_dim)``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(in_dim, out_dim, generator=gen) / math.sqrt(out_dim)


def random_projection(features: torch.Tensor, dim: Optional[int], seed: int) -> torch.Tensor:
    """Seeded Gaussian projection of ``features`` ``[N, D]`` to ``[N, dim]`` (scaled by
    ``1/sqrt(dim)``, which preserves distances in expectation). ``None`` or ``dim >= D`` keeps
    the features (as float32)."""
    n, d = features.shape
    if dim is None or dim >= d:
        return features.float()
    matrix = projection_matrix(d, dim, seed).to(features.device)
    out = torch.empty(n, dim, dtype=torch.float32, device=features.device)
    step = 65536
    for lo in range(0, n, step):
        torch.matmul(features[lo:lo + step].float(), matrix, out=out[lo:lo + step])
    return out


def first_index(n: int, seed: int) -> int:
    """The seeded first selected point."""
    gen = torch.Generator().manual_seed(seed)
    return int(torch.randint(n, (1,), generator=gen))


def greedy_coreset(features: torch.Tensor, k: int, projection_dim: Optional[int] = 128,
                   seed: int = 0, progress: bool = False,
                   method: str = "auto") -> torch.Tensor:
    """Indices ``[k]`` (int64, in selection order, on ``features.device``) of a greedy k-center
    coreset of ``features`` ``[N, D]``. ``method``: ``auto`` (dense on CUDA, batched on the
    CPU), ``dense`` (the plain loop, any device) or ``batched`` (CPU, exact float64;
    ``pruned`` is an alias of it)."""
    if features.ndim != 2 or features.shape[0] == 0:
        raise ValueError(f"features must be a non-empty [N, D] tensor, got {tuple(features.shape)}")
    n = features.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"coreset size k={k} must be between 1 and the {n} points")
    if method == "pruned":
        method = "batched"
    if method not in METHODS:
        raise ValueError(f"unknown coreset method {method!r}: {', '.join(METHODS)}")
    x = random_projection(features, projection_dim, seed)
    x = x - x.mean(dim=0, dtype=torch.float64).float()  # smaller norms: less float rounding
    start = first_index(n, seed)
    if method == "auto":
        method = "dense" if x.is_cuda else "batched"
    if method == "dense":
        return greedy_dense(x, k, start, progress)
    idx = greedy_batched(x.cpu().numpy(), k, start, progress)
    return torch.from_numpy(idx).to(features.device)


def _bar(total: int, enabled: bool, desc: str = "coreset"):
    if not enabled or tqdm is None:
        return None
    return tqdm(total=total, desc=desc, unit="pt", dynamic_ncols=True, leave=False)


def greedy_dense(x: torch.Tensor, k: int, start: int, progress: bool = False,
                 dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The plain loop on ``x`` ``[N, p]`` (any device): ``k`` passes over all points, distances
    in ``dtype`` (float64 by default: the brute-force rule, the same points as
    :func:`greedy_batched`; float32 halves the traffic but may resolve near-ties, ~1 per 1000
    centres on real banks, differently). Already selected points are never selected again
    (ties go to the lowest index). The selected index never leaves the device (no host
    synchronisation per point on CUDA)."""
    n = x.shape[0]
    x = x.to(dtype)
    min_d = torch.full((n,), float("inf"), dtype=dtype, device=x.device)
    selected = torch.empty(k, dtype=torch.long, device=x.device)
    bar = _bar(k, progress)
    idx = torch.full((1,), start, dtype=torch.long, device=x.device)
    for i in range(k):
        selected[i:i + 1] = idx
        c = x.index_select(0, idx)  # [1, p]
        d = torch.linalg.vector_norm(x - c, dim=1)
        torch.minimum(min_d, d, out=min_d)
        min_d.index_fill_(0, idx, -1.0)  # never again
        idx = torch.argmax(min_d).view(1)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return selected


def greedy_batched(x: np.ndarray, k: int, start: int, progress: bool = False,
                   stats: Optional[Dict[str, float]] = None, pool: int = POOL,
                   dims: Optional[int] = None) -> np.ndarray:
    """Exact greedy k-center on ``x`` ``[N, p]`` (float32 numpy, CPU): ``[k]`` int64 indices in
    selection order, the same as the brute-force float64 greedy (module docstring). ``dims``:
    principal directions used by the GEMM bounds (None: chosen from the spectrum). ``stats``
    (a dict) receives counters: batches, plain steps, exact float64 checks per centre."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, p = x.shape
    sq = np.einsum("ij,ij->i", x, x, dtype=np.float64)
    a = _bound_rows(x, dims)
    xs = x
    slack_abs = REL * 1e-3 * float(sq.max()) + 1e-30
    m = np.full(n, np.inf)  # exact float64 squared distance to the selected set; -1: selected
    selected = np.empty(k, dtype=np.int64)
    bar = _bar(k, progress)
    count = {"batches": 0, "plain_steps": 0, "exact_checks": 0, "pool_checks": 0}
    got = 0
    batch = [start]
    skip = waited = 0  # after a pool that did not pay: plain steps before the next pool
    while True:
        centres = np.asarray(batch, dtype=np.int64)
        selected[got:got + len(centres)] = centres
        got += len(centres)
        count["exact_checks"] += _apply(a, xs, sq, m, centres, slack_abs)
        if bar is not None:
            bar.update(len(centres))
        if got >= k:
            break
        if waited < skip:  # plain step: the farthest point (the lowest index among ties)
            waited += 1
            count["plain_steps"] += 1
            batch = [int(np.argmax(m))]
            continue
        batch = _pool_picks(xs, sq, m, min(pool, n - got), k - got, slack_abs, count)
        count["batches"] += 1
        waited = 0
        if len(batch) >= min(MIN_BATCH, k - got):
            skip = 0
        else:  # the pool does not pay on this data: back off exponentially
            skip = min(2 * skip + 1, 64)
            if not batch:
                count["plain_steps"] += 1
                batch = [int(np.argmax(m))]
    if bar is not None:
        bar.close()
    if stats is not None:
        stats.update(batches=count["batches"], plain_steps=count["plain_steps"],
                     centres_per_batch=k / max(1, count["batches"]),
                     exact_per_centre=count["exact_checks"] / k,
                     exact_fraction=count["exact_checks"] / k / n,
                     pool_checks_per_centre=count["pool_checks"] / k,
                     bound_dims=a.shape[1] - 3)
    return selected


def _bound_rows(x: np.ndarray, dims: Optional[int]) -> np.ndarray:
    """``[N, q + 3]`` float32 rows ``[y, |y|^2, 1, .]`` with ``y`` the coordinates of ``x``
    along its ``q`` leading principal directions (``y = x`` when ``q = p``):
    ``|y_x - y_c|^2 <= |x - c|^2``, so one GEMM with ``[-2 y_c, 1, |y_c|^2]`` bounds every
    squared distance from below. ``y`` is computed in float64 and rounded once, so the bound
    holds up to ~1e-7 relative."""
    n, p = x.shape
    vecs = None  # the principal directions, from one Gram matrix (its eigh gives both)
    if dims is None:
        dims = p
        if n >= 4 * p:  # the smallest multiple of 8 keeping all but FLOOR of the variance
            evals, vecs = np.linalg.eigh(_gram(x))
            ev = evals[::-1]
            left = 1.0 - np.cumsum(ev) / max(float(ev.sum()), 1e-300)
            dims = min(p, 8 * math.ceil((int(np.argmax(left <= RESIDUAL)) + 1) / 8))
    dims = max(1, min(int(dims), p))
    a = np.empty((n, dims + 3), dtype=np.float32)  # the last column: -limit, set per batch
    if dims == p:
        a[:, :p] = x
        a[:, p] = np.einsum("ij,ij->i", x, x, dtype=np.float64)
    else:
        if vecs is None:
            _, vecs = np.linalg.eigh(_gram(x))
        v = np.ascontiguousarray(vecs[:, ::-1][:, :dims])
        for lo in range(0, n, 65536):
            y = x[lo:lo + 65536].astype(np.float64) @ v
            a[lo:lo + len(y), :dims] = y
            a[lo:lo + len(y), dims] = np.einsum("ij,ij->i", y, y)
    a[:, dims + 1] = 1.0
    return a


def _gram(x: np.ndarray) -> np.ndarray:
    """``x^T x`` in float64 (chunked)."""
    out = np.zeros((x.shape[1], x.shape[1]))
    for lo in range(0, len(x), 65536):
        chunk = x[lo:lo + 65536].astype(np.float64)
        out += chunk.T @ chunk
    return out


def _apply(a: np.ndarray, xs: np.ndarray, sq: np.ndarray, m: np.ndarray, centres: np.ndarray,
           slack_abs: float) -> int:
    """Lower ``m`` by the squared distances to ``centres`` (exact float64 values). The bound rows
    ``a`` end with ``-limit`` (``m`` plus the rounding slack), so the GEMM with the centre columns
    ``[-2 y_c, 1, |y_c|^2 - slack_c, 1]`` is negative exactly where a pair may lower ``m``; only
    those pairs are recomputed in float64. Returns their number."""
    n, q3 = a.shape
    q = q3 - 3
    # -limit: m plus slack for every rounding the GEMM can make (its error is at most
    # ~1e-5 x (|y|^2 + |y_c|^2 + |limit|) for these 3 + q terms; REL = 1e-4)
    a[:, q + 2] = -(m * (1.0 + REL) + (REL * sq + slack_abs))
    b = np.empty((q3, len(centres)), dtype=np.float32)
    b[:q] = -2.0 * a[centres, :q].T
    b[q] = 1.0
    b[q + 1] = a[centres, q].astype(np.float64) - REL * sq[centres] - slack_abs
    b[q + 2] = 1.0
    c64 = xs[centres].astype(np.float64)
    rows = min(n, CHUNK)
    out = np.empty((rows, len(centres)), dtype=np.float32)
    neg = np.empty((rows, len(centres)), dtype=bool)
    checks = 0
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        d = np.matmul(a[lo:hi], b, out=out[:hi - lo])
        mask = np.less(d, 0.0, out=neg[:hi - lo])
        flat = np.flatnonzero(mask)
        if flat.size == 0:
            continue
        r, j = np.divmod(flat, len(centres))
        r += lo
        diff = xs[r].astype(np.float64)
        diff -= c64[j]
        checks += len(r)
        np.minimum.at(m, r, np.einsum("ij,ij->i", diff, diff))
    m[centres] = -1.0
    return checks


def _pool_picks(xs: np.ndarray, sq: np.ndarray, m: np.ndarray, size: int, budget: int,
                slack_abs: float, count: Dict[str, int]) -> List[int]:
    """Greedy picks certified by a pool of the ``size`` points of largest ``m`` (at most
    ``budget``); ``m`` is not modified."""
    n = len(m)
    if size >= n:
        members = np.arange(n)
        outside = -np.inf
    else:
        part = np.argpartition(m, n - size - 1)
        members = np.sort(part[n - size:])  # index order: argmax ties go to the lowest index
        outside = m[part[n - size - 1]]  # every point outside has m <= this
    pm = m[members]
    px = xs[members]
    psq = sq[members]
    picks: List[int] = []
    while len(picks) < budget:
        j = int(np.argmax(pm))
        if not pm[j] > outside:
            break
        picks.append(int(members[j]))
        c = px[j]
        d2 = psq - 2.0 * (px @ c) + psq[j]
        near = np.flatnonzero(d2 < pm + REL * (psq + psq[j]) + slack_abs)
        diff = px[near].astype(np.float64)
        diff -= c.astype(np.float64)
        pm[near] = np.minimum(pm[near], np.einsum("ij,ij->i", diff, diff))
        pm[j] = -1.0
        count["pool_checks"] += len(near)
    return picks


def coverage_radius(features: torch.Tensor, bank: torch.Tensor, chunk: int = 4096) -> float:
    """Largest distance from any row of ``features`` ``[N, D]`` to its nearest row of ``bank``
    ``[M, D]`` (exact, chunked; float64 accumulation of the difference norms)."""
    from anomaly_hooks.scorers.patchcore.knn import NearestNeighbors

    index = NearestNeighbors(bank.float(), backend="auto")
    worst = 0.0
    for lo in range(0, features.shape[0], chunk):
        dist, _ = index.search(features[lo:lo + chunk].float(), 1)
        worst = max(worst, float(dist.max()))
    return worst


class StreamingCoreset:
    """Bounded-memory coreset (merge-reduce). Added chunks are kept as they are until the kept
    points exceed ``max_points``; then the union is reduced to ``max_points // 2`` points by the
    same greedy rule, and so on. ``finalize`` reduces the kept points to the final size,
    ``coreset_size(total, ratio, count)`` capped at what is kept.

    Peak memory: ``max_points`` kept features plus one chunk, whatever the number of training
    images. Quality: each reduction is a k-center cover of what it reduces, so by the triangle
    inequality the final bank covers every training point within the sum of the radii of the
    reductions (docs/benchmarks.md gives measured radii and AUROC against the one-shot coreset).
    """

    def __init__(self, ratio: Optional[float], count: Optional[int], max_points: int,
                 projection_dim: Optional[int] = 128, seed: int = 0) -> None:
        if max_points < 2:
            raise ValueError(f"max_bank_points must be >= 2, got {max_points}")
        if count is not None and count > max_points // 2:
            raise ValueError(f"coreset count {count} exceeds half of max_bank_points "
                             f"({max_points}): raise patchcore.max_bank_points to at least "
                             f"{2 * count} or lower patchcore.coreset_count")
        self.ratio, self.count, self.max_points = ratio, count, max_points
        self.projection_dim, self.seed = projection_dim, seed
        self.kept: List[torch.Tensor] = []
        self.n_kept = 0
        self.total = 0
        self.reductions = 0

    def add(self, features: torch.Tensor, represented: Optional[int] = None) -> None:
        """Add a chunk ``[n, D]`` of patch features (reduced at once if it alone exceeds the
        budget). ``represented``: the training patches the chunk stands for (more than ``n``
        when a per-image pre-reduction made it; the final size is a share of those)."""
        if features.shape[0] == 0:
            return
        self.total += features.shape[0] if represented is None else int(represented)
        self.kept.append(features.float())
        self.n_kept += features.shape[0]
        if self.n_kept > self.max_points:
            merged = torch.cat(self.kept)
            self.kept = []
            self.reductions += 1
            idx = greedy_coreset(merged, self.max_points // 2, self.projection_dim,
                                 self.seed + self.reductions)
            self.kept = [merged[idx].clone()]
            self.n_kept = self.kept[0].shape[0]

    def finalize(self, progress: bool = False) -> torch.Tensor:
        """The final bank ``[M, D]``."""
        if not self.kept:
            raise ValueError("no features were added to the coreset")
        merged = torch.cat(self.kept)
        self.kept = []
        k = min(coreset_size(self.total, self.ratio, self.count), merged.shape[0])
        idx = greedy_coreset(merged, k, self.projection_dim, self.seed, progress=progress)
        return merged[idx].clone()
