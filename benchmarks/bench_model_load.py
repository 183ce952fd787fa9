#!/usr/bin/env python
"""Memory of a loaded model and the time of an update from it, in fresh processes.

Usage::

    nice -n 5 python benchmarks/bench_model_load.py --model M.safetensors [M2 ...] \\
        [--before /path/to/other/checkout | --before REVISION] \\
        [--update DIR --update-skip 100 --update-count 10] \\
        [--save] [--for-update] [--repeats 2] [--json out.json]

Each measurement runs in its own child process (``Detector.load(M, device="cpu")``; with
``--for-update``, ``for_update=True``: what an update remakes stays in the file); several
models (e.g. one model saved in two formats) are measured in turns. The
resident set size after importing the toolkit, after the load, and the peak; the load's
seconds; where the model left its kept embeddings in the file (a dense PaDiM), the seconds to
read them back (verified); with ``--save``, the seconds of saving the loaded model to a new
file beside it (checksummed, written, synced; removed after); with ``--update``, the seconds
of ``Detector.update`` with ``--update-count`` images of ``DIR`` (after the first
``--update-skip``) and the peak RSS after it. ``--before``: the same measurements with the
toolkit imported from another checkout (e.g. the main branch) or a git revision of this one,
alternated with this one's, for a before/after comparison in one run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.measure import code_version, machine, write_json  # noqa: E402

# run in the child with the measured checkout first on sys.path: public interfaces only
CHILD = r"""
import gc, json, resource, sys, time
import psutil
from anomaly_hooks.detector import Detector
import torch

def rss():
    return psutil.Process().memory_info().rss / 2**20

args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
out = {"code": __import__("anomaly_hooks").__file__, "rss_start_mb": rss()}
from pathlib import Path
from anomaly_hooks.modelfile import read_header
out["format_version"] = read_header(Path(args["model"]))["__metadata__"]["format_version"]
start = time.perf_counter()
det = (Detector.load(args["model"], device="cpu", for_update=True) if args["for_update"]
       else Detector.load(args["model"], device="cpu"))
out["load_s"] = time.perf_counter() - start
gc.collect()
out["rss_loaded_mb"] = rss()
out["peak_loaded_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
g = det.scorer_.gaussians
stored = getattr(g, "stored_samples", None)
out["embeddings_in_file"] = stored is not None
if stored is not None:
    start = time.perf_counter()
    x = g.samples
    out["read_embeddings_s"] = time.perf_counter() - start
    out["embeddings_mb"] = x.nbytes / 2**20
    del x
if args["save"]:
    import os, tempfile
    with tempfile.TemporaryDirectory(dir=args["save_dir"]) as tmp:
        start = time.perf_counter()
        det.save(os.path.join(tmp, "copy.safetensors"))
        out["save_s"] = time.perf_counter() - start
if args["update"]:
    from pathlib import Path
    from anomaly_hooks.data import list_images
    skip = args["update_skip"]
    images = [str(p) for p in list_images(Path(args["update"]))][skip:skip + args["update_count"]]
    start = time.perf_counter()
    det.update(images)
    out["update_s"] = time.perf_counter() - start
    out["update_steps"] = det.update_timings_
    out["update_images"] = len(images)
    out["n_train_after"] = det.scorer_.n_train
    out["peak_after_update_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("RESULT " + json.dumps(out))
"""


def measure(root: Path, model: Path, args: argparse.Namespace) -> Dict[str, Any]:
    """One child process with the toolkit of checkout ``root``, loading ``model``."""
    # absolute paths: the child runs in the measured code's folder
    spec = {"model": str(model.resolve()), "threads": args.threads,
            "for_update": args.for_update,
            "update": None if args.update is None else str(args.update.resolve()),
            "update_count": args.update_count, "update_skip": args.update_skip,
            "save": args.save, "save_dir": str(model.resolve().parent)}
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, cwd=root,
                          capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"child for {root} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"root": str(root), "model": str(model), **json.loads(lines[-1][len("RESULT "):])}


def summary_line(r: Dict[str, Any]) -> str:
    """One printed line per measurement."""
    parts = [f"{r['root']} {Path(r['model']).name} (format {r['format_version']}): "
             f"load {r['load_s']:.2f} s",
             f"RSS {r['rss_start_mb']:.0f} -> {r['rss_loaded_mb']:.0f} MiB "
             f"(+{r['rss_loaded_mb'] - r['rss_start_mb']:.0f}), peak {r['peak_loaded_mb']:.0f}",
             f"embeddings in the file: {r['embeddings_in_file']}"]
    if "read_embeddings_s" in r:
        parts.append(f"read {r['embeddings_mb']:.0f} MiB in {r['read_embeddings_s']:.2f} s")
    if "save_s" in r:
        parts.append(f"save {r['save_s']:.2f} s")
    if "update_s" in r:
        steps = ", ".join(f"{k} {v:.1f}" for k, v in r["update_steps"].items())
        parts.append(f"update +{r['update_images']} images {r['update_s']:.1f} s ({steps}), "
                     f"peak {r['peak_after_update_mb']:.0f} MiB")
    return "; ".join(parts)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, nargs="+")
    p.add_argument("--before", help="another checkout, or a git revision of this one, to "
                                    "measure alternately")
    p.add_argument("--update", type=Path, help="folder of good images for an update")
    p.add_argument("--update-count", type=int, default=10)
    p.add_argument("--update-skip", type=int, default=0,
                   help="images of --update to skip first (those the model was fitted on)")
    p.add_argument("--save", action="store_true",
                   help="also time saving the loaded model to a new file beside it")
    p.add_argument("--for-update", action="store_true",
                   help="load as for an update (Detector.load(for_update=True))")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_model_load_") as scratch:
        roots = [REPO] + ([code_version(args.before, Path(scratch))] if args.before else [])
        for _ in range(args.repeats):
            for model in args.model:
                for root in roots:
                    results.append(measure(root, model, args))
                    print(summary_line(results[-1]), flush=True)
    if args.json:
        write_json(args.json, {"machine": machine(threads=args.threads),
                               "models": {str(m): m.stat().st_size / 2**20 for m in args.model},
                               "for_update": args.for_update, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
