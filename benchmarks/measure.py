"""What the benchmarks share beyond :mod:`anomaly_hooks.timing` (``Stopwatch``, ``PeakMemory``,
``peak_rss_mb``, used for every timing and memory figure):

* :func:`machine`: where the figures were measured (CPU, cores, RAM, load, versions, GPU);
* :func:`tree_cpu_seconds`: CPU seconds of this process and everything it started;
* :func:`timed_repeats` and :func:`percentile`: wall time of repeated calls;
* :func:`bare_backbone` and :func:`bare_seconds`: the plain torchvision forward that the
  pipeline's figures are quoted against;
* :func:`child_result` / :func:`report_result`: a measurement in a fresh process (its own peak
  memory), handing back one JSON line;
* :func:`write_json` and :func:`chunks`;
* :func:`code_version`: another checkout or a git revision's ``anomaly_hooks``, for a
  before/after comparison in one run;
* :func:`wait_ready` and :func:`stop_process`: a service process the benchmark started;
* :func:`update_arguments` and :func:`split_training`: what the model-update benchmarks
  (``bench_update``, ``bench_loop``) take and how they split the training images.

Importing this module imports no torch: the ONNX engines of ``bench_export`` are timed in
processes whose peak memory must not include it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, TypeVar

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data" / "sample"
RESULT = "RESULT "  # starts the line in which a child process hands back its figures
# CPU extensions that decide convolution and int8 speed
CPU_FLAGS = ("avx", "amx", "fma", "vnni")

T = TypeVar("T")


# -- where ------------------------------------------------------------------------------------
def _cpu_info() -> Dict[str, Any]:
    """The CPU model and its vector extensions, from ``/proc/cpuinfo`` (Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {"cpu": platform.processor()}
    fields: Dict[str, str] = {}
    for line in lines:
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())  # the first core's
    flags = fields.get("flags", "").split()
    return {"cpu": fields.get("model name", platform.processor()),
            "cpu_flags": sorted(f for f in flags if f.startswith(CPU_FLAGS) or "vnni" in f)}


def machine(device: Any = None, threads: Optional[int] = None) -> Dict[str, Any]:
    """Where the figures were measured: platform, CPU model and extensions, cores, RAM, load
    average, Python / numpy / torch versions, the threads the run used (``threads``, else
    torch's), the date; for a CUDA ``device`` the GPU the run used (its own name, not GPU
    0's). torch is reported only if the caller imported it (this module does not)."""
    import numpy as np
    import psutil

    info: Dict[str, Any] = {
        "platform": platform.platform(), "python": platform.python_version(),
        **_cpu_info(), "cores": os.cpu_count(),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_avg": os.getloadavg(), "numpy": np.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
    if threads is not None or torch is not None:
        info["threads"] = threads if threads is not None else torch.get_num_threads()
    if getattr(device, "type", None) == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["device"] = str(device)
    return info


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process, every live descendant (Ray's workers, say)
    and the children they have reaped."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue  # ended between the listing and the reading
        total += t.user + t.system + t.children_user + t.children_system
    return total


# -- timing -----------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, nearest rank; NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = int(round(q / 100 * (len(ordered) - 1)))
    return ordered[min(len(ordered) - 1, max(0, rank))]


@dataclass
class Repeats:
    """Wall seconds of each timed call, and the process's CPU seconds per call."""

    walls: List[float]
    cpu: float

    @property
    def median(self) -> float:
        return statistics.median(self.walls)

    @property
    def p90(self) -> float:
        return percentile(self.walls, 90)


def timed_repeats(fn: Callable[[], Any], repeats: int, *, warmup: int = 1) -> Repeats:
    """Call ``fn`` ``warmup`` times untimed (first-call allocations, lazy initialisation), then
    ``repeats`` times timed. ``fn`` must return only when its work is done (results on the
    host, or a device synchronised): the clock is read around the call."""
    for _ in range(warmup):
        fn()
    walls: List[float] = []
    cpu0 = time.process_time()
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    return Repeats(walls, (time.process_time() - cpu0) / len(walls))


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """Consecutive slices of ``items`` of at most ``size``."""
    for start in range(0, len(items), size):
        yield items[start:start + size]


# -- the yardstick ----------------------------------------------------------------------------
def bare_backbone(cfg: Any, layers: Sequence[str], device: Any) -> Callable[[Any], Any]:
    """torchvision's own ``create_feature_extractor`` up to the deepest of ``layers``, on a
    separately built copy of the config's backbone (no hooks), run as the detector's extractor
    runs its own: the same ``backbone.precision`` (autocast, or IEEE float32: no TF32) and
    ``backbone.channels_last``, but its BatchNorms as they are (the forward the peers run; the
    detector folds them, ``backbone.fold_batchnorm``). Give it images already on ``device``:
    the copy from the host is not the backbone's time."""
    import contextlib

    import torch
    from torchvision.models.feature_extraction import create_feature_extractor

    from anomaly_hooks.backbones import build_backbone
    from anomaly_hooks.devices import ieee_float32
    from anomaly_hooks.extractor import PRECISIONS

    model = build_backbone(cfg.backbone.name, cfg.backbone.weights, cfg.seed).to(device).eval()
    deepest = [name for name, _ in model.named_modules() if name in layers][-1]
    fx = create_feature_extractor(model, return_nodes=[deepest])
    channels_last = bool(cfg.backbone.channels_last)
    if channels_last:
        fx = fx.to(memory_format=torch.channels_last)
    dtype = PRECISIONS[str(cfg.backbone.precision)]

    def run(images: torch.Tensor) -> Any:
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None
                    else contextlib.nullcontext())
        with torch.inference_mode(), ieee_float32(), autocast:
            return fx(images)
    return run


def bare_seconds(bare: Callable[[Any], Any], batches: Iterable[Any], device: Any) -> float:
    """Seconds of ``bare`` over ``batches`` (each copied to ``device`` first, untimed),
    synchronised with the device."""
    from anomaly_hooks.timing import Stopwatch

    watch = Stopwatch(device)
    for images in batches:
        images = images.to(device)
        watch.mark()
        bare(images)
        watch.lap("bare_backbone")
    return watch.seconds.get("bare_backbone", 0.0)


# -- processes and files ----------------------------------------------------------------------
def report_result(result: Dict[str, Any]) -> None:
    """Hand ``result`` back to the parent that started this process (see
    :func:`child_result`)."""
    print(RESULT + json.dumps(result), flush=True)


def child_result(args: Sequence[object]) -> Dict[str, Any]:
    """Run ``python ARGS`` in a fresh process (its peak memory its own, nothing inherited but
    the environment) and return the figures of its last :func:`report_result` line, or
    ``{"error": ...}`` with the end of its stderr if it gave none."""
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if not lines:
        return {"error": f"exit status {proc.returncode}: {proc.stderr[-2000:]}"}
    return json.loads(lines[-1][len(RESULT):])


def code_version(spec: str, scratch: Path) -> Path:
    """The folder whose ``anomaly_hooks`` package a before/after comparison runs: ``spec``
    itself where it holds one (another checkout), else the package of git revision ``spec`` of
    this repository, exported under ``scratch`` (a temporary folder of the caller's)."""
    path = Path(spec)
    if (path / "anomaly_hooks" / "__init__.py").is_file():
        return path.resolve()
    out = Path(scratch) / re.sub(r"[^A-Za-z0-9._-]", "_", spec)
    out.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", spec, "anomaly_hooks"],
                             capture_output=True)
    if archive.returncode:
        raise SystemExit(f"{spec}: neither a folder with anomaly_hooks/ nor a git revision "
                         f"({archive.stderr.decode(errors='replace').strip()})")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def write_json(path: Path | str, data: Any) -> Path:
    """Write ``data`` as indented JSON (creating the folder); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path


def wait_ready(proc: Any, url: str, log_path: Optional[Path] = None,
               timeout: float = 600, what: str = "server") -> None:
    """Until the service at ``url`` answers ``/readyz`` with 200 (its model loaded and warmed
    up); ``SystemExit`` with its log if the process ``proc`` (a ``subprocess.Popen``) exits
    first or ``timeout`` seconds pass."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = log_path.read_text() if log_path is not None else ""
            raise SystemExit(f"{what} exited with {proc.returncode}:\n{log}")
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what} not ready after {timeout:g} s")


def stop_process(proc: Any, timeout: float = 120, group: bool = False) -> None:
    """Terminate the process ``proc`` (a ``subprocess.Popen``; SIGTERM: a service drains),
    killing it if it has not ended after ``timeout`` seconds; ``group``: signal its whole
    process group (one started with ``start_new_session=True``)."""
    if proc.poll() is not None:
        return

    def send(sig: int) -> None:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)

    send(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()


def update_arguments(description: str) -> argparse.ArgumentParser:
    """A parser with the arguments of the model-update benchmarks: ``--data`` (an
    MVTec-layout data set), ``--config``, ``--split`` (the share of the training images
    fitted first), ``--json`` and the ``key=value`` config overrides; a benchmark adds its
    own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data", required=True, help="an MVTec-layout data set")
    parser.add_argument("--config", required=True, help="YAML config (configs/padim.yaml, ...)")
    parser.add_argument("--split", type=float, default=0.5,
                        help="the share of the training images (file order) fitted first")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    return parser


def split_training(train: Sequence[T], split: float) -> "tuple[List[T], List[T]]":
    """The training images fitted first (the first ``split`` share in file order, one at
    least) and the rest."""
    n_first = max(1, int(math.ceil(split * len(train))))
    return list(train[:n_first]), list(train[n_first:])
