"""Int8 for the CPU: static QDQ quantisation of the *backbone part* of an exported model.

Only the backbone's nodes (the TorchScript exporter names them ``/backbone/...`` after the
module scope; the dynamo exporter keeps the scope in the node metadata) are quantised, per
channel, with ONNX Runtime's ``quantize_static``, calibrated on good images. The embedding, the
scorer's distances (PaDiM's Gaussians, PatchCore's bank and search), the heatmap's blur and the
image score stay float32: they hold the model's fitted statistics, and rounding them would move
every score.

The result is checked before it is written: the image scores of held-out good images must
stay within ``tolerance`` of the float32 model's, in units of the threshold's scale (the good
scores' standard deviation), and no good image may change verdict; otherwise
:class:`QuantizationRefused` is raised and nothing is written. The threshold is the float32
model's; the metadata key ``int8`` records the calibration and the drift measured. The int8 file
carries the checksum of its own content (the float32 model's is dropped with its bytes).

The int8 file has no drift monitor: its quantised backbone's layer means sit one or two
good-image spreads away from the float32 ones the drift reference was fitted on (measured on
ResNet18), so every window would alarm; the layer-mean outputs and the reference are dropped,
and its service says to serve the float32 export where drift must be watched.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from anomaly_hooks.errors import ExportError
from anomaly_hooks.runtime.metadata import DRIFT_KEY, KEYS, LAYER_MEANS_PREFIX
from anomaly_hooks.runtime.onnxfile import EXTERNAL_KEY, seal

DEFAULT_TOLERANCE = 0.5  # max |score_int8 - score_fp32| / threshold.scale over good images
CALIBRATIONS = ("minmax", "entropy", "percentile")


class QuantizationRefused(ExportError):
    """The int8 model's good-image scores drift beyond the tolerance from float32."""


def _in_backbone(node: Any) -> bool:
    if node.name.startswith("/backbone/"):  # TorchScript exporter: the module scope
        return True
    for prop in node.metadata_props:  # dynamo exporter: the module stack in the metadata
        if prop.key == "pkg.torch.onnx.name_scopes":
            scopes = prop.value.strip("[]").replace("'", "").split(", ")
            return len(scopes) > 1 and scopes[1] == "backbone"
    return False


def backbone_nodes(model: Any) -> List[str]:
    """Names of the nodes of the backbone part (module scope ``backbone``)."""
    names = [n.name for n in model.graph.node if _in_backbone(n)]
    if not names:
        raise ExportError("no backbone nodes found in this graph (module scopes missing): "
                          "export it again with anomaly-hooks export")
    return names


class _Reader:
    """``CalibrationDataReader``: normalised batches ``[b, 3, h, w]`` of calibration images."""

    def __init__(self, batches: List[np.ndarray], name: str) -> None:
        self._it = iter([{name: b} for b in batches])

    def get_next(self) -> Optional[Dict[str, np.ndarray]]:
        return next(self._it, None)


def quantize_backbone(fp32_path: Union[str, os.PathLike], out_path: Union[str, os.PathLike],
                      calib_images: Sequence[Any], *,
                      check_images: Optional[Sequence[Any]] = None,
                      tolerance: float = DEFAULT_TOLERANCE, calibration: str = "minmax",
                      batch: int = 4, refuse: bool = True) -> Dict[str, Any]:
    """Write an int8 (QDQ) copy of ``fp32_path`` with the backbone quantised; returns a report
    (drift on the check images, nodes quantised, ``accepted``).

    Args:
        calib_images: good images (any input ``predict`` accepts).
        check_images: good images for the drift check (default: the calibration images;
            held-out ones are the honest choice).
        refuse: False writes the model even beyond the tolerance (for measurements).

    Raises:
        QuantizationRefused: the drift exceeds ``tolerance`` or a good image changes verdict.
    """
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    from anomaly_hooks.runtime.detector import OnnxDetector

    if calibration not in CALIBRATIONS:
        raise ExportError(f"calibration={calibration!r}: one of {', '.join(CALIBRATIONS)}")
    fp32_path, out_path = Path(fp32_path), Path(out_path)
    ref = OnnxDetector.load(fp32_path)
    if ref.meta.get("int8"):
        raise ExportError(f"{fp32_path} is already quantised")
    if ref.tiling is not None:
        raise ExportError(f"{fp32_path} is a tiled (high-resolution) model: its int8 "
                          "quantisation is not available; use the float32 export")
    arrays = ref.prepare(list(calib_images))[0]
    calib = [arrays[i:i + batch] for i in range(0, len(arrays), batch)]
    checks = list(check_images) if check_images is not None else list(calib_images)
    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
               "percentile": CalibrationMethod.Percentile}
    with tempfile.TemporaryDirectory(dir=out_path.parent, prefix=".int8-") as tmpdir:
        q = Path(tmpdir) / out_path.name
        pre = _pre_process(fp32_path, Path(tmpdir) / "pre.onnx")
        nodes = backbone_nodes(onnx.load(str(pre), load_external_data=False))
        quantize_static(
            str(pre), str(q), _Reader(calib, ref.input_name),
            quant_format=QuantFormat.QDQ, per_channel=True, activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8, nodes_to_quantize=nodes,
            calibrate_method=methods[calibration],
            use_external_data_format=fp32_path.with_name(fp32_path.name + ".data").exists(),
            extra_options={"ActivationSymmetric": False, "CalibMovingAverage": False})
        # the float32 model's checksum does not fit these bytes; nor does its drift reference
        _rewrite_metadata(q, {DRIFT_KEY: ""}, drop_layer_means=True)
        s32 = ref.decision_function(checks)
        s8 = OnnxDetector.load(q).decision_function(checks)
        report = drift_report(s32, s8, ref.threshold_, tolerance)
        report.update({"calib_images": len(calib_images), "calibration": calibration,
                       "nodes_quantized": len(nodes)})
        if not report["accepted"] and refuse:
            raise QuantizationRefused(
                f"int8 scores of {len(checks)} good images drift up to "
                f"{report['max_drift']:.3g} threshold scales from float32 (tolerance "
                f"{tolerance:g}), {report['verdict_flips']} verdict change(s): not written. "
                "Calibrate on more / more typical good images, try --calibration percentile, "
                "accept a larger drift (--tolerance), or keep the float32 model.")
        side = _rewrite_metadata(q, {"int8": json.dumps(report)})
        from anomaly_hooks.export.onnx import publish  # (torch: imported when needed)

        publish(q, side, out_path)
    return report


def _pre_process(src: Path, dst: Path) -> Path:
    """ONNX Runtime's recommended step before quantisation (shape inference, constant folding:
    the convolution biases become initialisers); the source itself where it fails."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        quant_pre_process(str(src), str(dst), skip_symbolic_shape=True)
        return dst
    except Exception:  # noqa: BLE001 (an optional optimisation: the quantisation works without it)
        return src


def drift_report(s32: np.ndarray, s8: np.ndarray, threshold: Any,
                 tolerance: float) -> Dict[str, Any]:
    """How far int8 scores ``s8`` of good images are from the float32 ones ``s32``."""
    drift = np.abs(s8 - s32) / threshold.scale
    flips = int(np.sum((s8 > threshold.value) != (s32 > threshold.value)))
    return {"check_images": int(len(s32)), "tolerance": tolerance,
            "max_drift": float(drift.max()), "mean_drift": float(drift.mean()),
            "mean_signed_drift": float(np.mean((s8 - s32) / threshold.scale)),
            "max_rel_drift": float(np.max(np.abs(s8 - s32) / np.abs(s32))),
            "verdict_flips": flips,
            "accepted": bool(drift.max() <= tolerance and not flips)}


def _rewrite_metadata(path: Path, values: Dict[str, str], drop_layer_means: bool = False
                      ) -> Optional[Path]:
    """Update metadata entries of the model at ``path`` (its side file of weights, written by
    the quantiser as ``<name>.data``, stays as it is) and seal it again; the entries ONNX
    Runtime's tools add (``onnx.infer``, ``onnx.quant.pre_process``) are dropped: an export
    holds the format's entries only. ``drop_layer_means``: remove the graph's
    ``layer_means/*`` outputs (their nodes, then unused, are skipped by the engines). Returns
    the side file, if any."""
    import onnx

    from anomaly_hooks.export.onnx import save_sealed, set_metadata

    model = onnx.load(str(path), load_external_data=False)
    if drop_layer_means:
        kept_outputs = [o for o in model.graph.output
                        if not o.name.startswith(LAYER_MEANS_PREFIX)]
        del model.graph.output[:]
        model.graph.output.extend(kept_outputs)
    kept = {p.key: p.value for p in model.metadata_props if p.key in KEYS}
    set_metadata(model, {**kept, **values})
    side = path.with_name(path.name + ".data")
    if not side.exists():
        return save_sealed(model, path, external=False)
    set_metadata(model, {**{p.key: p.value for p in model.metadata_props},
                         EXTERNAL_KEY: side.name})
    onnx.save_model(model, str(path))  # the tensors keep pointing into the side file
    seal(path)
    return side
