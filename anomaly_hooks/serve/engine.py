"""One loaded model as the service uses it: the Detector plus its file checksum and identity,
split into the three steps the request path runs in different places:

* :meth:`Engine.prepare` (decode pool): canonical image -> network input ``[3, h, w]``;
* :meth:`Engine.infer` (the model thread): a stacked batch -> image scores and heatmaps;
* :meth:`Engine.finish` (decode pool): one image's score and map -> verdict, anomalous-pixel
  count at full resolution, overlay / mask / thumbnail pictures.

Together they compute exactly what ``Detector.predict`` computes (tested), but the batch is
formed from concurrent requests. This module is the one place of the service that uses the
Detector's public stages (``preprocessor``, ``infer``, ``threshold_``); when the library changes,
only this file needs to follow.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from anomaly_hooks.prediction import Verdict
from anomaly_hooks.serve import pictures
from anomaly_hooks.serve.errors import ServeError
from anomaly_hooks.serve.modelpaths import check_model_extent, check_model_file
from anomaly_hooks.serve.results import iso_time
from anomaly_hooks.serve.uploads import decode_upload

log = logging.getLogger("anomaly_hooks.serve")


def file_sha256(path: Path, chunk: int = 4 << 20, cancel: Optional[threading.Event] = None
                ) -> str:
    """The file's SHA-256; stops (:func:`load_cancelled`) within a chunk of ``cancel`` being
    set."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            _check_cancel(cancel)
            block = fh.read(chunk)
            if not block:
                break
            digest.update(block)
    return digest.hexdigest()


def load_cancelled() -> ServeError:
    """The error of a model load stopped because the server is shutting down."""
    return ServeError(503, "shutting_down", "the server is shutting down: the model load was "
                      "stopped")


def _check_cancel(cancel: Optional[threading.Event]) -> None:
    if cancel is not None and cancel.is_set():
        raise load_cancelled()


def _signature(path: Path) -> Tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class PreparedImage:
    """A decoded upload, ready for a batch (the full-size decoded pixels are already dropped)."""

    tensor: Any                      # [3, h, w] network input
    width: int
    height: int
    format: str
    preview: Optional[np.ndarray]    # [h', w', 3] uint8, long side <= overlay_max_side


@dataclass
class Outcome:
    """The result for one image: its verdict, with the pictures asked for."""

    verdict: Verdict
    overlay_png: Optional[bytes] = None
    mask_png: Optional[bytes] = None
    thumb_jpg: Optional[bytes] = None


@dataclass
class Engine:
    """A loaded, warmed-up model and what identifies it."""

    detector: Any
    path: str
    sha256: str
    file_bytes: int
    load_seconds: float
    loaded_at: float = field(default_factory=time.time)

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str, device: Optional[str] = None, warmup: bool = True,
             cancel: Optional[threading.Event] = None) -> "Engine":
        """Read, verify and warm up a model file (raises the library's errors when refused).

        What can be refused cheaply is, before the file's data is read: a path that is not a
        regular file (stat), a file whose size is not what its header declares (the header
        alone). ``cancel``: when set (the server is stopping), the load stops with a 503
        ``shutting_down`` :class:`ServeError` between steps and within the hashing."""
        from anomaly_hooks.detector import Detector
        from anomaly_hooks.errors import ModelFileError

        start = time.perf_counter()
        p = Path(path)
        check_model_file(p)
        before = _signature(p)
        check_model_extent(p)
        sha = file_sha256(p, cancel=cancel)
        _check_cancel(cancel)
        det = Detector.load(p, device=device)
        _check_cancel(cancel)
        if _signature(p) != before:
            raise ModelFileError(f"{p}: the file changed while it was being loaded; try again "
                                 "once it is completely written (write to a temporary name, "
                                 "then rename)")
        engine = cls(det, str(p), sha, before[1], 0.0)
        if warmup:
            engine.warm_up()
        engine.load_seconds = time.perf_counter() - start
        return engine

    def warm_up(self) -> None:
        """One untimed pass through every step (decode, inference, overlay and thumbnail), so
        that the first request pays for no allocation or lazy import."""
        h, w = self.input_size
        pixels = np.full((h, w, 3), 128, np.uint8)
        pixels[: h // 2] = 200
        item = self.prepare(pictures.png_bytes(pixels), h * w, max(h, w))
        scores, maps = self.infer([item.tensor])
        self.finish(float(scores[0]), maps[0], item, overlay=True, keep_anomalous=False,
                    thumb_side=32)

    # -- identity --------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return f"{self.detector.cfg.method}-{self.sha256[:12]}"

    @property
    def threshold(self) -> float:
        return float(self.detector.threshold_.value)

    @property
    def input_size(self) -> Tuple[int, int]:
        return tuple(self.detector.preprocessor.input_size)  # type: ignore[return-value]

    def info(self) -> Dict[str, Any]:
        """What GET /v1/model shows."""
        from anomaly_hooks.config import to_container

        det = self.detector
        thr = det.threshold_
        cfg = to_container(det.cfg)
        return {
            "model_id": self.model_id,
            "path": self.path,
            "file_sha256": self.sha256,
            "file_bytes": self.file_bytes,
            "loaded_at": iso_time(self.loaded_at),
            "load_seconds": round(self.load_seconds, 3),
            "method": cfg["method"],
            "backbone": {"name": det.backbone_name,
                         "weights": cfg.get("backbone", {}).get("weights"),
                         "class": type(det.extractor.model).__name__},
            "layers": list(det.layers),
            "layer_info": [vars(i) for i in det.layer_info],
            "input_size": list(self.input_size),
            "preprocess": det.preprocessor.as_dict(),
            "threshold": thr.as_dict(),
            "fitted_on": int(det.fit_info_.get("n_train", 0)),
            "fit": {k: v for k, v in det.fit_info_.items() if k != "skipped"},
            "device": str(det.device),
            "config": cfg,
        }

    # -- the three steps -------------------------------------------------------------------
    def prepare(self, data: bytes, max_pixels: int, overlay_max_side: int) -> PreparedImage:
        """Decode uploaded bytes (the library's reader, as ``Detector.predict`` reads them) and
        preprocess them (runs in the decode pool)."""
        pre = self.detector.preprocessor
        canonical, (height, width), fmt = decode_upload(data, pre.min_source_size, max_pixels)
        tensor = pre(canonical)
        prev = pictures.preview(canonical, overlay_max_side)
        del canonical
        return PreparedImage(tensor, width, height, fmt, prev)

    def infer(self, tensors: List[Any], features: Optional[Dict[str, np.ndarray]] = None
              ) -> Tuple[np.ndarray, Any]:
        """Image scores ``[B]`` and heatmaps ``[B, h, w]`` of network inputs (the model thread).

        Args:
            features: if given, receives each tapped layer's per-image channel means
                ``[B, C_l]`` float32, read by the same forward hooks that feed the scorer (for
                a drift monitor; no second forward pass).
        """
        import torch

        batch = torch.stack(tensors)
        scores, maps = self.detector.infer(batch.to(self.detector.device), taps=features)
        return scores.numpy().astype(np.float64), maps.float().cpu()

    def finish(self, score: float, heat: Any, item: PreparedImage, *, overlay: bool,
               keep_anomalous: bool, thumb_side: int) -> Outcome:
        """Verdict, anomalous pixels and the pictures of one image (runs in the decode pool).

        Args:
            heat: ``[h, w]`` heatmap in the network frame.
            overlay: render the overlay and mask whatever the verdict.
            keep_anomalous: render them when the image is anomalous.
            thumb_side: long side of the thumbnail (0 = none).
        """
        det = self.detector
        thr = det.threshold_
        pre = det.preprocessor
        fill = float(heat.min())
        # the full-resolution map, as Detector.predict computes it, only for the pixel count
        full = pre.to_original(heat, (item.height, item.width), fill=fill)
        anomalous_pixels = int((full > thr.value).sum())
        del full
        out = Outcome(thr.verdict(score, anomalous_pixels))
        anomalous = out.verdict.is_anomalous
        prev = item.preview
        if prev is not None and (overlay or (keep_anomalous and anomalous) or thumb_side):
            from anomaly_hooks.visualize import colorize
            from anomaly_hooks.visualize import overlay as blend

            vmax = max(2 * thr.value, float(heat.max()))
            if overlay or (keep_anomalous and anomalous):
                small = pre.to_original(heat, prev.shape[:2], fill=fill).numpy()
                mask = small > thr.value
                picture = blend(prev, colorize(small, 0.0, vmax), mask=mask)
                out.overlay_png = pictures.png_bytes(picture)
                out.mask_png = pictures.png_bytes(mask)
            if thumb_side:
                th, tw = pictures.fit_size(prev.shape[0], prev.shape[1], thumb_side)
                small = pre.to_original(heat, (th, tw), fill=fill).numpy()
                base = prev if (th, tw) == prev.shape[:2] else pictures.preview(
                    _chw(prev), thumb_side)
                out.thumb_jpg = pictures.jpeg_bytes(
                    blend(base, colorize(small, 0.0, vmax), mask=small > thr.value), thumb_side)
        return out


def _chw(arr: np.ndarray):
    import torch

    return torch.from_numpy(arr).permute(2, 0, 1).float().div_(255.0)



