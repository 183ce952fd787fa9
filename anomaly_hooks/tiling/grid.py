"""Overlapping tiles of a working frame, and the stitching of their feature maps into one grid.

Tiles are cut at the backbone input. Along each axis of ``F`` pixels, the fewest tiles of at
most the configured size that cover it with overlaps of at least ``o``, each shrunk to the
least length (a multiple of ``S``) that still covers it, start at multiples of the coarsest
tapped stride ``S`` (so that every layer's cells line up with the frame's), spread evenly from
0 to ``F - t``.
Each frame position belongs to exactly one tile, the one whose *interior* holds it: the frame is
split at the middle of every overlap (rounded down to ``S``), so a kept cell lies at least
``o / 2`` pixels from its tile's inner edges (the frame's own edges are edges for any backbone).
Stitching copies, for every tapped layer of stride ``s``, each tile's kept cells into the
frame's map at ``1 / s`` of these coordinates: one feature grid per image, as if the backbone
had seen the whole frame with at least ``o / 2`` pixels of context around every position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, List, Sequence, Tuple

import torch

from anomaly_hooks.errors import ConfigError


def axis_plan(length: int, tile: int, overlap: int, stride: int
              ) -> Tuple[Tuple[int, ...], Tuple[int, ...], int]:
    """One axis: (tile origins, cuts, tile length). ``cuts`` has one more entry than origins:
    tile ``j`` keeps ``[cuts[j], cuts[j + 1])``. ``tile`` is the largest tile: the axis gets
    the fewest tiles of at most that length that cover it with the overlap, each as short as
    that allows (on ``stride``), so the backbone sees as few extra pixels as possible; a frame
    no longer than a tile is one tile of the frame's length."""
    if length <= tile:
        return (0,), (0, length), length
    n = math.ceil((length - overlap) / (tile - overlap))
    tile = min(tile, stride * math.ceil((length + (n - 1) * overlap) / (n * stride)))
    span = length - tile
    origins = [stride * ((j * span) // ((n - 1) * stride)) for j in range(n - 1)] + [span]
    cuts = [0]
    for left, right in zip(origins[:-1], origins[1:]):
        cuts.append(stride * ((left + tile + right) // (2 * stride)))  # mid-overlap, on S
    cuts.append(length)
    return tuple(origins), tuple(cuts), tile


@dataclass(frozen=True)
class TileGrid:
    """The tiles of a ``frame`` (H, W) network pixels (a multiple of ``stride``).

    Attributes:
        tile: (h, w) of every tile (the frame's size along an axis it fits in).
        origins_y / origins_x: top / left of the tile rows / columns.
        cuts_y / cuts_x: the kept ranges: tile row ``i`` keeps rows
            ``[cuts_y[i], cuts_y[i + 1])`` of the frame.
        stride: the coarsest tapped layer's stride ``S`` (origins and cuts are multiples).

    Tiles are numbered row-major; a batch of ``B`` frames gives ``B * n_tiles`` tiles,
    image-major (tile ``t`` of image ``b`` is ``b * n_tiles + t``).
    """

    frame: Tuple[int, int]
    tile: Tuple[int, int]
    origins_y: Tuple[int, ...]
    origins_x: Tuple[int, ...]
    cuts_y: Tuple[int, ...]
    cuts_x: Tuple[int, ...]
    stride: int

    @classmethod
    def plan(cls, frame: Sequence[int], tile: Sequence[int], overlap: int,
             stride: int) -> "TileGrid":
        """The grid of ``tile`` (h, w) tiles overlapping by ``overlap`` on ``frame``.

        Raises:
            ConfigError: a tile size that is not a multiple of ``stride``, or an overlap that
                is not a multiple of ``2 * stride`` (the kept halves must end on a cell of
                every layer), naming the key and the nearest valid values.
        """
        for side in tile:
            if side % stride:
                lo = max(stride, side // stride * stride)
                raise ConfigError(f"tiling.tile={list(tile)}: each side must be a multiple of "
                                  f"the coarsest tapped layer's stride {stride} (e.g. {lo} or "
                                  f"{lo + stride})")
        if overlap % (2 * stride):
            lo = overlap // (2 * stride) * 2 * stride
            raise ConfigError(f"tiling.overlap={overlap}: must be a multiple of twice the "
                              f"coarsest tapped layer's stride, {2 * stride} (e.g. {lo} or "
                              f"{lo + 2 * stride}), so that each tile keeps whole cells")
        if frame[0] % stride or frame[1] % stride:
            raise ValueError(f"frame {tuple(frame)} is not a multiple of the stride {stride}")
        oy, cy, th = axis_plan(int(frame[0]), int(tile[0]), overlap, stride)
        ox, cx, tw = axis_plan(int(frame[1]), int(tile[1]), overlap, stride)
        return cls((int(frame[0]), int(frame[1])), (th, tw), oy, ox, cy, cx, stride)

    @property
    def n_tiles(self) -> int:
        """Tiles per frame."""
        return len(self.origins_y) * len(self.origins_x)

    @property
    def overlap_factor(self) -> float:
        """Backbone input pixels per frame pixel (1 = no overlap)."""
        return self.n_tiles * self.tile[0] * self.tile[1] / float(self.frame[0] * self.frame[1])

    def min_margin(self) -> int:
        """The least distance in pixels from a kept position to an inner edge of its tile
        (the context every stitched feature had; the frame size for a single tile)."""
        margins = [min(self.frame)]
        for origins, cuts, t in ((self.origins_y, self.cuts_y, self.tile[0]),
                                 (self.origins_x, self.cuts_x, self.tile[1])):
            for j in range(len(origins) - 1):
                margins.append(origins[j] + t - cuts[j + 1])   # tile j's right/bottom margin
                margins.append(cuts[j + 1] - origins[j + 1])   # tile j + 1's left/top margin
        return min(margins)

    def tiles(self) -> Iterator[Tuple[int, int, int, int, int, int, int, int]]:
        """For each tile (row-major): its origin (y, x) and kept frame range
        (y0, y1, x0, x1), and its row and column."""
        for i, (y, ky0, ky1) in enumerate(zip(self.origins_y, self.cuts_y, self.cuts_y[1:])):
            for j, (x, kx0, kx1) in enumerate(zip(self.origins_x, self.cuts_x, self.cuts_x[1:])):
                yield y, x, ky0, ky1, kx0, kx1, i, j

    def cut(self, frames: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
        """Tiles ``indices`` (numbered image-major) of ``frames`` ``[B, C, H, W]`` ->
        ``[len(indices), C, th, tw]`` (a copy)."""
        places = list(self.tiles())
        th, tw = self.tile
        parts = []
        for k in indices:
            b, t = divmod(int(k), self.n_tiles)
            y, x = places[t][:2]
            parts.append(frames[b, :, y:y + th, x:x + tw])
        return torch.stack(parts)

    def stitch_into(self, out: torch.Tensor, tiles: torch.Tensor, indices: Sequence[int],
                    stride: int) -> None:
        """Copy the kept cells of tile maps ``tiles`` ``[n, C, th/s, tw/s]`` (tiles
        ``indices``, image-major) into ``out`` ``[B, C, H/s, W/s]`` (``s`` = ``stride``, a
        divisor of the grid's stride). ``C`` may be absent (``[n, th/s, tw/s]`` maps)."""
        places = list(self.tiles())
        for n, k in enumerate(indices):
            b, t = divmod(int(k), self.n_tiles)
            y, x, y0, y1, x0, x1 = places[t][:6]
            out[b, ..., y0 // stride:y1 // stride, x0 // stride:x1 // stride] = \
                tiles[n, ..., (y0 - y) // stride:(y1 - y) // stride,
                      (x0 - x) // stride:(x1 - x) // stride]

    def stitch(self, tiles: torch.Tensor, stride: int) -> torch.Tensor:
        """Every tile's map ``[B * T, C, th/s, tw/s]`` (or ``[B * T, th/s, tw/s]``) ->
        the frames' ``[B, C, H/s, W/s]``."""
        b = tiles.shape[0] // self.n_tiles
        if b * self.n_tiles != tiles.shape[0]:
            raise ValueError(f"{tiles.shape[0]} tile maps are not whole frames of "
                             f"{self.n_tiles} tiles")
        out = tiles.new_empty((b, *tiles.shape[1:-2], self.frame[0] // stride,
                               self.frame[1] // stride))
        self.stitch_into(out, tiles, range(tiles.shape[0]), stride)
        return out

    def recut(self, grid: torch.Tensor, stride: int) -> torch.Tensor:
        """Frames' maps ``[B, C, H/s, W/s]`` -> every tile's window of them
        ``[B * T, C, th/s, tw/s]`` (the stitched values: cells in a tile's margin come from
        the neighbour that kept them)."""
        th, tw = self.tile[0] // stride, self.tile[1] // stride
        parts: List[torch.Tensor] = []
        for b in range(grid.shape[0]):
            for y, x, *_ in self.tiles():
                ys, xs = y // stride, x // stride
                parts.append(grid[b, ..., ys:ys + th, xs:xs + tw])
        return torch.stack(parts)

    def as_dict(self) -> dict:
        """JSON-serialisable description (the model info)."""
        return {"frame": list(self.frame), "tile": list(self.tile),
                "tiles": [len(self.origins_y), len(self.origins_x)],
                "origins_y": list(self.origins_y), "origins_x": list(self.origins_x),
                "min_margin": self.min_margin(),
                "overlap_factor": round(self.overlap_factor, 4)}
