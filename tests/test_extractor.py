"""The hook extractor against torchvision's own feature extractor, and its hook hygiene."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

from anomaly_hooks.extractor import HookFeatureExtractor, layer_names, resolve_layers


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def test_wrn50_shapes_at_224(wrn50):
    with HookFeatureExtractor(wrn50, ["layer1", "layer2", "layer3"]) as ext:
        feats = ext(torch.rand(2, 3, 224, 224))
        assert [tuple(f.shape) for f in feats.values()] == [
            (2, 256, 56, 56), (2, 512, 28, 28), (2, 1024, 14, 14)]
        assert [(i.channels, i.stride) for i in ext.info] == [(256, 4), (512, 8), (1024, 16)]


@pytest.mark.parametrize("model_name", ["resnet18", "wrn50"])
def test_equals_create_feature_extractor(model_name, request):
    model = request.getfixturevalue(model_name)
    layers = ["layer1", "layer2", "layer3", "layer3.1"]
    x = torch.rand(2, 3, 128, 160)
    reference = create_feature_extractor(model, return_nodes={n: n for n in layers}).eval()
    with torch.no_grad():
        expected = reference(x)
    with HookFeatureExtractor(model, layers, probe_size=(128, 160)) as ext:
        got = ext(x)
    for name in layers:
        assert torch.equal(got[name], expected[name]), name


def test_close_and_with_remove_every_hook(resnet18):
    before = _hook_count(resnet18)
    ext = HookFeatureExtractor(resnet18, ["layer1", "layer2"])
    assert _hook_count(resnet18) == before + 2
    ext.close()
    assert _hook_count(resnet18) == before
    with HookFeatureExtractor(resnet18, ["layer3"]):
        assert _hook_count(resnet18) == before + 1
    assert _hook_count(resnet18) == before
    with pytest.raises(RuntimeError, match="closed"):
        ext(torch.rand(1, 3, 64, 64))


def test_forward_stops_after_last_layer_in_execution_order(resnet18):
    fired = []
    handle = resnet18.layer4.register_forward_hook(lambda *a: fired.append("layer4"))
    fc_handle = resnet18.fc.register_forward_hook(lambda *a: fired.append("fc"))
    try:
        # listed out of execution order: layer3 runs last, so nothing after it may run
        with HookFeatureExtractor(resnet18, ["layer3", "layer1"]) as ext:
            fired.clear()
            feats = ext(torch.rand(1, 3, 64, 64))
            assert list(feats) == ["layer3", "layer1"]
            assert ext.order == ["layer1", "layer3"]
        assert fired == []
    finally:
        handle.remove()
        fc_handle.remove()
    resnet18(torch.rand(1, 3, 64, 64))  # the backbone still works normally afterwards


def test_unknown_layer_lists_valid_names(resnet18):
    before = _hook_count(resnet18)
    with pytest.raises(ValueError, match=r"unknown layer name.*layer5.*Valid names.*layer1"):
        HookFeatureExtractor(resnet18, ["layer1", "layer5"])
    with pytest.raises(ValueError, match="duplicate"):
        resolve_layers(resnet18, ["layer1", "layer1"])
    assert "layer3.1.conv2" in layer_names(resnet18)
    assert _hook_count(resnet18) == before


def test_custom_module_and_tuple_outputs():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
            self.blocks = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1),
                                        nn.Conv2d(16, 32, 3, stride=2, padding=1))
            self.head = nn.Linear(32, 2)

        def forward(self, x):
            x = self.blocks(self.stem(x))
            return self.head(x.mean((2, 3)))

    model = Tiny().eval()
    with HookFeatureExtractor(model, ["blocks.1", "blocks.0"], probe_size=(64, 64)) as ext:
        assert [(i.name, i.channels, i.stride) for i in ext.info] == [
            ("blocks.1", 32, 8), ("blocks.0", 16, 4)]
        out = ext(torch.rand(1, 3, 64, 64))
        ref = model.blocks[0](model.stem(torch.rand(1, 3, 64, 64)))
        assert out["blocks.0"].shape == ref.shape


def test_efficientnet_lite_blocks():
    pytest.importorskip("efficientnet_lite_pytorch")
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name("efficientnet-lite0").eval()
    with HookFeatureExtractor(model, ["_blocks.2", "_blocks.4", "_blocks.10"]) as ext:
        assert [i.stride for i in ext.info] == [4, 8, 16]
        feats = ext(torch.rand(1, 3, 224, 224))
        assert feats["_blocks.4"].shape[-1] == 28


def test_threads_get_their_own_outputs(resnet18):
    xs = [torch.rand(1, 3, 64, 64) for _ in range(6)]
    with HookFeatureExtractor(resnet18, ["layer2"]) as ext:
        serial = [ext(x)["layer2"] for x in xs]
        results = [None] * len(xs)

        def work(i):
            for _ in range(3):
                results[i] = ext(xs[i])["layer2"]

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for a, b in zip(serial, results):
        assert torch.equal(a, b)


def _fresh_resnet18() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).eval()


def test_channels_last_and_bfloat16_autocast_close_to_float32():
    x = torch.rand(2, 3, 96, 96)
    with HookFeatureExtractor(_fresh_resnet18(), ["layer2", "layer3"], probe_size=(96, 96)) as ext:
        ref = ext(x)
    with HookFeatureExtractor(_fresh_resnet18(), ["layer2", "layer3"], probe_size=(96, 96),
                              channels_last=True) as ext:
        cl = ext(x)
    with HookFeatureExtractor(_fresh_resnet18(), ["layer2", "layer3"], probe_size=(96, 96),
                              precision="bfloat16") as ext:
        bf = ext(x)
    for name in ref:
        torch.testing.assert_close(cl[name], ref[name], rtol=1e-4, atol=1e-4)
        assert bf[name].dtype == torch.bfloat16
        rel = (bf[name].float() - ref[name]).norm() / ref[name].norm()
        assert rel < 0.05, (name, float(rel))
    with pytest.raises(ValueError, match="precision"):
        HookFeatureExtractor(_fresh_resnet18(), ["layer2"], precision="int8")
