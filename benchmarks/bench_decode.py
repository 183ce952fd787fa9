#!/usr/bin/env python
"""``predict`` on a list of images with the batch decoded on one thread and on several
(``data.num_workers``), in turns in one process, the same model: seconds, images a second,
the ratio, and that the scores are the same to the bit.

    python benchmarks/bench_decode.py --data ../shared/data/visa_macaroni1 \\
        [--config configs/padim_effnet_lite0.yaml] [--fit 20] [--images 64] [--repeats 5]
        [--threads 1 2 4] [--json decode.json] [key=value ...]

The model is fitted on the first ``--fit`` images of ``train/good``; ``--images`` test images
(``test/*/*``, file order) are scored by ``Detector.decision_function`` (which decodes a batch
in ``Detector.prepare`` on the caller's side, then runs the model) and by ``Detector.prepare``
alone (the decoding share).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from omegaconf import read_write  # noqa: E402

from anomaly_hooks import Detector, load_config  # noqa: E402
from anomaly_hooks.images import is_image_file  # noqa: E402
from benchmarks.measure import chunks, machine, timed_repeats, write_json  # noqa: E402


def images_of(folder: Path, n: int) -> List[Path]:
    """The first ``n`` image files under ``folder`` (recursively, file order)."""
    found = sorted(p for p in folder.rglob("*") if p.is_file() and is_image_file(p))
    if not found:
        raise SystemExit(f"{folder}: no images")
    return found[:n]


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="an MVTec-layout data set")
    ap.add_argument("--config", default="configs/padim_effnet_lite0.yaml")
    ap.add_argument("--fit", type=int, default=20, help="training images to fit on")
    ap.add_argument("--images", type=int, default=64, help="test images to score")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="decode threads to compare (default: 1 and the config's data.num_workers)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, ["device=cpu", *args.overrides])
    det = Detector(cfg).fit(images_of(args.data / "train" / "good", args.fit), progress=False)
    items = images_of(args.data / "test", args.images)
    threads = args.threads or sorted({1, cfg.data.num_workers})
    size = cfg.data.batch_size

    def prepare_all() -> None:
        for chunk in chunks(items, size):
            det.prepare(chunk)

    walls: Dict[int, Dict[str, List[float]]] = {n: {"predict": [], "prepare": []} for n in threads}
    scores: Dict[int, np.ndarray] = {}
    for _ in range(args.repeats):  # in turns: the machine's drift touches every setting alike
        for n in threads:
            with read_write(det.cfg):
                det.cfg.data.num_workers = n
            walls[n]["predict"] += timed_repeats(
                lambda n=n: scores.__setitem__(n, det.decision_function(items)), 1,
                warmup=0).walls
            walls[n]["prepare"] += timed_repeats(prepare_all, 1, warmup=0).walls
    out: Dict[str, Any] = {"machine": machine(), "config": args.config, "images": len(items),
                           "batch_size": size, "rows": []}
    base = statistics.median(walls[threads[0]]["predict"])
    print(f"{len(items)} images, batches of {size}, medians of {args.repeats} in turns")
    print("| decode threads | predict (s) | images/s | vs first | decode+preprocess (s) |"
          " scores as the first |")
    print("|---|---|---|---|---|---|")
    for n in threads:
        pred = statistics.median(walls[n]["predict"])
        prep = statistics.median(walls[n]["prepare"])
        same = bool(np.array_equal(scores[n], scores[threads[0]]))
        out["rows"].append({"threads": n, "predict_s": pred, "prepare_s": prep,
                            "images_per_s": len(items) / pred, "speedup": base / pred,
                            "same_scores": same, "walls": walls[n]})
        print(f"| {n} | {pred:.2f} | {len(items) / pred:.1f} | {base / pred:.2f}x | {prep:.2f} |"
              f" {'yes' if same else 'NO'} |")
    if args.json:
        write_json(args.json, out)
    return 0 if all(r["same_scores"] for r in out["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
