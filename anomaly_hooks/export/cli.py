"""``anomaly-hooks export --model m.safetensors [--format onnx] [--out m.onnx]
[--int8 [--calib DIR]]``."""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any, List


def add_parser(sub: Any) -> None:
    """The ``export`` sub-command's arguments."""
    p = sub.add_parser("export", help="export a fitted model to ONNX (predict without PyTorch)")
    p.add_argument("--model", required=True, help="model file written by fit (.safetensors)")
    p.add_argument("--format", default="onnx", choices=["onnx"])
    p.add_argument("--out", "--output", dest="output",
                   help="output path (default: the model's, with .onnx)")
    p.add_argument("--int8", action="store_true",
                   help="quantise the backbone to int8 (static, per channel), calibrated on "
                        "good images (--calib, default: the model's training folder)")
    p.add_argument("--calib", help="folder of good images for the int8 calibration (an MVTec "
                   "root uses train/good); every third image is kept aside for the drift check")
    p.add_argument("--tolerance", type=float, default=None,
                   help="int8: largest allowed good-image score drift, in threshold scales "
                        "(default 0.5)")
    p.add_argument("--calibration", default="minmax", choices=["minmax", "entropy", "percentile"])
    p.add_argument("--exporter", default="torchscript", choices=["torchscript", "dynamo"])
    p.add_argument("--search", default=None, choices=["auto", "projected", "brute"],
                   help="PatchCore: the exact k-NN search in the graph (default auto)")
    p.add_argument("--opset", type=int, default=None)


def _calibration_images(args: argparse.Namespace, det: Any) -> List[Any]:
    from anomaly_hooks.data import resolve_items
    from anomaly_hooks.errors import DataError

    source = args.calib or det.cfg.data.train
    if not source:
        raise DataError("--int8 needs good images to calibrate on: --calib DIR (the model "
                        "does not name its training folder)")
    images = resolve_items(Path(source), training=True)
    if len(images) < 6:
        raise DataError(f"{source}: {len(images)} image(s); the int8 calibration needs at "
                        "least 6 good images")
    return images


def cmd_export(args: argparse.Namespace) -> int:
    """Export (and optionally quantise); prints the output path (and the int8 report)."""
    try:
        from anomaly_hooks.detector import Detector
        from anomaly_hooks.export.onnx import DEFAULT_OPSET, export_onnx, source_checksum
    except ImportError as exc:  # an edge box with the runtime only
        from anomaly_hooks.errors import ExportError

        raise ExportError(f"export needs PyTorch and onnx ({exc}): run it where the model was "
                          "fitted, with pip install 'anomaly_hooks[export]'") from None

    out = Path(args.output) if args.output else Path(args.model).with_suffix(".onnx")
    det = Detector.load(args.model, device="cpu")
    options = {} if args.search is None else {"search": args.search}
    kw = dict(exporter=args.exporter, opset=args.opset or DEFAULT_OPSET,
              checksum=source_checksum(args.model), **options)
    if not args.int8:
        print(export_onnx(det, out, **kw))
        return 0
    from anomaly_hooks.export.quantize import DEFAULT_TOLERANCE, quantize_backbone

    images = _calibration_images(args, det)
    check = images[2::3]
    calib = [p for i, p in enumerate(images) if i % 3 != 2]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".fp32-") as tmp:
        fp32 = export_onnx(det, Path(tmp) / out.name, **kw)
        del det
        tol = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
        report = quantize_backbone(fp32, out, calib, check_images=check, tolerance=tol,
                                   calibration=args.calibration)
    print(json.dumps(report))
    print(out)
    return 0
