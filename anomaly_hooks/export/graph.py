"""Traceable torch modules that compute a fitted Detector's whole predict path, for export.

``PredictGraph(detector)`` maps a normalised batch ``[B, 3, H, W]`` to

* ``patch_scores`` ``[B, h, w]`` (the scorer's patch-score grid),
* ``heatmap`` ``[B, H, W]`` (bilinear upsampling + Gaussian blur, at the network input size),
* ``image_score`` ``[B]`` (max of the heatmap, or the scorer's own rule),
* then, for each layer of ``drift_layers``, its per-image channel means ``[B, C_l]`` (the
  drift monitor's layer statistic, :func:`anomaly_hooks.monitor.layer_statistics`, on the maps
  the scorer reads anyway).

A tiled (high-resolution) model's graph, :class:`TiledPredictGraph`, takes the working frames
``[B, 3, H, W]`` and each image's box ``[B, 2]`` (its own part of the frame) and runs the eager
tiled path (:mod:`anomaly_hooks.tiling.pipeline`) inside the graph: the tiles cut from the
frames by fixed slices, the backbone on all of them in one batch, each layer's kept cells
stitched back into one map per frame, then the embedding, the scorer (on tile windows for
statistics per tile position), the padding masked and the heatmap, as untiled. The stitching
comes before the embedding (its local pooling and PaDiM's per-position Gaussians read the
stitched grid), so the scorer cannot run per tile: the whole tiled path is one graph.

The generic parts live here: the backbone cut after the last tapped layer, the embedding
(a concatenation of resized layer maps) and the heatmap. The method's part comes from the
scorer (``Scorer.export_module``, in the method's wing): nothing here knows which method it
exports. Every piece uses ops that the ONNX exporter translates one to one (no in-place slice
writes, no data-dependent Python control flow).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from anomaly_hooks.embedding import PatchEmbedder
from anomaly_hooks.extractor import first_tensor
from anomaly_hooks.heatmap import (
    apply_operators,
    heatmap_operators,
    reference_maps,
    uses_products,
)
from anomaly_hooks.runtime.metadata import OUTPUTS, layer_means_output
from anomaly_hooks.tiling.pipeline import padding_masks


class _Stop(Exception):
    """Raised by the hook of the last tapped layer: the rest of the forward never runs."""


class TruncatedBackbone(nn.Module):
    """The backbone run up to its last tapped layer (in execution order), nothing after it.

    Same idea as :class:`~anomaly_hooks.extractor.HookFeatureExtractor` (hooks capture the
    layer outputs, the last one raises to stop the forward), but the hooks live for one forward
    call only, store into a per-call dict and stay out of inference mode, so that a tracer sees
    exactly the ops that ran, which end at the last tapped layer.

    Args:
        stop: False runs the whole forward (for ``torch.export``, which cannot trace the
            exception; its dead-code elimination drops the unused tail instead).
    """

    def __init__(self, model: nn.Module, layers: Sequence[str], order: Sequence[str],
                 stop: bool = True) -> None:
        super().__init__()
        self.model = model
        self.stop = stop
        self.layers = list(layers)
        self.last = list(order)[-1]
        named = dict(model.named_modules())
        self._targets = {name: named[name] for name in self.layers}

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        """``[B, 3, H, W]`` -> one ``[B, C_l, h_l, w_l]`` map per tapped layer."""
        store: Dict[str, torch.Tensor] = {}

        def hook(name: str, out: Any) -> None:
            if name not in store:
                store[name] = first_tensor(out)
            if self.stop and name == self.last and len(store) == len(self.layers):
                raise _Stop

        handles = [m.register_forward_hook(lambda _m, _i, o, n=name: hook(n, o))
                   for name, m in self._targets.items()]
        try:
            self.model(x)
        except _Stop:
            pass
        finally:
            for handle in handles:
                handle.remove()
        return [store[name] for name in self.layers]


def adaptive_pool_matrix(d_in: int, d_out: int) -> torch.Tensor:
    """``[d_in, d_out]`` matrix ``A`` with ``x @ A == adaptive_avg_pool1d(x, d_out)``."""
    a = torch.zeros(d_in, d_out)
    for j in range(d_out):
        lo = (j * d_in) // d_out
        hi = -((-(j + 1) * d_in) // d_out)
        a[lo:hi, j] = 1.0 / (hi - lo)
    return a


class Embed(nn.Module):
    """Traceable :class:`~anomaly_hooks.embedding.PatchEmbedder`: layer maps -> ``[B, P, D]``
    patch rows (P = h * w in row-major order, the order the scorers use). The channel subset is
    selected per layer before resizing, the projection and channel pooling become one matrix."""

    def __init__(self, embedder: PatchEmbedder) -> None:
        super().__init__()
        self.upsample = embedder.upsample
        self.local_pool = embedder.local_pool
        per = embedder.per_layer_channels
        self.selections = [None if per is None else per[i].clone().long()
                           for i in range(len(embedder.layers))]
        for i, sel in enumerate(self.selections):
            if sel is not None:
                self.register_buffer(f"sel{i}", sel)
        proj = embedder.projection.float() if embedder.projection is not None else None
        if embedder.pool_dim is not None:
            d_in = embedder.total_channels if proj is None else int(proj.shape[1])
            pool = adaptive_pool_matrix(d_in, embedder.pool_dim)
            proj = pool if proj is None else proj @ pool
        self.register_buffer("proj", proj.clone() if proj is not None else None)

    def _resize(self, fmap: torch.Tensor, h: int, w: int) -> torch.Tensor:
        fh, fw = fmap.shape[-2:]
        if (fh, fw) == (h, w):
            return fmap
        if self.upsample == "nearest" and h % fh == 0 and w % fw == 0:
            b, c = fmap.shape[:2]  # a broadcast copy: exact, as the eager embedder
            return fmap[:, :, :, None, :, None].expand(b, c, fh, h // fh, fw, w // fw) \
                .reshape(b, c, h, w)
        kw = {"align_corners": False} if self.upsample == "bilinear" else {}
        return F.interpolate(fmap, size=(h, w), mode=self.upsample, **kw)

    def forward(self, maps: List[torch.Tensor]) -> torch.Tensor:
        """One map per layer -> ``[B, P, D]`` float32 rows."""
        h, w = max((tuple(m.shape[-2:]) for m in maps), key=lambda s: s[0] * s[1])
        parts = []
        for i, fmap in enumerate(maps):
            if self.selections[i] is not None:
                sel = getattr(self, f"sel{i}")
                if sel.numel() == 0:
                    continue
                fmap = fmap.index_select(1, sel)
            fmap = fmap.float()
            if self.local_pool > 1:
                fmap = F.avg_pool2d(fmap, self.local_pool, stride=1, padding=self.local_pool // 2)
            parts.append(self._resize(fmap, h, w))
        rows = torch.cat(parts, dim=1).flatten(2).transpose(1, 2)  # [B, P, D]
        return rows @ self.proj if self.proj is not None else rows


class Heatmap(nn.Module):
    """Traceable :func:`~anomaly_hooks.heatmap.anomaly_maps`: patch scores ``[B, h, w]`` ->
    heatmaps ``[B, H, W]`` as two products with the pipeline's axis operators, held as
    buffers (constant ``MatMul`` operands in the exported graph; eager ``anomaly_maps`` keeps
    its own cached copies, which a tracer must not record); past
    :data:`~anomaly_hooks.heatmap.PRODUCTS_MAX_WORK` the reference operations, as eager."""

    def __init__(self, grid: Sequence[int], size: Sequence[int]) -> None:
        super().__init__()
        self.size = tuple(int(n) for n in size)
        self.products = uses_products(grid, size)
        if self.products:  # else the reference operations, as anomaly_maps decides
            a_v, a_h_t = heatmap_operators(grid, size)
            self.register_buffer("a_v", a_v)  # [H, h]
            self.register_buffer("a_h_t", a_h_t)  # [w, W]

    def forward(self, patch: torch.Tensor) -> torch.Tensor:
        """``[B, h, w]`` -> ``[B, H, W]`` float32."""
        if self.products:
            return apply_operators(patch, self.a_v, self.a_h_t)
        return reference_maps(patch, self.size)


def _plain_buffers(module: nn.Module) -> None:
    """Replace buffers made in inference mode (a fitted state is) by normal copies: a tracer
    cannot record operations on inference tensors."""
    for mod in module.modules():
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf is not None and buf.is_inference():
                mod._buffers[name] = buf.clone()


class PredictGraph(nn.Module):
    """A fitted Detector's predict path, ``[B, 3, H, W]`` -> (patch scores, heatmap, score).

    Args:
        detector: a fitted :class:`~anomaly_hooks.detector.Detector` on the CPU.
        stop: cut the backbone by stopping its forward (TorchScript exporter) or not (dynamo).
        drift_layers: tapped layers whose per-image channel means are extra outputs.
        heatmap_grid: the patch grid the heatmap is made from (default: the scorer's).
        options: passed to the scorer's ``export_module`` (e.g. PatchCore's ``search``).
    """

    def __init__(self, detector: Any, *, stop: bool = True, drift_layers: Sequence[str] = (),
                 heatmap_grid: Optional[Sequence[int]] = None, **options: Any) -> None:
        super().__init__()
        ext = detector.extractor
        self.backbone = TruncatedBackbone(ext.model, ext.layers, ext.order, stop=stop)
        unknown = sorted(set(drift_layers) - set(ext.layers))
        if unknown:
            raise ValueError(f"drift_layers {unknown} are not tapped layers ({ext.layers})")
        self.drift_layers: List[str] = list(drift_layers)
        self.drift_index = [list(ext.layers).index(name) for name in drift_layers]
        scorer = detector.scorer_
        self.embed = Embed(scorer.embedder)
        self.scorer = scorer.export_module(**options)
        self.form: str = self.scorer.form
        self.grid: Tuple[int, int] = tuple(scorer.grid)
        self.size: Tuple[int, int] = tuple(detector.preprocessor.input_size)
        self.heatmap = Heatmap(self.grid if heatmap_grid is None else heatmap_grid, self.size)
        _plain_buffers(self)

    @property
    def patch_grid(self) -> Tuple[int, int]:
        """``(h, w)`` of the ``patch_scores`` output (the metadata's ``grid``): the scorer's
        grid."""
        return self.grid

    @property
    def output_names(self) -> List[str]:
        """The graph's outputs in order: :data:`~anomaly_hooks.runtime.metadata.OUTPUTS`,
        then ``layer_means/<layer>`` of each drift layer."""
        return [*OUTPUTS, *(layer_means_output(name) for name in self.drift_layers)]

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """``[B, 3, H, W]`` -> ``[B, h, w]`` patch scores, ``[B, H, W]`` heatmap, ``[B]``
        image scores, then ``[B, C_l]`` channel means of each drift layer."""
        maps = self.backbone(x)
        rows = self.embed(maps)
        scores, aux = self.scorer(rows)  # [B, P]
        patch = scores.reshape(x.shape[0], self.grid[0], self.grid[1])
        heat = self.heatmap(patch)
        image = self.scorer.image_scores(rows, scores, aux, heat.flatten(1).amax(dim=1))
        return (patch, heat, image, *self.layer_means(maps))

    def layer_means(self, maps: Sequence[torch.Tensor], boxes: Any = None
                    ) -> Tuple[torch.Tensor, ...]:
        """Each drift layer's per-image channel means ``[B, C_l]`` of the layer maps
        ``[B, C_l, h_l, w_l]``: the eager taps' reduction (monitor.stats.layer_statistics),
        a float32 mean over h, w; with ``boxes`` ``[B, 2]`` (each image's own part of the
        frame, a tiled graph's input) over the cells whose top-left pixel is in the box, by a
        mask (traceable: no per-image slicing)."""
        if boxes is None:
            return tuple(maps[i].float().mean(dim=(2, 3)) for i in self.drift_index)
        return tuple(box_means(maps[i].float(), boxes, self.size) for i in self.drift_index)


def box_means(fmap: torch.Tensor, boxes: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """Channel means ``[B, C]`` of a layer map ``[B, C, h, w]`` of frames of ``size`` (H, W),
    each over the cells whose top-left pixel lies in its image's box ``[B, 2]`` (h, w at the
    top-left): monitor.stats.box_cells' rule, as a masked sum over a cell count."""
    h, w = fmap.shape[-2:]
    cell_y = torch.arange(h, device=fmap.device).view(1, h, 1) * (int(size[0]) // h)
    cell_x = torch.arange(w, device=fmap.device).view(1, 1, w) * (int(size[1]) // w)
    inside = ((cell_y < boxes[:, 0].view(-1, 1, 1)) & (cell_x < boxes[:, 1].view(-1, 1, 1))
              ).to(fmap.dtype).unsqueeze(1)  # [B, 1, h, w]
    count = inside.sum(dim=(2, 3)).clamp(min=1.0)  # [B, 1]
    return (fmap * inside).sum(dim=(2, 3)) / count


def stitch_tiles(tiles: torch.Tensor, grid: Any, stride: int) -> torch.Tensor:
    """Traceable :meth:`TileGrid.stitch`: every frame's tile maps ``[B * T, C, th/s, tw/s]``
    (or ``[B * T, th/s, tw/s]``) -> ``[B, C, H/s, W/s]``, each tile's kept cells by fixed
    slices and concatenations (no in-place writes)."""
    places = list(grid.tiles())
    per = tiles.reshape(-1, grid.n_tiles, *tiles.shape[1:])  # [B, T, ...]
    rows = []
    for i in range(len(grid.origins_y)):
        parts = []
        for j in range(len(grid.origins_x)):
            t = i * len(grid.origins_x) + j
            y, x, y0, y1, x0, x1 = places[t][:6]
            parts.append(per[:, t, ..., (y0 - y) // stride:(y1 - y) // stride,
                             (x0 - x) // stride:(x1 - x) // stride])
        rows.append(torch.cat(parts, dim=-1))
    return torch.cat(rows, dim=-2)


class TiledPredictGraph(PredictGraph):
    """A fitted tiled Detector's predict path: ``(frames [B, 3, H, W], boxes [B, 2] int64)``
    -> (patch scores ``[B, gh, gw]``, heatmap ``[B, H, W]``, image score ``[B]``, the drift
    layers' channel means), the eager :meth:`~anomaly_hooks.detector.Detector.infer` with
    ``sizes`` (see the module docstring).
    ``boxes``: each image's own part of the frame, (h, w) network pixels at its top-left
    (``Frame.placement`` of its size); the rest is padding, masked as eager masks it."""

    def __init__(self, detector: Any, *, stop: bool = True, **options: Any) -> None:
        tiling = detector.tiling
        size = tuple(detector.preprocessor.input_size)
        stride = int(tiling.grid_stride)
        frame_grid = (size[0] // stride, size[1] // stride)
        # the heatmap is the stitched frame's, not a tile's
        super().__init__(detector, stop=stop, heatmap_grid=frame_grid, **options)
        self.tile_grid = tiling.grid
        self.strides = [tiling.layer_strides[name] for name in detector.extractor.layers]
        self.grid_stride = stride
        self.tile_units = bool(tiling.tile_units)
        self.frame_grid = frame_grid

    @property
    def patch_grid(self) -> Tuple[int, int]:
        """The frame's grid ``(gh, gw)``: the patch scores are stitched back into it even when
        the scorer's own grid is a tile's (statistics per tile position)."""
        return self.frame_grid

    def cut(self, frames: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` -> every frame's tiles ``[B * T, 3, th, tw]``, image-major."""
        th, tw = self.tile_grid.tile
        tiles = [frames[:, :, y:y + th, x:x + tw] for y, x, *_ in self.tile_grid.tiles()]
        return torch.stack(tiles, dim=1).reshape(-1, frames.shape[1], th, tw)

    def windows(self, rows: torch.Tensor) -> torch.Tensor:
        """Frame rows ``[B, gh * gw, D]`` -> every tile window's rows ``[B * T, th * tw, D]``
        (:meth:`TileGrid.recut` of the embedding grid)."""
        gh, gw = self.frame_grid
        grid = rows.reshape(-1, gh, gw, rows.shape[-1])
        s = self.grid_stride
        th, tw = self.tile_grid.tile[0] // s, self.tile_grid.tile[1] // s
        parts = [grid[:, y // s:y // s + th, x // s:x // s + tw]
                 for y, x, *_ in self.tile_grid.tiles()]
        return torch.stack(parts, dim=1).reshape(-1, th * tw, rows.shape[-1])

    def forward(self, x: torch.Tensor, boxes: torch.Tensor  # type: ignore[override]
                ) -> Tuple[torch.Tensor, ...]:
        """Frames ``[B, 3, H, W]`` and boxes ``[B, 2]`` -> ``[B, gh, gw]`` patch scores,
        ``[B, H, W]`` heatmap, ``[B]`` image scores, then ``[B, C_l]`` channel means of each
        drift layer over the cells of its stitched frame map that hold pixels of the image's
        box (the padding left out: what the eager tiled path's taps and drift monitor read)."""
        maps = [stitch_tiles(f, self.tile_grid, s)
                for f, s in zip(self.backbone(self.cut(x)), self.strides)]
        rows = self.embed(maps)
        gh, gw = self.frame_grid
        if self.tile_units:  # statistics per tile position: windows scored, then stitched
            units = self.windows(rows)
            scores, aux = self.scorer(units)
            patch = stitch_tiles(scores.reshape(-1, *self.grid), self.tile_grid,
                                 self.grid_stride)
            rows, flat = units, scores
        else:
            scores, aux = self.scorer(rows)
            patch = scores.reshape(-1, gh, gw)
        patch, inside = padding_masks(patch, boxes, self.size)
        if not self.tile_units:
            flat = patch.flatten(1)
        heat = self.heatmap(patch)
        peak = torch.where(inside, heat, torch.full_like(heat, float("-inf")))
        image = self.scorer.image_scores(rows, flat, aux, peak.flatten(1).amax(dim=1))
        return (patch, heat, image, *self.layer_means(maps, boxes))
