#!/usr/bin/env python
"""Usage: python scripts/threshold_table.py [EVAL_DIR]  (the runs of scripts/threshold_runs.sh)

Prints the issue-16 accuracy table (Markdown): per dataset and method, the hold-out with the
rule of before (0.99 quantile + 0.5 margin, recomputed from the run's stored good scores: the
hold-out fit is the same, the rule a function of those scores alone), the hold-out with the 1 %
tail model, and all images with the 1 % tail model (both as stored by the runs)."""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from anomaly_hooks.threshold import Threshold  # noqa: E402


def at_threshold(images, t):
    """(precision, recall, false alarms, good images) of the verdicts score > t."""
    lab = np.array([r["label"] for r in images])
    flag = np.array([r["score"] for r in images]) > t
    tp = int((flag & (lab == 1)).sum())
    return (tp / flag.sum() if flag.sum() else 0.0, tp / max(1, (lab == 1).sum()),
            int(flag[lab == 0].sum()), int((lab == 0).sum()))


def rows(out: Path):
    for bb in ("effnet", "wrn50"):
        for m in ("padim", "patchcore"):
            runs = {}
            for mode in ("hold", "all"):
                f = out / f"{m}_{bb}_{mode}" / "results.json"
                if f.exists():
                    runs[mode] = {d["dataset"]: d for d in json.loads(f.read_text())["datasets"]}
            for ds in sorted(set().union(*runs.values()) if runs else ()):
                for mode in ("hold", "all"):
                    d = runs.get(mode, {}).get(ds)
                    if d is None:
                        continue
                    base = dict(dataset=ds, method=m, backbone=d["backbone"],
                                fit=f"{d['n_train']} / {d['threshold_n_images']} "
                                    + ("hold-out" if mode == "hold" else "all (OOS)"),
                                **{k: d.get(k) for k in ("image_auroc", "pixel_auroc", "aupro",
                                                         "image_f1_max", "fit_seconds")})
                    if mode == "hold" and d.get("threshold_scores"):
                        t = Threshold.from_good_scores(d["threshold_scores"], 0.99, 0.5).value
                        yield {**base, "rule": "q0.99 + margin (before)", "thr": t, "ci": None,
                               "m": at_threshold(d["images"], t)}
                    yield {**base, "rule": f"{d['threshold_tail']} "
                                           f"{100 * d['threshold_target_far']:g} %",
                           "thr": d["threshold"], "ci": d["threshold_far_interval"],
                           "m": at_threshold(d["images"], d["threshold"])}


def pct(v):
    return "–" if v is None else f"{100 * v:.1f}"


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "eval_threshold")
    print("| dataset | method | backbone | model / threshold images | image AUROC | pixel AUROC "
          "| AUPRO | image F1-max | threshold rule | precision | recall | FAR test/good "
          "| expected FAR (90 % CI) | fit s |")
    print("|" + "---|" * 14)
    for r in rows(out):
        p, rec, fa, ng = r["m"]
        ci = f"{pct(r['ci'][0])}–{pct(r['ci'][1])}" if r["ci"] else "–"
        print(f"| {r['dataset']} | {r['method']} | {r['backbone']} | {r['fit']} | "
              f"{pct(r['image_auroc'])} | {pct(r['pixel_auroc'])} | {pct(r['aupro'])} | "
              f"{pct(r['image_f1_max'])} | {r['rule']} | {pct(p)} | {pct(rec)} | "
              f"{pct(fa / ng)} ({fa}/{ng}) | {ci} | {r['fit_seconds']:.0f} |")


if __name__ == "__main__":
    main()
