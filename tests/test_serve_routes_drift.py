"""``GET /v1/drift`` (routes/drift.py): the monitor's status, and what the monitor sees of each
batch (the scoring pass's layer channel means); degenerate images and non-finite scores kept
from breaking its window."""
from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
import serve_helpers  # noqa: E402
import test_monitor  # noqa: E402
from conftest import f32_tol  # noqa: E402
from serve_helpers import StandInMonitor, encode, good_png, serving  # noqa: E402

models = serve_helpers.models
monitored = test_monitor.monitored  # a fitted detector with a drift reference (a fixture)


def test_drift_endpoint(models, tmp_path):
    with serving(models["good"], tmp_path / "a", monitor=StandInMonitor()) as (client, service):
        client.post("/v1/predict", content=good_png(12))
        status = client.get("/v1/drift").json()
        assert status["enabled"] is True and status["state"] == "ok" and status["observed"] >= 1
        # the monitor's own keys come through as they are
        assert set(status["statistics"]) == {"score_mean", "shifted"}
        # the monitor sees each tapped layer's per-image channel means from the same forward pass
        monitor = service.monitor.monitor
        batch = monitor.batches[-1]
        det = service.engine.detector
        assert list(batch.features) == det.layers
        for info in det.layer_info:
            means = batch.features[info.name]
            assert means.dtype == np.float32 and means.shape == (len(batch.scores), info.channels)
        reference = det.extractor(batch.inputs)  # a second forward pass, only in the test
        for name, feat in reference.items():
            # the same forward pass, then two float32 means of h * w values: n * F32_EPS times
            # the mean of their magnitudes
            hw = feat.shape[2] * feat.shape[3]
            np.testing.assert_allclose(batch.features[name], feat.mean(dim=(2, 3)).numpy(),
                                       rtol=0,
                                       atol=f32_tol(hw, float(feat.abs().mean((2, 3)).max())))
    with serving(models["good"], tmp_path / "b") as (plain, _):
        assert plain.get("/v1/drift").json() == {"enabled": False}
        assert 'anomaly_hooks_drift_enabled{model="default"} 0.0' in plain.get("/metrics").text


def _degenerate() -> dict:
    """Images a camera can send that carry (almost) no signal."""
    from PIL import Image

    def png(img: Image.Image) -> bytes:
        import io

        buf = io.BytesIO()
        img.save(buf, "PNG")
        return buf.getvalue()

    checker = (np.indices((96, 112)).sum(axis=0) % 2 * 255).astype(np.uint8)
    return {
        "black": encode(np.zeros((96, 112, 3), np.uint8)),
        "white": encode(np.full((96, 112, 3), 255, np.uint8)),
        "one_pixel": encode(np.full((1, 1, 3), 128, np.uint8)),
        "one_row": encode(np.full((1, 4000, 3), 200, np.uint8)),
        "one_column": encode(np.full((4000, 1, 3), 50, np.uint8)),
        "checkerboard": encode(np.stack([checker] * 3, axis=-1)),
        "gray_constant": encode(np.full((96, 112), 77, np.uint8)),
        "transparent_rgba": png(Image.new("RGBA", (112, 96), (0, 0, 0, 0))),
        "sixteen_bit_max": png(Image.fromarray(np.full((96, 112), 65535, np.uint16))),
    }


def test_degenerate_images_keep_the_drift_window_answering(monitored, tmp_path):
    """Uniform, one-pixel, one-row, checkerboard, transparent, 16-bit saturated images into
    the default drift monitor's window: each scored, /v1/drift and /metrics answer 200 with
    JSON (no NaN in it), and a good image is scored after them."""
    import json

    from anomaly_hooks.monitor.service import build_auto

    det, path = monitored
    with serving(path, tmp_path, monitor=build_auto(det), results_dir=None,
                 max_batch=4) as (client, service):
        for name, data in _degenerate().items():
            r = client.post("/v1/predict", content=data)
            assert r.status_code == 200, (name, r.text)
        files = [("files", (f"{n}.png", d)) for n, d in _degenerate().items()][:4]
        assert client.post("/v1/predict/batch", files=files).status_code == 200
        deadline = time.monotonic() + 30
        while service.monitor.observed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        drift = client.get("/v1/drift")
        assert drift.status_code == 200 and drift.json()["enabled"] is True, drift.text
        json.loads(drift.text, parse_constant=lambda c: pytest.fail(f"{c} in /v1/drift"))
        assert client.get("/metrics").status_code == 200
        assert client.post("/v1/predict", content=good_png(3)).status_code == 200


def test_non_finite_scores_stay_out_of_the_drift_window(models, tmp_path):
    """Images the model gives a NaN score are no verdicts (500); the monitor never sees them,
    while the finite images of the same batch reach it."""
    from test_serve_faults import BLACK, scores_poisoned, uniform

    monitor = StandInMonitor()
    with serving(models["good"], tmp_path, monitor=monitor, results_dir=None) as (client,
                                                                                   service):
        with scores_poisoned(service, float("nan"), only=uniform):
            files = [("files", ("black.png", BLACK)), ("files", ("good.png", good_png(5)))]
            body = client.post("/v1/predict/batch", files=files).json()
            assert body["failed"] == 1, body
            assert client.post("/v1/predict", content=BLACK).status_code == 500
        deadline = time.monotonic() + 30
        while len(monitor.scores) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        assert monitor.scores and all(np.isfinite(monitor.scores)), monitor.scores
