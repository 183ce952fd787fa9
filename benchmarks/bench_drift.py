#!/usr/bin/env python
"""Drift-monitor detection table: drift kind x dataset -> images to alarm, and the false-alarm
rate per window on held-out good images (BENCHMARKS.md, section "Drift monitor").

For each dataset (``train/good`` + ``test/good`` folders):

1. split ``train/good`` (seeded): 75 % to fit the detector (which holds out its own threshold
   images; its drift reference is recorded by the fit's hooks, as in production), 25 % held
   out of the whole fit; these plus ``test/good`` are the *held-out good* images;
2. one predict pass (the real hook path) over the held-out good images, clean and under each
   drift, and over other products' good images, recording the per-image statistics the
   monitor is fed (a recorder in the detector's monitor seam);
3. false alarms: 20 streams of 1000 held-out good images drawn with replacement, through a
   fresh ``DriftMonitor`` each: share of checks (windows) in alarm, alarm episodes per 1000;
4. images to alarm: 200 streams of ``W`` held-out good images then ``3 W`` drifted ones (in
   random order); the delay is the number of drifted images up to the first alarm: median / p90
   (``-`` = the median stream had no alarm within ``3 W``; the share detected in brackets).

Drifts are applied where the network sees them: to the image resized to the model's
``preprocess.resize`` (blur and noise sizes in those pixels), before the centre crop.

    python benchmarks/bench_drift.py --config configs/padim_effnet_lite0.yaml \\
        data/sample ../shared/data/mvtec_bottle ../shared/data/battery_weld
        [--device cpu] [--window 16] [--alpha 0.01] [--streams 200] [--max-held 40]
        [--seed 0] [--json drift.json]
    python benchmarks/bench_drift.py --alignment DATASET [DATASET ...]

``--alignment`` instead prints how far apart the good images of each dataset already are: the
offset of the phase-correlation peak between every pair of (at most 37) ``train/good`` images
(grey, 256 px, Hann window), quartiles in % of the width. A camera shift smaller than that is a
good image to the monitor.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import torch.nn.functional as F

from anomaly_hooks import Detector
from anomaly_hooks.data import list_images
from anomaly_hooks.images import read_image_reduced
from anomaly_hooks.monitor import SCORE_BLOCK, DriftMonitor
from anomaly_hooks.timing import Stopwatch
from benchmarks.measure import machine, write_json

Drift = Callable[[torch.Tensor, torch.Generator], torch.Tensor]  # [3, H, W] in [0, 1]


def _grey(x: torch.Tensor) -> torch.Tensor:
    return 0.299 * x[0] + 0.587 * x[1] + 0.114 * x[2]


def _blur(sigma: float) -> Drift:
    """Gaussian blur of ``sigma`` pixels (separable, reflected border)."""
    r = int(math.ceil(3 * sigma))
    t = torch.arange(-r, r + 1, dtype=torch.float32)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    k = k / k.sum()

    def f(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        y = F.pad(x[None], (r, r, r, r), mode="reflect")
        y = F.conv2d(y, k.view(1, 1, 1, -1).expand(3, 1, 1, -1), groups=3)
        return F.conv2d(y, k.view(1, 1, -1, 1).expand(3, 1, -1, 1), groups=3)[0]
    return f


def _affine(angle_deg: float = 0.0, shift_px: float = 0.0) -> Drift:
    """Rotate about the centre and/or shift (bicubic; reflection fills the border)."""
    def f(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        a = math.radians(angle_deg)
        h, w = x.shape[1:]
        theta = torch.tensor([[math.cos(a), -math.sin(a), -2 * shift_px / w],
                              [math.sin(a), math.cos(a), -2 * shift_px / h]])
        grid = F.affine_grid(theta[None], [1, *x.shape], align_corners=False)
        return F.grid_sample(x[None], grid, mode="bicubic", padding_mode="reflection",
                             align_corners=False)[0]
    return f


def _shift(frac: float) -> Drift:
    """The camera moved: whole-pixel shift right and down, reflected border."""
    def f(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        h, w = x.shape[1:]
        dy, dx = round(frac * h), round(frac * w)
        return F.pad(x[None], (dx, 0, dy, 0), mode="reflect")[0][:, :h, :w]
    return f


def _contrast(k: float) -> Drift:
    """Contrast scaled by ``k`` about the image's mean grey."""
    return lambda x, g: (x - _grey(x).mean()) * k + _grey(x).mean()


DRIFTS: Dict[str, Drift] = {
    "brightness +20 %": lambda x, g: x * 1.2,
    "brightness -20 %": lambda x, g: x * 0.8,
    "contrast x0.7": _contrast(0.7),
    "contrast x1.3": _contrast(1.3),
    "blur sigma 1.5 px": _blur(1.5),
    "blur sigma 2 px": _blur(2.0),
    "noise sigma 0.05": lambda x, g: x + 0.05 * torch.randn(x.shape, generator=g),
    "rotation 3 deg": _affine(angle_deg=3.0),
    "rotation 5 deg": _affine(angle_deg=5.0),
    "control: resampled, no rotation": _affine(shift_px=0.5),
    "shift 5 %": _shift(0.05),
    "shift 10 %": _shift(0.10),
}


class Recorder(DriftMonitor):
    """Sits in the detector's monitor seam and keeps every image's statistics (the exact
    vectors a monitor would be fed) instead of windowing them."""

    def __init__(self, det: Detector) -> None:
        pre = det.preprocessor
        super().__init__(det.drift_reference_, mean=pre.mean, std=pre.std)
        self.rows: List[Dict[str, np.ndarray]] = []
        self.cpu_s = 0.0  # CPU seconds spent in the statistics (the monitor's cost per batch)

    def statistics(self, features: Optional[Mapping[str, Any]], images: Any) -> Dict[str, Any]:
        c0 = time.process_time()
        out = super().statistics(features, images)
        self.cpu_s += time.process_time() - c0
        return out

    def update(self, vectors: Mapping[str, Any], scores: Optional[Any] = None) -> None:
        self.rows.append({**vectors, SCORE_BLOCK: np.asarray(scores, np.float64)[:, None]})

    def take(self) -> Dict[str, np.ndarray]:
        """The statistics recorded since the last call, one row per image."""
        out = {k: np.concatenate([r[k] for r in self.rows]) for k in self.rows[0]}
        self.rows = []
        return out


def resized(det: Detector, paths: List[Path]) -> List[torch.Tensor]:
    """Each image decoded and resized as the preprocessor does (``[3, rh, rw]``): the
    preprocessor's own resize of these is the identity, so the drift lands in network pixels."""
    pre = det.preprocessor
    return [F.interpolate(read_image_reduced(p, pre.min_source_size)[0][None], size=pre.resize,
                          mode="bilinear", align_corners=False, antialias=True)[0].clamp(0, 1)
            for p in paths]  # (clamped: the antialiased resize overshoots [0, 1] a little)


def statistics(det: Detector, rec: Recorder, images: List[torch.Tensor],
               drift: Optional[Drift], seed: int, cost: Dict[str, float]
               ) -> Dict[str, np.ndarray]:
    """The monitor's per-image statistics of ``images`` (drifted by ``drift``, seeded), from
    one predict pass; adds its CPU seconds and image count to ``cost``."""
    gen = torch.Generator().manual_seed(seed)
    batch = [x if drift is None else drift(x, gen).clamp(0, 1) for x in images]
    c0 = time.process_time()
    det.decision_function(batch)
    cost["predict_cpu_s"] += time.process_time() - c0
    cost["images"] += len(batch)
    return rec.take()


def cat(*parts: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The rows of ``parts``, block by block."""
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def run_stream(det: Detector, vecs: Dict[str, np.ndarray], order: np.ndarray) -> dict:
    """Feed the images ``order`` through a fresh monitor, one update per image batch."""
    mon = DriftMonitor.from_detector(det)
    mon.update({k: v[order] for k, v in vecs.items() if k != SCORE_BLOCK},
               scores=vecs[SCORE_BLOCK][order, 0])
    return mon.status()


def evaluate(det: Detector, clean: Dict[str, np.ndarray], drifted: Dict[str, dict],
             n_streams: int, rng: np.random.Generator) -> dict:
    """False alarms on streams of clean images, and the images to alarm of each drift."""
    w = det.drift_reference_.window
    n_clean = len(clean[SCORE_BLOCK])
    checks = alarms = episodes = 0
    for _ in range(20):
        st = run_stream(det, clean, rng.integers(0, n_clean, 1000 + w - 1))
        checks += 1000
        alarms += st["alarm_images"]
        episodes += st["alarm_episodes"]
    res = {"window": w, "far_per_window": alarms / checks, "episodes_per_1000": episodes / 20,
           "n_held_out_good": n_clean, "delays": {}}
    length = 3 * w
    for name, vecs in drifted.items():
        both, nd = cat(clean, vecs), len(vecs[SCORE_BLOCK])
        first, early = [], 0
        for _ in range(n_streams):
            post = np.concatenate([rng.permutation(nd) for _ in range(length // nd + 1)])
            order = np.concatenate([rng.choice(n_clean, w, replace=n_clean < w),
                                    n_clean + post[:length]])
            st = run_stream(det, both, order)
            hit = st["first_alarm_image"]
            early += hit is not None and hit < w  # a false alarm before the drift began
            first.append(hit - w if hit is not None and hit >= w else length + 1)
        first_a = np.asarray(first)
        res["delays"][name] = {"median": float(np.median(first_a)),
                               "p90": float(np.quantile(first_a, 0.9)),
                               "within_3W": float((first_a <= length).mean()),
                               "alarm_before_drift": early / n_streams}
    return res


def bench(cfg: str, root: Path, others: List[Path], args: argparse.Namespace) -> dict:
    """Fit on ``root``, record the statistics of its held-out good images clean, drifted and
    of the ``others``' good images, and evaluate the monitor on streams of them."""
    train = list_images(root / "train" / "good")
    order = list(range(len(train)))
    random.Random(args.seed).shuffle(order)
    n_pool = max(8, round(0.25 * len(train)))
    pool = [train[i] for i in sorted(order[:n_pool])][:args.max_held]
    fit = [train[i] for i in sorted(order[n_pool:])]
    test_good = list_images(root / "test" / "good")[:args.max_held]
    watch, c0 = Stopwatch(), time.process_time()
    det = Detector.from_config(cfg, device=args.device, overrides=[
        f"monitor.window={args.window}", f"monitor.alpha={args.alpha}", "data.num_workers=0"])
    det.fit(fit, progress=False)
    rec = Recorder(det)
    det.monitor = rec
    held = resized(det, pool + test_good)
    cost = {"predict_cpu_s": 0.0, "images": 0}
    clean = statistics(det, rec, held, None, 0, cost)
    drifted = {name: statistics(det, rec, held, fn, 1 + i, cost)
               for i, (name, fn) in enumerate(DRIFTS.items())}
    for other in others:
        imgs = list_images(other / "train" / "good")
        pick = random.Random(1).sample(imgs, min(32, len(imgs)))
        drifted[f"other product: {other.name}"] = statistics(det, rec, resized(det, pick),
                                                             None, 0, cost)
    res = evaluate(det, clean, drifted, args.streams, np.random.default_rng(args.seed))
    res.update(dataset=root.name, config=cfg, n_fit=len(fit), n_pool=len(pool),
               n_test_good=len(test_good), wall_s=watch.lap("bench"),
               cpu_s=time.process_time() - c0, alpha=args.alpha,
               predict_cpu_ms=1000 * cost["predict_cpu_s"] / cost["images"],
               statistics_cpu_ms=1000 * rec.cpu_s / cost["images"])
    print(f"{root.name}: {len(fit)} fit images, held-out good {len(pool)} + {len(test_good)}, "
          f"W={res['window']}: {res['wall_s']:.0f} s wall, {res['cpu_s']:.0f} s CPU; predict "
          f"{res['predict_cpu_ms']:.0f} ms CPU/image, of which the drift statistics "
          f"{res['statistics_cpu_ms']:.1f} ms", flush=True)
    return res


def table(runs: List[dict]) -> str:
    """Markdown: one row per drift kind, one column per dataset."""
    head = [f"{r['dataset']} (W={r['window']})" for r in runs]
    lines = ["| drift | " + " | ".join(head) + " |", "|---" * (len(runs) + 1) + "|"]
    kinds: List[str] = []
    for r in runs:
        kinds += [k if not k.startswith("other product") else "other product"
                  for k in r["delays"] if k not in kinds]
    for kind in dict.fromkeys(kinds):
        cells = []
        for r in runs:
            w3 = 3 * r["window"]
            ds = {k: d for k, d in r["delays"].items()
                  if k == kind or (kind == "other product" and k.startswith(kind))}
            cells.append(", ".join(
                (k.split(": ")[1] + " " if kind == "other product" else "")
                + (f"- ({100 * d['within_3W']:.0f} %)" if d["median"] > w3 else
                   f"{d['median']:.0f}/{d['p90']:.0f}" if d["p90"] <= w3 else
                   f"{d['median']:.0f}/>3W") for k, d in ds.items()) or "n/a")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines.append("| false alarms per window (held-out good, alpha "
                 f"{runs[0]['alpha']:g}) | "
                 + " | ".join(f"{r['far_per_window']:.4f}" for r in runs) + " |")
    lines.append("| alarm episodes / 1000 good images | "
                 + " | ".join(f"{r['episodes_per_1000']:.1f}" for r in runs) + " |")
    lines.append("| held-out good images (train/good hold-out + test/good) | "
                 + " | ".join(f"{r['n_pool']} + {r['n_test_good']}" for r in runs) + " |")
    return "\n".join(lines)


def alignment(root: Path, side: int = 256, limit: int = 37) -> Dict[str, float]:
    """Quartiles of the pairwise phase-correlation offsets of ``root/train/good`` (% of width),
    and the offset read for the first image against itself shifted by 5 % (the method's check)."""
    from PIL import Image

    window = np.outer(np.hanning(side), np.hanning(side))

    def grey(path: Path) -> np.ndarray:
        a = np.asarray(Image.open(path).convert("L").resize((side, side), Image.BILINEAR), float)
        return (a - a.mean()) * window

    def offset(a: np.ndarray, b: np.ndarray) -> float:
        cross = np.fft.fft2(a) * np.conj(np.fft.fft2(b))
        peak = np.fft.ifft2(cross / (np.abs(cross) + 1e-9)).real
        iy, ix = np.unravel_index(peak.argmax(), peak.shape)
        dy, dx = (v if v < side // 2 else v - side for v in (int(iy), int(ix)))
        return 100 * math.hypot(dy, dx) / side

    ims = [grey(p) for p in list_images(root / "train" / "good")[:limit]]
    pairs = [offset(ims[i], ims[j]) for i in range(len(ims)) for j in range(i + 1, len(ims))]
    q1, q2, q3 = np.percentile(pairs, [25, 50, 75])
    return {"images": len(ims), "q25": q1, "median": q2, "q75": q3,
            "known_5pct_shift": offset(np.roll(ims[0], round(0.05 * side), axis=1), ims[0])}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("datasets", nargs="+", type=Path, help="folders with train/good, test/good")
    ap.add_argument("--config", default="configs/padim_effnet_lite0.yaml")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=0.01)
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--max-held", type=int, default=40, help="held-out good images per source")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--alignment", action="store_true",
                    help="only print the good images' pairwise offsets per dataset")
    return ap.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.alignment:
        for root in args.datasets:
            a = alignment(root)
            print(f"{root.name}: {a['images']} train/good images, pairwise offsets "
                  f"{a['q25']:.1f} / {a['median']:.1f} / {a['q75']:.1f} % of the width "
                  f"(quartiles); a 5 % shift reads {a['known_5pct_shift']:.1f} %")
        return 0
    torch.manual_seed(args.seed)
    print(f"machine: {machine()}")
    runs = [bench(args.config, root, [o for o in args.datasets if o != root], args)
            for root in args.datasets]
    if args.json:
        write_json(args.json, runs)
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
