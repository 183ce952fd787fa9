#!/usr/bin/env python
"""Freed host memory kept for reuse (:mod:`anomaly_hooks.heap`) against the C library's own
behaviour: a fit and a scoring run, each pair in fresh processes, in turns.

Usage::

    nice -n 5 python benchmarks/bench_heap.py --data ../shared/data/visa_macaroni1 \\
        --config configs/padim_effnet_lite0.yaml [--train 200] [--test 100] [--repeats 3] \\
        [key=value ...] [--json out.json]

Each process fits on the first ``--train`` training images, then scores the first ``--test``
test images (``decision_function``), with ``ANOMALY_HOOKS_KEEP_HEAP`` on or off; printed per
mode, medians over ``--repeats`` processes: the seconds of each job, its CPU seconds in user
and system mode, its minor page faults, the process's peak resident memory and its resident
memory after the jobs (what the process keeps), and the largest score difference between
the modes (none expected: only where memory comes from changes).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks.measure import child_result, machine, report_result, write_json  # noqa: E402

ENV = ("ANOMALY_HOOKS_KEEP_HEAP", "THP_MEM_ALLOC_ENABLE")
# mode -> the values of ENV in its processes
MODES = {"keep": ("1", "0"), "release": ("0", "0"), "release, THP": ("0", "1"),
         "keep, THP": ("1", "1")}


def usage() -> Dict[str, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"user": r.ru_utime, "sys": r.ru_stime, "faults": float(r.ru_minflt)}


def timed(fn: Any) -> tuple[Any, Dict[str, float]]:
    """``fn()`` and its seconds, CPU seconds and minor faults."""
    before, start = usage(), time.perf_counter()
    out = fn()
    after = usage()
    return out, {"s": time.perf_counter() - start,
                 **{k: after[k] - before[k] for k in before}}


def child(args: argparse.Namespace) -> int:
    """One process: fit, then score; report the figures."""
    import psutil

    from anomaly_hooks import heap
    from anomaly_hooks.config import load_config
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.evaluation.datasets import mvtec
    from anomaly_hooks.timing import peak_rss_mb

    warnings.simplefilter("ignore")
    data = mvtec(args.data)
    cfg = load_config(args.config, args.overrides)
    train = [str(p) for p in data.train][:args.train]
    test = [str(s.path) for s in data.test][:args.test]
    det, fit = timed(lambda: Detector(cfg).fit(train, progress=False))
    scores, score = timed(lambda: det.decision_function(test))
    after = psutil.Process().memory_info().rss / 2**20
    # the high-water mark read after the RSS (whose reading may itself fault in a page or
    # two), and never below it (the kernel's RSS counters are summed per CPU, with slack)
    report_result({"fit": fit, "score": score, "peak_rss_mb": max(peak_rss_mb(), after),
                   "rss_after_mb": after, "keeps": heap.enabled(),
                   "scores": np.asarray(scores).tolist()})
    return 0


def median(runs: List[Dict[str, Any]], *keys: str) -> float:
    values = []
    for r in runs:
        v: Any = r
        for k in keys:
            v = v[k]
        values.append(v)
    return float(np.median(values))


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="an MVTec-layout data set")
    parser.add_argument("--config", required=True)
    parser.add_argument("--train", type=int, default=200, help="training images (first N)")
    parser.add_argument("--test", type=int, default=100, help="test images scored (first N)")
    parser.add_argument("--repeats", type=int, default=3, help="processes per mode, in turns")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    runs: Dict[str, List[Dict[str, Any]]] = {m: [] for m in MODES}
    cmd = [__file__, "--child", "--data", args.data, "--config", args.config,
           "--train", args.train, "--test", args.test, *args.overrides]
    saved = {k: os.environ.get(k) for k in ENV}
    try:
        for _ in range(args.repeats):
            for mode, values in MODES.items():
                os.environ.update(zip(ENV, values))  # the children inherit the environment
                result = child_result(cmd)
                if "error" in result:
                    print(f"{mode}: {result['error']}", file=sys.stderr)
                    return 1
                runs[mode].append(result)
    finally:  # this process's own settings as they were
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out: Dict[str, Any] = {"data": args.data, "config": args.config, "train": args.train,
                           "test": args.test, "repeats": args.repeats, "machine": machine()}
    print(f"{args.config} on {args.data}: fit on {args.train} images, score {args.test}; "
          f"medians of {args.repeats} fresh processes per mode, in turns")
    print("| mode | fit s | fit CPU s (user + system) | fit faults | score s | score CPU s "
          "(user + system) | score faults | peak RSS MB | RSS after MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, rs in runs.items():
        row = {job: {k: median(rs, job, k) for k in ("s", "user", "sys", "faults")}
               for job in ("fit", "score")}
        row["peak_rss_mb"] = median(rs, "peak_rss_mb")
        row["rss_after_mb"] = median(rs, "rss_after_mb")
        row["keeps"] = bool(rs[0]["keeps"])
        out[mode] = row
        f, s = row["fit"], row["score"]
        print(f"| {mode}{'' if row['keeps'] or 'keep' not in mode else ' (off here)'} | "
              f"{f['s']:.2f} | {f['user']:.2f} + {f['sys']:.2f} | {f['faults']:.0f} | "
              f"{s['s']:.2f} | {s['user']:.2f} + {s['sys']:.2f} | {s['faults']:.0f} | "
              f"{row['peak_rss_mb']:.0f} | {row['rss_after_mb']:.0f} |")
    keep, release = out["keep"], out["release"]
    out["fit_ratio"] = keep["fit"]["s"] / release["fit"]["s"]
    out["score_ratio"] = keep["score"]["s"] / release["score"]["s"]
    a = np.asarray(runs["keep"][0]["scores"])
    b = np.asarray(runs["release"][0]["scores"])
    out["max_score_difference"] = float(np.abs(a - b).max()) if a.size else 0.0
    print(f"keep / release: fit {out['fit_ratio']:.2f}, score {out['score_ratio']:.2f}; "
          f"largest score difference {out['max_score_difference']:.3g}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
