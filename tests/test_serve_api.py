"""The HTTP API of the inspection service, in process (FastAPI's TestClient around the real app:
real batcher, real model, real SQLite results log)."""
from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
from conftest import textured_images, with_defect  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from serve_helpers import (  # noqa: E402
    StandInMonitor,
    defect_png,
    encode,
    good_png,
    hostile_payloads,
    model_variants,
)

from anomaly_hooks.serve import ServeSettings, create_app  # noqa: E402

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def models(fitted, tmp_path_factory):
    return model_variants(fitted, tmp_path_factory.mktemp("serve_models"))


@contextlib.contextmanager
def serving(model: Path, tmp_path: Path, monitor=None, wait=True, **kw):
    kw.setdefault("results_dir", str(tmp_path / "results"))
    settings = ServeSettings(model=str(model), token=kw.pop("token", None), **kw)
    app = create_app(settings, monitor=monitor)
    with TestClient(app, raise_server_exceptions=False) as client:
        if wait:
            headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
            deadline = time.monotonic() + 120
            while client.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, client.get("/readyz").json()
                time.sleep(0.05)
            client.headers.update(headers)
        yield client, app.state.service


@pytest.fixture(scope="module")
def api(models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_api")
    with serving(models["good"], tmp, monitor=StandInMonitor()) as (client, service):
        yield client, service


def hold_inference(service):
    """Make the current model's inference wait for the returned event."""
    event = threading.Event()
    engine = service.engine
    original = engine.infer

    def held(tensors, **kw):
        event.wait(60)
        return original(tensors, **kw)

    engine.infer = held
    return event


def _assert_error(response, status, code):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["code"] == code and body["status"] == status and body["message"], body
    return body


# ---- predictions ----------------------------------------------------------------------------
def test_predict_raw_body(api, fitted):
    client, _ = api
    upload = defect_png()
    r = client.post("/v1/predict?part_id=A-1", content=upload,
                    headers={"Content-Type": "image/png"})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = fitted.predict(upload)  # the same bytes, in process: one Prediction
    assert expected.score == pytest.approx(
        fitted.predict(with_defect(textured_images(1, seed=100)[0])).score, rel=1e-6)
    assert body["score"] == pytest.approx(expected.score, rel=1e-5)
    assert body["score"] == pytest.approx(float(fitted.decision_function(upload)[0]), rel=1e-5)
    assert body["is_anomalous"] is True and body["normalized_score"] > 0.5
    assert body["threshold"] == pytest.approx(fitted.threshold_.value)
    assert abs(body["anomalous_pixels"] - int(expected.mask.sum())) <= 10
    assert body["image"] == {"width": 112, "height": 96, "format": "PNG"}
    assert body["part_id"] == "A-1" and isinstance(body["id"], int)
    assert set(body["timing_ms"]) >= {"decode", "queue", "inference", "total", "batch_size"}
    assert body["model"]["id"] == client.get("/v1/model").json()["model_id"]
    assert "overlay_png" not in body


def test_predict_multipart_with_fields(api):
    client, _ = api
    r = client.post("/v1/predict", files={"file": ("part7.jpg", encode(
        textured_images(1, seed=5)[0], "JPEG"), "image/jpeg")},
        data={"part_id": "SN-0007"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["part_id"] == "SN-0007" and body["source"] == "part7.jpg"
    assert body["image"]["format"] == "JPEG" and body["is_anomalous"] is False


def test_heatmap_png_and_url(api):
    client, _ = api
    body = client.post("/v1/predict?heatmap=png", content=defect_png()).json()
    overlay = Image.open(io.BytesIO(base64.b64decode(body["overlay_png"])))
    mask = Image.open(io.BytesIO(base64.b64decode(body["mask_png"])))
    assert overlay.size == mask.size == (112, 96) and overlay.mode == "RGB"
    assert np.asarray(mask).sum() > 0
    body = client.post("/v1/predict?heatmap=url", content=good_png()).json()
    for kind in ("overlay_url", "mask_url", "thumb_url"):
        r = client.get(body[kind])
        assert r.status_code == 200 and r.content[:4] in (b"\x89PNG", b"\xff\xd8\xff\xe0")


def test_batch_endpoint(api):
    client, _ = api
    files = [("files", ("a.png", good_png(1), "image/png")),
             ("files", ("b.png", defect_png(2), "image/png")),
             ("files", ("c.txt", b"not an image", "text/plain")),
             ("files", ("d.png", good_png(3), "image/png"))]
    r = client.post("/v1/predict/batch", files=files, data={"part_id": ["p1", "p2", "p3", "p4"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == 4 and body["failed"] == 1
    res = body["results"]
    assert [x["filename"] for x in res] == ["a.png", "b.png", "c.txt", "d.png"]
    assert res[2]["error"]["code"] == "unsupported_media_type"
    assert res[1]["is_anomalous"] and not res[0]["is_anomalous"] and res[3]["part_id"] == "p4"
    assert max(x["timing_ms"]["batch_size"] for x in res if "error" not in x) >= 2
    _assert_error(client.post("/v1/predict/batch", content=good_png()), 415,
                  "unsupported_media_type")
    _assert_error(client.post("/v1/predict/batch", files=[("x", ("a", b"", "text/plain"))][:0],
                              data={"a": "b"}), 415, "unsupported_media_type")


# ---- errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(hostile_payloads()))
def test_bad_uploads_get_clear_errors(api, name):
    client, _ = api
    data, status, code = hostile_payloads()[name]
    body = _assert_error(client.post("/v1/predict", content=data), status, code)
    assert "Traceback" not in body["message"]
    # the same as a multipart file
    _assert_error(client.post("/v1/predict", files={"file": ("x.bin", data)}), status, code)


@pytest.mark.parametrize("url, needle", [
    ("/v1/predict?heatmap=svg", "heatmap"), ("/v1/predict?part_id=" + "x" * 201, "part_id")])
def test_bad_parameters_are_422(api, url, needle):
    client, _ = api
    body = _assert_error(client.post(url, content=good_png()), 422, "invalid_parameter")
    assert needle in body["message"]


@pytest.mark.parametrize("query", ["limit=0", "limit=5000", "since=yesterday", "anomalous=maybe",
                                   "before_id=-3", "since=nan"])
def test_bad_result_queries_are_422(api, query):
    client, _ = api
    _assert_error(client.get("/v1/results?" + query), 422, "invalid_parameter")


def test_multipart_without_file_and_broken_multipart(api):
    client, _ = api
    _assert_error(client.post("/v1/predict", data={"part_id": "x"},
                              files={"nothing": ("", b"", "application/octet-stream")}),
                  400, "empty_body")
    r = client.post("/v1/predict", content=b"--xyz\r\nbroken",
                    headers={"Content-Type": "multipart/form-data; boundary=xyz"})
    assert r.status_code == 400 and r.json()["code"] in ("malformed_request", "empty_body")


def test_unknown_route_and_method(api):
    client, _ = api
    _assert_error(client.get("/v2/nothing"), 404, "not_found")
    _assert_error(client.get("/v1/predict"), 405, "method_not_allowed")
    _assert_error(client.get("/v1/results/999999"), 404, "not_found")
    _assert_error(client.get("/v1/results/1/secret.txt"), 404, "not_found")


def test_upload_limit(models, tmp_path):
    limit = 4000
    with serving(models["good"], tmp_path, max_upload_bytes=limit) as (client, _):
        big = encode((np.random.default_rng(0).random((96, 112, 3)) * 255).astype(np.uint8))
        assert len(big) > limit + 64 * 1024 or True
        huge = big * ((limit + 70 * 1024) // len(big) + 1)
        body = _assert_error(client.post("/v1/predict", content=huge), 413, "payload_too_large")
        assert "limit" in body["message"]

        def chunks():  # no Content-Length: counted while reading
            for i in range(0, len(huge), 8192):
                yield huge[i:i + 8192]
        _assert_error(client.post("/v1/predict", content=chunks()), 413, "payload_too_large")
        # over the per-image limit but within the multipart slack
        _assert_error(client.post("/v1/predict", content=big[:limit + 10]), 413,
                      "payload_too_large")
        assert client.post("/v1/predict", content=good_png()).status_code in (200, 413)


def test_too_many_images_in_a_batch(models, tmp_path):
    with serving(models["good"], tmp_path, max_batch_files=2) as (client, _):
        files = [("files", (f"{i}.png", good_png(i), "image/png")) for i in range(3)]
        _assert_error(client.post("/v1/predict/batch", files=files), 413, "too_many_images")


# ---- auth -----------------------------------------------------------------------------------
def test_bearer_token_auth(models, tmp_path):
    with serving(models["good"], tmp_path, token=TOKEN) as (client, _):
        client.headers.pop("Authorization")
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200
        for method, url in [("post", "/v1/predict"), ("get", "/v1/model"), ("get", "/metrics"),
                            ("get", "/v1/results"), ("get", "/v1/results.csv"),
                            ("get", "/v1/drift"), ("post", "/v1/admin/reload"),
                            ("post", "/v1/predict/batch")]:
            r = getattr(client, method)(url)
            _assert_error(r, 401, "unauthorized")
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
        r = client.get("/")
        assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Basic")
        wrong = {"Authorization": "Bearer nope-nope-nope"}
        assert _assert_error(client.get("/v1/model", headers=wrong), 401,
                             "unauthorized")["message"] == "wrong token"
        ok = {"Authorization": f"Bearer {TOKEN}"}
        assert client.post("/v1/predict", content=good_png(), headers=ok).status_code == 200
        basic = base64.b64encode(f"operator:{TOKEN}".encode()).decode()
        assert client.get("/", headers={"Authorization": f"Basic {basic}"}).status_code == 200
        bad_basic = base64.b64encode(b"operator:guess").decode()
        assert client.get("/", headers={"Authorization": f"Basic {bad_basic}"}).status_code == 401


# ---- model info, metrics, drift ------------------------------------------------------------
def test_model_info(api, models, fitted):
    client, _ = api
    info = client.get("/v1/model").json()
    assert info["file_sha256"] == hashlib.sha256(models["good"].read_bytes()).hexdigest()
    assert info["model_id"] == "padim-" + info["file_sha256"][:12]
    assert info["method"] == "padim" and info["backbone"]["name"] == "resnet18"
    assert info["layers"] == ["layer1", "layer2", "layer3"] and info["input_size"] == [64, 80]
    assert info["threshold"]["value"] == pytest.approx(fitted.threshold_.value)
    assert info["fitted_on"] == fitted.fit_info_["n_train"]
    assert info["config"]["padim"]["n_features"] == 40
    assert info["serving"]["token"] is None and info["serving"]["max_batch"] == 16
    assert info["drift_monitor"] is True


def test_metrics(api):
    client, _ = api
    client.post("/v1/predict", content=good_png(11))
    client.post("/v1/predict", content=b"junk")
    text = client.get("/metrics").text
    for needle in [
            'anomaly_hooks_http_requests_total{endpoint="/v1/predict",status="200"}',
            'anomaly_hooks_http_requests_total{endpoint="/v1/predict",status="415"}',
            "anomaly_hooks_http_request_duration_seconds_bucket",
            "anomaly_hooks_normalized_score_bucket", "anomaly_hooks_anomalous_rate",
            "anomaly_hooks_batch_size_bucket", "anomaly_hooks_queue_depth 0.0",
            "anomaly_hooks_images_in_progress", 'anomaly_hooks_rejected_images_total{code=',
            "anomaly_hooks_model_ready 1.0", "anomaly_hooks_model_info{",
            "anomaly_hooks_drift_enabled 1.0", 'anomaly_hooks_drift{key="observed"}',
            'anomaly_hooks_drift{key="statistics.score_mean"}',
            'anomaly_hooks_drift_state{state="ok"} 1.0']:
        assert needle in text, needle
    assert re.search(r'anomaly_hooks_predictions_total\{verdict="normal"\} [1-9]', text)


def test_drift_endpoint(api, models, tmp_path):
    client, service = api
    client.post("/v1/predict", content=good_png(12))
    status = client.get("/v1/drift").json()
    assert status["enabled"] is True and status["state"] == "ok" and status["observed"] >= 1
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
    with serving(models["good"], tmp_path) as (plain, _):
        assert plain.get("/v1/drift").json() == {"enabled": False}
        assert "anomaly_hooks_drift_enabled 0.0" in plain.get("/metrics").text


# ---- results log ----------------------------------------------------------------------------
def test_results_log_query_pictures_and_csv(models, tmp_path):
    with serving(models["good"], tmp_path) as (client, _):
        ids = []
        for i in range(3):
            ids.append(client.post(f"/v1/predict?part_id=G{i}", content=good_png(20 + i)).json())
        bad = client.post("/v1/predict?part_id=D0", content=defect_png(30)).json()
        res = client.get("/v1/results").json()
        assert res["count"] == 4 and [r["part_id"] for r in res["results"]] == ["D0", "G2", "G1",
                                                                                 "G0"]
        only = client.get("/v1/results?anomalous=true").json()["results"]
        assert [r["id"] for r in only] == [bad["id"]]
        assert client.get("/v1/results?limit=2").json()["next_before_id"] == ids[2]["id"]
        assert client.get("/v1/results?part_id=G1").json()["count"] == 1
        since = client.get(f"/v1/results?since={ids[1]['time']}").json()["count"]
        assert since == 3
        assert client.get("/v1/results?since=2999-01-01T00:00:00Z").json()["count"] == 0
        rec = client.get(f"/v1/results/{bad['id']}").json()
        assert rec["overlay_url"] and rec["mask_url"] and rec["thumb_url"]   # kept: anomalous
        good_rec = client.get(f"/v1/results/{ids[0]['id']}").json()
        assert good_rec["overlay_url"] is None and good_rec["thumb_url"]      # only a thumbnail
        assert client.get(rec["overlay_url"]).headers["content-type"] == "image/png"
        _assert_error(client.get(f"/v1/results/{ids[0]['id']}/overlay.png"), 404, "not_found")
        csv_text = client.get("/v1/results.csv?anomalous=false").text
        lines = csv_text.strip().splitlines()
        assert lines[0].startswith("id,time_iso") and len(lines) == 4
        assert client.get("/v1/results.csv?limit=1").text.count("\n") == 2
        assert "path" not in "".join(rec)  # no server paths in JSON


def test_keep_all_none_and_no_results(models, tmp_path):
    with serving(models["good"], tmp_path / "all", keep_images="all") as (client, _):
        body = client.post("/v1/predict", content=good_png()).json()
        assert body["overlay_url"] and body["mask_url"]
    with serving(models["good"], tmp_path / "none", keep_images="none",
                 thumbnails=False) as (client, _):
        body = client.post("/v1/predict", content=defect_png()).json()
        assert "overlay_url" not in body and "thumb_url" not in body and body["id"]
    with serving(models["good"], tmp_path / "off", results_dir=None) as (client, _):
        body = client.post("/v1/predict?heatmap=png", content=defect_png()).json()
        assert body["id"] is None and body["overlay_png"]
        _assert_error(client.get("/v1/results"), 404, "not_found")
        _assert_error(client.post("/v1/predict?heatmap=url", content=good_png()), 422,
                      "invalid_parameter")


def test_retention_removes_records_and_pictures(models, tmp_path):
    with serving(models["good"], tmp_path, retention_count=2, keep_images="all") as (client,
                                                                                      service):
        for i in range(5):
            client.post("/v1/predict", content=good_png(40 + i))
        pictures = list((tmp_path / "results" / "images").rglob("*.*"))
        assert len(pictures) == 15
        removed = client.portal.call(service.prune)
        assert removed == 3 and client.get("/v1/results").json()["count"] == 2
        assert len(list((tmp_path / "results" / "images").rglob("*.*"))) == 6


# ---- readiness, overload, timeout -----------------------------------------------------------
def test_not_ready_until_a_model_loads(models, tmp_path):
    with serving(models["damaged"], tmp_path, wait=False) as (client, service):
        deadline = time.monotonic() + 60
        while service.load_error is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.get("/healthz").json()["status"] == "ok"
        body = _assert_error(client.get("/readyz"), 503, "not_ready")
        assert "checksum" in body["message"] or "damaged" in body["message"]
        r = client.post("/v1/predict", content=good_png())
        _assert_error(r, 503, "not_ready")
        assert int(r.headers["Retry-After"]) >= 1
        ok = client.post("/v1/admin/reload", json={"path": str(models["good"])})
        assert ok.status_code == 200, ok.text
        assert client.get("/readyz").status_code == 200
        assert client.post("/v1/predict", content=good_png()).status_code == 200


def test_overloaded_queue_answers_503_with_retry_after(models, tmp_path):
    with serving(models["good"], tmp_path, max_batch=1, max_queue=2) as (client, service):
        release = hold_inference(service)
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(client.post, "/v1/predict", content=good_png(i)) for i in (1, 2)]
            deadline = time.monotonic() + 30
            while service.admission.used < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            r = client.post("/v1/predict", content=good_png(3))
            body = _assert_error(r, 503, "overloaded")
            assert int(r.headers["Retry-After"]) >= 1 and "limit of 2" in body["message"]
            r = client.post("/v1/predict/batch", files=[("f", ("a.png", good_png(4)))])
            _assert_error(r, 503, "overloaded")
            release.set()
            assert [f.result(60).status_code for f in held] == [200, 200]
        assert client.post("/v1/predict", content=good_png(5)).status_code == 200
        assert service.admission.used == 0


def test_request_timeout(models, tmp_path):
    with serving(models["good"], tmp_path, request_timeout_s=0.25) as (client, service):
        release = hold_inference(service)
        r = client.post("/v1/predict", content=good_png())
        _assert_error(r, 503, "timeout")
        assert "Retry-After" in r.headers
        assert service.admission.used == 0     # the timed-out request gave its slot back
        release.set()
        service.settings.request_timeout_s = 120  # read per request: a loaded machine is slow
        assert client.post("/v1/predict", content=good_png()).status_code == 200
        assert service.admission.used == 0


# ---- reload ---------------------------------------------------------------------------------
def test_reload_swaps_models_and_refuses_bad_files(models, tmp_path):
    with serving(models["good"], tmp_path) as (client, service):
        before = client.get("/v1/model").json()
        r = client.post("/v1/admin/reload", json={"path": str(models["strict"])})
        assert r.status_code == 200, r.text
        result = r.json()
        assert result["previous_model_id"] == before["model_id"]
        assert result["model_id"] != before["model_id"] and not result["unchanged"]
        body = client.post("/v1/predict", content=defect_png()).json()
        assert body["model"]["id"] == result["model_id"]
        assert body["threshold"] == pytest.approx(3 * before["threshold"]["value"])
        for bad, needle in [(models["damaged"], "checksum"), (models["text"], "not an anomaly_hooks model"),
                            (tmp_path / "missing.safetensors", "not found")]:
            r = client.post("/v1/admin/reload", json={"path": str(bad)})
            err = _assert_error(r, 422, "reload_failed")
            assert needle in err["message"].lower() and result["model_id"] in err["message"]
            assert client.get("/v1/model").json()["model_id"] == result["model_id"]
        info = client.get("/v1/model").json()
        assert info["last_reload"]["ok"] is False and info["path"] == str(models["strict"])
        # no path: the current file again
        again = client.post("/v1/admin/reload").json()
        assert again["unchanged"] is True and again["model_id"] == result["model_id"]
        _assert_error(client.post("/v1/admin/reload", content=b"[1,2",
                                  headers={"Content-Type": "application/json"}),
                      422, "invalid_parameter")
        assert 'anomaly_hooks_model_reloads_total{result="failed"} 3.0' in client.get(
            "/metrics").text


def test_reload_lets_in_flight_requests_finish_on_the_old_model(models, tmp_path):
    with serving(models["good"], tmp_path, max_batch=2, max_wait_ms=0) as (client, service):
        old_id = service.engine.model_id
        release = hold_inference(service)
        with ThreadPoolExecutor(4) as pool:
            in_flight = [pool.submit(client.post, "/v1/predict", content=good_png(i))
                         for i in range(4)]
            deadline = time.monotonic() + 30
            # all four with the batcher (one batch of 1 or 2 held in inference, the rest queued)
            while service.batcher.running + service.batcher.depth < 4:
                assert time.monotonic() < deadline, (service.batcher.running,
                                                     service.batcher.depth)
                time.sleep(0.02)
            r = client.post("/v1/admin/reload", json={"path": str(models["strict"])})
            assert r.status_code == 200, r.text
            new_id = r.json()["model_id"]
            after = pool.submit(client.post, "/v1/predict", content=defect_png())
            release.set()
            old = [f.result(60) for f in in_flight]
            assert [x.status_code for x in old] == [200] * 4
            assert {x.json()["model"]["id"] for x in old} == {old_id}
            assert after.result(60).json()["model"]["id"] == new_id


# ---- concurrency and the page ---------------------------------------------------------------
def test_concurrent_requests_share_batches(models, tmp_path):
    with serving(models["good"], tmp_path, max_batch=8, max_wait_ms=20) as (client, service):
        release = hold_inference(service)
        with ThreadPoolExecutor(9) as pool:
            first = pool.submit(client.post, "/v1/predict", content=good_png(0))
            deadline = time.monotonic() + 30
            while service.batcher.running == 0:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            rest = [pool.submit(client.post, "/v1/predict", content=good_png(i))
                    for i in range(1, 9)]
            while service.batcher.depth < 8:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            release.set()
            sizes = [f.result(60).json()["timing_ms"]["batch_size"] for f in rest]
        assert first.result().json()["timing_ms"]["batch_size"] == 1
        assert sizes == [8] * 8


def test_page_and_static_files_are_self_contained(api):
    client, _ = api
    page = client.get("/")
    assert page.status_code == 200 and 'id="file"' in page.text and "/static/app.js" in page.text
    static = Path(__file__).resolve().parents[1] / "anomaly_hooks" / "serve" / "static"
    for f in static.iterdir():
        r = client.get(f"/static/{f.name}")
        assert r.status_code == 200
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", r.text, re.I), f.name
    assert "innerHTML" not in (static / "app.js").read_text()
