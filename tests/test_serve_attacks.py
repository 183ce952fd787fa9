"""The inspection service under the attacks of its security review, as a real process (uvicorn
on a free loopback port): idle and slow connections, stalled batch bodies, request smuggling
and header floods, concurrent reloads and SIGHUP storms under load, a shutdown during a long
reload. The attack clients are ``benchmarks/bench_attacks``'s. (A results log that cannot be
opened: tests/test_serve_settings.py; hostile reload targets: tests/test_serve_routes_model.py.)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
httpx = pytest.importorskip("httpx", reason="httpx is not installed")
pytest.importorskip("psutil", reason="psutil is not installed")

from conftest import ROOT  # noqa: E402
from serve_helpers import TOKEN, ServerProcess, encode, good_png, model_variants  # noqa: E402

sys.path.insert(0, str(ROOT))  # benchmarks/ is no installed package: import it from the checkout
from benchmarks.bench_attacks import (  # noqa: E402
    Trickle,
    bounded_body,
    close_all,
    closed_by_server,
    connect,
    fields_body,
    open_idle,
    release,
    rss_mib,
    stall,
)

pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals, 127.0.0.2"),
              pytest.mark.slow]
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEADER_TIMEOUT = 3.0
IDLE_TIMEOUT = 2.0
PER_CLIENT = 32


@pytest.fixture(scope="module")
def model_files(fitted, tmp_path_factory):
    return model_variants(fitted, tmp_path_factory.mktemp("serve_attack_models"))


@pytest.fixture(scope="module")
def guarded(model_files, tmp_path_factory):
    """A server with a token and short connection timeouts."""
    with ServerProcess(model_files["good"], tmp_path_factory.mktemp("guarded"), "--token",
                       TOKEN, "--no-results", "--header-timeout", str(HEADER_TIMEOUT),
                       "--idle-timeout", str(IDLE_TIMEOUT), "--max-connections-per-client",
                       str(PER_CLIENT)) as server:
        yield server


def _answers(url: str, seconds: float) -> List[tuple]:
    """(path, status, seconds) of /healthz and an authorised predict, each on a new
    connection, for ``seconds``."""
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for method, path, kw in (("GET", "/healthz", {}),
                                 ("POST", "/v1/predict", {"content": good_png(),
                                                          "headers": AUTH})):
            t = time.perf_counter()
            r = httpx.request(method, url + path, timeout=30, **kw)
            out.append((path, r.status_code, time.perf_counter() - t))
        time.sleep(0.1)
    return out


def _connections(url: str) -> Dict[str, float]:
    """The server's connection gauges and counters from /metrics."""
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
    out = {}
    for name, labels, value in re.findall(
            r"^anomaly_hooks_connections_(\w+?)(?:_total)?(\{[^}]*\})? (\S+)$", text, re.M):
        out[name + (labels or "")] = float(value)
    return out


# ---- connections ----------------------------------------------------------------------------
def test_idle_and_slow_connections_leave_the_service_up(guarded):
    """300 silent and 300 trickling connections from the very address of the legitimate
    client, and 300 more from another: /healthz and an authorised predict answer at once
    throughout, the server holds at most its per-client cap of them, and closes every one
    within the header timeout."""
    before = _connections(guarded.url)
    idle = open_idle(guarded.port, 300)
    trickle = Trickle(guarded.port, 300, interval=0.3)
    trickle.start()
    other = open_idle(guarded.port, 300, source="127.0.0.2")
    try:
        answers = _answers(guarded.url, 2 * HEADER_TIMEOUT)
        held = _connections(guarded.url)
        # each address keeps at most its cap; the legitimate client's own connection is one
        assert held["open"] <= 2 * PER_CLIENT + 2, held
        deadline = time.monotonic() + HEADER_TIMEOUT + 5
        attack = idle + trickle.socks + other
        while not all(closed_by_server(s) for s in attack):
            assert time.monotonic() < deadline, sum(not closed_by_server(s) for s in attack)
            time.sleep(0.2)
    finally:
        trickle.stop()
        close_all(idle + other)
    assert {(path, status) for path, status, _ in answers} == {("/healthz", 200),
                                                                ("/v1/predict", 200)}
    assert max(seconds for _, _, seconds in answers) < 10, answers
    after = _connections(guarded.url)
    closed = {k: after[k] - before.get(k, 0) for k in after if k.startswith("closed")}
    assert sum(closed.values()) >= 900 and closed['closed{reason="refused"}'] == 0, closed


@pytest.mark.parametrize("source, trickling, timeout", [
    ("127.0.0.3", False, IDLE_TIMEOUT), ("127.0.0.4", True, HEADER_TIMEOUT)])
def test_silent_and_trickling_connections_are_closed_on_time(guarded, source, trickling,
                                                            timeout):
    """A silent connection is closed at the idle timeout; one trickling its request head a
    byte at a time at the header timeout (its bytes do not extend it)."""
    start = time.monotonic()
    if trickling:
        trickle = Trickle(guarded.port, 1, source=source, interval=0.2)
        trickle.start()
        sock = trickle.socks[0]
    else:
        sock = connect(guarded.port, source)
    try:
        while not closed_by_server(sock, wait=0.1):
            assert time.monotonic() - start < timeout + 3
    finally:
        if trickling:
            trickle.stop()
        sock.close()
    assert time.monotonic() - start > timeout - 0.5


def test_keep_alive_clients_and_slow_uploads_still_work(guarded):
    """A kept-alive client reuses its connection within the idle timeout; an image body sent
    slowly over twice the header timeout is scored (the body has the request timeout)."""
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60) as client:
        for _ in range(3):
            assert client.get("/healthz").status_code == 200
            time.sleep(IDLE_TIMEOUT / 4)
        noise = np.random.default_rng(0).integers(0, 256, (800, 1000, 3), dtype=np.uint8)
        image = encode(noise)
        assert len(image) > 2_000_000

        def slowly():
            step = len(image) // 20
            for i in range(0, len(image), step):
                time.sleep(2 * HEADER_TIMEOUT / 20)
                yield image[i:i + step]

        r = client.post("/v1/predict", content=slowly())
        assert r.status_code == 200, r.text
        assert r.json()["image"] == {"width": 1000, "height": 800, "format": "PNG"}


# ---- smuggling and header floods ------------------------------------------------------------
HOST = b"Host: x\r\n"
TOKEN_LINE = f"Authorization: Bearer {TOKEN}\r\n".encode()
INNER = b"GET /v1/model HTTP/1.1\r\n" + HOST + b"\r\n"  # no token: must be its own 401
SMUGGLING = {
    # Transfer-Encoding wins over Content-Length: the rest is a request of its own
    "cl_te": (b"POST /healthz HTTP/1.1\r\n" + HOST + TOKEN_LINE
              + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + INNER,
              [405, 401]),
    "te_cl": (b"POST /healthz HTTP/1.1\r\n" + HOST + TOKEN_LINE
              + b"Transfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\n" + INNER,
              [405, 401]),
    "te_tab": (b"POST /healthz HTTP/1.1\r\n" + HOST + TOKEN_LINE
               + b"Transfer-Encoding:\tchunked\r\n\r\n0\r\n\r\n" + INNER, [405, 401]),
    "pipelined": (b"GET /v1/model HTTP/1.1\r\n" + HOST + TOKEN_LINE + b"\r\n" + INNER,
                  [200, 401]),
    "two_content_lengths": (b"POST /healthz HTTP/1.1\r\n" + HOST
                            + b"Content-Length: 0\r\nContent-Length: 44\r\n\r\n" + INNER, [400]),
    "content_length_list": (b"POST /healthz HTTP/1.1\r\n" + HOST
                            + b"Content-Length: 0, 44\r\n\r\n" + INNER, [400]),
    "negative_length": (b"POST /healthz HTTP/1.1\r\n" + HOST + b"Content-Length: -1\r\n\r\n",
                        [400]),
    "plus_length": (b"POST /healthz HTTP/1.1\r\n" + HOST + b"Content-Length: +5\r\n\r\nhello",
                    [400]),
    "te_xchunked": (b"POST /healthz HTTP/1.1\r\n" + HOST
                    + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n" + INNER, [400]),
    "te_chunked_identity": (b"POST /healthz HTTP/1.1\r\n" + HOST
                            + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n", [400]),
    "te_space_before_colon": (b"POST /healthz HTTP/1.1\r\n" + HOST
                              + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n", [400]),
    "obs_fold": (b"POST /healthz HTTP/1.1\r\n" + HOST
                 + b"Content-Length: 0\r\n Transfer-Encoding: chunked\r\n\r\n", [400]),
    "bad_chunk_size": (b"POST /v1/predict HTTP/1.1\r\n" + HOST + TOKEN_LINE
                       + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", [400]),
    "no_host": (b"GET /healthz HTTP/1.1\r\n\r\n", [400]),
    "two_hosts": (b"GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", [400]),
    "nul_in_header": (b"GET /healthz HTTP/1.1\r\n" + HOST + b"X-A: a\x00b\r\n\r\n", [400]),
    "http_0_9": (b"GET /healthz\r\n\r\n", [400]),
}


@pytest.mark.parametrize("name", sorted(SMUGGLING))
def test_request_smuggling_is_refused_or_answered_apart(guarded, name):
    """An ambiguous body length is a 400 and the connection ends; an unambiguous one ends
    where it says, and what follows is a request of its own: answered on its own, with its
    own (missing) token -- never on the first request's."""
    raw, expected = SMUGGLING[name]
    assert _statuses(guarded.port, [raw]) == expected


@pytest.mark.parametrize("name, chunks", [
    ("header_over_16k", [b"GET /healthz HTTP/1.1\r\n" + HOST + b"X-Big: " + b"a" * 9000,
                         b"a" * 9000 + b"\r\n\r\n"]),
    ("5000_headers", [b"GET /healthz HTTP/1.1\r\n" + HOST]
     + [b"".join(b"X-%d: v\r\n" % i for i in range(k, k + 500)) for k in range(0, 5000, 500)]
     + [b"\r\n"]),
    ("request_line_over_16k", [b"GET /healthz?" + b"a" * 9000, b"a" * 9000 + b" HTTP/1.1\r\n"
                               + HOST + b"\r\n"]),
    ("header_200k", [b"GET /healthz HTTP/1.1\r\n" + HOST + b"X-Junk: " + b"a" * 200_000
                     + b"\r\n\r\n"]),
])
def test_header_floods_are_refused(guarded, name, chunks):
    """A request head over 16 KiB is refused: 400 by the HTTP parser while it is incomplete,
    431 once whole (or the connection reset after the refusal); the server stays up."""
    assert _statuses(guarded.port, chunks, pause=0.05) in ([400], [431], [])
    assert httpx.get(guarded.url + "/healthz").status_code == 200


def _statuses(port: int, chunks: List[bytes], pause: float = 0.0) -> List[int]:
    """The statuses the server answers to ``chunks`` sent on one connection, until it closes
    it (a reset after a refusal reads as the end)."""
    sock = connect(port, timeout=30)
    out = b""
    try:
        for chunk in chunks:
            sock.sendall(chunk)
            time.sleep(pause)
        while data := sock.recv(65536):
            out += data
    except OSError:
        pass
    finally:
        sock.close()
    return [int(s) for s in re.findall(rb"HTTP/1\.1 (\d{3}) ", out)]


# ---- stalled batch bodies -------------------------------------------------------------------
CLIENTS = 20
REVIEW_PARTS = 79, 1_040_000                       # text fields of the review's attack
FILES, FIELDS = 32, 40                             # the server's defaults: 32 + 8 fields
SPOOL, FIELD = 64 * 1024, 2048                     # serve/forms.py: kept in memory each
SLACK_MIB = 4.0                                    # per client: its request's objects, buffers


def test_stalled_batch_bodies_hold_bounded_memory(model_files, tmp_path):
    """20 authorised clients each announcing a batch body and stalling in it. The review's
    body (79 text fields of 1.04 MB, 82 MB a client, held until the client left) is refused
    at its first field; a body at the server's part bounds holds at most those bounds while it
    stalls, and is answered 503 timeout (its memory released) at the request timeout."""
    unbounded = CLIENTS * REVIEW_PARTS[0] * REVIEW_PARTS[1] / 2**20
    bound = CLIENTS * ((FILES * SPOOL + FIELDS * FIELD) / 2**20 + SLACK_MIB)
    assert bound * 5 < unbounded  # the test tells the two apart
    timeout = 20
    with ServerProcess(model_files["good"], tmp_path, "--token", TOKEN, "--no-results",
                       "--request-timeout", str(timeout)) as server:
        pid = server.proc.pid
        _batch(server.url)  # warm: the multipart path's imports and first allocations
        base = rss_mib(pid)
        clients = stall(server.port, CLIENTS, fields_body(*REVIEW_PARTS), TOKEN)
        grown = rss_mib(pid) - base
        assert _batch(server.url).status_code == 200
        release(clients)
        assert grown < bound, (grown, bound)
        assert all(c.answer.startswith(b"HTTP/1.1 413") for c in clients), clients[0].answer

        clients = stall(server.port, CLIENTS, bounded_body(FILES, SPOOL, FIELDS, FIELD),
                        TOKEN)
        try:
            assert all(c.sent_parts == FILES + FIELDS for c in clients)  # all read, in bounds
            grown = rss_mib(pid) - base
            assert _batch(server.url).status_code == 200
            assert grown < bound, (grown, bound)
            time.sleep(timeout + 2)
        finally:
            release(clients)
        assert all(c.answer.startswith(b"HTTP/1.1 503") and b'"timeout"' in c.answer
                   for c in clients), clients[0].answer
        assert rss_mib(pid) - base < bound


def _batch(url: str):
    files = [("files", (f"{i}.png", good_png(i), "image/png")) for i in range(2)]
    return httpx.post(url + "/v1/predict/batch", files=files, headers=AUTH, timeout=60)


# ---- reloads --------------------------------------------------------------------------------
def test_concurrent_reloads_and_sighups_under_load_give_no_5xx(model_files, tmp_path):
    """6 clients reloading at once and 83 SIGHUPs while 3 clients predict: every reload is
    done or refused with 409 (another is running: the client tries again), every prediction
    answered 200, the server serves throughout."""
    shelf = tmp_path / "models"
    shelf.mkdir()
    for name in ("good", "strict"):
        shutil.copy(model_files[name], shelf / f"{name}.safetensors")
    stop = threading.Event()
    statuses: Dict[str, List[int]] = {"predict": [], "reload": []}

    def predict() -> None:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
            while not stop.is_set():
                statuses["predict"].append(client.post("/v1/predict",
                                                       content=good_png()).status_code)

    def reload(i: int) -> None:
        """Reload 3 times, trying again after each 409 (another reload was running)."""
        deadline = time.monotonic() + 240
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
            for k in range(3):
                path = shelf / ("good.safetensors" if (i + k) % 2 else "strict.safetensors")
                while time.monotonic() < deadline:
                    status = client.post("/v1/admin/reload", json={"path": str(path)}
                                         ).status_code
                    statuses["reload"].append(status)
                    if status != 409:
                        break
                    time.sleep(0.1)

    with ServerProcess(shelf / "good.safetensors", tmp_path, "--token", TOKEN,
                       "--no-results") as server:
        with ThreadPoolExecutor(9) as pool:
            load = [pool.submit(predict) for _ in range(3)]
            reloaders = [pool.submit(reload, i) for i in range(6)]
            for _ in range(83):
                server.signal(signal.SIGHUP)
                time.sleep(0.05)
            for f in reloaders:
                f.result(300)
            stop.set()
            for f in load:
                f.result(120)
        assert httpx.get(server.url + "/readyz").status_code == 200
        assert "Traceback" not in server.log()
    assert set(statuses["reload"]) <= {200, 409}, set(statuses["reload"])
    assert statuses["reload"].count(200) == 6 * 3
    assert statuses["predict"] and set(statuses["predict"]) == {200}, set(statuses["predict"])


def test_shutdown_stops_a_long_reload_promptly(model_files, tmp_path):
    """A reload hashing a big (sparse) model file that its header describes exactly: SIGTERM
    meanwhile ends the server within seconds (not after the hashing and the graceful wait
    for running requests), the reload answered 503 ``shutting_down``, no traceback in the
    log."""
    shelf = tmp_path / "models"
    shelf.mkdir()
    shutil.copy(model_files["good"], shelf / "good.safetensors")
    size = min(16 << 30, _memory() // 2)
    big = _sparse_model(shelf / "big.safetensors", size, model_files["good"])
    server = ServerProcess(shelf / "good.safetensors", tmp_path, "--token", TOKEN,
                           "--no-results").wait_ready()
    answer: list = []
    try:
        thread = threading.Thread(target=lambda: answer.append(httpx.post(
            server.url + "/v1/admin/reload", json={"path": str(big)}, headers=AUTH,
            timeout=600)))
        thread.start()
        time.sleep(1.0)
        if answer:
            pytest.skip(f"hashing {size:,} bytes took under a second here: nothing to stop")
        t = time.monotonic()
        server.signal(signal.SIGTERM)
        server.proc.wait(60)
        stopped = time.monotonic() - t
        thread.join(30)
    finally:
        server.stop()
    assert stopped < 5, stopped
    log = server.log()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    if answer and isinstance(answer[0], httpx.Response):
        assert answer[0].status_code == 503, answer[0].text
        assert answer[0].json()["code"] == "shutting_down"


def _memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _sparse_model(path: Path, size: int, like: Path) -> Path:
    """A file of ``size`` bytes whose header (``like``'s metadata, padded to 4 KiB) declares
    one tensor filling the rest, a hole read as zeros: no model that loads, but one whose
    refusal needs its data hashed."""
    from anomaly_hooks.modelfile import read_header

    n = size - 8 - 4096
    header = {"__metadata__": read_header(like)["__metadata__"],
              "t": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}
    raw = json.dumps(header).encode().ljust(4096)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        fh.truncate(size)
    return path
