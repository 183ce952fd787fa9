"""The ``tiling:`` config section (high-resolution inspection) and its checks (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from anomaly_hooks.choices import check

AUTO = "auto"


@dataclass
class TilingConfig:
    """High-resolution inspection: a working frame of the images' own aspect, cut into
    overlapping tiles whose features are stitched into one grid per image (docs/high-resolution.md).
    Off by default: the ``preprocess`` framing (256 -> 224) applies.
    With it on, ``preprocess.resize`` / ``crop`` are not used (``mean`` / ``std`` are)."""

    enabled: bool = False
    # network pixels per image pixel: "auto" (from the training images' size and max_pixels)
    # or a number; long_side / short_side set it from a side of the training images instead
    scale: str = AUTO
    long_side: Optional[int] = None  # the working frame's long side, network pixels
    short_side: Optional[int] = None  # or its short side
    max_pixels: int = 600_000  # scale=auto: the working frame's budget (never above 1:1)
    tile: List[int] = field(default_factory=lambda: [256, 256])  # network pixels (int or [h, w])
    overlap: int = 64  # between neighbouring tiles, network pixels (a multiple of 2 x stride)
    crop: Optional[List[float]] = None  # centre crop: fractions of height and width kept
    # an image of another aspect than the training images': "keep" (letterboxed in the frame)
    # or "stretch" (fills it: parts imaged at varying sizes land on the same positions)
    aspect: str = "keep"
    tile_batch: int = 16  # tiles per backbone forward pass (memory: the guard counts them)


def scale_value(section: Any) -> Optional[float]:
    """``tiling.scale`` as a number, or None for ``auto``."""
    text = str(section.scale).strip().lower()
    if text == AUTO:
        return None
    return float(text)


def validate(section: Any) -> None:
    """Range and cross-field checks of a ``tiling`` section."""
    try:
        scale = scale_value(section)
    except ValueError:
        scale = None
        check(False, "tiling.scale", "auto or a number > 0 (network pixels per image pixel)",
              section.scale)
    if scale is not None:
        check(0.0 < scale <= 16.0, "tiling.scale", "auto or a number in (0, 16]", section.scale)
    given = [k for k in ("long_side", "short_side") if section[k] is not None]
    check(len(given) + (scale is not None) <= 1, "tiling.scale",
          "one of tiling.scale (a number), tiling.long_side, tiling.short_side; the others "
          "auto / null", {k: section[k] for k in ("scale", "long_side", "short_side")})
    for key in given:
        check(16 <= section[key] <= 65_536, f"tiling.{key}", "16 to 65536 network pixels",
              section[key])
    check(10_000 <= section.max_pixels <= 1 << 30, "tiling.max_pixels",
          "10000 to 2**30 network pixels", section.max_pixels)
    check(len(section.tile) == 2 and all(32 <= v <= 8192 for v in section.tile), "tiling.tile",
          "an int or [height, width] of ints in 32..8192", list(section.tile))
    check(section.overlap >= 0 and all(section.overlap < v for v in section.tile),
          "tiling.overlap", "0 <= overlap < the tile size", section.overlap)
    if section.crop is not None:
        check(len(section.crop) == 2 and all(0.0 < f <= 1.0 for f in section.crop),
              "tiling.crop", "null (the whole image) or [height, width] fractions in (0, 1]",
              list(section.crop))
    check(section.aspect in ("keep", "stretch"), "tiling.aspect", "keep or stretch",
          section.aspect)
    check(1 <= section.tile_batch <= 4096, "tiling.tile_batch", "1 to 4096", section.tile_batch)
