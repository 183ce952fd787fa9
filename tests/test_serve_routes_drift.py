"""``GET /v1/drift`` (routes/drift.py): the monitor's status, and what the monitor sees of each
batch (the scoring pass's layer channel means)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
import serve_helpers  # noqa: E402
from serve_helpers import StandInMonitor, good_png, serving  # noqa: E402

models = serve_helpers.models


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
            np.testing.assert_allclose(batch.features[name], feat.mean(dim=(2, 3)).numpy(),
                                       rtol=1e-5, atol=1e-6)
    with serving(models["good"], tmp_path / "b") as (plain, _):
        assert plain.get("/v1/drift").json() == {"enabled": False}
        assert "anomaly_hooks_drift_enabled 0.0" in plain.get("/metrics").text
