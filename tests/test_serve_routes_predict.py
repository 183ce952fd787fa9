"""``POST /v1/predict`` and ``/v1/predict/batch`` (routes/predict.py) in process: the real app
around FastAPI's TestClient (real batcher, real model, real SQLite results log)."""
from __future__ import annotations

import base64
import io
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
import serve_helpers  # noqa: E402
from conftest import backbone_rtol, textured_images, with_defect  # noqa: E402
from serve_helpers import (  # noqa: E402
    StandInMonitor,
    assert_error,
    defect_png,
    encode,
    good_png,
    hold_inference,
    hostile_payloads,
    serving,
)

models = serve_helpers.models


@pytest.fixture(scope="module")
def api(models, tmp_path_factory):
    with serving(models["good"], tmp_path_factory.mktemp("serve_predict"),
                 monitor=StandInMonitor()) as (client, service):
        yield client, service


def test_predict_raw_body(api, fitted):
    client, _ = api
    upload = defect_png()
    r = client.post("/v1/predict?part_id=A-1", content=upload,
                    headers={"Content-Type": "image/png"})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = fitted.predict(upload)  # the same bytes, in process: one Prediction
    # a lossless PNG of the same pixels, one image through the same model: the same score
    assert expected.score == fitted.predict(with_defect(textured_images(1, seed=100)[0])).score
    # the service's batches against these: other kernels in the backbone
    assert body["score"] == pytest.approx(expected.score, rel=backbone_rtol())
    assert body["score"] == pytest.approx(float(fitted.decision_function(upload)[0]),
                                          rel=backbone_rtol())
    assert body["is_anomalous"] is True and body["normalized_score"] > 0.5
    assert body["threshold"] == pytest.approx(fitted.threshold_.value)
    assert abs(body["anomalous_pixels"] - int(expected.mask.sum())) <= 10
    assert body["image"] == {"width": 112, "height": 96, "format": "PNG"}
    assert body["part_id"] == "A-1" and isinstance(body["id"], int)
    assert set(body["timing_ms"]) >= {"decode", "queue", "inference", "total", "batch_size"}
    assert body["model"]["id"] == client.get("/v1/model").json()["model_id"]
    assert "overlay_png" not in body


def test_predict_answer_has_the_verdict_fields_of_the_library(api):
    """The answer's keys: the library's verdict fields (prediction.VERDICT_FIELDS) and the
    service's own; the pictures' keys only when asked for or kept."""
    from anomaly_hooks.prediction import VERDICT_FIELDS

    client, _ = api
    body = client.post("/v1/predict", content=good_png(3)).json()
    assert set(body) == {*VERDICT_FIELDS, "id", "request_id", "time", "part_id", "source",
                         "image", "model", "timing_ms", "thumb_url"}


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
    assert set(res[2]) == {"index", "filename", "error"}
    assert res[1]["is_anomalous"] and not res[0]["is_anomalous"] and res[3]["part_id"] == "p4"
    assert max(x["timing_ms"]["batch_size"] for x in res if "error" not in x) >= 2
    assert_error(client.post("/v1/predict/batch", content=good_png()), 415,
                 "unsupported_media_type")
    assert_error(client.post("/v1/predict/batch", files=[("x", ("a", b"", "text/plain"))][:0],
                             data={"a": "b"}), 415, "unsupported_media_type")


# ---- refused requests -----------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(hostile_payloads()))
def test_bad_uploads_get_clear_errors(api, name):
    client, _ = api
    data, status, code = hostile_payloads()[name]
    body = assert_error(client.post("/v1/predict", content=data), status, code)
    assert "Traceback" not in body["message"]
    # the same as a multipart file
    assert_error(client.post("/v1/predict", files={"file": ("x.bin", data)}), status, code)


@pytest.mark.parametrize("url, needle", [
    ("/v1/predict?heatmap=svg", "heatmap"), ("/v1/predict?part_id=" + "x" * 201, "part_id"),
    ("/v1/predict?source=" + "x" * 501, "source")])
def test_bad_parameters_are_422(api, url, needle):
    client, _ = api
    body = assert_error(client.post(url, content=good_png()), 422, "invalid_parameter")
    assert needle in body["message"]
    assert f"query parameter '{needle}'" in body["message"]


def test_long_form_fields_are_422(api):
    client, _ = api
    r = client.post("/v1/predict", files={"file": ("a.png", good_png())},
                    data={"part_id": "x" * 201})
    assert "part_id" in assert_error(r, 422, "invalid_parameter")["message"]


def test_multipart_without_file_and_broken_multipart(api):
    client, _ = api
    assert_error(client.post("/v1/predict", data={"part_id": "x"},
                             files={"nothing": ("", b"", "application/octet-stream")}),
                 400, "empty_body")
    r = client.post("/v1/predict", content=b"--xyz\r\nbroken",
                    headers={"Content-Type": "multipart/form-data; boundary=xyz"})
    assert r.status_code == 400 and r.json()["code"] in ("malformed_request", "empty_body")


def test_upload_limit(models, tmp_path):
    limit = 4000
    with serving(models["good"], tmp_path, max_upload_bytes=limit) as (client, _):
        big = encode((np.random.default_rng(0).random((96, 112, 3)) * 255).astype(np.uint8))
        huge = big * ((limit + 70 * 1024) // len(big) + 1)
        body = assert_error(client.post("/v1/predict", content=huge), 413, "payload_too_large")
        assert "limit" in body["message"]

        def chunks():  # no Content-Length: counted while reading
            for i in range(0, len(huge), 8192):
                yield huge[i:i + 8192]
        assert_error(client.post("/v1/predict", content=chunks()), 413, "payload_too_large")
        # over the per-image limit but within the multipart slack
        assert_error(client.post("/v1/predict", content=big[:limit + 10]), 413,
                     "payload_too_large")
        assert client.post("/v1/predict", content=good_png()).status_code in (200, 413)


def test_too_many_images_in_a_batch(models, tmp_path):
    with serving(models["good"], tmp_path, max_batch_files=2) as (client, _):
        files = [("files", (f"{i}.png", good_png(i), "image/png")) for i in range(3)]
        assert_error(client.post("/v1/predict/batch", files=files), 413, "too_many_images")


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
        assert_error(client.get("/v1/results"), 404, "not_found")
        assert_error(client.post("/v1/predict?heatmap=url", content=good_png()), 422,
                     "invalid_parameter")


# ---- overload, timeout, batching ------------------------------------------------------------
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
            body = assert_error(r, 503, "overloaded")
            assert int(r.headers["Retry-After"]) >= 1 and "limit of 2" in body["message"]
            r = client.post("/v1/predict/batch", files=[("f", ("a.png", good_png(4)))])
            assert_error(r, 503, "overloaded")
            release.set()
            assert [f.result(60).status_code for f in held] == [200, 200]
        assert client.post("/v1/predict", content=good_png(5)).status_code == 200
        assert service.admission.used == 0


def test_request_timeout(models, tmp_path):
    with serving(models["good"], tmp_path, request_timeout_s=0.25) as (client, service):
        release = hold_inference(service)
        r = client.post("/v1/predict", content=good_png())
        assert_error(r, 503, "timeout")
        assert "Retry-After" in r.headers
        assert service.admission.used == 0     # the timed-out request gave its slot back
        release.set()
        service.settings.request_timeout_s = 120  # read per request: a loaded machine is slow
        assert client.post("/v1/predict", content=good_png()).status_code == 200
        assert service.admission.used == 0


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
