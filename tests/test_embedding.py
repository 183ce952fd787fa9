"""Patch embeddings (channels-last output) against a plain NCHW reference built from
torch.nn.functional: select channels, pool, interpolate, concatenate."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import f32_tol

from anomaly_hooks.embedding import PatchEmbedder
from anomaly_hooks.extractor import LayerInfo


def _reference(feats, layers, mode, pool=1, idx=None):
    maps = [feats[info.name].float() for info in layers]
    size = max((m.shape[-2:] for m in maps), key=lambda s: s[0] * s[1])
    if idx is not None:
        full = torch.cat([F.interpolate(m, size=tuple(size), mode="nearest") for m in maps], 1)
        return full[:, idx]
    out = []
    for m in maps:
        if pool > 1:
            m = F.avg_pool2d(m, pool, stride=1, padding=pool // 2)
        kw = {"align_corners": False} if mode == "bilinear" else {}
        out.append(F.interpolate(m, size=tuple(size), mode=mode, **kw))
    return torch.cat(out, 1)


def _feats(shapes, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=gen).to(dtype) for name, shape in shapes.items()}


@pytest.mark.parametrize("grids", [((16, 16), (8, 8), (4, 4)), ((12, 20), (6, 10), (3, 5))])
def test_padim_embedding_equals_reference_and_is_channels_last(grids):
    layers = [LayerInfo("l1", 8, 4), LayerInfo("l2", 12, 8), LayerInfo("l3", 16, 16)]
    feats = _feats({"l1": (2, 8, *grids[0]), "l2": (2, 12, *grids[1]), "l3": (2, 16, *grids[2])})
    idx = torch.tensor([0, 3, 7, 8, 9, 19, 20, 35])
    emb = PatchEmbedder(layers, upsample="nearest", channel_idx=idx)(feats)
    assert emb.shape == (2, 8, *grids[0]) and emb.dtype == torch.float32
    assert emb.permute(0, 2, 3, 1).is_contiguous()  # [B, h, w, D] rows: what scorers read
    assert torch.equal(emb, _reference(feats, layers, "nearest", idx=idx))


@pytest.mark.parametrize("grids", [((14, 14), (7, 7)), ((10, 16), (5, 8)), ((9, 9), (4, 4))])
def test_patchcore_embedding_equals_reference(grids):
    """3x3 averaging then bilinear upsampling (2x, non-square, and a non-integer ratio)."""
    layers = [LayerInfo("l2", 24, 8), LayerInfo("l3", 40, 16)]
    feats = _feats({"l2": (3, 24, *grids[0]), "l3": (3, 40, *grids[1])}, seed=1)
    emb = PatchEmbedder(layers, upsample="bilinear", local_pool=3)(feats)
    assert emb.permute(0, 2, 3, 1).is_contiguous()
    ref = _reference(feats, layers, "bilinear", pool=3)
    # float32 in both, perhaps in another order: a 3x3 mean (9 adds, 1 divide) then a bilinear
    # blend (2 multiplies, 1 add per axis): 16 roundings of values up to max |ref|
    torch.testing.assert_close(emb, ref, rtol=0, atol=f32_tol(16, float(ref.abs().max())))


def test_nearest_with_a_non_integer_ratio_uses_interpolate():
    layers = [LayerInfo("a", 4, 4), LayerInfo("b", 6, 8)]
    feats = _feats({"a": (2, 4, 9, 11), "b": (2, 6, 4, 5)}, seed=2)
    emb = PatchEmbedder(layers, upsample="nearest")(feats)
    assert torch.equal(emb, _reference(feats, layers, "nearest"))


def test_projection_and_channel_pooling_equal_references():
    layers = [LayerInfo("l2", 24, 8), LayerInfo("l3", 40, 16)]
    feats = _feats({"l2": (2, 24, 8, 8), "l3": (2, 40, 4, 4)}, seed=3)
    full = _reference(feats, layers, "bilinear", pool=3)
    proj = torch.randn(64, 10, generator=torch.Generator().manual_seed(4))
    got = PatchEmbedder(layers, upsample="bilinear", local_pool=3, projection=proj)(feats)
    # the embedding's 16 roundings (above), then a 64-term dot product with the projection:
    # 80 roundings of at most max |full| * sum_c |proj[c, d]|
    scale = float(full.abs().max() * proj.abs().sum(0).max())
    torch.testing.assert_close(got, torch.einsum("bchw,cd->bdhw", full, proj), rtol=0,
                               atol=f32_tol(16 + 64, scale))
    got = PatchEmbedder(layers, upsample="bilinear", local_pool=3, pool_dim=16)(feats)
    flat = full.permute(0, 2, 3, 1).reshape(-1, 1, 64)
    ref = F.adaptive_avg_pool1d(flat, 16).reshape(2, 8, 8, 16).permute(0, 3, 1, 2)
    # the embedding's 16 roundings, then a mean of 4 channels (3 adds, 1 divide)
    torch.testing.assert_close(got, ref, rtol=0, atol=f32_tol(16 + 4, float(full.abs().max())))


def test_mixed_precision_maps_give_float32_embeddings():
    layers = [LayerInfo("a", 4, 4), LayerInfo("b", 6, 8)]
    feats = _feats({"a": (2, 4, 8, 8), "b": (2, 6, 4, 4)}, seed=5, dtype=torch.bfloat16)
    emb = PatchEmbedder(layers, upsample="bilinear", local_pool=3)(feats)
    assert emb.dtype == torch.float32
    ref = _reference(feats, layers, "bilinear", pool=3)  # widened to float32 first, exactly
    # the 16 float32 roundings of the 3x3 mean and the bilinear blend (see above)
    torch.testing.assert_close(emb, ref, rtol=0, atol=f32_tol(16, float(ref.abs().max())))


def test_indices_and_projection_go_to_the_device_once(device, monkeypatch):
    """The channel indices and the projection matrix are copied to the features' device on the
    first call and reused (they were copied on every call: a host-to-device copy per batch)."""
    layers = [LayerInfo("l2", 24, 8), LayerInfo("l3", 40, 16)]
    feats = {k: v.to(device) for k, v in
             _feats({"l2": (2, 24, 8, 8), "l3": (2, 40, 4, 4)}, seed=6).items()}
    proj = torch.randn(64, 10, generator=torch.Generator().manual_seed(7))
    embedders = [PatchEmbedder(layers, channel_idx=torch.tensor([1, 5, 30, 50])),
                 PatchEmbedder(layers, upsample="bilinear", projection=proj)]
    for embedder in embedders:
        owned = [*(embedder._per_layer or []), *([proj] if embedder.projection is not None
                                                 else [])]
        moved = []
        real = torch.Tensor.to

        def spy(self, *args, _owned=owned, _moved=moved, _real=real, **kwargs):
            if any(self is t for t in _owned):
                _moved.append(self)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", spy)
        first = embedder(feats)
        assert len(moved) == len(owned)
        second = embedder(feats)
        assert len(moved) == len(owned)  # none again
        monkeypatch.undo()
        assert torch.equal(first, second) and first.device.type == device.type
