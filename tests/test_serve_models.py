"""Several models in one service (``--model NAME=PATH`` repeated; serve/slots.py): each model
answers under ``/v1/models/{name}/...`` exactly as its own ``Detector.predict`` does, the
routes without a name serve the first one, each reloads on its own, results rows and metrics
carry the model's name."""
from __future__ import annotations

import csv
import hashlib
import io
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
import serve_helpers  # noqa: E402
from conftest import backbone_rtol, textured_images  # noqa: E402
from serve_helpers import TOKEN, assert_error, defect_png, good_png, serving  # noqa: E402

from anomaly_hooks.errors import ConfigError  # noqa: E402
from anomaly_hooks.serve.settings import ServeSettings, parse_models  # noqa: E402

models = serve_helpers.models
NAMES = ("line-a", "line-b", "line-c")


@pytest.fixture(scope="module")
def three(fitted, small_cfg, tmp_path_factory):
    """Three different fitted models, name -> (file, detector): the session's PaDiM, another
    PaDiM (other seed, features and images) and a PatchCore."""
    from anomaly_hooks import Detector

    root = tmp_path_factory.mktemp("three_models")
    other = Detector.from_config({**small_cfg, "seed": 1, "padim": {"n_features": 24}})
    other.fit(textured_images(12, seed=5), progress=False)
    patchcore = Detector.from_config({**small_cfg, "method": "patchcore",
                                      "patchcore": {"coreset_ratio": 0.25}})
    patchcore.fit(textured_images(12, seed=7), progress=False)
    out = {}
    for name, det in zip(NAMES, (fitted, other, patchcore)):
        out[name] = (Path(det.save(root / f"{name}.safetensors")), det)
    return out


@pytest.fixture
def multi(three, tmp_path):
    paths = {name: str(path) for name, (path, _) in three.items()}
    with serving(three["line-a"][0], tmp_path, token=TOKEN, models=paths) as (client, service):
        yield client, service


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_each_model_answers_as_its_own_detector(three, multi):
    client, service = multi
    assert list(service.slots) == list(NAMES) and service.default.name == "line-a"
    images = {"good": good_png(11), "defect": defect_png(12)}
    scores = {}
    for name, (path, det) in three.items():
        for kind, upload in images.items():
            r = client.post(f"/v1/models/{name}/predict?part_id={name}-{kind}", content=upload)
            assert r.status_code == 200, r.text
            body = r.json()
            expected = det.predict(upload)
            # the service's batch against predict's: other kernels (conftest.backbone_rtol)
            assert body["score"] == pytest.approx(expected.score,
                                                  rel=backbone_rtol()), (name, kind)
            assert body["is_anomalous"] is expected.is_anomalous
            assert body["threshold"] == pytest.approx(det.threshold_.value)
            assert body["model"] == {"id": f"{det.cfg.method}-{sha(path)[:12]}",
                                     "sha256": sha(path), "name": name}
            scores[name, kind] = body["score"]
    assert len({round(s, 6) for s in scores.values()}) == 6  # three different models
    assert three["line-c"][1].cfg.method == "patchcore"
    # the routes without a name serve the first model
    body = client.post("/v1/predict", content=images["defect"]).json()
    assert body["model"]["name"] == "line-a"
    assert body["score"] == pytest.approx(scores["line-a", "defect"], rel=backbone_rtol())


def test_concurrent_requests_to_several_models_batch_per_model(three, multi):
    """Mixed concurrent requests: each model batches its own images (one model thread for
    all), and every answer is its model's."""
    client, service = multi
    uploads = [defect_png(20 + i) if i % 3 == 0 else good_png(20 + i) for i in range(6)]
    expected = {(name, i): det.predict(u).score
                for name, (_, det) in three.items() for i, u in enumerate(uploads)}
    jobs = [(name, i) for i in range(len(uploads)) for name in NAMES]

    def send(job):
        name, i = job
        return job, client.post(f"/v1/models/{name}/predict", content=uploads[i])

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, jobs))
    for (name, i), r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["model"]["name"] == name
        assert r.json()["score"] == pytest.approx(expected[name, i], rel=backbone_rtol())
    batches = {name: slot.batcher.batches for name, slot in service.slots.items()}
    assert all(n >= 1 for n in batches.values()), batches


def test_batch_route_of_one_model(three, multi):
    client, _ = multi
    files = [("files", (f"p{i}.png", good_png(40 + i), "image/png")) for i in range(3)]
    r = client.post("/v1/models/line-c/predict/batch", files=files)
    assert r.status_code == 200, r.text
    det = three["line-c"][1]
    for i, result in enumerate(r.json()["results"]):
        assert result["model"]["name"] == "line-c"
        assert result["score"] == pytest.approx(det.predict(good_png(40 + i)).score,
                                                rel=backbone_rtol())


def test_listing_info_and_unknown_names(three, multi):
    client, _ = multi
    listed = client.get("/v1/models").json()
    assert listed["count"] == 3 and listed["default"] == "line-a"
    assert [m["name"] for m in listed["models"]] == list(NAMES)
    assert [m["default"] for m in listed["models"]] == [True, False, False]
    assert all(m["ready"] and m["error"] is None for m in listed["models"])
    assert listed["models"][2]["method"] == "patchcore"
    info = client.get("/v1/models/line-b").json()
    assert info["name"] == "line-b" and info["file_sha256"] == sha(three["line-b"][0])
    assert info["threshold"]["value"] == pytest.approx(three["line-b"][1].threshold_.value)
    assert info["version"] is None  # versions follow the default model
    default = client.get("/v1/model").json()
    assert default["name"] == "line-a" and default["file_sha256"] == sha(three["line-a"][0])
    ready = client.get("/readyz").json()
    assert ready["model_id"] == default["model_id"] and set(ready["models"]) == set(NAMES)
    for path in ("/v1/models/nope", "/v1/models/nope/drift"):
        assert "line-a, line-b, line-c" in assert_error(client.get(path), 404,
                                                        "not_found")["message"]
    assert_error(client.post("/v1/models/nope/predict", content=good_png()), 404, "not_found")
    assert_error(client.post("/v1/admin/models/nope/reload"), 404, "not_found")
    assert client.get("/v1/models/line-c/drift").status_code == 200


def test_results_and_metrics_carry_the_model_name(multi):
    client, _ = multi
    for name in NAMES:
        assert client.post(f"/v1/models/{name}/predict", content=good_png(5)).status_code == 200
    assert client.post("/v1/predict", content=defect_png(6)).status_code == 200
    rows = client.get("/v1/results").json()["results"]
    assert [r["model_name"] for r in rows] == ["line-a", "line-c", "line-b", "line-a"]
    only = client.get("/v1/results?model=line-b").json()["results"]
    assert [r["model_name"] for r in only] == ["line-b"]
    assert client.get("/v1/results?model=nope").json()["count"] == 0
    csv_text = client.get("/v1/results.csv?model=line-c").text
    rows_csv = list(csv.DictReader(io.StringIO(csv_text)))
    assert [r["model_name"] for r in rows_csv] == ["line-c"]
    metrics = client.get("/metrics").text
    for name in NAMES:
        assert f'anomaly_hooks_model_ready{{model="{name}"}} 1.0' in metrics
        assert re.search(rf'anomaly_hooks_predictions_total\{{model="{name}",verdict="\w+"\}} '
                         r'[1-9]', metrics), name
        assert f'model="{name}",model_id=' in metrics
        assert f'anomaly_hooks_batch_size_count{{model="{name}"}}' in metrics
    assert 'endpoint="/v1/models/{name}/predict"' in metrics


def test_each_model_reloads_on_its_own(three, multi):
    client, service = multi
    before = {name: slot.engine for name, slot in service.slots.items()}
    target = str(three["line-c"][0])
    r = client.post("/v1/admin/models/line-b/reload", json={"path": target})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "line-b"
    assert r.json()["model_id"] == "patchcore-" + sha(three["line-c"][0])[:12]
    assert service.slots["line-a"].engine is before["line-a"]
    assert service.slots["line-c"].engine is before["line-c"]
    body = client.post("/v1/models/line-b/predict", content=defect_png(3)).json()
    assert body["score"] == pytest.approx(three["line-c"][1].predict(defect_png(3)).score,
                                          rel=backbone_rtol())
    assert client.get("/v1/models/line-b").json()["last_reload"]["ok"] is True
    assert client.get("/v1/model").json()["last_reload"] is None
    # a refused file leaves that model serving; the path rule is the reload's
    bad = assert_error(client.post("/v1/admin/models/line-b/reload",
                                   json={"path": "/etc/passwd"}), 403, "path_not_allowed")
    assert "models folder" in bad["message"]
    client.headers.pop("Authorization")
    assert_error(client.post("/v1/admin/models/line-a/reload"), 401, "unauthorized")


def test_admin_model_reload_needs_a_token(three, tmp_path):
    paths = {name: str(path) for name, (path, _) in three.items()}
    with serving(three["line-a"][0], tmp_path, models=paths) as (client, _):
        assert_error(client.post("/v1/admin/models/line-b/reload"), 403, "admin_disabled")


def test_a_model_that_cannot_load_names_itself(three, models, tmp_path):
    paths = {"ok": str(three["line-a"][0]), "broken": str(models["damaged"])}
    with serving(three["line-a"][0], tmp_path, models=paths, wait=False) as (client, service):
        slot = service.slots["broken"]
        deadline = time.monotonic() + 60
        while slot.load_error is None or service.slots["ok"].engine is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert slot.load_error.startswith("model broken: ")
        body = assert_error(client.get("/readyz"), 503, "not_ready")
        assert "model broken" in body["message"]
        listed = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
        assert listed["broken"]["ready"] is False and "checksum" in listed["broken"]["error"]


# ---- settings -------------------------------------------------------------------------------
def test_model_options():
    assert parse_models(["m.safetensors"]) == {"default": "m.safetensors"}
    assert parse_models(["a=x/m.safetensors", "b=y.onnx"]) == {"a": "x/m.safetensors",
                                                                "b": "y.onnx"}
    assert parse_models(["./k=v/m.safetensors"]) == {"default": "./k=v/m.safetensors"}
    assert parse_models(["solo=m.safetensors"]) == {"solo": "m.safetensors"}
    for bad, needle in ((["a.safetensors", "b.safetensors"], "name each one"),
                        (["a=x", "a=y"], "twice"), (["a=x", "y"], "name each one"),
                        (["=x"], "NAME=PATH"), (["a="], "NAME=PATH")):
        with pytest.raises(ConfigError, match=needle):
            parse_models(bad)
    for name in ("versions", "-x", "a b", "x" * 65, "é"):
        with pytest.raises(ConfigError, match="model name"):
            ServeSettings(model="m", models={name: "m"}).validate()
    s = ServeSettings(model="ignored", models={"a": "x", "b": "y"})
    assert s.model == "x" and list(s.models) == ["a", "b"]
    assert ServeSettings(model="m").models == {"default": "m"}


def test_command_line_takes_repeated_models(tmp_path):
    import argparse

    from anomaly_hooks.serve.cli import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "a=x.safetensors", "--model", "b=y.safetensors"])
    s = settings_from_args(args)
    assert s.models == {"a": "x.safetensors", "b": "y.safetensors"} and s.model == "x.safetensors"
    assert settings_from_args(parser.parse_args(["--model", "m.safetensors"])).models == {
        "default": "m.safetensors"}
