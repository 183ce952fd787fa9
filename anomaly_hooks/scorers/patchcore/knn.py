"""Nearest-neighbour search over a memory bank: faiss (flat, IVF, HNSW; GPU when a GPU build is
importable), a batched torch matrix-product search (any device), or ``projected``: an exact
search that does most of its work in a low-dimensional PCA subspace of the bank.

``projected`` (the CPU default for banks of 2048+ rows of 256+ dimensions whose variance is
concentrated: 99.8 % of it in at most ``D / 4`` principal directions, as CNN patch features
usually are; otherwise ``auto`` keeps faiss flat) works with a *lower bound* of every distance.
An orthonormal projection ``P`` onto the bank's top principal directions splits a difference
into its subspace part and its residual, and the residual's norm is at least the difference of
the two residual norms, so

    ``|| P^T (q - b) ||^2 + (|q_perp| - |b_perp|)^2 <= || q - b ||^2``

for every bank row ``b``: a distance between *augmented* vectors (subspace coordinates plus the
residual norm, ``r + 1`` numbers) never exceeds the true distance. The ``c`` rows with the
smallest bounds are the candidates; their exact distances are computed; a query is *certified*
when its k-th best exact distance is no larger than the bound of the nearest row it has not
checked (every such row is at least that far in full space too). Certified answers are exactly
those of a full search. The few queries that are not certified are *refined*: every bank row
whose bound is below the query's current k-th distance (the true k nearest are among them) is
checked exactly, or, where that is more than an eighth of the bank, the query is searched in
full. The subspace (at most ``D / 4`` dimensions) only sets the speed: the results never depend
on it.

``auto`` also bounds the search's cost as banks and images grow (high resolution): when the
exact search of one image's patches (``queries_per_image`` x bank rows x dimensions; the
projected search counted at its ``D / 4`` subspace) would exceed ``AUTO_EXACT_WORK`` multiply-adds,
it builds ``faiss-ivf`` instead (``nlist`` lists, reduced to one per 39 bank rows; ``nprobe``
searched). Measured on banks of 20k-100k real EfficientNet-Lite0 patches (152-d) queried with
good and defective test patches (``benchmarks/bench_highres.py knn``): IVF with 16 of 512 lists
has recall@1 0.998 at an eighth of the exact search's time; its misses are a neighbour a few
per cent farther (the patch scores can only rise), and no image's largest patch score changed.
HNSW is not chosen: it answers the far-out queries, the defects, worst (largest patch score
off by 54 % at ``ef_search`` 64). Smaller searches stay exact, as before.

Distances are **L2, not squared**. Whatever the backend, the distances of the returned
neighbours are recomputed exactly from the vectors (``|| q - b ||`` on the differences), so that
a query equal to a bank point gets distance 0 and not the rounding noise of the
``|q|^2 + |b|^2 - 2 q.b`` expansion the fast search uses internally.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator, Optional, Tuple

import numpy as np
import torch

from anomaly_hooks.devices import block_elements

log = logging.getLogger(__name__)

BACKENDS = ("auto", "projected", "faiss-flat", "faiss-ivf", "faiss-hnsw", "torch")
PROJECTED_MIN_ROWS = 2048  # auto picks the projected search from this bank size on (CPU)
# auto: beyond this many multiply-adds for the exact search of one image's patches (about a
# second on two CPU cores), an IVF index; below, the exact searches (results independent of the
# index). The published 224-px protocol stays below it on every MVTec AD category (WRN50, 10 %
# bank of hazelnut's 391 images: 9e9 in the projected subspace; EfficientNet-Lite0 on bottle:
# 2e9); a 0.6 MP working frame at stride 8 with a 1 % bank of 200 images: 3e10.
AUTO_EXACT_WORK = 1.6e10
IVF_MIN_ROWS = 4096  # an IVF index needs enough rows to train its lists
PROJECTED_VARIANCE = 0.998  # fraction of the bank's variance the subspace keeps
PROJECTED_CANDIDATES = 16  # candidates checked per query beyond k
PCA_MAX_ROWS = 8192  # bank rows (evenly spaced) used to estimate the principal directions
QUERY_CHUNK = 2048  # queries per chunk when projecting
PAIR_CHUNK = 512  # pairs per chunk of exact distances on the CPU (temporaries stay in cache)
WIDEN_BYTES = 64 << 20  # float32 bytes of float16 bank rows widened at a time
# Blocks of queries x bank rows of a matrix-product search: devices.block_elements (cache-sized
# on the CPU, large on a GPU so that a search is a few big kernel launches).


def _faiss() -> Optional[Any]:
    try:
        import faiss  # noqa: PLC0415
    except ImportError:
        return None
    return faiss


def faiss_gpu_available() -> bool:
    """True when the installed faiss is a GPU build and sees a GPU."""
    faiss = _faiss()
    return (faiss is not None and hasattr(faiss, "StandardGpuResources")
            and faiss.get_num_gpus() > 0)


def _gpu_index_wanted(device: torch.device) -> bool:
    """Whether a faiss index for a bank on ``device`` goes to the GPU."""
    return device.type == "cuda" and faiss_gpu_available()


def to_gpu(faiss: Any, index: Any, backend: str, device: torch.device) -> Tuple[Any, Any]:
    """``(index, resources)``: a GPU copy of the CPU faiss ``index`` on ``device`` and its GPU
    resources. An HNSW index stays on the CPU (resources None): faiss has no GPU HNSW
    (``index_cpu_to_gpu`` raises "not implemented on GPU"); it is searched there, the queries
    copied over. A float16 flat index becomes a GPU flat index storing float16."""
    if backend == "faiss-hnsw":
        log.info("faiss-hnsw has no GPU implementation in faiss: the index stays on the CPU")
        return index, None
    resources = faiss.StandardGpuResources()
    gpu = device.index if device.index is not None else torch.cuda.current_device()
    return faiss.index_cpu_to_gpu(resources, gpu, index), resources


def exact_work(shape: Tuple[int, int], queries: int) -> float:
    """Multiply-adds of the exact search of ``queries`` rows in a bank ``[M, D]`` (the
    projected search's share: its subspace of at most ``D / 4`` dimensions)."""
    m, d = shape
    dims = max(d // 4, 16) if m >= PROJECTED_MIN_ROWS and d >= 256 else d
    return float(queries) * m * dims


def resolve_backend(backend: str, device: torch.device, shape: Tuple[int, int] = (0, 0),
                    dtype: torch.dtype = torch.float32,
                    queries_per_image: Optional[int] = None) -> str:
    """``auto`` -> ``faiss-ivf`` when the exact search of ``queries_per_image`` patches would
    cost more than ``AUTO_EXACT_WORK`` (and the bank has ``IVF_MIN_ROWS``; faiss present);
    else on CPU ``projected`` for banks ``[M, D]`` with ``M >= 2048`` and ``D >= 256``
    (kept only if the bank's spectrum suits it, see ``NearestNeighbors``); otherwise
    ``faiss-flat`` when it can serve the device, else ``torch``. On a GPU a float16 bank gets
    ``torch``: faiss's GPU float16 flat index rounds the queries to float16 too, where the
    torch search is exact on the bank's own values."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown knn backend {backend!r}: one of {', '.join(BACKENDS)}")
    faiss_ok = _faiss() is not None and (
        device.type == "cpu" or (faiss_gpu_available() and dtype == torch.float32))
    if backend == "auto":
        if (queries_per_image is not None and faiss_ok and shape[0] >= IVF_MIN_ROWS
                and exact_work(shape, queries_per_image) > AUTO_EXACT_WORK):
            return "faiss-ivf"
        if device.type == "cpu" and shape[0] >= PROJECTED_MIN_ROWS and shape[1] >= 256:
            return "projected"
        return "faiss-flat" if faiss_ok else "torch"
    if backend.startswith("faiss") and _faiss() is None:
        raise ValueError(f"knn backend {backend!r} needs faiss: pip install faiss-cpu "
                         "(or use knn_backend=torch)")
    return backend


class NearestNeighbors:
    """k-nearest-neighbour index over ``bank`` ``[M, D]`` (float32 or float16).

    ``search(queries [n, D], k)`` returns ``(distances [n, k] float32, indices [n, k] int64)``
    on the queries' device, nearest first. Safe to search from many threads at once: the
    state is read-only after construction, except that searches of a faiss GPU index (which
    is not thread-safe even for searching: its ``StandardGpuResources`` hold one scratch
    space and stream) take turns behind a lock. A float16 bank is kept as it is (no float32
    copy): the torch search widens it block by block, faiss flat stores it as float16.
    """

    def __init__(self, bank: torch.Tensor, backend: str = "auto", nlist: int = 1024,
                 nprobe: int = 16, hnsw_m: int = 32, ef_search: int = 128,
                 seed: int = 0, queries_per_image: Optional[int] = None) -> None:
        if bank.ndim != 2 or bank.shape[0] == 0:
            raise ValueError(f"the bank must be a non-empty [M, D] tensor, got {tuple(bank.shape)}")
        self.bank = bank
        self.device = bank.device
        # queries_per_image: the patches of one image (the grid), for auto's cost rule
        self.backend = resolve_backend(backend, bank.device, tuple(bank.shape), bank.dtype,
                                       queries_per_image)
        self.index = None
        self._gpu_resources: Any = None
        self._search_lock: Optional[threading.Lock] = None  # set for a faiss GPU index
        self._sq: Optional[torch.Tensor] = None  # the bank's squared norms [M], once needed
        self.projected: Optional[ProjectedSearch] = None
        if self.backend == "projected":
            projected = ProjectedSearch(bank)
            if backend == "auto" and not projected.tight:
                # a flat spectrum: the capped subspace would certify too few queries to pay
                self.backend = resolve_backend("auto", bank.device, dtype=bank.dtype)
            else:
                self.projected = projected
        if self.backend.startswith("faiss"):
            self.index = self._build_faiss(nlist, nprobe, hnsw_m, ef_search, seed)

    # -- construction ---------------------------------------------------------------------
    def _build_faiss(self, nlist: int, nprobe: int, hnsw_m: int, ef_search: int,
                     seed: int) -> Any:
        faiss = _faiss()
        m, d = self.bank.shape
        if self.backend == "faiss-flat":
            if self.bank.dtype == torch.float16:  # stores 2 bytes per value, exact on them
                index = faiss.IndexScalarQuantizer(d, faiss.ScalarQuantizer.QT_fp16,
                                                   faiss.METRIC_L2)
            else:
                index = faiss.IndexFlatL2(d)
        elif self.backend == "faiss-ivf":
            nlist = max(1, min(nlist, m // 39))  # faiss wants >= 39 training points per list
            index = faiss.IndexIVFFlat(faiss.IndexFlatL2(d), d, nlist, faiss.METRIC_L2)
            index.cp.seed = seed
            # the whole bank (a float32 copy only of a float16 or GPU bank, while training)
            index.train(np.ascontiguousarray(self.bank.detach().float().cpu().numpy()))
            index.nprobe = min(nprobe, nlist)
        else:
            index = faiss.IndexHNSWFlat(d, hnsw_m, faiss.METRIC_L2)
            index.hnsw.efSearch = ef_search
        for rows in _host_rows(self.bank):
            index.add(rows)
        if _gpu_index_wanted(self.device):
            index, self._gpu_resources = to_gpu(faiss, index, self.backend, self.device)
            if self._gpu_resources is not None:
                self._search_lock = threading.Lock()
        return index

    # -- search ---------------------------------------------------------------------------
    def search(self, queries: torch.Tensor, k: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
        """``k`` nearest bank rows of each query row; see the class docstring."""
        if queries.ndim != 2 or queries.shape[1] != self.bank.shape[1]:
            raise ValueError(f"queries must be [n, {self.bank.shape[1]}], got "
                             f"{tuple(queries.shape)}")
        if not 1 <= k <= self.bank.shape[0]:
            raise ValueError(f"k={k} must be between 1 and the bank size {self.bank.shape[0]}")
        if queries.shape[0] == 0:
            empty = torch.empty(0, k, device=queries.device)
            return empty, empty.long()
        if self.projected is not None:
            idx, dist = self.projected.search(queries, k, self)
        else:
            idx = self._torch_search(queries, k) if self.index is None else \
                self._faiss_search(queries, k)
            dist = self.exact_distances(queries, idx)
        dist, order = dist.sort(dim=1)
        return dist, idx.gather(1, order)

    def _faiss_search(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        q = np.ascontiguousarray(queries.detach().float().cpu().numpy())
        lock = self._search_lock if self._search_lock is not None else contextlib.nullcontext()
        with lock:  # a GPU index: one search at a time
            _, idx = self.index.search(q, k)
        if (idx < 0).any():  # IVF/HNSW may return fewer than k hits
            raise RuntimeError("the approximate index returned fewer than k neighbours: raise "
                               "patchcore.nprobe / ef_search, or use knn_backend=faiss-flat")
        return torch.from_numpy(idx).to(queries.device)

    def _torch_search(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        if self._sq is None:  # computed once (a race computes the same values twice)
            self._sq = _squared_norms(self.bank)
        return _gemm_topk(queries, self.bank, k, self._sq)[1]

    def exact_distances(self, queries: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``|| q_i - bank[idx[i, j]] ||`` ``[n, k]`` float32, computed on the differences."""
        n, k = idx.shape
        rows = torch.arange(n, device=idx.device).repeat_interleave(k)
        return pair_distances(self.bank, queries, rows, idx.reshape(-1)).view(n, k)


class ProjectedSearch:
    """Exact k-NN through a PCA subspace of the bank (see the module docstring).

    Holds the bank's mean ``[D]``, an orthonormal basis ``[D, r]`` and the *augmented* projected
    bank ``[M, r + 1]``: each row's ``r`` subspace coordinates plus the norm of its residual
    outside the subspace. For any two vectors, ``|P(q - b)|^2 + (|q_perp| - |b_perp|)^2 <=
    |q - b|^2`` (the residual norms differ by at most the residual difference's norm), so a
    distance between augmented vectors is a lower bound of the true distance, tighter than the
    subspace alone. The bank itself stays with the caller.
    """

    def __init__(self, bank: torch.Tensor) -> None:
        self.mean, self.basis, self.tight = principal_basis(bank)
        self.points = self._augment(bank)
        self.dims = int(self.basis.shape[1])
        self._sq = self.points.square().sum(dim=1)  # [M]
        self._sq_max = float(self._sq.max())
        faiss = _faiss()
        self._flat = None
        if faiss is not None and bank.device.type == "cpu":
            self._flat = faiss.IndexFlatL2(self.dims + 1)
            self._flat.add(self.points.numpy())

    def _augment(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, D]`` -> ``[n, r + 1]`` float32: subspace coordinates and the residual norm."""
        out = torch.empty(x.shape[0], self.basis.shape[1] + 1, device=x.device)
        for lo in range(0, x.shape[0], QUERY_CHUNK):
            centred = x[lo:lo + QUERY_CHUNK].float() - self.mean
            coords = centred @ self.basis
            resid = torch.linalg.vecdot(centred, centred) - torch.linalg.vecdot(coords, coords)
            out[lo:lo + QUERY_CHUNK, :-1] = coords
            out[lo:lo + QUERY_CHUNK, -1] = resid.clamp_min_(0).sqrt_()
        return out

    def _candidates(self, qa: torch.Tensor, c: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Squared lower bounds ``[n, c]`` (ascending) and bank rows ``[n, c]``."""
        if self._flat is not None:
            d2, idx = self._flat.search(np.ascontiguousarray(qa.numpy()), c)
            return torch.from_numpy(d2), torch.from_numpy(idx)
        return _gemm_topk(qa, self.points, c, self._sq)

    def search(self, queries: torch.Tensor, k: int,
               owner: "NearestNeighbors") -> Tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[n, k]`` and exact distances ``[n, k]`` (unsorted), equal to a full search."""
        n, m = queries.shape[0], self.points.shape[0]
        c = min(m, k + PROJECTED_CANDIDATES)
        qa = self._augment(queries)
        lb2, cand = self._candidates(qa, c)
        # float32 rounding of the bounds (and of the residual norms): certify with a margin
        tol = 1e-4 * (qa.square().sum(dim=1) + self._sq_max)
        exact = torch.full((n, c), float("inf"), device=queries.device)
        exact[:, :k] = owner.exact_distances(queries, cand[:, :k])
        kth2 = exact[:, :k].amax(dim=1).square()
        # only candidates whose lower bound is below the k-th exact distance can beat it
        qi, cj = torch.nonzero(lb2[:, k:] < (kth2 + tol).unsqueeze(1), as_tuple=True)
        cj = cj + k
        exact[qi, cj] = pair_distances(owner.bank, queries, qi, cand[qi, cj])
        dist, order = exact.topk(k, dim=1, largest=False)
        idx = cand.gather(1, order)
        # rows outside the candidates are at least lb2[:, c - 1] away (unless all were candidates)
        rows = torch.nonzero(dist.amax(dim=1).square() > lb2[:, c - 1].clamp_min(0) - tol
                             ).flatten() if c < m else torch.empty(0, dtype=torch.long)
        if rows.numel():
            idx[rows], dist[rows] = self._refine(queries, qa, rows, dist, tol, k, owner)
        return idx, dist

    def _refine(self, queries: torch.Tensor, qa: torch.Tensor, rows: torch.Tensor,
                dist: torch.Tensor, tol: torch.Tensor, k: int,
                owner: "NearestNeighbors") -> Tuple[torch.Tensor, torch.Tensor]:
        """The exact k-NN of the unsettled queries ``rows``: every bank row whose lower bound is
        below the query's current k-th distance (which the true k nearest all are) is checked
        exactly; a query with more than ``m / 8`` such rows gets a full search instead."""
        m = self.points.shape[0]
        out_i = torch.empty(rows.numel(), k, dtype=torch.long, device=queries.device)
        out_d = torch.empty(rows.numel(), k, device=queries.device)
        block = max(1, block_elements(queries.device) // m)
        for lo in range(0, rows.numel(), block):
            sel = rows[lo:lo + block]
            q = qa[sel]
            lb2 = torch.addmm(self._sq, q, self.points.t(), alpha=-2.0)
            lb2 += q.square().sum(dim=1, keepdim=True)
            limit = dist[sel].amax(dim=1).square() + tol[sel]
            keep = lb2 <= limit.unsqueeze(1)  # [b, M]
            count = keep.sum(dim=1)
            ok = (count >= k) & (count <= max(k, m // 8))
            few, many = torch.nonzero(ok).flatten(), torch.nonzero(~ok).flatten()
            if few.numel():
                qi, bj = torch.nonzero(keep[few], as_tuple=True)
                d = torch.full((few.numel(), m), float("inf"), device=queries.device)
                d[qi, bj] = pair_distances(owner.bank, queries, sel[few][qi], bj)
                val, ind = d.topk(k, dim=1, largest=False)
                out_d[lo + few], out_i[lo + few] = val, ind
            if many.numel():
                full = owner._torch_search(queries[sel[many]], k)
                out_i[lo + many] = full
                out_d[lo + many] = owner.exact_distances(queries[sel[many]], full)
        return out_i, out_d


def principal_basis(bank: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, bool]:
    """Mean ``[D]``, orthonormal top principal directions ``[D, r]`` of ``bank`` ``[M, D]`` and
    whether they are *tight*: ``r`` is the fewest keeping ``PROJECTED_VARIANCE`` of the variance,
    clipped to ``[min(D, 16), max(D // 4, 16)]``; tight when that clip did not cut it.
    Deterministic (no random sketch); at most ``PCA_MAX_ROWS`` evenly spaced rows estimate it."""
    m, d = bank.shape
    step = -(-m // PCA_MAX_ROWS)  # ceil: at most PCA_MAX_ROWS rows
    sample = bank[::step].float()
    mean = sample.mean(dim=0)
    centred = sample - mean
    cov = (centred.t() @ centred).double()
    evals, evecs = torch.linalg.eigh(cov)  # ascending, orthonormal columns
    evals = evals.flip(0).clamp_min(0)
    total = float(evals.sum())
    lo, hi = min(d, 16), max(d // 4, min(d, 16))
    if total > 0:
        # the value on the eigenvalues' device: a CPU scalar tensor beside CUDA ones raises
        target = torch.tensor(PROJECTED_VARIANCE, dtype=evals.dtype, device=evals.device)
        keep = int(torch.searchsorted(evals.cumsum(0) / total, target)) + 1
    else:
        keep = lo
    r = min(max(keep, lo), hi)
    return mean, evecs.flip(1)[:, :r].float().contiguous(), keep <= hi


def _host_rows(bank: torch.Tensor) -> Iterator[np.ndarray]:
    """The bank's rows as float32 numpy blocks for faiss: a float32 CPU bank itself (no
    copy), any other bank ``WIDEN_BYTES`` of float32 at a time."""
    if bank.dtype == torch.float32 and bank.device.type == "cpu":
        yield np.ascontiguousarray(bank.detach().numpy())
        return
    step = max(1, WIDEN_BYTES // (4 * bank.shape[1]))
    for lo in range(0, bank.shape[0], step):
        yield np.ascontiguousarray(bank[lo:lo + step].detach().float().cpu().numpy())


def _squared_norms(points: torch.Tensor) -> torch.Tensor:
    """``|p|^2`` ``[M]`` float32 of ``points`` ``[M, r]`` (any float dtype), in row blocks."""
    step = max(1, block_elements(points.device) // max(1, points.shape[1]))
    return torch.cat([points[lo:lo + step].float().square().sum(dim=1)
                      for lo in range(0, points.shape[0], step)])


def pair_distances(bank: torch.Tensor, queries: torch.Tensor, qi: torch.Tensor,
                   bi: torch.Tensor) -> torch.Tensor:
    """Exact distances of chosen pairs: ``|| queries[qi[j]] - bank[bi[j]] ||`` ``[len(qi)]``
    float32, computed on the differences (not the dot-product expansion, whose cancellation
    errs for near neighbours): the exact re-ranking of approximate candidates.

    Args:
        bank: ``[M, D]`` (any float dtype; any device, rows moved to the queries').
        queries: ``[N, D]`` float32.
        qi, bi: ``[K]`` row indices into ``queries`` and ``bank``.
    """
    out = torch.empty(qi.shape[0], device=queries.device)
    # cache-sized chunks on the CPU; on a GPU ~64 MB per temporary (few, large launches)
    chunk = PAIR_CHUNK if queries.device.type != "cuda" else max(
        PAIR_CHUNK, block_elements(queries.device) // (4 * queries.shape[1]))
    for lo in range(0, qi.shape[0], chunk):
        q = queries.index_select(0, qi[lo:lo + chunk])
        b = bank.index_select(0, bi[lo:lo + chunk].to(bank.device)).to(q.device, torch.float32)
        b.sub_(q)  # index_select made b a new tensor: safe to overwrite
        out[lo:lo + chunk] = torch.linalg.vecdot(b, b)
    return out.sqrt_()


def _gemm_topk(queries: torch.Tensor, points: torch.Tensor, k: int,
               sq: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Squared L2 ``[n, k]`` (ascending, by the dot-product expansion) and rows ``[n, k]`` of
    the ``k`` nearest ``points`` ``[M, r]``; ``sq``: the points' squared norms, if known.

    Float32 points on the queries' device are used as they are; any others (a float16 bank)
    are widened ``WIDEN_BYTES`` at a time, each block's top ``k`` merged into the running
    ones, so no float32 copy of the whole bank is ever made."""
    n, m = queries.shape[0], points.shape[0]
    dev = queries.device
    sq = (_squared_norms(points) if sq is None else sq).to(dev)
    same = points.dtype == torch.float32 and points.device == dev
    cols = m if same else max(k, WIDEN_BYTES // (4 * points.shape[1]))
    val = torch.empty(n, k, device=dev)
    ind = torch.empty(n, k, dtype=torch.long, device=dev)
    for first in range(0, m, cols):  # the first block has at least k rows (k <= m)
        pts = points[first:first + cols].to(dev, torch.float32)
        rows = max(1, block_elements(dev) // pts.shape[0])
        for lo in range(0, n, rows):
            d2 = torch.addmm(sq[first:first + pts.shape[0]], queries[lo:lo + rows].float(),
                             pts.t(), alpha=-2.0)  # |b|^2 - 2 q.b
            v, i = d2.topk(min(k, pts.shape[0]), dim=1, largest=False)
            if first:  # merge with the best of the earlier blocks
                v, pick = torch.cat([val[lo:lo + rows], v], 1).topk(k, dim=1, largest=False)
                i = torch.cat([ind[lo:lo + rows], i + first], 1).gather(1, pick)
            val[lo:lo + rows], ind[lo:lo + rows] = v, i
    for lo in range(0, n, QUERY_CHUNK):
        q = queries[lo:lo + QUERY_CHUNK].float()
        val[lo:lo + QUERY_CHUNK] += q.square().sum(dim=1, keepdim=True)
    return val, ind
