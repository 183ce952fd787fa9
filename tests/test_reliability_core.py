"""Reliability: model-file safety, atomic saves under SIGKILL, determinism, resource guard,
config errors, and fuzzing of the image and model loaders."""
from __future__ import annotations

import json
import os
import pickle
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anomaly_hooks import Detector
from anomaly_hooks.cli import main
from anomaly_hooks.config import ConfigError, load_config
from anomaly_hooks.images import ImageReadError, read_image
from anomaly_hooks.modelfile import ModelFileError, load_model
from anomaly_hooks.resources import ResourceError, estimate_fit_memory
from conftest import (ROOT, rewrite_safetensors_header, safetensors_header,
                      textured_images)

FAST = {"backbone__name": "resnet18", "backbone__weights": None, "device": "cpu",
        "preprocess__resize": [64, 64], "preprocess__crop": None, "data__num_workers": 0,
        "padim__n_features": 24, "threshold__holdout_fraction": 0.25}


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    det = Detector.from_config(None, **FAST)
    det.fit(textured_images(8, size=(64, 64)), progress=False)
    return det.save(tmp_path_factory.mktemp("m") / "padim.safetensors")


_header = safetensors_header
_rewrite_header = rewrite_safetensors_header


# -- model files --------------------------------------------------------------------------
def test_flipped_bytes_in_tensor_data_fail_the_checksum(model_file, tmp_path):
    raw = bytearray(model_file.read_bytes())
    raw[-100] ^= 0xFF
    bad = tmp_path / "flipped.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match="checksum"):
        Detector.load(bad)


def test_truncated_and_garbage_files_are_refused(model_file, tmp_path):
    raw = model_file.read_bytes()
    for name, data in (("trunc", raw[: len(raw) // 2]), ("tiny", raw[:5]), ("empty", b""),
                       ("text", b"hello, I am not a model")):
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(data)
        with pytest.raises(ModelFileError):
            Detector.load(bad)


def test_newer_format_version_is_refused(model_file, tmp_path):
    newer = tmp_path / "newer.safetensors"
    _rewrite_header(model_file, newer,
                    lambda h: h["__metadata__"].__setitem__("format_version", "99"))
    with pytest.raises(ModelFileError, match="newer anomaly_hooks"):
        Detector.load(newer)


def test_tampered_metadata_fails_the_checksum(model_file, tmp_path):
    def edit(h):
        meta = json.loads(h["__metadata__"]["meta"])
        meta["threshold"]["value"] = 1e9
        h["__metadata__"]["meta"] = json.dumps(meta)
    bad = tmp_path / "tampered.safetensors"
    _rewrite_header(model_file, bad, edit)
    with pytest.raises(ModelFileError, match="checksum"):
        Detector.load(bad)


def test_wrong_method_is_refused(model_file):
    with pytest.raises(ModelFileError, match="is a padim model, but a patchcore model"):
        Detector.load(model_file, method="patchcore")
    assert Detector.load(model_file, method="padim").is_fitted


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_payload_never_runs(tmp_path):
    marker = tmp_path / "PWNED"
    for name, writer in (("torch", lambda p: torch.save({"x": _Boom(str(marker))}, p)),
                         ("pickle", lambda p: p.write_bytes(pickle.dumps(_Boom(str(marker)))))):
        bad = tmp_path / f"{name}.safetensors"
        writer(bad)
        with pytest.raises(ModelFileError):
            Detector.load(bad)
        assert main(["score", "--model", str(bad), str(tmp_path)]) == 2
    assert not marker.exists()


# -- atomic saves -------------------------------------------------------------------------
SAVER = """
import sys, torch
from anomaly_hooks.modelfile import save_model
big = {"w": torch.arange(4_000_000, dtype=torch.float32)}
print("ready", flush=True)
i = 0
while True:
    i += 1
    save_model(sys.argv[1], {**big, "i": torch.tensor([i])}, {"method": "padim", "i": i})
"""


def test_sigkill_during_save_never_leaves_a_loadable_corrupt_file(tmp_path):
    out = tmp_path / "m.safetensors"
    rng = random.Random(0)
    for trial in range(6):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(out)], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if out.exists():  # what is at the path is a complete, verified file
            tensors, meta = load_model(out)
            assert tensors["w"].numel() == 4_000_000 and int(tensors["i"]) == meta["i"]
    leftovers = [p for p in tmp_path.iterdir() if p.name != out.name]
    assert all(not p.name.endswith(".safetensors") for p in leftovers)


def test_failed_fit_keeps_the_existing_model(model_file, tmp_path):
    target = tmp_path / "keep.safetensors"
    target.write_bytes(model_file.read_bytes())
    before = target.read_bytes()
    bad = tmp_path / "bad"
    bad.mkdir()
    for i in range(4):
        (bad / f"{i}.png").write_bytes(b"not a png")
    code = main(["fit", "--data", str(bad), "--output", str(target), "--quiet",
                 "backbone.name=resnet18", "backbone.weights=null", "data.num_workers=0"])
    assert code == 2
    assert target.read_bytes() == before


# -- determinism --------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["padim", "padim-dense", "patchcore"])
def test_same_seed_gives_byte_identical_files(method, tmp_path):
    """...and a loaded model scores bit-identically to the fitted one."""
    imgs = textured_images(8, size=(64, 64))
    extra = {"padim__covariance": "dense"} if method == "padim-dense" else {}
    paths, dets = [], []
    for run, seed in enumerate((0, 0, 1)):
        det = Detector.from_config(None, method=method.split("-")[0], seed=seed, **FAST, **extra)
        det.fit(imgs, progress=False)
        paths.append(det.save(tmp_path / f"{run}.safetensors"))
        dets.append(det)
    a, b, c = (p.read_bytes() for p in paths)
    assert a == b
    assert a != c
    probe = textured_images(2, size=(64, 64), seed=9)
    loaded = Detector.load(paths[0]).predict(probe)
    for got, want in zip(loaded, dets[0].predict(probe)):
        assert got.score == want.score and np.array_equal(got.heatmap, want.heatmap)


# -- resource guard -----------------------------------------------------------------------
def test_resource_guard_refuses_with_estimate_and_keys():
    imgs = textured_images(6, size=(64, 64))
    for method, key in (("padim", "padim.n_features"), ("patchcore", "patchcore.max_bank_points")):
        det = Detector.from_config(None, method=method, resources__memory_limit_gb=1e-4, **FAST)
        with pytest.raises(ResourceError) as err:
            det.fit(imgs, progress=False)
        assert "GB" in str(err.value) and key in str(err.value)
        Detector.from_config(None, method=method, **FAST).fit(imgs, progress=False)


def test_padim_memory_estimate_matches_the_factors():
    from anomaly_hooks.extractor import LayerInfo

    cfg = load_config(None, padim__n_features=550)
    layers = [LayerInfo("layer1", 256, 4), LayerInfo("layer2", 512, 8), LayerInfo("layer3", 1024, 16)]
    est = estimate_fit_memory(cfg, layers, (224, 224), 250)  # > 220: dense
    assert est["model"] == 3136 * 550 * 550 * 4 + 3136 * 550 * 4
    # one float32 [P, D, D] tensor: sums, then covariances, then factors, in place
    assert est["statistics (float32 sums, factorised in place)"] == 3136 * 550 * 550 * 4
    assert est["float16 factors"] == 0
    half = estimate_fit_memory(load_config(None, padim__n_features=550,
                                           padim__factor_dtype="float16"),
                               layers, (224, 224), 200)  # float16: dense whatever n
    assert half["float16 factors"] == 3136 * 550 * 550 * 2
    assert half["model"] == 3136 * 550 * 550 * 2 + 3136 * 550 * 4
    # bottle: 167 training images keep the low-rank form, 2.6 times smaller than dense
    low = estimate_fit_memory(cfg, layers, (224, 224), 167)
    assert low["model"] == 3136 * (167 * 550 + 167 * 167 + 550) * 4
    assert low["total"] < est["total"] / 2


# -- config errors ------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, key", [
    (["padim.bogus=1"], "bogus"),
    (["nonsense=1"], "nonsense"),
    (["seed=abc"], "seed"),
    (["patchcore.coreset_ratio=0"], "patchcore.coreset_ratio"),
    (["patchcore.coreset_ratio=1.5"], "patchcore.coreset_ratio"),
    (["preprocess.resize=100", "preprocess.crop=200"], "preprocess.crop"),
    (["backbone.precision=int4"], "backbone.precision"),
    (["resources.memory_fraction=2"], "resources.memory_fraction"),
])
def test_config_errors_are_one_line_and_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_impossible_layer_and_too_many_channels():
    with pytest.raises(ValueError, match="layer9"):
        Detector.from_config(None, **{**FAST, "backbone__layers": ["layer9"]})
    det = Detector.from_config(None, **{**FAST, "padim__n_features": 5000})
    with pytest.raises(ValueError, match="padim.n_features=5000"):
        det.fit(textured_images(6, size=(64, 64)), progress=False)


# -- fuzzing ------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=2048), suffix=st.sampled_from([".png", ".jpg", ".gif", ".bmp"]))
def test_fuzz_image_bytes(tmp_path, data, suffix):
    path = tmp_path / f"x{suffix}"
    path.write_bytes(data)
    try:
        img = read_image(path)
    except ImageReadError as exc:
        assert str(path) in str(exc) or path.name in str(exc)
        return
    assert img.dtype == torch.float32 and img.shape[0] == 3
    assert float(img.min()) >= 0.0 and float(img.max()) <= 1.0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["flip", "cut", "insert"]),
                              st.integers(0, 10**9), st.integers(0, 255)), min_size=1, max_size=4))
def test_fuzz_model_file_mutations(model_file, tmp_path, ops):
    raw = bytearray(model_file.read_bytes())
    for op, pos, val in ops:
        pos %= max(1, len(raw))
        if op == "flip" and raw:
            raw[pos] ^= (val or 1)
        elif op == "cut":
            del raw[pos:]
        else:
            raw[pos:pos] = bytes([val])
    bad = tmp_path / "fuzz.safetensors"
    bad.write_bytes(bytes(raw))
    try:
        load_model(bad)
    except ModelFileError:
        return
    assert bytes(raw) == model_file.read_bytes() or True  # a harmless mutation may still verify


@settings(max_examples=60, deadline=None)
@given(shape=st.sampled_from([(5, 7), (5, 7, 1), (5, 7, 3), (5, 7, 4), (1, 1), (0, 4)]),
       dtype=st.sampled_from([np.uint8, np.uint16, np.float32, np.float64]),
       special=st.sampled_from([None, np.nan, np.inf, -1.0, 2.0]))
def test_fuzz_numpy_arrays(shape, dtype, special):
    rng = np.random.default_rng(0)
    arr = (rng.random(shape) * (255 if dtype in (np.uint8, np.uint16) else 1)).astype(dtype)
    if special is not None and arr.size and np.issubdtype(dtype, np.floating):
        arr.flat[0] = special
    try:
        img = read_image(arr)
    except (ImageReadError, ValueError) as exc:
        assert str(exc)
        return
    assert img.shape[0] == 3 and bool(torch.isfinite(img).all())


def test_saved_model_has_ordinary_permissions(model_file):
    mask = os.umask(0o022)
    os.umask(mask)
    assert (model_file.stat().st_mode & 0o777) == (0o666 & ~mask)


# -- model file reader ----------------------------------------------------------------------
@pytest.mark.parametrize("edit, message", [
    (lambda h: h["a"].update(shape=[3, 5]), "do not fit shape"),
    (lambda h: h["a"].update(data_offsets=[0, 10 ** 9]), "do not fit shape"),
    (lambda h: h["a"].update(shape=[10 ** 8], data_offsets=[0, 4 * 10 ** 8]), "past the end"),
    (lambda h: h["a"].update(dtype="Q99"), "malformed header entry"),
    (lambda h: h["a"].pop("data_offsets"), "malformed header entry"),
])
def test_reader_checks_offsets_before_reading(tmp_path, edit, message):
    """The loader reads each tensor straight into an owned buffer: an entry whose offsets do not
    match its shape, point past the file, or name an unknown dtype is refused before any read."""
    from conftest import rewrite_safetensors_header

    from anomaly_hooks.modelfile import ModelFileError, load_model, save_model

    good = save_model(tmp_path / "m.safetensors",
                      {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                       "b": torch.tensor([1, 2], dtype=torch.int64)}, {"x": 1})
    tensors, meta = load_model(good)
    assert torch.equal(tensors["a"], torch.arange(12.0).reshape(3, 4)) and meta["x"] == 1
    assert tensors["a"].data_ptr() % 64 == 0  # owned, aligned memory
    bad = tmp_path / "bad.safetensors"
    rewrite_safetensors_header(good, bad, edit)
    with pytest.raises(ModelFileError, match=message):
        load_model(bad)
