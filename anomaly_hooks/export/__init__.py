"""ONNX export of a fitted Detector's whole predict path (issue 14); needs the ``[export]``
extra (onnx, onnxruntime for the verification).

    from anomaly_hooks.export import export_onnx
    export_onnx(Detector.load("m.safetensors", device="cpu"), "m.onnx")

The exported file runs without PyTorch in :mod:`anomaly_hooks.runtime`.
"""
from anomaly_hooks.errors import ExportError
from anomaly_hooks.export.onnx import export_onnx, source_checksum, verify_export

__all__ = ["ExportError", "export_onnx", "source_checksum", "verify_export"]
