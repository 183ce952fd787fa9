#!/usr/bin/env python
"""Model updates against a full refit: time, score agreement, false alarms and recall.

Usage::

    python benchmarks/bench_update.py --data ../shared/data/battery_weld \\
        --config configs/padim.yaml [key=value ...] [--json out.json]

On an MVTec-layout data set (``train/good``, ``test/<type>``) the training images, in file
order, are cut in two halves (``--split``, the first part): the way new good parts arrive.

* ``fit half``: a fit on the first part;
* ``+ update``: that model updated with the second part (``Detector.update``);
* ``fit all``: a fit on every training image.

Printed per model: the seconds it took, its threshold, the false alarms on ``test/good``, the
recall on the defective test images at that threshold and the image AUROC; then the update's
time as a ratio of the full fit's and the largest relative difference between the updated
model's and the full fit's scores on the test images and on the training images (PaDiM:
float32 rounding; PatchCore: the merge-reduce's bank differs from the one-shot coreset), and
the update's steps (``Detector.update_timings_``).
"""
from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from anomaly_hooks.config import load_config  # noqa: E402
from anomaly_hooks.detector import Detector  # noqa: E402
from anomaly_hooks.evaluation.datasets import mvtec  # noqa: E402
from anomaly_hooks.evaluation.metrics import image_auroc  # noqa: E402
from benchmarks.measure import (  # noqa: E402
    machine,
    split_training,
    update_arguments,
    write_json,
)


def rates(det: Detector, scores: np.ndarray, labels: np.ndarray) -> dict:
    """False alarms on the good test images and recall on the defective ones, at the model's
    threshold; the image AUROC."""
    flagged = scores > det.threshold_.value
    good = labels == 0
    return {"threshold": float(det.threshold_.value),
            "false_alarms": int(flagged[good].sum()), "n_good": int(good.sum()),
            "recall": float(flagged[~good].mean()), "n_defective": int((~good).sum()),
            "auroc": float(image_auroc(labels, scores))}


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main(argv=None) -> int:
    args = update_arguments(__doc__.split("\n\n")[0]).parse_args(argv)
    data = mvtec(args.data)
    cfg = load_config(args.config, args.overrides)
    train = [str(p) for p in data.train]
    first, second = split_training(train, args.split)
    tests = [str(s.path) for s in data.test]
    labels = data.labels
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random-init backbones, few images for the rate
        det = Detector(cfg)
        _, t_half = timed(lambda: det.fit(first, progress=False))
        half = rates(det, det.decision_function(tests), labels)
        _, t_update = timed(lambda: det.update(second))
        upd_test = det.decision_function(tests)
        updated = rates(det, upd_test, labels)
        upd_train = det.decision_function(train)
        full_det = Detector(cfg)
        _, t_full = timed(lambda: full_det.fit(train, progress=False))
        full_test = full_det.decision_function(tests)
        full = rates(full_det, full_test, labels)
        full_train = full_det.decision_function(train)
    rel_test = float(np.max(np.abs(upd_test - full_test) / np.abs(full_test)))
    rel_train = float(np.max(np.abs(upd_train - full_train) / np.abs(full_train)))
    steps = {k: round(v, 2) for k, v in det.update_timings_.items()}
    summary = {k: v for k, v in det.scorer_.summary().items() if k != "patches"}
    rows = [("fit half", len(first), t_half, half), ("+ update", len(second), t_update, updated),
            ("fit all", len(train), t_full, full)]
    name = f"{Path(args.config).name} {' '.join(args.overrides)}".strip()
    print(f"{data.name}, {name}: {len(first)} + {len(second)} training images, "
          f"{len(tests)} test images; model after the update: {summary}")
    print("| model | images | seconds | threshold | false alarms (test/good) | recall | AUROC |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, n, seconds, r in rows:
        print(f"| {label} | {n} | {seconds:.1f} | {r['threshold']:.4g} | "
              f"{r['false_alarms']}/{r['n_good']} | {100 * r['recall']:.1f} % | "
              f"{r['auroc']:.3f} |")
    print(f"update / full fit time: {t_update / t_full:.2f}; max relative score difference "
          f"updated vs full fit: test images {rel_test:.2e}, training images {rel_train:.2e}")
    print(f"update steps (s): {steps}")
    if args.json:
        write_json(args.json, {"data": str(args.data), "config": args.config,
                               "overrides": args.overrides, "machine": machine(det.device),
                               "models": [{"model": label, "images": n, "seconds": s, **r}
                                          for label, n, s, r in rows],
                               "update_over_full": t_update / t_full,
                               "max_relative_difference": {"test": rel_test,
                                                           "train": rel_train},
                               "update_steps": steps, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
