"""The results-log routes (routes/results.py) in process: queries, paging, pictures, the CSV
export, retention, and every refused parameter answered with a 4xx JSON (never a 500)."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
import serve_helpers  # noqa: E402
from serve_helpers import assert_error, defect_png, good_png, serving  # noqa: E402

from anomaly_hooks.serve.results import MAX_ID  # noqa: E402

models = serve_helpers.models
HUGE = "99999999999999999999999"  # beyond a 64-bit integer


@pytest.fixture(scope="module")
def api(models, tmp_path_factory):
    with serving(models["good"], tmp_path_factory.mktemp("serve_results")) as (client, service):
        client.post("/v1/predict", content=defect_png(9))  # one record with every picture
        yield client, service


def _log(store_factory) -> dict:
    """The ``serving`` settings of the store under test: the default results.sqlite, or the
    PostgreSQL database as ``--results-db`` (pictures under the results folder in both)."""
    return {} if store_factory.kind == "sqlite" else {"results_db": store_factory.spec}


def test_results_log_query_pictures_and_csv(models, tmp_path, store_factory):
    with serving(models["good"], tmp_path, **_log(store_factory)) as (client, _):
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
        for key in ("score", "normalized_score", "is_anomalous", "threshold",
                    "anomalous_pixels", "part_id", "request_id"):
            assert rec[key] == bad[key], key  # the log holds what the answer said
        good_rec = client.get(f"/v1/results/{ids[0]['id']}").json()
        assert good_rec["overlay_url"] is None and good_rec["thumb_url"]      # only a thumbnail
        assert client.get(rec["overlay_url"]).headers["content-type"] == "image/png"
        assert client.get(rec["thumb_url"]).headers["content-type"] == "image/jpeg"
        assert_error(client.get(f"/v1/results/{ids[0]['id']}/overlay.png"), 404, "not_found")
        csv_text = client.get("/v1/results.csv?anomalous=false").text
        lines = csv_text.strip().splitlines()
        assert lines[0].startswith("id,time_iso") and len(lines) == 4
        assert client.get("/v1/results.csv?limit=1").text.count("\n") == 2
        assert "path" not in "".join(rec)  # no server paths in JSON


def test_retention_removes_records_and_pictures(models, tmp_path, store_factory):
    with serving(models["good"], tmp_path, retention_count=2, keep_images="all",
                 **_log(store_factory)) as (client, service):
        kind = {"sqlite": "SQLiteResultStore", "postgres": "PostgresResultStore"}
        assert type(service.store).__name__ == kind[store_factory.kind]
        for i in range(5):
            client.post("/v1/predict", content=good_png(40 + i))
        pictures = list((tmp_path / "results" / "images").rglob("*.*"))
        assert len(pictures) == 15
        removed = client.portal.call(service.prune)
        assert removed == 3 and client.get("/v1/results").json()["count"] == 2
        assert len(list((tmp_path / "results" / "images").rglob("*.*"))) == 6


@pytest.mark.parametrize("keep", ["anomalous", "all"])
def test_originals_kept_as_sent_and_removed_by_retention(models, tmp_path, keep):
    """``--keep-originals``: the upload itself, byte for byte, with its own format's
    extension, at ``/v1/results/{id}/original`` (anomalous: only for flagged images); the
    retention removes it with its record."""
    from conftest import textured_images
    from serve_helpers import encode

    jpeg = encode(textured_images(1, seed=61)[0], "JPEG", quality=90)
    with serving(models["good"], tmp_path, keep_originals=keep, keep_images="none",
                 thumbnails=False, retention_count=2) as (client, service):
        good = client.post("/v1/predict", content=jpeg).json()
        bad = client.post("/v1/predict", content=defect_png(62)).json()
        assert bad["is_anomalous"] and not good["is_anomalous"]
        assert client.get(bad["original_url"]).content == defect_png(62)
        assert client.get(bad["original_url"]).headers["content-type"] == "image/png"
        rec = client.get(f"/v1/results/{good['id']}").json()
        if keep == "all":
            assert client.get(rec["original_url"]).content == jpeg
            assert client.get(rec["original_url"]).headers["content-type"] == "image/jpeg"
        else:
            assert rec["original_url"] is None and "original_url" not in good
            assert_error(client.get(f"/v1/results/{good['id']}/original"), 404, "not_found")
        kept = sorted(p.name for p in (tmp_path / "results" / "images").rglob("*.*"))
        assert kept == sorted([f"{bad['request_id']}_original.png"]
                              + ([f"{good['request_id']}_original.jpg"] if keep == "all"
                                 else []))
        client.post("/v1/predict", content=good_png(63))
        client.post("/v1/predict", content=good_png(64))
        client.portal.call(service.prune)  # the two newest stay: the first two originals go
        left = {p.name for p in (tmp_path / "results" / "images").rglob("*.*")}
        assert not left & set(kept) and len(left) == (2 if keep == "all" else 0)


@pytest.mark.parametrize("keep", ["anomalous", "all"])
def test_network_inputs_kept_beside_originals(models, tmp_path, keep):
    """``--keep-inputs``: beside each kept original its network input, the tensor the
    library's loader makes of that file (bit for bit), as a KeptImage reads it; none beside
    an image whose original is not kept; the retention removes it with its record."""
    import torch
    from conftest import textured_images
    from serve_helpers import encode

    from anomaly_hooks.data import load_preprocessed
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.images import DEFAULT_MAX_PIXELS
    from anomaly_hooks.keptinputs import KeptImage, load, mismatch

    jpeg = encode(textured_images(1, seed=71)[0], "JPEG", quality=90)
    pre = Detector.load(models["good"]).preprocessor
    with serving(models["good"], tmp_path, keep_originals=keep, keep_inputs=True,
                 keep_images="none", thumbnails=False, retention_count=2) as (client, service):
        good = client.post("/v1/predict", content=jpeg).json()
        bad = client.post("/v1/predict", content=defect_png(72)).json()
        assert bad["is_anomalous"] and not good["is_anomalous"]
        images = tmp_path / "results" / "images"
        kept = {p.name: p for p in images.rglob("*.*")}
        for res, ext in ([bad, "png"], [good, "jpg"])[:2 if keep == "all" else 1]:
            original = kept[f"{res['request_id']}_original.{ext}"]
            item = KeptImage(original, kept[f"{res['request_id']}_input.safetensors"])
            assert mismatch(item.input, pre) is None
            want = load_preprocessed(original, pre, DEFAULT_MAX_PIXELS)
            got = load(item, pre)
            assert torch.equal(got[0], want[0]) and got[1] == want[1]
        assert len(kept) == (4 if keep == "all" else 2)
        client.post("/v1/predict", content=good_png(73))
        client.post("/v1/predict", content=good_png(74))
        client.portal.call(service.prune)  # the two newest stay: the first two go
        left = {p.name for p in images.rglob("*.*")}
        assert not left & set(kept) and len(left) == (4 if keep == "all" else 0)


def test_unknown_results_and_pictures_are_404(api):
    client, _ = api
    assert_error(client.get("/v1/results/999999"), 404, "not_found")
    assert_error(client.get(f"/v1/results/{MAX_ID}"), 404, "not_found")
    assert_error(client.get(f"/v1/results/{MAX_ID}/overlay.png"), 404, "not_found")
    assert_error(client.get("/v1/results/1/secret.txt"), 404, "not_found")
    assert client.get("/v1/results/1/overlay.png").status_code == 200


@pytest.mark.parametrize("query", ["limit=0", "limit=5000", "since=yesterday", "anomalous=maybe",
                                   "before_id=-3", "since=nan", "until=inf", "since=-1e999",
                                   "since=" + "9" * 400, "until=2026-13-45T10:00:00Z",
                                   "since=" + "1" * 65, "part_id=" + "p" * 201])
def test_bad_result_queries_are_422(api, query):
    client, _ = api
    assert_error(client.get("/v1/results?" + query), 422, "invalid_parameter")
    if not query.startswith(("limit=", "before_id=")):  # the CSV: no paging, any limit
        assert_error(client.get("/v1/results.csv?" + query), 422, "invalid_parameter")


@pytest.mark.parametrize("url, name", [
    (f"/v1/results/{HUGE}", "record_id"), (f"/v1/results/{HUGE}/overlay.png", "record_id"),
    (f"/v1/results/{MAX_ID + 1}", "record_id"), ("/v1/results/0", "record_id"),
    ("/v1/results/-5/mask.png", "record_id"), (f"/v1/results?before_id={HUGE}", "before_id"),
    (f"/v1/results?limit={HUGE}", "limit"), (f"/v1/results.csv?limit={HUGE}", "limit"),
    ("/v1/results/1.5", "record_id"), ("/v1/results/1e3", "record_id")])
def test_integers_beyond_the_store_are_422_not_500(api, url, name):
    """Every integer parameter is bounded to what SQLite holds (a signed 64-bit integer)."""
    client, _ = api
    body = assert_error(client.get(url), 422, "invalid_parameter")
    assert f"parameter '{name}'" in body["message"], body


def test_largest_ids_are_valid_queries(api):
    client, _ = api
    page = client.get(f"/v1/results?before_id={MAX_ID}&limit=1000").json()
    assert page["count"] >= 1
    assert client.get(f"/v1/results.csv?limit={MAX_ID}").status_code == 200


# ---- rows and paths the service did not write -----------------------------------------------
def _forge(service, **values) -> int:
    """A row written into the results log behind the service's back; its id."""
    import sqlite3

    row = {"time": 1.7e9, "request_id": "forged", "score": 1.0, "normalized_score": 0.5,
           "is_anomalous": 0, "threshold": 2.0, "model_id": "m", "model_checksum": "c",
           **values}
    con = sqlite3.connect(service.store.path)
    with con:
        cur = con.execute(f"INSERT INTO results ({', '.join(row)}) "
                          f"VALUES ({', '.join('?' for _ in row)})", list(row.values()))
    con.close()
    return int(cur.lastrowid)


@pytest.mark.parametrize("values", [
    {"score": float("inf"), "threshold": float("-inf"), "latency_ms": float("inf")},
    {"time": float("inf")}, {"time": 1e300}, {"time": "yesterday"},
    {"score": "high", "normalized_score": b"\x00", "is_anomalous": "yes"},
    {"width": 1.5, "height": "wide", "anomalous_pixels": float("inf")},
    {"request_id": 12345, "model_id": b"\xff\xfe", "part_id": 7, "source": b"bytes"}])
def test_no_row_breaks_a_route(api, values):
    """Whatever a row holds (written by hand, or by another program), every route that lists
    it answers 200: a non-finite or mistyped number as null."""
    client, service = api
    rid = _forge(service, **values)
    for url in (f"/v1/results/{rid}", f"/v1/results?before_id={rid + 1}&limit=1",
                "/v1/results.csv?limit=5"):
        r = client.get(url)
        assert r.status_code == 200, (url, r.text)
    record = client.get(f"/v1/results/{rid}").json()
    if "score" in values and not isinstance(values["score"], float):
        assert record["score"] is None
    if values.get("time") == float("inf"):
        assert record["time"] is None and record["time_iso"] is None


@pytest.mark.parametrize("path", [
    "../../../../../../etc/passwd", "/etc/passwd", "images/../../outside.png",
    "images/link.png", "images/\x00.png", "images/" + "x" * 5000 + ".png", ""])
def test_stored_picture_paths_cannot_leave_the_results_folder(api, path, tmp_path):
    """A row whose picture path points outside the results folder (by ``..``, an absolute
    path, a symbolic link out of it) or is no path at all: 404, never the file."""
    client, service = api
    root = service.files.root
    outside = root.parent / "outside.png"
    outside.write_bytes(b"\x89PNG secret")
    link = root / "images" / "link.png"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(outside)
    rid = _forge(service, overlay_path=path)
    r = client.get(f"/v1/results/{rid}/overlay.png")
    if path:
        assert_error(r, 404, "not_found")
    else:
        assert r.status_code == 404
    assert b"secret" not in r.content


@pytest.mark.parametrize("picture", [
    "..%2F..%2F..%2Fetc%2Fpasswd", "%2e%2e", "overlay.png%00", "overlay.png%2F..%2F..",
    "%2e%2e%2fresults.sqlite", "thumb.jpg%2F..%2F..%2Fresults.sqlite", "OVERLAY.PNG"])
def test_picture_names_are_the_three_kinds_only(api, picture):
    """Percent-encoded, the dots and slashes reach the server as they are (an HTTP client
    folds plain ``..`` segments itself): a picture name is one of three, or 404."""
    client, _ = api
    r = client.get(f"/v1/results/1/{picture}")
    assert r.status_code == 404 and r.json()["code"] == "not_found", (picture, r.text)
    assert b"SQLite" not in r.content


# ---- operator labels ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def admin_api(models, tmp_path_factory):
    """A server with a token (labels are an admin route) and the id of one unlabelled result."""
    from serve_helpers import TOKEN

    with serving(models["good"], tmp_path_factory.mktemp("serve_labels"), token=TOKEN) as (
            client, service):
        rid = client.post("/v1/predict", content=good_png()).json()["id"]
        yield client, service, rid


def test_label_results_over_http(models, tmp_path, store_factory):
    """POST /v1/results/{id}/label on a server with a token, on either store: the label, its
    note, who (the token's fingerprint) and when, in the record, the filters and the CSV."""
    import hashlib

    from serve_helpers import TOKEN

    with serving(models["good"], tmp_path, token=TOKEN, **_log(store_factory)) as (client, _):
        ids = [client.post("/v1/predict", content=good_png(50 + i)).json()["id"]
               for i in range(3)]
        r = client.post(f"/v1/results/{ids[0]}/label", json={"label": "defect", "note": "dent"})
        assert r.status_code == 200, r.text
        body = r.json()
        fingerprint = "token:" + hashlib.sha256(TOKEN.encode()).hexdigest()[:12]
        assert (body["id"], body["label"], body["label_note"], body["label_by"]) == (
            ids[0], "defect", "dent", fingerprint)
        assert body["label_at_iso"].endswith("Z") and TOKEN not in r.text
        r = client.post(f"/v1/results/{ids[1]}/label", json={"label": "good"})
        assert r.json()["label_note"] is None
        assert client.get(f"/v1/results/{ids[0]}").json()["label"] == "defect"

        def listed(query: str) -> list:
            return [x["id"] for x in client.get("/v1/results?" + query).json()["results"]]

        assert listed("label=defect") == [ids[0]] and listed("label=good") == [ids[1]]
        assert listed("label=none") == [ids[2]]
        client.post(f"/v1/results/{ids[0]}/label", json={"label": "good", "note": "no, fine"})
        assert listed("label=good") == [ids[1], ids[0]] and listed("label=defect") == []
        csv_text = client.get("/v1/results.csv?label=good").text
        header, *rows = csv_text.strip().splitlines()
        assert header.endswith(",label,label_note,label_by,label_at_iso,model_name,original_path")
        assert len(rows) == 2
        assert f",good,\"no, fine\",{fingerprint}," in rows[1]


@pytest.mark.parametrize("body", [
    {"label": "maybe"}, {"label": "Good"}, {}, {"label": None}, {"label": "good", "note": 5},
    {"label": "good", "note": "x" * 501}, {"label": "good", "who": "me"},
    ["good"], "good"])
def test_bad_labels_are_422(admin_api, body):
    client, service, rid = admin_api
    message = assert_error(client.post(f"/v1/results/{rid}/label", json=body), 422,
                           "invalid_parameter")["message"]
    assert "body" in message
    assert service.store.get(rid).label is None


def test_label_refusals_unknown_ids_auth_and_bodies(admin_api):
    client, _, rid = admin_api
    ok = {"label": "good"}
    assert_error(client.post("/v1/results/999999/label", json=ok), 404, "not_found")
    assert_error(client.post(f"/v1/results/{MAX_ID + 1}/label", json=ok), 422,
                 "invalid_parameter")
    assert_error(client.post(f"/v1/results/{rid}/label", json=ok,
                             headers={"Authorization": "Bearer wrong-token-here"}), 401,
                 "unauthorized")
    for raw in (b"{not json", b"", b"[" * 100_000 + b"]" * 100_000):
        r = client.post(f"/v1/results/{rid}/label", content=raw,
                        headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (raw[:10], r.status_code, r.text)
    r = client.post(f"/v1/results/{rid}/label", content=b" " * (2 << 20),
                    headers={"content-type": "application/json"})
    assert_error(r, 413, "payload_too_large")
    assert client.get(f"/v1/results/{rid}").json()["label"] is None


def test_labels_are_an_admin_route(api):
    """A server without a token answers 403 admin_disabled, as the other admin routes."""
    client, service = api
    rid = service.store.query(limit=1)[0].id
    assert_error(client.post(f"/v1/results/{rid}/label", json={"label": "good"}), 403,
                 "admin_disabled")
    assert_error(client.get("/v1/results?label=maybe"), 422, "invalid_parameter")
    assert_error(client.get("/v1/results.csv?label=maybe"), 422, "invalid_parameter")
    assert client.get("/v1/results?label=none").json()["count"] >= 1
