"""The drift monitor in the inspection service: the default factory (``--monitor auto``),
``observe(ObservedBatch)`` / ``status()``, and an injected drift showing up in ``/v1/drift``
and ``/metrics`` of a real server process."""
from __future__ import annotations

import io
import time

import numpy as np
import pytest
import test_monitor
from conftest import backbone_rtol, textured_images

from anomaly_hooks.errors import NotFittedError
from anomaly_hooks.monitor.service import ServiceMonitor, build, build_auto

monitored = test_monitor.monitored  # the fitted detector with a drift reference (a fixture)


def _png(img: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def _observed(det, images, model_id="m1"):
    """An ObservedBatch as the service builds it (inputs, scores, layer channel means)."""
    import torch

    from anomaly_hooks.data import load_preprocessed
    from anomaly_hooks.serve.monitoring import ObservedBatch

    inputs = torch.stack([load_preprocessed(i, det.preprocessor, det.cfg.data.max_pixels)[0]
                          for i in images])
    features: dict = {}
    scores = det.infer(inputs, taps=features).scores.numpy()
    pre = det.preprocessor
    return ObservedBatch(inputs=inputs, scores=scores, normalized_scores=scores * 0,
                         is_anomalous=scores > det.threshold_.value,
                         threshold=det.threshold_.value, model_id=model_id, mean=pre.mean,
                         std=pre.std, timestamp=time.time(), features=features)


def test_service_monitor_sees_what_the_detector_monitor_sees(monitored):
    """observe(ObservedBatch) gives the same statistics as the detector's own monitor seam
    (the service's layer channel means are the reference's layer statistics)."""
    pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
    det, _ = monitored
    good = textured_images(6, seed=5)
    dark = [(g * 0.5).astype(np.uint8) for g in good]
    svc = build(det)
    assert isinstance(svc, ServiceMonitor)
    assert svc.status()["state"] == "warming up"
    own = det.drift_monitor()
    for batch in (good, dark):
        svc.observe(_observed(det, batch))
        det.decision_function(batch)
    det.monitor = None
    a, b = svc.status(), own.status()
    assert a["state"] == "drift" and a["alarm"] and a["message"].startswith("drift (windows")
    # the service's batch of 6 against decision_function's batches of 4 and 2: features within
    # backbone_rtol (r), relative; a statistic, a mean of squares of z = (x - mean) / scale,
    # within 2 r (1 + |mean| / |x - mean|) -- at most 4 r, the dark windows lying farther from
    # the reference mean than it lies from 0
    for stat, d in b["statistics"].items():
        assert a["statistics"][stat]["value"] == pytest.approx(d["value"],
                                                               rel=4 * backbone_rtol()), stat
    svc.observe(_observed(det, good, model_id="m2"))  # a reloaded model: not mixed in
    assert svc.status()["ignored_batches"] == 1 and svc.status()["images_seen"] == 12


def test_factories_without_a_reference(small_cfg):
    from anomaly_hooks import Detector

    det = Detector.from_config({**small_cfg, "monitor": {"enabled": False}})
    det.fit(textured_images(12), progress=False)
    assert build_auto(det) is None
    with pytest.raises(NotFittedError, match="no drift reference"):
        build(det)


@pytest.mark.slow
def test_injected_drift_shows_in_v1_drift_of_a_real_server(monitored, tmp_path):
    """``anomaly-hooks serve`` with its default ``--monitor auto``: good images keep the
    status ``ok``, a batch of darkened images (lighting drift) turns it to ``drift``."""
    pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
    httpx = pytest.importorskip("httpx", reason="httpx is not installed")
    from serve_helpers import ServerProcess

    _, path = monitored
    good = textured_images(4, seed=7)
    dark = [(g * 0.5).astype(np.uint8) for g in textured_images(8, seed=8)]

    def post(images):
        files = [("files", (f"{i}.png", _png(img), "image/png")) for i, img in enumerate(images)]
        r = httpx.post(server.url + "/v1/predict/batch", files=files, timeout=120)
        assert r.status_code == 200, r.text

    def drift_after(n):
        deadline = time.monotonic() + 60
        while (st := httpx.get(server.url + "/v1/drift").json()).get("images_seen", 0) < n:
            assert time.monotonic() < deadline, st
            time.sleep(0.1)
        return st

    with ServerProcess(path, tmp_path, "--no-results", "--max-batch", "16") as server:
        st = httpx.get(server.url + "/v1/drift").json()
        assert st["enabled"] is True and st["state"] == "warming up", st
        post(good)
        st = drift_after(4)
        assert st["state"] == "ok" and not st["alarm"], st
        post(dark)
        st = drift_after(12)
        assert st["state"] == "drift" and st["alarm"] and st["alarming"], st
        assert 4 < st["first_alarm_image"] <= 8, st  # within one window of the drift
        metrics = httpx.get(server.url + "/metrics").text
        assert 'anomaly_hooks_drift{key="alarm",model="default"} 1.0' in metrics
        assert 'anomaly_hooks_drift_state{model="default",state="drift"} 1.0' in metrics


@pytest.mark.slow
def test_reload_gives_the_new_model_its_own_monitor(monitored, tmp_path):
    """After ``/v1/admin/reload`` of another file, the drift window is the new model's
    (built from its reference, counting its images); the old monitor would ignore every batch
    of the new model. Reloading the same file keeps the window; a file whose monitor cannot be
    built is refused, and the model before it serves on with its monitor."""
    pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
    from fastapi.testclient import TestClient
    from serve_helpers import TOKEN, save_model_variant, wait_ready

    from anomaly_hooks.serve import ServeSettings, create_app

    det, path = monitored
    other = save_model_variant(det, tmp_path / "other.safetensors", threshold_factor=2.0)
    refused = save_model_variant(det, tmp_path / "refused.safetensors", threshold_factor=1e9)
    good = [_png(img) for img in textured_images(3, seed=9)]
    app = create_app(ServeSettings(model=str(path), results_dir=None, token=TOKEN,
                                   models_dir=str(tmp_path),
                                   monitor="serve_helpers:monitor_refusing_huge_thresholds"))
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        wait_ready(client)

        def seen_after(n):
            deadline = time.monotonic() + 60
            while (st := client.get("/v1/drift").json()).get("images_seen", 0) < n:
                assert time.monotonic() < deadline, st
                time.sleep(0.05)
            return st

        for i, png in enumerate(good):  # one at a time: a busy monitor drops a batch
            assert client.post("/v1/predict", content=png).status_code == 200
            first = seen_after(i + 1)
        again = client.post("/v1/admin/reload").json()
        assert again["unchanged"] and client.get("/v1/drift").json()["images_seen"] == 3
        new_id = client.post("/v1/admin/reload", json={"path": str(other)}).json()["model_id"]
        assert new_id != first["model_id"]
        assert client.get("/v1/drift").json()["images_seen"] == 0
        for i, png in enumerate(good[:2]):
            assert client.post("/v1/predict", content=png).status_code == 200
            st = seen_after(i + 1)
        assert st["model_id"] == new_id and st["ignored_batches"] == 0 and st["images_seen"] == 2
        r = client.post("/v1/admin/reload", json={"path": str(refused)})
        assert r.status_code == 422 and r.json()["code"] == "reload_failed", r.text
        assert "drift monitor cannot be built" in r.json()["message"]
        assert "refuses thresholds above 1e6" in r.json()["message"]
        assert client.get("/v1/model").json()["model_id"] == new_id
        assert client.post("/v1/predict", content=good[2]).status_code == 200
        st = seen_after(3)
        assert st["model_id"] == new_id and st["images_seen"] == 3
