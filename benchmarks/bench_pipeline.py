#!/usr/bin/env python
"""Benchmark: fit throughput and peak memory, predict latency and throughput, a per-stage
breakdown, and every figure as a ratio to a bare torchvision forward of the same backbone up to
the same layer on the same batches, measured in the same run.

    python benchmarks/bench_pipeline.py [--config configs/padim.yaml]
        [--config configs/patchcore.yaml] [--data data/sample] [--batch-size 32]
        [--device cpu|cuda|auto] [--repeats 20] [--passes 3] [--json bench.json] [key=value ...]

The stages are the detector's own (``Detector.prepare``, ``Detector.infer`` with a
``Stopwatch``, ``Detector.predictions``): what is timed is what ``predict`` runs.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anomaly_hooks.config import load_config
from anomaly_hooks.images import is_image_file, read_image
from anomaly_hooks.timing import PeakMemory, Stopwatch
from benchmarks.measure import (
    bare_backbone,
    bare_seconds,
    chunks,
    machine,
    timed_repeats,
    write_json,
)

STAGES = ("decode_preprocess", "backbone", "embedding", "scorer", "heatmap")
Bare = Callable[[Any], Any]


def predict_items(data: Path) -> List[Path]:
    """The images under ``data/test`` (or ``data`` itself, without a ``test`` folder)."""
    test = data / "test"
    root = test if test.is_dir() else data
    items = sorted(p for p in root.rglob("*") if p.is_file() and is_image_file(p))
    if not items:
        raise ValueError(f"{data}: no test images to benchmark predict on")
    return items


# -- predict ----------------------------------------------------------------------------------
def one_pass(det: Any, items: Sequence[Path], batch_size: int, bare: Bare) -> Dict[str, float]:
    """Seconds per stage, and of the bare backbone on the same device batches, over one pass of
    ``items``. ``decode_preprocess`` is ``prepare`` and the copy to the device (so that the
    backbone and the bare backbone both start from images on the device); ``backbone``,
    ``embedding``, ``scorer`` and ``heatmap`` are the laps of ``infer``, the heatmap lap also
    charged with the full-size heatmaps, masks and verdicts of ``predictions``."""
    watch = Stopwatch(det.device)
    for chunk in chunks(items, batch_size):
        with watch.step("decode_preprocess"):
            images, sizes = det.prepare(chunk)
            images = images.to(det.device, non_blocking=True)
        scores, maps = det.infer(images, timings=watch)
        with watch.step("heatmap"):
            list(det.predictions(scores, maps, sizes))
        with watch.step("bare_backbone"):
            bare(images)
    return watch.as_dict()


def stage_breakdown(det: Any, items: Sequence[Path], batch_size: int,
                    bare: Bare, passes: int = 3) -> Dict[str, Any]:
    """Time each predict stage over ``items`` in batches, with the bare backbone on every batch
    right after the predict path; ``passes`` passes over the items (after one untimed warm-up
    batch, as a service would have run before). Figures are medians over the passes: on a
    shared machine one pass can be slowed by a neighbour."""
    warm, _ = det.prepare(items[:batch_size])
    det.predict(list(items[:batch_size]), batch_size=batch_size)
    bare(warm.to(det.device))
    runs = [one_pass(det, items, batch_size, bare) for _ in range(max(1, passes))]
    n = len(items)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    paths = [sum(r[k] for k in STAGES if k != "decode_preprocess") for r in runs]
    ratios = [p / r["bare_backbone"] for p, r in zip(paths, runs)]
    return {"n_images": n, "passes": len(runs),
            "ms_per_image": {k: 1000.0 * v / n for k, v in med.items()},
            "predict_path_ms_per_image": 1000.0 * statistics.median(paths) / n,
            "predict_path_ratio": statistics.median(ratios),
            "predict_path_ratio_per_pass": ratios,
            "stage_ratio": {k: med[k] / med["bare_backbone"] for k in STAGES}}


def latency_batch1(det: Any, items: Sequence[Path], repeats: int) -> Dict[str, float]:
    """Median and p90 milliseconds of ``predict`` on one decoded image (each call the next of
    ``repeats`` images, round robin)."""
    images = [read_image(p) for p in items[:max(1, min(len(items), repeats))]]
    cycle = itertools.cycle(images)
    timed = timed_repeats(lambda: det.predict(next(cycle)), len(images))
    return {"median_ms": 1000.0 * timed.median, "p90_ms": 1000.0 * timed.p90}


def bench_predict(det: Any, test: Sequence[Path], batch_size: int, bare: Bare,
                  repeats: int, passes: int) -> Dict[str, Any]:
    """The stage breakdown, the batched throughput with its peak memory, batch-1 latency."""
    stages = stage_breakdown(det, test, batch_size, bare, passes)
    with PeakMemory(det.device) as mem:
        watch = Stopwatch(det.device)
        det.predict(list(test), batch_size=batch_size)
        predict_s = watch.lap("predict")
    return {**stages, "throughput_images_per_s": len(test) / predict_s,
            "peak_rss_mb": mem.peak_mb, "peak_gpu_mb": mem.gpu_peak_mb,
            "batch1": latency_batch1(det, test, repeats)}


# -- fit --------------------------------------------------------------------------------------
def bench_fit(cfg: Any, data: Path, bare: Bare, batch_size: int) -> tuple[Any, Dict[str, Any]]:
    """Fit (timed, with peak memory), and the bare backbone over the images the fit trains on
    (``FitPlan.train``: without the threshold images a hold-out keeps out)."""
    from anomaly_hooks.data import list_images, train_folder
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.fitting import FitPlan

    train = list_images(train_folder(data))
    det = Detector(cfg)
    with PeakMemory(det.device) as mem:
        watch = Stopwatch(det.device)
        det.fit(train, progress=False)
        fit_s = watch.lap("fit")
    fitted = FitPlan.of(cfg, train).train
    bare_s = bare_seconds(bare, (det.prepare(c)[0] for c in chunks(fitted, batch_size)),
                          det.device)
    out = {"n_images": len(train), "seconds": fit_s, "images_per_s": len(train) / fit_s,
           "peak_rss_mb": mem.peak_mb, "peak_gpu_mb": mem.gpu_peak_mb,
           "timings": det.fit_timings_, "bare_backbone_seconds": bare_s,
           "ratio_to_bare_backbone": fit_s / bare_s}
    coreset = det.fit_timings_.get("finalize: coreset")  # the selection, if the method has one
    if coreset is not None:
        out["coreset_seconds"] = coreset
        out["coreset_ratio_to_bare_backbone"] = coreset / bare_s
    out.update(det.scorer_.summary())
    return det, out


def run(config: str, data: Path, batch_size: int, device: Optional[str],
        overrides: Sequence[str], repeats: int = 20, passes: int = 3) -> Dict[str, Any]:
    """Benchmark one config on one dataset."""
    from anomaly_hooks.detector import resolve_layer_names
    from anomaly_hooks.devices import resolve_device

    extra = [f"data.batch_size={batch_size}"] + ([f"device={device}"] if device else [])
    cfg = load_config(config, list(overrides) + extra)
    test = predict_items(data)
    bare = bare_backbone(cfg, resolve_layer_names(cfg), resolve_device(cfg.device))
    det, fit = bench_fit(cfg, data, bare, batch_size)
    return {"config": config, "method": cfg.method, "backbone": cfg.backbone.name,
            "device": str(det.device), "batch_size": batch_size, "data": str(data),
            "fit": fit, "predict": bench_predict(det, test, batch_size, bare, repeats, passes)}


# -- report -----------------------------------------------------------------------------------
def _cell(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_report(results: List[Dict[str, Any]]) -> str:
    """A table of the headline figures and ratios."""
    lines = [f"{'method':<10} {'fit img/s':>9} {'fit/bare':>8} {'fit MB':>7} {'coreset s':>9} "
             f"{'cs/bare':>7} {'pred ms/img':>11} {'pred/bare':>9} {'b1 ms':>7} "
             f"{'b32 img/s':>9}  stage ms/img (decode, backbone, embed, scorer, heatmap)"]
    for r in results:
        f, p = r["fit"], r["predict"]
        stages = ", ".join(f"{p['ms_per_image'][k]:.1f}" for k in STAGES)
        lines.append(
            f"{r['method']:<10} {f['images_per_s']:9.2f} {f['ratio_to_bare_backbone']:8.2f} "
            f"{f['peak_rss_mb']:7.0f} {_cell(f.get('coreset_seconds'), '.2f'):>9} "
            f"{_cell(f.get('coreset_ratio_to_bare_backbone'), '.2f'):>7} "
            f"{p['predict_path_ms_per_image']:11.1f} {p['predict_path_ratio']:9.2f} "
            f"{p['batch1']['median_ms']:7.1f} {p['throughput_images_per_s']:9.2f}  {stages}")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=[],
                        help="repeatable (default: configs/padim.yaml and configs/patchcore.yaml)")
    parser.add_argument("--data", default="data/sample", help="train/good and test/ images")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default: "
                        "the config's)")
    parser.add_argument("--repeats", type=int, default=20, help="batch-1 predictions timed")
    parser.add_argument("--passes", type=int, default=3,
                        help="passes over the test images for the stage breakdown (median)")
    parser.add_argument("--json", default="bench.json")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from anomaly_hooks.devices import resolve_device

    args = parse_args(argv)
    configs = args.config or ["configs/padim.yaml", "configs/patchcore.yaml"]
    results = [run(c, Path(args.data), args.batch_size, args.device, args.overrides,
                   args.repeats, args.passes) for c in configs]
    device = resolve_device(args.device or load_config(configs[0], args.overrides).device)
    report = {"machine": machine(device), "results": results}
    write_json(args.json, report)
    print(f"machine: {report['machine']}")
    print(format_report(results))
    print(f"ratios are to a bare torchvision forward (create_feature_extractor) of the same "
          f"backbone up to the same layer on the same batches, in this run. JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
