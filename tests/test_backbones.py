"""Backbones: building them (random init warned once), loading weights (another architecture's
refused, naming the mismatch), and the kept seeded random backbones the suite shares."""
from __future__ import annotations

import warnings

import pytest
import torch
import torchvision

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
