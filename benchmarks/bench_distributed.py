#!/usr/bin/env python
"""Benchmark of the scale-out job: score throughput with 1 and 2 Ray workers against plain
``score``, the driver's peak memory, and the cost of merging PaDiM partial states.

    python benchmarks/bench_distributed.py [--model M.safetensors] [--images 400]
        [--modes plain plain1 ray1 ray2] [--no-images] [--cpus 2] [--merge-positions 392]
        [--json out.json]
    python benchmarks/bench_distributed.py --coreset-data ../shared/data/mvtec_bottle
        [--coreset-shards 2 4] [--coreset-config configs/patchcore.yaml]
        [--oversample 2 4] [--coreset-seeds 3]   # sharded PatchCore: coverage radius, AUROC

Without ``--model`` a ResNet18 PaDiM (random init, 224 px, d=100) is fitted on data/sample
first. The inputs are the sample test images repeated under new names (symbolic links). Each
mode runs in its own subprocess (its own peak RSS, its own Ray session with ``--cpus`` CPUs).
Reported per mode: wall seconds, images/s, CPU seconds of the driver and every process it
started (Ray's workers included) and of the driver alone, the driver's start and peak RSS in MB
(sampled every 50 ms).
The merge part times :func:`~anomaly_hooks.scorers.padim.partial.merge` of two dense WRN50-size
states (``D = 550``) over ``--merge-positions`` of the 3136 positions (figures scale linearly
in positions) and one state's round trip through Ray's object store.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anomaly_hooks.timing import PeakMemory, Stopwatch
from benchmarks.measure import (
    ROOT,
    SAMPLE,
    child_result,
    machine,
    report_result,
    tree_cpu_seconds,
    write_json,
)

DEFAULT_CORESET_CONFIG = ROOT / "configs" / "patchcore.yaml"
RSS_INTERVAL = 0.05  # seconds between the driver's RSS samples (a long run: no need for finer)


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
    """A ResNet18 PaDiM (random init, d=100) fitted on the sample data, saved to ``path``."""
    from anomaly_hooks.detector import Detector

    det = Detector.from_config(None, backbone__name="resnet18", backbone__weights=None,
                               backbone__layers=None, padim__n_features=100, device="cpu",
                               data__num_workers=0)
    return str(det.fit(str(SAMPLE), progress=False).save(path))


def run_plain(mode: str, model: str, inputs: str, out: str, write_pngs: bool
              ) -> Dict[str, Any]:
    """The CLI's ``score`` in this process: ``plain`` on torch's default threads, ``plain1`` on
    one thread (as each Ray actor runs)."""
    import torch

    from anomaly_hooks.cli import main as cli

    if mode == "plain1":
        torch.set_num_threads(1)
    cpu0 = tree_cpu_seconds()
    with PeakMemory(interval=RSS_INTERVAL) as mem:
        watch = Stopwatch()
        cli(["score", "--model", model, inputs, "--out", out]
            + ([] if write_pngs else ["--no-images"]))
        secs = watch.lap("score")
    return {"seconds": secs, "cpu_seconds": tree_cpu_seconds() - cpu0,
            "rss_start_mb": mem.start_mb, "rss_peak_mb": mem.peak_rss_mb}


def run_ray(workers: int, model: str, inputs: str, out: str, write_pngs: bool,
            cpus: int) -> Dict[str, Any]:
    """The Ray score with ``workers`` actors, in a Ray session of ``cpus`` CPUs started here."""
    import ray

    from anomaly_hooks.distributed.scoring import score

    ray.init(num_cpus=cpus, log_to_driver=False, include_dashboard=False)
    cpu0, driver0 = tree_cpu_seconds(), time.process_time()
    with PeakMemory(interval=RSS_INTERVAL) as mem:
        watch = Stopwatch()
        summary = score(model, [inputs], out, num_workers=workers, write_pngs=write_pngs)
        secs = watch.lap("score")
    cpu, driver = tree_cpu_seconds() - cpu0, time.process_time() - driver0
    ray.shutdown()
    return {"seconds": secs, "cpu_seconds": cpu, "driver_cpu_seconds": driver,
            "rss_start_mb": mem.start_mb, "rss_peak_mb": mem.peak_rss_mb,
            "scored": summary["scored"], "failed": summary["failed"],
            "duplicates_dropped": summary["duplicates_dropped"],
            "missing": len(summary["missing"])}


def run_mode(mode: str, model: str, inputs: str, out: str, write_pngs: bool,
             cpus: int) -> Dict[str, Any]:
    """One mode in this process: ``plain``, ``plain1`` or ``rayN`` (N workers)."""
    if mode.startswith("plain"):
        return run_plain(mode, model, inputs, out, write_pngs)
    return run_ray(int(mode[3:]), model, inputs, out, write_pngs, cpus)


def merge_cost(positions: int, dim: int = 550, per_shard: int = 64) -> Dict[str, float]:
    """Seconds to merge two dense PaDiM states of ``positions`` positions, the state's size, and
    one state's put + get through Ray's object store."""
    import numpy as np
    import ray
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
    watch = Stopwatch()
    partial.merge(states)
    merge_s = watch.lap("merge")
    result = {"positions": positions, "dim": dim, "state_mb": nbytes / 1e6,
              "merge_seconds": merge_s, "merge_seconds_per_position": merge_s / positions}
    ray.init(num_cpus=1, log_to_driver=False, include_dashboard=False)
    watch.mark()
    ray.get(ray.put(states[0]))
    result["object_store_roundtrip_seconds"] = watch.lap("object store")
    ray.shutdown()
    return result


# -- sharded PatchCore ------------------------------------------------------------------------
class ShardStudy:
    """The embeddings of an MVTec category computed once (the fit's training images and scorer
    seed, the test images), and banks measured against them: the coverage radius over every
    training patch and the image AUROC on ``test/``."""

    def __init__(self, data: Path, config: Path) -> None:
        import torch

        from anomaly_hooks.config import load_config
        from anomaly_hooks.detector import Detector
        from anomaly_hooks.evaluation.datasets import open_dataset
        from anomaly_hooks.fitting import FitPlan
        from anomaly_hooks.scorers.patchcore.scorer import SEED_CORESET

        self.cfg = load_config(config, device="cpu",
                               data={"train": str(data), "num_workers": 0})
        self.det = Detector(self.cfg)
        scorer = self.det.new_scorer()
        self.seed = scorer.seed + SEED_CORESET
        dataset = open_dataset(data)
        train = self._embed(FitPlan.of(self.cfg, str(data)).train, scorer)
        self.grid = tuple(train[0].shape[2:])
        self.per_image = torch.cat([e.permute(0, 2, 3, 1).flatten(1, 2) for e in train])
        self.patches = self.per_image.reshape(-1, self.per_image.shape[2])  # [n * hw, D]
        del train  # concatenated above: not held while the test images are embedded
        self.test = self._embed([s.path for s in dataset.test], scorer)
        self.labels = dataset.labels

    def _embed(self, items: List[Any], scorer: Any) -> List[Any]:
        return [self.det.embed(b.images, scorer=scorer) for b in self.det.batches(items)]

    def measure(self, bank: Any) -> Dict[str, float]:
        """Coverage radius and image AUROC (%) of a PatchCore holding ``bank``."""
        from anomaly_hooks.evaluation.metrics import image_auroc
        from anomaly_hooks.heatmap import anomaly_maps
        from anomaly_hooks.scorers.patchcore.coreset import coverage_radius

        s = self.det.new_scorer()
        s.grid, s.fitted = self.grid, True
        s.set_bank(bank)
        size = self.det.preprocessor.input_size
        scores: List[float] = []
        for e in self.test:  # the scorer's half of Detector.infer, on the cached embeddings
            patch = s.score(e)
            scores += s.image_scores(e, patch, anomaly_maps(patch, size)).tolist()
        return {"bank": int(bank.shape[0]), "radius": coverage_radius(self.patches, bank),
                "auroc": 100 * image_auroc(self.labels, scores)}

    def one_shot(self, seed_offset: int = 0) -> Dict[str, float]:
        """The one-shot coreset over every training patch."""
        import torch

        from anomaly_hooks.scorers.patchcore import partial

        union = {"features": self.patches.numpy(), "n_patches": len(self.patches)}
        bank, _ = partial.select(union, self.cfg.patchcore, self.seed + seed_offset,
                                 torch.device("cpu"))
        return self.measure(bank)

    def sharded(self, shards: int, oversample: float) -> Dict[str, Any]:
        """``shards`` shards of the distributed fit, each keeping ``oversample`` x its share,
        merged and selected as the driver does."""
        import torch

        from anomaly_hooks.distributed.fitting import shard_bounds
        from anomaly_hooks.scorers.patchcore import partial

        n, d = self.per_image.shape[0], self.per_image.shape[2]
        pc = self.cfg.patchcore
        watch = Stopwatch()
        states = [partial.shard_state(self.per_image[lo:hi].reshape(-1, d), pc, self.seed,
                                      hi - lo, n, self.grid, oversample=oversample)
                  for lo, hi in shard_bounds(n, shards, self.cfg.data.batch_size)]
        shard_s = watch.lap("shards")
        merged = partial.merge(states)
        bank, _ = partial.select(merged, pc, self.seed, torch.device("cpu"))
        final_s = watch.lap("final")  # the merge and the driver's selection, not the measuring
        return {**self.measure(bank), "union": int(merged["features"].shape[0]),
                "oversample": oversample, "shard_selection_s": shard_s,
                "final_selection_s": final_s}


def coreset_shards(data: Path, shard_counts: List[int], config: Path = DEFAULT_CORESET_CONFIG,
                   oversample: Sequence[float] = (2.0,), seeds: int = 1) -> Dict[str, Any]:
    """Sharded PatchCore (the shard rule of :mod:`anomaly_hooks.scorers.patchcore.partial`,
    each shard keeping ``oversample`` x its share) against the one-shot coreset on an MVTec
    category: coverage radius over every training patch and image AUROC on ``test/``. The
    embeddings are computed once; shards are the distributed fit's (no Ray needed). With
    ``seeds`` > 1 the one-shot coreset is also drawn with other seeds (its first point is
    random): the spread of its AUROC is the yardstick for the sharded fits' differences."""
    study = ShardStudy(data, config)
    one = study.one_shot()
    res: Dict[str, Any] = {"config": str(config), "train_images": study.per_image.shape[0],
                           "test_images": len(study.labels), "one-shot": one}
    print("one-shot", json.dumps(one), flush=True)
    for extra in range(1, seeds):
        res[f"one-shot seed +{extra}"] = r = study.one_shot(extra)
        print(f"one-shot seed +{extra}", json.dumps(r), flush=True)
    for k in shard_counts:
        for factor in oversample:
            r = study.sharded(k, factor)
            r.update(radius_ratio=r["radius"] / one["radius"],
                     auroc_delta=r["auroc"] - one["auroc"])
            res[f"{k} shards x{factor:g}"] = r
            print(k, "shards", json.dumps(r), flush=True)
    return res


# -- driver -----------------------------------------------------------------------------------
def score_modes(args: argparse.Namespace) -> Dict[str, Any]:
    """Each mode in a fresh process on ``args.images`` inputs, then the merge cost."""
    tmp = Path(tempfile.mkdtemp(prefix="ah_bench_dist_"))
    args.model = args.model or fit_model(tmp / "model.safetensors")
    inputs = make_inputs(args.images, tmp / "inputs")
    res: Dict[str, Any] = {"images": args.images, "write_pngs": not args.no_images,
                           "machine": machine(threads=args.cpus), "modes": {}}
    for mode in args.modes:
        r = child_result([__file__, "--child", mode, "--model", args.model, "--inputs", inputs,
                          "--out", tmp / mode, "--cpus", args.cpus]
                         + (["--no-images"] if args.no_images else []))
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
    return res


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a fitted model (default: a small PaDiM fitted first)")
    ap.add_argument("--images", type=int, default=400, help="inputs to score")
    ap.add_argument("--modes", nargs="+", default=["plain", "plain1", "ray1", "ray2"])
    ap.add_argument("--no-images", action="store_true", help="no heatmap PNGs written")
    ap.add_argument("--cpus", type=int, default=2, help="CPUs of each Ray session")
    ap.add_argument("--merge-positions", type=int, default=392, help="0: no merge timing")
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
    return ap.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:
        report_result(run_mode(args.child, args.model, args.inputs, args.out,
                               not args.no_images, args.cpus))
        return 0
    if args.coreset_data:
        res = coreset_shards(args.coreset_data, args.coreset_shards, args.coreset_config,
                             args.oversample, args.coreset_seeds)
    else:
        res = score_modes(args)
    print(json.dumps(res, indent=1))
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
