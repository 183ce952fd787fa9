"""The ``monitor:`` config section (drift reference recorded at fit time); no third-party
import, so the core config can include it without pulling numpy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from anomaly_hooks.choices import check


@dataclass
class MonitorConfig:
    """Drift-monitor reference stored with the model (:mod:`anomaly_hooks.monitor`)."""

    enabled: bool = True  # record the reference of the good images at fit time
    window: int = 16  # images per sliding window (lowered to N/2 for N < 2 window images)
    alpha: float = 0.01  # false-alarm probability of one check (one window of good images)
    components: int = 8  # principal directions of each layer's pca statistic (at most)
    min_shift: float = 1.5  # smallest alarming drift, in good-image spreads (0 = any significant)
    calibration_windows: int = 4000  # leave-window-out windows (>= 20 / alpha)
    max_images: int = 5000  # per-image statistics kept for the reference (reservoir beyond)


def validate_monitor_config(mon: Any) -> None:
    """Range checks of the ``monitor`` section (a :class:`ConfigError` naming the key)."""
    check(2 <= mon.window <= 100_000, "monitor.window", "2 to 100000", mon.window)
    check(0.0 < mon.alpha < 0.5, "monitor.alpha", "0 < alpha < 0.5", mon.alpha)
    check(0 <= mon.components <= 1024, "monitor.components", "0 to 1024", mon.components)
    check(mon.min_shift >= 0, "monitor.min_shift", ">= 0", mon.min_shift)
    check(mon.calibration_windows * mon.alpha >= 20 and mon.calibration_windows <= 1_000_000,
          "monitor.calibration_windows",
          f">= 20 / monitor.alpha = {20 / mon.alpha:.0f} and <= 1000000",
          mon.calibration_windows)
    check(4 <= mon.max_images <= 1_000_000, "monitor.max_images", "4 to 1000000",
          mon.max_images)
