"""Memory guard: estimate what a fit and its model need before fitting, and refuse early (with
the estimate and the keys to change) rather than run out of memory an hour in.

Each scorer estimates its own parts (:meth:`Scorer.estimate_memory`); this module adds what
every fit holds (the preprocessed threshold images) and compares the total with the limit.
On a GPU the parts live in two places: the scorer's on the GPU, the threshold images in host
RAM, each compared with its own budget. The GPU budget counts the memory PyTorch holds cached
but unused (it reuses those blocks), so repeated fits in one process see the same budget.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple

import torch

from anomaly_hooks.errors import ResourceError
from anomaly_hooks.extractor import LayerInfo

if TYPE_CHECKING:  # pragma: no cover
    from anomaly_hooks.tiling.pipeline import Tiling

GB = 1024 ** 3


HOST_PARTS = ("threshold images (preprocessed)",)  # estimate parts that live in host RAM


def available_memory(device: torch.device) -> int:
    """Bytes available now: on CUDA the driver's free memory plus what PyTorch's caching
    allocator holds reserved but unused (freed tensors it keeps for reuse: a fit can have
    them), else the available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free) + max(0, int(cached))
    import psutil

    return int(psutil.virtual_memory().available)


def grid_positions(layers: Sequence[LayerInfo], input_size: Sequence[int]) -> int:
    """Patch positions of the embedding grid (the finest tapped layer's)."""
    stride = min(info.stride for info in layers)
    return math.ceil(input_size[0] / stride) * math.ceil(input_size[1] / stride)


def batch_bytes(layers: Sequence[LayerInfo], input_size: Sequence[int], batch_size: int,
                dim: int) -> int:
    """One batch's layer outputs and ``dim``-d embeddings (float32), with room for one copy
    each."""
    h, w = input_size
    feats = sum(info.channels * math.ceil(h / info.stride) * math.ceil(w / info.stride)
                for info in layers)
    return 2 * 4 * batch_size * (feats + dim * grid_positions(layers, input_size))


def estimate_fit_memory(scorer: type, cfg: Any, layers: Sequence[LayerInfo],
                        input_size: Tuple[int, int], n_train: int,
                        n_threshold: int = 0, tiling: Optional["Tiling"] = None
                        ) -> Dict[str, int]:
    """Peak bytes of a fit by ``scorer`` (the method's class) by part, ``total``, and
    ``model`` (what the fitted model holds). ``n_threshold``: threshold images, kept
    preprocessed until the model is fitted. ``tiling``: a tiled model's tiles are counted:
    the layer outputs of one backbone pass over ``tiling.tile_batch`` tiles and a batch's
    stitched maps, and a scorer with statistics per tile position sees ``n_train`` times the
    tiles per image samples of a tile's grid."""
    if tiling is None:
        est = scorer.estimate_memory(cfg, layers, input_size, n_train)
    else:
        units = tiling.units_per_image
        unit_size = tiling.grid.tile if tiling.tile_units else input_size
        est = scorer.estimate_memory(cfg, layers, unit_size, n_train * units)
        extra = {"tiles (one backbone pass)": batch_bytes(layers, tiling.grid.tile,
                                                          tiling.tile_batch, 0),
                 "stitched layer maps (one batch)": batch_bytes(layers, input_size,
                                                                cfg.data.batch_size, 0)}
        est.update(extra)
        est["total"] += sum(extra.values())
    held = n_threshold * 3 * int(input_size[0]) * int(input_size[1]) * 4
    if held:
        est["threshold images (preprocessed)"] = held
        est["total"] += held
    return est


def memory_limit(cfg: Any, device: torch.device) -> int:
    """The configured limit in bytes (``device``'s memory: the GPU's on CUDA)."""
    res = cfg.resources
    if res.memory_limit_gb is not None:
        return int(res.memory_limit_gb * GB)
    return int(res.memory_fraction * available_memory(device))


def check_fit_memory(scorer: type, cfg: Any, layers: Sequence[LayerInfo],
                     input_size: Tuple[int, int], n_train: int, device: torch.device,
                     n_threshold: int = 0, tiling: Optional["Tiling"] = None
                     ) -> Dict[str, int]:
    """Raise :class:`ResourceError` when the estimate exceeds the limit; else the estimate.

    On CUDA the host-resident parts (``HOST_PARTS``) are checked against the host RAM budget
    (``memory_fraction`` of the available RAM) and the rest against the GPU's limit; on the
    CPU everything against one limit."""
    est = estimate_fit_memory(scorer, cfg, layers, input_size, n_train, n_threshold, tiling)
    parts = {k: v for k, v in est.items() if k not in ("total", "model")}
    if device.type == "cuda":
        host = {k: v for k, v in parts.items() if k in HOST_PARTS}
        gpu = {k: v for k, v in parts.items() if k not in HOST_PARTS}
        _check(scorer, cfg, n_train, gpu, memory_limit(cfg, device), f"GPU memory ({device})")
        host_limit = int(cfg.resources.memory_fraction * available_memory(torch.device("cpu")))
        _check(scorer, cfg, n_train, host, host_limit, "host RAM")
    else:
        _check(scorer, cfg, n_train, parts, memory_limit(cfg, device), "memory")
    return est


def _check(scorer: type, cfg: Any, n_train: int, parts: Dict[str, int], limit: int,
           where: str) -> None:
    total = sum(parts.values())
    if total <= limit:
        return
    listed = ", ".join(f"{k} {v / GB:.3g} GB" for k, v in parts.items())
    raise ResourceError(
        f"this {cfg.method} fit on {n_train} images needs about {total / GB:.3g} GB of {where} "
        f"({listed}) but the limit is {limit / GB:.3g} GB (resources.memory_limit_gb, or "
        f"resources.memory_fraction={cfg.resources.memory_fraction} of the available "
        f"{where}): {scorer.memory_advice}; or raise resources.memory_limit_gb")
