#!/usr/bin/env python
"""Build the coreset benchmark banks reproducibly and cache them as ``.npy``.

Each bank is the set of PatchCore patch embeddings of a list of (augmented) training images,
projected and centred exactly as :func:`greedy_coreset` does before its selection (seeded
Gaussian projection to 128-d, mean subtracted), so the selection can be timed on its own.

Banks (``--bank``, repeatable; default: all):

* ``weld222``: battery_weld train/good (37 grayscale welds) x 6 augmentations (identity,
  h-flip, v-flip, both flips, two 80 % crops) = 222 images of near-uniform surfaces; the
  pretrained EfficientNet-Lite0 (configs/patchcore_effnet_lite0.yaml) at 256 x 256, no crop:
  32 x 32 = 1024 patches per image -> 227,328 x 152 -> 128-d.
* ``mix610``: battery_weld x 10 augmentations + data/sample train/good (60 textures) x 4 =
  610 images -> 624,640 patches, same backbone.
* ``bottle``: mvtec_bottle train/good (209 images), configs/patchcore.yaml (random-init
  WRN50 layer2+3, 224 crop): 209 x 784 = 163,856 x 1536 -> 128-d.
* ``sample``: data/sample train/good (60 textures), EfficientNet-Lite0 at 256: 61,440 patches
  (small; for quick checks).

For each bank the bare backbone (torchvision's create_feature_extractor up to the deepest
tapped layer) is timed over the same images in the same run, so that coreset seconds can be
quoted as a ratio to the backbone pass.

    python benchmarks/bench_coreset_banks.py [--out bench_out/banks] [--bank weld222]

Writes ``<out>/<bank>.npy`` (float32 [N, 128], projected and centred: select on it with
``greedy_batched(x, k, meta["first_index"])``), and ``<out>/<bank>.json`` (N, feature dim, seed,
first index, patches per image, backbone/embedding seconds).

``--export DIR`` instead writes the bank's images as PNGs in the MVTec layout (``DIR/<bank>/
train/good``, and ``test/good`` with the first 8 source images un-augmented), for an end-to-end
fit with bench_pipeline.py, e.g.::

    python benchmarks/bench_coreset_banks.py --export /tmp/banks --bank weld222
    python benchmarks/bench_pipeline.py --config configs/patchcore_effnet_lite0.yaml \\
        --data /tmp/banks/weld222 --batch-size 16 --passes 1 --repeats 3 preprocess.crop=null \\
        threshold.folder=/tmp/banks/weld222/test/good
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from anomaly_hooks.data import list_images
from anomaly_hooks.images import read_image
from anomaly_hooks.scorers.patchcore.coreset import first_index, random_projection
from anomaly_hooks.scorers.patchcore.scorer import SEED_CORESET
from anomaly_hooks.timing import Stopwatch
from benchmarks.measure import ROOT, bare_backbone, bare_seconds, chunks, write_json

SHARED = ROOT.parent / "shared" / "data"
WELD = SHARED / "battery_weld" / "train" / "good"
BOTTLE = SHARED / "mvtec_bottle" / "train" / "good"
SAMPLE = ROOT / "data" / "sample" / "train" / "good"
EFFNET = ["configs/patchcore_effnet_lite0.yaml", "preprocess.crop=null"]


def crop(img: torch.Tensor, frac: float, corner: int) -> torch.Tensor:
    """A ``frac`` crop of ``img`` [3, H, W] at one of four corners."""
    _, h, w = img.shape
    ch, cw = max(1, int(round(frac * h))), max(1, int(round(frac * w)))
    top = 0 if corner in (0, 1) else h - ch
    left = 0 if corner in (0, 2) else w - cw
    return img[:, top:top + ch, left:left + cw]


AUGMENT: List[Callable[[torch.Tensor], torch.Tensor]] = [
    lambda x: x,
    lambda x: x.flip(-1),
    lambda x: x.flip(-2),
    lambda x: x.flip(-1).flip(-2),
    lambda x: crop(x, 0.8, 0),
    lambda x: crop(x, 0.8, 3),
    lambda x: crop(x, 0.8, 1).flip(-1),
    lambda x: crop(x, 0.8, 2).flip(-2),
    lambda x: crop(x, 0.7, 0).transpose(-1, -2),
    lambda x: crop(x, 0.7, 3).transpose(-1, -2),
]


def images(folder: Path, n_aug: int) -> List[torch.Tensor]:
    """Each image of ``folder`` under the first ``n_aug`` augmentations."""
    out: List[torch.Tensor] = []
    for path in list_images(folder):
        img = read_image(path)
        out.extend(AUGMENT[a](img).contiguous() for a in range(n_aug))
    return out


# name -> (config and overrides, the images)
BANKS: Dict[str, Tuple[List[str], Callable[[], List[torch.Tensor]]]] = {
    "weld222": (EFFNET, lambda: images(WELD, 6)),
    "mix610": (EFFNET, lambda: images(WELD, 10) + images(SAMPLE, 4)),
    "bottle": (["configs/patchcore.yaml"], lambda: images(BOTTLE, 1)),
    "sample": (EFFNET, lambda: images(SAMPLE, 1)),
}


def _batches(det: Any, imgs: Sequence[torch.Tensor], batch_size: int) -> Iterator[torch.Tensor]:
    """The network inputs of ``imgs``, ``batch_size`` at a time (``Detector.prepare``)."""
    for chunk in chunks(imgs, batch_size):
        yield det.prepare(chunk)[0]


def build(name: str, out: Path, batch_size: int) -> Dict[str, Any]:
    """Embed the bank's images as the fit does, project and centre them as the selection does,
    time the bare backbone over the same images; write ``<name>.npy`` and ``<name>.json``."""
    from anomaly_hooks.detector import Detector, resolve_layer_names

    config, make = BANKS[name]
    det = Detector.from_config(config[0], overrides=config[1:])
    cfg = det.cfg
    scorer = det.new_scorer()
    seed = scorer.seed + SEED_CORESET  # the fit's coreset seed
    imgs = make()
    watch = Stopwatch(det.device)
    feats = []
    for images in _batches(det, imgs, batch_size):
        emb = det.embed(images.to(det.device), scorer=scorer, timings=watch)
        feats.append(emb.permute(0, 2, 3, 1).reshape(-1, emb.shape[1]).clone())
    per_image = emb.shape[2] * emb.shape[3]
    bare = bare_backbone(cfg, resolve_layer_names(cfg), det.device)
    bare_s = bare_seconds(bare, _batches(det, imgs, batch_size), det.device)
    x = torch.cat(feats)
    del feats
    n, d = x.shape
    watch.mark()
    p = random_projection(x, cfg.patchcore.projection_dim, seed)
    p = p - p.mean(dim=0, dtype=torch.float64).float()
    project_s = watch.lap("projection")
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / f"{name}.npy", p.cpu().numpy())
    meta = {"bank": name, "n": n, "feature_dim": d, "dim": int(p.shape[1]), "seed": seed,
            "first_index": first_index(n, seed), "images": len(imgs),
            "patches_per_image": per_image, "config": config,
            "embed_seconds": watch.seconds["backbone"] + watch.seconds["embedding"],
            "bare_backbone_seconds": bare_s, "projection_seconds": project_s,
            "threads": torch.get_num_threads()}
    write_json(out / f"{name}.json", meta)
    return meta


def export(name: str, root: Path) -> None:
    """The bank's images as PNG files (8-bit RGB) in an MVTec layout."""
    from PIL import Image

    def save(img: torch.Tensor, path: Path) -> None:
        arr = (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        Image.fromarray(arr).save(path)

    train, test = root / "train" / "good", root / "test" / "good"
    train.mkdir(parents=True, exist_ok=True)
    test.mkdir(parents=True, exist_ok=True)
    for i, img in enumerate(BANKS[name][1]()):
        save(img, train / f"{i:04d}.png")
    source = {"bottle": BOTTLE, "sample": SAMPLE}.get(name, WELD)
    for i, path in enumerate(list_images(source)[:8]):
        save(read_image(path), test / f"{i:03d}.png")
    print(f"{name}: images in {root}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench_out" / "banks")
    parser.add_argument("--bank", action="append", choices=sorted(BANKS),
                        help="repeatable (default: all; with --export, weld222)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--export", type=Path, default=None, metavar="DIR",
                        help="write the banks' images as an MVTec-layout dataset instead")
    args = parser.parse_args(argv)
    if args.export is not None:
        for name in args.bank or ["weld222"]:
            export(name, args.export / name)
        return 0
    for name in args.bank or ["sample", "weld222", "bottle", "mix610"]:
        watch = Stopwatch()
        meta = build(name, args.out, args.batch_size)
        print(f"{name}: {meta['n']} x {meta['feature_dim']} -> {meta['dim']} "
              f"({meta['images']} images x {meta['patches_per_image']}); bare backbone "
              f"{meta['bare_backbone_seconds']:.1f} s, embedding {meta['embed_seconds']:.1f} s; "
              f"{watch.lap('bank'):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
