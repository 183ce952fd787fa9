#!/usr/bin/env python
"""Load test of two service replicas on one PostgreSQL results log, with crashes.

Starts a throw-away PostgreSQL server (:mod:`anomaly_hooks.serve.pgtesting`: initdb + pg_ctl in
a temporary folder, fsync on) and, for each scenario, a fresh database and two
``anomaly-hooks serve --results-db postgresql://...`` processes on loopback. ``--clients``
client threads post the images of ``--images`` round-robin to both replicas for ``--duration``
seconds. A client that cannot reach a replica (a transport error) marks it down for
``--down-s`` seconds and sends the same image to the other one (fail-over); on a 503 it waits
the Retry-After (at most 2 s) and sends it again. Scenarios:

* ``steady``: no fault;
* ``replica-kill``: SIGKILL of one replica at ``--fault-at`` (a fraction of the duration);
* ``db-kill``: SIGKILL of the PostgreSQL postmaster and all its processes at ``--fault-at``,
  ``pg_ctl start`` on the same data folder ``--db-down-s`` seconds later (crash recovery).

Then it checks, against the database: every acknowledged result (the ids and request ids the
clients got back) stored exactly once and as answered (0 lost, 0 duplicated), and that
``GET /v1/results`` of each live replica lists every stored row. It prints one table (errors by
kind, rows stored, stored but not acknowledged, throughput) and, for ``db-kill``, the longest
answer during the outage and the time from the restart to the first acknowledged result.

    python benchmarks/bench_replicas.py --model models/padim_effnet_lite0.safetensors \\
        --clients 16 --duration 60

Bounded: loopback only, a time cap per scenario; servers and the database are stopped at the
end. Needs the [serve] and [postgres] extras and the PostgreSQL server programs.
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.measure import ROOT, machine, percentile, stop_process, wait_ready, write_json

HOST = "127.0.0.1"  # never anything else
SCENARIOS = ("steady", "replica-kill", "db-kill")
# error kinds: "503 <code>", "<status> <code>", "transport <Exception>"
TRANSPORT = "transport"
WARM_UP = "warm-up"  # the part id of the requests before the load (not counted)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a fitted model file (.safetensors or .onnx)")
    p.add_argument("--images", default=str(ROOT / "data" / "sample" / "test"),
                   help="folder of images to post (recursive; default data/sample/test)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per scenario")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated, of {', '.join(SCENARIOS)}")
    p.add_argument("--fault-at", type=float, default=0.4,
                   help="when the fault happens, as a fraction of --duration")
    p.add_argument("--db-down-s", type=float, default=5.0,
                   help="seconds the database server stays down (db-kill)")
    p.add_argument("--down-s", type=float, default=5.0,
                   help="seconds a client keeps a replica it could not reach out of its rotation")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra option for both replicas (repeatable)")
    p.add_argument("--out", default="bench_replicas.json")
    return p.parse_args(argv)


# ---- the replicas -----------------------------------------------------------------------------
class Replica:
    """``python -m anomaly_hooks.cli serve`` (the ``anomaly-hooks serve`` command) on a free
    loopback port, started at construction."""

    def __init__(self, model: str, db_url: str, workdir: Path, name: str,
                 extra: Sequence[str]) -> None:
        from anomaly_hooks.serve.pgtesting import free_port

        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = workdir / f"{name}.log"
        cmd = [sys.executable, "-m", "anomaly_hooks.cli", "serve", "--model", model,
               "--host", HOST, "--port", str(self.port), "--results-db", db_url,
               "--results-dir", str(workdir / "results"), "--log-level", "warning", *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the checkout whose code serves
        env.pop("ANOMALY_HOOKS_TOKEN", None)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> None:
        """Until ``/readyz`` answers 200."""
        wait_ready(self.proc, self.url, self.log_path, timeout, what="replica")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """Terminate the replica (SIGTERM: it drains), killing it if it does not end."""
        stop_process(self.proc)


# ---- the clients ------------------------------------------------------------------------------
class Tally:
    """What the clients saw, shared between their threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked: List[Dict[str, Any]] = []
        self.errors: collections.Counter = collections.Counter()
        self.latency: List[float] = []
        self.outage_latency: List[float] = []  # answers of requests sent while the db was down
        self.examples: Dict[str, str] = {}
        self.db_down = threading.Event()

    def ack(self, body: Dict[str, Any], url: str, seconds: float, at: float) -> None:
        with self.lock:
            self.acked.append({"id": body["id"], "request_id": body["request_id"],
                               "score": body["score"], "server": url, "at": at})
            self.latency.append(seconds)

    def error(self, kind: str, text: str, seconds: float, during_outage: bool) -> None:
        with self.lock:
            self.errors[kind] += 1
            self.examples.setdefault(kind, text[:300])
            if during_outage:
                self.outage_latency.append(seconds)


def client(urls: List[str], bodies: List[bytes], seed: int, until: float, tally: Tally,
           down_s: float) -> None:
    """Post images round-robin to ``urls`` until ``until`` (monotonic): fail over on a
    transport error, wait and resend on a 503."""
    import httpx

    down: Dict[str, float] = {}  # url -> monotonic time it may be tried again
    with httpx.Client(timeout=60) as http:
        i = 0
        while time.monotonic() < until:
            i += 1
            body = bodies[(seed * 7919 + i) % len(bodies)]
            sent = False
            while not sent and time.monotonic() < until:
                now = time.monotonic()
                live = [u for u in urls if down.get(u, 0.0) <= now] or urls
                url = live[(seed + i) % len(live)]
                outage = tally.db_down.is_set()
                t0 = time.monotonic()
                try:
                    r = http.post(url + f"/v1/predict?part_id=c{seed}-{i}", content=body)
                except httpx.HTTPError as exc:  # a replica killed: fail over to another
                    tally.error(f"{TRANSPORT} {type(exc).__name__}", repr(exc),
                                time.monotonic() - t0, outage)
                    down[url] = time.monotonic() + down_s
                    continue
                seconds = time.monotonic() - t0
                if r.status_code == 200:
                    tally.ack(r.json(), url, seconds, time.monotonic())
                    sent = True
                    continue
                code = _code(r)
                tally.error(f"{r.status_code} {code}", r.text, seconds,
                            outage or code == "results_unavailable")
                if r.status_code != 503:
                    sent = True  # not worth sending again
                    continue
                time.sleep(min(2.0, float(r.headers.get("Retry-After", "1"))))


def _code(r: Any) -> str:
    try:
        return str(r.json().get("code"))
    except ValueError:
        return "(not JSON)"


def warm_up(urls: List[str], body: bytes) -> None:
    """One request to each replica, not counted (a process's first batch is slow)."""
    import httpx

    for url in urls:
        r = httpx.post(url + f"/v1/predict?part_id={WARM_UP}", content=body, timeout=300)
        if r.status_code != 200:
            raise SystemExit(f"warm-up request to {url} failed: {r.status_code} {r.text}")


def run_load(urls: List[str], bodies: List[bytes], args: argparse.Namespace,
             fault: Optional[Any] = None) -> Tally:
    """``--clients`` threads for ``--duration`` s; ``fault(tally)`` runs at ``--fault-at``."""
    tally = Tally()
    until = time.monotonic() + args.duration
    threads = [threading.Thread(target=client, args=(urls, bodies, s, until, tally,
                                                     args.down_s), daemon=True)
               for s in range(args.clients)]
    for t in threads:
        t.start()
    if fault is not None:
        time.sleep(args.duration * args.fault_at)
        fault(tally)
    for t in threads:
        t.join(args.duration + 180)
    return tally


# ---- the checks -------------------------------------------------------------------------------
def stored_rows(db_url: str) -> Dict[str, List[tuple]]:
    """request_id -> [(id, score), ...] of every row of the results table but the warm-up
    requests'."""
    import psycopg

    rows: Dict[str, List[tuple]] = {}
    with psycopg.connect(db_url) as con:
        for rid, id_, score in con.execute(
                "SELECT request_id, id, score FROM results WHERE part_id <> %s", [WARM_UP]):
            rows.setdefault(rid, []).append((id_, score))
    return rows


def listed_ids(url: str) -> set:
    """Every id ``GET /v1/results`` of one replica lists, page by page."""
    import httpx

    ids: set = set()
    before = None
    while True:
        params = {"limit": 1000, **({"before_id": before} if before else {})}
        page = httpx.get(url + "/v1/results", params=params, timeout=120).json()
        ids |= {r["id"] for r in page["results"]}
        before = page["next_before_id"]
        if before is None:
            return ids


def check(tally: Tally, db_url: str, replicas: List[Replica]) -> Dict[str, Any]:
    rows = stored_rows(db_url)
    acked = tally.acked
    lost = [a for a in acked if a["request_id"] not in rows]
    duplicated = [k for k, v in rows.items() if len(v) > 1]
    wrong = [a for a in acked if a["request_id"] in rows and len(rows[a["request_id"]]) == 1
             and rows[a["request_id"]][0] != (a["id"], a["score"])]
    all_ids = {i for v in rows.values() for i, _ in v}
    listing = {r.url: listed_ids(r.url) >= all_ids for r in replicas if r.alive()}
    acked_ids = {a["request_id"] for a in acked}
    return {"acknowledged": len(acked), "rows": sum(len(v) for v in rows.values()),
            "lost": len(lost), "duplicated": len(duplicated), "stored_not_as_answered":
            len(wrong), "stored_not_acknowledged": len(set(rows) - acked_ids),
            "listing_complete": listing,
            "per_replica": dict(collections.Counter(a["server"] for a in acked))}


# ---- the scenarios ----------------------------------------------------------------------------
def scenario(name: str, pg: Any, args: argparse.Namespace, bodies: List[bytes],
             workdir: Path) -> Dict[str, Any]:
    db_url = pg.url(pg.new_database())
    replicas = [Replica(args.model, db_url, workdir, f"{name}-{k}", args.server_arg)
                for k in ("a", "b")]
    events: Dict[str, float] = {}
    try:
        for r in replicas:
            r.wait_ready()
        urls = [r.url for r in replicas]
        warm_up(urls, bodies[0])
        load0 = os.getloadavg()
        start = time.monotonic()

        def fault(tally: Tally) -> None:
            events["fault_s"] = time.monotonic() - start
            if name == "replica-kill":
                replicas[0].kill9()
            elif name == "db-kill":
                tally.db_down.set()
                pg.kill9()
                time.sleep(args.db_down_s)
                pg.restart()
                events["restarted_s"] = time.monotonic() - start
                tally.db_down.clear()

        tally = run_load(urls, bodies, args, fault if name != "steady" else None)
        wall = time.monotonic() - start
        load1 = os.getloadavg()
        result = check(tally, db_url, replicas)
    finally:
        for r in replicas:
            r.stop()
    if "restarted_s" in events:
        after = [a["at"] - start for a in tally.acked if a["at"] - start > events["restarted_s"]]
        events["first_ack_after_restart_s"] = (min(after) - events["restarted_s"]
                                               if after else float("nan"))
    return {"scenario": name, "clients": args.clients, "seconds": wall, **result,
            "errors": dict(tally.errors), "error_examples": tally.examples,
            "throughput_per_s": result["acknowledged"] / wall,
            "latency_s": {q: percentile(tally.latency, q) for q in (50, 95, 99)},
            "outage_answer_max_s": max(tally.outage_latency, default=0.0),
            "events": events, "loadavg_before": load0, "loadavg_after": load1}


def print_table(results: List[Dict[str, Any]]) -> None:
    head = ("| scenario | clients | seconds | acknowledged | errors by kind | rows stored | "
            "stored, not acknowledged | lost | duplicated | throughput (results/s) | "
            "/v1/results lists all |")
    print(head)
    print("|" + "---|" * head.count(" | ") + "---|")
    for r in results:
        errors = ", ".join(f"{k}: {n}" for k, n in sorted(r["errors"].items())) or "0"
        listing = "yes" if r["listing_complete"] and all(r["listing_complete"].values()) else "NO"
        print(f"| {r['scenario']} | {r['clients']} | {r['seconds']:.0f} | {r['acknowledged']} | "
              f"{errors} | {r['rows']} | {r['stored_not_acknowledged']} | {r['lost']} | "
              f"{r['duplicated']} | {r['throughput_per_s']:.2f} | {listing} "
              f"({len(r['listing_complete'])} live) |")
    for r in results:
        ev = r["events"]
        line = (f"{r['scenario']}: latency p50/p95/p99 {r['latency_s'][50]:.2f}/"
                f"{r['latency_s'][95]:.2f}/{r['latency_s'][99]:.2f} s; per replica "
                f"{sorted(r['per_replica'].values())}; load "
                f"{r['loadavg_before'][0]:.1f} -> {r['loadavg_after'][0]:.1f}")
        if "fault_s" in ev:
            line += f"; fault at {ev['fault_s']:.1f} s"
        if "restarted_s" in ev:
            line += (f", database back at {ev['restarted_s']:.1f} s, first acknowledged result "
                     f"{ev['first_ack_after_restart_s']:.2f} s after; longest answer during the "
                     f"outage {r['outage_answer_max_s']:.2f} s")
        print(line)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    from anomaly_hooks.serve.pgtesting import PostgresServer

    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}: choose from {', '.join(SCENARIOS)}")
    files = sorted(p for p in Path(args.images).rglob("*.png") if p.is_file())
    if not files:
        raise SystemExit(f"no PNG images under {args.images}")
    bodies = [p.read_bytes() for p in files]
    info = machine()
    print(f"machine: {info.get('cpu')}, {os.cpu_count()} CPUs; model {args.model}; "
          f"{len(bodies)} images; uptime load {os.getloadavg()}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp, PostgresServer() as pg:
        for name in names:
            workdir = Path(tmp) / name
            workdir.mkdir()
            results.append(scenario(name, pg, args, bodies, workdir))
            print(f"  {name}: {results[-1]['acknowledged']} acknowledged, "
                  f"{results[-1]['lost']} lost, errors {results[-1]['errors']}", flush=True)
    print_table(results)
    write_json(args.out, {"machine": info, "args": vars(args), "results": results})
    bad = [r["scenario"] for r in results if r["lost"] or r["duplicated"]
           or (r["scenario"] == "steady" and r["errors"])
           or r["stored_not_as_answered"] or not all(r["listing_complete"].values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
