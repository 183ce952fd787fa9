"""The pictures the service sends back and keeps: overlay and mask PNGs, thumbnail JPEGs."""
from __future__ import annotations

import io
from typing import Tuple

import numpy as np
from PIL import Image


def fit_size(height: int, width: int, max_side: int) -> Tuple[int, int]:
    """(h, w) scaled down so that the long side is at most ``max_side`` (never scaled up)."""
    long_side = max(height, width)
    if long_side <= max_side:
        return height, width
    s = max_side / long_side
    return max(1, int(round(height * s))), max(1, int(round(width * s)))


def preview(image: np.ndarray, max_side: int) -> np.ndarray:
    """``[H, W, 3]`` uint8 copy of a canonical ``[H, W, 3]`` float32 image in [0, 1], long side
    <= ``max_side`` (antialiased bilinear: Pillow's filter, the Preprocessor's rule; numpy and
    Pillow only)."""
    from anomaly_hooks.runtime.preprocess import resize_aa

    h, w = fit_size(image.shape[0], image.shape[1], max_side)
    if (h, w) != tuple(image.shape[:2]):
        x = resize_aa(np.asarray(image, dtype=np.float32), (h, w), "pillow").transpose(1, 2, 0)
    else:
        x = np.asarray(image, dtype=np.float32)
    # clip, scale and round in one new array (an upload's preview is full size: each
    # temporary is a copy of the whole image)
    out = np.clip(x, 0, 1)
    out *= np.float32(255)
    out += np.float32(0.5)
    return np.ascontiguousarray(out).astype(np.uint8)


def png_bytes(array: np.ndarray) -> bytes:
    """PNG of an ``[H, W]`` bool/uint8 or ``[H, W, 3]`` uint8 array (fast compression)."""
    if array.dtype == bool:
        img = Image.fromarray(array.astype(np.uint8) * 255).convert("1")
    else:
        img = Image.fromarray(array)
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def jpeg_bytes(array: np.ndarray, max_side: int, quality: int = 80) -> bytes:
    """A small JPEG (thumbnail) of an ``[H, W, 3]`` uint8 array."""
    img = Image.fromarray(array)
    img.thumbnail((max_side, max_side), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
