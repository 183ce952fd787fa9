"""anomaly_hooks: visual anomaly detection (PaDiM, PatchCore) on a hook-based feature extractor.

Scores everywhere mean "higher = more anomalous". The names below are imported on first use
(PEP 562), so ``import anomaly_hooks`` is cheap, imports no torch and changes nothing in the
process (the torch-free ``anomaly_hooks.runtime`` relies on that).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_EXPORTS = {
    "AnomalyHooksError": "anomaly_hooks.errors",
    "ConfigError": "anomaly_hooks.errors",
    "DataError": "anomaly_hooks.errors",
    "FitError": "anomaly_hooks.errors",
    "ImageReadError": "anomaly_hooks.errors",
    "ImageTooLargeError": "anomaly_hooks.errors",
    "ModelFileChangedError": "anomaly_hooks.errors",
    "ModelFileError": "anomaly_hooks.errors",
    "NotFittedError": "anomaly_hooks.errors",
    "Prediction": "anomaly_hooks.prediction",
    "Detector": "anomaly_hooks.detector",
    "load_config": "anomaly_hooks.config",
    "HookFeatureExtractor": "anomaly_hooks.extractor",
    "LayerInfo": "anomaly_hooks.extractor",
    "describe_layers": "anomaly_hooks.extractor",
    "layer_names": "anomaly_hooks.extractor",
    "read_image": "anomaly_hooks.images",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'anomaly_hooks' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_EXPORTS))
