"""Patch scores -> smooth anomaly heatmaps (bilinear upsampling, then a Gaussian blur).

The definition is two reference operations: ``F.interpolate(bilinear, align_corners=False)``
to the network input size, then :func:`gaussian_blur` (separable, reflect-padded). Both are
linear and act on each axis separately, so the pipeline is ``A_v @ S @ A_h^T`` for a map ``S``
``[h, w]``, with one axis operator per axis (:func:`axis_operator`: the blur of that axis times
its bilinear interpolation, ``[H, h]`` and ``[W, w]``). :func:`anomaly_maps` computes the maps
as those two matrix products (a long single-channel 1-d convolution is slow on the CPU; two
small products are not), with operators built by running the reference operations on the
identity, so every edge case (a kernel clipped to a tiny map and renormalised, ``sigma`` 0,
no upsampling) keeps its exact meaning. The dense products do more multiply-adds than the
banded convolutions, more so the larger the frame; past :data:`PRODUCTS_MAX_WORK` times as many
(at sigma 4 with a grid a quarter of the frame's size: frames over about 7000 pixels a side)
the maps come from the reference operations (:func:`reference_maps`) instead.
"""
from __future__ import annotations

import functools
from typing import Sequence, Tuple

import torch
import torch.nn.functional as F

from anomaly_hooks.devices import ieee_float32

DEFAULT_SIGMA = 4.0
# The products are used while their multiply-adds are at most this many times the reference
# operations': on the CPU a float32 GEMM does 70-80x more multiply-adds per second than the
# single-channel 1-d convolutions (docs/benchmarks.md, "Heatmaps": 79x faster at 1.0x the
# work for 56 -> 224, 18x at 3.9x for 232 -> 928, 4.1x at 18x for 1024 -> 4096), so the limit
# keeps them at least about twice as fast
PRODUCTS_MAX_WORK = 32.0


def gaussian_kernel1d(sigma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Normalised 1-d Gaussian of size ``2 * floor(4 sigma + 0.5) + 1`` (33 for sigma 4),
    float64 (callers round it to the maps' dtype): scipy's ``gaussian_filter`` kernel."""
    radius = int(4.0 * sigma + 0.5)
    x = torch.arange(-radius, radius + 1, dtype=torch.float64, device=device)
    k = torch.exp(-0.5 * (x / sigma) ** 2)
    return k / k.sum()


def gaussian_blur(maps: torch.Tensor, sigma: float = DEFAULT_SIGMA) -> torch.Tensor:
    """Separable Gaussian blur of ``[B, H, W]`` maps with reflect padding (same size out)."""
    if sigma <= 0:
        return maps
    k = gaussian_kernel1d(sigma, maps.device).to(maps.dtype)
    r = (k.numel() - 1) // 2
    x = maps.unsqueeze(1)
    pad_h = min(r, x.shape[-1] - 1)
    pad_v = min(r, x.shape[-2] - 1)
    if pad_h < r or pad_v < r:  # tiny maps: reflect padding needs pad < size
        k_h = gaussian_kernel1d(sigma, maps.device)[r - pad_h: r + pad_h + 1]
        k_v = gaussian_kernel1d(sigma, maps.device)[r - pad_v: r + pad_v + 1]
        k_h, k_v = (k_h / k_h.sum()).to(maps.dtype), (k_v / k_v.sum()).to(maps.dtype)
    else:
        k_h = k_v = k
    x = F.conv2d(F.pad(x, (pad_h, pad_h, 0, 0), mode="reflect"), k_h.view(1, 1, 1, -1))
    x = F.conv2d(F.pad(x, (0, 0, pad_v, pad_v), mode="reflect"), k_v.view(1, 1, -1, 1))
    return x.squeeze(1)


def reference_maps(patch_scores: torch.Tensor, size: Sequence[int],
                   sigma: float = DEFAULT_SIGMA) -> torch.Tensor:
    """The heatmap pipeline's definition run as such: ``[B, h, w]`` -> ``[B, H, W]`` float32,
    bilinear upsampling (``align_corners=False``) to ``size``, then :func:`gaussian_blur`."""
    up = F.interpolate(patch_scores.unsqueeze(1).float(), size=tuple(size), mode="bilinear",
                       align_corners=False).squeeze(1)
    return gaussian_blur(up, sigma)


def products_work_ratio(grid: Sequence[int], size: Sequence[int],
                        sigma: float = DEFAULT_SIGMA) -> float:
    """Multiply-adds per map of the two products, ``H w (h + W)``, over those of
    :func:`reference_maps`, ``H W (2 taps + 4)`` (two blur passes of ``taps``, the bilinear
    blend): about 1 for 56 x 56 -> 224 x 224 at sigma 4; :func:`anomaly_maps` uses the products
    up to :data:`PRODUCTS_MAX_WORK`."""
    (h, w), (big_h, big_w) = (int(n) for n in grid), (int(n) for n in size)
    taps = 2 * int(4.0 * sigma + 0.5) + 1 if sigma > 0 else 0
    return big_h * w * (h + big_w) / (big_h * big_w * (2 * taps + 4))


def uses_products(grid: Sequence[int], size: Sequence[int],
                  sigma: float = DEFAULT_SIGMA) -> bool:
    """Whether the maps from ``grid`` to ``size`` are made by the two products (their work at
    most :data:`PRODUCTS_MAX_WORK` times the reference operations'), eager and exported
    alike; else by :func:`reference_maps`."""
    return products_work_ratio(grid, size, sigma) <= PRODUCTS_MAX_WORK


def axis_operator(n_in: int, n_out: int, sigma: float = DEFAULT_SIGMA, *,
                  vertical: bool = True) -> torch.Tensor:
    """The heatmap pipeline along one axis as a float64 matrix ``[n_out, n_in]``: column ``j``
    is what bilinear upsampling (``align_corners=False``) from ``n_in`` to ``n_out`` points,
    then :func:`gaussian_blur`, make of the unit impulse at ``j``. Built by running exactly
    those operations, along the axis they act on (``vertical``: maps ``[n_in, n_out, 1]``;
    else ``[n_in, 1, n_out]``); the other axis has length 1, where both are the identity
    (interpolation from 1 to 1 point, a blur kernel clipped to its centre tap)."""
    if n_in < 1 or n_out < 1:
        raise ValueError(f"axis_operator: sizes must be >= 1, got n_in={n_in}, n_out={n_out}")
    with torch.inference_mode(False):  # normal tensors, usable inside and outside the mode
        eye = torch.eye(n_in, dtype=torch.float64)
        impulses = eye.view(n_in, 1, n_in, 1) if vertical else eye.view(n_in, 1, 1, n_in)
        target = (n_out, 1) if vertical else (1, n_out)
        up = F.interpolate(impulses, size=target, mode="bilinear", align_corners=False)
        rows = gaussian_blur(up.squeeze(1), sigma)  # [n_in, n_out, 1] or [n_in, 1, n_out]
        return rows.reshape(n_in, n_out).T.contiguous()


def heatmap_operators(grid: Sequence[int], size: Sequence[int], sigma: float = DEFAULT_SIGMA
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The two float32 operators of the pipeline from ``grid`` ``(h, w)`` to ``size``
    ``(H, W)``: ``A_v`` ``[H, h]`` and ``A_h^T`` ``[w, W]`` (stored transposed, ready for
    the right-hand product), on the CPU; built in float64, then rounded once."""
    (h, w), (big_h, big_w) = (int(n) for n in grid), (int(n) for n in size)
    a_v = axis_operator(h, big_h, sigma, vertical=True)
    a_h = axis_operator(w, big_w, sigma, vertical=False)
    return a_v.float(), a_h.T.contiguous().float()


@functools.lru_cache(maxsize=16)
def _cached_operators(h: int, w: int, big_h: int, big_w: int, sigma: float, device: str
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`heatmap_operators` on ``device``, one copy per (sizes, sigma, device):
    ``H * h + w * W`` floats (100 KiB for 56 -> 224, 32 MiB for 1024 -> 4096)."""
    with torch.inference_mode(False):
        return tuple(op.to(device) for op in heatmap_operators((h, w), (big_h, big_w), sigma))


def apply_operators(patch_scores: torch.Tensor, a_v: torch.Tensor, a_h_t: torch.Tensor
                    ) -> torch.Tensor:
    """``A_v @ S @ A_h^T`` for each map ``S`` of ``patch_scores`` ``[B, h, w]`` with ``a_v``
    ``[H, h]`` and ``a_h_t`` ``[w, W]`` (:func:`heatmap_operators`) -> ``[B, H, W]``, in the
    operators' dtype: a broadcasting product ``[H, h] @ [B, h, w]`` (one batched product),
    then ``[B, H, w] @ [w, W]`` (one 2-d product over all rows). Traceable: two ``MatMul``
    with constant operators in an exported graph."""
    return torch.matmul(torch.matmul(a_v, patch_scores.to(a_v.dtype)), a_h_t)


def anomaly_maps(patch_scores: torch.Tensor, size: Sequence[int],
                 sigma: float = DEFAULT_SIGMA) -> torch.Tensor:
    """``[B, h, w]`` patch scores -> ``[B, H, W]`` float32 heatmaps at the network input size
    ``size`` (H, W): bilinear upsampling then :func:`gaussian_blur`, computed as two matrix
    products (see the module docstring, :func:`apply_operators`) with operators cached per
    sizes, sigma and device (as :func:`reference_maps` past :data:`PRODUCTS_MAX_WORK`), in
    IEEE float32 (no TF32) either way. Eager use: a traced graph holds the operators as
    constants instead (:func:`heatmap_operators`, :func:`apply_operators`)."""
    if patch_scores.dim() != 3:
        raise ValueError(f"anomaly_maps: patch scores must be [B, h, w], got shape "
                         f"{tuple(patch_scores.shape)}")
    h, w = patch_scores.shape[-2:]
    with ieee_float32():
        if not uses_products((h, w), size, sigma):
            return reference_maps(patch_scores, size, sigma)
        a_v, a_h_t = _cached_operators(int(h), int(w), int(size[0]), int(size[1]),
                                       float(sigma), str(patch_scores.device))
        # a strided batch (the fit's out-of-sample scores are a transposed [P, n] buffer)
        # takes another path through the batched product: as fast on idle cores, but beside
        # other busy torch processes it stalled far more often than a contiguous copy does
        # (3-15x slower, docs/benchmarks.md, "Heatmaps"); the copy is cheap
        return apply_operators(patch_scores.to(a_v.dtype).contiguous(), a_v, a_h_t)
