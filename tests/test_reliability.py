"""Reliability suite: bad images, damaged/hostile model files, atomic saves under SIGKILL,
thread-safe prediction, determinism, config errors, the memory guard, and fuzzing of the image
and model-file readers.

Everything runs on CPU with a random-init ResNet18 and small inputs (see conftest.small_cfg);
every file lives under tmp_path.
"""
from __future__ import annotations

import functools
import io
import json
import os
import pickle
import random
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    ROOT,
    rewrite_safetensors_header,
    safetensors_header,
    textured_images,
    with_defect,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from anomaly_hooks import Detector
from anomaly_hooks.cli import main
from anomaly_hooks.modelfile import FORMAT_VERSION, ModelFileError, checksum, load_model

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


# =========================================================================================
# helpers
# =========================================================================================
def _png(arr_or_img, **kw) -> bytes:
    img = arr_or_img if isinstance(arr_or_img, Image.Image) else Image.fromarray(arr_or_img)
    buf = io.BytesIO()
    img.save(buf, "PNG", **kw)
    return buf.getvalue()


def _jpeg(arr: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + tag + data
            + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))


@functools.lru_cache(maxsize=None)
def _bomb_png(width: int = 20_000, height: int = 20_000) -> bytes:
    """A complete, valid 1-bit PNG of one colour, width x height, built without ever holding
    the decoded image (the compressed stream is ~50 KB for 20000x20000)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1-bit grayscale
    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    comp = zlib.compressobj(9)
    rows_per_chunk = 1000
    parts = []
    for start in range(0, height, rows_per_chunk):
        parts.append(comp.compress(row * min(rows_per_chunk, height - start)))
    parts.append(comp.flush())
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr)
            + _png_chunk(b"IDAT", b"".join(parts)) + _png_chunk(b"IEND", b""))


def _good_rgb(h: int = 40, w: int = 48, seed: int = 0) -> np.ndarray:
    return textured_images(1, size=(h, w), seed=seed)[0]


def make_bad_files(folder: Path) -> dict[str, Path]:
    """Unreadable 'images', each a different way of being broken."""
    folder.mkdir(parents=True, exist_ok=True)
    good_png = _png(_good_rgb())
    good_jpg = _jpeg(_good_rgb())
    bad = {
        "zero": folder / "zero_bytes.png",
        "trunc_png": folder / "truncated.png",
        "trunc_jpg": folder / "truncated.jpg",
        "text_png": folder / "text_file.png",
        "dir_png": folder / "a_directory.png",
        "bomb": folder / "bomb_20000x20000.png",
    }
    bad["zero"].write_bytes(b"")
    bad["trunc_png"].write_bytes(good_png[: len(good_png) // 2])
    bad["trunc_jpg"].write_bytes(good_jpg[: len(good_jpg) // 2])
    bad["text_png"].write_text("this is a text file, not a PNG\n")
    bad["dir_png"].mkdir()
    bad["bomb"].write_bytes(_bomb_png())
    return bad


def write_good(folder: Path, n: int, size=(96, 112), seed: int = 0) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, arr in enumerate(textured_images(n, size=size, seed=seed)):
        p = folder / f"good_{i:03d}.png"
        p.write_bytes(_png(arr))
        out.append(p)
    return out


_header = safetensors_header
rewrite_header = rewrite_safetensors_header


@pytest.fixture(scope="module")
def padim_file(fitted, tmp_path_factory) -> Path:
    return fitted.save(tmp_path_factory.mktemp("padim") / "padim.safetensors")


@pytest.fixture(scope="module")
def dense_padim_file(small_cfg, tmp_path_factory) -> Path:
    det = Detector.from_config(small_cfg, padim__covariance="dense")
    det.fit(textured_images(8), progress=False)
    return det.save(tmp_path_factory.mktemp("dense") / "padim.safetensors")


@pytest.fixture(scope="module")
def patchcore_file(small_cfg, tmp_path_factory) -> Path:
    det = Detector.from_config(small_cfg, method="patchcore", patchcore__coreset_ratio=0.5,
                               patchcore__knn_backend="torch")
    det.fit(textured_images(8), progress=False)
    return det.save(tmp_path_factory.mktemp("patchcore") / "patchcore.safetensors")


# =========================================================================================
# 1. bad images
# =========================================================================================


def test_cli_score_scores_the_rest_and_reports_failures(tmp_path, padim_file, capsys):
    good = write_good(tmp_path / "good", 3)
    one = tmp_path / "good" / "one_pixel.png"
    one.write_bytes(_png(np.array([[[10, 20, 30]]], dtype=np.uint8)))
    bad = make_bad_files(tmp_path / "bad")
    out = tmp_path / "results"
    inputs = [str(p) for p in good + [one]] + [str(p) for p in bad.values()]
    inputs.append(str(tmp_path / "does_not_exist.png"))
    code = main(["score", "--model", str(padim_file), *inputs, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in captured.err + captured.out
    result = json.loads((out / "results.json").read_text())
    scored = {Path(r["path"]).name for r in result["results"]}
    assert scored == {p.name for p in good + [one]}
    failures = "\n".join(result["failures"])
    for p in list(bad.values()) + [tmp_path / "does_not_exist.png"]:
        assert p.name in failures, p
    assert len(result["failures"]) == len(bad) + 1
    assert all(np.isfinite(r["score"]) for r in result["results"])
    assert (out / "results.csv").read_text().count("\n") == len(good) + 2


def test_cli_overrides_on_both_sides_of_an_option(tmp_path, capsys):
    data = tmp_path / "data"
    write_good(data, 4, size=(32, 32))
    code = main(["fit", "--quiet", "backbone.name=resnet18", "backbone.weights=null",
                 "--data", str(data), "--output", str(tmp_path / "m.safetensors"),
                 "padim.bogus=1"])  # the last override is wrong on purpose: exits fast
    assert code == 2
    assert "padim.bogus" in _one_error_line(capsys.readouterr().err)


def test_cli_stray_arguments_are_still_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--data", "x", "--bogus-flag", "a=1"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --bogus-flag" in capsys.readouterr().err


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("case", ["missing_model", "garbage_model", "bad_key", "bad_nested_key",
                                  "bad_type", "missing_data", "bad_layer", "too_few",
                                  "yaml_key", "yaml_syntax", "missing_config"])
def test_cli_user_errors_are_one_line_exit_2(case, tmp_path, capsys):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    img = tmp_path / "x.png"
    img.write_bytes(_png(_good_rgb(16, 16)))
    data = tmp_path / "data"
    write_good(data, 4, size=(32, 32))
    yaml_bad, yaml_broken = tmp_path / "bad.yaml", tmp_path / "broken.yaml"

    def fit(folder, *extra):
        return ["fit", "--quiet", "--output", str(tmp_path / "m.safetensors"), "--data",
                str(folder), "backbone.name=resnet18", "backbone.weights=null", "device=cpu",
                "preprocess.resize=64", "preprocess.crop=null", "data.num_workers=0", *extra]

    argv, expect = {
        "missing_model": (["score", "--model", str(tmp_path / "nope.safetensors"), str(img),
                           "--out", str(tmp_path / "o")], "nope.safetensors"),
        "garbage_model": (["score", "--model", str(garbage), str(img), "--out",
                           str(tmp_path / "o")], "garbage.safetensors"),
        "bad_key": (fit(data, "bogus=1"), "bogus"),
        "bad_nested_key": (fit(data, "padim.bogus=1"), "padim.bogus"),
        "bad_type": (fit(data, "seed=abc"), "seed"),
        "missing_data": (fit(tmp_path / "no_such_dir"), "no_such_dir"),
        "bad_layer": (fit(data, "backbone.layers=[layer9]"), "layer9"),
        "too_few": (fit(tmp_path / "two", "threshold.mode=holdout",
                            "threshold.holdout_fraction=0.25"), "at least 2"),
        "yaml_key": (["fit", "--config", str(yaml_bad), "--data", str(data)], "padim.bogus"),
        "yaml_syntax": (["fit", "--config", str(yaml_broken), "--data", str(data)],
                        "broken.yaml"),
        "missing_config": (["fit", "--config", str(tmp_path / "nope.yaml"), "--data", str(data)],
                           "nope.yaml"),
    }[case]
    write_good(tmp_path / "two", 2, size=(32, 32))
    yaml_bad.write_text("method: padim\npadim:\n  bogus: 1\n")
    yaml_broken.write_text("method: padim\npadim: [unclosed\n")
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2
    line = _one_error_line(captured.err)
    assert expect in line
    assert not (tmp_path / "m.safetensors").exists()


# =========================================================================================
# 2. model files
# =========================================================================================
def test_model_roundtrip_and_checksum_is_verified(padim_file, fitted, tmp_path):
    img = with_defect(textured_images(1, seed=5)[0])
    loaded = Detector.load(padim_file, method="padim")
    a, b = fitted.predict(img), loaded.predict(img)
    assert a.score == b.score and np.array_equal(a.heatmap, b.heatmap)
    _, header = _header(padim_file)
    meta = header["__metadata__"]
    tensors, _ = load_model(padim_file)
    assert meta["checksum"] == checksum(meta["meta"], tensors)


def test_flipped_bytes_in_tensor_data(padim_file, tmp_path):
    raw = bytearray(padim_file.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    rng = random.Random(0)
    for trial in range(5):
        data = bytearray(raw)
        pos = rng.randrange(8 + n, len(raw))
        data[pos] ^= 1 << rng.randrange(8)
        bad = tmp_path / f"flip{trial}.safetensors"
        bad.write_bytes(bytes(data))
        with pytest.raises(ModelFileError, match="checksum mismatch") as err:
            Detector.load(bad)
        assert str(bad) in str(err.value)


def test_flipped_bytes_in_header(padim_file, tmp_path):
    raw = padim_file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8:8 + n]
    positions = [0, 3, 7]  # the length prefix
    positions += [8 + header.index(b'"checksum"') + 14, 8 + header.index(b'"data_offsets"') + 17,
                  8 + header.index(b'"format_version"') + 18, 8 + header.index(b'"dtype"') + 9]
    positions += [8 + header.index(b'\\"threshold\\"') + 20, 8, 8 + n - 1]
    rng = random.Random(1)
    positions += [rng.randrange(8, 8 + n) for _ in range(10)]
    for i, pos in enumerate(positions):
        data = bytearray(raw)
        data[pos] ^= 0x01 if i % 2 else 0x20
        if bytes(data) == raw:
            continue
        bad = tmp_path / f"hdr{i}.safetensors"
        bad.write_bytes(bytes(data))
        with pytest.raises(ModelFileError) as err:
            Detector.load(bad)
        assert str(bad) in str(err.value)


@pytest.mark.parametrize("keep", [0, 4, 8, 100, "header", "half", "minus1"])
def test_truncated_model_file(padim_file, tmp_path, keep):
    raw = padim_file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    size = {"header": 8 + n, "half": len(raw) // 2, "minus1": len(raw) - 1}.get(keep, keep)
    bad = tmp_path / "trunc.safetensors"
    bad.write_bytes(raw[:size])
    with pytest.raises(ModelFileError) as err:
        Detector.load(bad)
    assert str(bad) in str(err.value)


def test_garbage_files_are_refused(tmp_path):
    for name, data in (("text", b"hello, I am not a model"), ("zeros", bytes(4096)),
                       ("png", _png(_good_rgb()))):
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(data)
        with pytest.raises(ModelFileError, match="not an anomaly_hooks model file|too short"):
            Detector.load(bad)


def test_saved_model_has_ordinary_permissions(padim_file):
    mask = os.umask(0o022)
    os.umask(mask)
    assert (padim_file.stat().st_mode & 0o777) == (0o666 & ~mask)


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
    from anomaly_hooks.modelfile import save_model

    good = save_model(tmp_path / "m.safetensors",
                      {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                       "b": torch.tensor([1, 2], dtype=torch.int64)}, {"x": 1})
    tensors, meta = load_model(good)
    assert torch.equal(tensors["a"], torch.arange(12.0).reshape(3, 4)) and meta["x"] == 1
    assert tensors["a"].data_ptr() % 64 == 0  # owned, aligned memory
    bad = tmp_path / "bad.safetensors"
    rewrite_header(good, bad, edit)
    with pytest.raises(ModelFileError, match=message):
        load_model(bad)


def test_newer_format_version_refused(padim_file, tmp_path):
    newer = tmp_path / "newer.safetensors"
    rewrite_header(padim_file, newer, lambda h: h["__metadata__"].update(
        format_version=str(FORMAT_VERSION + 1)))
    with pytest.raises(ModelFileError, match="newer anomaly_hooks.*upgrade"):
        Detector.load(newer)
    for bogus in ("0", "-1", "abc", ""):
        odd = tmp_path / "odd.safetensors"
        rewrite_header(padim_file, odd,
                       lambda h, v=bogus: h["__metadata__"].update(format_version=v))
        with pytest.raises(ModelFileError):
            Detector.load(odd)
    # the rewrite itself is sound: the same header rewritten with the current version loads
    same = tmp_path / "same.safetensors"
    rewrite_header(padim_file, same, lambda h: None)
    assert Detector.load(same).is_fitted


def test_patchcore_file_refused_as_padim(patchcore_file, padim_file):
    with pytest.raises(ModelFileError, match="is a patchcore model, but a padim model"):
        Detector.load(patchcore_file, method="padim")
    with pytest.raises(ModelFileError, match="is a padim model, but a patchcore model"):
        Detector.load(padim_file, method="patchcore")
    assert Detector.load(patchcore_file, method="patchcore").is_fitted


class _Payload:
    """Unpickling this creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _forge(path: Path, metadata: dict, tensors: dict | None = None) -> None:
    from safetensors.torch import save_file

    save_file(tensors or {"x": torch.zeros(2)}, str(path), metadata=metadata)


def test_pickle_payloads_never_run(tmp_path, padim_file, capsys):
    marker = tmp_path / "MARKER_code_ran"
    payload = _Payload(str(marker))
    assert pickle.loads(pickle.dumps(payload)) is None and marker.exists()  # the payload works
    marker.unlink()

    files = {}
    files["torch_save"] = tmp_path / "torch_save.safetensors"
    torch.save({"state": payload, "w": torch.zeros(3)}, files["torch_save"])
    files["torch_save_legacy"] = tmp_path / "torch_legacy.safetensors"
    torch.save({"state": payload}, files["torch_save_legacy"], _use_new_zipfile_serialization=False)
    files["raw_pickle"] = tmp_path / "raw_pickle.safetensors"
    files["raw_pickle"].write_bytes(pickle.dumps(payload, protocol=2))
    # a pickle behind a plausible length prefix
    blob = pickle.dumps(payload)
    files["prefixed_pickle"] = tmp_path / "prefixed.safetensors"
    files["prefixed_pickle"].write_bytes(struct.pack("<Q", len(blob)) + blob)
    # safetensors files whose metadata carries a pickle
    pickled_text = pickle.dumps(payload, protocol=0).decode("latin-1")
    files["meta_pickle"] = tmp_path / "meta_pickle.safetensors"
    _forge(files["meta_pickle"], {"format": "anomaly_hooks", "format_version": "1",
                                  "meta": pickled_text, "checksum": "0" * 64})
    # ... even with a checksum that matches it (the checksum is no signature)
    t = {"x": torch.zeros(2)}
    files["meta_pickle_valid_checksum"] = tmp_path / "meta_pickle_ck.safetensors"
    _forge(files["meta_pickle_valid_checksum"],
           {"format": "anomaly_hooks", "format_version": "1", "meta": pickled_text,
            "checksum": checksum(pickled_text, t)}, t)
    # a real model with an extra metadata key holding a pickle
    files["extra_key"] = tmp_path / "extra_key.safetensors"
    rewrite_header(padim_file, files["extra_key"],
                   lambda h: h["__metadata__"].update(pickle=pickled_text))

    for name, path in files.items():
        with pytest.raises(ModelFileError) as err:
            Detector.load(path)
        assert str(path) in str(err.value), name
        assert main(["score", "--model", str(path), str(tmp_path), "--out",
                     str(tmp_path / "o")]) == 2, name
        _one_error_line(capsys.readouterr().err)
        with pytest.raises(ModelFileError):
            load_model(path)
    assert not marker.exists(), "code from a model file ran"


@pytest.mark.parametrize("case", [
    "bad_channel_idx",
    "no_config",
    "config_unknown_key",
    "no_threshold",
    "layers_not_dicts",
    "scorer_meta_null",
    "lowrank_y_wrong_shape",
    "lowrank_cinv_wrong_dtype",
    "lowrank_y_missing",
    "unknown_covariance_form",
    "dense_meta_on_lowrank_tensors",
])
def test_forged_file_with_valid_checksum_is_refused_on_load(case, padim_file, tmp_path):
    """A file written through save_model (so its checksum verifies) whose content does not fit
    together: refused by Detector.load with ModelFileError, never a raw error, never later."""
    from anomaly_hooks.modelfile import save_model

    tensors, meta = load_model(padim_file)
    if case == "bad_channel_idx":
        tensors["embed.channel_idx"] = tensors["embed.channel_idx"] + 10_000
    elif case == "no_config":
        del meta["config"]
    elif case == "config_unknown_key":
        meta["config"]["bogus"] = 1
    elif case == "no_threshold":
        del meta["threshold"]
    elif case == "layers_not_dicts":
        meta["layers"] = "layer1"
    elif case == "scorer_meta_null":
        meta["scorer"] = None
    elif case == "lowrank_y_wrong_shape":
        tensors["padim.lowrank_y"] = tensors["padim.lowrank_y"][:10].clone()
    elif case == "lowrank_cinv_wrong_dtype":
        tensors["padim.lowrank_cinv"] = tensors["padim.lowrank_cinv"].double()
    elif case == "lowrank_y_missing":
        del tensors["padim.lowrank_y"]
    elif case == "unknown_covariance_form":
        meta["scorer"]["covariance"] = "diagonal"
    else:
        meta["scorer"]["covariance"] = "dense"
    forged = save_model(tmp_path / "forged.safetensors", tensors, meta, version=2)
    with pytest.raises(ModelFileError) as err:
        Detector.load(forged).predict(textured_images(1)[0])
    assert str(forged) in str(err.value)


@pytest.mark.parametrize("case", ["chol_wrong_shape", "chol_int", "mean_float64",
                                  "lowrank_meta_on_dense_tensors"])
def test_forged_dense_file_with_valid_checksum_is_refused_on_load(case, dense_padim_file,
                                                                   tmp_path):
    from anomaly_hooks.modelfile import save_model

    tensors, meta = load_model(dense_padim_file)
    assert meta["scorer"]["covariance"] == "dense"
    if case == "chol_wrong_shape":
        tensors["padim.chol"] = tensors["padim.chol"][:10].clone()
    elif case == "chol_int":
        tensors["padim.chol"] = tensors["padim.chol"].int()
    elif case == "mean_float64":
        tensors["padim.mean"] = tensors["padim.mean"].double()
    else:
        meta["scorer"]["covariance"] = "lowrank"
    forged = save_model(tmp_path / "forged.safetensors", tensors, meta)
    with pytest.raises(ModelFileError) as err:
        Detector.load(forged).predict(textured_images(1)[0])
    assert str(forged) in str(err.value)


def _both_preprocess(**changes):
    """An edit of the preprocessing in the metadata and in the config it is built from."""
    def edit(meta: dict) -> None:
        meta["preprocess"].update(changes)
        meta["config"]["preprocess"].update(changes)
    return edit


def _threshold(**changes):
    return lambda meta: meta["threshold"].update(changes)


_DISTANCE = "expected a finite number > 0 (image scores are distances >= 0)"
_STD = "expected three finite numbers >= 1.18e-38 (the smallest normal float32)"
_PIXELS = "expected an integer in 1..1099511627776"
FORGED_VALUES = {
    "threshold_inf": (_threshold(value=float("inf")), f"threshold.value = inf: {_DISTANCE}"),
    "threshold_minus_inf": (_threshold(value=float("-inf")),
                            f"threshold.value = -inf: {_DISTANCE}"),
    "threshold_minus_1e9": (_threshold(value=-1e9),
                            f"threshold.value = -1000000000.0: {_DISTANCE}"),
    "threshold_nan": (_threshold(value=float("nan")), f"threshold.value = nan: {_DISTANCE}"),
    "threshold_zero": (_threshold(value=0), f"threshold.value = 0: {_DISTANCE}"),
    "threshold_string": (_threshold(value="1.5"), f"threshold.value = '1.5': {_DISTANCE}"),
    "scale_zero": (_threshold(scale=0.0), "threshold.scale = 0.0: expected a finite number > 0"),
    "scale_inf": (_threshold(scale=float("inf")),
                  "threshold.scale = inf: expected a finite number > 0"),
    "std_zero": (_both_preprocess(std=[0.0, 0.0, 0.0]), f"preprocess.std[0] = 0.0: {_STD}"),
    "std_nan_in_config": (lambda m: m["config"]["preprocess"].update(std=[0.2, float("nan"),
                                                                          0.2]),
                          f"config.preprocess.std[1] = nan: {_STD}"),
    "mean_two_values": (_both_preprocess(mean=[0.5, 0.5]),
                        "preprocess.mean = [0.5, 0.5]: expected three finite float32 numbers"),
    "resize_20000": (_both_preprocess(resize=[20000, 20000]),
                     "preprocess.resize = [20000, 20000]: expected [height, width], integers "
                     "in 1..8192"),
    "preprocess_not_the_config": (lambda m: m["preprocess"].update(crop=None),
                                  "preprocess = {'crop': None, "),
    "max_pixels_zero": (lambda m: m["config"]["data"].update(max_pixels=0),
                        f"config.data.max_pixels = 0: {_PIXELS}"),
    "max_pixels_1e24": (lambda m: m["config"]["data"].update(max_pixels=10 ** 24),
                        f"config.data.max_pixels = {10 ** 24}: {_PIXELS}"),
    "layers_nested": (lambda m: m.update(layers=[[[["layer1"]]]]),
                      "layers[0] = [[['layer1']]]: expected an object"),
}


@pytest.mark.parametrize("case", sorted(FORGED_VALUES))
def test_forged_values_with_valid_checksum_are_refused_naming_the_field(case, padim_file,
                                                                        tmp_path, capsys):
    """Values that would decide every image the same way or fail at the first predict (a NaN,
    infinite or non-positive threshold or scale, a zero std, absurd sizes): refused by the
    reader, the loader and ``score`` (exit 2), naming the field."""
    from anomaly_hooks.modelfile import save_model

    edit, message = FORGED_VALUES[case]
    tensors, meta = load_model(padim_file)
    edit(meta)
    forged = save_model(tmp_path / "forged.safetensors", tensors, meta, version=2)
    for load in (load_model, Detector.load):
        with pytest.raises(ModelFileError) as err:
            load(forged)
        assert str(err.value).startswith(f"{forged}: {message}")
    assert main(["score", "--model", str(forged), str(tmp_path), "--out",
                 str(tmp_path / "o")]) == 2
    assert _one_error_line(capsys.readouterr().err).startswith(f"error: {forged}: {message}")


def test_model_files_record_the_oldest_format_that_holds_them(padim_file, dense_padim_file,
                                                               patchcore_file):
    """Dense PaDiM and PatchCore files stay format 1 (older readers open them); low-rank PaDiM
    needs format 2."""
    versions = {p: _header(p)[1]["__metadata__"]["format_version"]
                for p in (padim_file, dense_padim_file, patchcore_file)}
    assert versions == {padim_file: "2", dense_padim_file: "1", patchcore_file: "1"}
    assert FORMAT_VERSION == 2


# =========================================================================================
# 3. atomic saves
# =========================================================================================
KILLER = r"""
import os, shutil, signal, sys
import torch
torch.set_num_threads(1)
import safetensors.torch as st
from anomaly_hooks import Detector, modelfile
det = Detector.load(sys.argv[1])
old, out = sys.argv[2], sys.argv[3]


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at(point):
    if point == "mid-write":  # the temp file holds half of what safetensors writes
        real = st.save_file
        def half(tensors, filename, metadata=None):
            real(tensors, filename, metadata=metadata)
            os.truncate(filename, os.path.getsize(filename) // 2)
            die()
        st.save_file = half
    elif point == "written":  # complete temp file, header not yet canonical
        modelfile._canonicalise_header = die
    elif point == "unsynced":  # before the temp file's fsync
        os.fsync = die
    elif point == "before-rename":
        os.replace = die
    elif point == "after-rename":  # renamed, folder not yet synced
        real_replace = os.replace
        def then_die(src, dst):
            real_replace(src, dst)
            die()
        os.replace = then_die


print("ready", flush=True)
for line in sys.stdin:
    point, existing = line.split()
    if os.path.exists(out):
        os.unlink(out)
    if existing == "1":
        shutil.copyfile(old, out)
    pid = os.fork()
    if pid == 0:
        kill_at(point)
        det.save(out)
        os._exit(3)  # never reached when the kill point is hit
    print(os.waitpid(pid, 0)[1], flush=True)
"""
KILL_POINTS = ["mid-write", "written", "unsynced", "before-rename", "after-rename"]


@pytest.mark.slow
def test_sigkill_at_each_step_of_a_save_never_leaves_a_broken_model(padim_file,
                                                                    dense_padim_file, tmp_path):
    """SIGKILL of a saving process at each step of the atomic save, deterministically (the
    process kills itself at that step), with and without a model already at the path: before
    the rename the path holds exactly the old model (or nothing), after it exactly the new one;
    a leftover is only ever a hidden ``.tmp`` file, never a ``.safetensors`` path."""
    out_dir = tmp_path / "models"
    out_dir.mkdir()
    out = out_dir / "model.safetensors"
    new, old = padim_file.read_bytes(), dense_padim_file.read_bytes()  # saves are byte-identical
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", KILLER, str(padim_file), str(dense_padim_file),
                             str(out)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for point in KILL_POINTS:
            for existing in (False, True):
                proc.stdin.write(f"{point} {int(existing)}\n")
                proc.stdin.flush()
                status = int(proc.stdout.readline())
                case = f"{point}, {'old model there' if existing else 'no file'}"
                assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, case
                if point == "after-rename":
                    assert out.read_bytes() == new, case
                    load_model(out)  # complete and verified
                elif existing:
                    assert out.read_bytes() == old, case
                else:
                    assert not out.exists(), case
                for left in out_dir.iterdir():
                    if left != out:
                        assert left.name.startswith(".") and left.name.endswith(".tmp"), case
                        left.unlink()
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("fail_at", ["save_file", "canonicalise", "fsync", "replace"])
def test_save_interrupted_at_each_step_keeps_the_old_model(fail_at, fitted, padim_file,
                                                           tmp_path, monkeypatch):
    """Fault injection at every step of the atomic save (an exception, or KeyboardInterrupt as
    for Ctrl-C): the model already at the path is untouched and no temp file is left."""
    import safetensors.torch

    from anomaly_hooks import modelfile

    target = tmp_path / "model.safetensors"
    target.write_bytes(padim_file.read_bytes())
    before = target.read_bytes()
    exc = KeyboardInterrupt() if fail_at in ("fsync", "replace") else OSError("disk full")

    def boom(*args, **kwargs):
        raise exc

    if fail_at == "save_file":  # a partial file, then the failure
        def partial(tensors, filename, metadata=None):
            Path(filename).write_bytes(b"\x00" * 1000)
            raise exc
        monkeypatch.setattr(safetensors.torch, "save_file", partial)
    elif fail_at == "canonicalise":
        monkeypatch.setattr(modelfile, "_canonicalise_header", boom)
    elif fail_at == "fsync":
        monkeypatch.setattr(modelfile.os, "fsync", boom)
    else:
        monkeypatch.setattr(modelfile.os, "replace", boom)
    with pytest.raises(type(exc)):
        fitted.save(target)
    monkeypatch.undo()
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_failed_cli_fit_keeps_the_existing_model(padim_file, tmp_path, capsys):
    target = tmp_path / "keep.safetensors"
    target.write_bytes(padim_file.read_bytes())
    before = target.read_bytes()
    bad = tmp_path / "bad_train"
    make_bad_files(bad)
    base = ["fit", "--data", str(bad), "--output", str(target), "--quiet",
            "backbone.name=resnet18", "backbone.weights=null", "device=cpu",
            "preprocess.resize=64", "preprocess.crop=null", "data.num_workers=0"]
    for extra in ([], ["data.on_error=skip"]):
        code = main(base + extra)
        err = capsys.readouterr().err
        assert code != 0
        _one_error_line(err)
        assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".safetensors"] == [target.name]


# =========================================================================================
# 4. concurrency
# =========================================================================================


# =========================================================================================
# 5. determinism
# =========================================================================================


# =========================================================================================
# 6. config errors
# =========================================================================================


# =========================================================================================
# 7. resource guard
# =========================================================================================


# =========================================================================================
# 8. fuzzing
# =========================================================================================


mutation = st.tuples(st.sampled_from(["flip", "cut", "insert", "set"]),
                     st.integers(0, 10**9), st.integers(0, 255))


def _mutate(raw: bytes, ops) -> bytes:
    data = bytearray(raw)
    for op, pos, val in ops:
        pos %= max(1, len(data))
        if op == "flip" and data:
            data[pos] ^= val or 1
        elif op == "set" and data:
            data[pos] = val
        elif op == "cut":
            del data[pos:]
        else:
            data[pos:pos] = bytes([val]) * (1 + val % 16)
    return bytes(data)


@pytest.fixture(scope="module")
def tiny_model_bytes(padim_file) -> bytes:
    return padim_file.read_bytes()


@FUZZ
@given(ops=st.lists(mutation, min_size=1, max_size=4), in_header=st.booleans())
def test_fuzz_model_file_mutations(tiny_model_bytes, tmp_path, ops, in_header):
    raw = tiny_model_bytes
    if in_header:  # aim the mutations at the 8-byte prefix and the JSON header
        n = struct.unpack("<Q", raw[:8])[0]
        ops = [(op, pos % (8 + n), val) for op, pos, val in ops]
    mutated = _mutate(raw, ops)
    bad = tmp_path / "fuzz.safetensors"
    bad.write_bytes(mutated)
    try:
        tensors, meta = load_model(bad)
    except ModelFileError as exc:
        assert str(bad) in str(exc)
        return
    # it verified: then its tensors and metadata are exactly what was saved
    ref_tensors, ref_meta = load_model_cached(raw, tmp_path)
    assert meta == ref_meta
    assert tensors.keys() == ref_tensors.keys()
    assert all(torch.equal(tensors[k], ref_tensors[k]) for k in tensors)


_REF: dict = {}


def load_model_cached(raw: bytes, tmp_path: Path):
    key = hash(raw)
    if key not in _REF:
        p = tmp_path / "ref.safetensors"
        p.write_bytes(raw)
        _REF[key] = load_model(p)
    return _REF[key]


