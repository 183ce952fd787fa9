"""Drift monitoring through the detector's forward hooks, usable without the server.

* :class:`StatisticsCollector` -- fit time: per-image statistics of the good images (input
  brightness / contrast / sharpness / noise, each tapped layer's channel means);
* :class:`DriftReference` -- their reference (mean, spread, principal directions), the
  out-of-sample good scores, and alarm thresholds calibrated by leave-window-out at a stated
  false-alarm probability per window; stored in the model file (float32 tensors + JSON);
* :class:`DriftMonitor` -- serving time: sliding window of the last ``W`` images, drift
  statistics per block, ``status()`` for ``/v1/drift``, ``prometheus()`` gauges;
  ``Detector.drift_monitor()`` attaches one to a detector (every predict feeds it through the
  hooks), ``DriftMonitor.from_detector(det)`` makes one to feed yourself;
* ``fitting`` -- the detector's seam (collector at fit, state at save / load);
* ``service`` -- the inspection service's monitor (``anomaly-hooks serve --monitor auto``).

numpy only (no torch import): usable without the detector or the server, e.g. on the input and score
blocks when the layer outputs are not available.
"""
from anomaly_hooks.monitor.monitor import DriftMonitor
from anomaly_hooks.monitor.reference import SCORE_BLOCK, Block, DriftReference
from anomaly_hooks.monitor.stats import (
                                         INPUT_BLOCK,
                                         INPUT_STAT_NAMES,
                                         StatisticsCollector,
                                         block_statistics,
                                         input_statistics,
                                         layer_statistics,
)

__all__ = ["Block", "DriftMonitor", "DriftReference", "INPUT_BLOCK", "INPUT_STAT_NAMES",
           "SCORE_BLOCK", "StatisticsCollector", "block_statistics", "input_statistics",
           "layer_statistics"]
