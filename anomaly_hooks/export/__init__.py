"""ONNX export of a fitted Detector's whole predict path; needs torch and the
``[export]`` extra (onnx; onnxruntime for the verification).

    from anomaly_hooks.export import export_onnx
    export_onnx(Detector.load("m.safetensors", device="cpu"), "m.onnx")

The exported file runs without PyTorch in :mod:`anomaly_hooks.runtime`. The names are loaded
lazily, so that the CLI can list the ``export`` command on a box without torch.
"""
from __future__ import annotations

import importlib
from typing import Any

from anomaly_hooks.errors import ExportError

_LAZY = {"export_onnx": "anomaly_hooks.export.onnx", "source_checksum": "anomaly_hooks.export.onnx",
         "verify_export": "anomaly_hooks.export.onnx"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'anomaly_hooks.export' has no attribute {name!r}")


__all__ = ["ExportError", "export_onnx", "source_checksum", "verify_export"]
