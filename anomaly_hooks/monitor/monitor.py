"""The sliding-window drift monitor (numpy only; thread-safe).

Feed it what the detector already computes -- ``add_batch(features, images, scores)`` with the
tapped layers' outputs, the preprocessed input batch and the image scores -- or precomputed
per-image statistics with :meth:`DriftMonitor.update`. After every image, once ``window`` images
have been seen, each statistic of the last ``window`` images is compared with its calibrated
threshold; the alarm is on while any statistic is above its threshold.

Example::

    mon = detector.drift_monitor()   # attached: every predict() feeds it through the hooks
    detector.predict(images)
    mon.status()["alarm"], mon.status()["alarming"]
    print(mon.summary())

    mon = DriftMonitor.from_detector(detector)   # not attached: feed it yourself
    mon.add_batch(features, images, scores)
"""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, Mapping, Optional, Sequence

import numpy as np

from anomaly_hooks.errors import DataError, NotFittedError
from anomaly_hooks.monitor.fitting import NO_REFERENCE
from anomaly_hooks.monitor.reference import SCORE_BLOCK, DriftReference
from anomaly_hooks.monitor.stats import INPUT_BLOCK, block_statistics


class DriftMonitor:
    """Sliding-window drift statistics against a fitted :class:`DriftReference`.

    Args:
        reference: from the model file (``Detector.drift_reference_``).
        mean, std: the preprocessing's normalisation (to read brightness back from the
            network input); needed by :meth:`observe` for the input statistics.
        window: images per window; default: the calibrated one (another size voids the
            calibration: the thresholds are for the calibrated window).
    """

    @classmethod
    def from_detector(cls, detector: Any) -> "DriftMonitor":
        """A monitor of a fitted (or loaded) ``Detector``'s reference, not attached to it
        (:meth:`Detector.drift_monitor` attaches one). Raises :class:`NotFittedError` when the
        model has no drift reference."""
        reference = detector.drift_reference_
        if reference is None:
            raise NotFittedError(NO_REFERENCE)
        pre = detector.preprocessor
        return cls(reference, mean=pre.mean, std=pre.std)

    def __init__(self, reference: DriftReference, *, mean: Sequence[float] = (0.0, 0.0, 0.0),
                 std: Sequence[float] = (1.0, 1.0, 1.0), window: Optional[int] = None) -> None:
        self.reference = reference
        self.window = int(window or reference.window)
        self.mean, self.std = tuple(mean), tuple(std)
        self._lock = threading.Lock()
        # the last (up to) `window` per-image vectors of each block, oldest first
        self._recent = {name: np.zeros((0, b.dim)) for name, b in reference.blocks.items()}
        self._filled = {name: 0 for name in reference.blocks}  # images in each block's window
        self._n_seen = 0
        self._non_finite = 0  # images left out of the window for a non-finite statistic
        self._values: Dict[str, float] = {}
        self._alarm = False
        self._episodes = 0
        self._alarm_images = 0
        self._first_alarm: Optional[int] = None
        self._last_alarm: Optional[int] = None
        self._alarm_since: Optional[float] = None
        self._peaks: Dict[str, float] = {}

    # -- feeding ---------------------------------------------------------------------------
    def statistics(self, features: Optional[Mapping[str, Any]], images: Any,
                   boxes: Any = None, frame: Any = None) -> Dict[str, Any]:
        """Per-image block statistics of a batch (``features`` ``{layer: [B, C, h, w]}`` or
        None, ``images`` the normalised network input ``[B, 3, h, w]`` or None): a few
        floats per channel, so the layer outputs can be freed before :meth:`update`.
        ``boxes``: ``[B, 2]`` each image's own part of a tiled model's frame (``frame`` (H,
        W), default the images' size), the padding around it not read; None: all of it."""
        return block_statistics(features, images, self.mean, self.std,
                                blocks=self.reference.blocks, boxes=boxes, frame=frame)

    def batch(self) -> "PendingBatch":
        """A callable ``(features, images, boxes)`` for the detector's forward pass that keeps
        the batch's statistics (so the layer outputs can be freed) until ``finish(scores)``
        adds them with the image scores. One per batch: concurrent predicts do not mix."""
        return PendingBatch(self)

    def add_batch(self, features: Optional[Mapping[str, Any]], images: Any,
                  scores: Optional[Any] = None, boxes: Any = None) -> None:
        """One batch as the detector sees it: :meth:`statistics` then :meth:`update`.
        Tensors or arrays; e.g. from a runtime without layer outputs, ``features=None``."""
        self.update(self.statistics(features, images, boxes), scores)

    def update(self, vectors: Mapping[str, Any], scores: Optional[Any] = None) -> None:
        """Add ``B`` images: per-image statistics ``{block: [B, d]}`` and (optionally) their
        image scores ``[B]``. Blocks the reference does not know are ignored; a block left out
        is simply not checked. An image with a non-finite statistic (a NaN or infinite layer
        output, score or pixel) is counted (``non_finite_images`` in :meth:`status`) and kept
        out of the window: one such value would otherwise stay in every window sum after it.
        Thread-safe: images are added in the order the calls take the lock."""
        if scores is not None:
            vectors = {**vectors, SCORE_BLOCK: np.asarray(_np(scores), np.float64).reshape(-1, 1)}
        known = {k: np.asarray(_np(v), np.float64) for k, v in vectors.items()
                 if k in self.reference.blocks}
        if not known:
            return
        sizes = {v.shape[0] for v in known.values()}
        if len(sizes) != 1:
            raise DataError(f"blocks of one update hold different numbers of images: {sizes}")
        (n,) = sizes
        for name, v in known.items():
            d = self.reference.blocks[name].dim
            if v.ndim != 2 or v.shape[1] != d:
                raise DataError(f"drift block {name!r}: expected [B, {d}], got {v.shape}")
            known[name] = self.reference.blocks[name].prepare(v)
        finite = np.logical_and.reduce([np.isfinite(v).all(axis=1) for v in known.values()])
        n_bad = int(n - finite.sum())
        if n_bad:
            known = {name: v[finite] for name, v in known.items()}
            n -= n_bad
        w = self.window
        with self._lock:
            self._non_finite += n_bad
            if n == 0:
                return
            # every statistic after each of the n new images (NaN while a window is not full),
            # vectorised: window sums from cumulative sums over [recent, new]
            per_image: Dict[str, np.ndarray] = {}
            for name, v in known.items():
                hist = np.concatenate([self._recent[name], v])
                m = hist.shape[0] - n
                ends = np.arange(m + 1, m + n + 1)
                full = ends >= w
                if full.any():
                    cs = np.concatenate([np.zeros((1, hist.shape[1])), np.cumsum(hist, 0)])
                    e = ends[full]
                    means = (cs[e] - cs[e - w]) / w
                    for stat, vals in self.reference.blocks[name].stats_of_means(
                            means, w).items():
                        col = np.full(n, np.nan)
                        col[full] = vals
                        per_image[stat] = col
                self._recent[name] = hist[-w:]
                self._filled[name] = min(self._filled[name] + n, w)
            thr = self.reference.thresholds
            for i in range(n):
                self._n_seen += 1
                for stat, col in per_image.items():
                    if not np.isnan(col[i]):
                        self._values[stat] = float(col[i])
                        self._peaks[stat] = max(self._peaks.get(stat, -np.inf), float(col[i]))
                if per_image:
                    self._set_alarm(any(v > thr[st] for st, v in self._values.items()))

    def _set_alarm(self, alarm: bool) -> None:
        """Book-keeping after one image (lock held)."""
        if alarm:
            self._alarm_images += 1
            self._last_alarm = self._n_seen
            if self._first_alarm is None:
                self._first_alarm = self._n_seen
            if not self._alarm:
                self._episodes += 1
                self._alarm_since = time.time()
        else:
            self._alarm_since = None
        self._alarm = alarm

    def reset(self) -> None:
        """Forget every image seen (e.g. after the operator acknowledged a change)."""
        self.__init__(self.reference, mean=self.mean, std=self.std, window=self.window)

    # -- reading ---------------------------------------------------------------------------
    @property
    def alarm(self) -> bool:
        with self._lock:
            return self._alarm

    def status(self) -> Dict[str, Any]:
        """A JSON-able summary (for ``/v1/drift``, the page, ``score``'s summary):

        ``alarm`` (now), ``alarming`` (statistics above threshold now, worst first),
        ``non_finite_images`` (images left out of the window for a NaN or infinite statistic),
        ``statistics`` (per statistic: ``value``, ``threshold``, ``ratio`` = value /
        threshold, ``shift`` = the window's drift in good-image spreads, ``peak``; None
        until the window is full), ``images_seen``,
        ``window_filled``, ``alarm_episodes``, ``alarm_images`` (checks in alarm),
        ``first_alarm_image`` / ``last_alarm_image`` (1-based image counts),
        ``alarm_since`` (epoch seconds), and the calibration (``window``, ``alpha``).
        """
        ref = self.reference
        with self._lock:
            stats: Dict[str, Any] = {}
            for s in ref.stat_names:
                thr = ref.thresholds[s]
                v = self._values.get(s)
                stats[s] = {"value": v, "threshold": thr,
                            # a threshold of 0 has no ratio (never infinity: JSON has none)
                            "ratio": None if v is None or thr <= 0 else v / thr,
                            "shift": None if v is None else ref.effect(s, v),
                            "peak": self._peaks.get(s)}
            alarming = sorted((s for s, d in stats.items()
                               if d["value"] is not None and d["value"] > d["threshold"]),
                              key=lambda s: -(stats[s]["ratio"] or np.inf))
            return {"alarm": self._alarm, "alarming": alarming,
                    "images_seen": self._n_seen,
                    "non_finite_images": self._non_finite,
                    "window": self.window,
                    "window_filled": min(self._filled.values()) if self._filled else 0,
                    "alpha": ref.alpha, "min_shift": ref.info.get("min_shift", 0.0),
                    "alarm_episodes": self._episodes, "alarm_images": self._alarm_images,
                    "first_alarm_image": self._first_alarm,
                    "last_alarm_image": self._last_alarm,
                    "alarm_since": self._alarm_since,
                    "statistics": stats,
                    "blocks_observed": sorted(n for n, f in self._filled.items() if f)}

    def summary(self, status: Optional[Dict[str, Any]] = None) -> str:
        """One line for a command-line summary (``score`` over a folder); ``status``: a
        :meth:`status` just taken (else it is taken here)."""
        st = self.status() if status is None else status
        left_out = st.get("non_finite_images", 0)
        return self._summary_line(st) + (f"; {left_out} image(s) with a non-finite statistic "
                                         "left out" if left_out else "")

    @staticmethod
    def _summary_line(st: Dict[str, Any]) -> str:
        if st["images_seen"] < st["window"]:
            return (f"drift: not checked ({st['images_seen']} image(s); a window is "
                    f"{st['window']})")
        peaks = sorted(((d["peak"] / d["threshold"], s) for s, d in st["statistics"].items()
                        if d["peak"] is not None and d["threshold"] > 0), reverse=True)
        head = (f"drift (windows of {st['window']} images, false-alarm probability "
                f"{st['alpha']:g} per window, alarm from {st['min_shift']:g} spreads)")
        if st["alarm_episodes"] == 0:
            top = f"; closest: {peaks[0][1]} at {peaks[0][0]:.2f} x threshold" if peaks else ""
            return f"{head}: no alarm{top}"
        fired = ", ".join(f"{s} (peak {r:.1f} x)" for r, s in peaks if r > 1)
        note = (" -- score:shift also rises with a run of defective images"
                if any(s.startswith("score") for r, s in peaks if r > 1) else "")
        return (f"{head}: ALARM {st['alarm_episodes']} time(s), first at image "
                f"{st['first_alarm_image']}, {st['alarm_images']} of "
                f"{st['images_seen'] - st['window'] + 1} windows in alarm; fired: {fired}; now "
                f"{'in alarm' if st['alarm'] else 'clear'}{note}")

    def prometheus(self, prefix: str = "anomaly_hooks_drift") -> str:
        """Prometheus text-format gauges: ``<prefix>_alarm``, ``<prefix>_statistic{stat=}``,
        ``<prefix>_threshold{stat=}``, ``<prefix>_ratio{stat=}``, ``<prefix>_shift{stat=}``
        (drift in good-image spreads), counters of images and alarm episodes."""
        st = self.status()
        lines = [f"# TYPE {prefix}_alarm gauge", f"{prefix}_alarm {int(st['alarm'])}",
                 f"# TYPE {prefix}_images_total counter",
                 f"{prefix}_images_total {st['images_seen']}",
                 f"# TYPE {prefix}_non_finite_images_total counter",
                 f"{prefix}_non_finite_images_total {st['non_finite_images']}",
                 f"# TYPE {prefix}_alarm_episodes_total counter",
                 f"{prefix}_alarm_episodes_total {st['alarm_episodes']}"]
        for metric in ("value", "threshold", "ratio", "shift"):
            name = f"{prefix}_{'statistic' if metric == 'value' else metric}"
            lines.append(f"# TYPE {name} gauge")
            for s, d in st["statistics"].items():
                if d[metric] is not None:
                    lines.append(f'{name}{{stat="{s}"}} {d[metric]:.6g}')
        return "\n".join(lines) + "\n"


class PendingBatch:
    """One batch on its way through the detector (see :meth:`DriftMonitor.batch`)."""

    def __init__(self, monitor: DriftMonitor) -> None:
        self.monitor = monitor
        self.vectors: Dict[str, np.ndarray] = {}

    def __call__(self, features: Mapping[str, Any], images: Any, boxes: Any = None) -> None:
        self.vectors = self.monitor.statistics(features, images, boxes)

    def finish(self, scores: Any) -> None:
        """Add the batch (statistics and its image scores ``[B]``) to the window."""
        self.monitor.update(self.vectors, scores)


def _np(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x)


__all__ = ["DriftMonitor", "INPUT_BLOCK", "SCORE_BLOCK"]
