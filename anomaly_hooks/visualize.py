"""Heatmap, overlay and mask images for people to look at."""
from __future__ import annotations

from typing import Optional

import numpy as np
from PIL import Image


def colorize(heatmap: np.ndarray, vmin: float, vmax: float, cmap: str = "jet") -> np.ndarray:
    """``[H, W]`` float map -> ``[H, W, 3]`` uint8 RGB with a matplotlib colour map."""
    from matplotlib import colormaps

    span = max(vmax - vmin, 1e-12)
    norm = np.clip((heatmap.astype(np.float32) - vmin) / span, 0.0, 1.0)
    rgba = colormaps[cmap](norm, bytes=True)
    return rgba[..., :3]


def overlay(image: np.ndarray, heat_rgb: np.ndarray, alpha: float = 0.45,
            mask: Optional[np.ndarray] = None) -> np.ndarray:
    """Blend a coloured heatmap onto an ``[H, W, 3]`` uint8 image; outline ``mask`` in white."""
    out = (image.astype(np.float32) * (1 - alpha) + heat_rgb.astype(np.float32) * alpha)
    out = out.clip(0, 255).astype(np.uint8)
    if mask is not None and mask.any():
        edge = mask & ~_erode(mask)
        out[edge] = 255
    return out


def _erode(mask: np.ndarray) -> np.ndarray:
    m = mask.copy()
    m[1:, :] &= mask[:-1, :]
    m[:-1, :] &= mask[1:, :]
    m[:, 1:] &= mask[:, :-1]
    m[:, :-1] &= mask[:, 1:]
    return m


def to_uint8_rgb(image_chw: "np.ndarray") -> np.ndarray:
    """``[3, H, W]`` float in [0, 1] -> ``[H, W, 3]`` uint8."""
    return (np.clip(np.transpose(image_chw, (1, 2, 0)), 0, 1) * 255 + 0.5).astype(np.uint8)


def save_png(array: np.ndarray, path) -> None:
    """Write an ``[H, W]`` bool/uint8 or ``[H, W, 3]`` uint8 array as PNG."""
    if array.dtype == bool:
        array = array.astype(np.uint8) * 255
    Image.fromarray(array).save(path)
