#!/usr/bin/env python
"""The inspection service under the denial-of-service attacks of its security review.

Starts ``anomaly-hooks serve`` on 127.0.0.1 (a token, its default limits), then, one phase at
a time, holds an attack for ``--hold`` seconds while probing ``GET /healthz`` and an
authorised ``POST /v1/predict`` (a new connection each, as a new client would) and sampling the
server's RSS:

* ``idle``: ``--connections`` TCP connections that send nothing, and as many that trickle a
  partial request head (a byte every half second) -- all from this client's own address;
* ``batch fields``: ``--batch-clients`` authorised clients each sending a
  ``/v1/predict/batch`` body of 79 text fields of 1.04 MB, then stalling;
* ``batch in bounds``: as many clients sending the most the server accepts of text fields and
  small files, then stalling.

It prints, per phase, how many probes succeeded, the ``/healthz`` latency (p50 / p95 / max),
the server's RSS (peak, and its growth over the idle server) and the connections the server
closed, and writes them as JSON.

    python benchmarks/bench_attacks.py --model models/padim.safetensors

The attack primitives here are the ones ``tests/test_serve_attacks.py`` uses.
Bounded: loopback only, every phase capped in time; the server is stopped at the end.
"""
from __future__ import annotations

import argparse
import os
import select
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anomaly_hooks.timing import Stopwatch
from benchmarks.measure import ROOT, machine, percentile, write_json

HOST = "127.0.0.1"  # never anything else
TOKEN = "bench-attacks-token"
BOUNDARY = "attack-boundary-7MA4YWxkTrZu0gW"
PARTIAL_HEAD = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "


# ---- attack primitives (also used by the tests) ----------------------------------------------
def connect(port: int, source: str = HOST, timeout: float = 10.0) -> socket.socket:
    """A TCP connection to the server from ``source`` (any 127.x.y.z address is this host)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.bind((source, 0))
    sock.connect((HOST, port))
    return sock


def closed_by_server(sock: socket.socket, wait: float = 0.0) -> bool:
    """Whether the server has closed ``sock`` (an end of stream, a reset, or an answer
    followed by the end: a refusal reads as closed)."""
    try:
        readable, _, _ = select.select([sock], [], [], wait)
        if not readable:
            return False
        while sock.recv(65536):
            pass
        return True
    except OSError:  # reset, or the socket is already closed here
        return True


def open_idle(port: int, n: int, source: str = HOST) -> List[socket.socket]:
    """``n`` connections that send nothing."""
    return [connect(port, source) for _ in range(n)]


class Trickle(threading.Thread):
    """``n`` connections that send a partial request head, then one more byte every
    ``interval`` seconds, never completing it (until :meth:`stop`)."""

    def __init__(self, port: int, n: int, source: str = HOST, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.socks = [connect(port, source) for _ in range(n)]
        for sock in self.socks:
            sock.sendall(PARTIAL_HEAD)
        self.interval = interval
        self.closed = 0  # connections whose next byte could not be sent
        self._halt = threading.Event()

    def run(self) -> None:
        live = list(self.socks)
        while live and not self._halt.wait(self.interval):
            for sock in list(live):
                try:
                    sock.sendall(b"a")
                except OSError:
                    live.remove(sock)
                    self.closed += 1

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
        close_all(self.socks)


def close_all(socks: Iterable[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def form_part(name: str, value: bytes, filename: Optional[str] = None) -> bytes:
    """One part of a multipart body (:data:`BOUNDARY`)."""
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    kind = "Content-Type: application/octet-stream\r\n" if filename else ""
    return (f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n{kind}\r\n").encode() + \
        value + b"\r\n"


def fields_body(n: int, size: int) -> List[bytes]:
    """The parts of the review's batch body: ``n`` text fields of ``size`` bytes."""
    return [form_part("part_id", b"A" * size) for _ in range(n)]


def bounded_body(files: int, file_bytes: int, fields: int, field_bytes: int) -> List[bytes]:
    """Parts at the server's bounds: ``fields`` text fields and ``files`` files (not images:
    the body is never completed, so never decoded)."""
    return ([form_part("part_id", b"p" * field_bytes) for _ in range(fields)]
            + [form_part("files", b"\x89PNG" + b"\x00" * (file_bytes - 4), f"{i}.png")
               for i in range(files)])


class StalledUpload(threading.Thread):
    """An authorised ``POST /v1/predict/batch`` whose Content-Length announces ``parts`` and
    the closing boundary, which sends the parts (as far as the server reads them) and then
    stalls, holding the connection until :meth:`release`."""

    def __init__(self, port: int, parts: Sequence[bytes], token: str = TOKEN) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.parts = parts
        self.token = token
        self.sent_parts = 0
        self.sent_all = threading.Event()  # done sending (or refused)
        self.answer = b""
        self._release = threading.Event()

    def _head(self) -> bytes:
        length = sum(len(p) for p in self.parts) + len(f"--{BOUNDARY}--\r\n")
        return (f"POST /v1/predict/batch HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {self.token}\r\n"
                f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                f"Content-Length: {length}\r\n\r\n").encode()

    def run(self) -> None:
        sock = connect(self.port, timeout=60)
        try:
            sock.sendall(self._head())
            for part in self.parts:
                sock.sendall(part)
                self.sent_parts += 1
        except OSError:  # refused: the server answered and closed
            pass
        self.sent_all.set()
        self._release.wait(600)
        self.answer = _read_some(sock)
        sock.close()

    def release(self) -> None:
        self._release.set()


def _read_some(sock: socket.socket) -> bytes:
    """What the server sent on ``sock`` so far (without waiting)."""
    out = b""
    try:
        while select.select([sock], [], [], 0)[0]:
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    except OSError:
        pass
    return out


def stall(port: int, n: int, parts: Sequence[bytes], token: str = TOKEN,
          timeout: float = 120.0) -> List[StalledUpload]:
    """``n`` stalled uploads of ``parts``, started; returns once each has sent what the
    server would read (or ``timeout``)."""
    clients = [StalledUpload(port, parts, token) for _ in range(n)]
    for client in clients:
        client.start()
    deadline = time.monotonic() + timeout
    for client in clients:
        client.sent_all.wait(max(0.0, deadline - time.monotonic()))
    return clients


def release(clients: Iterable[StalledUpload]) -> None:
    for client in clients:
        client.release()
    for client in clients:
        client.join(30)


def rss_mib(pid: int) -> float:
    """A process's resident memory, MiB."""
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


# ---- the benchmark ---------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--image", default=None, help="the image the predict probe posts "
                   "(default: the first of data/sample/test/good)")
    p.add_argument("--connections", type=int, default=300,
                   help="idle connections, and as many trickling ones (default 300)")
    p.add_argument("--batch-clients", type=int, default=20, help="stalled batch uploads")
    p.add_argument("--hold", type=float, default=12.0,
                   help="seconds each attack is held while probing (default 12: past the "
                   "default header timeout of 10 s)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra option for the server (repeatable)")
    p.add_argument("--server-root", default=str(ROOT),
                   help="the checkout whose anomaly_hooks the server runs (default: this one; "
                   "another to compare versions)")
    p.add_argument("--out", default="bench_attacks.json")
    return p.parse_args(argv)


class Probe:
    """``GET /healthz`` and an authorised ``POST /v1/predict``, each on a new connection."""

    def __init__(self, url: str, image: bytes) -> None:
        self.url = url
        self.image = image

    def _one(self, method: str, path: str, **kw: Any) -> Dict[str, Any]:
        import httpx

        watch = Stopwatch()
        try:
            status = httpx.request(method, self.url + path, timeout=30, **kw).status_code
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        return {"status": status, "ms": watch.lap(path) * 1000}

    def run(self, seconds: float, pause: float = 0.2) -> Dict[str, List[Dict[str, Any]]]:
        out: Dict[str, List[Dict[str, Any]]] = {"healthz": [], "predict": []}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            out["healthz"].append(self._one("GET", "/healthz"))
            out["predict"].append(self._one(
                "POST", "/v1/predict", content=self.image,
                headers={"Authorization": f"Bearer {TOKEN}"}))
            time.sleep(pause)
        return out


def closed_counts(url: str) -> Dict[str, float]:
    """The server's ``anomaly_hooks_connections_closed_total`` by reason."""
    import httpx

    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"},
                     timeout=30).text
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("anomaly_hooks_connections_closed_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def summary(name: str, probes: Dict[str, List[Dict[str, Any]]], rss: List[float],
            base_rss: float, closed: Dict[str, float]) -> Dict[str, Any]:
    """One phase's figures."""
    health = probes["healthz"]
    ms = [p["ms"] for p in health]
    return {"phase": name,
            "healthz_ok": sum(p["status"] == 200 for p in health), "healthz_n": len(health),
            "healthz_ms": {"p50": percentile(ms, 50), "p95": percentile(ms, 95),
                           "max": max(ms, default=0.0)},
            "healthz_statuses": sorted({str(p["status"]) for p in health}),
            "predict_ok": sum(p["status"] == 200 for p in probes["predict"]),
            "predict_n": len(probes["predict"]),
            "predict_statuses": sorted({str(p["status"]) for p in probes["predict"]}),
            "rss_peak_mib": max(rss, default=base_rss),
            "rss_growth_mib": max(rss, default=base_rss) - base_rss,
            "server_closed": closed}


def sampled(pid: int, fn: Any) -> tuple:
    """``fn()``'s result and the server's RSS sampled every 0.25 s meanwhile (MiB)."""
    samples: List[float] = []
    halt = threading.Event()

    def sample() -> None:
        while not halt.is_set():
            samples.append(rss_mib(pid))
            halt.wait(0.25)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = fn()
    finally:
        halt.set()
        thread.join(5)
    return result, samples


def phases(args: argparse.Namespace, url: str, port: int, pid: int, image: bytes
           ) -> List[Dict[str, Any]]:
    """Each attack held for ``--hold`` seconds while probing; their figures."""
    probe = Probe(url, image)
    base = rss_mib(pid)
    out = []
    before = closed_counts(url)

    def closed_since() -> Dict[str, float]:
        now = closed_counts(url)
        return {k: now[k] - before.get(k, 0.0) for k in now if now[k] - before.get(k, 0.0)}

    res, rss = sampled(pid, lambda: probe.run(min(args.hold, 4.0)))
    out.append(summary("none", res, rss, base, {}))
    n = args.connections
    idle = open_idle(port, n)
    trickle = Trickle(port, n)
    trickle.start()
    res, rss = sampled(pid, lambda: probe.run(args.hold))
    trickle.stop()
    close_all(idle)
    out.append(summary(f"{n} idle + {n} slow connections", res, rss, base, closed_since()))
    for name, parts in ((f"{args.batch_clients} stalled batch bodies, 79 fields of 1.04 MB",
                         fields_body(79, 1_040_000)),
                        (f"{args.batch_clients} stalled batch bodies at the part bounds",
                         bounded_body(32, 64 * 1024, 40, 2048))):
        before = closed_counts(url)
        clients, _ = sampled(pid, lambda parts=parts: stall(port, args.batch_clients, parts))
        res, rss = sampled(pid, lambda: probe.run(args.hold))
        release(clients)
        out.append(summary(name, res, rss, base, closed_since()))
    time.sleep(2)
    out.append({"phase": "after the attacks", "rss_mib": rss_mib(pid),
                "rss_growth_mib": rss_mib(pid) - base})
    return out


def print_table(rows: List[Dict[str, Any]], base: float) -> None:
    """The phases' figures, one line each."""
    print(f"\nserver RSS with no attack: {base:.0f} MiB")
    head = ("attack", "healthz ok", "healthz p50/p95/max ms", "predict ok", "RSS peak MiB",
            "RSS +MiB", "closed by server")
    lines = [head]
    for r in rows:
        if "healthz_n" not in r:
            lines.append((r["phase"], "", "", "", f"{r['rss_mib']:.0f}",
                          f"{r['rss_growth_mib']:+.0f}", ""))
            continue
        ms = r["healthz_ms"]
        lines.append((r["phase"], f"{r['healthz_ok']}/{r['healthz_n']}",
                      f"{ms['p50']:.0f} / {ms['p95']:.0f} / {ms['max']:.0f}",
                      f"{r['predict_ok']}/{r['predict_n']}", f"{r['rss_peak_mib']:.0f}",
                      f"{r['rss_growth_mib']:+.0f}",
                      ", ".join(f"{k} {v:.0f}" for k, v in r["server_closed"].items()) or "-"))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  " + "  ".join(f"{str(c):<{w}}" for c, w in zip(line, widths)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    from benchmarks.bench_serve import Server

    image_path = Path(args.image) if args.image else sorted(
        (ROOT / "data" / "sample" / "test" / "good").glob("*.png"))[0]
    image = image_path.read_bytes()
    settings = argparse.Namespace(model=str(Path(args.model).resolve()), max_batch=16,
                                  max_wait_ms="auto", clients=args.batch_clients)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_attacks_") as tmp:
        server = Server(settings, Path(tmp), ["--token", TOKEN, *args.server_arg],
                        root=Path(args.server_root))
        try:
            server.wait_ready()
            base = rss_mib(server.proc.pid)
            rows = phases(args, server.url, server.port, server.proc.pid, image)
        finally:
            server.stop()
    result = {"rows": rows, "rss_idle_server_mib": base, "model": settings.model,
              "server_root": args.server_root,
              "connections": args.connections, "batch_clients": args.batch_clients,
              "hold_s": args.hold, "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": machine(),
              "loadavg_1_5_15": {"start": load_start, "end": os.getloadavg()}}
    print_table(rows, base)
    print(f"  load average (1, 5, 15 min) at start {load_start}, at end {os.getloadavg()} "
          f"on {os.cpu_count()} CPUs")
    print(f"written {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
