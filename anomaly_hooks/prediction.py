"""The result of scoring one image (torch-free: the ONNX runtime returns the same type)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Prediction:
    """The result for one image. Scores: higher = more anomalous.

    Attributes:
        score: raw image score (max of the heatmap).
        normalized_score: in (0, 1); the threshold maps to 0.5.
        is_anomalous: ``score > threshold``.
        heatmap: float32 ``[H, W]`` patch-score map in the frame of the input image.
        mask: bool ``[H, W]``, ``heatmap > threshold``.
        threshold: the raw threshold used.
    """

    score: float
    normalized_score: float
    is_anomalous: bool
    heatmap: np.ndarray
    mask: np.ndarray
    threshold: float
