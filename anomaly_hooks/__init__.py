"""anomaly_hooks: visual anomaly detection (PaDiM, PatchCore) on a hook-based feature extractor.

Scores everywhere mean "higher = more anomalous".
"""
__version__ = "0.1.0"

from anomaly_hooks.config import ConfigError, load_config  # noqa: E402
from anomaly_hooks.detector import Detector, FitError, Prediction  # noqa: E402
from anomaly_hooks.extractor import HookFeatureExtractor, LayerInfo, layer_names  # noqa: E402
from anomaly_hooks.images import ImageReadError, read_image  # noqa: E402
from anomaly_hooks.modelfile import ModelFileError  # noqa: E402
from anomaly_hooks.scorers import NotFittedError  # noqa: E402

__all__ = ["ConfigError", "Detector", "FitError", "HookFeatureExtractor", "ImageReadError",
           "LayerInfo", "ModelFileError", "NotFittedError", "Prediction", "layer_names",
           "load_config", "read_image", "__version__"]
