"""Model versions of ``--models-dir`` (serve/versions.py, routes/versions.py): the listing,
promote and rollback (token-protected, one code path with reload), the refusal of files that
are incomplete or still being written, and the rollback stack outliving a restart -- in
process; and a real server killed with ``kill -9`` during a promote loop, which never serves a
half-written model and, restarted, serves a complete version."""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
import serve_helpers  # noqa: E402
from serve_helpers import (  # noqa: E402
    TOKEN,
    ServerProcess,
    assert_error,
    defect_png,
    save_model_variant,
    serving,
    with_lineage,
)

from anomaly_hooks.serve.versions import (  # noqa: E402
    STATE_FILE,
    VersionShelf,
    lineage_summary,
)

models = serve_helpers.models


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def content_checksum(path: Path) -> str:
    from anomaly_hooks.modelfile import read_header

    return read_header(Path(path))["__metadata__"]["checksum"]


@pytest.fixture(scope="module")
def shelf_files(fitted, models, tmp_path_factory):
    """The versions every test copies into its models folder: v1 (the fitted model), v2 (its
    threshold x3), v3 (an update of v1: its lineage names v1 as its parent)."""
    root = tmp_path_factory.mktemp("versions_src")
    v1 = shutil.copy(models["good"], root / "v1.safetensors")
    v2 = shutil.copy(models["strict"], root / "v2.safetensors")
    parent = content_checksum(v1)
    v3 = with_lineage(Path(v1), root / "v3.safetensors", [
        {"parent_checksum": parent, "images_added": 8, "labels_used": 2,
         "time": "2026-01-02T03:04:05+00:00"}])
    return {"v1": Path(v1), "v2": Path(v2), "v3": Path(v3)}


@pytest.fixture
def shelf(shelf_files, tmp_path) -> Path:
    folder = tmp_path / "shelf"
    folder.mkdir()
    for path in shelf_files.values():
        shutil.copy(path, folder / path.name)
    return folder


def admin_server(shelf: Path, tmp_path: Path, model: str = "v1.safetensors", **kw):
    kw.setdefault("token", TOKEN)
    return serving(shelf / model, tmp_path, models_dir=str(shelf), **kw)


def promote(client, version):
    return client.post("/v1/admin/promote", json={"version": version})


def record(shelf: Path) -> dict:
    return json.loads((shelf / STATE_FILE).read_text())


# ---- the listing ----------------------------------------------------------------------------
def test_versions_lists_the_model_files_of_the_folder(shelf, models, tmp_path):
    raw = (shelf / "v2.safetensors").read_bytes()
    (shelf / "half.safetensors").write_bytes(raw[:len(raw) // 2])  # still being written
    (shelf / ".v4.safetensors.1234.tmp").write_bytes(raw)           # an atomic save under way
    (shelf / "v4.safetensors.tmp").write_bytes(raw)
    (shelf / "notes.txt").write_text("not a model")
    with admin_server(shelf, tmp_path) as (client, _):
        body = client.get("/v1/models/versions").json()
        assert body["folder"] == os.path.realpath(shelf) and body["count"] == 4
        rows = {r["name"]: r for r in body["versions"]}
        assert set(rows) == {"v1.safetensors", "v2.safetensors", "v3.safetensors",
                             "half.safetensors"}
        for name in ("v1", "v2", "v3"):
            row = rows[f"{name}.safetensors"]
            path = shelf / f"{name}.safetensors"
            assert row["checksum"] == sha(path) and row["size"] == path.stat().st_size
            assert row["mtime"] == pytest.approx(path.stat().st_mtime)
            assert row["method"] == "padim" and row["engine"] == "torch" and not row["problem"]
            assert row["model_id"] == "padim-" + row["checksum"][:12]
            assert row["serving"] is (name == "v1")
        assert rows["v1.safetensors"]["lineage"] is None
        assert rows["v3.safetensors"]["lineage"] == {
            "updates": 1, "images_added": 8, "labels_used": 2,
            "parent_checksum": content_checksum(shelf / "v1.safetensors"),
            "last_update": "2026-01-02T03:04:05+00:00", "parent_version": "v1.safetensors"}
        half = rows["half.safetensors"]
        assert half["checksum"] is None and "incomplete" in half["problem"]
        assert half["serving"] is False
        assert body["serving"]["name"] == "v1.safetensors" and body["history"] == []
        # the serving version, with its lineage, in /v1/model
        info = client.get("/v1/model").json()
        assert info["version"]["name"] == "v1.safetensors" and info["lineage"] is None
        assert info["version"]["previous"] is None and info["version"]["rollbacks"] == 0
    assert not (shelf / STATE_FILE).exists()  # listing and serving write nothing


def test_without_models_dir_there_are_no_versions(models, tmp_path):
    with serving(models["good"], tmp_path, token=TOKEN) as (client, _):
        assert "--models-dir" in assert_error(client.get("/v1/models/versions"), 404,
                                              "not_found")["message"]
        assert_error(promote(client, "model.safetensors"), 404, "not_found")
        assert_error(client.post("/v1/admin/rollback"), 404, "not_found")
        assert client.get("/v1/model").json()["version"] is None


# ---- promote and rollback -------------------------------------------------------------------
def test_promote_and_rollback(shelf, tmp_path):
    with admin_server(shelf, tmp_path) as (client, service):
        before = client.get("/v1/model").json()
        r = promote(client, "v2.safetensors")
        assert r.status_code == 200, r.text
        done = r.json()
        assert done["version"] == "v2.safetensors" and done["rollbacks"] == 1
        assert done["model_id"] == "padim-" + sha(shelf / "v2.safetensors")[:12]
        assert done["previous_model_id"] == before["model_id"] and not done["unchanged"]
        # exactly a reload: the new model answers, /v1/model says which version serves
        pred = client.post("/v1/predict", content=defect_png()).json()
        assert pred["model"]["id"] == done["model_id"]
        assert pred["threshold"] == pytest.approx(3 * before["threshold"]["value"])
        info = client.get("/v1/model").json()
        assert info["version"]["name"] == "v2.safetensors"
        assert info["version"]["previous"]["name"] == "v1.safetensors"
        assert info["last_reload"]["ok"] is True
        assert info["path"] == os.path.realpath(shelf / "v2.safetensors")
        # by a checksum prefix; its lineage shows
        r = promote(client, sha(shelf / "v3.safetensors")[:8])
        assert r.status_code == 200 and r.json()["version"] == "v3.safetensors", r.text
        info = client.get("/v1/model").json()
        assert info["lineage"]["updates"] == 1 and info["lineage"]["images_added"] == 8
        listed = client.get("/v1/models/versions").json()
        assert [h["name"] for h in listed["history"]] == ["v2.safetensors", "v1.safetensors"]
        assert [r["name"] for r in listed["versions"] if r["serving"]] == ["v3.safetensors"]
        assert [h["name"] for h in record(shelf)["history"]] == ["v1.safetensors",
                                                                 "v2.safetensors"]
        # promoting the serving version changes nothing
        again = promote(client, "v3.safetensors").json()
        assert again["unchanged"] is True and again["rollbacks"] == 2
        # back, and back again, then nothing more to roll back to
        r = client.post("/v1/admin/rollback")
        assert r.status_code == 200 and r.json()["version"] == "v2.safetensors", r.text
        assert r.json()["rollbacks"] == 1
        r = client.post("/v1/admin/rollback")
        assert r.json()["version"] == "v1.safetensors" and r.json()["rollbacks"] == 0
        assert client.get("/v1/model").json()["model_id"] == before["model_id"]
        body = assert_error(client.post("/v1/admin/rollback"), 409, "no_previous_version")
        assert "no earlier version" in body["message"]
        assert client.get("/v1/model").json()["model_id"] == before["model_id"]
        assert record(shelf)["history"] == [] and \
            record(shelf)["serving"]["name"] == "v1.safetensors"
        assert 'anomaly_hooks_model_reloads_total{model="default",result="ok"} 5.0' in client.get(
            "/metrics").text
        assert service.settings.model == os.path.realpath(shelf / "v1.safetensors")
    assert not [p for p in shelf.iterdir() if p.name.endswith(".tmp")]  # no leftovers


def test_a_plain_reload_is_recorded_too(shelf, tmp_path):
    """Every switch of the serving model goes through reload, and each is recorded."""
    with admin_server(shelf, tmp_path) as (client, _):
        r = client.post("/v1/admin/reload", json={"path": str(shelf / "v2.safetensors")})
        assert r.status_code == 200, r.text
        assert client.get("/v1/model").json()["version"]["previous"]["name"] == "v1.safetensors"
        assert client.post("/v1/admin/rollback").json()["version"] == "v1.safetensors"


def test_promote_and_rollback_need_a_token(shelf, tmp_path):
    with admin_server(shelf, tmp_path, token=None) as (client, service):
        before = service.engine
        for r in (promote(client, "v2.safetensors"), client.post("/v1/admin/rollback")):
            assert "--token" in assert_error(r, 403, "admin_disabled")["message"]
        assert service.engine is before
        assert client.get("/v1/models/versions").status_code == 200  # reading needs none
    with admin_server(shelf, tmp_path) as (client, _):
        client.headers.pop("Authorization")
        assert_error(promote(client, "v2.safetensors"), 401, "unauthorized")
        assert_error(client.post("/v1/admin/rollback"), 401, "unauthorized")


@pytest.mark.parametrize("kw", [
    {"content": b"[1,2", "headers": {"Content-Type": "application/json"}},
    {"content": b"[" * 100_000 + b"]" * 100_000, "headers": {"Content-Type": "application/json"}},
    {"json": [1, 2]}, {"json": {}}, {"json": {"version": 3}}, {"json": {"version": ""}},
    {"json": {"version": "v2.safetensors", "path": "/etc/passwd"}},
    {"json": {"version": "x" * 300}}, {"content": b"v2.safetensors"}, {}])
def test_bad_promote_bodies_are_422(shelf, tmp_path, kw):
    with admin_server(shelf, tmp_path) as (client, service):
        before = service.engine
        assert_error(client.post("/v1/admin/promote", **kw), 422, "invalid_parameter")
        assert service.engine is before


def test_unknown_versions_are_404(shelf, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.copy(shelf / "v2.safetensors", outside)
    (shelf / "link.safetensors").symlink_to(outside)
    with admin_server(shelf, tmp_path) as (client, service):
        before = service.engine
        for ref in ("v9.safetensors", "../outside.safetensors", str(shelf / "v2.safetensors"),
                    "0" * 12, "abc", "notes.txt", "/etc/passwd", "v2.safetensors\x00"):
            assert_error(promote(client, ref), 404, "not_found")
        assert_error(promote(client, "link.safetensors"), 403, "path_not_allowed")
        names = [r["name"] for r in client.get("/v1/models/versions").json()["versions"]]
        assert "link.safetensors" not in names  # a link leading out is no version
        assert service.engine is before


def test_files_being_written_are_never_served(shelf, tmp_path):
    """A file still being written -- a ``*.tmp`` name, or a model name whose bytes are not all
    there -- and a damaged one are refused by the loader; the serving model stays."""
    raw = (shelf / "v2.safetensors").read_bytes()
    (shelf / "half.safetensors").write_bytes(raw[:len(raw) // 2])
    (shelf / "v4.safetensors.tmp").write_bytes(raw)
    damaged = bytearray(raw)
    damaged[len(raw) // 2:len(raw) // 2 + 64] = b"\x00" * 64
    (shelf / "damaged.safetensors").write_bytes(bytes(damaged))
    with admin_server(shelf, tmp_path) as (client, service):
        before = service.engine
        body = assert_error(promote(client, "v4.safetensors.tmp"), 404, "not_found")
        assert "still being written" in body["message"]
        body = assert_error(promote(client, "half.safetensors"), 422, "reload_failed")
        assert "truncated" in body["message"] and before.model_id in body["message"]
        body = assert_error(promote(client, "damaged.safetensors"), 422, "reload_failed")
        assert "checksum" in body["message"]
        assert service.engine is before
        assert client.get("/v1/model").json()["version"]["rollbacks"] == 0
        # the half-written file, once complete, is promoted
        (shelf / "half.safetensors").write_bytes(raw)
        r = promote(client, "half.safetensors")
        assert r.status_code == 200 and r.json()["model_id"] == "padim-" + sha(
            shelf / "v2.safetensors")[:12], r.text
    assert not (shelf / "v4.safetensors").exists()


def test_a_version_changed_since_it_was_listed_is_refused(shelf, tmp_path, monkeypatch):
    """Promoted by checksum: exactly that content or nothing (the file may change between the
    listing and the load)."""
    with admin_server(shelf, tmp_path) as (client, service):
        before = service.engine
        wanted = sha(shelf / "v2.safetensors")
        shelf_obj = service.versions
        resolve = shelf_obj.resolve

        def resolve_then_replace(ref, cancel=None):
            found = resolve(ref, cancel)
            shutil.copy(shelf / "v3.safetensors", shelf / "v2.safetensors")
            return found

        monkeypatch.setattr(shelf_obj, "resolve", resolve_then_replace)
        body = assert_error(promote(client, wanted[:10]), 422, "reload_failed")
        assert "changed" in body["message"]
        assert service.engine is before


def test_rollback_to_a_file_that_is_gone_is_409(shelf, tmp_path):
    with admin_server(shelf, tmp_path) as (client, service):
        assert promote(client, "v2.safetensors").status_code == 200
        os.unlink(shelf / "v1.safetensors")
        body = assert_error(client.post("/v1/admin/rollback"), 409, "no_previous_version")
        assert "v1.safetensors" in body["message"] and "no longer" in body["message"]
        assert service.engine.path == os.path.realpath(shelf / "v2.safetensors")
        assert client.get("/v1/model").json()["version"]["rollbacks"] == 1  # kept


def test_rollback_finds_the_previous_content_under_another_name(shelf, tmp_path):
    with admin_server(shelf, tmp_path, model="v2.safetensors") as (client, _):
        assert promote(client, "v3.safetensors").status_code == 200
        os.rename(shelf / "v2.safetensors", shelf / "v2-renamed.safetensors")
        r = client.post("/v1/admin/rollback")
        assert r.status_code == 200 and r.json()["version"] == "v2-renamed.safetensors", r.text


# ---- the record outlives the server ---------------------------------------------------------
def test_the_promoted_version_and_the_stack_outlive_a_restart(shelf, tmp_path):
    with admin_server(shelf, tmp_path) as (client, _):
        assert promote(client, "v2.safetensors").status_code == 200
        assert promote(client, "v3.safetensors").status_code == 200
    saved = record(shelf)
    assert saved["serving"]["name"] == "v3.safetensors"
    assert saved["model_option"] == os.path.realpath(shelf / "v1.safetensors")
    # a new app, same command line: the promoted version serves, the stack is there
    with admin_server(shelf, tmp_path) as (client, service):
        info = client.get("/v1/model").json()
        assert info["version"]["name"] == "v3.safetensors" and info["lineage"]["updates"] == 1
        assert info["version"]["previous"]["name"] == "v2.safetensors"
        assert service.settings.model == os.path.realpath(shelf / "v3.safetensors")
        assert client.post("/v1/admin/rollback").json()["version"] == "v2.safetensors"
    with admin_server(shelf, tmp_path) as (client, _):
        assert client.get("/v1/model").json()["version"]["name"] == "v2.safetensors"
        assert client.post("/v1/admin/rollback").json()["version"] == "v1.safetensors"
        assert_error(client.post("/v1/admin/rollback"), 409, "no_previous_version")


def test_a_new_model_option_wins_over_the_record(shelf, tmp_path):
    with admin_server(shelf, tmp_path) as (client, _):
        assert promote(client, "v3.safetensors").status_code == 200
    with admin_server(shelf, tmp_path, model="v2.safetensors") as (client, _):
        info = client.get("/v1/model").json()
        assert info["version"]["name"] == "v2.safetensors"
        assert info["version"]["previous"]["name"] == "v1.safetensors"  # the stack stays
    assert record(shelf)["serving"]["name"] == "v2.safetensors"
    assert record(shelf)["model_option"] == os.path.realpath(shelf / "v2.safetensors")


def test_a_promoted_file_that_broke_leaves_model_option_serving(shelf, tmp_path):
    with admin_server(shelf, tmp_path) as (client, _):
        assert promote(client, "v2.safetensors").status_code == 200
    raw = (shelf / "v2.safetensors").read_bytes()
    (shelf / "v2.safetensors").write_bytes(raw[:len(raw) // 3])  # overwritten in place, cut
    with admin_server(shelf, tmp_path) as (client, _):
        assert client.get("/v1/model").json()["version"]["name"] == "v1.safetensors"
    (shelf / "v2.safetensors").write_bytes(raw)
    (shelf / STATE_FILE).write_text('{"format": "anomaly_hooks.versions", "history": [1]')
    with admin_server(shelf, tmp_path) as (client, _):  # a damaged record: started without it
        assert client.get("/v1/model").json()["version"]["rollbacks"] == 0


def test_each_named_model_has_its_own_versions(shelf, tmp_path):
    """--model NAME=PATH: a promote or rollback of one model leaves the other serving as it
    was; each has its own serving version and rollback stack, in the record too, and both
    outlive a restart; the unnamed routes are the default model's."""
    paths = {"line-a": str(shelf / "v1.safetensors"), "line-b": str(shelf / "v2.safetensors")}

    def version(client, name):
        return client.get(f"/v1/models/{name}").json()["version"]

    def scored_by(client, name):
        return client.post(f"/v1/models/{name}/predict", content=defect_png()).json()[
            "model"]["sha256"]

    with admin_server(shelf, tmp_path, models=paths) as (client, _):
        r = client.post("/v1/admin/models/line-b/promote", json={"version": "v3.safetensors"})
        assert r.status_code == 200, r.text
        assert (r.json()["model"], r.json()["version"], r.json()["rollbacks"]) == (
            "line-b", "v3.safetensors", 1)
        assert scored_by(client, "line-b") == sha(shelf / "v3.safetensors")
        assert scored_by(client, "line-a") == sha(shelf / "v1.safetensors")
        assert version(client, "line-a")["name"] == "v1.safetensors"
        assert version(client, "line-a")["rollbacks"] == 0
        assert version(client, "line-b")["previous"]["name"] == "v2.safetensors"
        listing = client.get("/v1/models/line-b/versions").json()
        assert listing["model"] == "line-b" and listing["serving"]["name"] == "v3.safetensors"
        assert [v["name"] for v in listing["versions"] if v["serving"]] == ["v3.safetensors"]
        assert [h["name"] for h in listing["history"]] == ["v2.safetensors"]
        default = client.get("/v1/models/versions").json()
        assert (default["model"], default["serving"]["name"], default["history"]) == (
            "line-a", "v1.safetensors", [])
        # the unnamed routes: the default model's stack only
        assert promote(client, "v2.safetensors").json()["model"] == "line-a"
        r = client.post("/v1/admin/models/line-b/rollback")
        assert (r.json()["model"], r.json()["version"]) == ("line-b", "v2.safetensors"), r.text
        assert_error(client.post("/v1/admin/models/line-b/rollback"), 409, "no_previous_version")
        assert scored_by(client, "line-b") == sha(shelf / "v2.safetensors")
        assert version(client, "line-a")["previous"]["name"] == "v1.safetensors"
        assert client.post("/v1/admin/models/line-b/promote",
                           json={"version": sha(shelf / "v3.safetensors")[:10]}
                           ).json()["version"] == "v3.safetensors"
        assert_error(client.post("/v1/admin/models/nope/promote",
                                 json={"version": "v3.safetensors"}), 404, "not_found")
        assert_error(client.post("/v1/admin/models/nope/rollback"), 404, "not_found")
        assert_error(client.get("/v1/models/nope/versions"), 404, "not_found")
        assert_error(client.post("/v1/admin/models/line-b/promote", json={"version": "x.onnx"}),
                     404, "not_found")
        assert version(client, "line-b")["name"] == "v3.safetensors"
        unauthorised = client.post("/v1/admin/models/line-b/rollback",
                                   headers={"Authorization": "Bearer wrong"})
        assert unauthorised.status_code == 401
    saved = record(shelf)
    assert saved["serving"]["name"] == "v2.safetensors"  # the default model's, at the top
    assert saved["models"]["line-b"]["serving"]["name"] == "v3.safetensors"
    assert saved["models"]["line-b"]["model_option"] == os.path.realpath(paths["line-b"])
    assert [h["name"] for h in saved["models"]["line-b"]["history"]] == ["v2.safetensors"]
    with admin_server(shelf, tmp_path, models=paths) as (client, _):
        assert scored_by(client, "line-a") == sha(shelf / "v2.safetensors")
        assert scored_by(client, "line-b") == sha(shelf / "v3.safetensors")
        assert client.post("/v1/admin/models/line-b/rollback").json()["version"] == (
            "v2.safetensors")
        assert client.post("/v1/admin/rollback").json()["version"] == "v1.safetensors"
        assert version(client, "line-a")["rollbacks"] == version(client, "line-b")[
            "rollbacks"] == 0


# ---- the pieces -----------------------------------------------------------------------------
def test_the_record_is_written_atomically(tmp_path, monkeypatch):
    shelf = VersionShelf(str(tmp_path))
    entry = {"name": "a.safetensors", "checksum": "a" * 64}
    shelf.switched(None, entry)
    shelf.switched(entry, {"name": "b.safetensors", "checksum": "b" * 64})
    shelf.save(shelf.snapshot())
    assert VersionShelf(str(tmp_path)).load().history[0]["name"] == "a.safetensors"
    before = (tmp_path / STATE_FILE).read_bytes()

    def crash(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        shelf.save({**shelf.snapshot(), "history": []})
    assert (tmp_path / STATE_FILE).read_bytes() == before  # the old record, whole
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]  # no temporary file left


def test_the_record_keeps_one_track_per_model(tmp_path):
    """The default model's track at the top level (a record of one model reads as before),
    the others' under ``models``; a damaged track discards the record, whole."""
    shelf = VersionShelf(str(tmp_path))
    a, b = ({"name": f"{n}.safetensors", "checksum": n * 64} for n in "ab")
    shelf.switched(a, b)
    shelf.track("line-b").switched(b, a)
    shelf.track("line-b").model_option = "/m/b.safetensors"
    shelf.save(shelf.snapshot())
    saved = json.loads((tmp_path / STATE_FILE).read_text())
    assert saved["serving"]["name"] == "b.safetensors" and set(saved["models"]) == {"line-b"}
    again = VersionShelf(str(tmp_path)).load()
    assert [h["name"] for h in again.history] == ["a.safetensors"]
    assert again.track("line-b").serving["name"] == "a.safetensors"
    assert again.track("line-b").model_option == "/m/b.safetensors"
    assert [h["name"] for h in again.track("line-b").history] == ["b.safetensors"]
    assert again.track("line-c").serving is None and again.track("line-c").history == []
    (tmp_path / STATE_FILE).write_text(json.dumps({**saved, "models": {"line-b": {
        "serving": {"name": "x", "checksum": "not hex"}}}}))
    broken = VersionShelf(str(tmp_path)).load()
    assert not broken.recorded and broken.history == []


def test_lineage_is_read_defensively():
    assert lineage_summary(None) is None and lineage_summary([]) is None
    assert lineage_summary("x") is None
    summary = lineage_summary([{"images_added": 5}, "junk", {"images_added": True,
                               "parent_checksum": 7, "labels_used": -1, "time": "t" * 999}])
    assert summary == {"updates": 3, "images_added": 5, "parent_checksum": None,
                       "labels_used": None, "last_update": "t" * 200}


# ---- a real server, killed during promotes --------------------------------------------------
def _writer(folder: Path, raw: bytes, stop: threading.Event) -> None:
    """Write ``incoming.safetensors`` again and again in place, slowly (never complete for
    long), and an atomic writer's ``.tmp`` beside it."""
    rng = random.Random(1)
    while not stop.is_set():
        with open(folder / "incoming.safetensors", "wb") as fh:
            for i in range(0, len(raw), len(raw) // 8 + 1):
                fh.write(raw[i:i + len(raw) // 8 + 1])
                fh.flush()
                time.sleep(rng.uniform(0.0, 0.02))
                if stop.is_set():
                    return
        (folder / "incoming.safetensors.tmp").write_bytes(raw[:rng.randrange(len(raw))])


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_kill9_during_promotes_never_serves_a_half_written_model(fitted, shelf_files, tmp_path):
    import httpx

    folder = tmp_path / "shelf"
    folder.mkdir()
    for path in shelf_files.values():
        shutil.copy(path, folder / path.name)
    save_model_variant(fitted, folder / "v4.safetensors", threshold_factor=2.0)
    complete = {sha(p) for p in folder.iterdir()}
    raw = (folder / "v2.safetensors").read_bytes()
    args = ("--models-dir", str(folder), "--token", TOKEN, "--no-results")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    stop = threading.Event()
    writer = threading.Thread(target=_writer, args=(folder, raw, stop))
    writer.start()
    server = ServerProcess(folder / "v1.safetensors", tmp_path, *args).wait_ready()
    seen: list = []
    answers: dict = {}
    try:
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
            rng = random.Random(0)
            choices = ["v1.safetensors", "v2.safetensors", "v3.safetensors", "v4.safetensors",
                       "incoming.safetensors", "incoming.safetensors.tmp"]
            kill_after = time.monotonic() + 20
            killer = None
            while True:
                version = rng.choice(choices)
                if killer is None and time.monotonic() > kill_after:
                    # kill -9 while this promote (or the next) runs
                    killer = threading.Timer(rng.uniform(0.0, 0.3), server.kill9)
                    killer.start()
                try:
                    r = client.post("/v1/admin/promote", json={"version": version})
                    answers[r.status_code] = answers.get(r.status_code, 0) + 1
                    assert r.status_code in (200, 404, 422), r.text
                    served = client.get("/v1/model").json()["file_sha256"]
                except httpx.HTTPError:
                    break  # killed
                assert served in complete, f"serving {served}, not a complete version"
                seen.append(served)
                assert time.monotonic() < kill_after + 60, "the server was not killed"
    finally:
        stop.set()
        writer.join(30)
        server.stop()
    assert answers.get(200, 0) >= 5 and answers.get(422, 0) >= 1 and answers.get(404, 0) >= 1, \
        answers
    assert len(set(seen)) >= 2
    # the record is whole (old or new, never half), and names a complete version
    saved = record(folder)
    assert saved["serving"]["checksum"] in complete
    named = folder / saved["serving"]["name"]
    expected = saved["serving"]["checksum"] if (named.is_file() and sha(named)
                                                == saved["serving"]["checksum"]) \
        else sha(folder / "v1.safetensors")
    with ServerProcess(folder / "v1.safetensors", tmp_path, *args) as again:
        info = httpx.get(again.url + "/v1/model", headers=headers, timeout=30).json()
        assert info["file_sha256"] == expected and info["file_sha256"] in complete
        r = httpx.post(again.url + "/v1/predict", content=defect_png(), headers=headers,
                       timeout=60)
        assert r.status_code == 200 and r.json()["model"]["sha256"] == expected


def test_an_exported_model_is_a_version_too(fitted, shelf, tmp_path):
    """An ``.onnx`` export in the folder is listed (its method from its verified metadata) and
    promoted like any version: the service switches engines."""
    pytest.importorskip("onnx", reason="the [export] extra is not installed")
    pytest.importorskip("onnxruntime", reason="ONNX Runtime is not installed")
    from anomaly_hooks.export import export_onnx

    export_onnx(fitted, shelf / "v5.onnx")
    with admin_server(shelf, tmp_path) as (client, _):
        rows = {r["name"]: r for r in client.get("/v1/models/versions").json()["versions"]}
        row = rows["v5.onnx"]
        assert row["engine"] == "onnx" and row["method"] == "padim" and not row["problem"]
        assert row["checksum"] == sha(shelf / "v5.onnx") and row["lineage"] is None
        r = promote(client, "v5.onnx")
        assert r.status_code == 200, r.text
        info = client.get("/v1/model").json()
        assert info["engine"] == "onnx" and info["version"]["name"] == "v5.onnx"
        assert client.post("/v1/admin/rollback").json()["version"] == "v1.safetensors"
        assert client.get("/v1/model").json()["engine"] == "torch"
