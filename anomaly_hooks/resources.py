"""Memory guard: estimate what a fit and its model need before fitting, and refuse early (with
the estimate and the keys to change) rather than run out of memory an hour in."""
from __future__ import annotations

import math
from typing import Any, Dict, Sequence

import torch

from anomaly_hooks.extractor import LayerInfo

GB = 1024 ** 3
PADIM_BUFFER = 128  # samples per position buffered by the PaDiM accumulator


class ResourceError(ValueError):
    """The fit would need more memory than allowed."""


def available_memory(device: torch.device) -> int:
    """Bytes available now: free GPU memory on CUDA, else available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def _grid(layers: Sequence[LayerInfo], input_size: Sequence[int]) -> int:
    stride = min(info.stride for info in layers)
    return math.ceil(input_size[0] / stride) * math.ceil(input_size[1] / stride)


def _batch_bytes(cfg: Any, layers: Sequence[LayerInfo], input_size: Sequence[int],
                 dim: int) -> int:
    """One batch's layer outputs and embeddings (float32), with room for one copy each."""
    h, w = input_size
    feats = sum(info.channels * math.ceil(h / info.stride) * math.ceil(w / info.stride)
                for info in layers)
    return 2 * 4 * cfg.data.batch_size * (feats + dim * _grid(layers, input_size))


def estimate_fit_memory(cfg: Any, layers: Sequence[LayerInfo], input_size: Sequence[int],
                        n_train: int, n_threshold: int = 0) -> Dict[str, int]:
    """Peak bytes of the fit by part, and ``model`` (what the fitted model holds).
    ``n_threshold``: threshold images, kept preprocessed until the model is fitted."""
    est = _method_memory(cfg, layers, input_size, n_train)
    held = n_threshold * 3 * int(input_size[0]) * int(input_size[1]) * 4
    if held:
        est["threshold images (preprocessed)"] = held
        est["total"] += held
    return est


def _method_memory(cfg: Any, layers: Sequence[LayerInfo], input_size: Sequence[int],
                   n_train: int) -> Dict[str, int]:
    positions = _grid(layers, input_size)
    total_channels = sum(info.channels for info in layers)
    if cfg.method == "padim":
        return _padim_memory(cfg, layers, input_size, n_train, positions, total_channels)
    pc = cfg.patchcore
    d = pc.reduce_dim if pc.reduce_dim and pc.reduce_dim < total_channels else total_channels
    patches = n_train * positions
    kept = patches if pc.max_bank_points is None else min(patches, pc.max_bank_points)
    kept += 0 if pc.max_bank_points is None else cfg.data.batch_size * positions
    if pc.coreset_count is not None:
        bank_rows = min(patches, pc.coreset_count)
    else:
        bank_rows = math.ceil(pc.coreset_ratio * patches)
    bank = bank_rows * d * (2 if pc.bank_dtype == "float16" else 4)
    parts = {"patch features before the coreset": kept * d * 4,
             # projected features, their GEMM bound rows, float64 norms and distances, and
             # two [8192, pool 2048] float32 blocks of the batched selection
             "coreset selection (projection, distances)":
                 kept * (2 * (pc.projection_dim or d) + 6) * 4 + 2 * 8192 * 2048 * 4,
             "model (memory bank + index)": 2 * bank,
             "batch": _batch_bytes(cfg, layers, input_size, d)}
    return {**parts, "total": sum(parts.values()), "model": bank}


def _padim_memory(cfg: Any, layers: Sequence[LayerInfo], input_size: Sequence[int], n_train: int,
                  positions: int, total_channels: int) -> Dict[str, int]:
    from anomaly_hooks.scorers.gaussians import choose_covariance
    from anomaly_hooks.scorers.padim import default_n_features

    pad = cfg.padim
    d = pad.n_features or default_n_features(cfg.backbone.name, total_channels)
    batch = _batch_bytes(cfg, layers, input_size, d)
    if choose_covariance(pad.covariance, n_train, d, pad.factor_dtype) == "lowrank":
        # the stored samples become the centred embeddings Y in place; plus C^-1 [n, n]
        samples, small = positions * n_train * d * 4, positions * n_train * n_train * 4
        parts = {"training embeddings (low-rank form, centred in place)": samples,
                 "inverse Gram factors": small, "batch": batch}
        return {**parts, "total": sum(parts.values()),
                "model": samples + small + positions * d * 4}
    factor_bytes = 2 if pad.factor_dtype == "float16" else 4
    model = positions * d * d * factor_bytes + positions * d * 4
    # the float32 sums become the covariances, then the factors, in place
    parts = {"statistics (float32 sums, factorised in place)": positions * d * d * 4,
             "float16 factors": positions * d * d * 2 if factor_bytes == 2 else 0,
             "sample buffer": positions * PADIM_BUFFER * d * 4,
             "batch": batch}
    return {**parts, "total": sum(parts.values()), "model": model}


def memory_limit(cfg: Any, device: torch.device) -> int:
    """The configured limit in bytes."""
    res = cfg.resources
    if res.memory_limit_gb is not None:
        return int(res.memory_limit_gb * GB)
    return int(res.memory_fraction * available_memory(device))


def _advice(cfg: Any) -> str:
    if cfg.method == "padim":
        return ("lower padim.n_features (dense memory grows with its square, low-rank with "
                "it times the number of images), or preprocess.crop / resize, or use layers "
                "with a coarser grid")
    return ("set patchcore.max_bank_points (bounded-memory fit, e.g. 200000), lower "
            "patchcore.reduce_dim, or fit on fewer or smaller images")


def check_fit_memory(cfg: Any, layers: Sequence[LayerInfo], input_size: Sequence[int],
                     n_train: int, device: torch.device, n_threshold: int = 0) -> Dict[str, int]:
    """Raise :class:`ResourceError` when the estimate exceeds the limit; else the estimate."""
    est = estimate_fit_memory(cfg, layers, input_size, n_train, n_threshold)
    limit = memory_limit(cfg, device)
    if est["total"] > limit:
        parts = ", ".join(f"{k} {v / GB:.3g} GB" for k, v in est.items()
                          if k not in ("total", "model"))
        raise ResourceError(
            f"this {cfg.method} fit on {n_train} images needs about {est['total'] / GB:.3g} GB "
            f"({parts}) but the limit is {limit / GB:.3g} GB (resources.memory_limit_gb, or "
            f"resources.memory_fraction={cfg.resources.memory_fraction} of the available "
            f"memory): {_advice(cfg)}; or raise resources.memory_limit_gb")
    return est
