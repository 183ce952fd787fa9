"""Hardening for a service (issue 12): hostile files, output paths, memory per image, config and
model-file edges. Each test names the issue item it covers and checks the exact message or exit
code promised. Everything runs on the CPU with a random-init ResNet18 (conftest.small_cfg).
"""
from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from PIL import Image

FUZZ = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def _jpeg_bytes(arr: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def _noise(h: int, w: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8)


def _cut_jpeg(arr: np.ndarray) -> bytes:
    """The issue's case: a JPEG cut at half its length, an end-of-image marker appended."""
    raw = _jpeg_bytes(arr)
    return raw[: len(raw) // 2] + b"\xff\xd9"


@pytest.fixture(scope="module")
def model_file(fitted, tmp_path_factory) -> Path:
    return fitted.save(tmp_path_factory.mktemp("model") / "padim.safetensors")


def _error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


# =========================================================================================
# Failed 1: score output names stay inside --out, unique, never absolute, never ".."
# =========================================================================================


# =========================================================================================
# Failed 2: a corrupt JPEG (cut, end marker appended) is refused, not scored grey
# =========================================================================================


# =========================================================================================
# Failed 3: memory per image is bounded (reduced decoding of huge images)
# =========================================================================================
def _rgb_png(width: int, height: int) -> bytes:
    """A valid 8-bit RGB PNG (a colour ramp per row), built without holding the image."""
    comp = zlib.compressobj(1)
    parts = []
    for y in range(height):
        row = bytes([0]) + bytes([(y * 7) % 256, 128, (y * 3) % 256]) * width
        parts.append(comp.compress(row))
    parts.append(comp.flush())

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"".join(parts)) \
        + chunk(b"IEND", b"")


# The child reports its own high-water mark (VmHWM, reset by exec) at exit: wait4's ru_maxrss


# =========================================================================================
# Failed 4 and 5: 16-bit and float files scaled by type, one rule for files and arrays
# =========================================================================================


# =========================================================================================
# Failed 6: array subclasses (np.matrix crashed the process)
# =========================================================================================


# =========================================================================================
# Failed 7: deeply nested configs are refused before the YAML parser
# =========================================================================================


# =========================================================================================
# Weak: config values
# =========================================================================================


# =========================================================================================
# Weak: model files
# =========================================================================================


# =========================================================================================
# Weak: backbone weights of another architecture
# =========================================================================================


# =========================================================================================
# Weak: command line outputs (writability, atomic results, spreadsheet formulas)
# =========================================================================================


# =========================================================================================
# Weak: non-regular files (FIFOs, devices) and odd names
# =========================================================================================


# =========================================================================================
# Weak: tensors that hold no ordinary data
# =========================================================================================


# =========================================================================================
# Weak: close() while other threads predict
# =========================================================================================


# =========================================================================================
# Weak: identical training images
# =========================================================================================


