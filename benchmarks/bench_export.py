#!/usr/bin/env python
"""Eager PyTorch vs the exported model: speed, memory and the accuracy of int8.

    python benchmarks/bench_export.py [--config configs/patchcore_effnet_lite0.yaml]
        [--data data/sample] [--out DIR] [--threads N] [--repeats 5] [--rounds 2]
        [--max-train N] [--calib 32] [--calibration minmax|entropy|percentile] [key=value ...]

1. Fits the config on the dataset's training images (CPU), saves it, exports float32 ONNX and
   an int8 copy (backbone quantised, calibrated on two thirds of the training images; written
   even beyond the drift tolerance, so that the drift is *reported*).
2. Accuracy on the test images, per engine: image AUROC, pixel AUROC and AUPRO (where the
   dataset has masks), the correlation of the image scores with eager's and the largest
   relative score difference.
3. Speed, each engine in its own process (so that its peak RSS is its own: the eager one
   imports torch, the ONNX ones do not), on the same preprocessed batches: latency at batch 1
   (median of repeats) and throughput at batch 32, wall and CPU seconds, as ratios to eager;
   the engines take turns for ``--rounds`` rounds and each keeps its best (a shared machine's
   load drifts). OpenVINO is timed where it is installed.

Results in ``<out>/bench_export.json`` (``--out``, default a new temporary folder), a table on
stdout.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

# torch-free: each engine's worker process imports only what its engine needs
from anomaly_hooks.timing import peak_rss_mb
from benchmarks.measure import child_result, machine, report_result, timed_repeats, write_json

ENGINES = ("eager", "onnxruntime", "int8", "openvino")


# -- worker: one engine, timed in its own process ------------------------------------------
def _runner(engine: str, model: Path, threads: int) -> Callable[[np.ndarray], Any]:
    """A function running the network part on a normalised batch ``[B, 3, H, W]``."""
    if engine == "eager":
        import torch

        from anomaly_hooks.detector import Detector

        torch.set_num_threads(threads)
        det = Detector.load(model, device="cpu")
        return lambda x: det.infer(torch.from_numpy(x))
    from anomaly_hooks.runtime import OnnxDetector

    odet = OnnxDetector.load(model, threads=threads, batch_size=10**6,
                             engine="openvino" if engine == "openvino" else "onnxruntime")
    return odet.run


def worker(engine: str, model: Path, batches: Path, threads: int, repeats: int) -> Dict[str, Any]:
    """Latency at batch 1 (four single images a call), throughput at batch 32, the peak RSS of
    this process after each."""
    data = np.load(batches)
    run = _runner(engine, model, threads)
    one = timed_repeats(lambda: [run(data[i:i + 1]) for i in range(4)], repeats)
    rss_b1 = peak_rss_mb()
    big = timed_repeats(lambda: run(data[:32]), max(2, repeats // 2))
    return {"engine": engine, "latency_b1_ms": 1000 * one.median / 4,
            "latency_b1_cpu_ms": 1000 * one.cpu / 4,
            "throughput_b32": 32 / big.median, "b32_wall_s": big.median, "b32_cpu_s": big.cpu,
            "peak_rss_b1_mb": rss_b1, "peak_rss_mb": peak_rss_mb()}


# -- driver ----------------------------------------------------------------------------------
def _engines(paths: Dict[str, Path]) -> List[str]:
    """The engines to measure: those with a model file, OpenVINO only where installed."""
    openvino = importlib.util.find_spec("openvino") is not None
    return [e for e in ENGINES if e in paths and (openvino or e != "openvino")]


def build_models(args: argparse.Namespace, out: Path) -> tuple[Any, Dict[str, Path], Dict]:
    """Fit, save, export float32 and int8; returns the detector, the files and the int8
    report."""
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.evaluation.datasets import open_dataset
    from anomaly_hooks.export.onnx import export_onnx, source_checksum
    from anomaly_hooks.export.quantize import quantize_backbone

    data = open_dataset(args.data)
    train = data.train[:args.max_train] if args.max_train else data.train
    det = Detector.from_config(args.config, overrides=["device=cpu", "data.num_workers=0",
                                                       *args.overrides])
    det.fit(train, progress=False)
    saved = det.save(out / "model.safetensors")
    fp32 = export_onnx(det, out / "model.onnx", checksum=source_checksum(saved))
    calib = [p for i, p in enumerate(train) if i % 3 != 2][:args.calib]
    report = quantize_backbone(fp32, out / "model.int8.onnx", calib, check_images=train[2::3],
                               calibration=args.calibration, refuse=False)
    paths = {"eager": saved, "onnxruntime": fp32, "int8": out / "model.int8.onnx",
             "openvino": fp32}
    return det, paths, report


def accuracy(det: Any, paths: Dict[str, Path], data_root: str) -> Dict[str, Dict[str, float]]:
    """Image AUROC (and pixel AUROC / AUPRO with masks) of each engine on the test images."""
    from anomaly_hooks.evaluation.datasets import open_dataset
    from anomaly_hooks.evaluation.metrics import image_auroc, pixel_metrics
    from anomaly_hooks.runtime import OnnxDetector

    data = open_dataset(data_root)
    items = [s.path for s in data.test]
    out: Dict[str, Dict[str, float]] = {}
    ref: Optional[np.ndarray] = None
    for engine in _engines(paths):
        model = det if engine == "eager" else OnnxDetector.load(
            paths[engine], engine="openvino" if engine == "openvino" else "onnxruntime")
        preds = model.predict(items)
        scores = np.array([p.score for p in preds])
        ref = scores if ref is None else ref
        row = {"image_auroc": image_auroc(data.labels, scores),
               "score_corr": float(np.corrcoef(scores, ref)[0, 1]),
               "max_rel_diff": float(np.max(np.abs(scores - ref) / np.abs(ref)))}
        if data.has_masks:
            masks = [data.load_mask(s, p.heatmap.shape[::-1]) for s, p in zip(data.test, preds)]
            pix = pixel_metrics(masks, [p.heatmap for p in preds])
            row.update(pixel_auroc=pix["pixel_auroc"], aupro=pix["aupro"])
        out[engine] = row
    return out


def batches(det: Any, data_root: str, path: Path) -> None:
    """32 test images (repeated if fewer), decoded and preprocessed by ``Detector.prepare``,
    saved as one ``.npy``: every engine runs on these same network inputs."""
    from anomaly_hooks.evaluation.datasets import open_dataset

    items = [s.path for s in open_dataset(data_root).test]
    items = (items * (32 // len(items) + 1))[:32]
    np.save(path, det.prepare(items)[0].numpy())


def speed(paths: Dict[str, Path], npy: Path, threads: int, repeats: int,
          rounds: int) -> List[Dict]:
    """Each engine's worker in a fresh process, the engines interleaved for ``rounds`` rounds
    (on a shared machine the load drifts: each engine keeps its best round)."""
    best: Dict[str, Dict] = {}
    for _ in range(rounds):
        for engine in _engines(paths):
            row = child_result([__file__, "--worker", engine, "--model", paths[engine],
                                "--batches", npy, "--threads", threads, "--repeats", repeats])
            if "error" in row:
                raise SystemExit(f"the {engine} worker failed: {row['error']}")
            best[engine] = _best(best.get(engine, row), row)
    return [best[e] for e in _engines(paths)]


def _best(a: Dict, b: Dict) -> Dict:
    """The faster batch-1 figures and the faster batch-32 figures of two rounds."""
    lat = min(a, b, key=lambda r: r["latency_b1_ms"])
    thr = max(a, b, key=lambda r: r["throughput_b32"])
    return {**thr, "latency_b1_ms": lat["latency_b1_ms"],
            "latency_b1_cpu_ms": lat["latency_b1_cpu_ms"],
            "peak_rss_b1_mb": max(a["peak_rss_b1_mb"], b["peak_rss_b1_mb"]),
            "peak_rss_mb": max(a["peak_rss_mb"], b["peak_rss_mb"])}


def format_table(rows: List[Dict], acc: Dict[str, Dict[str, float]]) -> str:
    """A markdown table, ratios to eager."""
    base = rows[0]
    lines = ["| engine | b1 latency ms (CPU ms) | x eager | b32 img/s (wall s / CPU s) | x eager "
             "| peak RSS MB b1 / b32 | image AUROC | pixel AUROC | AUPRO | score corr. |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in rows:
        a = acc.get(r["engine"], {})
        cells = [r["engine"], f"{r['latency_b1_ms']:.1f} ({r['latency_b1_cpu_ms']:.0f})",
                 f"{base['latency_b1_ms'] / r['latency_b1_ms']:.2f}",
                 f"{r['throughput_b32']:.1f} ({r['b32_wall_s']:.2f} / {r['b32_cpu_s']:.2f})",
                 f"{r['throughput_b32'] / base['throughput_b32']:.2f}",
                 f"{r['peak_rss_b1_mb']:.0f} / {r['peak_rss_mb']:.0f}"]
        cells += [f"{a.get(key, nan):.4f}" for key in ("image_auroc", "pixel_auroc", "aupro")]
        cells.append(f"{a.get('score_corr', nan):.5f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/patchcore_effnet_lite0.yaml")
    p.add_argument("--data", default="data/sample", help="MVTec-layout dataset root")
    p.add_argument("--out", default=None, help="folder for the models and bench_export.json")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per engine")
    p.add_argument("--max-train", type=int, default=None, help="use the first N training images")
    p.add_argument("--calib", type=int, default=32, help="int8 calibration images")
    p.add_argument("--calibration", default="minmax", choices=["minmax", "entropy", "percentile"])
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--batches", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        report_result(worker(args.worker, Path(args.model), Path(args.batches), args.threads,
                             args.repeats))
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_export_"))
    out.mkdir(parents=True, exist_ok=True)
    det, paths, int8 = build_models(args, out)
    acc = accuracy(det, paths, args.data)
    batches(det, args.data, out / "batches.npy")
    del det
    rows = speed(paths, out / "batches.npy", args.threads, args.repeats, args.rounds)
    result = {"config": args.config, "data": args.data, "overrides": args.overrides,
              "machine": machine(threads=args.threads), "int8": int8, "accuracy": acc,
              "speed": rows}
    write_json(out / "bench_export.json", result)
    print(json.dumps({k: result[k] for k in ("machine", "int8")}))
    print(format_table(rows, acc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
