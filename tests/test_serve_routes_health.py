"""The probes and the metrics (routes/health.py): ``/healthz``, ``/readyz``, ``/metrics``."""
from __future__ import annotations

import contextlib
import logging
import re
import time

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
import serve_helpers  # noqa: E402
from serve_helpers import (  # noqa: E402
    StandInMonitor,
    assert_error,
    good_png,
    locked_by_another_process,
    serving,
    write_locked,
)

from anomaly_hooks.serve.results import SQLiteResultStore  # noqa: E402
from anomaly_hooks.serve.settings import RESULTS_FILE  # noqa: E402

models = serve_helpers.models


@pytest.fixture(scope="module")
def api(models, tmp_path_factory):
    with serving(models["good"], tmp_path_factory.mktemp("serve_health"),
                 monitor=StandInMonitor()) as (client, service):
        yield client, service


def test_probes(api):
    client, service = api
    health = client.get("/healthz").json()
    assert health["status"] == "ok" and health["uptime_s"] >= 0
    assert client.get("/readyz").json() == {"ready": True, "model_id": service.engine.model_id}


def test_readiness_reports_a_locked_sqlite_log(models, tmp_path):
    """/readyz answers 503 ``results_unavailable`` saying why while another program holds the
    SQLite log's write lock (every prediction would be refused), promptly and without waiting
    out the busy timeout; /healthz stays 200; ready again once the lock is gone."""
    store = SQLiteResultStore(tmp_path / "results" / RESULTS_FILE, busy_timeout_s=30)
    with serving(models["good"], tmp_path, store=store) as (client, _):
        assert client.get("/readyz").status_code == 200
        with write_locked(store.path):
            start = time.monotonic()
            r = client.get("/readyz")
            assert time.monotonic() - start < 5  # the check's own short wait, not 30 s
            body = assert_error(r, 503, "results_unavailable")
            assert "not ready" in body["message"] and "locked" in body["message"]
            assert str(store.path) in body["message"] and int(r.headers["Retry-After"]) >= 1
            assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200


def test_a_log_locked_by_another_process_at_start_starts_not_ready_until_released(
        models, tmp_path, caplog):
    """Another process holds the SQLite log locked from before the service opens it (its
    tables not yet created): the service starts all the same, says so in one warning, and
    answers /readyz and predictions 503 ``results_unavailable`` naming the file, who probably
    holds it and what to do (not "move it away": nothing is wrong with the file); /healthz is
    200. Once the lock is gone it turns ready by itself (no restart) and records."""
    path = tmp_path / "results" / RESULTS_FILE
    path.parent.mkdir()
    with contextlib.ExitStack() as lock, caplog.at_level(logging.WARNING, "anomaly_hooks.serve"):
        lock.enter_context(locked_by_another_process(path))
        store = SQLiteResultStore(path, busy_timeout_s=0.3)
        with serving(models["good"], tmp_path, store=store, wait=False) as (client, _):
            deadline = time.monotonic() + 120
            while client.get("/readyz").json().get("code") == "not_ready":  # the model loads
                assert time.monotonic() < deadline
                time.sleep(0.05)
            warnings = [r.getMessage() for r in caplog.records if "at start" in r.getMessage()]
            assert len(warnings) == 1 and "locked by another program" in warnings[0]
            for r in (client.get("/readyz"), client.post("/v1/predict", content=good_png())):
                message = assert_error(r, 503, "results_unavailable")["message"]
                assert str(path) in message and "locked by another program" in message
                assert "second service" in message and "Stop that program or wait" in message
                assert "move it away" not in message and int(r.headers["Retry-After"]) >= 1
            assert client.get("/healthz").status_code == 200
            lock.close()  # the other program lets go; the same service goes on
            assert client.get("/readyz").status_code == 200
            r = client.post("/v1/predict", content=good_png())
            assert r.status_code == 200 and r.json()["id"] == 1 and store.count() == 1


def test_readiness_reports_a_database_server_that_is_down(models, tmp_path,
                                                         own_postgres_server):
    """PostgreSQL killed: /readyz 503 ``results_unavailable`` naming the database, /healthz
    200; after the server's restart the same service is ready again by itself."""
    pg = own_postgres_server
    with serving(models["good"], tmp_path,
                 results_db=pg.url(pg.new_database())) as (client, _):
        assert client.get("/readyz").status_code == 200
        pg.kill9()
        body = assert_error(client.get("/readyz"), 503, "results_unavailable")
        assert f":{pg.port}/" in body["message"], body
        assert client.get("/healthz").status_code == 200
        pg.restart()
        assert client.get("/readyz").status_code == 200


def test_readiness_without_a_results_log(models, tmp_path):
    with serving(models["good"], tmp_path, results_dir=None) as (client, service):
        assert service.store is None and client.get("/readyz").status_code == 200


def test_metrics(api):
    client, _ = api
    client.post("/v1/predict", content=good_png(11))
    client.post("/v1/predict", content=b"junk")
    client.get("/docs")
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for needle in [
            'anomaly_hooks_http_requests_total{endpoint="/v1/predict",status="200"}',
            'anomaly_hooks_http_requests_total{endpoint="/v1/predict",status="415"}',
            'anomaly_hooks_http_requests_total{endpoint="/docs",status="200"}',
            "anomaly_hooks_http_request_duration_seconds_bucket",
            "anomaly_hooks_normalized_score_bucket", "anomaly_hooks_anomalous_rate",
            "anomaly_hooks_batch_size_bucket", "anomaly_hooks_queue_depth 0.0",
            "anomaly_hooks_images_in_progress", 'anomaly_hooks_rejected_images_total{code=',
            'anomaly_hooks_model_ready{model="default"} 1.0',
            'anomaly_hooks_model_info{', 'model="default",model_id="padim-',
            'anomaly_hooks_drift_enabled{model="default"} 1.0',
            'anomaly_hooks_drift{key="observed",model="default"}',
            'anomaly_hooks_drift{key="statistics.score_mean",model="default"}',
            'anomaly_hooks_drift_state{model="default",state="ok"} 1.0']:
        assert needle in text, needle
    assert re.search(r'anomaly_hooks_predictions_total\{model="default",verdict="normal"\} '
                     r'[1-9]', text)


def test_metrics_labels_are_bounded():
    """Request paths become a fixed set of labels: an id or a junk path never makes a new one."""
    from fastapi.routing import APIRoute

    from anomaly_hooks.serve.middleware import endpoint_label
    from anomaly_hooks.serve.routes import ROUTERS

    for route in (r for router in ROUTERS for r in router.routes if isinstance(r, APIRoute)):
        if "{" not in route.path:  # each route without parameters is its own label
            assert endpoint_label(route.path) == route.path
    assert endpoint_label("/v1/results/123/overlay.png") == "/v1/results/{id}"
    assert endpoint_label("/v1/results/99999999999999999999") == "/v1/results/{id}"
    assert endpoint_label("/static/app.js") == "/static"
    assert endpoint_label("/docs/assets/swagger-ui.css") == "/docs/assets"
    assert endpoint_label("/openapi.json") == "/openapi.json"
    assert endpoint_label("/wp-admin/x") == "other"
    # one model's routes by their template, whatever the name
    for path in ("/v1/models/{name}", "/v1/models/{name}/predict",
                 "/v1/models/{name}/predict/batch", "/v1/models/{name}/drift",
                 "/v1/admin/models/{name}/reload"):
        assert endpoint_label(path.replace("{name}", "x" * 300)) == path
    assert endpoint_label("/v1/models/a/b/c") == "other"
    assert endpoint_label("/v1/admin/models/a/predict") == "other"
