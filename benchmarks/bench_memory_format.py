#!/usr/bin/env python
"""A backbone or loader setting on or off: fit and predict times, and how much the scores
differ.

Usage::

    python benchmarks/bench_memory_format.py --data ../shared/data/visa_macaroni1 \\
        --config configs/padim_effnet_lite0.yaml [--setting backbone.channels_last] \\
        [--fit 100] [--predict 60] [--repeats 2] [key=value ...] [--json out.json]

``--setting``: ``backbone.channels_last`` (the default: contiguous against channels-last),
``backbone.fold_batchnorm`` (BatchNorms kept against folded into their convolutions),
``backbone.fold_padding`` (zero-padding layers kept against folded into the convolutions) or
``backbone.inplace_activations`` (activations out of place against in place) or
``data.worker_processes`` (the loader's decoding threads against worker processes). For
each of ``false`` and ``true`` (in turns, ``--repeats`` times): a fit on the first ``--fit``
training images and ``decision_function`` on the first ``--predict`` test images. Printed per
value: the medians of the fit's seconds, of its backbone seconds (``fit_timings_``,
"accumulate: features") and of the predict milliseconds an image; then the ratios (false /
true) and how much the two values' scores and thresholds differ (float32 rounding of other
kernels or weights, amplified by the scorer).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from anomaly_hooks.config import load_config  # noqa: E402
from anomaly_hooks.detector import Detector  # noqa: E402
from anomaly_hooks.evaluation.datasets import mvtec  # noqa: E402
from benchmarks.measure import machine, write_json  # noqa: E402

VALUES = (False, True)
# what false and true are called in the output, per setting
SETTINGS = {"backbone.channels_last": ("contiguous", "channels_last"),
            "backbone.fold_batchnorm": ("unfolded", "folded"),
            "backbone.fold_padding": ("padded", "pad folded"),
            "backbone.inplace_activations": ("out of place", "in place"),
            "data.worker_processes": ("threads", "processes")}


def one_run(config: str, overrides: List[str], setting: str, value: bool, train: List[str],
            tests: List[str]) -> Dict[str, Any]:
    """Fit and score once with ``setting=value``: seconds, scores and threshold."""
    cfg = load_config(config, [*overrides, f"{setting}={value}"])
    start = time.perf_counter()
    det = Detector(cfg).fit(train, progress=False)
    fit_s = time.perf_counter() - start
    start = time.perf_counter()
    scores = np.asarray(det.decision_function(tests), dtype=np.float64)
    predict_ms = (time.perf_counter() - start) / len(tests) * 1000
    return {"fit_s": fit_s, "features_s": det.fit_timings_.get("accumulate: features", 0.0),
            "predict_ms": predict_ms, "scores": scores, "threshold": det.threshold_.value}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="an MVTec-layout data set")
    parser.add_argument("--config", required=True)
    parser.add_argument("--fit", type=int, default=100, help="training images fitted")
    parser.add_argument("--predict", type=int, default=60, help="test images scored")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="backbone.channels_last",
                        help="the boolean setting compared")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("overrides", nargs="*", help="config key=value")
    args = parser.parse_args(argv)
    data = mvtec(args.data)
    train = [str(p) for p in data.train][:args.fit]
    tests = [str(s.path) for s in data.test][:args.predict]
    warnings.simplefilter("ignore")  # the few-images rate warnings of every fit
    runs: Dict[bool, List[Dict[str, Any]]] = {v: [] for v in VALUES}
    for _ in range(args.repeats):
        for value in VALUES:
            runs[value].append(one_run(args.config, args.overrides, args.setting, value, train,
                                       tests))
    out: Dict[str, Any] = {"config": args.config, "data": args.data, "setting": args.setting,
                           "n_fit": len(train), "n_predict": len(tests), "machine": machine()}
    names = SETTINGS[args.setting]
    for value in VALUES:
        name = names[value]
        out[name] = {key: statistics.median(r[key] for r in runs[value])
                     for key in ("fit_s", "features_s", "predict_ms")}
        print(f"{name:>13}: fit {out[name]['fit_s']:.1f} s (backbone "
              f"{out[name]['features_s']:.1f} s), predict {out[name]['predict_ms']:.0f} ms/image"
              f" (medians of {args.repeats})")
    a, b = out[names[False]], out[names[True]]
    out["speedup"] = {key: a[key] / b[key] for key in a}
    s0, s1 = runs[False][0]["scores"], runs[True][0]["scores"]
    t0, t1 = runs[False][0]["threshold"], runs[True][0]["threshold"]
    out["max_relative_score_difference"] = float(np.max(np.abs(s1 - s0) / np.abs(s0)))
    out["relative_threshold_difference"] = abs(t1 - t0) / abs(t0)
    print(f"{names[False]} / {names[True]}: " + ", ".join(
        f"{k} {v:.2f}" for k, v in out["speedup"].items()))
    print(f"scores differ by at most {out['max_relative_score_difference']:.1e} (relative), "
          f"thresholds by {out['relative_threshold_difference']:.1e}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
