"""Patch scores -> smooth anomaly heatmaps (bilinear upsampling, then a Gaussian blur)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

DEFAULT_SIGMA = 4.0


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


def anomaly_maps(patch_scores: torch.Tensor, size: Sequence[int],
                 sigma: float = DEFAULT_SIGMA) -> torch.Tensor:
    """``[B, h, w]`` patch scores -> ``[B, H, W]`` heatmaps at the network input size."""
    up = F.interpolate(patch_scores.unsqueeze(1).float(), size=tuple(size), mode="bilinear",
                       align_corners=False).squeeze(1)
    return gaussian_blur(up, sigma)
