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
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from anomaly_hooks.config import load_config, to_container
from anomaly_hooks.errors import ConfigError, DataError, ImageReadError
from anomaly_hooks.evaluation import metrics
from anomaly_hooks.evaluation.datasets import AnomalyDataset, copies_of_training
from anomaly_hooks.fitting import SEED_THRESHOLD_DEFECTS

log = logging.getLogger(__name__)

SUMMARY_KEYS = ("image_auroc", "pixel_auroc", "aupro", "image_f1_max", "pixel_f1_max",
                "fit_seconds", "ms_per_image")
# the stored threshold's verdicts: precision, recall, false-alarm rate on the good test images
THRESHOLD_KEYS = ("threshold_precision", "threshold_recall", "threshold_far", "threshold_f1")


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
             backbone: Any = None, threshold_defects: int = 0) -> EvalResult:
    """Fit ``config`` on ``dataset.train``, score ``dataset.test`` and compute the metrics.

    ``report_dir``: where to write the per-image report pictures (None = no pictures).
    ``threshold_defects``: a seeded draw of that many defective test images sets the operating
    point with the config's ``threshold.objective`` (:meth:`Detector.recalibrate`); they are
    left out of every metric and marked ``used_for_threshold`` in the per-image rows.
    Test images that are byte copies of training images are marked ``copy_of_training`` (a
    warning names them) and the stored threshold's false alarms are also given without them
    (``threshold_far_unseen``).
    """
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.evaluation.report import ReportWriter  # matplotlib: only when asked

    cfg = load_config(config, list(overrides))
    drawn = draw_threshold_defects(cfg, dataset, threshold_defects)
    objective = str(cfg.threshold.objective)
    fit_cfg = cfg
    if drawn:  # the drawn defects set the operating point after the fit (no refit)
        fit_cfg = load_config(cfg, ["threshold.objective=far", "threshold.defects=null"])
    det = Detector(fit_cfg, backbone=backbone)
    start = time.perf_counter()
    det.fit(dataset.train, progress=progress)
    fit_seconds = time.perf_counter() - start

    writer = ReportWriter(report_dir) if report_dir is not None else None
    copies = copies_of_training(dataset)
    _warn_copies(dataset, copies)
    records, masks, maps, predict_seconds = _score_test_set(det, dataset, writer, drawn,
                                                            copies)
    used = np.array([r["used_for_threshold"] for r in records], dtype=bool)
    if drawn:
        _set_operating_point(det, cfg, objective, records, used)
        for r in records:  # the verdicts at the new threshold
            r["is_anomalous"] = bool(r["score"] > det.threshold_.value)
            r["normalized_score"] = det.threshold_.normalize(r["score"])
    summary = _summary(det, cfg, dataset, records, used, fit_seconds, predict_seconds)
    if drawn:
        summary["threshold_defects"] = {"n": len(drawn), "seed": cfg.seed + SEED_THRESHOLD_DEFECTS,
                                        "files": [dataset.test[i].path.name for i in drawn]}
    curves = _curves(det, records, used, summary)
    pixel = _pixel_metrics(masks, maps) if masks else {}
    if "_pro_curve" in pixel:
        curves["pro"] = pixel.pop("_pro_curve")
    summary.update(pixel)
    result = EvalResult(summary, records, curves)
    if writer is not None:
        writer.finish(result.summary, result.curves)
    return result


def draw_threshold_defects(cfg: Any, dataset: AnomalyDataset, n: int) -> List[int]:
    """Indices into ``dataset.test`` of ``n`` defective images drawn with the config's seed
    (``seed + SEED_THRESHOLD_DEFECTS``), in ascending order; checks that the objective has
    labelled defects to work with."""
    objective = str(cfg.threshold.objective)
    if n < 0:
        raise ConfigError(f"--threshold-defects {n}: give a count >= 0")
    if n == 0:
        if objective != "far" and not cfg.threshold.defects:
            raise ConfigError(f"threshold.objective={objective} needs labelled defects: "
                              "--threshold-defects N (drawn from the test set) or "
                              "threshold.defects=DIR")
        return []
    bad = [i for i, s in enumerate(dataset.test) if s.label == 1]
    if n >= len(bad):
        raise DataError(f"--threshold-defects {n}: {dataset.name} has {len(bad)} defective test "
                        "images; leave at least one to evaluate")
    rng = np.random.default_rng(cfg.seed + SEED_THRESHOLD_DEFECTS)
    return sorted(int(i) for i in rng.choice(bad, size=n, replace=False))


def _warn_copies(dataset: AnomalyDataset, copies: Sequence[bool]) -> None:
    """A warning naming the test images that are byte copies of training images."""
    names = [s.path.name for s, c in zip(dataset.test, copies) if c]
    if names:
        warnings.warn(
            f"{dataset.name}: {len(names)} test image(s) are byte copies of training images "
            f"(e.g. {names[:3]}): the model has seen them, so their scores are in-sample; "
            "threshold_far_unseen gives the false alarms without them", UserWarning,
            stacklevel=3)


def _score_test_set(det: Any, dataset: AnomalyDataset, writer: Any, drawn: Sequence[int],
                    copies: Sequence[bool]) -> tuple:
    """(per-image records, masks, heatmaps, decode + predict seconds) of the test images;
    the ``drawn`` ones are marked ``used_for_threshold`` and kept out of the pixel metrics,
    the ``copies`` (per test image) ``copy_of_training``."""
    paths = [s.path for s in dataset.test]
    chosen = set(drawn)
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
        if gt is not None and i not in chosen:
            masks.append(gt)
            maps.append(pred.heatmap)
        rec = {"path": str(sample.path), "label": sample.label, "defect": sample.defect,
               **{k: v for k, v in pred.verdict.as_dict().items()
                  if k in ("score", "normalized_score", "is_anomalous")},
               "used_for_threshold": i in chosen, "copy_of_training": bool(copies[i])}
        if writer is not None:
            t_report = time.perf_counter()
            rec.update(writer.add(sample, pred, gt, used_for_threshold=i in chosen,
                                  copy_of_training=bool(copies[i])))
            report_seconds += time.perf_counter() - t_report
        records.append(rec)
    predict_seconds = time.perf_counter() - start - report_seconds
    if failures:
        raise ImageReadError(f"{len(failures)} test image(s) could not be read:\n"
                             + "\n".join(failures[:20]))
    return records, masks, maps, predict_seconds


def _set_operating_point(det: Any, cfg: Any, objective: str, records: List[Dict[str, Any]],
                         used: np.ndarray) -> None:
    """Recalibrate ``det`` with the drawn defects' scores (no refit, no re-scoring) and the
    config's objective; F1 is taken at the evaluated images' share of defects unless the
    config states ``threshold.prevalence``."""
    labels = np.array([r["label"] for r in records])
    scores = np.array([r["score"] for r in records])
    thr_cfg = cfg.threshold
    prevalence = thr_cfg.prevalence
    if objective == "f1" and prevalence is None:
        prevalence = float(labels[~used].mean())
    options = {"objective": objective, "tail": str(thr_cfg.tail)}
    if objective == "far" and thr_cfg.false_alarm_rate is not None:
        options["false_alarm_rate"] = float(thr_cfg.false_alarm_rate)
    if objective == "recall":
        options["target_recall"] = float(thr_cfg.target_recall)
    if objective == "f1":
        options["prevalence"] = prevalence
    names = [Path(r["path"]).name for r, u in zip(records, used) if u]
    prov = {**(det.threshold_.provenance or {}), "set_by": "evaluate --threshold-defects",
            "defects": {"source": "test split (seeded draw)", "n": int(used.sum()),
                        "files": names, "seed": int(cfg.seed + SEED_THRESHOLD_DEFECTS)}}
    det.threshold_ = det.threshold_.recalibrate(defect_scores=scores[used].tolist(),
                                                provenance=prov, **options)


def _summary(det: Any, cfg: Any, dataset: AnomalyDataset, records: List[Dict[str, Any]],
             used: np.ndarray, fit_seconds: float, predict_seconds: float) -> Dict[str, Any]:
    """The metrics of the evaluated images (the test images not used for the threshold) and
    what the stored threshold does on them."""
    keep = ~used
    labels = np.array([r["label"] for r in records])[keep]
    scores = np.array([r["score"] for r in records])[keep]
    verdicts = np.array([r["is_anomalous"] for r in records], dtype=bool)[keep]
    precision, recall = _precision_recall(labels, verdicts)
    good = labels == 0
    far = float(verdicts[good].mean()) if good.any() else None
    copy = np.array([r["copy_of_training"] for r in records], dtype=bool)[keep]
    unseen = good & ~copy
    thr = det.threshold_
    tp = int((verdicts & (labels == 1)).sum())
    f1 = 2 * tp / (verdicts.sum() + labels.sum()) if labels.any() else None
    return {
        "dataset": dataset.name, "method": cfg.method, "backbone": det.backbone_name,
        "layers": det.layers, "n_train": det.fit_info_.get("n_train"),
        "n_test": int(keep.sum()), "n_defective": int(labels.sum()),
        "image_auroc": metrics.image_auroc(labels, scores),
        "image_f1_max": metrics.f1_max(labels, scores)[0],
        "threshold": thr.value, "threshold_objective": thr.objective,
        "threshold_precision": precision, "threshold_recall": recall,
        "threshold_f1": f1, "threshold_far": far,
        "threshold_false_alarms": int(verdicts[good].sum()), "threshold_n_good": int(good.sum()),
        # the good test images the model has not seen (byte copies of training images left out)
        "test_copies_of_training": int(copy.sum()),
        "threshold_far_unseen": float(verdicts[unseen].mean()) if unseen.any() else None,
        "threshold_false_alarms_unseen": int(verdicts[unseen].sum()),
        "threshold_n_good_unseen": int(unseen.sum()),
        "threshold_far_interval": thr.far_interval,
        "threshold_far_pvalue": far_pvalue(int(verdicts[good].sum()), int(good.sum()),
                                           thr.far_interval),
        "threshold_expected_far": thr.expected_far,
        "threshold_expected_recall": thr.recall, "threshold_recall_interval": thr.recall_interval,
        "threshold_source": thr.source, "threshold_tail": thr.tail,
        "threshold_target_far": thr.false_alarm_rate,
        "threshold_target_recall": thr.target_recall, "threshold_prevalence": thr.prevalence,
        "threshold_supported_rate": thr.supported_rate,
        "threshold_n_images": thr.n_images,
        "threshold_scores": thr.scores,  # the good scores the threshold came from
        "threshold_provenance": thr.provenance,
        "fit_seconds": fit_seconds,
        "fit_timings": det.fit_timings_,
        "ms_per_image": 1000.0 * predict_seconds / max(len(records), 1),
        # the working frame and tiles, and the part of every image never inspected
        "framing": det.fit_info_.get("framing"),
        "config": to_container(cfg),
    }


def far_pvalue(false_alarms: int, n_good: int, interval: Optional[Sequence[float]]
               ) -> Optional[float]:
    """One-sided binomial test of ``false_alarms`` of ``n_good`` against the recorded
    interval's upper end: ``P(X >= false_alarms)``, ``X ~ Bin(n_good, upper)`` (small: more
    false alarms than the stated rate allows)."""
    if not interval or n_good == 0:
        return None
    from scipy.stats import binom

    return float(binom.sf(false_alarms - 1, n_good, float(interval[1])))


def _curves(det: Any, records: List[Dict[str, Any]], used: np.ndarray,
            summary: Dict[str, Any]) -> Dict[str, Any]:
    """The ROC of the evaluated images and the operating curve: false-alarm rate against
    recall on the test images and, from what set the threshold, on the good images'
    out-of-sample scores and the labelled defects' scores, with the stored point."""
    keep = ~used
    labels = np.array([r["label"] for r in records])[keep]
    scores = np.array([r["score"] for r in records])[keep]
    thr = det.threshold_
    curves: Dict[str, Any] = {"roc": metrics.roc_curve_points(labels, scores)[:2]}
    if summary["threshold_far"] is None or not labels.any():
        return curves
    calibration = None
    if thr.scores and thr.defect_scores:
        both = np.concatenate([thr.scores, thr.defect_scores])
        lab = np.concatenate([np.zeros(len(thr.scores)), np.ones(len(thr.defect_scores))])
        calibration = metrics.roc_curve_points(lab, both)[:2]
    curves["operating"] = {
        "test": curves["roc"], "calibration": calibration,
        "measured": (summary["threshold_far"], summary["threshold_recall"]),
        "expected": (thr.expected_far, thr.recall), "far_interval": thr.far_interval,
        "recall_interval": thr.recall_interval, "objective": thr.objective,
        "n_good": int((labels == 0).sum()), "n_defects_calibration": thr.n_defects}
    return curves


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
           "pixel F1-max | thr. precision | thr. recall | thr. FAR (test good) | thr. F1 | " \
           "fit s | ms / image |"
    lines = [head, "|" + "---|" * 14]
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
            "thr P", "thr R", "thr FAR", "thr F1"]
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
