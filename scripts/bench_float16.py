#!/usr/bin/env python
"""Score difference of float16 storage (PaDiM factors, PatchCore bank) against float32.

Fits once, scores every test image with the float32 model, converts the stored tensor to
float16 (what ``padim.factor_dtype=float16`` / ``patchcore.bank_dtype=float16`` keep) and
scores again; prints the image AUROC of both and the relative score differences as JSON.
PaDiM is fitted with ``padim.covariance=dense`` (float16 applies to dense factors only).

    python scripts/bench_float16.py --config configs/padim.yaml --data ../shared/data/mvtec_bottle
"""
import argparse
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import read_write  # noqa: E402
from sklearn.metrics import roc_auc_score  # noqa: E402

from anomaly_hooks import Detector, load_config  # noqa: E402
from anomaly_hooks.data import list_images, train_folder  # noqa: E402
from anomaly_hooks.evaluation.benchmark import _test_items  # noqa: E402


def to_float16(det: Detector) -> None:
    """Convert the fitted model's stored tensor to float16, in place."""
    sc = det.scorer_
    if det.cfg.method == "padim":
        sc.gaussians.chol = sc.gaussians.chol.half()
    else:  # what a bank_dtype=float16 fit stores, with its index rebuilt
        with read_write(sc.cfg):
            sc.cfg.bank_dtype = "float16"
        sc.set_bank(sc.bank)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--data", required=True, help="an MVTec AD layout root")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="backbone.weights is null")
    cfg = load_config(args.config, ["data.batch_size=32", *args.overrides])
    if cfg.method == "padim":
        cfg = load_config(cfg, ["padim.covariance=dense"])
    det = Detector(cfg)
    det.fit(list_images(train_folder(Path(args.data))), progress=False)
    tests = _test_items(Path(args.data))
    labels = np.array([0 if p.parent.name == "good" else 1 for p in tests])

    def run() -> tuple[np.ndarray, torch.Tensor]:
        preds = det.predict(tests, batch_size=32)
        return (np.array([p.score for p in preds]),
                torch.stack([torch.as_tensor(p.heatmap) for p in preds]))

    s32, h32 = run()
    to_float16(det)
    s16, h16 = run()
    print(json.dumps({
        "config": args.config, "method": det.cfg.method, "images": len(tests),
        "image_auroc_float32": roc_auc_score(labels, s32),
        "image_auroc_float16": roc_auc_score(labels, s16),
        "image_score_max_rel_diff": float(np.max(np.abs(s16 - s32) / np.abs(s32))),
        "heatmap_max_rel_diff": float((h16 - h32).abs().max() / h32.abs().max()),
        "heatmap_mean_rel_diff": float((h16 - h32).abs().mean() / h32.abs().mean())}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
