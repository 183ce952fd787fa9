"""Memory guard: estimate what a fit and its model need before fitting, and refuse early (with
the estimate and the keys to change) rather than run out of memory an hour in.

Each scorer estimates its own parts (:meth:`Scorer.estimate_memory`); this module adds what
every fit holds (the preprocessed threshold images) and compares the total with the limit.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Sequence, Tuple

import torch

from anomaly_hooks.errors import ResourceError
from anomaly_hooks.extractor import LayerInfo

GB = 1024 ** 3


def available_memory(device: torch.device) -> int:
    """Bytes available now: free GPU memory on CUDA, else available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
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
                        n_threshold: int = 0) -> Dict[str, int]:
    """Peak bytes of a fit by ``scorer`` (the method's class) by part, ``total``, and
    ``model`` (what the fitted model holds). ``n_threshold``: threshold images, kept
    preprocessed until the model is fitted."""
    est = scorer.estimate_memory(cfg, layers, input_size, n_train)
    held = n_threshold * 3 * int(input_size[0]) * int(input_size[1]) * 4
    if held:
        est["threshold images (preprocessed)"] = held
        est["total"] += held
    return est


def memory_limit(cfg: Any, device: torch.device) -> int:
    """The configured limit in bytes."""
    res = cfg.resources
    if res.memory_limit_gb is not None:
        return int(res.memory_limit_gb * GB)
    return int(res.memory_fraction * available_memory(device))


def check_fit_memory(scorer: type, cfg: Any, layers: Sequence[LayerInfo],
                     input_size: Tuple[int, int], n_train: int, device: torch.device,
                     n_threshold: int = 0) -> Dict[str, int]:
    """Raise :class:`ResourceError` when the estimate exceeds the limit; else the estimate."""
    est = estimate_fit_memory(scorer, cfg, layers, input_size, n_train, n_threshold)
    limit = memory_limit(cfg, device)
    if est["total"] > limit:
        parts = ", ".join(f"{k} {v / GB:.3g} GB" for k, v in est.items()
                          if k not in ("total", "model"))
        raise ResourceError(
            f"this {cfg.method} fit on {n_train} images needs about {est['total'] / GB:.3g} GB "
            f"({parts}) but the limit is {limit / GB:.3g} GB (resources.memory_limit_gb, or "
            f"resources.memory_fraction={cfg.resources.memory_fraction} of the available "
            f"memory): {scorer.memory_advice}; or raise "
            "resources.memory_limit_gb")
    return est
