"""Patch embeddings: each tapped layer's map brought to one grid and concatenated."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from anomaly_hooks.extractor import LayerInfo


class PatchEmbedder:
    """Turn ``{layer: [B, C_l, h_l, w_l]}`` into one ``[B, D, h, w]`` patch-embedding map.

    The grid (h, w) is the finest (largest) of the tapped layers' grids.

    Args:
        layers: the extractor's per-layer description, in the order of concatenation.
        upsample: ``nearest`` (PaDiM) or ``bilinear`` (PatchCore).
        local_pool: average each layer over a ``k x k`` neighbourhood first (stride 1, padding
            k // 2; PatchCore uses 3); 1 = no pooling.
        channel_idx: optional sorted indices into the concatenated channels (PaDiM's random
            subset), ``[D]`` int64. Selected before upsampling, which gives the same result with
            less memory.
        projection: optional ``[C, D]`` matrix applied per patch after concatenation.
        pool_dim: optional target dimension by adaptive average pooling over channels.
    """

    def __init__(
        self,
        layers: Sequence[LayerInfo],
        *,
        upsample: str = "nearest",
        local_pool: int = 1,
        channel_idx: Optional[torch.Tensor] = None,
        projection: Optional[torch.Tensor] = None,
        pool_dim: Optional[int] = None,
    ) -> None:
        if upsample not in ("nearest", "bilinear"):
            raise ValueError(f"upsample={upsample!r}: use nearest or bilinear")
        self.layers: List[LayerInfo] = list(layers)
        self.upsample = upsample
        self.local_pool = local_pool
        self.total_channels = sum(info.channels for info in self.layers)
        self.channel_idx = channel_idx
        self.projection = projection
        self.pool_dim = pool_dim
        self._per_layer = self._split_indices(channel_idx) if channel_idx is not None else None
        # device -> (per-layer indices, projection) on it: copied once, not on every call
        self._on_device: Dict[torch.device, Tuple[Optional[List[torch.Tensor]],
                                                  Optional[torch.Tensor]]] = {}

    def _split_indices(self, idx: torch.Tensor) -> List[torch.Tensor]:
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.total_channels):
            raise ValueError(f"channel indices must lie in [0, {self.total_channels})")
        parts, start = [], 0
        for info in self.layers:
            sel = idx[(idx >= start) & (idx < start + info.channels)] - start
            parts.append(sel.to(torch.long))
            start += info.channels
        return parts

    def _tensors_on(self, device: torch.device
                    ) -> Tuple[Optional[List[torch.Tensor]], Optional[torch.Tensor]]:
        """The per-layer channel indices and the projection matrix on ``device`` (cached; two
        threads filling the cache at once store equal copies)."""
        cached = self._on_device.get(device)
        if cached is None:
            per_layer = (None if self._per_layer is None
                         else [sel.to(device) for sel in self._per_layer])
            projection = None if self.projection is None else self.projection.to(device)
            cached = self._on_device[device] = (per_layer, projection)
        return cached

    @property
    def per_layer_channels(self) -> Optional[List[torch.Tensor]]:
        """The channel subset split per layer: for each layer a ``[k_l]`` long tensor of its
        own channel indices (``channel_idx`` minus the layer's offset), or None where no subset
        is set (every channel is kept)."""
        return self._per_layer

    @property
    def out_channels(self) -> int:
        """D, the embedding dimension."""
        if self.pool_dim is not None:
            return self.pool_dim
        if self.projection is not None:
            return int(self.projection.shape[1])
        if self.channel_idx is not None:
            return int(self.channel_idx.numel())
        return self.total_channels

    def __call__(self, feats: Dict[str, torch.Tensor]) -> torch.Tensor:
        """``{layer: [B, C_l, h_l, w_l]}`` -> ``[B, D, h, w]`` float32 in **channels-last**
        memory: ``emb.permute(0, 2, 3, 1)`` is a contiguous ``[B, h, w, D]`` tensor, so a
        scorer reads each patch's ``D`` values as one row (``[B * h * w, D]`` patches, or
        ``[h * w, B, D]`` per position) without a transposing copy.

        Each layer is transposed to channels-last once, at its own (coarse) resolution, then
        pooled and resized straight into its slice of one preallocated output (no concatenation
        copy). Nearest upsampling by an integer factor is a broadcast copy (exact); bilinear
        upsampling is ``F.interpolate`` on the channels-last map, which is fast on the CPU.
        """
        maps = [feats[info.name] for info in self.layers]
        size = tuple(max((m.shape[-2:] for m in maps), key=lambda s: s[0] * s[1]))
        per_layer, projection = self._tensors_on(maps[0].device)
        parts = []
        for i, fmap in enumerate(maps):
            if per_layer is not None:
                sel = per_layer[i]
                if sel.numel() == 0:
                    continue
                fmap = fmap.index_select(1, sel)
            # mixed-precision backbones give bf16/fp16 maps: float32 and channels-last in one pass
            fmap = fmap.to(dtype=torch.float32, memory_format=torch.channels_last)
            if self.local_pool > 1:
                fmap = F.avg_pool2d(fmap, self.local_pool, stride=1, padding=self.local_pool // 2)
            parts.append(fmap)
        b = parts[0].shape[0]
        emb = torch.empty(b, *size, sum(p.shape[1] for p in parts), dtype=torch.float32,
                          device=parts[0].device)  # [B, h, w, D]
        start = 0
        for fmap in parts:
            stop = start + fmap.shape[1]
            _resize_into(fmap, emb[..., start:stop], self.upsample)
            start = stop
        if projection is not None:
            emb = emb @ projection
        if self.pool_dim is not None:
            flat = emb.reshape(-1, 1, emb.shape[-1])
            emb = F.adaptive_avg_pool1d(flat, self.pool_dim).reshape(*emb.shape[:3], -1)
        return emb.permute(0, 3, 1, 2)

    def state_tensors(self) -> Dict[str, torch.Tensor]:
        """Tensors that define this embedder (saved with the model)."""
        out: Dict[str, torch.Tensor] = {}
        if self.channel_idx is not None:
            out["embed.channel_idx"] = self.channel_idx.cpu()
        if self.projection is not None:
            out["embed.projection"] = self.projection.cpu()
        return out


def _resize_into(src: torch.Tensor, dst: torch.Tensor, mode: str) -> None:
    """Write ``src`` ``[B, C, h, w]`` resized to ``dst``'s grid into ``dst`` ``[B, H, W, C]``."""
    (h, w), (big_h, big_w) = src.shape[-2:], dst.shape[1:3]
    bsz, c = src.shape[:2]
    rows = src.permute(0, 2, 3, 1)  # [B, h, w, C]
    if (h, w) == (big_h, big_w):
        dst.copy_(rows)
    elif mode == "nearest" and big_h % h == 0 and big_w % w == 0:
        sh, sw = big_h // h, big_w // w
        dst.view(bsz, h, sh, w, sw, c).copy_(rows[:, :, None, :, None, :].expand(
            bsz, h, sh, w, sw, c))
    else:
        kwargs = {"align_corners": False} if mode == "bilinear" else {}
        up = F.interpolate(src, size=(big_h, big_w), mode=mode, **kwargs)
        dst.copy_(up.permute(0, 2, 3, 1))


def random_channel_subset(total: int, n: int, seed: int) -> torch.Tensor:
    """Sorted random subset of ``n`` of ``total`` channel indices, ``[n]`` int64 (seeded)."""
    if not 1 <= n <= total:
        raise ValueError(f"cannot pick {n} channels out of {total}: choose 1..{total}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(total, generator=gen)[:n].sort().values
