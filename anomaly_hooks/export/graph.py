"""Traceable torch modules that compute a fitted Detector's whole predict path, for export.

``PredictGraph(detector)`` maps a normalised batch ``[B, 3, H, W]`` to

* ``patch_scores`` ``[B, h, w]`` (the scorer's patch-score grid),
* ``heatmap`` ``[B, H, W]`` (bilinear upsampling + Gaussian blur, at the network input size),
* ``image_score`` ``[B]`` (max of the heatmap, or the scorer's own rule),
* then, for each layer of ``drift_layers``, its per-image channel means ``[B, C_l]`` (the
  drift monitor's layer statistic, :func:`anomaly_hooks.monitor.layer_statistics`, on the maps
  the scorer reads anyway).

The generic parts live here: the backbone cut after the last tapped layer, the embedding
(a concatenation of resized layer maps) and the heatmap. The method's part comes from the
scorer (``Scorer.export_module``, in the method's wing): nothing here knows which method it
exports. Every piece uses ops that the ONNX exporter translates one to one (no in-place slice
writes, no data-dependent Python control flow).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from anomaly_hooks.embedding import PatchEmbedder
from anomaly_hooks.extractor import first_tensor
from anomaly_hooks.heatmap import anomaly_maps
from anomaly_hooks.runtime.metadata import OUTPUTS, layer_means_output


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
        per = embedder._per_layer
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
        options: passed to the scorer's ``export_module`` (e.g. PatchCore's ``search``).
    """

    def __init__(self, detector: Any, *, stop: bool = True, drift_layers: Sequence[str] = (),
                 **options: Any) -> None:
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
        _plain_buffers(self)

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
        heat = anomaly_maps(patch, self.size)
        image = self.scorer.image_scores(rows, scores, aux, heat.flatten(1).amax(dim=1))
        # the eager taps' reduction (monitor.stats.layer_statistics): float32 mean over h, w
        means = tuple(maps[i].float().mean(dim=(2, 3)) for i in self.drift_index)
        return (patch, heat, image, *means)
