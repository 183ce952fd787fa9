"""Benchmark of the scale-out job: score throughput with 1 and 2 Ray workers against plain
``score``, the driver's peak memory, and the cost of merging PaDiM partial states.

    python scripts/bench_distributed.py [--model M.safetensors] [--images 400]
        [--modes plain plain1 ray1 ray2] [--no-images] [--merge-positions 392] [--json out.json]
    python scripts/bench_distributed.py --coreset-data ../shared/data/mvtec_bottle
        [--coreset-shards 2 4] [--coreset-config configs/patchcore.yaml]
        [--oversample 2 4] [--coreset-seeds 3]   # sharded PatchCore: coverage radius, AUROC

Without ``--model`` a ResNet18 PaDiM (random init, 224 px, d=100) is fitted on data/sample
first. The inputs are the sample test images repeated under new names (symbolic links). Each
mode runs in its own subprocess (its own peak RSS, its own Ray session with ``--cpus`` CPUs).
Reported per mode: wall seconds, images/s, CPU seconds of the driver and every process it
started (Ray's workers included) and of the driver alone, the driver's start and peak RSS
(sampled every 50 ms).
The merge part times :func:`~anomaly_hooks.scorers.padim.partial.merge` of two dense WRN50-size
states (``D = 550``) over ``--merge-positions`` of the 3136 positions (figures scale linearly
in positions) and one state's round trip through Ray's object store.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CORESET_CONFIG = ROOT / "configs" / "patchcore.yaml"
SAMPLE = ROOT / "data" / "sample"


class PeakRSS:
    """The process's peak resident memory, sampled by a thread every ``interval`` seconds."""

    def __init__(self, interval: float = 0.05) -> None:
        import psutil

        self.proc = psutil.Process()
        self.peak = self.start = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.interval = interval

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and every live descendant."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def make_inputs(n: int, folder: Path) -> Path:
    """``n`` symbolic links to the sample test images under new names."""
    src = sorted((SAMPLE / "test").rglob("*.png"))
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        link = folder / f"img_{i:06d}.png"
        if not link.exists():
            os.symlink(src[i % len(src)], link)
    return folder


def fit_model(path: Path) -> str:
    from anomaly_hooks.detector import Detector

    det = Detector.from_config(None, backbone__name="resnet18", backbone__weights=None,
                               backbone__layers=None, padim__n_features=100, device="cpu",
                               data__num_workers=0)
    return str(det.fit(str(SAMPLE), progress=False).save(path))


def run_mode(mode: str, model: str, inputs: str, out: str, write_pngs: bool,
             cpus: int) -> Dict[str, Any]:
    """One mode in this process: ``plain`` (the CLI's score, torch's default threads),
    ``plain1`` (the same on one thread, as each Ray actor runs) or ``rayN`` (N workers)."""
    if mode.startswith("plain"):
        import torch

        from anomaly_hooks.cli import main as cli

        if mode == "plain1":
            torch.set_num_threads(1)

        cpu0 = tree_cpu_seconds()
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            cli(["score", "--model", model, inputs, "--out", out]
                + ([] if write_pngs else ["--no-images"]))
            secs = time.perf_counter() - t0
        return {"seconds": secs, "cpu_seconds": tree_cpu_seconds() - cpu0,
                "rss_start_mb": mem.start / 1e6, "rss_peak_mb": mem.peak / 1e6}
    import ray

    from anomaly_hooks.distributed.scoring import score

    ray.init(num_cpus=cpus, log_to_driver=False, include_dashboard=False)
    cpu0, driver0 = tree_cpu_seconds(), time.process_time()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        summary = score(model, [inputs], out, num_workers=int(mode[3:]), write_pngs=write_pngs)
        secs = time.perf_counter() - t0
    cpu, driver = tree_cpu_seconds() - cpu0, time.process_time() - driver0
    ray.shutdown()
    return {"seconds": secs, "cpu_seconds": cpu, "driver_cpu_seconds": driver,
            "rss_start_mb": mem.start / 1e6,
            "rss_peak_mb": mem.peak / 1e6, "scored": summary["scored"],
            "failed": summary["failed"], "duplicates_dropped": summary["duplicates_dropped"],
            "missing": len(summary["missing"])}


def merge_cost(positions: int, dim: int = 550, per_shard: int = 64) -> Dict[str, float]:
    """Seconds to merge two dense PaDiM states of ``positions`` positions, state size, and one
    state's put + get through the object store (when Ray is running)."""
    import numpy as np
    import torch

    from anomaly_hooks.scorers.padim import partial
    from anomaly_hooks.scorers.padim.gaussians import GaussianAccumulator

    gen = torch.Generator().manual_seed(0)
    states = []
    for s in range(2):
        acc = GaussianAccumulator()
        acc.update(torch.randn(positions, per_shard, dim, generator=gen) + s)
        states.append(partial.dense_state(acc, (positions, 1)))
    nbytes = sum(v.nbytes for v in states[0].values() if isinstance(v, np.ndarray))
    t0 = time.perf_counter()
    partial.merge(states)
    merge_s = time.perf_counter() - t0
    result = {"positions": positions, "dim": dim, "state_mb": nbytes / 1e6,
              "merge_seconds": merge_s, "merge_seconds_per_position": merge_s / positions}
    import ray

    ray.init(num_cpus=1, log_to_driver=False, include_dashboard=False)
    t0 = time.perf_counter()
    ray.get(ray.put(states[0]))
    result["object_store_roundtrip_seconds"] = time.perf_counter() - t0
    ray.shutdown()
    return result


def coreset_shards(data: Path, shard_counts: List[int], config: Path = DEFAULT_CORESET_CONFIG,
                   oversample: Sequence[float] = (2.0,), seeds: int = 1) -> Dict[str, Any]:
    """Sharded PatchCore (the shard rule of :mod:`anomaly_hooks.scorers.patchcore.partial`,
    each shard keeping ``oversample`` x its share) against the one-shot coreset on an MVTec
    category: coverage radius over every training patch and image AUROC on ``test/``. The
    embeddings are computed once; shards are the distributed fit's (no Ray needed). With
    ``seeds`` > 1 the one-shot coreset is also drawn with other seeds (its first point is
    random): the spread of its AUROC is the yardstick for the sharded fits' differences."""
    import torch

    from anomaly_hooks.config import load_config
    from anomaly_hooks.data import iter_batches
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.distributed.fitting import shard_bounds
    from anomaly_hooks.evaluation.metrics import image_auroc
    from anomaly_hooks.fitting import FitPlan
    from anomaly_hooks.heatmap import anomaly_maps
    from anomaly_hooks.scorers.patchcore import partial
    from anomaly_hooks.scorers.patchcore.coreset import coverage_radius
    from anomaly_hooks.scorers.patchcore.scorer import SEED_CORESET

    cfg = load_config(config, device="cpu", data={"train": str(data), "num_workers": 0})
    det = Detector(cfg)
    train = FitPlan.of(cfg, str(data)).train
    test = sorted((data / "test").rglob("*.png"))
    scorer = det.new_scorer()
    seed, cpu = scorer.seed + SEED_CORESET, torch.device("cpu")

    def embed(items: List[Any]) -> List[torch.Tensor]:
        return [det.embed(b.images, scorer=scorer) for b in iter_batches(
            items, det.preprocessor, batch_size=cfg.data.batch_size, num_workers=0,
            max_pixels=cfg.data.max_pixels)]

    train_emb = embed(train)
    grid = tuple(train_emb[0].shape[2:])
    per_image = torch.cat([e.permute(0, 2, 3, 1).flatten(1, 2) for e in train_emb])  # [n, hw, D]
    del train_emb
    n, d = per_image.shape[0], per_image.shape[2]
    patches = per_image.reshape(-1, d)
    test_emb, labels = embed(test), [int(p.parent.name != "good") for p in test]

    def measure(bank: torch.Tensor) -> Dict[str, float]:
        s = det.new_scorer()
        s.grid, s.fitted = grid, True
        s.set_bank(bank)
        scores = []
        for e in test_emb:
            patch = s.score(e)
            scores += s.image_scores(e, patch, anomaly_maps(patch, det.preprocessor.input_size)
                                     ).tolist()
        return {"bank": int(bank.shape[0]), "radius": coverage_radius(patches, bank),
                "auroc": 100 * image_auroc(labels, scores)}

    union = {"features": patches.numpy(), "n_patches": len(patches)}
    one = measure(partial.select(union, cfg.patchcore, seed, cpu))
    res: Dict[str, Any] = {"config": str(config), "train_images": n, "test_images": len(test),
                           "one-shot": one}
    print("one-shot", json.dumps(one), flush=True)
    for extra in range(1, seeds):
        r = measure(partial.select(union, cfg.patchcore, seed + extra, cpu))
        res[f"one-shot seed +{extra}"] = r
        print(f"one-shot seed +{extra}", json.dumps(r), flush=True)
    for k in shard_counts:
        for factor in oversample:
            t0 = time.perf_counter()
            states = [partial.shard_state(per_image[lo:hi].reshape(-1, d), cfg.patchcore, seed,
                                          hi - lo, n, grid, oversample=factor)
                      for lo, hi in shard_bounds(n, k, cfg.data.batch_size)]
            t1 = time.perf_counter()
            merged = partial.merge(states)
            bank = partial.select(merged, cfg.patchcore, seed, cpu)
            r = measure(bank)
            r.update(union=int(merged["features"].shape[0]), oversample=factor,
                     radius_ratio=r["radius"] / one["radius"],
                     auroc_delta=r["auroc"] - one["auroc"], shard_selection_s=t1 - t0,
                     final_selection_s=time.perf_counter() - t1)
            res[f"{k} shards x{factor:g}"] = r
            print(k, "shards", json.dumps(r), flush=True)
    return res


def _child(args: argparse.Namespace, mode: str, inputs: Path, out: Path) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "anomaly_hooks.distributed.bench", "--child", mode,
           "--model", args.model, "--inputs", str(inputs), "--out", str(out),
           "--cpus", str(args.cpus)] + (["--no-images"] if args.no_images else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-2000:]}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--modes", nargs="+", default=["plain", "plain1", "ray1", "ray2"])
    ap.add_argument("--no-images", action="store_true")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--merge-positions", type=int, default=392)
    ap.add_argument("--coreset-data", type=Path,
                    help="an MVTec category: sharded PatchCore coverage radius and AUROC")
    ap.add_argument("--coreset-shards", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--coreset-config", type=Path, default=DEFAULT_CORESET_CONFIG,
                    help="the PatchCore config (default: configs/patchcore.yaml)")
    ap.add_argument("--oversample", type=float, nargs="+", default=[2.0],
                    help="each shard keeps this many times its share of the final bank")
    ap.add_argument("--coreset-seeds", type=int, default=1,
                    help="also draw the one-shot coreset with this many seeds in all")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--inputs", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_mode(args.child, args.model, args.inputs, args.out,
                                               not args.no_images, args.cpus)))
        return 0
    if args.coreset_data:
        res = coreset_shards(args.coreset_data, args.coreset_shards, args.coreset_config,
                             args.oversample, args.coreset_seeds)
        print(json.dumps(res, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="ah_bench_dist_"))
    args.model = args.model or fit_model(tmp / "model.safetensors")
    inputs = make_inputs(args.images, tmp / "inputs")
    res: Dict[str, Any] = {"images": args.images, "write_pngs": not args.no_images,
                           "load_average": os.getloadavg(), "modes": {}}
    for mode in args.modes:
        r = _child(args, mode, inputs, tmp / mode)
        if "seconds" in r:
            r["images_per_s"] = args.images / r["seconds"]
            r["rss_growth_mb"] = r["rss_peak_mb"] - r["rss_start_mb"]
        res["modes"][mode] = r
        print(mode, json.dumps(r), flush=True)
    plain = res["modes"].get("plain", {}).get("seconds")
    for r in res["modes"].values():
        if plain and "seconds" in r:
            r["speedup_vs_plain"] = plain / r["seconds"]
    if args.merge_positions:
        res["merge"] = merge_cost(args.merge_positions)
        print("merge", json.dumps(res["merge"]), flush=True)
    res["load_average_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
