"""The tiled predict and fit path, as the detector calls it (its ``tiling`` attribute).

::

    frames [B, 3, H, W]                       Preprocessor with the working Frame
      │  TileGrid.cut, tile_batch tiles at a time -> the hooked extractor
      │  TileGrid.stitch_into per tapped layer    {layer: [B, C_l, H/s_l, W/s_l]}
      ▼
    the scorer's embedder on the stitched maps  [B, D, gh, gw]   (one grid per image)
      │  units(): as they are, or re-cut into tile windows [B*T, D, th/s, tw/s] for a scorer
      │  that shares its statistics by tile position (PaDiM ``positions: tile``)
      ▼
    scorer.score -> frame_scores(): tile windows' scores stitched back   [B, gh, gw]
      │  padding cells (letterbox, rounding) set to the image's least score (mask_padding);
      │  heatmap at the frame size; image score over the image's own box only
      ▼
    Preprocessor.to_original: the image's own part of the frame back to its size

Only the backbone sees tiles: everything after it sees one grid per image, so there is one
memory bank (PatchCore), one set of Gaussians (PaDiM) and one heatmap, with no seams to blend.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from anomaly_hooks.errors import ConfigError
from anomaly_hooks.extractor import LayerInfo
from anomaly_hooks.framing import Frame
from anomaly_hooks.tiling.frame import median_size, provisional_frame, working_frame
from anomaly_hooks.tiling.grid import TileGrid

Extract = Callable[[torch.Tensor], Dict[str, torch.Tensor]]


def strides(layers: Sequence[LayerInfo]) -> Tuple[int, int]:
    """(coarsest, finest) stride of the tapped layers; every stride must divide the coarsest
    (so that the tiles' cells line up on every layer)."""
    coarse, fine = max(i.stride for i in layers), min(i.stride for i in layers)
    odd = [i.name for i in layers if coarse % i.stride]
    if odd:
        raise ConfigError(f"tiling needs tapped layers whose strides divide the coarsest "
                          f"({coarse}); {odd} do not: {[(i.name, i.stride) for i in layers]}")
    return coarse, fine


class Tiling:
    """A tiled model's working frame, its tile grid and the steps around the scorer.

    Args:
        section: the ``tiling`` config section.
        frame: the working frame (decided at fit, or provisional before it).
        layers: the tapped layers (strides).
        tile_units: the scorer keeps its statistics per tile position (it sees re-cut tile
            windows of the stitched grid, and its patch scores are stitched back).
    """

    def __init__(self, section: Any, frame: Frame, layers: Sequence[LayerInfo],
                 tile_units: bool = False) -> None:
        self.section = section
        self.frame = frame
        self.layers = list(layers)
        self.layer_strides = {info.name: info.stride for info in layers}
        self.stride, self.grid_stride = strides(layers)
        self.grid = TileGrid.plan(frame.size, tuple(section.tile), int(section.overlap),
                                  self.stride)
        self.tile_units = tile_units
        self.tile_batch = int(section.tile_batch)

    @property
    def units_per_image(self) -> int:
        """The scorer's samples per image: its tile windows (``tile_units``), else 1."""
        return self.grid.n_tiles if self.tile_units else 1

    # -- the frame ---------------------------------------------------------------------------
    def decide(self, items: Sequence[Any]) -> Frame:
        """The working frame for training ``items`` (their median size and the section's
        scale rule)."""
        return working_frame(self.section, median_size(items), self.stride)

    def with_frame(self, frame: Frame) -> "Tiling":
        """The same tiling on another working frame."""
        return Tiling(self.section, frame, self.layers, self.tile_units)

    # -- predict and fit stages --------------------------------------------------------------
    def features(self, extract: Extract, frames: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Stitched layer maps ``{layer: [B, C_l, H/s_l, W/s_l]}`` of ``frames``
        ``[B, 3, H, W]``: their tiles through ``extract`` (the hooked extractor),
        ``tile_batch`` tiles per forward pass, across images."""
        grid = self.grid
        total = frames.shape[0] * grid.n_tiles
        out: Dict[str, torch.Tensor] = {}
        for lo in range(0, total, self.tile_batch):
            indices = range(lo, min(total, lo + self.tile_batch))
            feats = extract(grid.cut(frames, indices))
            for name, fmap in feats.items():
                stride = self.layer_strides[name]
                if name not in out:
                    out[name] = fmap.new_empty((frames.shape[0], fmap.shape[1],
                                                grid.frame[0] // stride,
                                                grid.frame[1] // stride))
                grid.stitch_into(out[name], fmap, indices, stride)
        return out

    def units(self, embeddings: torch.Tensor) -> torch.Tensor:
        """The scorer's units of frame embeddings ``[B, D, gh, gw]``: themselves, or their
        tile windows ``[B * T, D, th/s, tw/s]`` for a scorer with ``tile_units``."""
        if not self.tile_units:
            return embeddings
        return self.grid.recut(embeddings, self.grid_stride)

    def frame_scores(self, patch: torch.Tensor) -> torch.Tensor:
        """Patch scores of the scorer's units -> per frame ``[B, gh, gw]`` (tile windows'
        kept cells stitched back)."""
        if not self.tile_units:
            return patch
        return self.grid.stitch(patch, self.grid_stride)

    def boxes(self, sizes: Optional[Sequence[Tuple[int, int]]], batch: int
              ) -> List[Tuple[int, int]]:
        """Each image's own part of the frame, (h, w) network pixels at its top-left: its
        :meth:`Frame.placement` from its (H, W) in ``sizes``; without sizes the content box
        (an image of the training images' aspect)."""
        if sizes is None:
            return [tuple(self.frame.content)] * batch  # type: ignore[list-item]
        if len(sizes) != batch:
            raise ValueError(f"{len(sizes)} image sizes for a batch of {batch} frames")
        return [self.frame.placement(tuple(s)) for s in sizes]

    def mask_padding(self, patch: torch.Tensor, boxes: Sequence[Tuple[int, int]]
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Patch scores ``[B, gh, gw]`` of frames -> (the same with every cell that holds no
        pixel of its image set to the least score of the image's own cells, the pixel mask
        ``[B, H, W]`` of each image's box). The padding (the letterbox of an image of another
        aspect, and the rounding of the frame up to the stride) is no part: it must neither
        alarm nor, through the heatmap's blur, lift the scores at the part's edges."""
        boxes_t = torch.tensor([list(b) for b in boxes], dtype=torch.int64, device=patch.device)
        return padding_masks(patch, boxes_t, self.frame.size)

    # -- what the model says about itself ------------------------------------------------------
    def info(self) -> Dict[str, Any]:
        """The working frame and tiles (the model info)."""
        return {"mode": "tiled", **self.frame.as_dict(), "tiles": self.grid.as_dict(),
                "tile_units": self.tile_units,
                "uninspected_fraction": self.frame.uninspected_fraction}


def padding_masks(patch: torch.Tensor, boxes: torch.Tensor, size: Sequence[int]
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Patch scores ``[B, gh, gw]`` on a frame of ``size`` (H, W) and each image's box
    ``[B, 2]`` int64 (h, w network pixels at the top-left) -> (patch scores with the cells
    outside the box at the least score inside it, the pixel mask ``[B, H, W]``, True in the
    box). A cell is the image's when its top-left pixel is (it holds some of the image).
    Traceable (no data-dependent Python control flow): the ONNX export runs the same code."""
    gh, gw = patch.shape[-2:]
    height, width = int(size[0]), int(size[1])
    box_h, box_w = boxes[:, 0].view(-1, 1, 1), boxes[:, 1].view(-1, 1, 1)
    cell_y = torch.arange(gh, device=patch.device).view(1, gh, 1) * (height // gh)
    cell_x = torch.arange(gw, device=patch.device).view(1, 1, gw) * (width // gw)
    cells = (cell_y < box_h) & (cell_x < box_w)  # [B, gh, gw]
    inf = torch.full_like(patch, float("inf"))
    least = torch.where(cells, patch, inf).flatten(1).amin(dim=1).view(-1, 1, 1)
    masked = torch.where(cells, patch, least.expand_as(patch))
    pix_y = torch.arange(height, device=patch.device).view(1, height, 1)
    pix_x = torch.arange(width, device=patch.device).view(1, 1, width)
    return masked, (pix_y < box_h) & (pix_x < box_w)


def outside_to(maps: torch.Tensor, inside: torch.Tensor, value: float) -> torch.Tensor:
    """Heatmaps ``[B, H, W]`` with the pixels outside ``inside`` (a mask of that shape) at
    ``value`` (``-inf``: what an image score's max never picks)."""
    return torch.where(inside, maps, torch.full_like(maps, value))


def probe_size(cfg: Any, default: Tuple[int, int]) -> Tuple[int, int]:
    """The extractor's dry-run size: one tile for a tiled model, else the network input."""
    if not cfg.tiling.enabled:
        return default
    return tuple(int(v) for v in cfg.tiling.tile)  # type: ignore[return-value]


def build(cfg: Any, layers: Sequence[LayerInfo], tile_units: bool,
          frame: Optional[Frame] = None) -> Optional[Tiling]:
    """The config's :class:`Tiling` (None when ``tiling.enabled`` is off) on ``frame``, or on
    the provisional one-tile frame before a fit decides it."""
    section = cfg.tiling
    if not section.enabled:
        return None
    coarse, _ = strides(layers)
    return Tiling(section, frame if frame is not None else provisional_frame(section, coarse),
                  layers, tile_units)
