"""PaDiM on parts at varying places: alignment tolerance, covariance regularisation and the
image score, on embeddings computed once.

Run from the repository root::

    python benchmarks/bench_padim_align.py ../shared/data/visa_macaroni1          # 256 -> 224
    python benchmarks/bench_padim_align.py ../shared/data/visa_macaroni1 --tag s384 \\
        'backbone.layers=[_blocks.4,_blocks.10]' padim.n_features=152 \\
        'preprocess.resize=[384,576]' preprocess.crop=null       # a working scale, stride 8
    python benchmarks/bench_padim_align.py DATA [OVERRIDES] --epsilons 0.01 1 --neighbourhoods 0 1

The embeddings of the training and test images (``CONFIG`` with the overrides) are cached under
``--cache`` (outside the repository). Each variant ``epsilon × neighbourhood`` is a fit of the
PaDiM scorer itself on the cached training embeddings, then the test images' heatmaps (the
detector's heatmap pipeline at the network input size) and these image scores: the map's max
(what the detector uses), the mean of its top-k pixels, its mean. Pixel metrics compare the
maps with the masks framed like the images (inside the crop only), so they rank variants but
differ from ``evaluate``'s, which scores the whole image at its own size.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_highres.py

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

TOP_K = (100, 1000)
CACHE = Path("/tmp/anomaly_hooks_bench_cache/padim_align")  # outside the repository


def embed_all(det: Any, items: Sequence[Any]) -> np.ndarray:
    """``[N, D, h, w]`` float16 embeddings of ``items`` by ``det``'s fresh scorer's embedder."""
    scorer = det.new_scorer()
    return np.concatenate([det.embed(b.images, scorer=scorer).half().numpy()
                           for b in det.batches(items)])


def framed_masks(det: Any, dataset: Any) -> np.ndarray:
    """``[N, h, w]`` bool masks of the test images, resized and cropped like the images."""
    pre = det.preprocessor
    rh, rw = pre.resize
    top, left, ch, cw = pre.crop_box()
    out = []
    for s in dataset.test:
        if s.mask_path is None:
            out.append(np.zeros((ch, cw), bool))
            continue
        with Image.open(s.mask_path) as img:  # BOX: a defect smaller than a cell stays visible
            m = np.asarray(img.convert("L").resize((rw, rh), Image.BOX)) > 0
        out.append(m[top:top + ch, left:left + cw])
    return np.stack(out)


def cached(path: Path, make: Any) -> np.ndarray:
    """``make()`` saved at ``path`` once, loaded afterwards."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, make())
    return np.load(path)


def variant(config: str, overrides: List[str], train: np.ndarray, test: np.ndarray,
            labels: np.ndarray, masks: np.ndarray) -> Dict[str, Any]:
    """Fit the scorer of ``config`` + ``overrides`` on ``train`` ``[n, D, h, w]``, score
    ``test``: image AUROC of each image score, pixel AUROC, AUPRO and pixel F1-max of the maps."""
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.evaluation import metrics
    from anomaly_hooks.heatmap import anomaly_maps

    scorer = Detector.from_config(config, overrides=overrides).new_scorer()
    start = time.perf_counter()
    scorer.begin(train.shape[0])
    for lo in range(0, train.shape[0], 32):
        scorer.partial_fit(torch.from_numpy(train[lo:lo + 32]).float())
    scorer.finalize()
    fit_s = time.perf_counter() - start
    start = time.perf_counter()
    maps = torch.cat([anomaly_maps(scorer.score(torch.from_numpy(test[lo:lo + 32]).float()),
                                   masks.shape[1:]) for lo in range(0, test.shape[0], 32)])
    score_s = time.perf_counter() - start
    flat = maps.flatten(1)
    stats = {"max": flat.amax(dim=1), "mean": flat.mean(dim=1),
             **{f"top{k}": flat.topk(k, dim=1).values.mean(dim=1) for k in TOP_K}}
    maps_np = list(maps.numpy())
    return {"overrides": overrides, "fit_s": round(fit_s, 1), "score_s": round(score_s, 1),
            **{f"image_auroc_{k}": round(metrics.image_auroc(labels, v.numpy()), 4)
               for k, v in stats.items()},
            "pixel_auroc": round(metrics.pixel_auroc(list(masks), maps_np), 4),
            "aupro": round(metrics.aupro(list(masks), maps_np), 4),
            "pixel_f1_max": round(metrics.pixel_f1_max(list(masks), maps_np)[0], 4),
            "load": f"{os.getloadavg()[0]:.2f}"}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("overrides", nargs="*", help="key=value for the config (the framing)")
    ap.add_argument("--config", default=str(ROOT / "configs/padim_effnet_lite0.yaml"))
    ap.add_argument("--tag", default="default", help="names the cached embeddings")
    ap.add_argument("--cache", type=Path, default=CACHE)
    ap.add_argument("--epsilons", type=float, nargs="+", default=[0.01, 1.0])
    ap.add_argument("--neighbourhoods", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_intermixed_args(argv)  # options between the overrides too
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.evaluation.datasets import open_dataset

    ds = open_dataset(args.data)
    det = Detector.from_config(args.config, overrides=args.overrides)
    stem = args.cache / f"{args.data.name}_{args.tag}"
    train = cached(stem.with_name(stem.name + "_train.npy"), lambda: embed_all(det, ds.train))
    test = cached(stem.with_name(stem.name + "_test.npy"),
                  lambda: embed_all(det, [s.path for s in ds.test]))
    masks = cached(stem.with_name(stem.name + "_masks.npy"), lambda: framed_masks(det, ds))
    for eps in args.epsilons:
        for r in args.neighbourhoods:
            row = variant(args.config, [*args.overrides, f"padim.epsilon={eps}",
                                        f"padim.neighbourhood={r}"],
                          train, test, ds.labels, masks)
            print(json.dumps({"data": args.data.name, "tag": args.tag, **row}), flush=True)


if __name__ == "__main__":
    main()
