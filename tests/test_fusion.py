"""The backbone's rewrites (anomaly_hooks.fusion): BatchNorms folded into convolutions, zero
padding into convolutions, activations in place. The same features as the model as given, and
every rewrite that would change something left undone."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import backbone_rtol
from torch import nn

from anomaly_hooks import Detector
from anomaly_hooks.backbones import fingerprint
from anomaly_hooks.extractor import HookFeatureExtractor
from anomaly_hooks.fusion import (
    conv_bn_pairs,
    fold_batchnorm,
    fold_padding,
    inplace_activations,
    widened_kernel,
)

LAYERS = ["layer1", "layer2", "layer3"]
PROBE = (64, 80)


def trained_like(model: nn.Module, seed: int = 1) -> nn.Module:
    """``model`` with seeded BatchNorm statistics and affine parameters away from their
    initial 0 / 1 (which make a BatchNorm nearly the identity: a fold would test nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                if m.running_mean is not None:
                    m.running_mean.copy_(torch.randn(c, generator=g) * 0.3)
                    m.running_var.copy_(torch.rand(c, generator=g) * 2 + 0.2)
                m.weight.copy_(torch.rand(c, generator=g) + 0.5)
                m.bias.copy_(torch.randn(c, generator=g) * 0.2)
    return model.eval()


@pytest.fixture
def resnet(resnet18) -> nn.Module:
    return trained_like(copy.deepcopy(resnet18))


def n_batchnorms(model: nn.Module) -> int:
    return sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def features(model: nn.Module, layers, device, fold: bool, x: torch.Tensor):
    with HookFeatureExtractor(model, layers, device, probe_size=PROBE, copy_module=True,
                              fold_batchnorm=fold) as ext:
        return ext(x), ext


def test_folded_features_equal_the_unfolded(resnet, device):
    x = torch.rand(3, 3, *PROBE)
    plain, _ = features(resnet, LAYERS, device, False, x)
    folded, ext = features(resnet, LAYERS, device, True, x)
    # every BatchNorm folded (the whole forward is probed), every name still there
    assert len(ext.folded) == n_batchnorms(resnet) == 20
    assert n_batchnorms(ext.model) == 0
    assert {n for n, _ in ext.model.named_modules()} == {n for n, _ in resnet.named_modules()}
    assert n_batchnorms(resnet) == 20  # the caller's module (copied) is left as it was
    for name in LAYERS:  # another composition of the same float32 sums: backbone_rtol
        ref = plain[name]
        err = (folded[name] - ref).abs().max().item()
        assert err <= backbone_rtol() * ref.abs().max().item(), name


def test_folded_is_as_close_to_float64_as_the_unfolded(resnet):
    """Against the float64 forward, folding costs no accuracy (a weight rounded once more):
    within twice the unfolded float32 error and one backbone_rtol of rounding noise."""
    x = torch.rand(2, 3, *PROBE)
    ref = copy.deepcopy(resnet).double()(x.double())
    folded = copy.deepcopy(resnet)
    fold_batchnorm(folded, torch.zeros(1, 3, *PROBE))
    with torch.no_grad():
        err_plain = (resnet(x).double() - ref).abs().max().item()
        err_folded = (folded(x).double() - ref).abs().max().item()
    assert err_folded <= 2 * err_plain + backbone_rtol() * ref.abs().max().item()


def test_a_hooked_convolution_keeps_its_own_output(resnet, device):
    layers = ["conv1", "layer1.0.conv1", "layer1.0.bn2", "layer2"]
    x = torch.rand(2, 3, *PROBE)
    plain, _ = features(resnet, layers, device, False, x)
    folded, ext = features(resnet, layers, device, True, x)
    assert "bn1" not in ext.folded and "layer1.0.bn1" not in ext.folded
    assert isinstance(ext.model.bn1, nn.BatchNorm2d)
    assert torch.equal(folded["conv1"], plain["conv1"])  # its weights untouched
    # a hooked BatchNorm became an Identity under its name and gives what it gave
    assert "layer1.0.bn2" in ext.folded
    assert isinstance(ext.model.get_submodule("layer1.0.bn2"), nn.Identity)
    for name in layers:
        ref = plain[name]
        assert (folded[name] - ref).abs().max().item() <= backbone_rtol() * ref.abs().max().item()


class Residual(nn.Module):
    """The convolution's output also goes to the sum: not foldable."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


class InPlace(Residual):
    """An in-place op between them: the BatchNorm sees a changed tensor."""

    def forward(self, x):
        y = self.conv(x)
        y.relu_()
        return self.bn(y)


class Shared(Residual):
    """The convolution runs twice: folding would change its first use too."""

    def forward(self, x):
        return self.bn(self.conv(self.conv(x)))


class Returned(Residual):
    """The convolution's output is also returned (to the caller, who may use it)."""

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y), y


class TwoNorms(Residual):
    """Two BatchNorms read the one output: neither can take the convolution alone."""

    def __init__(self) -> None:
        super().__init__()
        self.bn2 = nn.BatchNorm2d(3)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + self.bn2(y)


class NoStats(Residual):
    """A BatchNorm without running statistics normalises with each batch's own."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(3, track_running_stats=False)

    def forward(self, x):
        return self.bn(self.conv(x))


class Nested(nn.Module):
    """The convolution's output returned by its container, then normalised: foldable (the
    container is an ancestor), unless the container is a hooked layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.bn = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1)), nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn(self.inner(x))


class Hooked(NoStats):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.seen = []
        self.conv.register_forward_hook(lambda m, i, o: self.seen.append(o))


@pytest.mark.parametrize("cls", [Residual, InPlace, Shared, Returned, TwoNorms, NoStats,
                                 Hooked])
def test_pairs_whose_folding_would_change_something_are_left(cls):
    model = trained_like(cls())
    x = torch.rand(2, 3, 8, 8)
    with torch.no_grad():
        before = model(x)
    assert fold_batchnorm(model, torch.zeros(1, 3, 8, 8)) == []
    assert isinstance(model.bn, nn.BatchNorm2d)
    with torch.no_grad():
        after = model(x)
    for a, b in zip(before if isinstance(before, tuple) else [before],
                    after if isinstance(after, tuple) else [after]):
        assert torch.equal(a, b)


def test_a_container_returning_the_convolution_is_folded_unless_hooked():
    model = trained_like(Nested())
    probe = torch.zeros(1, 3, 8, 8)
    assert conv_bn_pairs(model, probe) == [("inner.0", "bn")]
    assert conv_bn_pairs(model, probe, keep=["inner"]) == []
    x = torch.rand(2, 3, 8, 8)
    with torch.no_grad():
        before = model(x)
        assert fold_batchnorm(model, probe) == ["bn"]
        after = model(x)
    assert (after - before).abs().max().item() <= backbone_rtol(1, 27) * before.abs().max().item()


def test_a_forward_that_fails_folds_nothing():
    model = trained_like(NoStats())
    model.bn = nn.BatchNorm2d(3).eval()
    assert fold_batchnorm(model, torch.zeros(1, 5, 8, 8)) == []  # 5 channels: conv refuses
    assert isinstance(model.bn, nn.BatchNorm2d)


def test_folding_leaves_models_in_other_threads_alone(resnet):
    """The data-flow probe is thread-local: another thread running a model meanwhile (a
    service answering while it loads the next version) computes exactly what it would."""
    other = copy.deepcopy(resnet)
    x = torch.rand(1, 3, *PROBE)
    with torch.no_grad():
        expected = other(x)
    errors, done = [], threading.Event()

    def run() -> None:
        try:
            while not done.is_set():
                with torch.no_grad():
                    if not torch.equal(other(x), expected):
                        errors.append("differs")
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    thread = threading.Thread(target=run)
    thread.start()
    try:
        for _ in range(3):
            assert len(fold_batchnorm(copy.deepcopy(resnet), torch.zeros(1, 3, *PROBE))) == 20
    finally:
        done.set()
        thread.join()
    assert errors == []


def test_detector_folds_by_default_and_keeps_the_weights_fingerprint(small_cfg, resnet18):
    folded = Detector.from_config(small_cfg)
    plain = Detector.from_config(small_cfg, backbone__fold_batchnorm=False)
    assert folded.extractor.folded and n_batchnorms(folded.extractor.model) == 0
    assert plain.extractor.folded == [] and n_batchnorms(plain.extractor.model) == 20
    # the model file's fingerprint is that of the weights as built: files fitted either way
    # load onto either
    assert folded.backbone_fingerprint == plain.backbone_fingerprint
    given = Detector.from_config(small_cfg, backbone=resnet18)
    assert given.backbone_fingerprint == fingerprint(resnet18)
    assert n_batchnorms(resnet18) == 20  # the caller's module is not folded


# -- zero padding folded into the convolution ----------------------------------------------
class SamePadConv(nn.Conv2d):
    """A convolution that pads with a ZeroPad2d child, as EfficientNet-Lite's static "same"
    padding does."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, pad=None,
                 groups: int = 1) -> None:
        super().__init__(cin, cout, k, stride, groups=groups)
        self.static_padding = nn.ZeroPad2d(pad if pad is not None else (k // 2,) * 4)

    def forward(self, x):
        return F.conv2d(self.static_padding(x), self.weight, self.bias, self.stride,
                        self.padding, self.dilation, self.groups)


class IgnoresPadding(SamePadConv):
    """Convolves without its own ``padding``: folding the pad would drop it."""

    def forward(self, x):
        return F.conv2d(self.static_padding(x), self.weight, self.bias, self.stride, 0,
                        self.dilation, self.groups)


class PadNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = SamePadConv(3, 8, 3, stride=2, pad=(0, 1, 0, 1))  # asymmetric, dense
        self.dw = SamePadConv(8, 8, 5, groups=8)
        self.pw = SamePadConv(8, 8, 3)
        self.odd = IgnoresPadding(8, 8, 3)
        # asymmetric, depthwise: "same" padding at stride 2, one each way round
        self.down = SamePadConv(8, 8, 3, stride=2, pad=(0, 1, 0, 1), groups=8)
        self.down5 = SamePadConv(8, 8, 5, stride=2, pad=(2, 1, 1, 2), groups=8)
        self.odd_down = IgnoresPadding(8, 8, 3, stride=2, pad=(0, 1, 0, 1), groups=8)
        self.act = nn.ReLU6()

    def forward(self, x):
        x = self.act(self.stem(x))
        x = self.odd(self.pw(self.act(self.dw(x))))
        return self.odd_down(self.down5(self.down(x)))


SYMMETRIC, ASYMMETRIC = ["dw", "pw"], ["down", "down5"]


@pytest.mark.parametrize("widen", [False, True])
def test_padding_layers_are_folded_and_the_rest_left(device, widen):
    model = PadNet().eval().to(device)
    given = {name: model.get_submodule(name).weight.clone()
             for name in ["stem", *ASYMMETRIC, "odd_down"]}
    x = torch.rand(2, 3, 32, 40, device=device)
    with torch.no_grad():
        before = model(x)
        folded = fold_padding(model, torch.zeros(1, 3, 32, 40, device=device), widen=widen)
        after = model(x)
    assert folded == SYMMETRIC + (ASYMMETRIC if widen else [])
    for name in SYMMETRIC:
        conv = model.get_submodule(name)
        k = conv.kernel_size[0] // 2
        assert isinstance(conv.static_padding, nn.Identity) and conv.padding == (k, k)
    if widen:  # the larger side's padding, the kernel one zero tap wider on the other side
        assert model.down.padding == (1, 1) and model.down.kernel_size == (4, 4)
        assert torch.equal(model.down.weight[:, :, 1:, 1:], given["down"])
        assert model.down5.padding == (2, 2) and model.down5.kernel_size == (6, 6)
        assert torch.equal(model.down5.weight[:, :, 1:, :5], given["down5"])
        assert not model.down5.weight[:, :, 0].any() and not model.down5.weight[..., 5].any()
    for name in ["stem", "odd", "odd_down", *([] if widen else ASYMMETRIC)]:
        conv = model.get_submodule(name)  # dense (stem), checked and undone (odd*), not asked
        assert isinstance(conv.static_padding, nn.ZeroPad2d) and conv.padding == (0, 0)
    for name in ["stem", "odd_down"]:  # an undone widening leaves the kernel as it was
        conv = model.get_submodule(name)
        assert conv.weight is not None and torch.equal(conv.weight, given[name])
        assert conv.kernel_size == tuple(given[name].shape[2:])
    # the same sums, maybe by another kernel: float32 rounding of 7 layers of <= 72 terms
    assert after.shape == before.shape
    err = (after - before).abs().max().item()
    assert err <= backbone_rtol(7, 72) * before.abs().max().item()


def test_asymmetric_padding_is_widened_on_the_cpu_by_default(device):
    model = PadNet().eval().to(device)
    folded = fold_padding(model, torch.zeros(1, 3, 32, 40, device=device))
    assert folded == SYMMETRIC + (ASYMMETRIC if device.type == "cpu" else [])


@pytest.mark.parametrize("stride", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_widened_kernel_meets_the_samples_of_the_asymmetric_padding(k, stride):
    """Against the padded input itself, every padding of up to 3 a side: small integers in
    float64, so that every sum is exact whatever its order and the outputs are equal."""
    g = torch.Generator().manual_seed(k * 10 + stride)
    x = torch.randint(-4, 5, (2, 3, 11, 14), generator=g).double()
    w = torch.randint(-4, 5, (3, 1, k, k), generator=g).double()
    for pad in [(0, 1, 0, 1), (1, 2, 1, 2), (2, 1, 0, 3), (3, 0, 2, 2), (0, 0, 1, 0)]:
        ref = F.conv2d(F.pad(x, pad), w, stride=stride, groups=3)
        left, right, top, bottom = pad
        got = F.conv2d(x, widened_kernel(w, pad), stride=stride, groups=3,
                       padding=(max(top, bottom), max(left, right)))
        assert torch.equal(got, ref), pad


def test_padding_is_left_where_kept_hooked_or_negative():
    model = PadNet().eval()
    model.pw.register_forward_hook(lambda *a: None)
    model.down.register_forward_hook(lambda *a: None)
    model.down5.static_padding = nn.ZeroPad2d((-1, 0, 0, 0))  # a crop, not a padding
    assert fold_padding(model, torch.zeros(1, 3, 32, 40), keep=["dw.static_padding"]) == []


# -- activations in place ------------------------------------------------------------------
class ActNet(nn.Module):
    """Convolutions each followed by a ReLU6; one activation module used twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.act = nn.ReLU6()  # after bn1 and after conv2
        self.silu = nn.SiLU()

    def forward(self, x):
        x = self.act(self.bn1(self.conv1(x)))
        return self.silu(self.act(self.conv2(x)) - 3)


def test_activations_run_in_place_with_the_same_values(device):
    model = trained_like(ActNet()).to(device)
    x = torch.rand(2, 3, 8, 8, device=device)
    with torch.no_grad():
        before = model(x)
        assert inplace_activations(model, torch.zeros(1, 3, 8, 8, device=device)) == ["act",
                                                                                      "silu"]
        after = model(x)
    assert model.act.inplace and model.silu.inplace
    assert torch.equal(after, before)  # the same kernels: to the bit
    assert torch.equal(x, x.clone()) and x.min() >= 0  # the caller's input untouched


class OnInput(nn.Module):
    """The activation takes the model's input: the caller's tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU6()

    def forward(self, x):
        return self.act(x)


class ReadTwice(Residual):
    """The activation's input also goes to a residual sum."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU6()

    def forward(self, x):
        y = self.conv(x)
        return self.act(y) + y


class OnView(ReadTwice):
    """The activation takes a view: overwriting it changes the tensor it views."""

    def forward(self, x):
        y = self.conv(x)
        return self.act(y[:, :2]), y


class ReturnsInput(ReadTwice):
    """The activation's input is returned by the model too."""

    def forward(self, x):
        y = self.conv(x)
        return self.act(y), y


class OneUnsafeCall(ReadTwice):
    """One activation module, one of whose two inputs is read again."""

    def forward(self, x):
        y = self.conv(x)
        z = self.conv(self.act(y))
        return self.act(z) + z


class Watched(ReadTwice):
    """Someone's hook keeps the convolution's output."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []
        self.conv.register_forward_hook(lambda m, i, o: self.seen.append(o))

    def forward(self, x):
        return self.act(self.conv(x))


@pytest.mark.parametrize("cls", [OnInput, ReadTwice, OnView, ReturnsInput, OneUnsafeCall,
                                 Watched])
def test_activations_whose_input_is_needed_stay_out_of_place(cls):
    model = cls().eval()
    x = torch.rand(2, 3, 8, 8) * 10
    with torch.no_grad():
        before = model(x)
    x_copy = x.clone()
    assert inplace_activations(model, torch.zeros(1, 3, 8, 8)) == []
    assert not model.act.inplace
    with torch.no_grad():
        after = model(x)
    assert torch.equal(x, x_copy)
    for a, b in zip(before if isinstance(before, tuple) else [before],
                    after if isinstance(after, tuple) else [after]):
        assert torch.equal(a, b)


def test_a_kept_layer_output_is_not_overwritten():
    model = trained_like(ActNet())
    probe = torch.zeros(1, 3, 8, 8)
    assert inplace_activations(copy.deepcopy(model), probe, keep=["bn1"]) == ["silu"]
    x = torch.rand(2, 3, 8, 8)
    with HookFeatureExtractor(model, ["bn1", "conv2"], probe_size=(8, 8), copy_module=True,
                              inplace_activations=True) as ext:
        got = ext(x)
    with torch.no_grad():
        y = model.bn1(model.conv1(x))
        assert torch.equal(got["bn1"], y)  # the hooked output, not its ReLU6
        assert torch.equal(got["conv2"], model.conv2(model.act(y)))


def test_efficientnet_lite0_gives_the_same_features_rewritten(device):
    """The packaged backbone the [effnet] configs use: every padding of a depthwise
    convolution folded (on the CPU; the symmetric ones elsewhere), every ReLU6 in place, the
    hooked blocks' features within float32 rounding of the model as given."""
    pytest.importorskip("efficientnet_lite_pytorch")
    from anomaly_hooks.backbones import build_backbone

    model = build_backbone("efficientnet_lite0", None, 0).eval()
    layers = ["_blocks.2", "_blocks.4", "_blocks.10"]
    x = torch.rand(2, 3, 96, 96)
    outs = {}
    for rewrite in (False, True):
        with HookFeatureExtractor(model, layers, device, probe_size=(96, 96), copy_module=True,
                                  fold_padding=rewrite, inplace_activations=rewrite) as ext:
            outs[rewrite] = ext(x)
            if rewrite:
                assert len(ext.folded_padding) == (16 if device.type == "cpu" else 12)
                assert len(ext.in_place) == 17
    for name in layers:
        ref = outs[False][name]
        err = (outs[True][name] - ref).abs().max().item()
        assert err <= backbone_rtol(30, 1152) * ref.abs().max().item(), name
