"""anomaly_hooks: visual anomaly detection (PaDiM, PatchCore) on a hook-based feature extractor.

Scores everywhere mean "higher = more anomalous".
"""
import os as _os
import sys as _sys

__version__ = "0.1.0"

# Transparent huge pages for large CPU tensors (PyTorch reads this once, at its first allocation,
# so it only takes effect when anomaly_hooks is imported before torch: the CLIs always are).
# Multi-GB tensors (PaDiM sums and factors, per-batch work buffers) are page-faulted 2 MB at a
# time instead of 4 kB: several times faster where the kernel has THP in "madvise" mode. Set
# THP_MEM_ALLOC_ENABLE=0 to opt out.
if "torch" not in _sys.modules:
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from anomaly_hooks.config import ConfigError, load_config  # noqa: E402
from anomaly_hooks.detector import Detector, FitError, Prediction  # noqa: E402
from anomaly_hooks.extractor import HookFeatureExtractor, LayerInfo, layer_names  # noqa: E402
from anomaly_hooks.images import ImageReadError, read_image  # noqa: E402
from anomaly_hooks.modelfile import ModelFileError  # noqa: E402
from anomaly_hooks.scorers import NotFittedError  # noqa: E402

__all__ = ["ConfigError", "Detector", "FitError", "HookFeatureExtractor", "ImageReadError",
           "LayerInfo", "ModelFileError", "NotFittedError", "Prediction", "layer_names",
           "load_config", "read_image", "__version__"]
