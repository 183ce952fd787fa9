#!/usr/bin/env python
"""Load test of the inspection service on loopback.

Starts ``anomaly-hooks serve`` on 127.0.0.1 (a free port, a temporary results log), then

* measures ``Detector.predict`` on batches of ``--max-batch`` images of the same files in this
  process (the reference; before and after the load, with the server idle);
* runs ``--clients`` concurrent HTTP clients for ``--duration`` seconds (at most
  ``--max-requests``) posting real images, and reports p50/p95/p99 latency, throughput, errors,
  the server's peak RSS, the mean batch size, the throughput as a ratio to the reference and the
  p99 latency as a multiple of the reference batch latency;
* checks that every acknowledged prediction is in the results log (lost results).

``--model`` may be an exported ``.onnx`` file (the edge service, on ONNX Runtime; its reference
is the runtime's ``OnnxDetector.predict``), and may be repeated: each model is load-tested in
turn, same settings, and the table ends with the server's images per CPU-second of each model as
a ratio to the first one's (e.g. the ONNX service against the eager one, in one run).

``--soak SECONDS`` instead runs mixed good, defective and hostile uploads (corrupt and truncated
files, decompression bombs, huge headers, over-size bodies, unsupported types, 16-bit PNGs) and
reports the server's RSS growth between the second minute and the last minute, wrong statuses and
5xx answers.

``--rss`` instead measures the memory of a service of several models: with ``--model
NAME=PATH`` repeated it starts the service with the first 1, 2, ... of them, sends each model a
few requests (its route ``/v1/models/NAME/predict``), and reports the server's settled RSS and
the RSS each extra model adds.

    python benchmarks/bench_serve.py --model models/padim.safetensors --clients 16 --duration 180
    python benchmarks/bench_serve.py --model m.safetensors --model m.onnx --clients 8 --duration 120
    python benchmarks/bench_serve.py --model models/padim.safetensors --soak 600 --clients 8
    python benchmarks/bench_serve.py --rss --model a=a.onnx --model b=b.onnx --model c=c.onnx

Bounded: loopback only, a request cap and a time cap; the server is stopped at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import socket
import sqlite3
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.measure import ROOT, machine, percentile, stop_process, wait_ready, write_json

HOST = "127.0.0.1"  # never anything else
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, action="append",
                   help="model file (.safetensors or .onnx); repeated: each load-tested in turn "
                   "(--rss: NAME=PATH, the service's models)")
    p.add_argument("--images", default=str(ROOT / "data" / "sample" / "test"),
                   help="folder of images to post (recursive; default data/sample/test)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--max-requests", type=int, default=5000)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-wait-ms", default="auto", help="ms or auto (the server's default)")
    p.add_argument("--reference-passes", type=int, default=2,
                   help="timed Detector.predict batches before each load segment and at the end")
    p.add_argument("--cycles", type=int, default=3,
                   help="load segments, with reference batches between them (the machine's load "
                   "drifts: interleaving keeps the ratio fair)")
    p.add_argument("--soak", type=float, default=0.0,
                   help="seconds of mixed good/defective/hostile uploads instead of the load test")
    p.add_argument("--rss", action="store_true",
                   help="measure the RSS of a service of 1, 2, ... of the --model NAME=PATH "
                   "models instead of the load test")
    p.add_argument("--rss-requests", type=int, default=8,
                   help="--rss: requests to each model before the RSS is read")
    p.add_argument("--rss-settle", type=float, default=3.0,
                   help="--rss: seconds of idle whose median RSS is read (ready, after requests)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra option for the server (repeatable), e.g. "
                   "--server-arg=--keep-images=all")
    p.add_argument("--out", default=None,
                   help="write the figures as JSON to this file (default: none written)")
    return p.parse_args(argv)


# ---- the server -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """``python -m anomaly_hooks.serve`` on a free loopback port, started at construction, its
    results and log in ``workdir``."""

    def __init__(self, args: argparse.Namespace, workdir: Path, extra: List[str],
                 root: Path = ROOT, models: Optional[List[str]] = None) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.results = workdir / "results"
        self.log_path = workdir / "server.log"
        model_args = [w for m in (models or [args.model]) for w in ("--model", m)]
        cmd = [sys.executable, "-m", "anomaly_hooks.serve", *model_args, "--host", HOST,
               "--port", str(self.port), "--results-dir", str(self.results),
               "--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms),
               "--max-queue", str(max(64, 2 * args.clients)), "--log-level", "warning",
               # every client is on this address: the per-client cap (64) must hold them all
               *(["--max-connections-per-client", str(args.clients + 8)]
                 if args.clients + 8 > 64 else []), *extra]
        env = {**os.environ, "PYTHONPATH": str(root)}  # the checkout whose code serves
        env.pop("ANOMALY_HOOKS_TOKEN", None)
        self.proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=open(self.log_path, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> None:
        """Until ``/readyz`` answers 200 (the model loaded and warmed up)."""
        wait_ready(self.proc, self.url, self.log_path, timeout)

    def stop(self) -> None:
        """Terminate the server (SIGTERM: it drains), killing it if it does not end."""
        stop_process(self.proc)


class RssSampler(threading.Thread):
    """The server's resident memory (with children), every ``interval`` seconds."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        import psutil

        self.proc = psutil.Process(pid)
        self.interval = interval
        self.samples: List[Tuple[float, int]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        import psutil

        t0 = time.monotonic()
        while not self._halt.is_set():
            try:
                rss = self.proc.memory_info().rss + sum(
                    c.memory_info().rss for c in self.proc.children(recursive=True))
            except psutil.Error:
                return
            self.samples.append((time.monotonic() - t0, rss))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        """Stop sampling."""
        self._halt.set()
        self.join(5)

    def peak(self) -> int:
        """The highest RSS sampled, bytes."""
        return max((r for _, r in self.samples), default=0)


# ---- payloads ---------------------------------------------------------------------------------
def list_images(folder: Path, limit: int = 400) -> List[Path]:
    """The first ``limit`` image files under ``folder`` (recursive, sorted)."""
    from anomaly_hooks.images import is_image_file

    return sorted(p for p in folder.rglob("*") if p.is_file() and is_image_file(p))[:limit]


def _chunk(kind: bytes, data: bytes) -> bytes:
    """A PNG chunk: length, type, data, CRC."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(
        ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def hostile_payloads(sample: bytes, max_upload: int) -> Dict[str, Tuple[bytes, int]]:
    """name -> (bytes, expected HTTP status). ``sample``: a valid PNG."""
    import numpy as np
    from PIL import Image

    img = Image.open(io.BytesIO(sample)).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    jpeg = bytearray(buf.getvalue())
    corrupt = bytes(jpeg[: len(jpeg) // 3]) + os.urandom(len(jpeg) // 3)
    bomb = (PNG_SIGNATURE + _chunk(b"IHDR", struct.pack(">IIBBBBB", 50000, 50000, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(b"\x00" * 150001 * 4, 9)) + _chunk(b"IEND", b""))
    over = (PNG_SIGNATURE + _chunk(b"IHDR", struct.pack(">IIBBBBB", 8000, 8000, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(b"\x00" * 24001 * 4, 9)) + _chunk(b"IEND", b""))
    text = _chunk(b"zTXt", b"comment\x00\x00" + zlib.compress(b"A" * (8 << 20), 9))
    huge_header = sample[:33] + text + sample[33:]
    g16 = io.BytesIO()
    Image.fromarray((np.asarray(img.convert("L"), dtype=np.uint16) * 257)).save(g16, "PNG")
    gif = io.BytesIO()
    img.save(gif, "GIF")
    return {
        "corrupt_jpeg": (corrupt, 400),
        "truncated_png": (sample[: len(sample) // 2], 400),
        "png_bomb_50k": (bomb, 413),
        "png_over_pixel_limit": (over, 413),
        "png_huge_text_header": (huge_header, 400),
        "oversize_body": (os.urandom(max_upload + 200 * 1024), 413),
        "gif": (gif.getvalue(), 415),
        "text": (b"GET / HTTP/1.1 this is not an image" * 10, 415),
        "empty": (b"", 400),
        "png16_valid": (g16.getvalue(), 200),
    }


# ---- the reference ----------------------------------------------------------------------------
REFERENCE_CODE = r"""
import json, resource, sys, time
from concurrent.futures import ThreadPoolExecutor
model, batch = sys.argv[1], int(sys.argv[2])
paths = sys.argv[3:]
if model.endswith(".onnx"):   # the runtime (no torch), as the ONNX engine runs it
    from anomaly_hooks.runtime import OnnxDetector
    from anomaly_hooks.serve.engine_onnx import PREPROCESS, SPIN
    def load():
        return OnnxDetector.load(model, batch_size=batch, preprocess_method=PREPROCESS,
                                 spin=SPIN)
else:
    from anomaly_hooks import Detector
    import torch
    torch.zeros(1 << 20).add_(1)   # first parallel op on the main thread: see serve/service.py
    def load():
        return Detector.load(model, device="cpu")
pool = ThreadPoolExecutor(1)   # batches on a worker thread, as the service runs them
det = pool.submit(load).result()
pool.submit(det.predict, paths[:batch], batch_size=batch).result()   # warm-up
print(json.dumps({"ready": True}), flush=True)
done = 0
for line in sys.stdin:
    times = []
    c0 = resource.getrusage(resource.RUSAGE_SELF)   # microseconds, not clock ticks
    for _ in range(int(line)):
        chunk = [paths[(done * batch + k) % len(paths)] for k in range(batch)]
        t = time.perf_counter()
        pool.submit(det.predict, chunk, batch_size=batch).result()
        times.append(time.perf_counter() - t)
        done += 1
    c1 = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"times": times, "user": c1.ru_utime - c0.ru_utime,
                      "system": c1.ru_stime - c0.ru_stime}), flush=True)
"""


class Reference:
    """``Detector.predict`` (``OnnxDetector.predict`` for an ``.onnx`` model) on batches of the
    same files, in a process of its own started like
    the server (a fresh interpreter that imports anomaly_hooks first), kept alive and idle
    while the load runs, so that the same run can interleave both. (Measured in the load
    generator's own process it came out up to twice as expensive per image: the two must not
    differ in anything but the HTTP service.)"""

    def __init__(self, model: str, paths: List[Path], batch: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", REFERENCE_CODE, model, str(batch), *map(str, paths)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self._started = False
        self.times: List[float] = []
        self.user = self.system = 0.0

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the reference process died")
        return json.loads(line)

    def run(self, passes: int) -> List[float]:
        """Time ``passes`` batches; returns their seconds (the first call waits until the
        process has loaded the model: it starts while the server does)."""
        if not self._started:
            self._read()
            self._started = True
        self.proc.stdin.write(f"{passes}\n")
        self.proc.stdin.flush()
        out = self._read()
        self.times += out["times"]
        self.user += out["user"]
        self.system += out["system"]
        return out["times"]

    def close(self) -> None:
        """End the reference process."""
        self.proc.stdin.close()
        self.proc.wait(60)


def _cpu(pid: int) -> Tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads (page faults and huge-page
    compaction count as system time)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user, t.system


# ---- load -------------------------------------------------------------------------------------
async def run_clients(url: str, bodies: List[Tuple[str, bytes, int]], clients: int,
                      duration: float, max_requests: int, warmup: bool = True) -> dict:
    """Each client posts ``bodies`` round-robin (shifted per client) until the time or request
    cap. Returns latencies (s) of 200s, statuses, acknowledged request ids and the wall time."""
    import httpx

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    out = {"lat": [], "status": {}, "unexpected": [], "acked": [], "transport_errors": 0}
    counter = {"n": 0}
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        if warmup:  # one request per client, not counted: the first batches and connections
            await asyncio.gather(*(client.post("/v1/predict", content=bodies[i % len(bodies)][1])
                                   for i in range(clients)))
        start = time.perf_counter()
        deadline = start + duration

        async def one_client(cid: int) -> None:
            i = cid * 7
            while time.perf_counter() < deadline and counter["n"] < max_requests:
                counter["n"] += 1
                name, body, expect = bodies[i % len(bodies)]
                i += 1
                t = time.perf_counter()
                try:
                    r = await client.post(f"/v1/predict?part_id=c{cid}-{i}", content=body)
                except httpx.HTTPError as exc:
                    out["transport_errors"] += 1
                    out["unexpected"].append(f"{name}: {type(exc).__name__}")
                    continue
                dt = time.perf_counter() - t
                out["status"][r.status_code] = out["status"].get(r.status_code, 0) + 1
                if r.status_code != expect:
                    out["unexpected"].append(f"{name}: {r.status_code} {r.text[:200]}")
                if r.status_code == 200:
                    out["lat"].append(dt)
                    out["acked"].append(r.json()["request_id"])

        await asyncio.gather(*(one_client(c) for c in range(clients)))
        out["wall"] = time.perf_counter() - start
    return out


def batch_stats(url: str) -> Tuple[float, float, float]:
    """(images batched, batches, seconds of inference) so far, from the server's /metrics."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    vals = {}
    keys = ("anomaly_hooks_batch_size_sum", "anomaly_hooks_batch_size_count",
            "anomaly_hooks_batch_duration_seconds_sum")
    for line in text.splitlines():
        for key in keys:  # unlabelled, or labelled by model (summed over the models)
            if line.startswith(key + " ") or line.startswith(key + "{"):
                vals[key] = vals.get(key, 0.0) + float(line.rsplit(None, 1)[1])
    return tuple(vals.get(k, 0.0) for k in keys)  # type: ignore[return-value]


def lost_results(db: Path, acked: List[str]) -> int:
    """How many acknowledged request ids the server's results log lacks."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    stored = {r[0] for r in con.execute("SELECT request_id FROM results")}
    con.close()
    return sum(1 for a in acked if a not in stored)


def mib(n: float) -> float:
    """Bytes to MiB."""
    return n / 2**20


# ---- main -------------------------------------------------------------------------------------
def load_test(args: argparse.Namespace, server: Server, ref: Reference,
              bodies: List[Tuple[str, bytes, int]]) -> Dict[str, Any]:
    """Concurrent clients in ``--cycles`` segments, the reference between them."""
    ref.run(args.reference_passes)
    sampler = RssSampler(server.proc.pid)
    sampler.start()
    sum0, cnt0, sec0 = batch_stats(server.url)
    res: dict = {"lat": [], "status": {}, "unexpected": [], "acked": [], "transport_errors": 0,
                 "wall": 0.0}
    segment = args.duration / max(1, args.cycles)
    server_user = server_sys = 0.0
    for cycle in range(max(1, args.cycles)):
        if cycle:
            ref.run(args.reference_passes)
        if cycle == 0:  # warm-up round (not counted), then the measured segment
            asyncio.run(run_clients(server.url, bodies, args.clients, 0, 0, warmup=True))
        u0, s0 = _cpu(server.proc.pid)
        part = asyncio.run(run_clients(server.url, bodies, args.clients, segment,
                                       args.max_requests - len(res["lat"]), warmup=False))
        u1, s1 = _cpu(server.proc.pid)
        server_user += u1 - u0
        server_sys += s1 - s0
        for key in ("lat", "unexpected", "acked"):
            res[key] += part[key]
        for code, n in part["status"].items():
            res["status"][code] = res["status"].get(code, 0) + n
        res["transport_errors"] += part["transport_errors"]
        res["wall"] += part["wall"]
        print(f"  segment {cycle + 1}: {len(part['lat'])} ok in {part['wall']:.0f} s "
              f"({len(part['lat']) / part['wall']:.3f} img/s); reference batches so far "
              f"{[round(t, 2) for t in ref.times]}", flush=True)
    sum1, cnt1, sec1 = batch_stats(server.url)
    ref.run(args.reference_passes)
    ref.close()
    ref_times = ref.times
    sampler.stop()
    ref_batch = statistics.mean(ref_times)
    ref_tput = args.max_batch / ref_batch
    ok = len(res["lat"])
    tput = ok / res["wall"]
    ref_user, ref_sys = ref.user, ref.system
    ref_cpu = ref_user + ref_sys  # none measurable: a pass shorter than the clock's step
    ref_img_per_cpu = args.max_batch * len(ref_times) / ref_cpu if ref_cpu else float("nan")
    server_cpu = server_user + server_sys
    srv_img_per_cpu = ok / server_cpu if server_cpu else float("nan")
    errors = sum(n for s, n in res["status"].items() if s != 200) + res["transport_errors"]
    lost = lost_results(server.results / "results.sqlite", res["acked"])
    p = {q: percentile(res["lat"], q) for q in (50, 95, 99)}
    return {
        "mode": "load", "clients": args.clients, "max_batch": args.max_batch,
        "max_wait_ms": args.max_wait_ms, "images": len(bodies), "requests_ok": ok,
        "errors": errors, "statuses": res["status"], "lost_results": lost,
        "wall_s": res["wall"], "cycles": args.cycles, "throughput_img_s": tput,
        "latency_s": {"p50": p[50], "p95": p[95], "p99": p[99], "max": max(res["lat"], default=0)},
        "mean_batch_size": (sum1 - sum0) / max(cnt1 - cnt0, 1),
        "server_batch_seconds_mean": (sec1 - sec0) / max(cnt1 - cnt0, 1),
        "reference": {"batch_seconds": ref_times, "batch_seconds_mean": ref_batch,
                      "batch_seconds_median": statistics.median(ref_times),
                      "throughput_img_s": ref_tput},
        "throughput_ratio": tput / ref_tput, "p99_over_batch_latency": p[99] / ref_batch,
        "cpu": {"server_user_s": server_user, "server_system_s": server_sys,
                "server_img_per_cpu_s": srv_img_per_cpu, "reference_user_s": ref_user,
                "reference_system_s": ref_sys, "reference_img_per_cpu_s": ref_img_per_cpu,
                "ratio": srv_img_per_cpu / ref_img_per_cpu},
        "server_peak_rss_mib": mib(sampler.peak()),
        "targets": {"zero_errors": errors == 0, "zero_lost": lost == 0,
                    "throughput_ratio_ge_0.85": tput / ref_tput >= 0.85,
                    "p99_lt_3x_batch": p[99] < 3 * ref_batch},
        "unexpected": res["unexpected"][:20],
    }


def soak_test(args: argparse.Namespace, server: Server, paths: List[Path]) -> Dict[str, Any]:
    """Mixed good, defective and hostile uploads for ``--soak`` seconds; RSS over time."""
    goods = [p for p in paths if p.parent.name == "good"] or paths
    defects = [p for p in paths if p.parent.name != "good"] or paths
    sample = goods[0].read_bytes()
    max_upload = 4 << 20
    hostile = hostile_payloads(sample, max_upload)
    rng = random.Random(0)
    mix: List[Tuple[str, bytes, int]] = []
    for i in range(400):  # ~45 % good, 25 % defective, 30 % hostile, shuffled
        u = rng.random()
        if u < 0.45:
            p = goods[i % len(goods)]
            mix.append((f"good:{p.name}", p.read_bytes(), 200))
        elif u < 0.70:
            p = defects[i % len(defects)]
            mix.append((f"defect:{p.name}", p.read_bytes(), 200))
        else:
            name = rng.choice(sorted(hostile))
            mix.append((name, *hostile[name]))
    sampler = RssSampler(server.proc.pid, interval=1.0)
    sampler.start()
    res = asyncio.run(run_clients(server.url, mix, args.clients, args.soak, args.max_requests))
    sampler.stop()
    samples = sampler.samples
    end_t = samples[-1][0] if samples else 0.0
    base = [r for t, r in samples if 60 <= t < 120] or [r for _, r in samples[: len(samples) // 4]]
    last = [r for t, r in samples if t >= end_t - 60]
    base_rss, last_rss = statistics.median(base), statistics.median(last)
    by_kind: Dict[str, int] = {}
    for name, _, _ in mix:
        by_kind[name.split(":")[0]] = by_kind.get(name.split(":")[0], 0) + 1
    five_xx = sum(n for s, n in res["status"].items() if s >= 500)
    lost = lost_results(server.results / "results.sqlite", res["acked"])
    return {
        "mode": "soak", "seconds": res["wall"], "clients": args.clients,
        "requests": sum(res["status"].values()), "statuses": res["status"],
        "scored_ok": len(res["lat"]), "wrong_status": len(res["unexpected"]), "5xx": five_xx,
        "transport_errors": res["transport_errors"], "lost_results": lost,
        "rss_mib": {"second_minute_median": mib(base_rss), "last_minute_median": mib(last_rss),
                    "peak": mib(sampler.peak()),
                    "growth_pct": 100 * (last_rss - base_rss) / base_rss},
        "rss_timeline_mib": [(round(t), round(mib(r)))
                             for t, r in samples[:: max(1, len(samples) // 60)]],
        # per minute: the floor (between batches: memory kept), median and peak (in flight)
        "rss_per_minute_mib": per_minute(samples),
        "latency_s": {"p50": percentile(res["lat"], 50), "p99": percentile(res["lat"], 99)},
        "mix": by_kind, "unexpected": res["unexpected"][:20],
        "targets": {"rss_growth_lt_5pct": (last_rss - base_rss) / base_rss < 0.05,
                    "no_5xx": five_xx == 0, "zero_lost": lost == 0},
    }


def per_minute(samples: List[Tuple[float, int]]) -> List[Tuple[int, float, float, float]]:
    """(minute, min, median, max) RSS in MiB of each full minute of ``(seconds, bytes)``."""
    out = []
    for m in range(int(samples[-1][0] // 60) if samples else 0):
        w = [r for t, r in samples if m * 60 <= t < (m + 1) * 60]
        if w:
            out.append((m + 1, round(mib(min(w))), round(mib(statistics.median(w))),
                        round(mib(max(w)))))
    return out


def print_load(r: Dict[str, Any]) -> None:
    """The load test's figures, one per line."""
    ref = r["reference"]
    lat = r["latency_s"]
    print(f"\n{r['model']} ({r['engine']})")
    print(f"load test: {r['clients']} clients, {r['wall_s']:.0f} s in {r['cycles']} segments, "
          f"max batch {r['max_batch']}, "
          f"max wait {r['max_wait_ms']} ms, {r['images']} images")
    rows = [
        ("requests ok / errors / lost results", f"{r['requests_ok']} / {r['errors']} / "
                                                f"{r['lost_results']}"),
        ("throughput (img/s)", f"{r['throughput_img_s']:.3f}"),
        (f"Detector.predict, batches of {r['max_batch']} (img/s)",
         f"{ref['throughput_img_s']:.3f}"),
        ("throughput ratio (target >= 0.85)", f"{r['throughput_ratio']:.3f}"),
        ("images per CPU-second: server / Detector.predict",
         f"{r['cpu']['server_img_per_cpu_s']:.3f} / {r['cpu']['reference_img_per_cpu_s']:.3f}"
         f" = {r['cpu']['ratio']:.3f}"),
        ("CPU s per image, user + system: server / Detector.predict",
         f"{r['cpu']['server_user_s'] / r['requests_ok']:.3f} + "
         f"{r['cpu']['server_system_s'] / r['requests_ok']:.3f} / "
         f"{r['cpu']['reference_user_s'] / len(ref['batch_seconds']) / r['max_batch']:.3f} + "
         f"{r['cpu']['reference_system_s'] / len(ref['batch_seconds']) / r['max_batch']:.3f}"),
        ("latency p50 / p95 / p99 (s)", f"{lat['p50']:.2f} / {lat['p95']:.2f} / {lat['p99']:.2f}"),
        (f"batch latency, Detector.predict of {r['max_batch']} (s, mean)",
         f"{ref['batch_seconds_mean']:.2f}"),
        ("p99 / batch latency (target < 3)", f"{r['p99_over_batch_latency']:.2f}"),
        ("mean batch size; the server's inference time per batch (s)",
         f"{r['mean_batch_size']:.2f}; {r['server_batch_seconds_mean']:.2f}"),
        ("server peak RSS (MiB)", f"{r['server_peak_rss_mib']:.0f}"),
    ]
    width = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"  {a:<{width}}  {b}")
    print_targets(r)


def print_targets(r: Dict[str, Any]) -> None:
    """Which targets the run met."""
    print("  targets: " + ", ".join(f"{k}={'met' if v else 'MISSED'}"
                                    for k, v in r["targets"].items()))


def print_soak(r: Dict[str, Any]) -> None:
    """The soak test's figures."""
    rss = r["rss_mib"]
    print(f"\nsoak: {r['seconds']:.0f} s, {r['clients']} clients, {r['requests']} requests "
          f"{r['statuses']}; mix {r['mix']}")
    print(f"  scored {r['scored_ok']}, wrong status {r['wrong_status']}, 5xx {r['5xx']}, "
          f"transport errors {r['transport_errors']}, lost results {r['lost_results']}")
    print(f"  RSS (MiB): 2nd minute {rss['second_minute_median']:.0f}, last minute "
          f"{rss['last_minute_median']:.0f} ({rss['growth_pct']:+.2f} %), peak {rss['peak']:.0f}")
    print("  per minute, min / median / max: " + "; ".join(
        f"{m}: {a}/{b}/{c}" for m, a, b, c in r["rss_per_minute_mib"]))
    print_targets(r)


def engine_of(model: str) -> str:
    """``onnx`` for an exported model, else ``torch`` (the service's choice by suffix)."""
    return "onnx" if model.lower().endswith(".onnx") else "torch"


def one_model(args: argparse.Namespace, paths: List[Path],
              bodies: List[Tuple[str, bytes, int]]) -> Dict[str, Any]:
    """The load test (or soak) of the service of ``args.model``."""
    load_start = os.getloadavg()  # a shared machine: the figures need the load beside them
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        extra = list(args.server_arg)
        if args.soak:
            extra += ["--max-upload-mb", "4"]
        server = Server(args, Path(tmp), extra)
        # the reference loads its model while the server does (it idles during the load)
        ref = None if args.soak else Reference(args.model, paths, args.max_batch)
        try:
            t = time.perf_counter()
            server.wait_ready()
            print(f"server ready in {time.perf_counter() - t:.1f} s on {server.url}")
            result = soak_test(args, server, paths) if ref is None else load_test(
                args, server, ref, bodies)
        finally:
            server.stop()
            if ref is not None and ref.proc.poll() is None:
                ref.proc.kill()
                ref.proc.wait()
    result["model"] = args.model
    result["engine"] = engine_of(args.model)
    result["date"] = time.strftime("%Y-%m-%d %H:%M")
    result["machine"] = machine()
    result["loadavg_1_5_15"] = {"start": load_start, "end": os.getloadavg()}
    return result


def compare_models(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Each model's server images per CPU-second (and throughput) as a ratio to the first's."""
    base = runs[0]
    return {"baseline": base["model"], "models": [
        {"model": r["model"], "engine": r["engine"],
         "server_img_per_cpu_s": r["cpu"]["server_img_per_cpu_s"],
         "per_cpu_ratio": r["cpu"]["server_img_per_cpu_s"]
         / base["cpu"]["server_img_per_cpu_s"],
         "throughput_ratio": r["throughput_img_s"] / base["throughput_img_s"]} for r in runs]}


def print_comparison(c: Dict[str, Any]) -> None:
    """The models side by side, per server CPU-second."""
    print(f"\nper server CPU-second, against {c['baseline']}:")
    for m in c["models"]:
        print(f"  {m['engine']:<6} {m['server_img_per_cpu_s']:.3f} img/CPU-s  "
              f"x{m['per_cpu_ratio']:.2f} per CPU-second, x{m['throughput_ratio']:.2f} "
              f"throughput  {m['model']}")


# ---- memory of several models -----------------------------------------------------------------
def settled_rss(pid: int, seconds: float = 3.0) -> int:
    """The median of the server's RSS (with children) over ``seconds`` of idle."""
    sampler = RssSampler(pid, interval=0.25)
    sampler.start()
    time.sleep(seconds)
    sampler.stop()
    return int(statistics.median(r for _, r in sampler.samples))


def rss_test(args: argparse.Namespace, bodies: List[Tuple[str, bytes, int]]) -> Dict[str, Any]:
    """The service started with the first 1, 2, ... of the ``NAME=PATH`` models: its RSS after
    ``--rss-requests`` requests to each model, and what each extra model adds."""
    import httpx

    specs = [m if "=" in m else f"{Path(m).stem}={m}" for m in args.model]
    rows = []
    for k in range(1, len(specs) + 1):
        with tempfile.TemporaryDirectory(prefix="bench_serve_rss_") as tmp:
            server = Server(args, Path(tmp), list(args.server_arg), models=specs[:k])
            try:
                server.wait_ready()
                ready = settled_rss(server.proc.pid, args.rss_settle)
                for spec in specs[:k]:
                    name = spec.split("=", 1)[0]
                    for i in range(args.rss_requests):
                        r = httpx.post(f"{server.url}/v1/models/{name}/predict",
                                       content=bodies[i % len(bodies)][1], timeout=600)
                        if r.status_code != 200:
                            raise SystemExit(f"{name}: {r.status_code} {r.text[:300]}")
                rss = settled_rss(server.proc.pid, args.rss_settle)
            finally:
                server.stop()
        rows.append({"models": specs[:k], "rss_ready_mib": mib(ready), "rss_mib": mib(rss)})
        added = rows[-1]["rss_mib"] - rows[-2]["rss_mib"] if k > 1 else None
        rows[-1]["added_mib"] = added
        print(f"  {k} model(s): RSS {mib(rss):.0f} MiB after requests ({mib(ready):.0f} MiB "
              f"ready){'' if added is None else f', +{added:.0f} MiB for {specs[k - 1]}'}",
              flush=True)
    return {"mode": "rss", "requests_per_model": args.rss_requests, "rows": rows,
            "targets": {"all_answered": True}}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    paths = list_images(Path(args.images))
    if not paths:
        raise SystemExit(f"no images under {args.images}")
    bodies = [(p.name, p.read_bytes(), 200) for p in paths]
    load_start = os.getloadavg()
    if args.rss:
        result = rss_test(args, bodies)
        result.update(date=time.strftime("%Y-%m-%d %H:%M"), machine=machine(),
                      loadavg_1_5_15={"start": load_start, "end": os.getloadavg()})
    else:
        runs = []
        for model in args.model:
            one = argparse.Namespace(**{**vars(args), "model": str(Path(model).resolve())})
            runs.append(one_model(one, paths, bodies))
        for r in runs:
            (print_soak if args.soak else print_load)(r)
        result = runs[0] if len(runs) == 1 else {
            "runs": runs, "comparison": None if args.soak else compare_models(runs),
            "targets": {f"{i}.{k}": v for i, r in enumerate(runs)
                        for k, v in r["targets"].items()}}
        if len(runs) > 1 and not args.soak:
            print_comparison(result["comparison"])
    print(f"  load average (1, 5, 15 min) at start {load_start}, at end {os.getloadavg()} "
          f"on {os.cpu_count()} CPUs")
    if args.out:
        print(f"written {write_json(args.out, result)}")
    ok = all(result["targets"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
