"""Which engine serves a model file: by its suffix, ``.onnx`` -> the ONNX engine (no torch),
anything else -> the PyTorch engine. Kept apart from :mod:`.engine` (the interface both engines
implement), so that the interface never imports an implementation."""
from __future__ import annotations

import threading
from typing import Any, Optional, Type

from anomaly_hooks.errors import ModelFileError
from anomaly_hooks.serve.engine import ONNX_SUFFIX, ModelEngine


def engine_class(path: Any) -> Type[ModelEngine]:
    """The engine for a model file, by its suffix: ``.onnx`` -> the ONNX engine (no torch),
    anything else -> the PyTorch engine (a :class:`ModelFileError` saying what to do where
    torch cannot be imported)."""
    if str(path).lower().endswith(ONNX_SUFFIX):
        from anomaly_hooks.serve.engine_onnx import OnnxEngine

        return OnnxEngine
    try:
        from anomaly_hooks.serve.engine_torch import TorchEngine
    except ImportError as exc:  # an edge install: no PyTorch
        raise ModelFileError(
            f"{path}: a PyTorch model file, but PyTorch cannot be imported here ({exc}); "
            "export the model (anomaly-hooks export, where it was fitted) and serve the "
            ".onnx file, or install the full package") from None
    return TorchEngine


def load_engine(path: str, device: Optional[str] = None, warmup: bool = True,
                cancel: Optional[threading.Event] = None) -> ModelEngine:
    """:meth:`ModelEngine.load` of the engine :func:`engine_class` picks for ``path``."""
    return engine_class(path).load(path, device, warmup=warmup, cancel=cancel)
