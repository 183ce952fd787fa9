"""Drift monitoring through the detector's forward hooks (issue 13), usable without the server.

* :class:`StatisticsCollector` -- fit time: per-image statistics of the good images (input
  brightness / contrast / sharpness / noise, each tapped layer's channel means);
* :class:`DriftReference` -- their reference (mean, spread, principal directions), the
  out-of-sample good scores, and alarm thresholds calibrated by leave-window-out at a stated
  false-alarm probability per window; stored in the model file (float32 tensors + JSON);
* :class:`DriftMonitor` -- serving time: sliding window of the last ``W`` images, drift
  statistics per block, ``status()`` for ``/v1/drift``, ``prometheus()`` gauges.

numpy only (no torch import): works with the torch-free runtime too, on the input and score
blocks when the layer outputs are not available.
"""
from anomaly_hooks.monitor.monitor import DriftMonitor
from anomaly_hooks.monitor.reference import SCORE_BLOCK, Block, DriftReference
from anomaly_hooks.monitor.stats import (INPUT_BLOCK, INPUT_STAT_NAMES, StatisticsCollector,
                                         block_statistics, input_statistics, layer_statistics)

__all__ = ["Block", "DriftMonitor", "DriftReference", "INPUT_BLOCK", "INPUT_STAT_NAMES",
           "SCORE_BLOCK", "StatisticsCollector", "block_statistics", "input_statistics",
           "layer_statistics"]
