#!/usr/bin/env python
"""Operating points on real data: the stored threshold's false alarms and recall per objective.

Usage::

    python benchmarks/bench_threshold.py [--data ROOT ...] [--methods padim patchcore]
        [--objectives far f1 recall] [--defects 10] [--target-recall 0.9] [--device cpu] [--out DIR]
        [--shots PARTS SHOTS] [--draws N]

For every data set (MVTec layout; default the three under ``../shared/data``) and method (the
pretrained EfficientNet-Lite0 configs), ``anomaly_hooks.evaluation.runner.evaluate`` runs once
per objective: ``far`` at the config's 1 % (good images only), ``f1`` and ``recall`` with a
seeded draw of ``--defects`` defective test images (left out of the metrics). Printed per run,
all on the evaluated test images:

* the stored threshold's false alarms on test/good, the recorded 90 % interval and the
  one-sided binomial p-value of those false alarms against its upper end (target: >= 0.05);
* the false alarms on test/good without the test images that are byte copies of training
  images (the model has seen those: they score in-sample, not as unseen parts);
* its recall and image F1, and the oracle F1-max of the same images (target for ``f1``: within
  0.05);
* the recall at 5 % false alarms with the best threshold (what the model could do).

``--shots PARTS SHOTS`` adds the re-shot experiment: a copy of the first data set whose
training images are PARTS parts photographed SHOTS times each (a shift of a few pixels, a small
exposure change, sensor noise), written under ``--out``; its test images are the original
ones (new parts). It is fitted with near-duplicate groups (the default) and without
(``threshold.near_duplicates=null``: plain leave-one-out for PaDiM), objective ``far``.

``--draws N`` adds how much the ``f1`` and ``recall`` points depend on *which* ``--defects``
defects were labelled: per data set and method one fit (the model never sees the defects, they
only place the threshold), then ``Detector.threshold_.recalibrate`` with the scores of N draws
of defects: the evaluation's own seeded draw (its row above, reproduced) and N - 1 more; ``f1``
at the evaluated images' share of defects (as the evaluation takes it) and at the labelled
images' (the fit's default). Printed: the false alarms on test/good, the recall on the undrawn
defects and the F1 gap to the F1-max of the undrawn images, as medians with the 10th-90th
percentiles over the draws, and the share of draws at <= 10 % false alarms with >= 80 %
recall.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from sklearn.metrics import f1_score  # noqa: E402

from anomaly_hooks.detector import Detector  # noqa: E402
from anomaly_hooks.evaluation.datasets import open_dataset  # noqa: E402
from anomaly_hooks.evaluation.metrics import f1_max  # noqa: E402
from anomaly_hooks.evaluation.runner import draw_threshold_defects, evaluate  # noqa: E402

SHARED = REPO.parent / "shared" / "data"
DEFAULT_SETS = ("mvtec_bottle", "battery_weld", "visa_macaroni1")
SEED_SHOTS = 0
SEED_DRAWS = 1  # the draws after the evaluation's own


def recall_at_far(labels: np.ndarray, scores: np.ndarray, far: float) -> float:
    """The best recall over thresholds flagging at most ``far`` of the good images."""
    good = np.sort(scores[labels == 0])[::-1]
    k = int(math.floor(far * good.size))  # good images allowed above the threshold
    t = good[k] if k < good.size else -np.inf
    return float((scores[labels == 1] > t).mean())


def run(root: Path, method: str, objective: str, args: argparse.Namespace,
        extra: tuple = ()) -> dict:
    """One evaluation; the figures of the module docstring."""
    config = REPO / "configs" / f"{method}_effnet_lite0.yaml"
    overrides = [f"device={args.device}", f"threshold.objective={objective}", *extra]
    if objective == "recall":
        overrides.append(f"threshold.target_recall={args.target_recall}")
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = evaluate(str(config), open_dataset(root), overrides, report_dir=None,
                       progress=False,
                       threshold_defects=0 if objective == "far" else args.defects)
    s = res.summary
    images = [r for r in res.images if not r["used_for_threshold"]]
    labels = np.array([r["label"] for r in images])
    scores = np.array([r["score"] for r in images])
    oos = (s.get("threshold_provenance") or {}).get("good", {}).get("out_of_sample", {})
    return {
        "dataset": s["dataset"], "method": method, "objective": objective,
        "variant": " ".join(extra), "auroc": s["image_auroc"], "threshold": s["threshold"],
        "false_alarms": s["threshold_false_alarms"], "n_good": s["threshold_n_good"],
        "copies_of_training_images": s["test_copies_of_training"],
        "unseen_false_alarms": s["threshold_false_alarms_unseen"],
        "unseen_n_good": s["threshold_n_good_unseen"],
        "far": s["threshold_far"], "far_interval": s["threshold_far_interval"],
        "pvalue": s["threshold_far_pvalue"], "expected_far": s["threshold_expected_far"],
        "recall": s["threshold_recall"], "expected_recall": s["threshold_expected_recall"],
        "recall_interval": s["threshold_recall_interval"], "f1": s["threshold_f1"],
        "f1_max": s["image_f1_max"], "recall_at_5": recall_at_far(labels, scores, 0.05),
        "n_train": s["n_train"], "scheme": oos.get("scheme"),
        "grouped_images": oos.get("grouped_images"), "seconds": time.perf_counter() - start,
        "warnings": [str(w.message) for w in caught],
    }


def pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def row(r: dict) -> str:
    lo, hi = r["far_interval"] or (None, None)
    gap = None if r["f1"] is None else r["f1_max"] - r["f1"]
    objective = f"{r['objective']} {r['variant']}".strip()
    return (f"| {r['dataset']} | {r['method']} | {objective} | "
            f"{pct(r['auroc'])} | {r['false_alarms']} / {r['n_good']} ({pct(r['far'])}) | "
            f"{r['unseen_false_alarms']} / {r['unseen_n_good']} "
            f"({pct(r['unseen_false_alarms'] / max(r['unseen_n_good'], 1))}) | "
            f"{pct(lo)}–{pct(hi)} | {r['pvalue']:.3f} | {pct(r['recall'])} | "
            f"{pct(r['f1'])} / {pct(r['f1_max'])} ({'–' if gap is None else f'{gap:.3f}'}) | "
            f"{pct(r['recall_at_5'])} | {r['seconds']:.0f} |")


HEAD = ("| set | method | objective | image AUROC | false alarms test/good | the same without "
        "copies of training images | recorded 90 % interval | p (binomial vs upper) | recall | "
        "F1 / F1-max (gap) | recall at 5 % FA (best threshold) | s |\n|" + "---|" * 12)


def reshoot(src: Path, dst: Path, parts: int, shots: int) -> Path:
    """A copy of ``src`` whose ``train/good`` holds ``parts`` parts shot ``shots`` times each
    (see the module docstring); ``test`` and ``ground_truth`` link to the original's."""
    from PIL import Image

    rng = np.random.default_rng(SEED_SHOTS)
    (dst / "train" / "good").mkdir(parents=True, exist_ok=True)
    for f in sorted((src / "train" / "good").iterdir())[:parts]:
        im = np.asarray(Image.open(f).convert("RGB")).astype(np.float32)
        for s in range(shots):
            dy, dx = rng.integers(-6, 7, 2)
            out = np.roll(im, (int(dy), int(dx)), axis=(0, 1)) * rng.uniform(0.97, 1.03)
            out = out + rng.normal(0, 2.0, im.shape)
            Image.fromarray(np.clip(out, 0, 255).astype(np.uint8)).save(
                dst / "train" / "good" / f"{f.stem}_shot{s}.png")
    for sub in ("test", "ground_truth"):
        if not (dst / sub).exists():
            (dst / sub).symlink_to((src / sub).resolve())
    return dst


def draws(root: Path, method: str, args: argparse.Namespace) -> list:
    """``--draws`` operating points per objective ``f1`` / ``recall`` from one fit (see the
    module docstring): one dict per objective with the per-draw figures."""
    dataset = open_dataset(root)
    det = Detector.from_config(str(REPO / "configs" / f"{method}_effnet_lite0.yaml"),
                               overrides=[f"device={args.device}"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the few-images rate warnings of the fit
        det.fit(dataset.train, progress=False)
    scores = np.asarray(det.decision_function([s.path for s in dataset.test]), dtype=np.float64)
    labels = dataset.labels
    bad = np.flatnonzero(labels == 1)
    rng = np.random.default_rng(SEED_DRAWS)
    picks = [np.asarray(draw_threshold_defects(det.cfg, dataset, args.defects))]
    picks += [np.sort(rng.choice(bad, args.defects, replace=False))
              for _ in range(args.draws - 1)]
    out = []
    for objective, share in draw_choices(args.objectives):
        runs = []
        for pick in picks:
            keep = np.ones(labels.size, dtype=bool)
            keep[pick] = False
            prevalence = float(labels[keep].mean()) if share == "evaluated" else None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # most-good-flagged: counted below instead
                thr = det.threshold_.recalibrate(objective=objective,
                                                 target_recall=args.target_recall,
                                                 prevalence=prevalence,
                                                 defect_scores=scores[pick].tolist())
            flagged, lab = scores[keep] > thr.value, labels[keep]
            runs.append({"far": float(flagged[lab == 0].mean()),
                         "recall": float(flagged[lab == 1].mean()),
                         "f1_gap": f1_max(lab, scores[keep])[0] - f1_score(lab, flagged)})
        name = objective if share is None else f"{objective}, {share} share"
        out.append({"dataset": dataset.name, "method": method, "objective": name,
                    "draws": runs})
    return out


def draw_choices(objectives: list) -> list:
    """(objective, share of defects) pairs of the draws: ``f1`` at the evaluated images' share
    (as the evaluation takes it) and at the labelled images' (the fit's default, ``m / (n +
    m)``); ``recall`` once."""
    out: list = []
    for o in objectives:
        if o == "f1":
            out += [("f1", "evaluated"), ("f1", "labelled")]
        elif o != "far":
            out.append((o, None))
    return out


def draws_row(r: dict) -> str:
    def spread(key: str, scale: float = 100.0, fmt: str = ".1f") -> str:
        v = np.array([d[key] for d in r["draws"]]) * scale
        lo, med, hi = np.percentile(v, [10, 50, 90])
        return f"{med:{fmt}} ({lo:{fmt}}–{hi:{fmt}})"

    first = r["draws"][0]
    meets = np.mean([d["far"] <= 0.1 and d["recall"] >= 0.8 for d in r["draws"]])
    return (f"| {r['dataset']} | {r['method']} | {r['objective']} | {len(r['draws'])} | "
            f"{100 * first['far']:.1f} / {100 * first['recall']:.1f} | {spread('far')} | "
            f"{spread('recall')} | {spread('f1_gap', 1.0, '.3f')} | "
            f"{100 * np.mean([d['f1_gap'] <= 0.05 for d in r['draws']]):.0f} | "
            f"{100 * meets:.0f} |")


DRAWS_HEAD = ("| set | method | objective | draws | the evaluation's draw: false alarms / recall "
              "(%) | false alarms test/good, % (10th–90th) | recall, % (10th–90th) | "
              "F1-max gap (10th–90th) | draws with gap <= 0.05, % | draws at <= 10 % false "
              "alarms with >= 80 % recall, % |\n|" + "---|" * 10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", action="append", help="MVTec-layout roots (default: the shared sets)")
    p.add_argument("--methods", nargs="+", default=["padim", "patchcore"])
    p.add_argument("--objectives", nargs="+", default=["far", "f1", "recall"])
    p.add_argument("--defects", type=int, default=10)
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--target-recall", type=float, default=0.9)
    p.add_argument("--shots", type=int, nargs=2, metavar=("PARTS", "SHOTS"))
    p.add_argument("--out", default="bench_threshold", help="results.json and the re-shot set")
    p.add_argument("--draws", type=int, default=0,
                   help="also the f1 / recall points over this many draws of defects (>= 2)")
    args = p.parse_args()
    if args.draws == 1 or args.draws < 0:
        p.error(f"--draws {args.draws}: give 0 (off) or at least 2")
    roots = [Path(d) for d in args.data] if args.data else [SHARED / d for d in DEFAULT_SETS]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    print(HEAD, flush=True)
    jobs = [(root, m, o, ()) for root in roots for m in args.methods for o in args.objectives]
    if args.shots:
        shot = reshoot(roots[0], out / f"{roots[0].name}_reshot", *args.shots)
        jobs += [(shot, m, "far", extra) for m in args.methods
                 for extra in ((), ("threshold.near_duplicates=null",))]
    for root, method, objective, extra in jobs:
        r = run(root, method, objective, args, extra)
        rows.append(r)
        print(row(r), flush=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1))
    if args.draws:
        points = []
        print("\n" + DRAWS_HEAD, flush=True)
        for root in roots:
            for method in args.methods:
                for r in draws(root, method, args):
                    points.append(r)
                    print(draws_row(r), flush=True)
                    (out / "draws.json").write_text(json.dumps(points, indent=1))


if __name__ == "__main__":
    main()
