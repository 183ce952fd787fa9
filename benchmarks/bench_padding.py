#!/usr/bin/env python
"""Asymmetric zero padding ("same" padding at stride 2) against a kernel widened by zero taps.

Usage::

    python benchmarks/bench_padding.py [--backbone efficientnet_lite0] [--weights PACKAGED] \\
        [--batch 25] [--size 224] [--repeats 15] [--json out.json]

For each convolution of the backbone that pads its input with an asymmetric ``nn.ZeroPad2d``
child: the milliseconds of ``conv2d(pad(x))`` (and of ``pad(x)`` alone) against
``conv2d(x, widened_kernel(w), padding=larger side)``
(:func:`anomaly_hooks.fusion.widened_kernel`) on a batch of the input it sees, in the
contiguous and the channels-last memory format, and how much the two outputs
differ (the largest difference over the largest sum of the products' magnitudes). Then the
whole feature extraction (the backbone's other rewrites at their defaults) with the
asymmetric paddings kept and widened (``fusion.fold_padding(..., widen=)``), in turns:
medians of ``--repeats``, and the largest difference of the features. ``--dense``: the same
comparison on two dense stride-2 convolutions (the widening is kept to depthwise ones).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from anomaly_hooks import fusion  # noqa: E402
from anomaly_hooks.backbones import build_backbone  # noqa: E402
from anomaly_hooks.config import load_config  # noqa: E402
from anomaly_hooks.detector import resolve_layer_names  # noqa: E402
from anomaly_hooks.extractor import HookFeatureExtractor  # noqa: E402
from benchmarks.measure import machine, timed_repeats, write_json  # noqa: E402


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median milliseconds of ``fn()`` after two warm-up calls."""
    return timed_repeats(fn, repeats, warmup=2).median * 1000


def asymmetric_inputs(model: nn.Module, size: int) -> Dict[str, torch.Size]:
    """``{convolution: its input's shape}`` (batch of 1, from one forward pass) of every
    convolution with an asymmetric ``nn.ZeroPad2d`` child."""
    shapes: Dict[str, torch.Size] = {}

    def seen(name: str, _module: nn.Module, args: tuple) -> None:
        shapes.setdefault(name, args[0].shape)

    handles = []
    for name, conv in model.named_modules():
        pads = [m for m in conv.children() if type(m) is nn.ZeroPad2d]
        if isinstance(conv, nn.Conv2d) and len(pads) == 1 and len(set(pads[0].padding)) > 1:
            handles.append(conv.register_forward_pre_hook(partial(seen, name)))
    with torch.inference_mode():
        model(torch.zeros(1, 3, size, size))
    for handle in handles:
        handle.remove()
    return shapes


def padded_and_widened(conv: nn.Conv2d, x: torch.Tensor, pad: Tuple[int, int, int, int],
                       fmt: torch.memory_format) -> Tuple[Callable, Callable]:
    """The two forms of ``conv`` on ``x`` as calls: its padding layer's copy then the
    convolution, and the widened kernel with the symmetric padding."""
    left, right, top, bottom = pad
    w = conv.weight.detach().contiguous(memory_format=fmt)
    wide = fusion.widened_kernel(conv.weight.detach(), pad).contiguous(memory_format=fmt)
    sym = (max(top, bottom), max(left, right))
    return (lambda: F.conv2d(F.pad(x, pad), w, None, conv.stride, 0, 1, conv.groups),
            lambda: F.conv2d(x, wide, None, conv.stride, sym, 1, conv.groups))


def per_convolution(model: nn.Module, shapes: Dict[str, torch.Size], batch: int,
                    repeats: int, shown: Optional[str] = None) -> List[Dict[str, Any]]:
    """Padded against widened, per convolution and memory format (``shown``: the name the
    rows give a single convolution, else its module name)."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        conv = model.get_submodule(name)
        pad = next(m for m in conv.children() if type(m) is nn.ZeroPad2d).padding
        for fmt, label in ((torch.contiguous_format, "contiguous"),
                           (torch.channels_last, "channels-last")):
            x = torch.rand(batch, *shape[1:], generator=gen).contiguous(memory_format=fmt)
            padded, widened = padded_and_widened(conv, x, pad, fmt)
            with torch.inference_mode():
                ref = padded()
                # against the largest sum of the products' magnitudes: float32 rounding of the
                # sum bounds it by the products per output times eps
                size = F.conv2d(F.pad(x.abs(), pad), conv.weight.detach().abs(), None,
                                conv.stride, 0, 1, conv.groups).max()
                diff = ((widened() - ref).abs().max() / size).item()
                a, b = median_ms(padded, repeats), median_ms(widened, repeats)
                copy = median_ms(lambda: F.pad(x, pad), repeats)  # noqa: B023 (called here)
            rows.append({"conv": shown or name, "format": label, "input": [batch, *shape[1:]],
                         "padding": list(pad), "depthwise": conv.groups == conv.in_channels,
                         "padded_ms": a, "pad_alone_ms": copy, "widened_ms": b,
                         "relative_difference": diff})
            print(f"{shown or name:27s} {label:13s} {tuple(x.shape)} pad {pad} "
                  f"{'depthwise' if rows[-1]['depthwise'] else 'dense':9s}: padded {a:7.2f} ms "
                  f"(the pad alone {copy:6.2f}), widened {b:7.2f} ms ({b / a:.2f}), "
                  f"differ by {diff:.1e}")
    return rows


class DenseReference(nn.Module):
    """A dense stride-2 3 x 3 convolution with "same" padding ``(0, 1, 0, 1)`` (a ResNet-like
    downsampling step): what the widening would cost where the products, not the copy,
    dominate."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(cin, cout, 3, stride=2)
        self.conv.static_padding = nn.ZeroPad2d((0, 1, 0, 1))


DENSE = {"dense 64->128": (64, 128, 56), "dense 256->256": (256, 256, 28)}


def dense_references(batch: int, repeats: int) -> List[Dict[str, Any]]:
    """:func:`per_convolution` on the :data:`DENSE` convolutions (random weights)."""
    rows = []
    for name, (cin, cout, side) in DENSE.items():
        ref = DenseReference(cin, cout)
        rows += per_convolution(ref, {"conv": torch.Size([1, cin, side, side])}, batch,
                                repeats, shown=name)
    return rows


def extractors(args: argparse.Namespace, layers: List[str]
               ) -> Dict[bool, Tuple[HookFeatureExtractor, List[str]]]:
    """The feature extractor with the asymmetric paddings kept (False) and widened (True), each
    with the convolutions whose padding was folded."""
    out = {}
    for widen in (False, True):
        model = build_backbone(args.backbone, args.weights, 0).eval()
        probe = torch.zeros(1, 3, args.size, args.size)
        folded = fusion.fold_padding(model, probe, keep=layers, widen=widen)
        out[widen] = (HookFeatureExtractor(model, layers, "cpu",
                                           probe_size=(args.size, args.size),
                                           fold_batchnorm=True, inplace_activations=True,
                                           channels_last=True), folded)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="efficientnet_lite0")
    parser.add_argument("--weights", default="PACKAGED",
                        help="backbone weights (PACKAGED: the [effnet] extra's; none: random)")
    parser.add_argument("--batch", type=int, default=25, help="images a forward pass")
    parser.add_argument("--size", type=int, default=224, help="input side in pixels")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dense", action="store_true",
                        help="also two dense stride-2 convolutions (random weights), padded "
                             "against widened")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    args.weights = None if str(args.weights).lower() == "none" else args.weights
    cfg = load_config(None, [f"backbone.name={args.backbone}"])
    layers = resolve_layer_names(cfg)  # PaDiM's default layers for the backbone
    model = build_backbone(args.backbone, args.weights, 0).eval()
    shapes = asymmetric_inputs(model, args.size)
    if not shapes:
        print(f"{args.backbone}: no convolution pads asymmetrically; nothing to compare")
        return 0
    out: Dict[str, Any] = {"machine": machine(), "backbone": args.backbone, "layers": layers,
                           "convolutions": per_convolution(model, shapes, args.batch,
                                                           args.repeats)}
    if args.dense:
        out["dense"] = dense_references(args.batch, args.repeats)
    exts = extractors(args, layers)
    x = torch.rand(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(1))
    feats = {w: ext(x) for w, (ext, _) in exts.items()}
    diff = max(((feats[True][n] - feats[False][n]).abs().max() / feats[False][n].abs().max())
               .item() for n in layers)
    times: Dict[bool, List[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for widen, (ext, _) in exts.items():  # in turns
            start = time.perf_counter()
            ext(x)
            times[widen].append((time.perf_counter() - start) * 1000)
    kept, wide = (statistics.median(times[w]) for w in (False, True))
    out["extractor"] = {"batch": args.batch, "size": args.size, "kept_ms": kept,
                        "widened_ms": wide, "folded": exts[True][1],
                        "relative_difference": diff}
    print(f"features of {args.batch} images at {args.size} x {args.size} ({', '.join(layers)}): "
          f"asymmetric paddings kept {kept:.1f} ms, widened {wide:.1f} ms "
          f"({kept / wide:.2f} x as fast), features differ by {diff:.1e} (relative)")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
