"""``OnnxDetector``: predict with an exported model, with numpy, Pillow and ONNX Runtime only.

The same prediction contract as :class:`anomaly_hooks.detector.Detector`: ``predict(one image)
-> Prediction``, ``predict(sequence) -> list`` (batched), ``decision_function(images)`` (raw
image scores, float64), ``iter_predict`` (unreadable items come back as
:class:`~anomaly_hooks.errors.ImageReadError`, the rest are scored); any input type (path, PIL
image, numpy array), decoded by the same torch-free :mod:`anomaly_hooks.images` as the eager
path; the heatmap and mask in the caller's frame; thread-safe (an ONNX Runtime session may be
run from many threads, everything else is read-only). A file is verified before its first image
(:mod:`anomaly_hooks.runtime.metadata`): the checksum of its content, every metadata entry, and
the metadata against the graph.

A tiled (high-resolution) export runs as the eager tiled Detector does: each image placed in
the working frame with its aspect kept (the numpy twin of the framed preprocessing), the graph
given each image's box in the frame (``boxes``: its padding gets no score) and run on whole
frames' tiles, at most ``tiling.tile_batch`` tiles (one image at least) per session run; the
heatmap comes back from the image's own part of the frame.

Drift: a file exported from a model with a drift reference carries it (``drift_reference_``)
and its graph outputs each tapped layer's per-image channel means (a tiled model's: over the
cells of the stitched frame maps that hold the image's box, as the eager tiled path's taps)
beside the scores
(:meth:`OnnxDetector.run` with ``features``), so the numpy drift monitor runs on the edge as on
the eager path::

    from anomaly_hooks.monitor import DriftMonitor
    mon = det.drift_monitor()     # attached: every predict / run from now on feeds it
    det.predict(paths)
    mon.status()["alarm"]

    mon = DriftMonitor.from_detector(det)          # not attached: feed it yourself
    batch, _ = det.prepare(paths)
    layers = {}                                     # {layer: [B, C]} channel means
    scores, _ = det.run(batch, features=layers)
    mon.update({**mon.statistics(None, batch), **layers}, scores)   # input + layers + score
    # (a tiled model: statistics(None, batch, boxes), each image's box in the frame)

``drift_unavailable`` says why a file cannot (an older export, a model fitted without a
reference).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from anomaly_hooks.errors import ImageReadError, ModelFileError, NotFittedError
from anomaly_hooks.framing import Frame
from anomaly_hooks.images import decode_reduced, is_one_image, load_all
from anomaly_hooks.images import decode_threads as images_decode_threads  # a parameter's name
from anomaly_hooks.modelmeta import about
from anomaly_hooks.monitor.monitor import DriftMonitor
from anomaly_hooks.prediction import Prediction
from anomaly_hooks.runtime.metadata import (
    OUTPUTS,
    ExportedModel,
    check_graph,
    layer_means_output,
    read_exported,
)
from anomaly_hooks.runtime.onnxfile import unchanged
from anomaly_hooks.runtime.preprocess import NumpyPreprocessor

DEFAULT_BATCH = 8
ENGINES = ("onnxruntime", "openvino")


def _session(path: Path, engine: str, providers: Optional[Sequence[Any]],
             threads: Optional[int], spin: bool = True) -> Any:
    """An inference session on ``path`` (ONNX Runtime's, or the OpenVINO adapter); ``spin``:
    ONNX Runtime's intra-op threads busy-wait for work between operators (its default)."""
    if engine == "openvino":
        from anomaly_hooks.runtime.openvino import OpenVinoSession

        return OpenVinoSession(str(path), threads=threads)
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads is not None:
        opts.intra_op_num_threads = int(threads)
    return ort.InferenceSession(str(path), sess_options=opts,
                                providers=list(providers or ["CPUExecutionProvider"]))


def open_session(path: Path, engine: str = "onnxruntime",
                 providers: Optional[Sequence[Any]] = None, threads: Optional[int] = None,
                 spin: bool = True) -> Any:
    """An inference session on a verified model; a missing engine or a graph the engine
    refuses is a :class:`ModelFileError`."""
    if engine not in ENGINES:
        raise ModelFileError(f"engine={engine!r}: one of {', '.join(ENGINES)}")
    try:
        return _session(path, engine, providers, threads, spin)
    except ImportError as exc:
        extra = "runtime" if engine == "onnxruntime" else engine
        raise ModelFileError(f"engine {engine} is not installed ({exc}): pip install "
                             f"'anomaly_hooks[{extra}]'") from None
    # the engines raise their own types for a graph they cannot load
    except Exception as exc:  # noqa: BLE001
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelFileError(f"{path}: not a loadable ONNX model ({first})") from None


class OnnxDetector:
    """A predict-only detector on an ONNX file written by ``anomaly-hooks export``."""

    def __init__(self, session: Any, model: ExportedModel, batch_size: int = DEFAULT_BATCH,
                 preprocess_method: str = "numpy", decode_threads: Optional[int] = None
                 ) -> None:
        self.session = session
        self.model = model
        self.meta = dict(model.meta)
        self.path = model.path
        self.method = model.method
        self.threshold_ = model.threshold
        pre = model.preprocess
        frame = Frame.from_dict(pre["frame"]) if pre.get("frame") is not None else None
        self.preprocessor = NumpyPreprocessor(pre["resize"], pre["crop"], pre["mean"],
                                              pre["std"], frame, preprocess_method)
        self.tiling = model.tiling
        self.layers = model.layers
        self.max_pixels = model.max_pixels
        self.batch_size = batch_size
        self.decode_threads = images_decode_threads(decode_threads)
        self.input_name = model.input_name
        #: the drift reference saved with the source model (None: see ``drift_unavailable``)
        self.drift_reference_ = model.drift
        #: the tapped layers whose channel means :meth:`run` can return
        self.drift_layers = model.drift_layers
        #: None when this model can feed a drift monitor, else why not
        self.drift_unavailable = model.drift_unavailable
        self._means = [layer_means_output(name) for name in model.drift_layers]
        #: the attached drift monitor (:meth:`drift_monitor`), None until one is
        self.monitor: Optional[DriftMonitor] = None
        # a tiled model's session runs hold whole frames' tiles: at most tile_batch of them
        self.per_run = batch_size if self.tiling is None else \
            max(1, min(batch_size, self.tiling["tile_batch"] // self.tiling["n_tiles"]))

    @classmethod
    def load(cls, path: Union[str, os.PathLike], *, providers: Optional[Sequence[Any]] = None,
             threads: Optional[int] = None, batch_size: int = DEFAULT_BATCH,
             preprocess_method: str = "numpy", engine: str = "onnxruntime",
             spin: bool = True, decode_threads: Optional[int] = None) -> "OnnxDetector":
        """Open ``path`` (``.onnx``; its ``.onnx.data`` side file, if any, next to it), after
        :func:`~anomaly_hooks.runtime.metadata.read_exported` has verified its checksum and
        metadata and before any image is read; the metadata must agree with the graph
        (:func:`~anomaly_hooks.runtime.metadata.check_graph`).

        Args:
            providers: ONNX Runtime execution providers (default: CPU).
            threads: intra-op threads (default: the engine's choice).
            batch_size: images per session run.
            preprocess_method: ``numpy`` (torch's float32 arithmetic) or ``pillow`` (faster on
                big images); both match :class:`~anomaly_hooks.preprocess.Preprocessor`.
            engine: ``onnxruntime`` or ``openvino`` (the optional extra; the same file).
            spin: ONNX Runtime's threads busy-wait between operators (its default: lowest
                latency on an idle machine); False frees the CPU for other threads (the
                service's decode pool: measured 1.2x images per CPU-second on a loaded 2-core
                box).
            decode_threads: threads that decode a batch in :meth:`prepare` (default: the
                CPUs, at most :data:`~anomaly_hooks.images.DECODE_THREADS`).

        Raises:
            ModelFileError: missing, damaged (checksum), not an anomaly_hooks export, another
                format version, metadata outside its rules or disagreeing with the graph
                (naming the entry), or the engine is not installed.
        """
        path = Path(path)
        if engine not in ENGINES:
            raise ModelFileError(f"engine={engine!r}: one of {', '.join(ENGINES)}")
        model = read_exported(path)
        sess = open_session(path, engine, providers, threads, spin)
        with about(path):
            check_graph(model, sess.get_inputs(), sess.get_outputs())
        if not unchanged(model.content):  # the engine read the files again
            raise ModelFileError(f"{path}: the file changed while it was being loaded; try "
                                 "again once it is complete")
        return cls(sess, model, batch_size, preprocess_method, decode_threads)

    def drift_monitor(self) -> DriftMonitor:
        """Attach a new drift monitor to this detector and return it: a sliding window over
        every image scored from now on (:meth:`run`, hence :meth:`predict`,
        :meth:`iter_predict`, :meth:`decision_function`), as ``Detector.drift_monitor``.

        Raises:
            NotFittedError: the file cannot feed one (:attr:`drift_unavailable` says why)."""
        if self.drift_reference_ is None:
            raise NotFittedError(self.drift_unavailable or "no drift reference")
        self.monitor = DriftMonitor.from_detector(self)
        return self.monitor

    # -- inference ------------------------------------------------------------------------
    def run(self, batch: np.ndarray, sizes: Optional[Sequence[Tuple[int, int]]] = None,
            features: Optional[Dict[str, np.ndarray]] = None) -> Tuple[np.ndarray, np.ndarray]:
        """Image scores ``[B]`` and heatmaps ``[B, h, w]`` (network frame) of a normalised
        float32 batch ``[B, 3, h, w]``, in session runs of at most ``batch_size`` images (a
        tiled model's: at most its ``tile_batch`` tiles; an attached :meth:`drift_monitor`
        sees the batch).

        Args:
            sizes: each image's own (H, W) (a tiled model scores only its part of the frame;
                None: every image fills it).
            features: if given, receives each of :attr:`drift_layers`' per-image channel means
                ``{layer: [B, C_l]}`` float32 from the same session run (the drift monitor's
                layer statistics; nothing for a model without them)."""
        monitor = self.monitor
        if features is None and monitor is not None:
            features = {}
        names = list(OUTPUTS[1:]) + (self._means if features is not None else [])
        feed_boxes = None
        if self.tiling is not None:
            content = tuple(self.tiling["frame"]["content"])
            feed_boxes = np.asarray([content] * batch.shape[0] if sizes is None else
                                    [self.preprocessor.placement(s) for s in sizes],
                                    dtype=np.int64).reshape(batch.shape[0], 2)
        scores, maps, means = [], [], []
        for lo in range(0, batch.shape[0], self.per_run):
            feed = {self.input_name: batch[lo:lo + self.per_run]}
            if feed_boxes is not None:
                feed[self.tiling["boxes_input"]] = feed_boxes[lo:lo + self.per_run]
            heat, score, *layer_means = self.session.run(names, feed)
            scores.append(score)
            maps.append(heat)
            means.append(layer_means)
        if features is not None and self._means:
            features.update({name: np.concatenate([m[i] for m in means])
                             for i, name in enumerate(self.drift_layers)})
        scores_all = np.concatenate(scores)
        if monitor is not None:
            monitor.update({**monitor.statistics(None, batch, feed_boxes),
                            **(features or {})}, scores_all)
        return scores_all, np.concatenate(maps)

    def preprocess(self, image: np.ndarray, size: Optional[Sequence[int]] = None
                   ) -> np.ndarray:
        """The network input ``[3, h, w]`` float32 of a decoded canonical image (``[H, W, 3]``
        float32 in [0, 1], e.g. :func:`~anomaly_hooks.images.decode_reduced`'s): the model's
        resize, crop and normalisation (or working frame), as :meth:`predict` applies them.
        ``size``: the original (H, W) of a reduced decode."""
        return self.preprocessor(image, size)

    def load_image(self, item: Any) -> Tuple[np.ndarray, Tuple[int, int]]:
        """One image decoded as the eager path does (a huge one at a reduced scale, within the
        model's ``max_pixels``) and preprocessed (:meth:`preprocess`): ``[3, h, w]`` and the
        image's own (H, W). Raises :class:`ImageReadError` for an unreadable image."""
        image, size = decode_reduced(item, self.preprocessor.min_source_size, self.max_pixels)
        return self.preprocess(image, size), size

    def prepare(self, items: Sequence[Any]) -> Tuple[np.ndarray, List[Tuple[int, int]]]:
        """Normalised ``[B, 3, h, w]`` and the (H, W) of each image, decoded on
        ``decode_threads`` threads (:func:`~anomaly_hooks.images.load_all`)."""
        loaded = load_all(self.load_image, items, self.decode_threads)
        return np.stack([x for x, _ in loaded]), [size for _, size in loaded]

    def heatmap(self, heat: np.ndarray, size: Sequence[int]) -> np.ndarray:
        """A ``[h, w]`` heatmap of the network frame (a row of :meth:`run`'s maps) in an image
        frame ``size`` (H, W): ``[H, W]`` float32, the parts the crop cut off at the map's
        minimum -- the heatmap :meth:`predict` returns for an image of that size."""
        return self.preprocessor.to_original(heat, size, fill=float(heat.min()))

    def prediction(self, score: float, heat: np.ndarray, size: Tuple[int, int]) -> Prediction:
        """The :class:`Prediction` of one image from its :meth:`run` outputs (its image score
        and network-frame heatmap) and its own (H, W): heatmap and mask in the image's frame,
        the verdict counting the anomalous pixels there."""
        thr = self.threshold_
        heatmap = self.heatmap(heat, size)
        mask = heatmap > thr.value
        verdict = thr.verdict(score, anomalous_pixels=int(mask.sum()))
        return Prediction(**vars(verdict), heatmap=heatmap, mask=mask)

    @staticmethod
    def _items(images: Any) -> Tuple[bool, List[Any]]:
        single = is_one_image(images)
        return single, [images] if single else list(images)

    def predict(self, images: Any, *, batch_size: Optional[int] = None
                ) -> Union[Prediction, List[Prediction]]:
        """Score one image (-> :class:`Prediction`) or a sequence (-> list). Thread-safe.
        Raises :class:`ImageReadError` for an unreadable image (see :meth:`iter_predict`)."""
        single, items = self._items(images)
        size = batch_size or self.batch_size
        out: List[Prediction] = []
        for lo in range(0, len(items), size):
            batch, sizes = self.prepare(items[lo:lo + size])
            scores, maps = self.run(batch, sizes)
            out.extend(self.prediction(float(s), m, sz) for s, m, sz in zip(scores, maps, sizes))
        return out[0] if single else out

    def decision_function(self, images: Any, *, batch_size: Optional[int] = None
                          ) -> np.ndarray:
        """Raw image scores ``[N]`` float64 (higher = more anomalous)."""
        _, items = self._items(images)
        size = batch_size or self.batch_size
        scores = [self.run(*self.prepare(items[lo:lo + size]))[0]
                  for lo in range(0, len(items), size)]
        return np.concatenate(scores).astype(np.float64) if scores else np.empty(0)

    def iter_predict(self, items: Sequence[Any], *, batch_size: Optional[int] = None
                     ) -> Iterator[Tuple[int, Union[Prediction, ImageReadError]]]:
        """``(index, Prediction)`` in input order, or ``(index, ImageReadError)`` for an item
        that could not be read (the rest are still scored)."""
        size = batch_size or self.batch_size
        items = list(items)
        for lo in range(0, len(items), size):
            results: Dict[int, Any] = {}
            good: List[int] = []
            loaded = []
            for i in range(lo, min(lo + size, len(items))):
                try:
                    loaded.append(self.load_image(items[i]))
                    good.append(i)
                except ImageReadError as exc:
                    results[i] = exc
            if good:
                scores, maps = self.run(np.stack([x for x, _ in loaded]),
                                        [sz for _, sz in loaded])
                for i, s, m, (_, sz) in zip(good, scores, maps, loaded):
                    results[i] = self.prediction(float(s), m, sz)
            yield from sorted(results.items())

    def __repr__(self) -> str:
        return (f"OnnxDetector(method={self.method}, form={self.meta.get('scorer_form')}, "
                f"int8={bool(self.meta.get('int8'))}, path={self.path})")
