#!/usr/bin/env python
"""PaDiM's exact leave-one-out distances by their two routes: time and error on real embeddings.

Usage::

    python benchmarks/bench_loo.py --data ../shared/data/visa_macaroni1 [--images 100 200]
        [--config configs/padim_effnet_lite0.yaml] [--positions 512] [--reference 32]
        [override ...]

The training images' embeddings ``[P, n, D]`` (the config's backbone and embedder) for the
first ``max(--images)`` good training images; then, for each ``n`` of ``--images``, the
leave-one-out squared distances of those ``n`` samples at ``--positions`` positions, on one
thread, in turns (medians of 3):

* the Gram route, ``n x n`` (:func:`anomaly_hooks.scorers.padim.loo.gram_loo_squared` of the
  float32 Gram matrix ``Y Y^T + eps I``): what the fit uses for ``n <= D``;
* the covariance route, ``D x D`` (``covariance_group_out_squared`` of the float32
  covariance, which the fit computes for the Gaussians either way: not timed here): what the
  fit uses for ``n > D``, its triangular solve in float32 on the float64 factor;
* the same with the solve in float64 (the samples given in float64), to show what the float32
  solve costs in precision;

and each one's relative error against a float64 refit without each image (the brute force, at
``--reference`` positions): the median and the maximum over samples and positions.

``--chunk-mib 16 5``: first, the fit's Gaussians and leave-one-out together
(``DenseGaussians.from_samples(..., loo=True)``, every position, the process's threads) with
the position chunks each working-set budget gives (``loo.CHUNK_CACHE_BYTES``), in turns,
medians of 5, and whether every budget gives the same factors and distances to the bit.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from anomaly_hooks.config import load_config  # noqa: E402
from anomaly_hooks.data import list_images  # noqa: E402
from anomaly_hooks.detector import Detector  # noqa: E402
from anomaly_hooks.scorers.padim import loo  # noqa: E402
from anomaly_hooks.scorers.padim.gaussians import DenseGaussians  # noqa: E402
from anomaly_hooks.scorers.padim.loo import (  # noqa: E402
    covariance_group_out_squared,
    fit_chunk,
    gram_loo_squared,
)
from benchmarks.measure import machine  # noqa: E402


def embeddings(cfg, paths: list) -> torch.Tensor:
    """``[P, n, D]`` float32: every image's embedding at every position."""
    det = Detector(cfg)
    scorer = det.new_scorer()
    out = []
    for batch in det.batches(paths):
        if batch.errors:
            raise SystemExit("unreadable images: " + "; ".join(m for _, m in batch.errors))
        emb = det.embed(batch.images, scorer=scorer)  # [B, D, h, w]
        out.append(emb.flatten(2).permute(2, 0, 1).float())  # [P, B, D]
    return torch.cat(out, dim=1).contiguous()


def gram_route(xc: torch.Tensor, cov: torch.Tensor, eps: float) -> torch.Tensor:
    n = xc.shape[1]
    eye = eps * torch.eye(n, dtype=torch.float32)
    return gram_loo_squared(torch.baddbmm(eye, xc, xc.transpose(1, 2), alpha=1.0 / (n - 1)), eps)


def covariance_route(xc: torch.Tensor, cov: torch.Tensor, eps: float) -> torch.Tensor:
    return covariance_group_out_squared(xc, cov, eps)


def covariance_route64(xc: torch.Tensor, cov: torch.Tensor, eps: float) -> torch.Tensor:
    return covariance_group_out_squared(xc.double(), cov, eps)


def centred_chunks(x: torch.Tensor) -> list:
    """Fit-sized chunks of positions ``(xc, cov)``: the samples centred as the fit centres
    them and their float32 covariance (the fit computes it for the Gaussians either way)."""
    p, n, d = x.shape
    step = fit_chunk(n, d, x.device)
    out = []
    for lo in range(0, p, step):
        part = x[lo:lo + step]
        xc = part - part.mean(dim=1, dtype=torch.float64).float().unsqueeze(1)
        out.append((xc, torch.bmm(xc.transpose(1, 2), xc).div_(n - 1)))
    return out


def chunk_budgets(x_all: torch.Tensor, images: list, budgets_mib: list, eps: float,
                  repeats: int = 5) -> None:
    """Time ``from_samples`` (Gaussians and leave-one-out) of the first ``n`` samples for each
    ``n`` of ``images`` with each chunk budget (MiB), in turns; check the results agree."""
    p, _, d = x_all.shape
    kept = loo.CHUNK_CACHE_BYTES
    print(f"Gaussians and leave-one-out (from_samples), {p} positions, "
          f"{torch.get_num_threads()} threads, budgets in turns, medians of {repeats}")
    print("| n | chunk budget (MiB) | positions a chunk | seconds | same as the first |")
    print("|---:|---:|---:|---:|---|")
    try:
        for n in images:
            x = x_all[:, :n].contiguous()
            seconds = {b: [] for b in budgets_mib}
            results = {}
            for _ in range(repeats):
                for b in budgets_mib:
                    loo.CHUNK_CACHE_BYTES = int(b * (1 << 20))
                    start = time.perf_counter()
                    g = DenseGaussians.from_samples(x, eps, loo=True)
                    seconds[b].append(time.perf_counter() - start)
                    results[b] = (g.chol, g.loo)
            first = results[budgets_mib[0]]
            for b in budgets_mib:
                loo.CHUNK_CACHE_BYTES = int(b * (1 << 20))
                same = all(torch.equal(a, c) for a, c in zip(results[b], first))
                print(f"| {n} | {b:g} | {loo.fit_chunk(n, d, x.device)} | "
                      f"{float(np.median(seconds[b])):.3f} | {'yes' if same else 'NO'} |")
    finally:
        loo.CHUNK_CACHE_BYTES = kept


def brute_force(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Float64 refit without each sample: squared distances ``[P, n]``."""
    x = x.double()
    p, n, d = x.shape
    out = torch.empty(p, n, dtype=torch.float64)
    eye = eps * torch.eye(d, dtype=torch.float64)
    for i in range(n):
        rest = torch.cat([x[:, :i], x[:, i + 1:]], dim=1)
        mu = rest.mean(dim=1, keepdim=True)
        u = rest - mu
        chol = torch.linalg.cholesky(u.transpose(1, 2) @ u / (n - 2) + eye)
        v = (x[:, i] - mu[:, 0]).unsqueeze(2)
        out[:, i] = (v * torch.cholesky_solve(v, chol)).sum(dim=(1, 2))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="an MVTec-layout set (train/good is used)")
    ap.add_argument("--config", default=str(REPO / "configs" / "padim_effnet_lite0.yaml"))
    ap.add_argument("--images", type=int, nargs="+", default=[100, 200])
    ap.add_argument("--positions", type=int, default=512, help="positions timed")
    ap.add_argument("--reference", type=int, default=32, help="positions checked in float64")
    ap.add_argument("--chunk-mib", type=float, nargs="+", default=None,
                    help="also time the fit's Gaussians and leave-one-out with position "
                         "chunks of these working-set budgets (MiB), e.g. 16 5")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args()
    cfg = load_config(args.config, ["device=cpu", *args.overrides])
    eps = float(cfg.padim.epsilon)
    paths = list_images(Path(args.data) / "train" / "good")[:max(args.images)]
    if len(paths) < max(args.images):
        raise SystemExit(f"{args.data}: {len(paths)} good training images, fewer than "
                         f"--images {max(args.images)}")
    print(machine("cpu", 1))
    x_all = embeddings(cfg, paths)
    p, _, d = x_all.shape
    rng = np.random.default_rng(0)
    timed_at = torch.from_numpy(np.sort(rng.choice(p, min(p, args.positions), replace=False)))
    checked = timed_at[:args.reference]
    if args.chunk_mib:
        chunk_budgets(x_all, args.images, args.chunk_mib, eps)
    torch.set_num_threads(1)  # as each of the fit's chunk threads runs
    print(f"{args.config}: D = {d}, {p} positions, epsilon {eps}; one thread")
    print("| n | route | ms a position | median rel. error | max rel. error |")
    print("|---:|---|---:|---:|---:|")
    for n in args.images:
        chunks = centred_chunks(x_all[timed_at, :n].contiguous())
        ref = brute_force(x_all[checked, :n], eps)
        for name, route in (("Gram (n x n)", gram_route), ("covariance (D x D)", covariance_route),
                            ("covariance, float64 solve", covariance_route64)):
            seconds = []
            for _ in range(3):
                start = time.perf_counter()
                got = torch.cat([route(xc, cov, eps) for xc, cov in chunks])
                seconds.append(time.perf_counter() - start)
            err = ((got[:len(checked)].double() - ref).abs() / ref).flatten()
            ms = 1e3 * float(np.median(seconds)) / got.shape[0]
            print(f"| {n} | {name} | {ms:.3f} | {float(err.median()):.1e} | "
                  f"{float(err.max()):.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
