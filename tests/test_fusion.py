"""BatchNorm folding (anomaly_hooks.fusion): the same features as the unfolded backbone, and
every pair whose folding would change something left alone."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from conftest import backbone_rtol
from torch import nn

from anomaly_hooks import Detector
from anomaly_hooks.backbones import fingerprint
from anomaly_hooks.extractor import HookFeatureExtractor
from anomaly_hooks.fusion import conv_bn_pairs, fold_batchnorm

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
