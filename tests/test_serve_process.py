"""The inspection service as a real process (uvicorn on a free loopback port): kill -9
durability of the results log, SIGHUP reload under load, the command line, batching over HTTP,
the admin routes and the API docs."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
httpx = pytest.importorskip("httpx", reason="httpx is not installed")

from conftest import ROOT  # noqa: E402
from serve_helpers import (  # noqa: E402
    TOKEN,
    ServerProcess,
    defect_png,
    good_png,
    hostile_payloads,
    locked_by_another_process,
    model_variants,
)

# every test here starts a server process: slow (the README's test command runs them)
pytestmark = [pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
              pytest.mark.slow]
TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def model_files(fitted, tmp_path_factory):
    return model_variants(fitted, tmp_path_factory.mktemp("serve_proc_models"))


def _load(url: str, stop: threading.Event, out: list, errors: list, seed: int) -> None:
    """One client: predictions until ``stop``; acknowledged results into ``out``."""
    with httpx.Client(timeout=60) as client:
        i = 0
        while not stop.is_set():
            i += 1
            body = defect_png(seed * 1000 + i) if i % 4 == 0 else good_png(seed * 1000 + i)
            try:
                r = client.post(url + f"/v1/predict?part_id=c{seed}-{i}", content=body)
            except httpx.HTTPError as exc:  # the server was killed mid-request
                errors.append(repr(exc))
                continue
            if r.status_code == 200:
                out.append(r.json())
            else:
                errors.append(f"{r.status_code} {r.text}")


def test_kill9_loses_no_acknowledged_result(model_files, tmp_path):
    results = tmp_path / "results"
    server = ServerProcess(model_files["good"], tmp_path, "--results-dir", str(results),
                           "--max-wait-ms", "5", "--keep-images", "all").wait_ready()
    acked: list = []
    errors: list = []
    stop = threading.Event()
    try:
        threads = [threading.Thread(target=_load, args=(server.url, stop, acked, errors, s))
                   for s in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while len(acked) < 30:
            assert time.monotonic() < deadline, (errors, server.log())
            time.sleep(0.01)
        server.kill9()          # while requests are in flight
        n_acked = len(acked)
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        server.stop()
    acked = acked[:]
    assert len(acked) >= n_acked >= 30
    con = sqlite3.connect(results / "results.sqlite")
    rows = {r[0]: r[1:] for r in con.execute(
        "SELECT request_id, id, score, is_anomalous, part_id, overlay_path FROM results")}
    con.close()
    lost = [a["request_id"] for a in acked if a["request_id"] not in rows]
    assert not lost, f"{len(lost)} acknowledged results lost"
    for a in acked:
        rid, score, anomalous, part_id, overlay = rows[a["request_id"]]
        assert (rid, score, bool(anomalous), part_id) == (a["id"], a["score"],
                                                          a["is_anomalous"], a["part_id"])
        assert (results / overlay).is_file()
    # a new server on the same log carries on
    with ServerProcess(model_files["good"], tmp_path, "--results-dir", str(results)) as again:
        listed = httpx.get(again.url + "/v1/results?limit=1000").json()
        assert {a["id"] for a in acked} <= {r["id"] for r in listed["results"]}
        new = httpx.post(again.url + "/v1/predict", content=good_png()).json()
        assert new["id"] > max(a["id"] for a in acked)


def _db_rows(url: str) -> dict:
    """request_id -> [(id, score, is_anomalous, part_id, overlay_path), ...] of a PostgreSQL
    results log (a list: a request recorded twice would show)."""
    import psycopg

    rows: dict = {}
    with psycopg.connect(url) as con:
        for r in con.execute("SELECT request_id, id, score, is_anomalous, part_id, "
                             "overlay_path FROM results"):
            rows.setdefault(r[0], []).append(r[1:])
    return rows


def _each_once(acked: list, rows: dict) -> None:
    """Every acknowledged result is in the log exactly once, as it was answered."""
    lost = [a["request_id"] for a in acked if a["request_id"] not in rows]
    assert not lost, f"{len(lost)} acknowledged results lost"
    twice = [k for k, v in rows.items() if len(v) != 1]
    assert not twice, f"{len(twice)} results recorded more than once"
    for a in acked:
        [(rid, score, anomalous, part_id, _)] = rows[a["request_id"]]
        assert (rid, score, anomalous, part_id) == (a["id"], a["score"], a["is_anomalous"],
                                                    a["part_id"])


def _listed_ids(url: str) -> set:
    """Every id ``GET /v1/results`` lists, page by page."""
    ids: set = set()
    before = None
    while True:
        params = {"limit": 1000, **({"before_id": before} if before else {})}
        r = httpx.get(url + "/v1/results", params=params, timeout=60)
        assert r.status_code == 200, r.text
        page = r.json()
        ids |= {r["id"] for r in page["results"]}
        before = page["next_before_id"]
        if before is None:
            return ids


def _wait_for(acked: list, n: int, errors: list, *servers: ServerProcess) -> None:
    deadline = time.monotonic() + 180
    while len(acked) < n:
        assert time.monotonic() < deadline, (errors[-5:], [s.log()[-3000:] for s in servers])
        time.sleep(0.01)


def test_kill9_with_postgres_loses_no_acknowledged_result(model_files, tmp_path, postgres_url):
    """The results log on a PostgreSQL server: kill -9 under load, every acknowledged result
    is there exactly once, and a restarted server carries on with the same log."""
    results = tmp_path / "results"
    args = ("--results-db", postgres_url, "--results-dir", str(results), "--max-wait-ms", "5",
            "--keep-images", "all")
    server = ServerProcess(model_files["good"], tmp_path, *args).wait_ready()
    acked: list = []
    errors: list = []
    stop = threading.Event()
    threads = [threading.Thread(target=_load, args=(server.url, stop, acked, errors, s))
               for s in range(6)]
    try:
        for t in threads:
            t.start()
        _wait_for(acked, 30, errors, server)
        server.kill9()          # while requests are in flight
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        server.stop()
    acked = acked[:]
    assert len(acked) >= 30
    rows = _db_rows(postgres_url)
    _each_once(acked, rows)
    assert all((results / rows[a["request_id"]][0][4]).is_file() for a in acked)
    with ServerProcess(model_files["good"], tmp_path, *args) as again:
        assert {a["id"] for a in acked} <= _listed_ids(again.url)
        new = httpx.post(again.url + "/v1/predict", content=good_png()).json()
        assert new["id"] > max(a["id"] for a in acked)


def test_a_killed_database_server_answers_503_then_serves_again(model_files, tmp_path,
                                                              own_postgres_server):
    """kill -9 of the PostgreSQL server under a running service: predictions and reads of the
    log answer 503 ``results_unavailable`` at once (a clear body, no traceback, no hang);
    once the server is started again on its data, the same service process serves again,
    and every acknowledged result is in the log once."""
    pg = own_postgres_server
    url = pg.url(pg.new_database())
    results = tmp_path / "results"
    with ServerProcess(model_files["good"], tmp_path, "--results-db", url, "--results-dir",
                       str(results), "--max-wait-ms", "5", "--keep-images", "all") as server:
        def predict(i: int) -> httpx.Response:
            return httpx.post(server.url + f"/v1/predict?part_id=p{i}", content=good_png(i),
                              timeout=60)

        acked = [predict(i) for i in range(4)]
        assert [r.status_code for r in acked] == [200] * 4
        pg.kill9()
        for answer in (predict(10), httpx.get(server.url + "/v1/results", timeout=60)):
            assert answer.status_code == 503, answer.text
            body = answer.json()
            assert body["code"] == "results_unavailable" and body["status"] == 503
            assert "results log is unavailable" in body["message"], body
            assert str(pg.port) in body["message"] and "Traceback" not in body["message"]
            assert int(answer.headers["Retry-After"]) >= 1
            assert answer.elapsed.total_seconds() < 10  # refused at once, no hang
        assert httpx.get(server.url + "/healthz").status_code == 200
        pg.restart()
        again = [predict(20 + i) for i in range(3)]
        assert [r.status_code for r in again] == [200] * 3, [r.text for r in again]
        acked = [r.json() for r in acked + again]
        assert {a["id"] for a in acked} <= _listed_ids(server.url)
        rows = _db_rows(url)
        _each_once(acked, rows)
        log = server.log()
    # the pictures of the refused predictions went with them: each kept file has its row
    kept = {p.name.split("_", 1)[0] for p in (results / "images").rglob("*.*")}
    assert kept == set(rows), kept ^ set(rows)
    assert "results log is unavailable" in log and "reachable again" in log
    assert "Traceback" not in log, log[-3000:]


def _fill_results(url: str, n: int) -> None:
    """``n`` results in the PostgreSQL log at ``url`` (schema created by the store), in one
    statement."""
    import psycopg

    from anomaly_hooks.serve.stores import open_store

    open_store(url).close()
    with psycopg.connect(url) as con:
        con.execute("INSERT INTO results (time, request_id, score, normalized_score, "
                    "is_anomalous, threshold, model_id, model_checksum, part_id, source) "
                    "SELECT 1000 + g, 'r' || g, g, 0.5, false, 10, 'm', repeat('c', 64), "
                    "'P' || g, repeat('s', 100) FROM generate_series(1, %s) AS g", [n])


def test_a_csv_export_cut_by_a_database_crash_is_an_incomplete_transfer(model_files, tmp_path,
                                                                       own_postgres_server):
    """``/v1/results.csv`` while the PostgreSQL server dies: a crash mid-export aborts the
    transfer (the client sees an incomplete chunked body, never a 200 with a short file that
    parses as complete); an export asked while the server is down is a clean 503
    ``results_unavailable``; once it is back the export is whole."""
    pg = own_postgres_server
    url = pg.url(pg.new_database())
    n = 40_000  # ~10 MB of CSV: more than the socket buffers hold, so the export is mid-way
    _fill_results(url, n)
    with ServerProcess(model_files["good"], tmp_path, "--results-db", url) as server:
        received = bytearray()
        with pytest.raises(httpx.RemoteProtocolError):
            with httpx.stream("GET", server.url + "/v1/results.csv", timeout=60) as r:
                assert r.status_code == 200
                chunks = r.iter_raw()
                received += next(chunks)
                pg.kill9()
                time.sleep(0.5)
                for chunk in chunks:
                    received += chunk
        assert 0 < received.count(b"\n") - 1 < n  # cut: some rows, not all
        down = httpx.get(server.url + "/v1/results.csv", timeout=60)
        assert down.status_code == 503, down.text[:300]
        assert down.json()["code"] == "results_unavailable" and down.headers["Retry-After"]
        pg.restart()
        whole = httpx.get(server.url + "/v1/results.csv", timeout=60)
        assert whole.status_code == 200 and whole.text.count("\n") == n + 1
        log = server.log()
    assert "the CSV export was cut" in log, log[-3000:]


def _alternating(urls: list, stop: threading.Event, out: list, errors: list, seed: int
                 ) -> None:
    """One client sending its predictions to each server in turn until ``stop``."""
    with httpx.Client(timeout=60) as client:
        i = 0
        while not stop.is_set():
            i += 1
            url = urls[(seed + i) % len(urls)]
            body = defect_png(seed * 1000 + i) if i % 4 == 0 else good_png(seed * 1000 + i)
            try:
                r = client.post(url + f"/v1/predict?part_id=c{seed}-{i}", content=body)
            except httpx.HTTPError as exc:  # that server was killed
                errors.append(repr(exc))
                time.sleep(0.01)
                continue
            if r.status_code == 200:
                out.append({**r.json(), "server": url})
            else:
                errors.append(f"{r.status_code} {r.text}")


def test_two_replicas_on_one_database_survive_a_kill9(model_files, tmp_path, postgres_url):
    """Two service processes started together on one PostgreSQL log (the migrations run
    once), 8 client threads alternating between them; one is killed with -9 under load: every
    acknowledged result, by either, is in the log exactly once, and the survivor lists all."""
    args = ("--results-db", postgres_url, "--results-dir", str(tmp_path / "results"),
            "--max-wait-ms", "5")
    first = ServerProcess(model_files["good"], tmp_path, *args)
    second = ServerProcess(model_files["good"], tmp_path, *args)
    acked: list = []
    errors: list = []
    stop = threading.Event()
    threads = [threading.Thread(target=_alternating,
                                args=([first.url, second.url], stop, acked, errors, s))
               for s in range(8)]
    try:
        first.wait_ready()
        second.wait_ready()
        for t in threads:
            t.start()
        _wait_for(acked, 40, errors, first, second)
        first.kill9()
        n_before = len(acked)
        _wait_for(acked, n_before + 20, errors, second)  # the survivor serves on
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        first.stop()
    try:
        acked = acked[:]
        assert {a["server"] for a in acked} == {first.url, second.url}
        _each_once(acked, _db_rows(postgres_url))
        assert {a["id"] for a in acked} <= _listed_ids(second.url)
    finally:
        second.stop()


def test_a_results_log_locked_at_start_serves_once_the_other_program_lets_go(model_files,
                                                                            tmp_path):
    """``anomaly-hooks serve --results-dir`` while another process holds the (new) log
    locked: the command does not refuse (nothing is wrong with the file), the server comes up
    with /readyz 503 ``results_unavailable`` saying who may hold the log and what to do, its
    log says so once; when the other process lets go it turns ready without a restart and
    records."""
    results = tmp_path / "results"
    results.mkdir()
    with locked_by_another_process(results / "results.sqlite") as holder:
        server = ServerProcess(model_files["good"], tmp_path, "--results-dir", str(results))
        try:
            deadline = time.monotonic() + 180
            while True:
                assert server.proc.poll() is None, server.log()
                assert time.monotonic() < deadline, server.log()
                try:
                    body = httpx.get(server.url + "/readyz", timeout=5).json()
                    if body.get("code") == "results_unavailable":
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            assert "locked by another program" in body["message"], body
            assert "Stop that program or wait" in body["message"], body
            r = httpx.post(server.url + "/v1/predict", content=good_png(), timeout=60)
            assert r.status_code == 503 and r.json()["code"] == "results_unavailable"
        except BaseException:
            server.stop()
            raise
        holder.stdin.close()  # the other program lets go
        holder.wait(30)
    with server:
        server.wait_ready()
        r = httpx.post(server.url + "/v1/predict", content=good_png(), timeout=60)
        assert r.status_code == 200 and r.json()["id"] == 1
        log = server.log()
    assert log.count("at start, not ready") == 1 and "error:" not in log, log


def test_sighup_reload_under_load(model_files, tmp_path):
    live = tmp_path / "live.safetensors"
    shutil.copy(model_files["good"], live)
    acked: list = []
    errors: list = []
    stop = threading.Event()
    with ServerProcess(live, tmp_path, "--results-dir", str(tmp_path / "res"),
                       "--max-wait-ms", "5") as server:
        old_id = httpx.get(server.url + "/v1/model").json()["model_id"]
        threads = [threading.Thread(target=_load, args=(server.url, stop, acked, errors, s))
                   for s in range(4)]
        for t in threads:
            t.start()
        try:
            while len(acked) < 8:
                time.sleep(0.01)
            tmp = tmp_path / "incoming.tmp"
            shutil.copy(model_files["strict"], tmp)
            os.replace(tmp, live)               # the way a new model should be dropped in
            server.signal(signal.SIGHUP)
            deadline = time.monotonic() + 120
            while httpx.get(server.url + "/v1/model").json()["model_id"] == old_id:
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.1)
            new_id = httpx.get(server.url + "/v1/model").json()["model_id"]
            n = len(acked)
            while len(acked) < n + 8:
                time.sleep(0.01)
            # a damaged file: refused, the new model keeps serving
            shutil.copy(model_files["damaged"], tmp)
            os.replace(tmp, live)
            server.signal(signal.SIGHUP)
            while (httpx.get(server.url + "/v1/model").json()["last_reload"] or {}).get(
                    "ok", True):
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.1)
            info = httpx.get(server.url + "/v1/model").json()
            assert info["model_id"] == new_id and "checksum" in info["last_reload"]["error"]
            n = len(acked)
            while len(acked) < n + 4:
                time.sleep(0.01)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
    assert not errors, errors[:5]
    ids = [a["model"]["id"] for a in acked]
    assert ids[0] == old_id and ids[-1] == new_id and set(ids) == {old_id, new_id}
    for a in acked:  # each answer is consistent with the model that says it scored it
        factor = 3.0 if a["model"]["id"] == new_id else 1.0
        assert a["threshold"] == pytest.approx(factor * acked[0]["threshold"])
    assert "refused" in server.log()


def test_http_batching_and_monitor_plugin(model_files, tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), TESTS])}
    with ServerProcess(model_files["good"], tmp_path, "--max-wait-ms", "300", "--monitor",
                       "serve_helpers:standin_factory", "--no-results", "--max-upload-mb", "1",
                       env=env) as server:
        # an over-size upload: the client, still sending, gets to read the 413
        for body in (os.urandom(3 << 20), iter([os.urandom(1 << 20)] * 3)):
            r = httpx.post(server.url + "/v1/predict", content=body, timeout=60)
            assert r.status_code == 413 and r.json()["code"] == "payload_too_large"
        # every hostile upload, all at once: its 4xx JSON, never a 500
        hostile = hostile_payloads()
        with ThreadPoolExecutor(4) as pool:
            refused = dict(zip(hostile, pool.map(
                lambda data: httpx.post(server.url + "/v1/predict", content=data, timeout=60),
                [data for data, _, _ in hostile.values()])))
        for name, (data, status, code) in hostile.items():
            if len(data) > 1 << 20:  # over this server's --max-upload-mb
                status, code = 413, "payload_too_large"
            r = refused[name]
            assert (r.status_code, r.json()["code"]) == (status, code), (name, r.text)
            assert r.json()["message"], name
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: httpx.post(server.url + "/v1/predict",
                                                         content=good_png(i), timeout=60),
                                    range(8)))
        assert all(a.status_code == 200 for a in answers)
        assert max(a.json()["timing_ms"]["batch_size"] for a in answers) >= 2
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/v1/drift").json().get("observed", 0) < 8:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(server.url + "/v1/drift").json()["enabled"] is True
        metrics = httpx.get(server.url + "/metrics").text
        assert 'anomaly_hooks_drift{key="observed",model="default"} 8.0' in metrics
        # hostile HTTP: a huge header, a lying Content-Length; the server stays up
        # (uvicorn answers 400 and closes while the client may still be sending the header:
        # the kernel then resets the connection before the client reads the answer; either
        # is a refusal, what matters is that the server stays up)
        try:
            r = httpx.post(server.url + "/v1/predict", content=good_png(),
                           headers={"X-Junk": "a" * 200_000}, timeout=30)
            assert 400 <= r.status_code < 500
        except httpx.ReadError as exc:
            assert "reset" in str(exc).lower(), exc
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                         b"Content-Type: image/png\r\n\r\n" + good_png()[:100])
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1024)
        assert httpx.get(server.url + "/healthz").status_code == 200
        assert httpx.post(server.url + "/v1/predict", content=good_png()).status_code == 200
        # no token: the admin routes refuse (a reload is SIGHUP's then)
        r = httpx.post(server.url + "/v1/admin/reload", params={"path": "/dev/zero"})
        assert r.status_code == 403 and r.json()["code"] == "admin_disabled"
        assert server.stop() in (0, -signal.SIGTERM)  # SIGTERM: graceful shutdown
        assert "Application shutdown complete" in server.log()


def _run_cli(*args, timeout=180):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "anomaly_hooks.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_refuses_a_model_it_cannot_serve(model_files, tmp_path):
    missing = _run_cli("serve", "--model", str(tmp_path / "nope.safetensors"))
    assert missing.returncode == 2 and "model file not found" in missing.stderr
    bad = _run_cli("serve", "--model", str(model_files["damaged"]), "--port", "0",
                   "--results-dir", str(tmp_path / "r"))
    assert bad.returncode == 2 and "checksum" in bad.stderr.splitlines()[-1], bad.stderr
    opts = _run_cli("serve", "--model", str(model_files["good"]), "--max-batch", "0")
    assert opts.returncode == 2 and "max-batch" in opts.stderr
    device = _run_cli("serve", "--model", "/dev/zero")
    assert device.returncode == 2
    assert "not a regular file (a character device)" in device.stderr, device.stderr
    folder = _run_cli("serve", "--model", str(model_files["good"]), "--models-dir",
                      str(tmp_path / "nowhere"))
    assert folder.returncode == 2 and "models-dir" in folder.stderr
    helptext = _run_cli("serve", "--help")
    assert helptext.returncode == 0 and "--max-wait-ms" in helptext.stdout
    assert "--models-dir" in helptext.stdout


def test_admin_routes_and_docs_over_http(model_files, tmp_path):
    """A real server with a token: a reload body nested 100,000 deep is a 422 JSON answer (not
    a dropped connection), a path outside the models folder a 403, a good one reloads; the
    API docs and their assets come from the server itself."""
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    shutil.copy(model_files["strict"], shelf / "strict.safetensors")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with ServerProcess(model_files["good"], tmp_path, "--token", TOKEN, "--models-dir",
                       str(shelf), "--no-results") as server:
        url = server.url + "/v1/admin/reload"
        deep = httpx.post(url, content=b"[" * 100_000 + b"]" * 100_000, timeout=60,
                          headers={**auth, "Content-Type": "application/json"})
        assert deep.status_code == 422 and deep.json()["code"] == "invalid_parameter", deep.text
        outside = httpx.post(url, params={"path": str(model_files["strict"])}, headers=auth)
        assert outside.status_code == 403 and str(shelf) in outside.json()["message"]
        ok = httpx.post(url, json={"path": str(shelf / "strict.safetensors")}, headers=auth,
                        timeout=120)
        assert ok.status_code == 200 and not ok.json()["unchanged"], ok.text
        docs = httpx.get(server.url + "/docs", auth=("operator", TOKEN))
        assert docs.status_code == 200 and "/docs/assets/swagger-ui-bundle.js" in docs.text
        for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
            r = httpx.get(f"{server.url}/docs/assets/{asset}", auth=("operator", TOKEN))
            assert r.status_code == 200 and len(r.content) > 10_000, asset
        spec = httpx.get(server.url + "/openapi.json", headers=auth).json()
        assert "/v1/admin/reload" in spec["paths"]
