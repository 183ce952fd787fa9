#!/usr/bin/env python
"""PatchCore fit study on one dataset: coreset selection time (10 % and 1 %), one-shot vs bounded
(merge-reduce) coverage radius, peak memory of both fit modes, and the recall of the
approximate faiss indexes against exact search.

    python scripts/bench_coreset.py --data ../shared/data/mvtec_bottle [--config configs/patchcore.yaml]
        [--max-bank-points 50000] [--json coreset.json] [key=value ...]

Each fit mode runs in a fresh subprocess so that its peak resident memory is its own.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from anomaly_hooks.config import load_config  # noqa: E402
from anomaly_hooks.data import iter_batches, list_images, train_folder  # noqa: E402
from anomaly_hooks.scorers.patchcore.coreset import (  # noqa: E402
    StreamingCoreset,
    coreset_size,
    coverage_radius,
    greedy_coreset,
)
from anomaly_hooks.scorers.patchcore.knn import NearestNeighbors  # noqa: E402


def training_features(cfg, data: Path) -> tuple[torch.Tensor, int]:
    """All training patch embeddings ``[N, D]`` of the dataset's train/good images, and the
    number of patches per image."""
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.scorers import get_scorer

    det = Detector(cfg)
    scorer = get_scorer("patchcore").create(cfg.patchcore, det.layer_info, det.backbone_name,
                                            cfg.seed)
    feats = []
    for batch in iter_batches(list_images(train_folder(data)), det.preprocessor,
                              batch_size=cfg.data.batch_size, num_workers=cfg.data.num_workers,
                              max_pixels=cfg.data.max_pixels):
        emb = det.embed(batch.images, scorer=scorer)
        feats.append(emb.permute(0, 2, 3, 1).reshape(-1, emb.shape[1]).clone())
    return torch.cat(feats), emb.shape[2] * emb.shape[3]


def fit_peak_memory(config: str, data: Path, overrides: list[str]) -> dict:
    """Fit in a subprocess; its peak RSS (ru_maxrss) and fit seconds."""
    # psutil sampling in the child: ru_maxrss would include the parent's peak (kept across exec)
    code = (
        "import json, sys, time\n"
        "from anomaly_hooks import Detector\n"
        "from anomaly_hooks.evaluation.benchmark import PeakMemory\n"
        "det = Detector.from_config(sys.argv[1], overrides=sys.argv[3:])\n"
        "with PeakMemory(det.device) as mem:\n"
        "    t = time.perf_counter(); det.fit(sys.argv[2], progress=False)\n"
        "    secs = time.perf_counter() - t\n"
        "print(json.dumps({'fit_seconds': secs, 'bank': int(det.scorer_.bank.shape[0]),"
        " 'peak_rss_above_start_mb': mem.peak_mb, 'timings': det.fit_timings_}))\n")
    out = subprocess.run([sys.executable, "-c", code, config, str(data), *overrides],
                         capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--config", default="configs/patchcore.yaml")
    parser.add_argument("--max-bank-points", type=int, default=50000)
    parser.add_argument("--json", default="coreset.json")
    parser.add_argument("--skip-fits", action="store_true", help="no subprocess fits")
    parser.add_argument("--only-fits", action="store_true", help="only the subprocess fits")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    pc = cfg.patchcore
    report: dict = {"data": str(args.data), "config": args.config}

    if args.only_fits:
        for name, extra in (("one_shot", ["threshold.mode=holdout"]),
                            ("bounded", [f"patchcore.max_bank_points={args.max_bank_points}",
                                         "threshold.mode=holdout"])):
            report[f"fit_{name}"] = fit_peak_memory(args.config, args.data,
                                                    list(args.overrides) + extra)
            print(f"fit {name}: {report[f'fit_{name}']}")
        Path(args.json).write_text(json.dumps(report, indent=2))
        return 0
    start = time.perf_counter()
    feats, per_image = training_features(cfg, args.data)
    report["features"] = {"n": feats.shape[0], "dim": feats.shape[1],
                          "extract_seconds": time.perf_counter() - start}
    print(f"{feats.shape[0]} patches x {feats.shape[1]} in {report['features']['extract_seconds']:.1f} s")

    banks = {}
    for ratio in (0.1, 0.01):
        k = coreset_size(feats.shape[0], ratio, None)
        start = time.perf_counter()
        idx = greedy_coreset(feats, k, pc.projection_dim, seed=cfg.seed)
        secs = time.perf_counter() - start
        banks[ratio] = feats[idx]
        report[f"coreset_{ratio}"] = {"k": k, "seconds": secs}
        print(f"coreset {ratio:.0%}: {k} points in {secs:.2f} s")

    k10 = banks[0.1].shape[0]
    stream = StreamingCoreset(ratio=0.1, count=None, max_points=args.max_bank_points,
                              projection_dim=pc.projection_dim, seed=cfg.seed)
    start = time.perf_counter()
    for chunk in torch.split(feats, cfg.data.batch_size * per_image):
        stream.add(chunk)
    bounded = stream.finalize()
    report["bounded"] = {"max_bank_points": args.max_bank_points, "k": bounded.shape[0],
                         "seconds": time.perf_counter() - start, "reductions": stream.reductions}
    gen = torch.Generator().manual_seed(cfg.seed)
    rand = feats[torch.randperm(feats.shape[0], generator=gen)[:k10]]
    radii = {}
    for name, bank in (("one_shot_10", banks[0.1]), ("bounded_10", bounded), ("random_10", rand)):
        start = time.perf_counter()
        radii[name] = coverage_radius(feats, bank)
        print(f"coverage radius {name}: {radii[name]:.3f} ({time.perf_counter() - start:.0f} s)")
    report["coverage_radius"] = radii

    exact = NearestNeighbors(banks[0.1], backend="faiss-flat")
    queries = feats[torch.randperm(feats.shape[0], generator=gen)[:20000]]
    _, truth = exact.search(queries, 1)
    report["recall"] = {}
    for backend in ("faiss-ivf", "faiss-hnsw"):
        index = NearestNeighbors(banks[0.1], backend=backend, nlist=pc.nlist, nprobe=pc.nprobe,
                                 hnsw_m=pc.hnsw_m, ef_search=pc.ef_search, seed=cfg.seed)
        start = time.perf_counter()
        _, got = index.search(queries, 1)
        recall = float((got[:, 0] == truth[:, 0]).float().mean())
        report["recall"][backend] = {"recall_at_1": recall,
                                     "ms_per_1000_queries": 1000 * (time.perf_counter() - start)
                                     / (len(queries) / 1000)}
        print(f"{backend}: recall@1 {recall:.4f}")
    del feats, banks, bounded, rand

    if not args.skip_fits:
        for name, extra in (("one_shot", ["threshold.mode=holdout"]),
                            ("bounded", [f"patchcore.max_bank_points={args.max_bank_points}",
                                         "threshold.mode=holdout"])):
            report[f"fit_{name}"] = fit_peak_memory(args.config, args.data,
                                                    list(args.overrides) + extra)
            print(f"fit {name}: {report[f'fit_{name}']}")
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
