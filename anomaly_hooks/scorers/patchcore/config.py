"""PatchCore's config section (``patchcore:``) and its checks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from anomaly_hooks.choices import check, choices

ReduceMethod = choices("ReduceMethod", ["pool", "project"])
KnnBackend = choices("KnnBackend", ["auto", "projected", "faiss-flat", "faiss-ivf", "faiss-hnsw",
                                    "torch"])
BankDtype = choices("BankDtype", ["float32", "float16"])


@dataclass
class PatchCoreConfig:
    """PatchCore: coreset memory bank + nearest-neighbour distance."""

    local_pool: int = 3  # neighbourhood averaging (kernel size, stride 1)
    reduce_dim: Optional[int] = None  # target embedding dimension; null = keep all channels
    reduce_method: ReduceMethod = ReduceMethod["pool"]  # adaptive average pooling or random
    coreset_ratio: Optional[float] = 0.1
    coreset_count: Optional[int] = None  # absolute size; overrides the ratio when set
    projection_dim: Optional[int] = 128  # for the selection only; null = no projection
    max_bank_points: Optional[int] = None  # bounded-memory fit: merge-reduce when set
    # per-image pre-reduction (high resolution): each image keeps prereduce x its share of the
    # final bank, by the same greedy rule, as it arrives; null = every patch until the end
    prereduce: Optional[float] = None
    knn_backend: KnnBackend = KnnBackend["auto"]
    k: int = 1
    reweight: bool = False  # eq. 7 of the paper
    reweight_neighbors: int = 9  # b in eq. 7
    nlist: int = 1024  # faiss-ivf: number of lists (reduced for small banks)
    nprobe: int = 16  # faiss-ivf: lists searched
    hnsw_m: int = 32  # faiss-hnsw: graph degree
    ef_search: int = 128  # faiss-hnsw: search breadth
    bank_dtype: BankDtype = BankDtype["float32"]


def validate(pc: Any) -> None:
    """Range and cross-field checks of a ``patchcore`` section."""
    check(pc.local_pool >= 1 and pc.local_pool % 2 == 1, "patchcore.local_pool",
          "an odd int >= 1", pc.local_pool)
    if pc.coreset_ratio is not None:
        check(0.0 < pc.coreset_ratio <= 1.0, "patchcore.coreset_ratio", "0 < ratio <= 1",
              pc.coreset_ratio)
    if pc.coreset_count is not None:
        check(pc.coreset_count >= 1, "patchcore.coreset_count", ">= 1", pc.coreset_count)
    check(pc.coreset_ratio is not None or pc.coreset_count is not None,
          "patchcore.coreset_ratio", "a ratio or a coreset_count must be set", None)
    for key in ("reduce_dim", "projection_dim", "max_bank_points"):
        value = pc[key]
        if value is not None:
            check(value >= 1, f"patchcore.{key}", ">= 1 or null", value)
    if pc.prereduce is not None:
        check(pc.prereduce >= 1.0, "patchcore.prereduce",
              "a number >= 1 (kept points per image, as a multiple of its share of the final "
              "bank) or null (no pre-reduction)", pc.prereduce)
    for key in ("k", "reweight_neighbors", "nlist", "nprobe", "hnsw_m", "ef_search"):
        check(pc[key] >= 1, f"patchcore.{key}", ">= 1", pc[key])
