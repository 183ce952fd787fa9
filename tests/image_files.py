"""Image files for the tests of the readers, the fit and the command line: encoded bytes, PNGs
built chunk by chunk without holding the decoded image (bombs, huge images), damaged files."""
from __future__ import annotations

import functools
import io
import struct
import zlib
from pathlib import Path

import numpy as np
from conftest import textured_images
from PIL import Image


def png_bytes(arr_or_img, **kw) -> bytes:
    """A PNG of a uint8/uint16 array or a PIL image."""
    img = arr_or_img if isinstance(arr_or_img, Image.Image) else Image.fromarray(arr_or_img)
    buf = io.BytesIO()
    img.save(buf, "PNG", **kw)
    return buf.getvalue()


def jpeg_bytes(arr: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def png_chunk(tag: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + tag + data
            + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))


@functools.lru_cache(maxsize=None)
def bomb_png(width: int = 20_000, height: int = 20_000) -> bytes:
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
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr)
            + png_chunk(b"IDAT", b"".join(parts)) + png_chunk(b"IEND", b""))


def rgb_png(width: int, height: int) -> bytes:
    """A valid 8-bit RGB PNG (a colour ramp per row), built without holding the image."""
    comp = zlib.compressobj(1)
    parts = []
    for y in range(height):
        row = bytes([0]) + bytes([(y * 7) % 256, 128, (y * 3) % 256]) * width
        parts.append(comp.compress(row))
    parts.append(comp.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr)
            + png_chunk(b"IDAT", b"".join(parts)) + png_chunk(b"IEND", b""))


def good_rgb(h: int = 40, w: int = 48, seed: int = 0) -> np.ndarray:
    return textured_images(1, size=(h, w), seed=seed)[0]


def noise(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Uniform uint8 RGB noise (incompressible: a JPEG of it is long)."""
    return (np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8)


def cut_jpeg(arr: np.ndarray) -> bytes:
    """A JPEG cut at half its length, an end-of-image marker appended (Pillow alone decodes it
    at full size, the lower half grey, without an error)."""
    raw = jpeg_bytes(arr)
    return raw[: len(raw) // 2] + b"\xff\xd9"


def make_bad_files(folder: Path) -> dict[str, Path]:
    """Unreadable 'images', each a different way of being broken."""
    folder.mkdir(parents=True, exist_ok=True)
    good_png = png_bytes(good_rgb())
    good_jpg = jpeg_bytes(good_rgb())
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
    bad["bomb"].write_bytes(bomb_png())
    return bad


def write_good(folder: Path, n: int, size=(96, 112), seed: int = 0) -> list[Path]:
    """``n`` textured PNGs ``good_000.png``... in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, arr in enumerate(textured_images(n, size=size, seed=seed)):
        p = folder / f"good_{i:03d}.png"
        p.write_bytes(png_bytes(arr))
        out.append(p)
    return out
