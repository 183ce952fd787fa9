"""Model files: save and load (round trip, checksum, format versions, stored configs), damaged
and hostile files (flipped bytes, truncation, absurd headers, pickles), forged files whose
checksum verifies but whose content does not hold together, atomic saves under faults and
SIGKILL, and fuzzing of the reader. Everything runs on the CPU with a random-init ResNet18
(conftest.small_cfg); every file lives under tmp_path."""
from __future__ import annotations

import builtins
import json
import os
import pickle
import random
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from conftest import (
    ROOT,
    one_error_line,
    rewrite_safetensors_header,
    safetensors_header,
    textured_images,
    with_defect,
)
from fuzzing import fuzz_settings, mutate, mutation
from hypothesis import given
from hypothesis import strategies as st
from image_files import good_rgb, png_bytes
from safetensors.torch import save_file

from anomaly_hooks import Detector, modelfile
from anomaly_hooks.cli import main
from anomaly_hooks.detector import DESCRIPTORS_TENSOR
from anomaly_hooks.errors import ConfigError, DataError, ModelFileChangedError
from anomaly_hooks.modelfile import (
    FORMAT_VERSION,
    ModelFileError,
    checksum,
    load_model,
    save_model,
)


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


# ---- saving and loading ------------------------------------------------------------------
def test_model_roundtrip_and_checksum_is_verified(padim_file, fitted, tmp_path):
    img = with_defect(textured_images(1, seed=5)[0])
    loaded = Detector.load(padim_file, method="padim")
    a, b = fitted.predict(img), loaded.predict(img)
    assert a.score == b.score and np.array_equal(a.heatmap, b.heatmap)
    _, header = safetensors_header(padim_file)
    meta = header["__metadata__"]
    tensors, _ = load_model(padim_file)
    assert (meta["digests"], meta["checksum"]) == modelfile.digested(meta["meta"], tensors)


def test_saved_checksum_is_the_content_hash_not_the_placeholder(fitted, tmp_path):
    """The checksum, hashed while the tensors are written, is the one a single-threaded hash
    of the saved content gives, and two saves of one model are the same bytes."""
    a, b = fitted.save(tmp_path / "a.safetensors"), fitted.save(tmp_path / "b.safetensors")
    assert a.read_bytes() == b.read_bytes()
    _, header = safetensors_header(a)
    tensors, _ = load_model(a)
    recorded = header["__metadata__"]["checksum"]
    assert recorded != "0" * 64 and "0" * 64 not in header["__metadata__"]["digests"]
    digests, whole = modelfile.digested(header["__metadata__"]["meta"], tensors)
    assert (digests, whole) == (header["__metadata__"]["digests"], recorded)
    assert json.loads(digests) == {k: modelfile.tensor_digest(k, v) for k, v in tensors.items()}


def test_saved_model_has_ordinary_permissions(padim_file):
    mask = os.umask(0o022)
    os.umask(mask)
    assert (padim_file.stat().st_mode & 0o777) == (0o666 & ~mask)


def test_model_files_are_written_in_format_3_and_older_formats_still_load(
        padim_file, dense_padim_file, patchcore_file, tmp_path):
    """Every model is written in format 3 (a digest per tensor); the same content written in
    format 1 or 2 (one checksum over everything, what older versions wrote) loads and scores
    the same, its checksum the whole-content hash."""
    image = with_defect(textured_images(1, seed=5)[0])
    assert FORMAT_VERSION == 3
    for path in (padim_file, dense_padim_file, patchcore_file):
        assert safetensors_header(path)[1]["__metadata__"]["format_version"] == "3"
        tensors, meta = load_model(path)
        for version in (1, 2):
            old = save_model(tmp_path / f"v{version}.safetensors", tensors, meta, version)
            header = safetensors_header(old)[1]["__metadata__"]
            assert header["format_version"] == str(version) and "digests" not in header
            assert header["checksum"] == checksum(header["meta"], tensors)
            np.testing.assert_array_equal(Detector.load(old).decision_function([image]),
                                          Detector.load(path).decision_function([image]))


def test_a_model_saved_in_an_older_format_for_older_readers(kept_dense_file, dense_padim_file,
                                                            tmp_path, capsys):
    """``Detector.save(format_version=...)`` and ``--format-version`` write format 1 or 2
    (what an anomaly_hooks before format 3 reads: no digests, the whole file checksummed),
    the same model; a format below what the model holds needs, or not a format, is refused
    naming the formats it can have, before anything is written."""
    image = with_defect(textured_images(1, seed=5)[0])
    det = Detector.load(kept_dense_file)
    assert det.min_format_version() == 2  # kept embeddings
    old = det.save(tmp_path / "v2.safetensors", format_version=2)
    header = safetensors_header(old)[1]["__metadata__"]
    assert header["format_version"] == "2" and "digests" not in header
    tensors, _ = load_model(old)
    assert header["checksum"] == checksum(header["meta"], tensors)
    assert torch.equal(tensors["padim.dense_samples"], load_model(kept_dense_file)[0][
        "padim.dense_samples"])
    np.testing.assert_array_equal(Detector.load(old).decision_function([image]),
                                  det.decision_function([image]))
    assert det.scorer_.gaussians.stored_samples.digest is None  # reads verify the whole file
    for bad in (1, 4, 0, True, 2.0):
        with pytest.raises(ConfigError, match=r"formats 2\.\.3"):
            det.save(tmp_path / "bad.safetensors", format_version=bad)
    assert not (tmp_path / "bad.safetensors").exists()
    dense = Detector.load(dense_padim_file)
    assert dense.min_format_version() == 1
    v1 = dense.save(tmp_path / "v1.safetensors", format_version=1)
    assert safetensors_header(v1)[1]["__metadata__"]["format_version"] == "1"
    np.testing.assert_array_equal(Detector.load(v1).decision_function([image]),
                                  dense.decision_function([image]))
    cli = tmp_path / "cli.safetensors"
    assert main(["threshold", "--model", str(kept_dense_file), "--out", str(cli),
                 "--format-version", "2"]) == 0
    assert safetensors_header(cli)[1]["__metadata__"]["format_version"] == "2"
    assert Detector.load(cli).threshold_.n_images == det.threshold_.n_images
    capsys.readouterr()
    assert main(["threshold", "--model", str(kept_dense_file), "--out",
                 str(tmp_path / "no.safetensors"), "--format-version", "1"]) == 2
    assert "formats 2..3" in capsys.readouterr().err
    assert main(["threshold", "--model", str(kept_dense_file), "--format-version", "2"]) == 2
    assert "--format-version goes with --out" in capsys.readouterr().err
    assert not (tmp_path / "no.safetensors").exists()


@pytest.mark.parametrize("section, threshold, n_features", [
    ({}, "all-images", 40),  # 8 of 40 dimensions: auto picks the low-rank form
    ({"covariance": "dense"}, "all-images", 40),  # keeps the embeddings
    ({"covariance": "dense", "keep_embeddings": False}, "all-images", 40),
    ({"covariance": "dense"}, "holdout", 40),  # no leave-one-out: nothing kept
    ({}, "all-images", 3),  # 8 > 2 D images: dense, too many to keep
    (None, "all-images", 40),  # PatchCore
])
def test_the_planned_format_is_the_fitted_models(small_cfg, section, threshold, n_features):
    """``Detector.planned_format_version`` (before a fit) gives what the fitted model's
    ``min_format_version`` then is, for each form the config and the image count lead to."""
    images = textured_images(8)
    over = {"threshold__mode": threshold, "padim__n_features": n_features}
    if section is None:
        over.update(method="patchcore", patchcore__coreset_ratio=0.5,
                    patchcore__knn_backend="torch")
    else:
        over.update({f"padim__{k}": v for k, v in section.items()})
    det = Detector.from_config(small_cfg, **over)
    with pytest.raises(DataError, match="not a one-pass iterator"):
        det.check_format_version(1, train=iter(images))
    planned = det.planned_format_version(images)
    det.fit(images, progress=False)
    assert planned == det.min_format_version()
    assert planned == (2 if section in ({}, {"covariance": "dense"}) and threshold ==
                       "all-images" and n_features == 40 else 1)


def test_fit_writes_the_asked_format_refused_before_the_fit(small_cfg, tmp_path, monkeypatch,
                                                            capsys):
    """``anomaly-hooks fit --format-version N`` writes format N; a format the config's model
    cannot have is refused before any image is fitted, naming the settings for format 1."""
    import yaml

    data = tmp_path / "good"
    data.mkdir()
    for i, img in enumerate(textured_images(8)):
        (data / f"{i}.png").write_bytes(png_bytes(img))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**small_cfg, "threshold": {"mode": "all-images"}}))

    def fit(*argv: str) -> tuple[int, Path]:
        out = tmp_path / f"m{len(list(tmp_path.iterdir()))}.safetensors"
        code = main(["fit", "--quiet", "--config", str(config), "--data", str(data),
                     "--output", str(out), *argv])
        return code, out

    with monkeypatch.context() as m:  # the refusal comes before any fitting
        m.setattr(Detector, "fit", lambda *a, **k: pytest.fail("fitted before the check"))
        code, out = fit("--format-version", "1", "padim.covariance=dense")
    assert code == 2 and not out.exists()
    err = one_error_line(capsys.readouterr().err)
    assert "formats 2..3" in err and "padim.keep_embeddings=false" in err
    for argv, version in ((["--format-version", "2", "padim.covariance=dense"], "2"),
                          (["--format-version", "1", "padim.covariance=dense",
                            "padim.keep_embeddings=false"], "1"),
                          (["padim.covariance=dense"], str(FORMAT_VERSION))):
        code, out = fit(*argv)
        assert code == 0, capsys.readouterr().err
        assert safetensors_header(out)[1]["__metadata__"]["format_version"] == version
        assert Detector.load(out).min_format_version() == (2 if version == "2" else
                                                           1 if version == "1" else 2)


def test_newer_format_version_refused(padim_file, tmp_path):
    newer = tmp_path / "newer.safetensors"
    rewrite_safetensors_header(padim_file, newer, lambda h: h["__metadata__"].update(
        format_version=str(FORMAT_VERSION + 1)))
    with pytest.raises(ModelFileError, match="newer anomaly_hooks.*upgrade"):
        Detector.load(newer)
    for bogus in ("0", "-1", "abc", ""):
        odd = tmp_path / "odd.safetensors"
        rewrite_safetensors_header(padim_file, odd,
                       lambda h, v=bogus: h["__metadata__"].update(format_version=v))
        with pytest.raises(ModelFileError):
            Detector.load(odd)
    # the rewrite itself is sound: the same header rewritten with the current version loads
    same = tmp_path / "same.safetensors"
    rewrite_safetensors_header(padim_file, same, lambda h: None)
    assert Detector.load(same).is_fitted


def test_patchcore_file_refused_as_padim(patchcore_file, padim_file):
    with pytest.raises(ModelFileError, match="is a patchcore model, but a padim model"):
        Detector.load(patchcore_file, method="padim")
    with pytest.raises(ModelFileError, match="is a padim model, but a patchcore model"):
        Detector.load(padim_file, method="patchcore")
    assert Detector.load(patchcore_file, method="patchcore").is_fitted


def test_user_config_interpolations_are_stored_resolved(small_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("AH_MODELS", str(tmp_path))
    det = Detector.from_config({**small_cfg, "output": "${oc.env:AH_MODELS}/m.safetensors"})
    det.fit(textured_images(8), progress=False)
    _, meta = load_model(det.save(tmp_path / "m.safetensors"))
    assert meta["config"]["output"] == f"{tmp_path}/m.safetensors"


def test_stored_config_is_read_with_no_interpolation(padim_file, tmp_path, monkeypatch):
    """A stored config is plain values: a '${...}' in it (a forged file, or a literal string
    in the fitted config) stays text on load, never reads the environment or other keys."""
    monkeypatch.setenv("AH_SECRET", "leaked")
    tensors, meta = load_model(padim_file)
    meta["config"]["output"] = "${oc.env:AH_SECRET}/m.safetensors"
    meta["config"]["threshold"]["folder"] = "\\\\${threshold.quantile}"
    forged = save_model(tmp_path / "forged.safetensors", tensors, meta, version=2)
    det = Detector.load(forged)
    assert det.cfg.output == "${oc.env:AH_SECRET}/m.safetensors"
    assert det.cfg.threshold.folder == "\\\\${threshold.quantile}"
    resaved = Detector.load(det.save(tmp_path / "again.safetensors"))
    assert resaved.cfg.output == det.cfg.output
    assert resaved.cfg.threshold.folder == det.cfg.threshold.folder


def test_model_file_is_opened_once_and_survives_concurrent_replacement(padim_file, fitted,
                                                                       tmp_path):
    """Header and tensors come from one open file: replacing the file atomically while it is
    being loaded gives one version or the other, never a false 'checksum mismatch'."""
    det_b = Detector.from_config(fitted.cfg)
    det_b.fit(textured_images(12, seed=7), progress=False)
    versions = [padim_file.read_bytes(), det_b.save(tmp_path / "b.safetensors").read_bytes()]
    target = tmp_path / "m.safetensors"
    target.write_bytes(versions[0])
    stop = threading.Event()

    def replace_forever() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            tmp = tmp_path / f".m.{i}.tmp"
            tmp.write_bytes(versions[i % 2])
            os.replace(tmp, target)

    thread = threading.Thread(target=replace_forever)
    thread.start()
    try:
        for _ in range(40):
            tensors, meta = load_model(target)
            assert meta["threshold"]["value"] in (fitted.threshold_.value,
                                                   det_b.threshold_.value)
    finally:
        stop.set()
        thread.join()


# ---- damaged files -----------------------------------------------------------------------
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
                       ("png", png_bytes(good_rgb()))):
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(data)
        with pytest.raises(ModelFileError, match="not an anomaly_hooks model file|too short"):
            Detector.load(bad)


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


@pytest.mark.parametrize("edit, message", [
    (lambda h: h[_first_tensor(h)].update(shape=[2 ** 63]), "do not fit shape"),
    (lambda h: h[_first_tensor(h)].update(shape=[2 ** 40, 2 ** 40, 2 ** 40]),
     "do not fit shape"),
    (lambda h: h[_first_tensor(h)].update(shape=[1.5]), "malformed header entry"),
    (lambda h: h[_first_tensor(h)].update(shape=[True]), "malformed header entry"),
    (lambda h: h[_first_tensor(h)].update(data_offsets=["0", "4"]), "malformed header entry"),
    (lambda h: h.update(x=[[[[]]]]), "malformed header entry"),
    (lambda h: h["__metadata__"].update(format_version=7), "metadata values must be strings"),
])
def test_absurd_header_entries_are_model_file_errors(padim_file, tmp_path, edit, message):
    bad = tmp_path / "bad.safetensors"
    rewrite_safetensors_header(padim_file, bad, edit)
    with pytest.raises(ModelFileError, match=message) as err:
        load_model(bad)
    assert str(bad) in str(err.value)


def _first_tensor(header: dict) -> str:
    return next(k for k in sorted(header) if k != "__metadata__")


def test_deeply_nested_json_is_a_model_file_error(tmp_path):
    blob = (b"[" * 200_000 + b"]" * 200_000)
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    with pytest.raises(ModelFileError, match="header is not valid JSON"):
        load_model(path)
    meta = {"format": "anomaly_hooks", "format_version": "1",
            "meta": "[" * 100_000 + "]" * 100_000, "checksum": ""}
    tensors = {"x": torch.zeros(2)}
    meta["checksum"] = checksum(meta["meta"], tensors)
    save_file(tensors, str(tmp_path / "deep_meta.safetensors"), metadata=meta)
    with pytest.raises(ModelFileError, match="metadata is not valid JSON"):
        load_model(tmp_path / "deep_meta.safetensors")


def test_unreadable_or_odd_model_paths_are_model_file_errors(padim_file, tmp_path,
                                                             monkeypatch):
    with pytest.raises(ModelFileError, match=f"{tmp_path}: is a folder, not a model file"):
        load_model(tmp_path)
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ModelFileError, match=r"not a regular file \(a FIFO\), not a model file"):
        load_model(fifo)  # refused without opening: never blocks
    real_open = builtins.open

    def denied(file, *args, **kwargs):
        if str(file) == str(padim_file):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", denied)
    with pytest.raises(ModelFileError) as err:
        Detector.load(padim_file)
    assert str(err.value) == f"{padim_file}: cannot read the model file (Permission denied)"


# ---- forged files ------------------------------------------------------------------------
class _Payload:
    """Unpickling this creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _forge(path: Path, metadata: dict, tensors: dict | None = None) -> None:
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
    rewrite_safetensors_header(padim_file, files["extra_key"],
                   lambda h: h["__metadata__"].update(pickle=pickled_text))

    for name, path in files.items():
        with pytest.raises(ModelFileError) as err:
            Detector.load(path)
        assert str(path) in str(err.value), name
        assert main(["score", "--model", str(path), str(tmp_path), "--out",
                     str(tmp_path / "o")]) == 2, name
        one_error_line(capsys.readouterr().err)
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


@pytest.fixture(scope="module")
def kept_dense_file(small_cfg, tmp_path_factory) -> Path:
    """A dense PaDiM with an all-images threshold: it keeps its training embeddings."""
    det = Detector.from_config(small_cfg, padim__covariance="dense",
                               threshold__mode="all-images")
    det.fit(textured_images(8), progress=False)
    return det.save(tmp_path_factory.mktemp("kept") / "padim.safetensors")


@pytest.fixture(scope="module")
def legacy_kept_file(kept_dense_file, tmp_path_factory) -> Path:
    """The same model in format 2 (one checksum over every tensor, no digests)."""
    tensors, meta = load_model(kept_dense_file)
    return save_model(tmp_path_factory.mktemp("legacy") / "padim.safetensors", tensors, meta,
                      version=2)


def test_dense_file_keeps_its_embeddings(kept_dense_file):
    """The kept embeddings [P, n, D] come back as saved."""
    assert safetensors_header(kept_dense_file)[1]["__metadata__"]["format_version"] == "3"
    tensors, meta = load_model(kept_dense_file)
    det = Detector.load(kept_dense_file)
    samples = det.scorer_.gaussians.samples
    p, d = tensors["padim.mean"].shape
    assert tuple(samples.shape) == (p, 8, d)
    assert torch.equal(samples, tensors["padim.dense_samples"])
    assert det.scorer_.summary()["keeps_embeddings"] is True


@pytest.mark.parametrize("case", ["wrong_count", "float16"])
def test_forged_kept_embeddings_are_refused_on_load(case, kept_dense_file, tmp_path):
    tensors, meta = load_model(kept_dense_file)
    x = tensors["padim.dense_samples"]
    tensors["padim.dense_samples"] = x[:, :5].clone() if case == "wrong_count" else x.half()
    forged = save_model(tmp_path / "forged.safetensors", tensors, meta, version=2)
    with pytest.raises(ModelFileError) as err:
        Detector.load(forged).predict(textured_images(1)[0])
    assert "dense_samples" in str(err.value)


def test_kept_embeddings_come_with_the_fit_grouping_descriptors(small_cfg, tmp_path):
    """A model keeping its embeddings saves the descriptors its fit grouped the images by
    (an update groups with them); one that does not keeps none."""
    det = Detector.from_config(small_cfg, padim__covariance="dense",
                               threshold__mode="all-images").fit(textured_images(8),
                                                                 progress=False)
    desc = det.training_descriptors_
    assert desc.shape[0] == 8 and desc.dtype == np.float32
    tensors, _ = load_model(det.save(tmp_path / "kept.safetensors"))
    np.testing.assert_array_equal(tensors[DESCRIPTORS_TENSOR].numpy(), desc)
    np.testing.assert_array_equal(
        Detector.load(tmp_path / "kept.safetensors").training_descriptors_, desc)
    sums_only = Detector.from_config(small_cfg, padim__covariance="dense",
                                     padim__keep_embeddings=False,
                                     threshold__mode="all-images")
    sums_only.fit(textured_images(8), progress=False)
    assert sums_only.training_descriptors_ is None
    assert DESCRIPTORS_TENSOR not in load_model(sums_only.save(tmp_path / "s.safetensors"))[0]


@pytest.mark.parametrize("case", ["wrong_count", "float64", "one_dim"])
def test_forged_descriptors_are_refused_on_load(case, kept_dense_file, tmp_path):
    tensors, meta = load_model(kept_dense_file)
    d = tensors[DESCRIPTORS_TENSOR]
    tensors[DESCRIPTORS_TENSOR] = {"wrong_count": d[:5].clone(), "float64": d.double(),
                                   "one_dim": d.flatten()}[case]
    forged = save_model(tmp_path / "forged.safetensors", tensors, meta, version=2)
    with pytest.raises(ModelFileError, match="grouping.descriptors.*one row per training"):
        Detector.load(forged)


def _tensor_bytes(obj: object) -> int:
    """Bytes of the tensors an object holds as attributes."""
    return sum(v.nbytes for v in vars(obj).values() if isinstance(v, torch.Tensor))


def test_loaded_model_leaves_its_kept_embeddings_in_the_file(kept_dense_file):
    """Detector.load verifies the kept embeddings but holds only the means and factors: the
    embeddings are read from the file when asked for, the same bytes as saved."""
    full, _ = load_model(kept_dense_file)
    det = Detector.load(kept_dense_file)
    g = det.scorer_.gaussians
    stored = g.stored_samples
    assert g.keeps_samples and stored is not None
    assert stored.path == kept_dense_file.absolute() and stored.name == "padim.dense_samples"
    assert stored.checksum == modelfile.file_checksum(kept_dense_file)
    assert stored.nbytes == full["padim.dense_samples"].nbytes
    # what the scorer holds: the means and factors, none of the embeddings' bytes
    assert _tensor_bytes(g) == g.mean.nbytes + g.chol.nbytes
    assert _tensor_bytes(det.scorer_) < stored.nbytes
    assert torch.equal(g.samples, full["padim.dense_samples"])
    assert g.stored_samples is stored  # a read does not keep them
    with g.hold_samples():  # held for a span of work, left in the file again after it
        assert g.stored_samples is None and torch.equal(g.samples, full["padim.dense_samples"])
    assert g.stored_samples is stored


def test_streamed_checksum_equals_the_whole_tensor_checksum(legacy_kept_file, monkeypatch):
    """Format 2: a deferred tensor streams through the hash in chunks (here many, and a
    partial last one), kept tensors are hashed piece by piece behind their reading: the same
    checksum as hashing every tensor whole in one thread, the same tensors read back."""
    full, meta = load_model(legacy_kept_file)
    n, header = safetensors_header(legacy_kept_file)
    recorded = header["__metadata__"]["checksum"]
    assert modelfile.checksum(header["__metadata__"]["meta"], full) == recorded
    monkeypatch.setattr(modelfile, "READ_PIECE", 999)  # many pieces, a partial last one
    monkeypatch.setattr(modelfile, "HASH_CHUNK", 1000)  # not a divisor of the tensor's bytes
    pieces, _ = load_model(legacy_kept_file)  # verified against the recorded checksum
    assert set(pieces) == set(full) and all(torch.equal(pieces[k], full[k]) for k in full)
    lazy, meta_lazy = load_model(legacy_kept_file, defer={"padim.dense_samples", "no.such"})
    stored = lazy["padim.dense_samples"]
    assert isinstance(stored, modelfile.StoredTensor) and meta_lazy == meta
    assert stored.nbytes % 1000 and stored.nbytes > 10_000
    assert set(lazy) == set(full)
    assert all(torch.equal(lazy[k], full[k]) for k in full if k != "padim.dense_samples")
    assert torch.equal(stored.read(), full["padim.dense_samples"])


def _reads(monkeypatch) -> list:
    """The tensor names the model file reader reads bytes of, from now on (in order)."""
    names: list = []
    real = modelfile._read_into

    def spy(fh, key, *args, **kwargs):
        names.append(key)
        return real(fh, key, *args, **kwargs)

    monkeypatch.setattr(modelfile, "_read_into", spy)
    return names


def test_format_3_reads_only_what_is_kept(kept_dense_file, monkeypatch):
    """A tensor left in a format-3 file is not read at load; kept ones are read in pieces and
    each verified against its digest; the one left in the file reads back verified, into a
    buffer or whole, the same bytes as saved."""
    full, meta = load_model(kept_dense_file)
    monkeypatch.setattr(modelfile, "READ_PIECE", 999)  # many pieces, a partial last one
    names = _reads(monkeypatch)
    lazy, meta_lazy = load_model(kept_dense_file, defer={"padim.dense_samples", "no.such"})
    assert meta_lazy == meta and set(lazy) == set(full)
    assert "padim.dense_samples" not in names and "padim.chol" in names
    stored = lazy["padim.dense_samples"]
    assert stored.digest == modelfile.tensor_digest(stored.name, full[stored.name])
    assert stored.stamp is None  # each read verifies the digest: no stamp needed
    names.clear()
    assert torch.equal(stored.read(), full["padim.dense_samples"])
    assert set(names) == {"padim.dense_samples"}
    assert all(torch.equal(lazy[k], full[k]) for k in full if k != "padim.dense_samples")


@pytest.mark.parametrize("where", ["chol", "dense_samples"])
def test_damaged_tensor_of_a_format_3_file(where, kept_dense_file, tmp_path):
    """A flipped byte in a tensor that the load reads is a checksum error at load naming it;
    in the embeddings left in the file, the load succeeds, scoring is unaffected, and what
    reads them (an update, a save) is the same ModelFileError (loading again cannot help),
    writing nothing."""
    n, header = safetensors_header(kept_dense_file)
    begin, end = header[f"padim.{where}"]["data_offsets"]
    raw = bytearray(kept_dense_file.read_bytes())
    raw[8 + n + (begin + end) // 2] ^= 0x10
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    if where == "chol":
        with pytest.raises(ModelFileError, match=r"checksum mismatch \(padim.chol\)"):
            Detector.load(bad)
        return
    det = Detector.load(bad)
    image = textured_images(1)[0]
    np.testing.assert_array_equal(det.decision_function([image]),
                                  Detector.load(kept_dense_file).decision_function([image]))
    for attempt in (lambda: det.update(textured_images(2)),
                    lambda: det.save(tmp_path / "copy.safetensors")):
        with pytest.raises(ModelFileError,
                           match=r"checksum mismatch \(padim.dense_samples\).*restore") as err:
            attempt()
        assert not isinstance(err.value, ModelFileChangedError)
    assert not (tmp_path / "copy.safetensors").exists() and det.lineage_ == []


def test_damaged_kept_embeddings_are_a_checksum_error_at_load(legacy_kept_file, tmp_path):
    """Format 2: a flipped byte in the block left in the file is still caught by the load."""
    n, header = safetensors_header(legacy_kept_file)
    begin, end = header["padim.dense_samples"]["data_offsets"]
    raw = bytearray(legacy_kept_file.read_bytes())
    raw[8 + n + (begin + end) // 2] ^= 0x10
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match="checksum mismatch"):
        Detector.load(bad)


def test_settled_file_gives_the_embeddings_without_hashing_it_again(legacy_kept_file,
                                                                    tmp_path, monkeypatch):
    """Format 2: a file last changed well before the load is stamped (inode, size, times):
    while it is as stamped, a read takes the tensor alone, the same bytes as saved."""
    full, _ = load_model(legacy_kept_file)
    path = tmp_path / "m.safetensors"
    shutil.copy(legacy_kept_file, path)
    monkeypatch.setattr(modelfile, "SETTLED_NS", 0)  # as if copied long ago
    stored = Detector.load(path).scorer_.gaussians.stored_samples
    info = os.stat(path)
    assert stored.stamp == modelfile.FileStamp(info.st_dev, info.st_ino, info.st_size,
                                               info.st_mtime_ns, info.st_ctime_ns)

    def no_hash(*args, **kwargs):
        raise AssertionError("the whole file was hashed again")

    monkeypatch.setattr(modelfile, "_read_verified", no_hash)
    assert torch.equal(stored.read(), full["padim.dense_samples"])
    assert stored.at(legacy_kept_file, stored.checksum).stamp is None


def test_recently_changed_file_is_not_stamped(legacy_kept_file, tmp_path):
    """Format 2: a file changed less than SETTLED_NS before the load may change again within
    the same timestamp tick: no stamp, every read verifies the whole file."""
    path = tmp_path / "m.safetensors"
    shutil.copy(legacy_kept_file, path)
    stored = Detector.load(path).scorer_.gaussians.stored_samples
    assert stored.stamp is None
    assert torch.equal(stored.read(), load_model(path)[0]["padim.dense_samples"])


@pytest.mark.parametrize("settled", [False, True, None], ids=["recent", "settled", "format3"])
def test_embeddings_read_into_part_of_a_buffer(kept_dense_file, legacy_kept_file, settled,
                                               tmp_path, monkeypatch):
    """``StoredTensor.read(out)`` fills a strided view (the leading images of a larger sample
    buffer, staged a few rows at a time) with exactly what ``read()`` gives, through the
    digest-verified read (format 3), the stamped read (format 2, settled) and the fully
    verified one; a view of another shape, dtype or device is refused before anything is
    read."""
    if settled:
        monkeypatch.setattr(modelfile, "SETTLED_NS", 0)
    monkeypatch.setattr(modelfile, "READ_STAGE", 1000)  # several staged pieces
    path = tmp_path / "m.safetensors"
    # just written: not settled unless SETTLED_NS is 0
    shutil.copy(kept_dense_file if settled is None else legacy_kept_file, path)
    stored = Detector.load(path).scorer_.gaussians.stored_samples
    assert (stored.stamp is not None) == bool(settled)
    assert (stored.digest is not None) == (settled is None)
    whole = stored.read()
    p, n, d = whole.shape
    buf = torch.full((p, n + 3, d), -1.0)
    assert stored.read(buf[:, :n]).data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf[:, :n], whole, rtol=0, atol=0)
    assert bool((buf[:, n:] == -1).all())  # nothing written past the view
    for wrong in (buf[:, :n - 1], buf[:, :n].double(), torch.empty(0)):
        with pytest.raises(ValueError, match="cannot read"):
            stored.read(wrong)


@pytest.mark.parametrize("settled", [False, True, None], ids=["recent", "settled", "format3"])
@pytest.mark.parametrize("change", ["replaced", "modified", "modified-times-restored",
                                    "removed"])
def test_file_changed_after_load_is_refused_when_the_embeddings_are_read(
        change, settled, kept_dense_file, legacy_kept_file, dense_padim_file, tmp_path,
        monkeypatch):
    """The embeddings are read from the file the model was loaded from only while it is still
    that file: replaced (another model), modified in place (even with its modification time
    set back) or removed, reading them is a ModelFileChangedError saying to load the model
    again, whether the load stamped a format-2 file (settled) or not; in format 3 the header
    still names the model loaded, so bytes modified in place are damage: a checksum
    mismatch. The model still scores, and is left as it was."""
    path = tmp_path / "m.safetensors"
    shutil.copy(kept_dense_file if settled is None else legacy_kept_file, path)
    if settled:
        monkeypatch.setattr(modelfile, "SETTLED_NS", 0)
    det = Detector.load(path)
    assert (det.scorer_.gaussians.stored_samples.stamp is not None) == bool(settled)
    image = textured_images(1)[0]
    before = det.decision_function([image])
    time.sleep(0.05)  # past the file system's timestamp tick (a few ms)
    if change == "replaced":
        shutil.copy(dense_padim_file, path)
    elif change.startswith("modified"):  # the header (and its checksum) as it was, one byte
        info = os.stat(path)
        n, header = safetensors_header(path)
        begin = header["padim.dense_samples"]["data_offsets"][0]
        with open(path, "r+b") as fh:
            fh.seek(8 + n + begin)
            byte = fh.read(1)[0]
            fh.seek(8 + n + begin)
            fh.write(bytes([byte ^ 1]))
        if change.endswith("restored"):  # the status-change time still moves
            os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    else:
        path.unlink()
    damage = settled is None and change.startswith("modified")
    for attempt in (lambda: det.update(textured_images(2)),
                    lambda: det.save(tmp_path / "copy.safetensors"),
                    lambda: det.scorer_.training_embeddings()):
        with pytest.raises(ModelFileError, match="checksum mismatch" if damage
                           else "load the model again") as err:
            attempt()
        assert isinstance(err.value, ModelFileChangedError) != damage
        assert str(path.absolute()) in str(err.value)
    assert not (tmp_path / "copy.safetensors").exists()  # nothing incomplete written
    assert isinstance(err.value, ModelFileError)
    np.testing.assert_array_equal(det.decision_function([image]), before)  # scoring unaffected
    assert det.lineage_ == []  # the failed update left the model as it was


def test_resave_holds_the_embeddings_and_reads_from_the_new_file(kept_dense_file, tmp_path):
    """A loaded model saved again writes a complete file (the embeddings read from the loaded
    one); from then on they are read from the saved file: saved over the file it came from
    with another threshold, the model still reads them."""
    full, _ = load_model(kept_dense_file)
    path = tmp_path / "m.safetensors"
    shutil.copy(kept_dense_file, path)
    det = Detector.load(path)
    det.recalibrate(false_alarm_rate=0.2)  # another threshold: another checksum
    det.save(path)
    resaved, _ = load_model(path)
    assert torch.equal(resaved["padim.dense_samples"], full["padim.dense_samples"])
    stored = det.scorer_.gaussians.stored_samples
    assert stored.path == path.absolute() and stored.checksum == modelfile.file_checksum(path)
    assert torch.equal(det.scorer_.gaussians.samples, full["padim.dense_samples"])
    other = det.save(tmp_path / "other.safetensors")  # the same content elsewhere
    assert modelfile.file_checksum(other) == modelfile.file_checksum(path)
    assert det.scorer_.gaussians.stored_samples.path == other.absolute()


def test_model_fitted_in_memory_keeps_its_embeddings_in_memory(small_cfg, tmp_path):
    """Nothing to read back: a fitted model's embeddings stay in memory, saved or not."""
    det = Detector.from_config(small_cfg, padim__covariance="dense",
                               threshold__mode="all-images")
    det.fit(textured_images(8), progress=False)
    g = det.scorer_.gaussians
    samples = g.samples
    det.save(tmp_path / "m.safetensors")
    assert g.stored_samples is None and g.samples is samples


@pytest.mark.parametrize("case", ["chol_wrong_shape", "chol_int", "mean_float64",
                                  "lowrank_meta_on_dense_tensors"])
def test_forged_dense_file_with_valid_checksum_is_refused_on_load(case, dense_padim_file,
                                                                   tmp_path):
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
    assert one_error_line(capsys.readouterr().err).startswith(f"error: {forged}: {message}")


def test_deep_stored_config_is_a_model_file_error(padim_file, tmp_path):
    tensors, meta = load_model(padim_file)
    deep: list = []
    node = deep
    for _ in range(900):
        node.append([])
        node = node[0]
    meta["config"]["backbone"]["layers"] = deep
    forged = save_model(tmp_path / "deep.safetensors", tensors, meta, version=2)
    with pytest.raises(ModelFileError, match="inconsistent model file .*nested more than 32"):
        Detector.load(forged)


# ---- atomic saves ------------------------------------------------------------------------
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


# ---- fuzzing the reader ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_bytes(padim_file) -> bytes:
    return padim_file.read_bytes()


@fuzz_settings(60)
@given(ops=st.lists(mutation, min_size=1, max_size=4), in_header=st.booleans())
def test_fuzz_model_file_mutations(tiny_model_bytes, tmp_path, ops, in_header):
    raw = tiny_model_bytes
    if in_header:  # aim the mutations at the 8-byte prefix and the JSON header
        n = struct.unpack("<Q", raw[:8])[0]
        ops = [(op, pos % (8 + n), val) for op, pos, val in ops]
    mutated = mutate(raw, ops)
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


header_values = st.one_of(st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
                          st.text(max_size=8), st.none(), st.booleans(),
                          st.lists(st.integers(-5, 2 ** 64), max_size=4),
                          st.recursive(st.integers(0, 9), lambda c: st.lists(c, max_size=3),
                                       max_leaves=30))


@fuzz_settings(80)
@given(field=st.sampled_from(["dtype", "shape", "data_offsets", "entry", "metadata", "new"]),
       value=header_values, which=st.integers(0, 100))
@pytest.mark.slow
def test_fuzz_model_file_headers(padim_file, tmp_path, field, value, which):
    """JSON header mutations: a ModelFileError naming the file, or a model that loads and
    verifies; never another exception."""
    def edit(header: dict) -> None:
        names = sorted(k for k in header if k != "__metadata__")
        name = names[which % len(names)]
        if field == "entry":
            header[name] = value
        elif field == "metadata":
            keys = sorted(header["__metadata__"])
            header["__metadata__"][keys[which % len(keys)]] = value
        elif field == "new":
            header[f"extra{which}"] = value
        else:
            header[name][field] = value

    bad = tmp_path / "fuzz.safetensors"
    rewrite_safetensors_header(padim_file, bad, edit)
    try:
        load_model(bad)
    except ModelFileError as exc:
        assert str(bad) in str(exc)


hex_digest = st.text("0123456789abcdefABCDEF", min_size=63, max_size=65)


@fuzz_settings(80)
@given(digests=st.one_of(
    st.dictionaries(st.text(max_size=12), st.one_of(hex_digest, header_values), max_size=6),
    header_values), keep_names=st.booleans(), raw=st.one_of(st.none(), st.text(max_size=20)))
def test_fuzz_format_3_digests(padim_file, tmp_path, digests, keep_names, raw):
    """A forged ``digests`` entry (any JSON, or the file's tensor names with any values, or
    text that is not JSON): a ModelFileError naming the file, never another exception, and
    never a model loaded from digests other than the ones written."""
    def edit(header: dict) -> None:
        meta = header["__metadata__"]
        value = digests
        if keep_names and isinstance(digests, dict):
            names = sorted(k for k in header if k != "__metadata__")
            value = {n: list(digests.values())[i % len(digests)] if digests else "0" * 64
                     for i, n in enumerate(names)}
        meta["digests"] = raw if raw is not None else json.dumps(value)

    bad = tmp_path / "fuzz.safetensors"
    rewrite_safetensors_header(padim_file, bad, edit)
    with pytest.raises(ModelFileError) as err:
        load_model(bad)
    assert str(bad) in str(err.value)
