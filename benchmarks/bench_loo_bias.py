#!/usr/bin/env python
"""Are PaDiM's leave-one-out scores of the training images higher than unseen good images'?

Usage::

    python benchmarks/bench_loo_bias.py [--data ../shared/data/battery_weld] [--splits 12]
        [--sizes 24 30] [--positions 6] [--draws 300] [--out DIR]

The default PaDiM EfficientNet-Lite0 config's embeddings of the training, ``test/good`` and
defective test images (cached under ``--out``), then three measurements:

1. **Copies**: test images byte-identical to a training image (the model has seen them).
2. **Paired splits**: a model fitted on ``m`` random training images scores the other training
   images (unseen, the same population) and ``test/good``; its exact leave-one-out image scores
   (:func:`anomaly_hooks.scorers.padim.loo.loo_distances_from_samples`, i.e. models on
   ``m - 1``) are compared with the unseen training images' per split (the ratio of means).
3. **Monte-Carlo**: Gaussian data with the covariance measured at ``--positions`` random patch
   positions, ``n`` = the number of training images: the regularised (``padim.epsilon``)
   squared Mahalanobis distance of a left-out sample (model on ``n - 1``) against an unseen
   one (model on ``n``). Without ``eps`` and with ``D < n - 3`` this ratio is Hotelling's
   ``n^2 (n - 2) (n - D - 2) / ((n - 1)^2 (n + 1) (n - D - 3))`` (1.0065 for n = 37, D = 5);
   PaDiM's ``D`` exceeds ``n``, where only ``eps`` makes the covariance invertible.

Image scores are the detector's own (heatmap, blur, max: ``Detector.image_scores_from_patches``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from anomaly_hooks.data import resolve_items  # noqa: E402
from anomaly_hooks.detector import Detector  # noqa: E402
from anomaly_hooks.scorers.padim.loo import loo_distances_from_samples  # noqa: E402

CONFIG = REPO / "configs" / "padim_effnet_lite0.yaml"


def digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def embeddings(det: Detector, root: Path, cache: Path) -> dict:
    """``{train, good, bad}``: ``[n, D, h, w]`` embeddings of the three image sets (cached)."""
    if cache.exists():
        return torch.load(cache)
    scorer = det.new_scorer()
    sets = {"train": resolve_items(root, training=True),
            "good": resolve_items(root / "test" / "good"),
            "bad": [p for d in sorted((root / "test").iterdir()) if d.name != "good"
                    for p in resolve_items(d)]}
    out = {}
    for name, items in sets.items():
        parts = []
        for batch in det.batches(items):
            with torch.inference_mode():
                parts.append(det.embed(batch.images, scorer=scorer))
        out[name] = torch.cat(parts)
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, cache)
    return out


class Gaussians:
    """Per-position regularised Gaussians of samples ``[P, m, D]`` in the exact low-rank form
    (float64): ``d^2 = (|v|^2 - a.Yv) / eps``, ``a = (eps I + Y Y^T)^-1 Y v``."""

    def __init__(self, x: torch.Tensor, eps: float) -> None:
        m = x.shape[1]
        self.eps, self.mu = eps, x.mean(1, keepdim=True)
        self.y = (x - self.mu) / math.sqrt(m - 1)
        gram = eps * torch.eye(m, dtype=x.dtype) + self.y @ self.y.transpose(1, 2)
        self.ginv = torch.linalg.inv(gram)

    def distances(self, z: torch.Tensor) -> torch.Tensor:
        """``[P, b]`` distances of ``z`` ``[P, b, D]``."""
        v = z - self.mu
        yv = self.y @ v.transpose(1, 2)
        d2 = (v.square().sum(2) - ((self.ginv @ yv) * yv).sum(1)) / self.eps
        return d2.clamp_min(0).sqrt()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "battery_weld"))
    p.add_argument("--splits", type=int, default=12)
    p.add_argument("--sizes", type=int, nargs="*", default=[24, 30])
    p.add_argument("--positions", type=int, default=6)
    p.add_argument("--draws", type=int, default=300)
    p.add_argument("--out", default="bench_loo_bias")
    args = p.parse_args()
    root, out = Path(args.data), Path(args.out)
    det = Detector.from_config(str(CONFIG), overrides=["device=cpu"])
    eps = float(det.cfg.padim.epsilon)
    emb = embeddings(det, root, out / f"{root.name}_embeddings.pt")
    grid = emb["train"].shape[2:]
    pnd = {k: v.flatten(2).permute(2, 0, 1).double() for k, v in emb.items()}  # [P, n, D]
    n = pnd["train"].shape[1]

    def scores(dist: torch.Tensor) -> np.ndarray:
        return np.array(det.image_scores_from_patches(dist.t().reshape(-1, *grid).float()))

    rows: dict = {"dataset": root.name, "n_train": n, "dim": pnd["train"].shape[2]}
    train_digests = {digest(f) for f in resolve_items(root, training=True)}
    copies = [digest(f) in train_digests for f in resolve_items(root / "test" / "good")]
    full = Gaussians(pnd["train"], eps)
    good = scores(full.distances(pnd["good"]))
    loo = scores(loo_distances_from_samples(pnd["train"].float(), eps).double())
    unseen = good[~np.array(copies)]
    rows.update(copies=int(sum(copies)), n_good=len(copies), loo_mean=loo.mean(),
                loo_median=float(np.median(loo)), good_unseen_mean=unseen.mean(),
                good_unseen_median=float(np.median(unseen)),
                good_copies_mean=float(good[np.array(copies)].mean()) if any(copies) else None)
    print(json.dumps(rows), flush=True)
    rng = np.random.default_rng(0)
    for m in args.sizes:
        ratio, vs_good = [], []
        for _ in range(args.splits):
            idx = rng.permutation(n)
            fit_i, held = idx[:m].tolist(), idx[m:].tolist()
            model = Gaussians(pnd["train"][:, fit_i], eps)
            h = scores(model.distances(pnd["train"][:, held])).mean()
            in_loo = scores(loo_distances_from_samples(pnd["train"][:, fit_i].float(),
                                                       eps).double()).mean()
            ratio.append(in_loo / h)
            vs_good.append(scores(model.distances(pnd["good"])).mean() / h)
        r = np.array(ratio)
        row = {"split_size": m, "splits": args.splits, "loo_over_unseen_train": r.mean(),
               "sd_of_mean": r.std(ddof=1) / math.sqrt(r.size),
               "test_good_over_unseen_train": float(np.mean(vs_good))}
        print(json.dumps(row), flush=True)
        rows[f"split_{m}"] = row
    x = pnd["train"].numpy()
    for pos in rng.choice(x.shape[0], args.positions, replace=False).tolist():
        cov = np.cov(x[pos].T) + 1e-6 * np.eye(x.shape[2])
        chol = np.linalg.cholesky(cov)
        left, new = [], []
        for _ in range(args.draws):
            s = rng.standard_normal((n + 1, cov.shape[0])) @ chol.T
            new.append(float(Gaussians(torch.from_numpy(s[None, :n]), eps).distances(
                torch.from_numpy(s[None, n:])).square()))
            left.append(float(Gaussians(torch.from_numpy(s[None, :n - 1]), eps).distances(
                torch.from_numpy(s[None, n - 1:n])).square()))
        left_a, new_a = np.array(left), np.array(new)
        row = {"position": pos, "d2_loo_over_unseen": left_a.mean() / new_a.mean(),
               "se": math.sqrt(left_a.var() / left_a.size + new_a.var() / new_a.size)
               / new_a.mean(),
               "median_d_ratio": math.sqrt(np.median(left_a) / np.median(new_a))}
        print(json.dumps(row), flush=True)
        rows.setdefault("monte_carlo", []).append(row)
    (out / "loo_bias.json").write_text(json.dumps(rows, indent=1, default=float))


if __name__ == "__main__":
    main()
