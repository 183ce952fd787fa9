"""The working frame of a tiled model, decided at fit from the training images' size.

The frame is the same for every image the model sees (so that batches stack, PaDiM's
positions mean the same place, and a saved model predicts as it was fitted): the training
images' median size (after the configured crop) times the working scale, rounded up to the
coarsest tapped stride. The scale is ``tiling.scale`` (a number), or set by
``tiling.long_side`` / ``tiling.short_side``, or ``auto``: the largest scale not above 1 (no
upsampling) that keeps the frame within ``tiling.max_pixels`` network pixels.
"""
from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

from anomaly_hooks.errors import DataError
from anomaly_hooks.framing import Frame
from anomaly_hooks.tiling.config import scale_value

SIZE_SAMPLE = 64  # training images whose size is read (evenly spaced): the median of those
_ORIENTATION = 0x0112  # EXIF tag; values 5-8 swap width and height


def image_size(item: Any) -> Optional[Tuple[int, int]]:
    """(H, W) of an image as the decoder will give it (EXIF orientation applied), read from
    the file's header without decoding; None when it cannot be read (the fit reports it)."""
    try:
        if isinstance(item, (str, os.PathLike, bytes, bytearray)):
            source = io.BytesIO(bytes(item)) if isinstance(item, (bytes, bytearray)) \
                else Path(item)
            with Image.open(source) as img:
                width, height = img.size
                swap = img.getexif().get(_ORIENTATION, 1) in (5, 6, 7, 8)
            return (width, height) if swap else (height, width)
        if isinstance(item, Image.Image):
            return item.size[1], item.size[0]
        shape = tuple(item.shape)  # numpy HxW / HxWxC, torch CxHxW
        if hasattr(item, "permute") and len(shape) == 3:
            return int(shape[1]), int(shape[2])
        return int(shape[0]), int(shape[1])
    except (OSError, ValueError, AttributeError, TypeError, IndexError, SyntaxError):
        return None


def median_size(items: Sequence[Any], sample: int = SIZE_SAMPLE) -> Tuple[int, int]:
    """The median (H, W) of up to ``sample`` evenly spaced ``items`` (their headers)."""
    step = max(1, math.ceil(len(items) / sample))
    sizes = [s for s in (image_size(it) for it in list(items)[::step]) if s is not None]
    if not sizes:
        raise DataError(f"none of the {len(items)} training images could be read (their "
                        "size sets a tiled model's working frame): check the paths and files")
    arr = np.asarray(sizes, dtype=np.float64)
    return int(round(float(np.median(arr[:, 0])))), int(round(float(np.median(arr[:, 1]))))


def working_scale(section: Any, size: Tuple[int, int]) -> float:
    """Network pixels per image pixel for images of ``size`` (H, W, after the crop)."""
    if section.long_side is not None:
        return section.long_side / float(max(size))
    if section.short_side is not None:
        return section.short_side / float(min(size))
    scale = scale_value(section)
    if scale is not None:
        return scale
    return min(1.0, math.sqrt(section.max_pixels / float(size[0] * size[1])))


def working_frame(section: Any, size: Tuple[int, int], stride: int) -> Frame:
    """The :class:`Frame` for training images of median ``size`` (H, W): the crop, the scale,
    the content rounded to whole pixels and the frame rounded up to ``stride``."""
    crop = tuple(float(f) for f in section.crop) if section.crop is not None else None
    probe = Frame((1, 1), (1, 1), crop)
    _, _, ch, cw = probe.source_box(size)
    scale = working_scale(section, (ch, cw))
    content = (max(stride, int(round(ch * scale))), max(stride, int(round(cw * scale))))
    frame = tuple(stride * math.ceil(c / stride) for c in content)
    return Frame(content, frame, crop, section.aspect)  # type: ignore[arg-type]


def provisional_frame(section: Any, stride: int) -> Frame:
    """The frame of a tiled detector before its fit decides one: an explicit scale's frame is
    only known from the images too, so this is one tile (what a dry run or an estimate uses)."""
    tile = tuple(stride * math.ceil(int(v) / stride) for v in section.tile)
    crop = tuple(float(f) for f in section.crop) if section.crop is not None else None
    return Frame(tile, tile, crop, section.aspect)  # type: ignore[arg-type]
