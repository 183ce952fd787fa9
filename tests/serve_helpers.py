"""Helpers for the service tests: image payloads (good, defective, hostile), model files, the app
in process (``serving``) and a real uvicorn server in a subprocess on a free loopback port, a
stand-in drift monitor."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest
from conftest import ROOT, textured_images, with_defect
from PIL import Image

TOKEN = "s3cret-token-for-tests"


# ---- payloads -------------------------------------------------------------------------------
def encode(arr: np.ndarray, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(arr)
    if fmt == "JPEG" and kw.pop("cmyk", False):
        img = img.convert("CMYK")
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def good_png(seed: int = 100) -> bytes:
    return encode(textured_images(1, seed=seed)[0])


def defect_png(seed: int = 100) -> bytes:
    return encode(with_defect(textured_images(1, seed=seed)[0]))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def png_bomb(width: int = 40000, height: int = 40000) -> bytes:
    """A tiny PNG whose header declares width x height RGB pixels (a decompression bomb)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    row = b"\x00" + b"\x00" * (3 * width)
    idat = zlib.compress(row * 4, 9)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat)
            + _chunk(b"IEND", b""))


def png_huge_text(size: int = 4 << 20) -> bytes:
    """A valid small PNG with a huge compressed text chunk before the pixels."""
    base = good_png()
    text = _chunk(b"zTXt", b"comment\x00\x00" + zlib.compress(b"A" * size, 9))
    return base[:33] + text + base[33:]  # after the signature and IHDR


def jpeg_bomb() -> bytes:
    """A JPEG whose frame header declares 60000 x 60000 pixels."""
    data = bytearray(encode(textured_images(1)[0], "JPEG"))
    i = 2
    while i < len(data):
        marker = data[i + 1]
        length = struct.unpack(">H", data[i + 2:i + 4])[0]
        if marker in (0xC0, 0xC1, 0xC2):
            data[i + 5:i + 9] = struct.pack(">HH", 60000, 60000)
            return bytes(data)
        i += 2 + length
    raise AssertionError("no SOF marker")


def corrupt_jpeg() -> bytes:
    data = bytearray(encode(textured_images(1)[0], "JPEG"))
    for i in range(len(data) // 3, len(data) - 2):
        data[i] = (data[i] * 7 + 13) % 256 if data[i] != 0xFF else 0x00
    return bytes(data[:len(data) // 2])


def png16() -> bytes:
    arr = (textured_images(1)[0][..., 0].astype(np.uint16) * 257)
    buf = io.BytesIO()
    img = Image.fromarray(arr)
    assert img.mode.startswith("I;16"), img.mode
    img.save(buf, "PNG")
    return buf.getvalue()


def gif() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(textured_images(1)[0]).save(buf, "GIF")
    return buf.getvalue()


def cut_jpeg_with_end_marker() -> bytes:
    """The first half of a noisy JPEG plus an end marker: Pillow alone decodes it (the rest
    grey) without an error; libjpeg's strict check refuses it."""
    noise = np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    raw = encode(noise, "JPEG", quality=90)
    return raw[:len(raw) // 2] + b"\xff\xd9"


def tiff_of(arr: np.ndarray, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode=mode).save(buf, "TIFF")
    return buf.getvalue()


def hostile_payloads() -> Dict[str, tuple]:
    """name -> (bytes, expected status, expected code)."""
    return {
        "empty": (b"", 400, "empty_body"),
        "text": (b"hello, this is not an image", 415, "unsupported_media_type"),
        "gif": (gif(), 415, "unsupported_media_type"),
        "truncated_png": (good_png()[:500], 400, "unreadable_image"),
        "corrupt_jpeg": (corrupt_jpeg(), 400, "unreadable_image"),
        "png_bomb": (png_bomb(), 413, "too_many_pixels"),
        "png_over_limit": (png_bomb(6000, 6000), 413, "too_many_pixels"),
        "jpeg_bomb": (jpeg_bomb(), 413, "too_many_pixels"),
        "png_huge_text": (png_huge_text(), 400, "unreadable_image"),
        "png_header_only": (good_png()[:33], 400, "unreadable_image"),
        "bmp_garbage": (b"BM" + os.urandom(200), 400, "unreadable_image"),
        "tiff_garbage": (b"II*\x00" + os.urandom(300), 400, "unreadable_image"),
        # the hardened reader's refusals, reached through an upload
        "jpeg_cut_with_end_marker": (cut_jpeg_with_end_marker(), 400, "unreadable_image"),
        "tiff_int32": (tiff_of(np.full((8, 8), 70000, np.int32), "I"), 400, "unreadable_image"),
        "tiff_float_255": (tiff_of(np.full((8, 8), 200.0, np.float32), "F"), 400,
                           "unreadable_image"),
        "jpeg_padded": (encode(textured_images(1)[0], "JPEG") + b"\x00" * (17 << 20), 400,
                        "unreadable_image"),
    }


def accepted_formats() -> Dict[str, bytes]:
    """Every accepted type (and odd modes): each must be scored (200)."""
    img = textured_images(1, seed=7)[0]
    return {
        "png": encode(img), "jpeg": encode(img, "JPEG", quality=90),
        "jpeg_cmyk": encode(img, "JPEG", cmyk=True), "tiff": encode(img, "TIFF"),
        "bmp": encode(img, "BMP"), "webp": encode(img, "WEBP", quality=90),
        "png16": png16(), "gray": encode(img[..., 0]),
    }


# ---- model files ----------------------------------------------------------------------------
def save_model_variant(det, path: Path, threshold_factor: float = 1.0) -> Path:
    """Save ``det`` (optionally with its threshold scaled: a different model file)."""
    original = det.threshold_
    try:
        if threshold_factor != 1.0:
            det.threshold_ = dataclasses.replace(original, value=original.value * threshold_factor)
        det.save(path)
    finally:
        det.threshold_ = original
    return Path(path)


def with_lineage(src: Path, dst: Path, lineage) -> Path:
    """A copy of the model file ``src`` whose metadata records ``lineage`` (as
    ``anomaly-hooks update`` writes it), checksummed as a valid model file."""
    from anomaly_hooks.modelfile import load_model, read_header, save_model

    tensors, meta = load_model(src)
    version = int(read_header(Path(src))["__metadata__"]["format_version"])
    return save_model(dst, tensors, {**meta, "lineage": lineage}, version=version)


def model_variants(det, root: Path) -> Dict[str, Path]:
    """The model files the service tests load: ``good``, ``strict`` (threshold x3: another
    file), ``damaged`` (64 bytes of tensor data zeroed: the checksum fails) and ``text``."""
    good = save_model_variant(det, root / "model.safetensors")
    strict = save_model_variant(det, root / "strict.safetensors", threshold_factor=3.0)
    damaged = root / "damaged.safetensors"
    raw = bytearray(good.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = b"\x00" * 64
    damaged.write_bytes(bytes(raw))
    text = root / "notes.txt"
    text.write_text("not a model")
    return {"good": good, "strict": strict, "damaged": damaged, "text": text}


@pytest.fixture(scope="module")
def models(fitted, tmp_path_factory) -> Dict[str, Path]:
    """:func:`model_variants` of the fitted detector (a test module takes it as a fixture with
    ``models = serve_helpers.models``)."""
    return model_variants(fitted, tmp_path_factory.mktemp("serve_models"))


# ---- the results log ---------------------------------------------------------------------------
@contextlib.contextmanager
def write_locked(path) -> Iterator[sqlite3.Connection]:
    """Another connection holds the SQLite log's write lock for the block (as a program
    writing to it by hand would)."""
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield other
        other.execute("ROLLBACK")
    finally:
        other.close()


@contextlib.contextmanager
def locked_by_another_process(path) -> Iterator[subprocess.Popen]:
    """Another process holds ``BEGIN EXCLUSIVE`` on the SQLite file at ``path`` (creating it
    when missing, as any SQLite program does) for the block, as the sqlite3 shell or a second
    service stuck in a transaction would; the lock is released when the block ends."""
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sqlite3, sys\n"
         "con = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
         "con.execute('BEGIN EXCLUSIVE')\n"
         "print('held', flush=True)\n"
         "sys.stdin.read()\n"
         "con.execute('ROLLBACK')\n", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held", "the holder did not take the lock"
        yield holder
    finally:
        holder.stdin.close()  # end of input: the holder rolls back and exits
        holder.wait(30)


# ---- the app in process ---------------------------------------------------------------------
@contextlib.contextmanager
def serving(model: Path, tmp_path: Path, monitor=None, wait: bool = True, store=None, **kw
            ) -> Iterator[Tuple[Any, Any]]:
    """The real app (real batcher, model and SQLite results log) around FastAPI's TestClient;
    the client sends the token when one is set. ``kw``: :class:`ServeSettings` fields.
    ``monitor``: a drift monitor object, or a ``--monitor`` spec (``"auto"``: the one the
    service builds from the model file); ``store``: a results store opened by the test."""
    from fastapi.testclient import TestClient

    from anomaly_hooks.serve import ServeSettings, create_app

    if isinstance(monitor, str):
        kw["monitor"], monitor = monitor, None

    kw.setdefault("results_dir", str(tmp_path / "results"))
    settings = ServeSettings(model=str(model), token=kw.pop("token", None), **kw)
    app = create_app(settings, monitor=monitor, store=store)
    with TestClient(app, raise_server_exceptions=False) as client:
        if settings.token:
            client.headers["Authorization"] = f"Bearer {settings.token}"
        if wait:
            wait_ready(client)
        yield client, app.state.service


def wait_ready(client, timeout: float = 120.0) -> None:
    """Until ``/readyz`` answers 200 (the model loads in the background)."""
    deadline = time.monotonic() + timeout
    while (r := client.get("/readyz")).status_code != 200:
        assert time.monotonic() < deadline, r.json()
        time.sleep(0.05)


def assert_error(response, status: int, code: str) -> dict:
    """The response is the service's JSON error with this status and code; its body."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["code"] == code and body["status"] == status and body["message"], body
    assert set(body) == {"code", "status", "message"}, body
    return body


def hold_inference(service) -> threading.Event:
    """Make the current model's inference wait for the returned event."""
    event = threading.Event()
    engine = service.engine
    original = engine.infer

    def held(tensors, **kw):
        event.wait(60)
        return original(tensors, **kw)

    engine.infer = held
    return event


# ---- a real server --------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``anomaly-hooks serve`` (the documented command, through ``python -m anomaly_hooks.cli``)
    on a free loopback port, in its own process group."""

    def __init__(self, model: Path, workdir: Path, *args: str, env: Optional[dict] = None,
                 ready_timeout: float = 180.0, launcher: Optional[List[str]] = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(workdir) / f"server_{self.port}.log"
        self._log = open(self.log_path, "w")
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        # launcher: what runs the CLI (default: this Python's ``-m anomaly_hooks.cli``)
        command = launcher or [sys.executable, "-m", "anomaly_hooks.cli"]
        self.proc = subprocess.Popen(
            [*command, "serve", "--model", str(model), "--port", str(self.port), *args],
            cwd=workdir, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
            start_new_session=True)
        self.ready_timeout = ready_timeout

    def wait_ready(self) -> "ServerProcess":
        import httpx

        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {self.ready_timeout} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        """SIGTERM (graceful), then wait; the exit status (uvicorn re-raises the signal after a
        graceful shutdown, so -15 is a clean stop too)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- a stand-in drift monitor ---------------------------------------------------------------
class StandInMonitor:
    """What the service needs from a drift monitor: observe(batch) and status() -> dict."""

    def __init__(self) -> None:
        self.batches: List = []
        self.scores: List[float] = []

    def observe(self, batch) -> None:
        self.batches.append(batch)
        self.scores.extend(float(s) for s in batch.scores)

    def status(self) -> dict:
        n = len(self.scores)
        mean = float(np.mean(self.scores)) if n else 0.0
        return {"state": "ok" if n < 1000 else "drift", "message": f"{n} images observed",
                "observed": n, "statistics": {"score_mean": mean, "shifted": False}}


def standin_factory(detector) -> StandInMonitor:
    """``--monitor serve_helpers:standin_factory`` in the subprocess tests."""
    return StandInMonitor()


def monitor_refusing_huge_thresholds(detector):
    """A ``--monitor`` factory for the reload tests: the default (auto) monitor, but refused for
    a model whose threshold is above 1e6 (a variant saved with ``threshold_factor=1e9``)."""
    from anomaly_hooks.monitor.service import build_auto

    if detector.threshold_.value > 1e6:
        raise ValueError("this test factory refuses thresholds above 1e6")
    return build_auto(detector)
