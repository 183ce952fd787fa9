"""Heatmap, overlay and mask images for people to look at."""
from __future__ import annotations

import functools
import gc
import os
import tempfile
from pathlib import Path
from typing import Callable, Dict, Optional, Union

import numpy as np
from PIL import Image

_BAND_PIXELS = 1 << 21  # pixels per band when a picture is built a band of rows at a time
_FAST_PNG_PIXELS = 4096 * 4096  # larger pictures are written with fast PNG compression


# matplotlib's "jet" segments (x, value) per channel: the colour map without matplotlib, for the
# torch-free runtime on an edge box (which installs numpy, Pillow and onnxruntime only)
_JET = (((0, 0), (0.35, 0), (0.66, 1), (0.89, 1), (1, 0.5)),
        ((0, 0), (0.125, 0), (0.375, 1), (0.64, 1), (0.91, 0), (1, 0)),
        ((0, 0.5), (0.11, 1), (0.34, 1), (0.65, 0), (1, 0)))


@functools.cache
def matplotlib_colormaps():
    """matplotlib's colour-map registry (ImportError without matplotlib), imported on first
    use. That first import leaves reference cycles through exceptions caught inside it (its
    pyparsing grammars'), whose frames reach up the calling stack: collected at once, or the
    caller's arrays (a full-size heatmap: 400 MB at 100 MP) stay alive until the next
    garbage collection, and a score's peak memory depends on when that comes. Cached (an
    ImportError is not: ``cache_clear()`` forgets the registry)."""
    from matplotlib import colormaps

    gc.collect()
    return colormaps


def colorize(heatmap: np.ndarray, vmin: float, vmax: float, cmap: str = "jet") -> np.ndarray:
    """``[H, W]`` float map -> ``[H, W, 3]`` uint8 RGB with a matplotlib colour map (``jet``
    also without matplotlib)."""
    span = max(vmax - vmin, 1e-12)
    norm = np.clip((heatmap.astype(np.float32) - vmin) / span, 0.0, 1.0)
    try:
        colormaps = matplotlib_colormaps()
    except ImportError:
        if cmap != "jet":
            raise
        x = np.linspace(0.0, 1.0, 256)  # matplotlib's 256-entry table, same indexing
        table = np.stack([np.interp(x, *zip(*seg)) for seg in _JET], axis=1)
        return (table * 255 + 0.5).astype(np.uint8)[np.minimum((norm * 256).astype(int), 255)]
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


def save_png(picture: Union[np.ndarray, Image.Image], path: Union[str, os.PathLike]) -> None:
    """Write an ``[H, W]`` bool/uint8 or ``[H, W, 3]`` uint8 array (or a PIL image) as PNG,
    atomically: a temporary file in the same folder renamed over ``path``, so a full disk
    leaves no half-written picture and a symbolic link at ``path`` is replaced, never
    followed. Pictures of more than ``_FAST_PNG_PIXELS`` pixels are compressed at zlib's
    fastest level (a 100 MP picture: seconds instead of most of a minute)."""
    if isinstance(picture, np.ndarray):
        if picture.dtype == bool:
            picture = picture.astype(np.uint8) * 255
        picture = Image.fromarray(picture)
    level = 1 if picture.size[0] * picture.size[1] > _FAST_PNG_PIXELS else 6
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            picture.save(fh, "PNG", compress_level=level)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _banded(size: tuple, mode: str, rows: Callable[[int, int], np.ndarray],
            into: Optional[Image.Image] = None) -> Image.Image:
    """A ``mode`` PIL image of ``size`` (W, H) (or ``into``, overwritten in place) filled a band
    of rows at a time from ``rows(top, bottom)`` (uint8 arrays), so no second full-size array
    exists."""
    width, height = size
    out = into if into is not None else Image.new(mode, size)
    step = max(1, _BAND_PIXELS // max(1, width))
    for top in range(0, height, step):
        bottom = min(top + step, height)
        out.paste(Image.fromarray(np.ascontiguousarray(rows(top, bottom))), (0, top))
    return out


def write_pictures(heatmap: np.ndarray, mask: np.ndarray, threshold: float,
                   original: Callable[[], Image.Image],
                   canonical_rows: Callable[[Image.Image, int, int], np.ndarray],
                   files: Dict[str, Path], alpha: float = 0.45) -> None:
    """Write the heatmap (colour-mapped, the threshold at mid-scale), the overlay (heatmap
    blended on the original, mask outlined in white) and the mask as PNGs at the image's own
    size: the same pictures as :func:`colorize` and :func:`overlay` of the whole arrays.

    Built a band of rows at a time: beside ``heatmap`` ``[H, W]`` float32 and ``mask``
    ``[H, W]`` bool, one picture (Pillow's RGB: 4 bytes per pixel) exists at once; the overlay
    is drawn into the decoded original itself when it is RGB. ``original()`` decodes the image
    (PIL, oriented); ``canonical_rows(img, top, bottom)`` gives its rows as float32
    ``[rows, W, 3]`` in [0, 1]. Keys of ``files``: ``heatmap``, ``overlay``, ``mask``.
    """
    height, width = heatmap.shape
    vmax = max(2 * threshold, float(heatmap.max()))

    def heat_rows(top: int, bottom: int) -> np.ndarray:
        return colorize(heatmap[top:bottom], vmin=0.0, vmax=vmax)

    save_png(_banded((width, height), "RGB", heat_rows), files["heatmap"])
    image = original()

    def overlay_rows(top: int, bottom: int) -> np.ndarray:
        rgb = (np.clip(canonical_rows(image, top, bottom), 0, 1) * 255 + 0.5).astype(np.uint8)
        out = (rgb.astype(np.float32) * (1 - alpha)
               + heat_rows(top, bottom).astype(np.float32) * alpha).clip(0, 255).astype(np.uint8)
        lo, hi = max(0, top - 1), min(height, bottom + 1)  # erosion needs the neighbour rows
        band = mask[lo:hi]
        edge = (band & ~_erode(band))[top - lo:top - lo + bottom - top]
        out[edge] = 255
        return out

    into = image if image.mode == "RGB" and image.size == (width, height) else None
    save_png(_banded((width, height), "RGB", overlay_rows, into=into), files["overlay"])
    image = into = None  # the decoded original goes before the mask is drawn
    save_png(_banded((width, height), "L",
                     lambda top, bottom: mask[top:bottom].astype(np.uint8) * 255),
             files["mask"])
