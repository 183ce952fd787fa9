"""Torch-free runtime for exported models: numpy, Pillow and ONNX Runtime only
(the ``[runtime]`` extra).

    from anomaly_hooks.runtime import OnnxDetector
    det = OnnxDetector.load("m.onnx")
    pred = det.predict("part.png")   # the same Prediction as Detector.predict

Images are decoded by the torch-free :func:`anomaly_hooks.images.decode_reduced` (the same
decoder as the eager path) and preprocessed by :class:`NumpyPreprocessor`, the numpy twin of
:class:`anomaly_hooks.preprocess.Preprocessor`. :func:`read_exported` verifies a file (checksum
and metadata) without running it: ``OnnxDetector.load`` calls it before the first image, and a
service can call it before loading or reloading a model.
"""
from anomaly_hooks.errors import ImageReadError, ModelFileError
from anomaly_hooks.modelmeta import MetadataError
from anomaly_hooks.prediction import Prediction
from anomaly_hooks.runtime.detector import OnnxDetector
from anomaly_hooks.runtime.metadata import ExportedModel, check_graph, read_exported
from anomaly_hooks.runtime.preprocess import NumpyPreprocessor

__all__ = ["ExportedModel", "ImageReadError", "MetadataError", "ModelFileError",
           "NumpyPreprocessor", "OnnxDetector", "Prediction", "check_graph", "read_exported"]
