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
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    rewrite_safetensors_header,
    safetensors_header,
    textured_images,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from PIL import Image

from anomaly_hooks.cli import main

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


# =========================================================================================
# 3. atomic saves
# =========================================================================================


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


