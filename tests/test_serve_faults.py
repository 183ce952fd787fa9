"""Faults of the model and of the results log, in process: a model that gives non-finite
numbers (a NaN or infinite score, a forged threshold or scale) answers 500 JSON and records
nothing; one poisoned image of a batch fails alone; a request whose record is being committed
when its timeout strikes is answered with that record; a locked SQLite log answers 503 as
a database outage does; any other error is a JSON 500, not
the framework's text. (One refused record of a group commit: test_serve_results.py.)"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Callable, Iterator

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
import serve_helpers  # noqa: E402
from serve_helpers import assert_error, encode, good_png, serving, write_locked  # noqa: E402

from anomaly_hooks.serve.results import SQLiteResultStore  # noqa: E402
from anomaly_hooks.serve.settings import RESULTS_FILE  # noqa: E402

models = serve_helpers.models
BLACK = encode(np.zeros((96, 112, 3), np.uint8))  # the image a poisoned model fails on


def uniform(tensor) -> bool:
    """Whether a network input is one flat colour (BLACK, preprocessed)."""
    return float(tensor.std(dim=(1, 2)).max()) < 1e-3


@pytest.fixture(scope="module")
def api(models, tmp_path_factory):
    with serving(models["good"], tmp_path_factory.mktemp("serve_faults"),
                 keep_images="all") as (client, service):
        yield client, service


@contextlib.contextmanager
def scores_poisoned(service, value: float, only: Callable = lambda t: True) -> Iterator[None]:
    """The serving model's scores are ``value`` for the images ``only`` selects."""
    engine = service.engine
    infer = engine.infer

    def poisoned(tensors, **kw):
        scores, maps = infer(tensors, **kw)
        scores = scores.copy()
        for i, tensor in enumerate(tensors):
            if only(tensor):
                scores[i] = value
        return scores, maps

    engine.infer = poisoned
    try:
        yield
    finally:
        engine.infer = infer


@contextlib.contextmanager
def threshold_forged(service, **fields) -> Iterator[None]:
    """The serving model's threshold with ``fields`` replaced (what a forged file would load)."""
    det = service.engine.detector
    original = det.threshold_
    det.threshold_ = dataclasses.replace(original, **fields)
    try:
        yield
    finally:
        det.threshold_ = original


POISONS = {
    "score_nan": lambda s: scores_poisoned(s, float("nan")),
    "score_inf": lambda s: scores_poisoned(s, float("inf")),
    "score_minus_inf": lambda s: scores_poisoned(s, float("-inf")),
    "threshold_nan": lambda s: threshold_forged(s, value=float("nan")),
    "threshold_inf": lambda s: threshold_forged(s, value=float("inf")),
    "scale_zero": lambda s: threshold_forged(s, scale=0.0),
    "scale_nan": lambda s: threshold_forged(s, scale=float("nan")),
}


@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("heatmap", ["none", "png"])
def test_non_finite_model_numbers_are_a_500_that_records_nothing(api, poison, heatmap):
    client, service = api
    before = service.store.count()
    with POISONS[poison](service):
        r = client.post(f"/v1/predict?heatmap={heatmap}", content=good_png())
        body = assert_error(r, 500, "internal_error")
        assert service.engine.model_id in body["message"]
        assert "nothing recorded" in body["message"]
        for url in ("/v1/results", "/v1/results.csv", "/v1/model", "/metrics"):
            assert client.get(url).status_code == 200, url
    assert service.store.count() == before
    assert client.post("/v1/predict", content=good_png()).status_code == 200


def test_a_poisoned_image_of_a_batch_fails_alone(api):
    """The image the model gives NaN for answers its 500 in its place, unrecorded; the others
    of the same batch are scored and recorded; all poisoned: the request's own 500."""
    client, service = api
    before = service.store.count()
    files = [("files", ("good.png", good_png(1))), ("files", ("black.png", BLACK)),
             ("files", ("good2.png", good_png(2)))]
    with scores_poisoned(service, float("nan"), only=uniform):
        r = client.post("/v1/predict/batch", files=files)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["failed"] == 1 and body["results"][1]["error"]["code"] == "internal_error"
        assert "score" in body["results"][0] and "score" in body["results"][2]
        assert service.store.count() == before + 2
        recorded = {x["request_id"] for x in client.get("/v1/results?limit=2").json()["results"]}
        assert recorded == {body["results"][0]["request_id"], body["results"][2]["request_id"]}
        r = client.post("/v1/predict/batch", files=[("files", ("black.png", BLACK))] * 2)
        assert_error(r, 500, "internal_error")
    assert service.store.count() == before + 2


def test_a_record_committed_as_the_timeout_strikes_is_answered(models, tmp_path):
    """The commit is the point of no return: a request whose record is being written when
    its timeout strikes answers 200 with it (a 503 would leave a row for a failed request,
    and the client's retry a second one)."""
    with serving(models["good"], tmp_path, request_timeout_s=30) as (client, service):
        store = service.store
        add = store.add

        def slow_add(records):
            time.sleep(1.0)
            return add(records)

        store.add = slow_add
        service.settings.request_timeout_s = 0.5  # read per request
        r = client.post("/v1/predict", content=good_png())
        assert r.status_code == 200, r.text
        assert store.count() == 1 and client.get(f"/v1/results/{r.json()['id']}").status_code == 200
        files = [("files", (f"{i}.png", good_png(i))) for i in range(2)]
        r = client.post("/v1/predict/batch", files=files)
        assert r.status_code == 200 and r.json()["failed"] == 0, r.text
        assert store.count() == 3


def test_a_locked_sqlite_log_answers_503_like_a_database_outage(models, tmp_path, caplog):
    """Another program holds the SQLite log's write lock: a prediction answers 503
    ``results_unavailable`` with a Retry-After after the busy timeout (not a 500), its kept
    pictures are removed, the outage is one log line; once the lock is gone it serves again."""
    results = tmp_path / "results"
    store = SQLiteResultStore(results / RESULTS_FILE, busy_timeout_s=0.3)
    with serving(models["good"], tmp_path, keep_images="all", store=store) as (client, _):
        assert client.post("/v1/predict", content=good_png(1)).status_code == 200
        kept = sorted((results / "images").rglob("*.*"))
        with write_locked(store.path), caplog.at_level(logging.INFO, "anomaly_hooks.serve"):
            for i in range(2):
                r = client.post("/v1/predict", content=good_png(2 + i))
                body = assert_error(r, 503, "results_unavailable")
                assert "locked by another connection" in body["message"]
                assert int(r.headers["Retry-After"]) >= 1
            assert client.get("/v1/results").status_code == 200  # reads go on
        assert sorted((results / "images").rglob("*.*")) == kept  # refused: pictures gone
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "unavailable" in errors[0].getMessage(), errors
        assert not any(r.exc_info for r in caplog.records)
        assert client.post("/v1/predict", content=good_png(5)).status_code == 200
        assert client.get("/v1/results").json()["count"] == 2


def test_an_unexpected_error_is_a_json_500(api, monkeypatch):
    client, service = api
    monkeypatch.setattr(type(service.engine), "info", lambda self: 1 / 0)
    body = assert_error(client.get("/v1/model"), 500, "internal_error")
    assert "ZeroDivisionError" in body["message"]
