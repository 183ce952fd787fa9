"""The hook extractor against torchvision's own feature extractor, and its hook hygiene."""
from __future__ import annotations

import math
import threading

import pytest
import torch
import torchvision
from conftest import backbone_rtol
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

from anomaly_hooks.extractor import (
    HookFeatureExtractor,
    describe_layers,
    layer_names,
    resolve_layers,
)


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


@pytest.mark.slow
def test_wrn50_shapes_at_224(wrn50):
    with HookFeatureExtractor(wrn50, ["layer1", "layer2", "layer3"]) as ext:
        feats = ext(torch.rand(2, 3, 224, 224))
        assert [tuple(f.shape) for f in feats.values()] == [
            (2, 256, 56, 56), (2, 512, 28, 28), (2, 1024, 14, 14)]
        assert [(i.channels, i.stride) for i in ext.info] == [(256, 4), (512, 8), (1024, 16)]


@pytest.mark.parametrize("model_name", ["resnet18", pytest.param("wrn50", marks=pytest.mark.slow)])
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


class _TupleBlock(nn.Module):
    """A block that returns ``(features, auxiliary)``, as some detection backbones do."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=2, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y, y.mean((2, 3))


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.blocks = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1),
                                    nn.Conv2d(16, 32, 3, stride=2, padding=1))
        self.pair = _TupleBlock(32, 24)
        self.head = nn.Linear(24, 2)

    def forward(self, x):
        feats, _aux = self.pair(self.blocks(self.stem(x)))
        return self.head(feats.mean((2, 3)))


def test_custom_module_and_tuple_outputs():
    torch.manual_seed(0)
    model = _Tiny().eval()
    x = torch.rand(1, 3, 64, 64)
    with HookFeatureExtractor(model, ["blocks.1", "blocks.0", "pair"], probe_size=(64, 64)) as ext:
        assert [(i.name, i.channels, i.stride) for i in ext.info] == [
            ("blocks.1", 32, 8), ("blocks.0", 16, 4), ("pair", 24, 16)]
        out = ext(x)
    with torch.no_grad():
        b0 = model.blocks[0](model.stem(x))
        pair, _ = model.pair(model.blocks[1](b0))
    assert torch.equal(out["blocks.0"], b0)
    assert torch.equal(out["pair"], pair)  # a tuple output gives its first tensor


def test_describe_layers_lists_shapes_strides_and_defaults(resnet18):
    hooks = _hook_count(resnet18)  # a shared fixture: other tests' extractors may hold some
    rows = describe_layers(resnet18, (96, 128), defaults={"padim": ["layer1", "layer2", "layer3"],
                                                          "patchcore": ["layer2", "layer3"]})
    by_name = {r.name: r for r in rows}
    assert [r.name for r in rows][:2] == ["conv1", "bn1"]  # execution order
    assert by_name["layer2"].shape == (1, 128, 12, 16)
    assert (by_name["layer2"].channels, by_name["layer2"].stride) == (128, 8)
    assert by_name["layer3"].default_for == ("padim", "patchcore")
    assert by_name["layer1"].default_for == ("padim",)
    assert by_name["layer1.0.relu"].calls == 2  # reused inside the basic block
    assert by_name["fc"].shape == (1, 1000) and not by_name["fc"].tappable
    assert _hook_count(resnet18) == hooks  # all of its own removed
    # what describe_layers reports is what the extractor gives
    with HookFeatureExtractor(resnet18, ["layer3", "layer1"], probe_size=(96, 128)) as ext:
        assert [(i.channels, i.stride) for i in ext.info] == [
            (by_name["layer3"].channels, by_name["layer3"].stride),
            (by_name["layer1"].channels, by_name["layer1"].stride)]
    tuple_rows = {r.name: r for r in describe_layers(_Tiny().eval(), 64)}
    assert tuple_rows["pair"].shape == (1, 24, 4, 4) and tuple_rows["pair"].stride == 16


def test_layers_cli_lists_layers_and_refuses_unknown_backbones(capsys):
    from anomaly_hooks.cli import main

    assert main(["layers", "resnet18", "--input", "128"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("layer2 "))
    assert "[1, 128, 16, 16]" in line and " 8 " in line and "padim, patchcore" in line
    assert "fc" not in out.split()  # not a [B, C, H, W] map
    assert main(["layers", "resnet_9000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "resnet18" in err and "efficientnet_lite0" in err


def test_layers_cli_keeps_its_columns_for_long_type_names(capsys):
    """EfficientNet-Lite's ``Conv2dStaticSamePadding`` is longer than the type column's
    minimum: every row's shape still starts under the header's."""
    pytest.importorskip("efficientnet_lite_pytorch")
    from anomaly_hooks.cli import main

    assert main(["layers", "efficientnet_lite0", "--input", "64"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()[:-1]
    column = header.index("output shape")
    assert any("Conv2dStaticSamePadding" in row for row in rows)
    assert all(row[column] == "[" for row in rows)


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

    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).eval()


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_channels_last_and_autocast_close_to_float32(precision, device):
    if precision == "float16" and device.type == "cpu":
        pytest.skip("float16 autocast is a GPU feature (bfloat16 is the CPU's)")
    x = torch.rand(2, 3, 96, 96)
    layers = ["layer2", "layer3"]
    with HookFeatureExtractor(_fresh_resnet18(), layers, device, probe_size=(96, 96)) as ext:
        ref = {k: v.float().cpu() for k, v in ext(x).items()}
    with HookFeatureExtractor(_fresh_resnet18(), layers, device, probe_size=(96, 96),
                              channels_last=True) as ext:
        cl = {k: v.float().cpu() for k, v in ext(x).items()}
    with HookFeatureExtractor(_fresh_resnet18(), layers, device, probe_size=(96, 96),
                              precision=precision) as ext:
        half = ext(x)
    # half precision: each of the (at most 13) convolutions' outputs rounded to 8 (bfloat16)
    # or 11 (float16) significant bits, a relative error of up to 2**-8 or 2**-11 a value;
    # errors of random sign add in quadrature over the layers: a relative norm error of about
    # sqrt(13) 2**-8 = 1.4 % for bfloat16 -- allowed 3.5 times that
    half_noise = math.sqrt(13) * 2.0 ** -8
    for name in ref:
        # channels-last: other float32 kernels (conftest.backbone_rtol), relative to the
        # largest feature
        atol = backbone_rtol() * float(ref[name].abs().max())
        torch.testing.assert_close(cl[name], ref[name], rtol=0, atol=atol)
        assert half[name].dtype == getattr(torch, precision)
        assert half[name].device.type == device.type  # cuda:0 for cuda
        rel = (half[name].float().cpu() - ref[name]).norm() / ref[name].norm()
        assert rel < 3.5 * half_noise, (name, float(rel))
    with pytest.raises(ValueError, match="precision"):
        HookFeatureExtractor(_fresh_resnet18(), ["layer2"], precision="int8")
    with pytest.raises(ValueError, match="precision"):
        HookFeatureExtractor(_fresh_resnet18(), ["layer2"], precision="int8")


def test_close_during_a_forward_pass_gives_the_closed_error(resnet18):
    ext = HookFeatureExtractor(resnet18, ["layer1", "layer2"], probe_size=(64, 64))
    handle = resnet18.layer1.register_forward_hook(lambda *a: ext.close())
    try:
        with pytest.raises(RuntimeError, match=r"^the extractor is closed; create a new one$"):
            ext(torch.rand(1, 3, 64, 64))
    finally:
        handle.remove()
