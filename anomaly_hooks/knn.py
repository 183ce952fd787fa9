"""Nearest-neighbour search over a memory bank: faiss (flat, IVF, HNSW; GPU when a GPU build is
importable) or a batched torch matrix-product search (any device).

Distances are **L2, not squared**. Whatever the backend, the distances of the returned
neighbours are recomputed exactly from the vectors (``|| q - b ||`` on the differences), so that
a query equal to a bank point gets distance 0 and not the rounding noise of the
``|q|^2 + |b|^2 - 2 q.b`` expansion the fast search uses internally.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

import numpy as np
import torch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "faiss-flat", "faiss-ivf", "faiss-hnsw", "torch")
QUERY_CHUNK = 8192  # queries per chunk when recomputing exact distances
TORCH_BLOCK_ELEMENTS = 1 << 24  # queries x bank rows per block of the torch search


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


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> ``faiss-flat`` when it can serve the device, else ``torch``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown knn backend {backend!r}: one of {', '.join(BACKENDS)}")
    faiss_ok = _faiss() is not None and (device.type == "cpu" or faiss_gpu_available())
    if backend == "auto":
        return "faiss-flat" if faiss_ok else "torch"
    if backend.startswith("faiss") and _faiss() is None:
        raise ValueError(f"knn backend {backend!r} needs faiss: pip install faiss-cpu "
                         "(or use knn_backend=torch)")
    return backend


class NearestNeighbors:
    """k-nearest-neighbour index over ``bank`` ``[M, D]`` (float32 or float16).

    ``search(queries [n, D], k)`` returns ``(distances [n, k] float32, indices [n, k] int64)``
    on the queries' device, nearest first. Read-only after construction: safe to search from
    many threads at once.
    """

    def __init__(self, bank: torch.Tensor, backend: str = "auto", nlist: int = 1024,
                 nprobe: int = 16, hnsw_m: int = 32, ef_search: int = 128,
                 seed: int = 0) -> None:
        if bank.ndim != 2 or bank.shape[0] == 0:
            raise ValueError(f"the bank must be a non-empty [M, D] tensor, got {tuple(bank.shape)}")
        self.bank = bank
        self.device = bank.device
        self.backend = resolve_backend(backend, bank.device)
        self.index = None
        if self.backend.startswith("faiss"):
            self.index = self._build_faiss(nlist, nprobe, hnsw_m, ef_search, seed)

    # -- construction ---------------------------------------------------------------------
    def _build_faiss(self, nlist: int, nprobe: int, hnsw_m: int, ef_search: int,
                     seed: int) -> Any:
        faiss = _faiss()
        m, d = self.bank.shape
        data = np.ascontiguousarray(self.bank.detach().float().cpu().numpy())
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
            index.train(data)
            index.nprobe = min(nprobe, nlist)
        else:
            index = faiss.IndexHNSWFlat(d, hnsw_m, faiss.METRIC_L2)
            index.hnsw.efSearch = ef_search
        index.add(data)
        if self.device.type == "cuda" and faiss_gpu_available():
            self._gpu_resources = faiss.StandardGpuResources()
            index = faiss.index_cpu_to_gpu(self._gpu_resources, self.device.index or 0, index)
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
        if self.index is None:
            idx = self._torch_search(queries, k)
        else:
            idx = self._faiss_search(queries, k)
        dist = self.exact_distances(queries, idx)
        dist, order = dist.sort(dim=1)
        return dist, idx.gather(1, order)

    def _faiss_search(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        q = np.ascontiguousarray(queries.detach().float().cpu().numpy())
        _, idx = self.index.search(q, k)
        if (idx < 0).any():  # IVF/HNSW may return fewer than k hits
            raise RuntimeError("the approximate index returned fewer than k neighbours: raise "
                               "patchcore.nprobe / ef_search, or use knn_backend=faiss-flat")
        return torch.from_numpy(idx).to(queries.device)

    def _torch_search(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        bank = self.bank.to(queries.device).float()
        bank_sq = bank.square().sum(dim=1)
        bank_t = bank.t()
        rows = max(1, TORCH_BLOCK_ELEMENTS // bank.shape[0])
        out = []
        for lo in range(0, queries.shape[0], rows):
            q = queries[lo:lo + rows].float()
            d2 = torch.addmm(bank_sq, q, bank_t, alpha=-2.0)  # |b|^2 - 2 q.b
            out.append(d2.topk(k, dim=1, largest=False).indices)
        return torch.cat(out)

    def exact_distances(self, queries: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``|| q_i - bank[idx[i, j]] ||`` ``[n, k]`` float32, computed on the differences."""
        bank = self.bank.to(queries.device)
        out = torch.empty(idx.shape, dtype=torch.float32, device=queries.device)
        k = idx.shape[1]
        rows = max(1, QUERY_CHUNK // k)
        for lo in range(0, queries.shape[0], rows):
            q = queries[lo:lo + rows].float().unsqueeze(1)
            b = bank[idx[lo:lo + rows]].float()
            out[lo:lo + rows] = torch.linalg.vector_norm(b - q, dim=2)
        return out
