"""Evaluation runner: fit on a dataset's good training images, score its test set, compute the
image and pixel metrics, and write JSON, CSV and a visual report.

Pixel metrics are computed at each mask's own resolution (heatmaps come back in the frame of
the original image).
"""
from __future__ import annotations

import csv
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from anomaly_hooks.config import load_config, to_container
from anomaly_hooks.errors import ImageReadError
from anomaly_hooks.evaluation import metrics
from anomaly_hooks.evaluation.datasets import AnomalyDataset

log = logging.getLogger(__name__)

SUMMARY_KEYS = ("image_auroc", "pixel_auroc", "aupro", "image_f1_max", "pixel_f1_max",
                "fit_seconds", "ms_per_image")
# the stored threshold's verdicts: precision, recall, false-alarm rate on the good test images
THRESHOLD_KEYS = ("threshold_precision", "threshold_recall", "threshold_far")


@dataclass
class EvalResult:
    """Everything one evaluation measured (``summary`` is JSON-ready)."""

    summary: Dict[str, Any]
    images: List[Dict[str, Any]]
    curves: Dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        return {**self.summary, "images": self.images}


def _pixel_metrics(masks: List[np.ndarray], maps: List[np.ndarray]) -> Dict[str, Any]:
    """Pixel AUROC, AUPRO (FPR <= 0.3) and pixel F1-max at the masks' own resolution, from one
    pass over the images; empty when no mask has a defect pixel."""
    if not any(m.any() for m in masks):
        return {}
    out = metrics.pixel_metrics(masks, maps, fpr_limit=0.3)
    return {"pixel_auroc": out["pixel_auroc"], "aupro": out["aupro"],
            "pixel_f1_max": out["pixel_f1_max"], "_pro_curve": out["pro_curve"]}


def evaluate(config: Any, dataset: AnomalyDataset, overrides: Sequence[str] = (),
             report_dir: Optional[Path] = None, progress: bool = True,
             backbone: Any = None) -> EvalResult:
    """Fit ``config`` on ``dataset.train``, score ``dataset.test`` and compute the metrics.

    ``report_dir``: where to write the per-image report pictures (None = no pictures).
    """
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.evaluation.report import ReportWriter  # matplotlib: only when asked

    cfg = load_config(config, list(overrides))
    det = Detector(cfg, backbone=backbone)
    start = time.perf_counter()
    det.fit(dataset.train, progress=progress)
    fit_seconds = time.perf_counter() - start

    writer = ReportWriter(report_dir) if report_dir is not None else None
    paths = [s.path for s in dataset.test]
    records: List[Dict[str, Any]] = []
    masks: List[np.ndarray] = []
    maps: List[np.ndarray] = []
    failures: List[str] = []
    report_seconds = 0.0
    start = time.perf_counter()
    for i, pred in det.iter_predict(paths):
        sample = dataset.test[i]
        if isinstance(pred, ImageReadError):
            failures.append(str(pred))
            continue
        h, w = pred.heatmap.shape
        gt = dataset.load_mask(sample, (w, h)) if dataset.has_masks else None
        if gt is not None:
            masks.append(gt)
            maps.append(pred.heatmap)
        rec = {"path": str(sample.path), "label": sample.label, "defect": sample.defect,
               **{k: v for k, v in pred.verdict.as_dict().items()
                  if k in ("score", "normalized_score", "is_anomalous")}}
        if writer is not None:
            t_report = time.perf_counter()
            rec.update(writer.add(sample, pred, gt))
            report_seconds += time.perf_counter() - t_report
        records.append(rec)
    predict_seconds = time.perf_counter() - start - report_seconds  # decode + predict only
    if failures:
        raise ImageReadError(f"{len(failures)} test image(s) could not be read:\n"
                             + "\n".join(failures[:20]))
    labels = np.array([r["label"] for r in records])
    scores = np.array([r["score"] for r in records])
    verdicts = np.array([r["is_anomalous"] for r in records])
    precision, recall = _precision_recall(labels, verdicts)
    good = labels == 0
    far = float(verdicts[good].mean()) if good.any() else None
    thr = det.threshold_
    summary: Dict[str, Any] = {
        "dataset": dataset.name, "method": cfg.method, "backbone": det.backbone_name,
        "layers": det.layers, "n_train": det.fit_info_.get("n_train"),
        "n_test": len(records), "n_defective": int(labels.sum()),
        "image_auroc": metrics.image_auroc(labels, scores),
        "image_f1_max": metrics.f1_max(labels, scores)[0],
        "threshold": thr.value,
        "threshold_precision": precision, "threshold_recall": recall,
        "threshold_far": far,
        "threshold_source": thr.source, "threshold_tail": thr.tail,
        "threshold_target_far": thr.false_alarm_rate,
        "threshold_far_interval": thr.far_interval,
        "threshold_n_images": thr.n_images,
        "threshold_scores": thr.scores,  # the good scores the threshold came from
        "fit_seconds": fit_seconds,
        "fit_timings": det.fit_timings_,
        "ms_per_image": 1000.0 * predict_seconds / max(len(records), 1),
        # the working frame and tiles, and the part of every image never inspected
        "framing": det.fit_info_.get("framing"),
        "config": to_container(cfg),
    }
    curves: Dict[str, Any] = {"roc": metrics.roc_curve_points(labels, scores)[:2]}
    if far is not None and labels.any():  # the stored threshold's operating point on the ROC
        curves["roc_point"] = (far, recall, thr.false_alarm_rate, thr.far_interval)
    pixel = _pixel_metrics(masks, maps) if masks else {}
    if "_pro_curve" in pixel:
        curves["pro"] = pixel.pop("_pro_curve")
    summary.update(pixel)
    result = EvalResult(summary, records, curves)
    if writer is not None:
        writer.finish(result.summary, result.curves)
    return result


def _precision_recall(labels: np.ndarray, verdicts: np.ndarray) -> tuple[float, float]:
    """Precision and recall of the stored threshold's verdicts (precision 0 if none flagged)."""
    tp = int((verdicts & (labels == 1)).sum())
    flagged, positives = int(verdicts.sum()), int((labels == 1).sum())
    return (tp / flagged if flagged else 0.0), (tp / positives if positives else 0.0)


def write_results(results: List[EvalResult], out: Path) -> None:
    """``results.json`` (every image) and ``results.csv`` (one row per dataset + mean)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.json", "w") as fh:
        json.dump({"datasets": [r.as_dict() for r in results],
                   "mean": mean_row(results)}, fh, indent=2, default=_json_default)
    (out / "results.md").write_text(format_markdown(results) + "\n")
    cols = ["dataset", "method", *SUMMARY_KEYS, *THRESHOLD_KEYS]
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        for row in [r.summary for r in results] + [mean_row(results)]:
            writer.writerow(row)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def mean_row(results: List[EvalResult]) -> Dict[str, Any]:
    """Mean of each metric over the datasets that have it."""
    row: Dict[str, Any] = {"dataset": "mean", "method": results[0].summary["method"]
                           if results else ""}
    for key in (*SUMMARY_KEYS, *THRESHOLD_KEYS):
        vals = [r.summary[key] for r in results if r.summary.get(key) is not None]
        row[key] = float(np.mean(vals)) if vals else None
    return row


def format_markdown(results: List[EvalResult]) -> str:
    """The results as a Markdown table (what BENCHMARKS.md is made of)."""
    keys = ["image_auroc", "pixel_auroc", "aupro", "image_f1_max", "pixel_f1_max",
            *THRESHOLD_KEYS, "fit_seconds", "ms_per_image"]
    head = "| dataset | method | backbone | image AUROC | pixel AUROC | AUPRO | image F1-max | " \
           "pixel F1-max | thr. precision | thr. recall | thr. FAR (test good) | fit s | " \
           "ms / image |"
    lines = [head, "|" + "---|" * 13]
    rows = [r.summary for r in results]
    if len(results) > 1:
        rows.append({**mean_row(results), "backbone": results[0].summary["backbone"]})
    for row in rows:
        cells = []
        for k in keys:
            v = row.get(k)
            cells.append("–" if v is None else (f"{v:.1f}" if k in ("fit_seconds", "ms_per_image")
                                                else f"{100 * v:.1f}"))
        lines.append(f"| {row['dataset']} | {row['method']} | {row.get('backbone', '')} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_table(results: List[EvalResult]) -> str:
    """A fixed-width table: one row per dataset, then the mean."""
    head = ["dataset", "img AUROC", "pix AUROC", "AUPRO", "img F1", "pix F1", "fit s", "ms/img",
            "thr P", "thr R", "thr FAR"]
    keys = ["image_auroc", "pixel_auroc", "aupro", "image_f1_max", "pixel_f1_max",
            "fit_seconds", "ms_per_image", *THRESHOLD_KEYS]
    rows = [[r.summary["dataset"]] + [r.summary.get(k) for k in keys] for r in results]
    if len(results) > 1:
        mean = mean_row(results)
        rows.append(["mean"] + [mean.get(k) for k in keys])
    lines = ["  ".join(f"{h:>10}" for h in head)]
    for row in rows:
        cells = [f"{row[0]:>10}"] + [f"{'-':>10}" if v is None else
                                      (f"{v:10.1f}" if k in ("fit_seconds", "ms_per_image")
                                       else f"{v:10.4f}") for k, v in zip(keys, row[1:])]
        lines.append("  ".join(cells))
    return "\n".join(lines)
