"""``GET /v1/model`` and the admin route ``POST /v1/admin/reload`` (routes/model.py) in process:
the model's identity, atomic reload, and the admin gate: no token -> 403, a path outside the
models folder -> 403, a target that is not a model file -> what it is, hostile bodies -> 422."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
import serve_helpers  # noqa: E402
from serve_helpers import (  # noqa: E402
    TOKEN,
    StandInMonitor,
    assert_error,
    defect_png,
    good_png,
    hold_inference,
    serving,
)

from anomaly_hooks.serve.errors import ServeError  # noqa: E402
from anomaly_hooks.serve.routes.model import MAX_JSON_DEPTH, nested_deeper_than  # noqa: E402

models = serve_helpers.models


@pytest.fixture(scope="module")
def admin(models, tmp_path_factory):
    """A server with a token (admin routes enabled) on the good model."""
    with serving(models["good"], tmp_path_factory.mktemp("serve_admin"),
                 token=TOKEN) as (client, service):
        yield client, service


def test_model_info(models, fitted, tmp_path):
    with serving(models["good"], tmp_path, monitor=StandInMonitor()) as (client, service):
        info = client.get("/v1/model").json()
        assert info["file_sha256"] == hashlib.sha256(models["good"].read_bytes()).hexdigest()
        assert info["model_id"] == "padim-" + info["file_sha256"][:12]
        assert info["method"] == "padim" and info["backbone"]["name"] == "resnet18"
        assert info["backbone"]["class"] == "ResNet"
        assert info["layers"] == ["layer1", "layer2", "layer3"] and info["input_size"] == [64, 80]
        assert info["threshold"]["value"] == pytest.approx(fitted.threshold_.value)
        assert info["fitted_on"] == fitted.fit_info_["n_train"]
        assert info["config"]["padim"]["n_features"] == 40
        assert info["serving"]["token"] is None and info["serving"]["max_batch"] == 16
        assert info["drift_monitor"] is True and info["last_reload"] is None
        # the response model drops nothing the engine reports
        assert set(info) == {*service.engine.info(), "name", "serving", "batching",
                             "last_reload", "version", "drift_monitor"}
        assert info["name"] == "default"
        assert info["lineage"] is None and info["version"] is None  # no --models-dir


# ---- the admin gate -------------------------------------------------------------------------
def test_admin_routes_refuse_without_a_token(models, tmp_path):
    with serving(models["good"], tmp_path) as (client, service):
        before = service.engine
        for kw in ({}, {"params": {"path": str(models["strict"])}},
                   {"json": {"path": str(models["strict"])}}):
            body = assert_error(client.post("/v1/admin/reload", **kw), 403, "admin_disabled")
            assert "--token" in body["message"]
        assert service.engine is before


def test_reload_paths_must_lie_inside_the_models_folder(models, admin, tmp_path):
    client, service = admin
    folder = os.path.realpath(models["good"].parent)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(models["strict"], outside)
    link = models["good"].parent / "link_out.safetensors"
    link.symlink_to(outside)
    try:
        for path in (outside, models["good"].parent / ".." / outside.parent.name / outside.name,
                     link, "/etc/passwd", "/dev/zero"):
            r = client.post("/v1/admin/reload", params={"path": str(path)})
            body = assert_error(r, 403, "path_not_allowed")
            assert folder in body["message"] and "--models-dir" in body["message"]
        assert service.engine.path == str(models["good"])
    finally:
        link.unlink()


def test_models_dir_option_sets_the_allowed_folder(models, tmp_path):
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    shutil.copy(models["strict"], shelf / "strict.safetensors")
    with serving(models["good"], tmp_path, token=TOKEN, models_dir=str(shelf)) as (client, _):
        assert_error(client.post("/v1/admin/reload", params={"path": str(models["strict"])}),
                     403, "path_not_allowed")
        r = client.post("/v1/admin/reload", params={"path": str(shelf / "strict.safetensors")})
        assert r.status_code == 200, r.text
        # reloading the serving path again (no path) is always allowed
        assert client.post("/v1/admin/reload").json()["unchanged"] is True


def test_reload_says_what_a_non_model_target_is(models, tmp_path):
    """Each target that is not a regular file is refused from its stat alone (never opened,
    never hashed: /dev/zero would never end, a FIFO would wait for a writer)."""
    folder = tmp_path / "models"
    folder.mkdir()
    os.mkfifo(folder / "pipe.safetensors")
    (folder / "sub").mkdir()
    os.symlink(folder / "loop_a", folder / "loop_b")
    os.symlink(folder / "loop_b", folder / "loop_a")
    targets = {"pipe.safetensors": "not a regular file (a FIFO)", "sub": "is a folder",
               "loop_a": "is a symbolic link loop", "missing.safetensors": "model file not found"}
    with serving(models["good"], tmp_path, token=TOKEN, models_dir=str(folder)) as (client, _):
        for name, needle in targets.items():
            r = client.post("/v1/admin/reload", json={"path": str(folder / name)})
            assert needle in assert_error(r, 422, "reload_failed")["message"], name
    with serving(models["good"], tmp_path, token=TOKEN, models_dir="/dev") as (client, _):
        for device in ("/dev/zero", "/dev/null"):
            r = client.post("/v1/admin/reload", params={"path": device})
            assert "not a regular file (a character device)" in assert_error(
                r, 422, "reload_failed")["message"]


@pytest.mark.parametrize("body, needle", [
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested deeper"),
    (b"[1,2", "not valid JSON"), (b"\xff\xfe", "not valid JSON"), (b"[1, 2]", '{"path"'),
    (b'{"path": 3}', "must be a string"), (b'{"path": "' + b"x" * 5000 + b'"}', "at most")])
def test_hostile_reload_bodies_are_422(admin, body, needle):
    client, _ = admin
    r = client.post("/v1/admin/reload", content=body, headers={"Content-Type": "application/json"})
    assert needle in assert_error(r, 422, "invalid_parameter")["message"]


def test_reload_body_size_is_capped(admin):
    client, _ = admin
    r = client.post("/v1/admin/reload", content=b" " * (2 << 20),
                    headers={"Content-Type": "application/json"})
    assert_error(r, 413, "payload_too_large")


def test_json_depth_ignores_brackets_in_strings():
    assert not nested_deeper_than(json.dumps({"path": "[" * 100}).encode(), MAX_JSON_DEPTH)
    assert not nested_deeper_than(json.dumps({"p": "\\\"" + "{" * 100}).encode(), 3)
    assert nested_deeper_than(b"[" * 5 + b"]" * 5, 4)
    assert not nested_deeper_than(b"[" * 4 + b"]" * 4 + b"[[]]" * 50, 4)


# ---- reload ---------------------------------------------------------------------------------
def test_not_ready_until_a_model_loads(models, tmp_path):
    with serving(models["damaged"], tmp_path, wait=False, token=TOKEN) as (client, service):
        deadline = time.monotonic() + 60
        while service.load_error is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.get("/healthz").json()["status"] == "ok"
        body = assert_error(client.get("/readyz"), 503, "not_ready")
        assert "checksum" in body["message"] or "damaged" in body["message"]
        r = client.post("/v1/predict", content=good_png())
        assert_error(r, 503, "not_ready")
        assert int(r.headers["Retry-After"]) >= 1
        ok = client.post("/v1/admin/reload", json={"path": str(models["good"])})
        assert ok.status_code == 200, ok.text
        assert client.get("/readyz").status_code == 200
        assert client.post("/v1/predict", content=good_png()).status_code == 200


def test_reload_swaps_models_and_refuses_bad_files(models, tmp_path):
    with serving(models["good"], tmp_path, token=TOKEN) as (client, service):
        before = client.get("/v1/model").json()
        r = client.post("/v1/admin/reload", json={"path": str(models["strict"])})
        assert r.status_code == 200, r.text
        result = r.json()
        assert result["previous_model_id"] == before["model_id"]
        assert result["model_id"] != before["model_id"] and not result["unchanged"]
        body = client.post("/v1/predict", content=defect_png()).json()
        assert body["model"]["id"] == result["model_id"]
        assert body["threshold"] == pytest.approx(3 * before["threshold"]["value"])
        for bad, needle in [(models["damaged"], "checksum"),
                            (models["text"], "not an anomaly_hooks model"),
                            (tmp_path / "missing.safetensors", "not found")]:
            bad = models["good"].parent / bad.name  # inside the models folder
            r = client.post("/v1/admin/reload", json={"path": str(bad)})
            err = assert_error(r, 422, "reload_failed")
            assert needle in err["message"].lower() and result["model_id"] in err["message"]
            assert client.get("/v1/model").json()["model_id"] == result["model_id"]
        info = client.get("/v1/model").json()
        assert info["last_reload"]["ok"] is False
        assert info["path"] == os.path.realpath(models["strict"])  # symbolic links resolved
        assert set(info["last_reload"]) == {"ok", "at", "path", "error", "serving"}
        # no path: the current file again
        again = client.post("/v1/admin/reload").json()
        assert again["unchanged"] is True and again["model_id"] == result["model_id"]
        last = client.get("/v1/model").json()["last_reload"]
        assert last["ok"] is True and last["model_id"] == result["model_id"]
        assert_error(client.post("/v1/admin/reload", content=b"[1,2",
                                 headers={"Content-Type": "application/json"}),
                     422, "invalid_parameter")
        assert ('anomaly_hooks_model_reloads_total{model="default",result="failed"} 3.0'
                in client.get("/metrics").text)


def test_reload_lets_in_flight_requests_finish_on_the_old_model(models, tmp_path):
    with serving(models["good"], tmp_path, max_batch=2, max_wait_ms=0,
                 token=TOKEN) as (client, service):
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


# ---- hostile reload targets -----------------------------------------------------------------
def _forged(path, size: int, like) -> None:
    """A sparse file of ``size`` bytes whose header (``like``'s metadata) declares one tensor
    filling it: what only hashing its data could refuse."""
    from anomaly_hooks.modelfile import read_header

    meta = read_header(like)["__metadata__"]
    room = len(json.dumps(meta).encode()) + 4096  # the header's bytes, with room for the entry
    n = size - 8 - room
    header = {"__metadata__": meta, "t": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}
    raw = json.dumps(header).encode().ljust(room)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        fh.truncate(size)


def test_hostile_reload_targets_are_refused_before_their_data_is_read(models, tmp_path,
                                                                      monkeypatch):
    """Each from its size and header alone (nothing hashed), at once, the old model serving:
    a 30 GB sparse file, an empty one, a truncated and a padded model, a header whose
    offsets are no numbers, one that declares more than this machine's memory, and a /proc
    file (which reports 0 bytes whatever a read gives)."""
    from anomaly_hooks.serve import engine as engine_module
    from anomaly_hooks.serve.modelpaths import physical_memory

    folder = tmp_path / "models"
    folder.mkdir()
    raw = models["good"].read_bytes()
    with open(folder / "sparse.safetensors", "wb") as fh:
        fh.truncate(30 << 30)
    (folder / "empty.safetensors").write_bytes(b"")
    (folder / "truncated.safetensors").write_bytes(raw[:-100])
    (folder / "padded.safetensors").write_bytes(raw + b"\x00" * 100)
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"] = ["0", "x"]
    lying = json.dumps(header).encode()
    (folder / "offsets.safetensors").write_bytes(len(lying).to_bytes(8, "little") + lying
                                                 + raw[8 + n:])
    _forged(folder / "huge.safetensors", physical_memory() + (1 << 30), models["good"])
    targets = {"sparse.safetensors": "bad header", "empty.safetensors": "0 bytes",
               "truncated.safetensors": "its header describes",
               "padded.safetensors": "its header describes",
               "offsets.safetensors": "without valid data offsets",
               "huge.safetensors": "more than this machine's memory"}
    with serving(models["good"], tmp_path, token=TOKEN, models_dir=str(folder)) as (client,
                                                                                    service):
        serving_id = service.engine.model_id

        def never(*args, **kwargs):
            raise AssertionError("hashed")

        monkeypatch.setattr(engine_module, "file_sha256", never)
        for name, needle in targets.items():
            t = time.monotonic()
            r = client.post("/v1/admin/reload", json={"path": str(folder / name)})
            assert needle in assert_error(r, 422, "reload_failed")["message"], name
            assert time.monotonic() - t < 2, name
            assert service.engine.model_id == serving_id
    monkeypatch.undo()
    with serving(models["good"], tmp_path, token=TOKEN, models_dir="/proc/self") as (client, _):
        r = client.post("/v1/admin/reload", params={"path": "/proc/self/pagemap"})
        assert "0 bytes" in assert_error(r, 422, "reload_failed")["message"]


def test_hashing_stops_when_the_server_begins_to_stop(tmp_path):
    """The model file's hashing checks the stop flag every chunk: a 4 GB file stops within
    a fraction of a second of the flag."""
    from anomaly_hooks.serve.engine import file_sha256

    big = tmp_path / "big.bin"
    with open(big, "wb") as fh:
        fh.truncate(4 << 30)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    t = time.monotonic()
    with pytest.raises(ServeError, match="shutting down"):
        file_sha256(big, cancel=stop)
    assert time.monotonic() - t < 1.5


def test_a_reload_in_progress_answers_503_when_the_server_stops(models, tmp_path, monkeypatch):
    """begin_shutdown (the server's first step on SIGTERM) stops a reload at once: 503
    ``shutting_down``, the old model untouched; reloads after it are refused the same way."""
    from anomaly_hooks.serve import engine as engine_module

    started = threading.Event()

    def slow_sha256(path, chunk=4 << 20, cancel=None):
        started.set()
        while not cancel.wait(0.01):
            pass
        raise engine_module.load_cancelled()

    with serving(models["good"], tmp_path, token=TOKEN) as (client, service):
        monkeypatch.setattr(engine_module, "file_sha256", slow_sha256)
        with ThreadPoolExecutor(1) as pool:
            reload = pool.submit(client.post, "/v1/admin/reload")
            assert started.wait(30)
            t = time.monotonic()
            service.begin_shutdown()
            assert_error(reload.result(30), 503, "shutting_down")
            assert time.monotonic() - t < 2
        assert_error(client.post("/v1/admin/reload"), 503, "shutting_down")
        assert client.get("/readyz").status_code == 200
