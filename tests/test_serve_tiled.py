"""The service with a tiled (high-resolution) model, through a real server: a 12 MP upload
(4000 x 3000 JPEG, of another aspect than the training images: letterboxed in the working
frame) within the default upload and pixel limits, its verdict and anomalous pixels in the
caller's frame as the library gives them, and the server's memory peak raised by less than two
full-size float32 copies of the image: an image of at most ``images.FULL_DECODE_PIXELS`` is
decoded at full resolution (the canonical float32 copy, 144 MB here, with the decoder's uint8
one), then the full-size heatmap for the pixel count (48 MB) -- measured 220-240 MB. The PyTorch
engine (``.safetensors``) and the ONNX engine (``.onnx``, in a process where ``import torch``
fails) both serve it."""
from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import pytest
from conftest import TILED_SIZE, backbone_rtol, textured_images, tiled_cfg
from PIL import Image

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
httpx = pytest.importorskip("httpx", reason="httpx is not installed")

from serve_helpers import ServerProcess  # noqa: E402

BIG = (3000, 4000)  # (H, W): 12 MP, aspect 4:3 (the training images': 3:2)
FLOAT32_IMAGE = BIG[0] * BIG[1] * 3 * 4  # bytes of one full-size float32 RGB copy
PEAK_LIMIT = 2 * FLOAT32_IMAGE  # see the module's docstring


@pytest.fixture(scope="module")
def tiled_files(tmp_path_factory):
    """(the fitted tiled PatchCore detector, its .safetensors, its .onnx, the 12 MP JPEG with
    a stain, a small good PNG of the training aspect)."""
    from anomaly_hooks import Detector

    root = tmp_path_factory.mktemp("serve_tiled")
    det = Detector.from_config(tiled_cfg()).fit(textured_images(8, size=TILED_SIZE),
                                                progress=False)
    big = textured_images(1, size=BIG, seed=31)[0]
    big[1200:1800, 1600:2200] = [250, 40, 30]  # about 19 frame pixels wide
    buf = io.BytesIO()
    Image.fromarray(big).save(buf, format="JPEG", quality=90)
    jpeg = root / "big.jpg"
    jpeg.write_bytes(buf.getvalue())
    small = root / "small.png"
    Image.fromarray(textured_images(1, size=TILED_SIZE, seed=32)[0]).save(small)
    pytest.importorskip("onnx", reason="the [export] extra is not installed")
    from anomaly_hooks.export import export_onnx

    return (det, det.save(root / "t.safetensors"), export_onnx(det, root / "t.onnx"), jpeg,
            small)


def memory_kb(pid: int) -> dict:
    """VmRSS and VmHWM (the peak) of a process, kB."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in lines)
            if k in ("VmRSS", "VmHWM")}


def post_big(server: ServerProcess, jpeg: Path) -> tuple[dict, int]:
    """The 12 MP upload's answer and how far it raised the server's memory peak (bytes)."""
    before = memory_kb(server.proc.pid)
    with httpx.Client(base_url=server.url, timeout=300) as client:
        r = client.post("/v1/predict", content=jpeg.read_bytes(), params={"heatmap": "png"})
    assert r.status_code == 200, r.text
    after = memory_kb(server.proc.pid)
    return r.json(), 1024 * (after["VmHWM"] - max(before["VmHWM"], before["VmRSS"]))


def check_answer(body: dict, ref, rtol: float) -> None:
    """The server's verdict on the 12 MP image against the library's prediction ``ref``."""
    assert abs(body["score"] - ref.score) <= rtol * ref.score
    assert body["is_anomalous"] and ref.is_anomalous
    assert ref.heatmap.shape == BIG  # the caller's frame
    # the anomalous pixels are counted on the full-size heatmap
    assert abs(body["anomalous_pixels"] - int(ref.mask.sum())) <= 0.01 * ref.mask.sum()
    overlay = Image.open(io.BytesIO(base64.b64decode(body["overlay_png"])))
    assert overlay.size == (1024, 768)  # the overlay's long side limit, the image's aspect


@pytest.mark.slow
def test_a_12_megapixel_upload_to_a_tiled_model(tiled_files, tmp_path):
    det, saved, _, jpeg, small = tiled_files
    assert jpeg.stat().st_size < 20 * 1024 * 1024  # within the default upload limit
    with ServerProcess(saved, tmp_path) as server:
        body, raised = post_big(server, jpeg)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            info = client.get("/v1/model").json()
            r = client.post("/v1/predict", content=small.read_bytes())
        assert r.status_code == 200 and not r.json()["is_anomalous"]
    assert info["input_size"] == [96, 144]
    check_answer(body, det.predict(str(jpeg)), backbone_rtol())
    assert raised < PEAK_LIMIT, f"the upload raised the peak by {raised / 1e6:.0f} MB"


@pytest.mark.slow
def test_a_12_megapixel_upload_to_a_tiled_onnx_model_without_torch(tiled_files, tmp_path):
    """``serve --model tiled.onnx`` where ``import torch`` fails: the runtime's prediction,
    to the last bit (one image per session run on both sides)."""
    from test_serve_edge import LAUNCHER, blocked_env

    from anomaly_hooks.runtime import OnnxDetector
    from anomaly_hooks.serve.engine_onnx import PREPROCESS

    _, _, path, jpeg, _ = tiled_files
    env = blocked_env(tmp_path)
    with ServerProcess(path, tmp_path, env=env,
                       launcher=[sys.executable, "-c", LAUNCHER]) as server:
        body, raised = post_big(server, jpeg)
    # the engine's preprocessing (Pillow's resize), as the service runs it: the same input bits
    ref = OnnxDetector.load(path, preprocess_method=PREPROCESS).predict(str(jpeg))
    check_answer(body, ref, 0.0)
    assert raised < PEAK_LIMIT, f"the upload raised the peak by {raised / 1e6:.0f} MB"
    assert not Path(env["EDGE_TORCH_LOG"]).exists(), "the server imported torch"
