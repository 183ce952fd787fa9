"""High-resolution inspection: quality and cost, default framing against the tiled configs.

Run from the repository root (each part prints a table and writes JSON under --out)::

    python benchmarks/bench_highres.py table     # default vs highres, both methods, 3 data sets
    python benchmarks/bench_highres.py sweep     # scale x tile size on visa_macaroni1 (PatchCore)
    python benchmarks/bench_highres.py coreset   # 1 % of 2 M patches; radius vs exact greedy
    python benchmarks/bench_highres.py knn       # index choice by bank size: time and recall@1
    python benchmarks/bench_highres.py memory    # fit memory, 200 -> 900 macaroni-sized images
    python benchmarks/bench_highres.py cost      # predict cost per network pixel, tiled/untiled
    python benchmarks/bench_highres.py example   # a stitched heatmap with the tile cuts drawn
    python benchmarks/bench_highres.py eval CONFIG DATA [key=value ...]   # one evaluation
    python benchmarks/bench_highres.py report    # every part's table from the JSON lines
    python benchmarks/bench_highres.py all       # every part, then the report

Every timing is printed with the load average of the machine (``os.getloadavg``) at its start
and end: on a shared machine compare ratios measured in one run, not absolute times across runs.
Data: ``../shared/data/<name>`` (MVTec layout), never copied into the repository.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Idle OpenMP threads sleep instead of spinning (set before torch and faiss start theirs): on a
# machine shared with other jobs, spinning threads of torch's and faiss's two OpenMP runtimes
# lose their time slices to each other and to the neighbours; measured on this 2-core machine
# at load 4-5, the EfficientNet-Lite0 forward of 4 tiles took 2.0 s spinning, 0.44 s passive.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from anomaly_hooks.timing import PeakMemory, Stopwatch  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
DATASETS = ("visa_macaroni1", "mvtec_bottle", "battery_weld")
CONFIGS = {  # (method, framing) -> config file
    ("patchcore", "default"): "configs/patchcore_effnet_lite0.yaml",
    ("patchcore", "highres"): "configs/patchcore_effnet_lite0_highres.yaml",
    ("padim", "default"): "configs/padim_effnet_lite0.yaml",
    ("padim", "highres"): "configs/padim_effnet_lite0_highres.yaml",
}
METRICS = ("image_auroc", "pixel_auroc", "aupro", "pixel_f1_max")
REPEATS = 3  # timed repeats of a short measurement (the least is kept)


def load() -> str:
    """The 1-minute load average, as text."""
    return f"{os.getloadavg()[0]:.2f}"


def environment() -> Dict[str, Any]:
    """What the timings depend on besides the code: threads, the OpenMP wait policy, load."""
    return {"torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "load": load()}


def emit(out: Path, name: str, row: Dict[str, Any]) -> None:
    """Print ``row`` as one JSON line and append it to ``out / name``."""
    line = json.dumps(row, default=float)
    print(line, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / name, "a") as fh:
        fh.write(line + "\n")


# -- quality: one evaluation ----------------------------------------------------------------
def evaluate_one(config: str, data: Path, overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """Fit on ``data``'s good training images, score its test set (the ``evaluate`` command's
    runner), with the fit's step timings, its peak memory and the load average."""
    from anomaly_hooks.evaluation.datasets import open_dataset
    from anomaly_hooks.evaluation.runner import evaluate

    load_start = load()
    with PeakMemory() as mem:
        result = evaluate(str(ROOT / config), open_dataset(data), overrides, report_dir=None,
                          progress=False)
    s = result.summary
    framing = s.get("framing") or {}
    return {"dataset": data.name, "config": config, "overrides": list(overrides),
            **{k: s.get(k) for k in METRICS}, "fit_s": s["fit_seconds"],
            "predict_ms": s["ms_per_image"], "fit_steps": s.get("fit_timings"),
            "framing": framing, "peak_rss_mb": mem.peak_rss_mb,
            "load_start": load_start, "load_end": load(), "env": environment()}


def cmd_eval(args: argparse.Namespace) -> None:
    emit(args.out, "eval.jsonl", evaluate_one(args.config, Path(args.data), args.overrides))


def cmd_table(args: argparse.Namespace) -> None:
    """Default vs highres on every data set, both methods."""
    rows = []
    for name in args.datasets:
        for (method, framing), config in CONFIGS.items():
            if args.methods and method not in args.methods:
                continue
            result = evaluate_one(config, DATA / name)
            # "framing": the config's (default | highres); "frame": what the fit decided
            row = {"method": method, **result, "framing": framing, "frame": result["framing"]}
            emit(args.out, "table.jsonl", row)
            rows.append(row)
    print(format_table(rows))


def format_table(rows: List[Dict[str, Any]]) -> str:
    """The quality/cost table as Markdown."""
    head = ("| data set | method | framing | image AUROC | pixel AUROC | AUPRO | pixel F1-max "
            "| fit s | predict ms/img | load |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        cells = [f"{100 * r[k]:.1f}" if r.get(k) is not None else "–" for k in METRICS]
        lines.append(f"| {r['dataset']} | {r['method']} | {r['framing']} | "
                     + " | ".join(cells)
                     + f" | {r['fit_s']:.0f} | {r['predict_ms']:.0f} | "
                       f"{r['load_start']}–{r['load_end']} |")
    return "\n".join(lines)


# -- real patch features (cached outside the repository) ------------------------------------
def collect_patches(config: str, data: Path, cache: Path, n_images: int,
                    split: str = "train") -> np.ndarray:
    """``[N, D]`` float32 patch embeddings of ``n_images`` of ``data``'s training images (or
    test images, ``split="test"``) through ``config``'s tiled detector (its working frame
    decided from the training images), cached in ``cache``."""
    from anomaly_hooks.data import resolve_items
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.tiling import detector as tiled

    name = f"{Path(config).stem}_{data.name}_{split}_{n_images}.npy"
    path = cache / name
    if path.exists():
        return np.load(path, mmap_mode="r")
    det = Detector.from_config(str(ROOT / config))
    train = resolve_items(data, training=True)
    tiled.attach(det, tiled.fit_frame(det, train))
    items = train if split == "train" else resolve_items(data / "test" / "good")
    items = list(items)[:n_images]
    scorer = det.new_scorer()
    parts = []
    for batch in det.batches(items):
        emb = det.embed(batch.images, scorer=scorer)
        parts.append(emb.permute(0, 2, 3, 1).reshape(-1, emb.shape[1]).numpy().copy())
    out = np.concatenate(parts)
    cache.mkdir(parents=True, exist_ok=True)
    np.save(path, out)
    return out


def per_image(features: np.ndarray, n_images: int) -> int:
    """Patches per image of ``features`` collected from ``n_images`` images."""
    return features.shape[0] // n_images


# -- coreset: 1 % of 2 M patches ---------------------------------------------------------------
def greedy_radius(features: torch.Tensor, bank: torch.Tensor) -> float:
    """The coverage radius (full feature space, exact) of ``bank`` over ``features``."""
    from anomaly_hooks.scorers.patchcore.coreset import coverage_radius

    return coverage_radius(features, bank)


def prereduced_bank(features: torch.Tensor, p: int, ratio: float, oversample: float,
                    seed: int = 0) -> tuple[torch.Tensor, Dict[str, float]]:
    """The bank of the per-image pre-reduction + final greedy (as the scorer's fit runs it)
    over ``features`` (``p`` patches per image, in image order), and its step timings."""
    from anomaly_hooks.scorers.patchcore.coreset import coreset_size, greedy_coreset
    from anomaly_hooks.scorers.patchcore.prereduce import PerImageReduction

    n_img = features.shape[0] // p
    red = PerImageReduction(oversample, ratio, None, n_img, 128, seed)
    clock = Stopwatch()
    for lo in range(0, n_img, 8):
        hi = min(n_img, lo + 8)
        red.add(features[lo * p:hi * p].view(hi - lo, p, -1), lo)
    clock.lap("per-image reductions")
    kept, _ = red.take()
    k = coreset_size(features.shape[0], ratio, None)
    idx = greedy_coreset(kept, k, 128, seed)
    clock.lap("final selection")
    return kept[idx], {**clock.as_dict(total=True), "kept": int(kept.shape[0]), "k": k}


def exact_bank(features: torch.Tensor, ratio: float,
               seed: int = 0) -> tuple[torch.Tensor, float]:
    """The exact greedy's bank over all ``features`` and its seconds."""
    from anomaly_hooks.scorers.patchcore.coreset import coreset_size, greedy_coreset

    start = time.perf_counter()
    idx = greedy_coreset(features, coreset_size(features.shape[0], ratio, None), 128, seed)
    return features[idx], time.perf_counter() - start


def cmd_coreset(args: argparse.Namespace) -> None:
    """1 % of ~2 M macaroni patches by the pre-reduction (time), and on subsamples of whole
    images the coverage radius against the exact greedy (which can run there)."""
    data = DATA / "visa_macaroni1"
    feats = collect_patches(CONFIGS[("patchcore", "highres")], data, args.cache, args.images)
    p = per_image(feats, args.images)
    full = torch.from_numpy(np.ascontiguousarray(feats))
    for oversample in args.oversample:
        ld = load()
        _, steps = prereduced_bank(full, p, args.ratio, oversample)
        emit(args.out, "coreset.jsonl", {"what": "pre-reduction, all patches",
                                         "patches": int(full.shape[0]), "oversample": oversample,
                                         **steps, "load_start": ld, "load_end": load()})
    for n_sub in args.subsample:
        sub = full[:n_sub * p] if n_sub else full  # 0: every image (the exact greedy too)
        ld = load()
        exact, exact_s = exact_bank(sub, args.ratio)
        r_exact = greedy_radius(sub, exact)
        for oversample in args.oversample:
            bank, steps = prereduced_bank(sub, p, args.ratio, oversample)
            r = greedy_radius(sub, bank)
            emit(args.out, "coreset.jsonl", {
                "what": "radius vs exact greedy", "images": n_sub, "patches": int(sub.shape[0]),
                "oversample": oversample, "radius": r, "radius_exact": r_exact,
                "radius_ratio": r / r_exact, "exact_s": exact_s, **steps,
                "speedup": exact_s / steps["total"], "load_start": ld, "load_end": load()})


# -- kNN: the index by bank size ----------------------------------------------------------------
def knn_row(bank: torch.Tensor, queries: torch.Tensor, per_image_q: int, backend: str,
            exact: tuple, **params: Any) -> Dict[str, Any]:
    """Build time, search time per query, recall@1 and distance errors of one backend
    against the exact search ``exact`` = (distances, indices)."""
    from anomaly_hooks.scorers.patchcore.knn import NearestNeighbors

    start = time.perf_counter()
    index = NearestNeighbors(bank, backend=backend, **params)
    built = time.perf_counter() - start
    index.search(queries[:256], 1)  # warm-up
    searched = math.inf
    for _ in range(REPEATS):  # the least of a few: a shared machine only ever adds time
        start = time.perf_counter()
        dist, idx = index.search(queries, 1)
        searched = min(searched, time.perf_counter() - start)
    d0, i0 = exact
    rel = ((dist[:, 0] - d0[:, 0]) / d0[:, 0].clamp_min(1e-12)).numpy()
    # the image score is the max over an image's patches: its relative error per image
    n_img = queries.shape[0] // per_image_q
    top = dist[:n_img * per_image_q, 0].view(n_img, -1).amax(dim=1)
    top0 = d0[:n_img * per_image_q, 0].view(n_img, -1).amax(dim=1)
    return {"backend": index.backend, **params, "build_s": built,
            "us_per_query": 1e6 * searched / queries.shape[0],
            "recall_at_1": float((idx[:, 0] == i0[:, 0]).float().mean()),
            "dist_err_mean": float(rel.mean()), "dist_err_p999": float(np.quantile(rel, 0.999)),
            "max_patch_err": float(((top - top0) / top0).max())}


def cmd_knn(args: argparse.Namespace) -> None:
    """Exact and approximate search on banks of real macaroni patches of several sizes,
    queried with good and defective test images' patches."""
    data = DATA / "visa_macaroni1"
    config = CONFIGS[("patchcore", "highres")]
    train = collect_patches(config, data, args.cache, args.images)
    test = collect_patches(config, data, args.cache, args.queries, split="test")
    queries = torch.from_numpy(np.array(test))
    per_q = test.shape[0] // args.queries
    gen = torch.Generator().manual_seed(0)
    for m in args.sizes:
        pick = torch.randperm(train.shape[0], generator=gen)[:m].sort().values
        bank = torch.from_numpy(np.ascontiguousarray(train[pick.numpy()]))
        from anomaly_hooks.scorers.patchcore.knn import NearestNeighbors

        exact = NearestNeighbors(bank, backend="faiss-flat").search(queries, 1)
        ld = load()
        variants = [("faiss-flat", {}), ("torch", {}), ("projected", {}),
                    ("auto", {"queries_per_image": per_q})]
        variants += [("faiss-ivf", {"nprobe": n}) for n in (4, 8, 16, 32)]
        variants += [("faiss-hnsw", {"ef_search": e}) for e in (32, 64, 128)]
        for backend, params in variants:
            row = knn_row(bank, queries, per_q, backend, exact, **params)
            emit(args.out, "knn.jsonl", {"bank": m, "dim": int(bank.shape[1]),
                                         "queries": int(queries.shape[0]), "asked": backend,
                                         **row, "load_start": ld, "load_end": load()})


# -- the sweep: working scale x tile size on visa_macaroni1 ----------------------------------------
def cmd_sweep(args: argparse.Namespace) -> None:
    """PatchCore highres on visa_macaroni1 at each scale x tile size (threshold-free metrics:
    the fits hold 10 images out for the threshold instead of scoring all 200 out of sample,
    which would double each fit's backbone time)."""
    rows = []
    # the cheapest points first (small scales, large tiles: the least overlap), so that an
    # interrupted sweep has written the points it could
    for scale in sorted(args.scales, key=float):
        for tile in sorted(args.tiles, reverse=True):
            overrides = [f"tiling.scale={scale}", f"tiling.tile={tile}",
                         "threshold.mode=holdout", "threshold.holdout_fraction=0.05"]
            row = {"scale": scale, "tile": tile,
                   **evaluate_one(CONFIGS[("patchcore", "highres")], DATA / "visa_macaroni1",
                                  overrides)}
            emit(args.out, "sweep.jsonl", row)
            rows.append(row)
    print(format_sweep(rows))


def backbone_pixels(framing: Dict[str, Any]) -> int:
    """Backbone input pixels per image of a tiled ``framing`` (every tile's pixels): the cost
    measure that load cannot blur; fit and predict time grow with it about linearly."""
    t = framing["tiles"]
    return t["tiles"][0] * t["tiles"][1] * t["tile"][0] * t["tile"][1]


def format_sweep(rows: List[Dict[str, Any]]) -> str:
    """The sweep as Markdown."""
    lines = ["| scale | `tiling.tile` | content | tiles | backbone Mpx / image | image AUROC | "
             "pixel AUROC | AUPRO | pixel F1-max | fit s | predict ms/img | load |",
             "|" + "---|" * 12]
    for r in sorted(rows, key=lambda r: (-r["tile"], float(r["scale"]))):
        f = r["framing"]
        cells = [f"{100 * r[k]:.1f}" if r.get(k) is not None else "–" for k in METRICS]
        t = f["tiles"]
        lines.append(f"| {r['scale']} | {r['tile']} | {f['content'][0]} x {f['content'][1]} | "
                     f"{t['tiles'][0]} x {t['tiles'][1]} of {t['tile'][0]} x {t['tile'][1]} | "
                     f"{backbone_pixels(f) / 1e6:.2f} | " + " | ".join(cells)
                     + f" | {r['fit_s']:.0f} | {r['predict_ms']:.0f} | "
                       f"{r['load_start']}–{r['load_end']} |")
    return "\n".join(lines)


# -- fit memory: 200 -> 900 images ----------------------------------------------------------------
def cmd_memory(args: argparse.Namespace) -> None:
    """Peak RSS of PatchCore highres fits on 200 .. 900 macaroni-sized images (the 200 training
    images cycled, every other round mirrored: the same size and content statistics), with the
    bank as a ratio of the patches and as a fixed count; and the memory guard's estimate of the
    same fit without the per-image pre-reduction."""
    import gc

    from anomaly_hooks.data import resolve_items
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.resources import estimate_fit_memory
    from anomaly_hooks.scorers import get_scorer

    train = resolve_items(DATA / "visa_macaroni1", training=True)
    flipped = args.cache / "flipped"
    flipped.mkdir(parents=True, exist_ok=True)
    mirror = []
    for path in train:  # a mirrored copy of each image, once, outside the repository
        out = flipped / Path(path).name
        if not out.exists():
            from PIL import Image, ImageOps

            ImageOps.mirror(Image.open(path)).save(out, quality=95)
        mirror.append(out)
    pool = [p for pair in zip(train, mirror) for p in pair]
    for bank in ("ratio", "count"):
        for n in args.images:
            items = [pool[i % len(pool)] for i in range(n)]
            overrides = [f"tiling.max_pixels={args.max_pixels}", "threshold.mode=holdout",
                         "threshold.holdout_fraction=0.02"]
            if bank == "count":
                overrides.append(f"patchcore.coreset_count={args.count}")
            from anomaly_hooks.config import load_config

            cfg = load_config(str(ROOT / CONFIGS[("patchcore", "highres")]), overrides)
            det = Detector(cfg)
            gc.collect()
            ld = load()
            with PeakMemory() as mem:
                det.fit(items, progress=False)
            plain = load_config(str(ROOT / CONFIGS[("patchcore", "highres")]),
                                [*overrides, "patchcore.prereduce=null"])
            est = estimate_fit_memory(get_scorer("patchcore"), plain, det.layer_info,
                                      det.preprocessor.input_size, n, tiling=det.tiling)
            emit(args.out, "memory.jsonl", {
                "bank": bank, "images": n, "peak_rss_mb": mem.peak_rss_mb,
                "rss_growth_mb": mem.peak_rss_mb - mem.start_mb,
                "bank_rows": int(det.scorer_.bank.shape[0]),
                "fit_s": det.fit_timings_["total"],
                "estimate_without_prereduce_mb":
                    est["patch features before the coreset"] / 2 ** 20,
                "frame": list(det.preprocessor.input_size), "load_start": ld,
                "load_end": load()})
            del det
            gc.collect()


# -- predict cost per network pixel: tiled vs the untiled pipeline ------------------------------
def cmd_cost(args: argparse.Namespace) -> None:
    """``Detector.infer`` seconds per backbone input pixel of the tiled pipeline against the
    untiled one (``tiling.enabled=false``, ``preprocess.resize`` = the same frame, no crop):
    the tiles' own cost (cutting, stitching, more forward calls) beyond their extra pixels."""
    from anomaly_hooks.data import resolve_items
    from anomaly_hooks.detector import Detector

    train = resolve_items(DATA / "visa_macaroni1", training=True)[:args.fit_images]
    test = resolve_items(DATA / "visa_macaroni1" / "test" / "good")[:args.batch]
    config = str(ROOT / CONFIGS[("patchcore", "highres")])
    base = ["threshold.mode=holdout", "threshold.holdout_fraction=0.2",
            f"tiling.max_pixels={args.max_pixels}"]
    variants = {f"tiles of at most {t}": [f"tiling.tile={t}"] for t in args.tiles}
    rows = []
    frame = None
    for name, extra in [*variants.items(), ("untiled", None)]:
        if extra is None:  # the same frame through the untiled pipeline
            extra = ["tiling.enabled=false", f"preprocess.resize=[{frame[0]},{frame[1]}]",
                     "preprocess.crop=null"]
        det = Detector.from_config(config, overrides=[*base, *extra])
        det.fit(train, progress=False)
        images, _ = det.prepare(test)
        det.infer(images)  # warm-up
        best: Dict[str, float] = {}
        for _ in range(REPEATS):
            clock = Stopwatch()
            det.infer(images, timings=clock)
            total = sum(clock.seconds.values())
            if not best or total < best["total"]:
                best = {**clock.seconds, "total": total}
        frame = det.preprocessor.input_size
        grid = det.tiling.grid if det.tiling is not None else None
        px = images.shape[0] * (grid.n_tiles * grid.tile[0] * grid.tile[1] if grid
                                else frame[0] * frame[1])
        row = {"variant": name, "frame": list(frame),
               "tile": list(grid.tile) if grid else None, "tiles": grid.n_tiles if grid else 1,
               "overlap_factor": grid.overlap_factor if grid else 1.0, "seconds": best,
               "ns_per_backbone_px": 1e9 * best["total"] / px,
               "ms_per_image": 1e3 * best["total"] / images.shape[0], "env": environment()}
        rows.append(row)
        emit(args.out, "cost.jsonl", row)
    untiled = rows[-1]["ns_per_backbone_px"]
    for row in rows[:-1]:
        emit(args.out, "cost.jsonl", {"variant": row["variant"], "cost_per_px_vs_untiled":
                                      row["ns_per_backbone_px"] / untiled})


# -- pictures: the sweep's curve and a stitched heatmap -----------------------------------------
def plot_sweep(rows: List[Dict[str, Any]], path: Path) -> None:
    """Image AUROC and AUPRO against backbone megapixels per image (the cost, free of the
    machine's load), one line per tile size, each point labelled with its scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=100)
    for tile in sorted({r["tile"] for r in rows}, reverse=True):
        pts = sorted((backbone_pixels(r["framing"]) / 1e6, r["image_auroc"], r["aupro"],
                      r["scale"]) for r in rows if r["tile"] == tile)
        for ax, k in zip(axes, (1, 2)):
            ax.plot([p[0] for p in pts], [p[k] for p in pts], "o-", label=f"tiles <= {tile}")
            for p in pts:
                ax.annotate(f"scale {p[3]}", (p[0], p[k]), fontsize=7, xytext=(4, -10),
                            textcoords="offset points")
    for ax, name in zip(axes, ("image AUROC", "AUPRO (FPR <= 0.3)")):
        ax.set(xlabel="backbone Mpx / image (cost)", ylabel=name)
        ax.grid(alpha=0.3)
        ax.margins(x=0.2, y=0.15)  # room for the labels
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("visa_macaroni1, PatchCore EfficientNet-Lite0: working scale x tile size",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def small_png(picture: Any, path: Path, width: int, colours: int = 128) -> None:
    """Save ``picture`` as a PNG for the docs: resized to ``width`` pixels wide (aspect kept)
    and reduced to ``colours`` palette entries, which keeps a photograph with an overlay
    under ~200 KB where the full-size RGB picture takes megabytes."""
    from PIL import Image

    if picture.width > width:
        height = round(picture.height * width / picture.width)
        picture = picture.resize((width, height), Image.Resampling.LANCZOS)
    path.parent.mkdir(parents=True, exist_ok=True)
    picture.quantize(colours, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def cmd_example(args: argparse.Namespace) -> None:
    """A defective macaroni's stitched heatmap in its own 1500 x 1000 frame, the tile cuts
    drawn in black (the frame's cut lines mapped back to the image) and the thresholded mask
    outlined in white, written to ``--picture``
    (default ``heatmap_example.png`` under ``--out``), ``--width`` pixels wide."""
    from PIL import Image, ImageDraw

    from anomaly_hooks.data import resolve_items
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.images import read_image
    from anomaly_hooks.visualize import colorize, overlay, to_uint8_rgb

    data = DATA / "visa_macaroni1"
    det = Detector.from_config(str(ROOT / CONFIGS[("patchcore", "highres")]),
                               overrides=["threshold.mode=holdout", *args.overrides])
    train = resolve_items(data, training=True)
    det.fit(train[:args.fit_images] if args.fit_images else train, progress=False)
    defects = resolve_items(data / "test" / args.defect)
    scored = [(det.predict(defects[i]), defects[i]) for i in args.index]
    for pred, item in scored:
        print(json.dumps({"image": str(item), "score": pred.score, "threshold": pred.threshold}))
    # the drawn one: the highest score relative to the threshold among those asked for
    pred, item = max(scored, key=lambda s: s[0].score / s[0].threshold)
    image = to_uint8_rgb(read_image(item).numpy())
    # blue up to the image's median patch score, red at its largest (or the threshold)
    heat = colorize(pred.heatmap, float(np.median(pred.heatmap)),
                    max(pred.threshold, float(pred.heatmap.max())))
    # shrink first, then outline and draw: the lines stay sharp at the picture's size
    shrink = min(1.0, args.width / image.shape[1])
    size = (round(image.shape[1] * shrink), round(image.shape[0] * shrink))
    small = [np.asarray(Image.fromarray(a).resize(size, Image.Resampling.LANCZOS))
             for a in (image, heat)]
    mask = np.asarray(Image.fromarray(pred.mask).resize(size, Image.Resampling.NEAREST))
    picture = Image.fromarray(overlay(*small, mask=mask))  # the mask outlined in white
    draw = ImageDraw.Draw(picture)
    grid, frame = det.tiling.grid, det.tiling.frame
    h, w = frame.placement(image.shape[:2])  # the image's part of the frame, network px
    sy, sx = size[1] / h, size[0] / w
    for y in grid.cuts_y[1:-1]:  # the tile cuts in black
        draw.line([(0, y * sy), (size[0], y * sy)], fill=(0, 0, 0), width=2)
    for x in grid.cuts_x[1:-1]:
        draw.line([(x * sx, 0), (x * sx, size[1])], fill=(0, 0, 0), width=2)
    path = args.picture or args.out / "heatmap_example.png"
    small_png(picture, path, args.width)
    print(json.dumps({"image": str(item), "score": pred.score, "threshold": pred.threshold,
                      "fit_images": args.fit_images or len(train),
                      "framing": det.fit_info_.get("framing"), "picture": str(path),
                      "bytes": path.stat().st_size}, default=float))


# -- the report: every part's table from what the runs wrote --------------------------------
def read_rows(out: Path, name: str) -> List[Dict[str, Any]]:
    """The JSON lines of ``out / name`` (none if the part was not run)."""
    path = out / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def format_coreset(rows: List[Dict[str, Any]]) -> str:
    """The coreset figures as Markdown."""
    lines = ["| images | patches | bank | oversample | kept | pre-reduction s | exact greedy s "
             "| radius / exact's | load |", "|" + "---|" * 9]
    for r in rows:
        if r["what"] != "radius vs exact greedy":
            continue
        lines.append(f"| {r['images'] or 'all'} | {r['patches']:,} | {r['k']:,} | "
                     f"{r['oversample']:g} | {r['kept']:,} | {r['total']:.1f} | "
                     f"{r['exact_s']:.1f} | {r['radius_ratio']:.3f} | "
                     f"{r['load_start']}–{r['load_end']} |")
    return "\n".join(lines)


def format_knn(rows: List[Dict[str, Any]]) -> str:
    """The index measurements as Markdown."""
    lines = ["| bank | backend | setting | us / query | recall@1 | distance error p99.9 | "
             "largest image max error | load |", "|" + "---|" * 8]
    for r in rows:
        setting = r.get("nprobe", r.get("ef_search", ""))
        lines.append(f"| {r['bank']:,} | {r['backend']} | {setting} | {r['us_per_query']:.1f} | "
                     f"{r['recall_at_1']:.4f} | {100 * r['dist_err_p999']:.1f} % | "
                     f"{100 * r['max_patch_err']:.1f} % | {r['load_start']} |")
    return "\n".join(lines)


def cmd_report(args: argparse.Namespace) -> None:
    """Print every part's table from the JSON lines in ``--out``."""
    parts = [("Default vs highres", "table.jsonl", format_table),
             ("Scale x tile size, visa_macaroni1", "sweep.jsonl", format_sweep),
             ("Coreset", "coreset.jsonl", format_coreset),
             ("kNN index", "knn.jsonl", format_knn)]
    for title, name, fmt in parts:
        rows = read_rows(args.out, name)
        if rows:
            print(f"\n## {title}\n\n{fmt(rows)}")
    sweep = read_rows(args.out, "sweep.jsonl")
    if sweep:
        picture = getattr(args, "picture", None) or args.out / "sweep.png"
        plot_sweep(sweep, picture)
        print(f"\n(picture: {picture})")
    for name in ("memory.jsonl", "cost.jsonl"):
        rows = read_rows(args.out, name)
        if rows:
            print(f"\n## {name.split('.')[0]}\n")
            for r in rows:
                print(json.dumps(r, default=float))


def cmd_all(args: argparse.Namespace) -> None:
    """Every part with its defaults, then the report (hours on a 2-core machine)."""
    parser = build_parser()
    for part in ("table", "coreset", "knn", "sweep", "memory", "cost", "example"):
        part_args = parser.parse_args(["--out", str(args.out), "--cache", str(args.cache), part])
        part_args.func(part_args)
    cmd_report(args)


def build_parser() -> argparse.ArgumentParser:
    """The command line: one sub-command per part."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench_results" / "highres")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/anomaly_hooks_bench_cache"),
                        help="where collected patch features are kept (outside the repo)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("eval")
    p.add_argument("config")
    p.add_argument("data")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("table")
    p.add_argument("--datasets", nargs="*", default=list(DATASETS))
    p.add_argument("--methods", nargs="*", default=[])
    p.set_defaults(func=cmd_table)
    p = sub.add_parser("coreset")
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--oversample", type=float, nargs="*", default=[4.0, 8.0, 16.0])
    p.add_argument("--subsample", type=int, nargs="*", default=[20, 40, 0],
                   help="images of the radius comparisons; 0 = all of them")
    p.set_defaults(func=cmd_coreset)
    p = sub.add_parser("knn")
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--queries", type=int, default=4)
    p.add_argument("--sizes", type=int, nargs="*", default=[5000, 20000, 50000, 100000])
    p.set_defaults(func=cmd_knn)
    p = sub.add_parser("sweep")
    p.add_argument("--scales", nargs="*", default=["0.4", "0.55", "0.7"])
    p.add_argument("--tiles", type=int, nargs="*", default=[256, 512])
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser("memory")
    p.add_argument("--images", type=int, nargs="*", default=[200, 450, 900])
    p.add_argument("--max-pixels", type=int, default=150_000)
    p.add_argument("--count", type=int, default=5000)
    p.set_defaults(func=cmd_memory)
    p = sub.add_parser("cost")
    p.add_argument("--fit-images", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-pixels", type=int, default=600_000)
    p.add_argument("--tiles", type=int, nargs="*", default=[512, 256])
    p.add_argument("--method-config", default="highres")
    p.set_defaults(func=cmd_cost)
    p = sub.add_parser("example")
    p.add_argument("--defect", default="small_cracks")
    p.add_argument("--index", type=int, nargs="+", default=[0],
                   help="test images of --defect to score; the picture shows the one with the "
                        "highest score relative to the threshold")
    p.add_argument("--fit-images", type=int, default=0,
                   help="fit on the first N training images (0: all of them)")
    p.add_argument("--width", type=int, default=750, help="the picture's width in pixels")
    p.add_argument("--picture", type=Path, default=None,
                   help="where to write it (default: heatmap_example.png under --out), "
                        "e.g. docs/highres_heatmap.png")
    p.add_argument("overrides", nargs="*", help="config key=value overrides")
    p.set_defaults(func=cmd_example)
    p = sub.add_parser("report")
    p.add_argument("--picture", type=Path, default=None,
                   help="where to write the sweep's picture (default: sweep.png under --out), "
                        "e.g. docs/highres_sweep.png")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("all")
    p.set_defaults(func=cmd_all)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    warnings.filterwarnings("ignore", message="backbone.weights is null")
    args = build_parser().parse_args(argv)
    print(json.dumps({"environment": environment()}), flush=True)
    args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
