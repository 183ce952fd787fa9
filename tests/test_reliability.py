"""Reliability suite: bad images, damaged/hostile model files, atomic saves under SIGKILL,
thread-safe prediction, determinism, config errors, the memory guard, and fuzzing of the image
and model-file readers.

Everything runs on CPU with a random-init ResNet18 and small inputs (see conftest.small_cfg);
every file lives under tmp_path.
"""
from __future__ import annotations

import functools
import io
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


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


# =========================================================================================
# 2. model files
# =========================================================================================


# =========================================================================================
# 3. atomic saves
# =========================================================================================


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


