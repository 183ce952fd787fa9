#!/usr/bin/env python
"""PatchCore fit study on one dataset: coreset selection time (10 % and 1 %), one-shot vs bounded
(merge-reduce) coverage radius, peak memory of both fit modes, and the recall of the
approximate faiss indexes against exact search.

    python benchmarks/bench_coreset.py --data ../shared/data/mvtec_bottle
        [--config configs/patchcore.yaml] [--max-bank-points 50000] [--queries 20000]
        [--skip-fits | --only-fits] [--json coreset.json] [key=value ...]

The patch embeddings are the fit's (``Detector.embed`` with a scorer seeded as the fit seeds
it, over ``FitPlan.train``), and so is the coreset seed. Each fit mode runs in a fresh process
so that its peak resident memory is its own.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from anomaly_hooks.config import load_config
from anomaly_hooks.devices import resolve_device
from anomaly_hooks.scorers.patchcore.coreset import (
    StreamingCoreset,
    coreset_size,
    coverage_radius,
    greedy_coreset,
)
from anomaly_hooks.scorers.patchcore.knn import NearestNeighbors
from anomaly_hooks.scorers.patchcore.scorer import SEED_CORESET
from anomaly_hooks.timing import PeakMemory, Stopwatch
from benchmarks.measure import child_result, machine, report_result, write_json

RATIOS = (0.1, 0.01)
APPROXIMATE = ("faiss-ivf", "faiss-hnsw")


def training_features(cfg: Any, data: Path) -> Tuple[torch.Tensor, int, int]:
    """The fit's training patch embeddings ``[N, D]``, the patches per image and the fit's
    coreset seed."""
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.fitting import FitPlan

    det = Detector(cfg)
    scorer = det.new_scorer()
    feats = []
    for batch in det.batches(FitPlan.of(cfg, str(data)).train):
        emb = det.embed(batch.images, scorer=scorer)
        feats.append(emb.permute(0, 2, 3, 1).reshape(-1, emb.shape[1]).clone())
    return torch.cat(feats), emb.shape[2] * emb.shape[3], scorer.seed + SEED_CORESET


def one_shot(feats: torch.Tensor, projection_dim: int, seed: int
             ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """The one-shot greedy coreset at each of :data:`RATIOS`: the banks and their timings."""
    banks, report = {}, {}
    for ratio in RATIOS:
        k = coreset_size(feats.shape[0], ratio, None)
        watch = Stopwatch(feats.device)
        idx = greedy_coreset(feats, k, projection_dim, seed=seed)
        secs = watch.lap("select")
        banks[f"{ratio:g}"] = feats[idx]
        report[f"coreset_{ratio}"] = {"k": k, "seconds": secs}
        print(f"coreset {ratio:.0%}: {k} points in {secs:.2f} s")
    return banks, report


def bounded(feats: torch.Tensor, chunk: int, max_points: int, projection_dim: int,
            seed: int) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """The merge-reduce coreset at 10 %, fed ``chunk`` patches at a time (one batch of images,
    as the fit feeds it)."""
    stream = StreamingCoreset(ratio=0.1, count=None, max_points=max_points,
                              projection_dim=projection_dim, seed=seed)
    watch = Stopwatch(feats.device)
    for part in torch.split(feats, chunk):
        stream.add(part)
    bank = stream.finalize()
    return bank, {"max_bank_points": max_points, "k": bank.shape[0],
                  "seconds": watch.lap("bounded"), "reductions": stream.reductions}


def radii(feats: torch.Tensor, banks: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """The coverage radius of every training patch by each bank."""
    out = {}
    for name, bank in banks.items():
        watch = Stopwatch(feats.device)
        out[name] = coverage_radius(feats, bank)
        print(f"coverage radius {name}: {out[name]:.3f} ({watch.lap('radius'):.0f} s)")
    return out


def recall(bank: torch.Tensor, queries: torch.Tensor, pc: Any, seed: int) -> Dict[str, Any]:
    """Recall at 1 of each approximate faiss index against exact search, and its speed."""
    _, truth = NearestNeighbors(bank, backend="faiss-flat").search(queries, 1)
    out = {}
    for backend in APPROXIMATE:
        index = NearestNeighbors(bank, backend=backend, nlist=pc.nlist, nprobe=pc.nprobe,
                                 hnsw_m=pc.hnsw_m, ef_search=pc.ef_search, seed=seed)
        watch = Stopwatch()
        _, got = index.search(queries, 1)
        secs = watch.lap("search")
        hit = float((got[:, 0] == truth[:, 0]).float().mean())
        out[backend] = {"recall_at_1": hit, "ms_per_1000_queries": 1e6 * secs / len(queries)}
        print(f"{backend}: recall@1 {hit:.4f}")
    return out


def selection_study(cfg: Any, data: Path, max_points: int, n_queries: int) -> Dict[str, Any]:
    """Selection times, coverage radii (one-shot, bounded, random) and index recall."""
    watch = Stopwatch()
    feats, per_image, seed = training_features(cfg, data)
    report: Dict[str, Any] = {"features": {"n": feats.shape[0], "dim": feats.shape[1],
                                           "extract_seconds": watch.lap("extract")}}
    print(f"{feats.shape[0]} patches x {feats.shape[1]} in "
          f"{report['features']['extract_seconds']:.1f} s")
    pc = cfg.patchcore
    banks, timings = one_shot(feats, pc.projection_dim, seed)
    report.update(timings)
    stream_bank, report["bounded"] = bounded(feats, cfg.data.batch_size * per_image, max_points,
                                             pc.projection_dim, seed)
    gen = torch.Generator().manual_seed(seed)
    ten = banks["0.1"]
    rand = feats[torch.randperm(feats.shape[0], generator=gen)[:ten.shape[0]]]
    report["coverage_radius"] = radii(feats, {"one_shot_10": ten, "bounded_10": stream_bank,
                                              "random_10": rand})
    queries = feats[torch.randperm(feats.shape[0], generator=gen)[:n_queries]]
    report["recall"] = recall(ten, queries, pc, seed)
    return report


# -- the fits, each in its own process --------------------------------------------------------
def fit_child(config: str, data: str, overrides: Sequence[str]) -> Dict[str, Any]:
    """Fit in this process: seconds, bank size, peak RSS above the start, step timings."""
    from anomaly_hooks.detector import Detector

    det = Detector.from_config(config, overrides=list(overrides))
    with PeakMemory(det.device) as mem:
        watch = Stopwatch(det.device)
        det.fit(data, progress=False)
        secs = watch.lap("fit")
    return {"fit_seconds": secs, "bank": int(det.scorer_.bank.shape[0]),
            "peak_rss_above_start_mb": mem.peak_mb, "timings": det.fit_timings_}


def fits(config: str, data: Path, overrides: Sequence[str], max_points: int) -> Dict[str, Any]:
    """The one-shot and the bounded fit, each in a fresh process."""
    modes = {"one_shot": [], "bounded": [f"patchcore.max_bank_points={max_points}"]}
    out = {}
    for name, extra in modes.items():
        out[f"fit_{name}"] = child_result([__file__, "--fit-child", "--config", config,
                                           "--data", data, *overrides, *extra,
                                           "threshold.mode=holdout"])
        print(f"fit {name}: {out[f'fit_{name}']}")
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="an MVTec-layout category")
    parser.add_argument("--config", default="configs/patchcore.yaml")
    parser.add_argument("--max-bank-points", type=int, default=50000)
    parser.add_argument("--queries", type=int, default=20000,
                        help="training patches searched for the recall")
    parser.add_argument("--json", default="coreset.json")
    parser.add_argument("--skip-fits", action="store_true", help="no subprocess fits")
    parser.add_argument("--only-fits", action="store_true", help="only the subprocess fits")
    parser.add_argument("--fit-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.fit_child:
        report_result(fit_child(args.config, str(args.data), args.overrides))
        return 0
    cfg = load_config(args.config, args.overrides)
    report: Dict[str, Any] = {"data": str(args.data), "config": args.config}
    if not args.only_fits:
        report.update(selection_study(cfg, args.data, args.max_bank_points, args.queries))
    if not args.skip_fits:
        report.update(fits(args.config, args.data, args.overrides, args.max_bank_points))
    report["machine"] = machine(resolve_device(cfg.device))
    write_json(args.json, report)
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
