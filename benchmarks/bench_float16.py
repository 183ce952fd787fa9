#!/usr/bin/env python
"""Score difference of float16 storage (PaDiM factors, PatchCore bank) against float32.

Fits once, scores every test image with the float32 model, converts the stored tensor to
float16 (what ``padim.factor_dtype=float16`` / ``patchcore.bank_dtype=float16`` keep) and
scores again; prints the image AUROC of both and the relative score differences as JSON.
PaDiM is fitted with ``padim.covariance=dense`` (float16 applies to dense factors only).

    python benchmarks/bench_float16.py --config configs/padim.yaml \\
        --data ../shared/data/mvtec_bottle [--json float16.json] [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from omegaconf import read_write

from anomaly_hooks import Detector, load_config
from anomaly_hooks.evaluation.datasets import open_dataset
from anomaly_hooks.evaluation.metrics import image_auroc
from anomaly_hooks.scorers.patchcore.config import BankDtype
from benchmarks.measure import machine, write_json

BATCH = 32


def to_float16(det: Detector) -> None:
    """Convert the fitted model's stored tensor to float16, in place."""
    sc = det.scorer_
    if det.cfg.method == "padim":
        sc.gaussians.chol = sc.gaussians.chol.half()
    else:  # what a bank_dtype=float16 fit stores, with its index rebuilt
        with read_write(sc.cfg):
            sc.cfg.bank_dtype = BankDtype["float16"]
        sc.set_bank(sc.bank)


def scores_and_heatmaps(det: Detector, items: Sequence[Path]) -> Tuple[np.ndarray, torch.Tensor]:
    """Image scores ``[N]`` and full-size heatmaps ``[N, H, W]`` of ``items``."""
    preds = det.predict(list(items), batch_size=BATCH)
    return (np.array([p.score for p in preds]),
            torch.stack([torch.as_tensor(p.heatmap) for p in preds]))


def compare(config: str, data: Path, overrides: Sequence[str]) -> Dict[str, Any]:
    """Fit, score in float32, convert to float16, score again."""
    cfg = load_config(config, [f"data.batch_size={BATCH}", *overrides])
    if cfg.method == "padim":
        cfg = load_config(cfg, ["padim.covariance=dense"])
    dataset = open_dataset(data)
    det = Detector(cfg)
    det.fit(dataset.train, progress=False)
    tests = [s.path for s in dataset.test]
    s32, h32 = scores_and_heatmaps(det, tests)
    to_float16(det)
    s16, h16 = scores_and_heatmaps(det, tests)
    return {
        "config": config, "method": det.cfg.method, "images": len(tests),
        "image_auroc_float32": image_auroc(dataset.labels, s32),
        "image_auroc_float16": image_auroc(dataset.labels, s16),
        "image_score_max_rel_diff": float(np.max(np.abs(s16 - s32) / np.abs(s32))),
        "heatmap_max_rel_diff": float((h16 - h32).abs().max() / h32.abs().max()),
        "heatmap_mean_rel_diff": float((h16 - h32).abs().mean() / h32.abs().mean()),
        "machine": machine(det.device)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--data", type=Path, required=True, help="an MVTec AD layout root")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="backbone.weights is null")
    result = compare(args.config, args.data, args.overrides)
    print(json.dumps(result, indent=2))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
