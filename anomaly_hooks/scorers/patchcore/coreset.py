"""Greedy k-center coreset selection (PatchCore's "approximate greedy" coreset), fast and O(N).

The rule (Sener & Savarese 2018; Roth et al. 2022): features are projected to a small seeded
random dimension for the selection only; a seeded first point is selected; then, repeatedly,
the point farthest from the selected set is selected. Only a running vector of each point's
distance to the selected set is kept — never an N x N matrix.

Two exact implementations of the same rule:

* :func:`greedy_dense` — one pass over all points per selected point (memory-bound). Used on
  CUDA, where a pass is cheap, and as the readable reference.
* :func:`greedy_pruned` — the CPU path. Points are grouped into *blocks* around already selected
  centres (re-grouped whenever the number of centres doubles). A block whose centre ``b`` is far
  from the new centre ``c`` cannot contain a point that ``c`` gets closer to, by the triangle
  inequality: for ``x`` in the block, ``d(x, c) >= d(c, b) - rho_b`` where ``rho_b`` bounds
  ``d(x, b)``; when that exceeds the block's largest current distance the block is skipped.
  Same selections as the dense pass (up to exact float ties), typically tens of times fewer
  distance evaluations.
"""
from __future__ import annotations

import math
from typing import List, Optional

import numpy as np
import torch

try:  # tqdm is a core dependency; the fallback only keeps imports cheap in odd environments
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
    tqdm = None

TOLERANCE = 1e-4  # relative slack on the pruning bound (float32 distances)
MIN_BLOCK_REBUILD = 16  # first re-grouping at this many centres, then at every doubling


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
    """Indices ``[k]`` (int64, in selection order) of a greedy k-center coreset of ``features``
    ``[N, D]``. ``method``: ``auto`` (dense on CUDA, pruned on CPU), ``dense`` or ``pruned``."""
    if features.ndim != 2 or features.shape[0] == 0:
        raise ValueError(f"features must be a non-empty [N, D] tensor, got {tuple(features.shape)}")
    n = features.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"coreset size k={k} must be between 1 and the {n} points")
    x = random_projection(features, projection_dim, seed)
    x = x - x.mean(dim=0, dtype=torch.float64).float()  # smaller norms: less float rounding
    start = first_index(n, seed)
    if method == "auto":
        method = "dense" if x.is_cuda else "pruned"
    if method == "dense":
        return greedy_dense(x, k, start, progress)
    if method == "pruned":
        idx = greedy_pruned(x.cpu().numpy(), k, start, progress)
        return torch.from_numpy(idx).to(features.device)
    raise ValueError(f"unknown coreset method {method!r}: auto, dense or pruned")


def _bar(total: int, enabled: bool, desc: str = "coreset"):
    if not enabled or tqdm is None:
        return None
    return tqdm(total=total, desc=desc, unit="pt", dynamic_ncols=True, leave=False)


def greedy_dense(x: torch.Tensor, k: int, start: int, progress: bool = False) -> torch.Tensor:
    """Reference greedy k-center on ``x`` ``[N, p]`` (any device): ``k`` passes over all points.
    Already selected points are never selected again (ties go to the lowest index)."""
    n = x.shape[0]
    min_d = torch.full((n,), float("inf"), device=x.device)
    selected = torch.empty(k, dtype=torch.long, device=x.device)
    bar = _bar(k, progress)
    idx = torch.tensor(start, device=x.device)
    for i in range(k):
        selected[i] = idx
        c = x[idx]
        d = torch.linalg.vector_norm(x - c, dim=1)
        torch.minimum(min_d, d, out=min_d)
        min_d[idx] = -1.0  # never again
        idx = torch.argmax(min_d)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return selected


class _Blocks:
    """Points sorted by block; per block its centre, radius bound and current maximum."""

    def __init__(self, x: np.ndarray, assign: np.ndarray, centres: np.ndarray,
                 m: np.ndarray) -> None:
        self.order = np.argsort(assign, kind="stable")  # sorted position -> original index
        self.xs = x[self.order]
        self.sq = np.einsum("ij,ij->i", self.xs, self.xs)
        self.m = m[self.order]
        block_ids, self.start = np.unique(assign[self.order], return_index=True)
        self.stop = np.append(self.start[1:], len(self.order))
        self.centre = x[centres[block_ids]]  # [nb, p]
        self.centre_sq = np.einsum("ij,ij->i", self.centre, self.centre)
        self.max = np.maximum.reduceat(self.m, self.start)  # [nb] current max of m
        self.rho = self.max.copy()  # fixed bound on d(x, centre) within the block
        self.arg = self.start + _segment_argmax(self.m, self.start, self.max)

    def update(self, c: np.ndarray, c_sq: float, tol: float) -> Optional[np.ndarray]:
        """Lower distances to the new centre ``c``; return the sorted positions that moved."""
        dcb = np.sqrt(np.maximum(self.centre_sq - 2.0 * (self.centre @ c) + c_sq, 0.0))
        cand = np.flatnonzero(dcb - self.rho <= self.max + tol)
        if cand.size == 0:
            return None
        pos = _ranges(self.start[cand], self.stop[cand])
        d = np.sqrt(np.maximum(self.sq[pos] - 2.0 * (self.xs[pos] @ c) + c_sq, 0.0))
        closer = d < self.m[pos]
        moved = pos[closer]
        self.m[moved] = d[closer]
        seg = np.concatenate(([0], np.cumsum(self.stop[cand] - self.start[cand])[:-1]))
        sub = self.m[pos]
        self.max[cand] = np.maximum.reduceat(sub, seg)
        self.arg[cand] = pos[seg + _segment_argmax(sub, seg, self.max[cand])]
        return moved


def _ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(start, stop)`` for each pair (vectorised)."""
    lengths = stops - starts
    total = int(lengths.sum())
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return np.arange(total) + offsets


def _segment_argmax(values: np.ndarray, seg_start: np.ndarray, seg_max: np.ndarray) -> np.ndarray:
    """Offset of the first maximum inside each segment of ``values``."""
    seg_len = np.diff(np.append(seg_start, len(values)))
    local = np.arange(len(values)) - np.repeat(seg_start, seg_len)
    is_max = values == np.repeat(seg_max, seg_len)
    return np.minimum.reduceat(np.where(is_max, local, np.iinfo(np.int64).max), seg_start)


def greedy_pruned(x: np.ndarray, k: int, start: int, progress: bool = False) -> np.ndarray:
    """Greedy k-center on ``x`` ``[N, p]`` (float32 numpy) with triangle-inequality pruning;
    returns ``[k]`` int64 original indices in selection order."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[0]
    sq = np.einsum("ij,ij->i", x, x)
    tol = TOLERANCE * float(np.sqrt(sq.max())) + 1e-12
    m = np.sqrt(np.maximum(sq - 2.0 * (x @ x[start]) + sq[start], 0.0)).astype(np.float32)
    assign = np.zeros(n, dtype=np.int64)
    centres = np.array([start], dtype=np.int64)
    selected = np.empty(k, dtype=np.int64)
    selected[0] = start
    m[start] = -1.0
    blocks = _Blocks(x, assign, centres, m)
    next_rebuild = MIN_BLOCK_REBUILD
    bar = _bar(k, progress)
    for i in range(1, k):
        b = int(np.argmax(blocks.max))
        if blocks.max[b] < 0:  # every point is selected already (k == n)
            raise RuntimeError("coreset selection ran out of points")
        p = int(blocks.arg[b])
        idx = int(blocks.order[p])
        selected[i] = idx
        c = blocks.xs[p]
        moved = blocks.update(c, float(blocks.sq[p]), tol)
        blocks.m[p] = -1.0
        blocks.max[b] = np.max(blocks.m[blocks.start[b]:blocks.stop[b]])
        blocks.arg[b] = blocks.start[b] + int(np.argmax(blocks.m[blocks.start[b]:blocks.stop[b]]))
        if moved is not None and moved.size:
            assign[blocks.order[moved]] = i
        if i + 1 >= next_rebuild and i + 1 < k:
            centres = selected[:i + 1]
            m = np.empty(n, dtype=np.float32)
            m[blocks.order] = blocks.m
            assign[centres] = np.arange(i + 1)
            blocks = _Blocks(x, assign, centres, m)
            next_rebuild *= 2
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.update(1)
        bar.close()
    return selected


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
    reductions (the README gives measured radii and AUROC against the one-shot coreset).
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

    def add(self, features: torch.Tensor) -> None:
        """Add a chunk ``[n, D]`` of patch features (reduced at once if it alone exceeds the
        budget)."""
        if features.shape[0] == 0:
            return
        self.total += features.shape[0]
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
