"""One loaded model as the service uses it: the model plus its file checksum and identity,
split into the three steps the request path runs in different places:

* :meth:`ModelEngine.prepare` (decode pool): uploaded bytes -> network input ``[3, h, w]``;
* :meth:`ModelEngine.infer` (the model thread): a stacked batch -> image scores and heatmaps;
* :meth:`ModelEngine.finish` (decode pool): one image's score and map -> verdict,
  anomalous-pixel count at full resolution, overlay / mask / thumbnail pictures.

Together they compute exactly what the model's own ``predict`` computes (tested), but the batch
is formed from concurrent requests. :class:`ModelEngine` is the interface the service relies on
(those three steps, :meth:`~ModelEngine.load` with its checks, :meth:`~ModelEngine.warm_up`,
:meth:`~ModelEngine.info`, the identity); two implementations, chosen by the model file's
suffix (:func:`~anomaly_hooks.serve.engines.engine_class`):

* :class:`~anomaly_hooks.serve.engine_torch.TorchEngine` (``.safetensors``, any other suffix):
  the PyTorch :class:`~anomaly_hooks.detector.Detector`, with the drift monitor's layer taps;
* :class:`~anomaly_hooks.serve.engine_onnx.OnnxEngine` (``.onnx``): an exported model on
  :class:`~anomaly_hooks.runtime.OnnxDetector` (ONNX Runtime, numpy, Pillow): the edge service,
  which never imports torch.

This module and everything the service imports besides the torch engine are torch-free:
``import torch`` happens only in :mod:`.engine_torch`, when a PyTorch model is loaded.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import numpy as np

from anomaly_hooks.errors import ModelFileError
from anomaly_hooks.prediction import Verdict
from anomaly_hooks.serve import pictures
from anomaly_hooks.serve.modelpaths import (
    check_cancel,
    check_model_file,
    file_sha256,
)
from anomaly_hooks.serve.results import iso_time
from anomaly_hooks.serve.uploads import decode_upload
from anomaly_hooks.serve.versions import model_lineage

log = logging.getLogger("anomaly_hooks.serve")

ONNX_SUFFIX = ".onnx"  # an exported model: served by the ONNX engine


def _signature(path: Path) -> Tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class PreparedImage:
    """A decoded upload, ready for a batch (the full-size decoded pixels are already dropped)."""

    tensor: Any                      # [3, h, w] network input (the engine's array type)
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
class ModelEngine:
    """A loaded, warmed-up model and what identifies it (the interface of the service's model;
    subclasses fill in the model-specific steps).

    ``detector`` is the implementation's model object; the service reads only what this class
    offers (its ``threshold_`` and ``preprocessor``, which both detectors have, are read here
    and by the drift seam)."""

    detector: Any
    path: str
    sha256: str
    file_bytes: int
    load_seconds: float
    loaded_at: float = field(default_factory=time.time)
    #: the summary of the ``lineage`` its file's metadata records (the updates it went
    #: through; :func:`~.versions.lineage_summary`), None for a model without one
    lineage: Optional[Dict[str, Any]] = None

    kind: ClassVar[str] = "?"
    #: None when the engine feeds a drift monitor; else why it cannot (``/v1/drift`` says it)
    drift_unavailable: ClassVar[Optional[str]] = None

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str, device: Optional[str] = None, warmup: bool = True,
             cancel: Optional[threading.Event] = None) -> "ModelEngine":
        """Read, verify and warm up a model file (raises the library's errors when refused).

        What can be refused cheaply is, before the file's data is read: a path that is not a
        regular file (stat), and whatever :meth:`check_file` refuses from the file's size and
        header. ``cancel``: when set (the server is stopping), the load stops with a 503
        ``shutting_down`` :class:`ServeError` between steps and within the hashing."""
        start = time.perf_counter()
        p = Path(path)
        check_model_file(p)
        before = _signature(p)
        cls.check_file(p)
        sha = file_sha256(p, cancel=cancel)
        check_cancel(cancel)
        det = cls.open_detector(p, device)
        check_cancel(cancel)
        lineage = model_lineage(str(p))
        if _signature(p) != before:
            raise ModelFileError(f"{p}: the file changed while it was being loaded; try again "
                                 "once it is completely written (write to a temporary name, "
                                 "then rename)")
        engine = cls(det, str(p), sha, before[1], 0.0, lineage=lineage)
        if warmup:
            engine.warm_up()
        engine.load_seconds = time.perf_counter() - start
        return engine

    @classmethod
    def check_file(cls, path: Path) -> None:
        """Refuse, from the file's size and header alone, what cannot be this kind of model
        (a regular file: checked before). Default: nothing more."""

    @classmethod
    def open_detector(cls, path: Path, device: Optional[str]) -> Any:
        """The verified model object of ``path`` on ``device`` (raises the library's errors)."""
        raise NotImplementedError

    @classmethod
    def prepare_process(cls) -> None:
        """Called once on the main thread when the service starts, before any model loads
        on a worker thread. Default: nothing."""

    def warm_up(self) -> None:
        """One untimed pass through every step (decode, inference, overlay and thumbnail), so
        that the first request pays for no allocation or lazy import."""
        h, w = self.input_size
        pixels = np.full((h, w, 3), 128, np.uint8)
        pixels[: h // 2] = 200
        item = self.prepare(pictures.png_bytes(pixels), h * w, max(h, w))
        scores, maps = self.infer([item.tensor], sizes=[(item.height, item.width)])
        self.finish(float(scores[0]), maps[0], item, overlay=True, keep_anomalous=False,
                    thumb_side=32)

    # -- identity --------------------------------------------------------------------------
    @property
    def method(self) -> str:
        """The model's method (``patchcore``, ``padim``)."""
        raise NotImplementedError

    @property
    def backbone_name(self) -> str:
        raise NotImplementedError

    @property
    def model_id(self) -> str:
        return f"{self.method}-{self.sha256[:12]}"

    @property
    def threshold(self) -> float:
        return float(self.detector.threshold_.value)

    @property
    def input_size(self) -> Tuple[int, int]:
        return tuple(self.detector.preprocessor.input_size)  # type: ignore[return-value]

    def boxes(self, sizes: Sequence[Optional[Tuple[int, int]]]) -> Optional[np.ndarray]:
        """``[B, 2]`` int64: each image's own part of a tiled model's working frame, ``(h,
        w)`` network pixels at its top-left, for images of ``sizes`` (H, W; None: the content
        box); None for an untiled model (its images fill the input)."""
        frame = getattr(self.detector.preprocessor, "frame", None)
        if frame is None:
            return None
        return np.asarray([tuple(frame.content) if s is None else frame.placement(tuple(s))
                           for s in sizes], dtype=np.int64).reshape(len(sizes), 2)

    def info(self) -> Dict[str, Any]:
        """What GET /v1/model shows (the fields of :class:`.schemas.ModelInfo`)."""
        raise NotImplementedError

    def _file_info(self) -> Dict[str, Any]:
        """The part of :meth:`info` every engine shows alike."""
        return {"model_id": self.model_id, "path": self.path, "file_sha256": self.sha256,
                "file_bytes": self.file_bytes, "loaded_at": iso_time(self.loaded_at),
                "load_seconds": round(self.load_seconds, 3), "engine": self.kind,
                "drift_unavailable": self.drift_unavailable, "lineage": self.lineage}

    # -- the model-specific parts of the three steps ---------------------------------------
    def network_input(self, canonical: np.ndarray, size: Optional[Tuple[int, int]] = None
                      ) -> Any:
        """``[H, W, 3]`` float32 canonical image -> the network input ``[3, h, w]``; ``size``:
        the original (H, W) of a reduced decode (a working frame places an image by it)."""
        raise NotImplementedError

    def input_file(self, tensor: Any, size: Tuple[int, int]) -> Optional[bytes]:
        """The kept-input file (:mod:`anomaly_hooks.keptinputs`) of a network input
        ``[3, h, w]`` made from an image of (H, W) ``size``, for ``--keep-inputs``; None where
        the updates (which run the library's torch preprocessing) could not take it."""
        return None

    def preview(self, canonical: np.ndarray, max_side: int) -> np.ndarray:
        """``[h', w', 3]`` uint8 copy of a canonical image, long side <= ``max_side``."""
        return pictures.preview(canonical, max_side)

    def stack(self, tensors: List[Any]) -> Any:
        """Network inputs -> one ``[B, 3, h, w]`` batch (also what a drift monitor sees)."""
        raise NotImplementedError

    def heat_to_frame(self, heat: Any, size: Tuple[int, int], fill: float) -> np.ndarray:
        """A ``[h, w]`` heatmap of the network frame -> ``[H, W]`` float32 in the image's
        frame ``size`` (the preprocessing's way back; parts the crop cut off get ``fill``)."""
        raise NotImplementedError

    # -- the three steps -------------------------------------------------------------------
    def prepare(self, data: bytes, max_pixels: int, overlay_max_side: int) -> PreparedImage:
        """Decode uploaded bytes (the library's reader, as ``predict`` reads them) and
        preprocess them (runs in the decode pool)."""
        pre = self.detector.preprocessor
        canonical, (height, width), fmt = decode_upload(data, pre.min_source_size, max_pixels)
        tensor = self.network_input(canonical, (height, width))
        prev = self.preview(canonical, overlay_max_side)
        del canonical
        return PreparedImage(tensor, width, height, fmt, prev)

    def infer(self, tensors: List[Any], features: Optional[Dict[str, np.ndarray]] = None,
              sizes: Optional[Sequence[Tuple[int, int]]] = None) -> Tuple[np.ndarray, Any]:
        """Image scores ``[B]`` float64 and heatmaps ``[B, h, w]`` of network inputs (the
        model thread).

        Args:
            sizes: each image's own (H, W): a tiled model gives the padding around an image
                of another aspect no score (None: every image fills the frame).
            features: if given, receives each tapped layer's per-image channel means
                ``[B, C_l]`` float32, read in the scoring pass (for a drift monitor; no second
                forward pass). An engine that cannot (:attr:`drift_unavailable`) leaves it
                empty.
        """
        raise NotImplementedError

    def finish(self, score: float, heat: Any, item: PreparedImage, *, overlay: bool,
               keep_anomalous: bool, thumb_side: int) -> Outcome:
        """Verdict, anomalous pixels and the pictures of one image (runs in the decode pool).

        Args:
            heat: ``[h, w]`` heatmap in the network frame.
            overlay: render the overlay and mask whatever the verdict.
            keep_anomalous: render them when the image is anomalous.
            thumb_side: long side of the thumbnail (0 = none).
        """
        thr = self.detector.threshold_
        fill = float(heat.min())
        # the full-resolution map, as predict computes it, only for the pixel count
        full = self.heat_to_frame(heat, (item.height, item.width), fill)
        anomalous_pixels = int((full > thr.value).sum())
        out = Outcome(thr.verdict(score, anomalous_pixels))
        anomalous = out.verdict.is_anomalous
        prev = item.preview
        if prev is not None and (overlay or (keep_anomalous and anomalous) or thumb_side):
            from anomaly_hooks.visualize import colorize
            from anomaly_hooks.visualize import overlay as blend

            vmax = max(2 * thr.value, float(heat.max()))
            if overlay or (keep_anomalous and anomalous):
                # a preview at the upload's own size (the usual case) reuses the full map
                small = full if prev.shape[:2] == full.shape else \
                    self.heat_to_frame(heat, prev.shape[:2], fill)
                mask = small > thr.value
                picture = blend(prev, colorize(small, 0.0, vmax), mask=mask)
                out.overlay_png = pictures.png_bytes(picture)
                out.mask_png = pictures.png_bytes(mask)
            del full
            if thumb_side:
                th, tw = pictures.fit_size(prev.shape[0], prev.shape[1], thumb_side)
                small = self.heat_to_frame(heat, (th, tw), fill)
                base = prev if (th, tw) == prev.shape[:2] else self.preview(
                    prev.astype(np.float32) / np.float32(255.0), thumb_side)
                out.thumb_jpg = pictures.jpeg_bytes(
                    blend(base, colorize(small, 0.0, vmax), mask=small > thr.value), thumb_side)
        return out
