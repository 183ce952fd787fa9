"""Kept network inputs (anomaly_hooks.keptinputs): the file round trip, what makes one
unusable (another preprocessing or library version, damage), and the loader taking it instead
of decoding the original -- or decoding the original where it cannot."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from conftest import SAMPLE
from safetensors import safe_open
from safetensors.torch import save

from anomaly_hooks.data import load_preprocessed
from anomaly_hooks.errors import ImageTooLargeError
from anomaly_hooks.images import DEFAULT_MAX_PIXELS
from anomaly_hooks.keptinputs import KeptImage, encode, load, mismatch, producer
from anomaly_hooks.preprocess import Preprocessor

PRE = Preprocessor((72, 72), (64, 64), (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
OTHER = Preprocessor((80, 80), (64, 64), (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def _original() -> Path:
    return sorted((SAMPLE / "train" / "good").glob("*.png"))[0]


def _kept(tmp_path: Path, pre: Preprocessor = PRE) -> KeptImage:
    """The original and the input file the service writes of it (its own loader's tensor)."""
    original = _original()
    x, size = load_preprocessed(original, pre, DEFAULT_MAX_PIXELS)
    path = tmp_path / "req_input.safetensors"
    path.write_bytes(encode(x, pre, size))
    return KeptImage(original, path)


def test_round_trip_gives_the_loaders_tensor(tmp_path):
    """The kept input is the tensor decoding the original gives, bit for bit, with its size;
    a KeptImage names, opens and prints as its original."""
    item = _kept(tmp_path)
    want, size = load_preprocessed(item.original, PRE, DEFAULT_MAX_PIXELS)
    x, got_size = load(item, PRE)
    assert torch.equal(x, want) and got_size == size
    assert os.fspath(item) == str(item) == str(item.original)
    assert Path(item).name == item.original.name
    assert mismatch(item.input, PRE) is None


def test_loader_reads_the_kept_input_not_the_original(tmp_path):
    """With a usable input the original is not decoded at all (a path that no longer exists
    would fail); the same tensor comes back."""
    item = _kept(tmp_path)
    want, _ = load_preprocessed(item.original, PRE, DEFAULT_MAX_PIXELS)
    gone = KeptImage(tmp_path / "gone.png", item.input)
    x, _ = load_preprocessed(gone, PRE, DEFAULT_MAX_PIXELS)
    assert torch.equal(x, want)


def test_another_preprocessing_or_version_decodes_the_original(tmp_path, monkeypatch):
    item = _kept(tmp_path)
    assert mismatch(item.input, OTHER) == "made by another preprocessing"
    assert load(item, OTHER) is None
    want, _ = load_preprocessed(item.original, OTHER, DEFAULT_MAX_PIXELS)
    assert torch.equal(load_preprocessed(item, OTHER, DEFAULT_MAX_PIXELS)[0], want)
    made = producer()
    monkeypatch.setattr(torch, "__version__", "0.0.0-another")
    assert mismatch(item.input, PRE) == f"made by {made}, not torch 0.0.0-another"
    assert load(item, PRE) is None


def _meta(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as fh:
        return fh.metadata()


def test_damaged_or_foreign_files_decode_the_original_with_a_warning(tmp_path, caplog):
    item = _kept(tmp_path)
    meta = _meta(item.input)
    want, _ = load_preprocessed(item.original, PRE, DEFAULT_MAX_PIXELS)
    data = bytearray(item.input.read_bytes())
    data[-5] ^= 0x40  # one bit of the tensor's last float
    item.input.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="anomaly_hooks.keptinputs"):
        assert load(item, PRE) is None
        assert torch.equal(load_preprocessed(item, PRE, DEFAULT_MAX_PIXELS)[0], want)
    assert "damaged" in caplog.text
    caplog.clear()
    # a whole file of this kind, its checksum right, its tensor not the preprocessing's shape
    x = torch.zeros(3, 32, 64)
    item.input.write_bytes(save({"input": x}, metadata={
        **meta, "sha256": hashlib.sha256(x.numpy().tobytes()).hexdigest()}))
    with caplog.at_level(logging.WARNING, logger="anomaly_hooks.keptinputs"):
        assert mismatch(item.input, PRE) is None and load(item, PRE) is None
    assert "damaged" in caplog.text
    caplog.clear()
    item.input.write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.WARNING, logger="anomaly_hooks.keptinputs"):
        assert load(item, PRE) is None
    assert "unreadable" in caplog.text
    item.input.write_bytes(save({"input": torch.zeros(3, 64, 64)}, metadata={"format": "x"}))
    assert mismatch(item.input, PRE) == "not a network-input file of this version"
    assert mismatch(tmp_path / "none.safetensors", PRE).startswith("unreadable")


def test_over_max_pixels_is_refused_as_the_original_would_be(tmp_path):
    item = _kept(tmp_path)
    with safe_open(str(item.input), framework="pt") as fh:
        h, w = json.loads(fh.metadata()["size"])
    with pytest.raises(ImageTooLargeError):
        load_preprocessed(item, PRE, h * w - 1)
