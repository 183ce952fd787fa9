"""Benchmark: fit throughput and peak memory, predict latency and throughput, a per-stage
breakdown, and every figure as a ratio to a bare torchvision forward of the same backbone up to
the same layer on the same batches, measured in the same run.

    python scripts/bench.py [--config configs/padim.yaml --config configs/patchcore.yaml]
                            [--data data/sample] [--batch-size 32] [--device cpu|cuda|auto]
                            [--json bench.json] [key=value ...]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from anomaly_hooks.config import load_config
from anomaly_hooks.data import list_images, train_folder
from anomaly_hooks.devices import ieee_float32, resolve_device, synchronize
from anomaly_hooks.heatmap import anomaly_maps
from anomaly_hooks.images import is_image_file, read_image

STAGES = ("decode_preprocess", "backbone", "embedding", "scorer", "heatmap")


class PeakMemory:
    """Peak resident memory (and peak CUDA memory) of this process during a ``with`` block,
    in MB above the level at entry (the RSS sampled every few milliseconds; on CUDA the
    allocator's exact peak of allocated memory, minus what was allocated at entry)."""

    def __init__(self, device: torch.device, interval: float = 0.005) -> None:
        import psutil

        self.proc = psutil.Process()
        self.device = device
        self.interval = interval
        self.peak_mb = 0.0
        self.gpu_peak_mb: Optional[float] = None

    def __enter__(self) -> "PeakMemory":
        self._base = self.proc.memory_info().rss
        self._peak = self._base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._gpu_base = torch.cuda.memory_allocated(self.device)
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self.proc.memory_info().rss)
            self._stop.wait(self.interval)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self.proc.memory_info().rss)
        self.peak_mb = (self._peak - self._base) / 2**20
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self._gpu_base
            self.gpu_peak_mb = peak / 2**20


@contextmanager
def timed(acc: Dict[str, float], key: str, device: torch.device) -> Iterator[None]:
    """Add the wall time of the block (device-synchronised) to ``acc[key]``."""
    synchronize(device)
    start = time.perf_counter()
    yield
    synchronize(device)
    acc[key] = acc.get(key, 0.0) + time.perf_counter() - start


def bare_backbone(cfg: Any, layers: Sequence[str], device: torch.device) -> Callable:
    """torchvision's own ``create_feature_extractor`` up to the deepest tapped layer, on a
    separately built copy of the backbone (no hooks), run as the extractor runs its own:
    the same ``backbone.precision`` (autocast, or IEEE float32: no TF32) and
    ``backbone.channels_last``. Give it images already on ``device``: the copy from the
    host is not the backbone's time."""
    from torchvision.models.feature_extraction import create_feature_extractor

    from anomaly_hooks.backbones import build_backbone
    from anomaly_hooks.extractor import PRECISIONS

    model = build_backbone(cfg.backbone.name, cfg.backbone.weights, cfg.seed).to(device).eval()
    names = dict(model.named_modules())
    order = [n for n in names if n in layers]
    fx = create_feature_extractor(model, return_nodes=[order[-1]])
    channels_last = bool(cfg.backbone.channels_last)
    if channels_last:
        fx = fx.to(memory_format=torch.channels_last)
    dtype = PRECISIONS[str(cfg.backbone.precision)]

    def run(images: torch.Tensor) -> Any:
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None
                    else contextlib.nullcontext())
        with torch.inference_mode(), ieee_float32(), autocast:
            return fx(images)
    return run


def _test_items(data: Path) -> List[Path]:
    test = data / "test"
    root = test if test.is_dir() else data
    items = sorted(p for p in root.rglob("*") if p.is_file() and is_image_file(p))
    if not items:
        raise ValueError(f"{data}: no test images to benchmark predict on")
    return items


def _batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def stage_breakdown(det: Any, items: Sequence[Path], batch_size: int,
                    bare: Callable, passes: int = 3) -> Dict[str, Any]:
    """Time each predict stage over ``items`` in batches, with the bare backbone on every batch
    right after the predict path; ``passes`` passes over the items (after one untimed warm-up
    batch, as a service would have run before). Figures are medians over the passes: on a
    shared machine one pass can be slowed by a neighbour."""
    dev = det.device
    warm = [read_image(p) for p in items[:batch_size]]
    det.predict(warm, batch_size=batch_size)
    bare(torch.stack([det.preprocessor(img) for img in warm]).to(dev))  # warm-up, untimed
    runs = [_one_pass(det, items, batch_size, bare) for _ in range(max(1, passes))]
    n = len(items)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    paths = [sum(r[k] for k in STAGES if k != "decode_preprocess") for r in runs]
    ratios = [p / r["bare_backbone"] for p, r in zip(paths, runs)]
    path = statistics.median(paths)
    return {"n_images": n, "passes": len(runs),
            "ms_per_image": {k: 1000.0 * v / n for k, v in med.items()},
            "predict_path_ms_per_image": 1000.0 * path / n,
            "predict_path_ratio": statistics.median(ratios),
            "predict_path_ratio_per_pass": ratios,
            "stage_ratio": {k: med[k] / med["bare_backbone"] for k in STAGES}}


def _one_pass(det: Any, items: Sequence[Path], batch_size: int,
              bare: Callable) -> Dict[str, float]:
    """Seconds per stage (and of the bare backbone) over one pass of ``items``."""
    dev = det.device
    acc: Dict[str, float] = {}
    for chunk in _batches(items, batch_size):
        with timed(acc, "decode_preprocess", dev):
            canon = [read_image(p) for p in chunk]
            images = torch.stack([det.preprocessor(img) for img in canon]).to(dev)
        with torch.inference_mode(), ieee_float32():  # as Detector.predict computes
            with timed(acc, "backbone", dev):
                feats = det.extractor(images)
            with timed(acc, "embedding", dev):
                emb = det.scorer_.embedder(feats)
            with timed(acc, "scorer", dev):
                patch = det.scorer_.score(emb)
            with timed(acc, "heatmap", dev):
                maps = anomaly_maps(patch, det.preprocessor.input_size)
                det.scorer_.image_scores(emb, patch, maps).cpu()
                list(det.heatmaps(maps, [(img.shape[1], img.shape[2]) for img in canon]))
        with timed(acc, "bare_backbone", dev):
            bare(images)  # already on the device, like the extractor's input above
    return acc


def latency_batch1(det: Any, items: Sequence[Path], repeats: int) -> Dict[str, float]:
    """Median and p90 milliseconds of ``predict`` on one decoded image."""
    images = [read_image(p) for p in items[:max(1, min(len(items), repeats))]]
    det.predict(images[0])  # warm-up
    times = []
    for img in images:
        start = time.perf_counter()
        det.predict(img)
        times.append(1000.0 * (time.perf_counter() - start))
    times.sort()
    return {"median_ms": statistics.median(times),
            "p90_ms": times[min(len(times) - 1, int(0.9 * len(times)))]}


def bench_fit(cfg: Any, train: List[Path], bare: Callable, batch_size: int) -> tuple[Any, Dict]:
    """Fit (timed, with peak memory) and the bare backbone over the same training images."""
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.preprocess import Preprocessor

    det = Detector(cfg)
    with PeakMemory(det.device) as mem:
        start = time.perf_counter()
        det.fit(train, progress=False)
        fit_s = time.perf_counter() - start
    pre = Preprocessor.from_config(cfg.preprocess)
    used = train  # the bare backbone sees every training image once, like the fit
    bare_s = 0.0
    for chunk in _batches(used, batch_size):
        images = torch.stack([pre(read_image(p)) for p in chunk]).to(det.device)
        synchronize(det.device)
        start = time.perf_counter()
        bare(images)
        synchronize(det.device)
        bare_s += time.perf_counter() - start
    out = {"n_images": len(train), "seconds": fit_s, "images_per_s": len(train) / fit_s,
           "peak_rss_mb": mem.peak_mb, "peak_gpu_mb": mem.gpu_peak_mb,
           "timings": det.fit_timings_, "bare_backbone_seconds": bare_s,
           "ratio_to_bare_backbone": fit_s / bare_s}
    # the selection alone, if the method has one
    coreset = det.fit_timings_.get("finalize: coreset")
    if coreset is not None:
        out["coreset_seconds"] = coreset
        out["coreset_ratio_to_bare_backbone"] = coreset / bare_s
    out.update(det.scorer_.summary())
    return det, out


def run(config: str, data: Path, batch_size: int, device: Optional[str],
        overrides: Sequence[str], repeats: int = 20, passes: int = 3) -> Dict[str, Any]:
    """Benchmark one config on one dataset."""
    extra = [f"data.batch_size={batch_size}"] + ([f"device={device}"] if device else [])
    cfg = load_config(config, list(overrides) + extra)
    train = list_images(train_folder(data))
    test = _test_items(data)
    from anomaly_hooks.detector import resolve_layer_names

    bare = bare_backbone(cfg, resolve_layer_names(cfg), resolve_device(cfg.device))
    det, fit = bench_fit(cfg, train, bare, batch_size)
    stages = stage_breakdown(det, test, batch_size, bare, passes)
    with PeakMemory(det.device) as mem:
        start = time.perf_counter()
        det.predict([read_image(p) for p in test], batch_size=batch_size)
        predict_s = time.perf_counter() - start
    return {"config": config, "method": cfg.method, "backbone": cfg.backbone.name,
            "device": str(det.device), "batch_size": batch_size, "data": str(data),
            "fit": fit, "predict": {**stages,
                                    "throughput_images_per_s": len(test) / predict_s,
                                    "peak_rss_mb": mem.peak_mb, "peak_gpu_mb": mem.gpu_peak_mb,
                                    "batch1": latency_batch1(det, test, repeats)}}


def machine(device: Optional[torch.device] = None) -> Dict[str, Any]:
    """Where the figures were measured: the platform, and the GPU the run used (its own
    name, not GPU 0's) when ``device`` is a CUDA device."""
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if device is not None and device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["device"] = str(device)
    return info


def format_report(results: List[Dict[str, Any]]) -> str:
    """A table of the headline figures and ratios."""
    lines = [f"{'method':<10} {'fit img/s':>9} {'fit/bare':>8} {'fit MB':>7} {'coreset s':>9} "
             f"{'cs/bare':>7} {'pred ms/img':>11} {'pred/bare':>9} {'b1 ms':>7} "
             f"{'b32 img/s':>9}  stage ms/img (decode, backbone, embed, scorer, heatmap)"]
    for r in results:
        f, p = r["fit"], r["predict"]
        stages = ", ".join(f"{p['ms_per_image'][k]:.1f}" for k in STAGES)
        cs = f.get("coreset_seconds")
        csr = f.get("coreset_ratio_to_bare_backbone")
        lines.append(
            f"{r['method']:<10} {f['images_per_s']:9.2f} {f['ratio_to_bare_backbone']:8.2f} "
            f"{f['peak_rss_mb']:7.0f} {'-' if cs is None else f'{cs:.2f}':>9} "
            f"{'-' if csr is None else f'{csr:.2f}':>7} {p['predict_path_ms_per_image']:11.1f} "
            f"{p['predict_path_ratio']:9.2f} {p['batch1']['median_ms']:7.1f} "
            f"{p['throughput_images_per_s']:9.2f}  {stages}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[])
    parser.add_argument("--data", default="data/sample")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default=None)
    parser.add_argument("--repeats", type=int, default=20, help="batch-1 predictions timed")
    parser.add_argument("--passes", type=int, default=3,
                        help="passes over the test images for the stage breakdown (median)")
    parser.add_argument("--json", default="bench.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    configs = args.config or ["configs/padim.yaml", "configs/patchcore.yaml"]
    results = [run(c, Path(args.data), args.batch_size, args.device, args.overrides,
                   args.repeats, args.passes) for c in configs]
    device = resolve_device(args.device or load_config(configs[0], args.overrides).device)
    report = {"machine": machine(device), "results": results}
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"machine: {report['machine']}")
    print(format_report(results))
    print(f"ratios are to a bare torchvision forward (create_feature_extractor) of the same "
          f"backbone up to the same layer on the same batches, in this run. JSON: {args.json}")
    return 0
