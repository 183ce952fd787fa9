"""Every error anomaly_hooks raises on purpose derives from :class:`AnomalyHooksError`.

Catch that one class to handle any problem of the input (config, images, model files, a fit
that cannot proceed); anything else that escapes is a bug. The subclasses that were
``ValueError`` before stay ``ValueError`` too, so existing ``except ValueError`` code still works.
No third-party import here: the torch-free runtime shares these classes.
"""
from __future__ import annotations


class AnomalyHooksError(Exception):
    """Base class of every error anomaly_hooks raises about its input; the message says what
    was wrong and how to fix it."""


class ConfigError(AnomalyHooksError, ValueError):
    """A configuration value is missing, unknown or not allowed (the message names the key)."""


class BackboneError(AnomalyHooksError, ValueError):
    """The backbone or its weights could not be built or loaded."""


class DataError(AnomalyHooksError, ValueError):
    """A source of images is empty, missing, or holds unreadable images."""


class ImageReadError(AnomalyHooksError, ValueError):
    """An image could not be read; the message names the file (or input) and the reason."""


class ImageTooLargeError(ImageReadError):
    """An image has more pixels than allowed (the decompression-bomb guard): an image the
    reader refuses by its size, not by damage (a service answers 413 rather than 400)."""


class ModelFileError(AnomalyHooksError, ValueError):
    """A model file is missing, damaged, of another format/version, or not what was expected."""


class ModelFileChangedError(ModelFileError):
    """A loaded model reads part of its state from its model file on demand (e.g. a dense
    PaDiM's kept training embeddings), and that file was replaced, changed or removed since:
    load the model again."""


class FitError(AnomalyHooksError, ValueError):
    """Fitting could not proceed (bad images, too few images); the message says what to do."""


class ThresholdError(AnomalyHooksError, ValueError):
    """No usable operating point: the labelled defects do not separate from the good images,
    or the asked recall or rate cannot be reached (the message says what was found)."""


class ResourceError(AnomalyHooksError, ValueError):
    """The fit would need more memory than allowed (the message gives the estimate)."""


class ExportError(AnomalyHooksError, ValueError):
    """A model cannot be exported (an operator or layer without an ONNX translation), or the
    exported graph does not reproduce the eager model; nothing was written."""


class NotFittedError(AnomalyHooksError, ValueError, AttributeError):
    """A model was used before ``fit`` (like scikit-learn's: a ValueError and an AttributeError)."""


__all__ = ["AnomalyHooksError", "BackboneError", "ConfigError", "DataError", "ExportError",
           "FitError", "ImageReadError", "ImageTooLargeError", "ModelFileChangedError",
           "ModelFileError", "NotFittedError", "ResourceError", "ThresholdError"]
