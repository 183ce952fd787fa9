"""The public entry point: fit on good images, predict scores, verdicts and heatmaps.

Example (in a service: load once, predict from many threads)::

    from anomaly_hooks import Detector
    det = Detector.load("models/padim.safetensors")
    pred = det.predict("part_0001.png")
    pred.score, pred.is_anomalous, pred.heatmap.shape  # heatmap: H x W of the input image
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from omegaconf import DictConfig
from torch import nn

from anomaly_hooks import __version__
from anomaly_hooks.backbones import CUSTOM, build_backbone, fingerprint
from anomaly_hooks.config import ConfigSource, literal, load_config, to_container
from anomaly_hooks.data import Batch, iter_batches, load_preprocessed
from anomaly_hooks.devices import (
    channels_last_for,
    ieee_float32,
    resolve_device,
    resolve_saved_device,
)
from anomaly_hooks.errors import ConfigError, DataError, FitError, ModelFileError, NotFittedError
from anomaly_hooks.extractor import HookFeatureExtractor, LayerInfo
from anomaly_hooks.fitting import SEED_SCORER, FitPlan, FitRun
from anomaly_hooks.heap import keep_freed_memory
from anomaly_hooks.heatmap import anomaly_maps
from anomaly_hooks.images import ImageInput, ImageReadError, is_one_image, load_all
from anomaly_hooks.modelfile import (
    DIGESTS_VERSION,
    FORMAT_VERSION,
    content_checksum,
    file_checksum,
    load_model,
    save_model,
)
from anomaly_hooks.modelmeta import check_lineage
from anomaly_hooks.monitor import fitting as drift
from anomaly_hooks.monitor.monitor import DriftMonitor
from anomaly_hooks.monitor.stats import layer_statistics
from anomaly_hooks.prediction import Prediction
from anomaly_hooks.preprocess import Preprocessor
from anomaly_hooks.scorers import Scorer, get_scorer, on_demand_tensors
from anomaly_hooks.threshold import Threshold
from anomaly_hooks.tiling import detector as tiled
from anomaly_hooks.tiling.pipeline import Tiling, outside_to, probe_size
from anomaly_hooks.timing import Stopwatch

log = logging.getLogger(__name__)

# sees a batch's layer outputs {layer: [B, C, h, w]}, its network input [B, 3, h, w] and each
# image's box [B] (h, w) in a tiled model's frame (its own part, the rest padding; None: an
# untiled model, whose images fill the input)
Observer = Callable[[Dict[str, torch.Tensor], torch.Tensor,
                     Optional[List[Tuple[int, int]]]], None]


class Inference(NamedTuple):
    """What :meth:`Detector.infer` gives for a batch of ``B`` network inputs."""

    scores: torch.Tensor  # [B] float32 image scores, on the CPU
    maps: torch.Tensor    # [B, h, w] heatmaps at the network input size, on the device


def _taps_observer(taps: Dict[str, np.ndarray], then: Optional[Observer]) -> Observer:
    """An observer that puts each layer's per-image channel means into ``taps`` (and calls
    ``then``, if any)."""
    def observe(features: Dict[str, torch.Tensor], images: torch.Tensor,
                boxes: Optional[List[Tuple[int, int]]] = None) -> None:
        # the drift monitor's layer statistic, on maps the scorer reads anyway
        frame = tuple(images.shape[-2:])
        taps.update({name: layer_statistics(f, boxes, frame) for name, f in features.items()})
        if then is not None:
            then(features, images, boxes)
    return observe


def resolve_layer_names(cfg: DictConfig) -> List[str]:
    """The layers to tap: the config's, else the method's default for the backbone."""
    return list(cfg.backbone.layers or get_scorer(cfg.method).layers_for(cfg.backbone.name))


DESCRIPTORS_TENSOR = "grouping.descriptors"  # Detector.training_descriptors_ in a model file


def saved_descriptors(path: Union[str, Path], tensors: Dict[str, torch.Tensor],
                      scorer: Scorer) -> Optional[np.ndarray]:
    """The training images' grouping descriptors a model file holds (None for a file without
    them: they are pooled from the kept embeddings when an update needs them)."""
    t = tensors.get(DESCRIPTORS_TENSOR)
    if t is None:
        return None
    if t.dim() != 2 or t.dtype != torch.float32 or t.shape[0] != int(scorer.n_train):
        raise ModelFileError(f"{path}: {DESCRIPTORS_TENSOR} is {tuple(t.shape)} {t.dtype}, "
                             f"not [{int(scorer.n_train)}, F] float32 (one row per training "
                             "image): the file is damaged; save the model again or refit")
    return t.numpy()


class Detector:
    """Anomaly detector: a hooked backbone, a patch embedder and a scorer (PaDiM, PatchCore).

    Build with :meth:`from_config` or :meth:`load`. Follows scikit-learn's conventions: ``fit``
    returns ``self``; what fitting learns ends in ``_`` (``scorer_``, ``threshold_``,
    ``fit_info_``, ``fit_timings_``) and reading it before ``fit`` raises
    :class:`NotFittedError`. Scores are "higher = more anomalous" (unlike scikit-learn's
    ``score_samples``). Thread-safe for :meth:`predict` and :meth:`decision_function`.
    """

    def __init__(self, cfg: DictConfig, *, backbone: Optional[nn.Module] = None,
                 device: Union[str, torch.device, None] = None) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device if device is None else device)
        self.preprocessor = Preprocessor.from_config(cfg.preprocess)
        self.backbone_name = CUSTOM if backbone is not None else cfg.backbone.name
        self.layers: List[str] = resolve_layer_names(cfg)
        model = backbone if backbone is not None else build_backbone(
            cfg.backbone.name, cfg.backbone.weights, cfg.seed)
        # on first use (see the property); of the weights as given, before any folding
        self._backbone_fingerprint: Optional[str] = (
            fingerprint(model) if cfg.backbone.fold_batchnorm else None)
        # a module the caller gave is copied (theirs is left as it was, see docs/python-api.md);
        # one this detector built is its own
        self.extractor = HookFeatureExtractor(model, self.layers, self.device,
                                              probe_size=probe_size(
                                                  cfg, self.preprocessor.input_size),
                                              precision=cfg.backbone.precision,
                                              channels_last=channels_last_for(
                                                  cfg.backbone.channels_last, self.device),
                                              copy_module=backbone is not None,
                                              fold_batchnorm=cfg.backbone.fold_batchnorm,
                                              fold_padding=cfg.backbone.fold_padding,
                                              inplace_activations=(
                                                  cfg.backbone.inplace_activations))
        # high-resolution mode (tiling.enabled): the working frame's preprocessing and the
        # tiles around the backbone (anomaly_hooks.tiling); None: the resize-crop framing
        self.tiling: Optional[Tiling] = None
        tiled.attach(self)
        # drift monitor fed by every predict (see drift_monitor()); None = not monitored
        self.monitor: Optional[DriftMonitor] = None
        # the checksum of the model file this fitted state was loaded from or saved to (None:
        # changed since, or never saved): an update's parent (lineage_)
        self.source_checksum: Optional[str] = None

    @property
    def backbone_fingerprint(self) -> str:
        """SHA-256 of the backbone's parameters and buffers (:func:`backbones.fingerprint`),
        stored in the model file: of the weights as given, so that folding the BatchNorms
        (``backbone.fold_batchnorm``) does not change it. Computed at construction where they
        are folded (before the folding), else on first use (a save, an export, a load's
        check): ~30 ms for a ResNet18, 0.2 s for a WRN50."""
        if self._backbone_fingerprint is None:
            self._backbone_fingerprint = fingerprint(self.extractor.model)
        return self._backbone_fingerprint

    def __getattr__(self, name: str) -> Any:
        # only reached for missing attributes: a fitted one (``threshold_``) before fit()
        if name.endswith("_") and not name.startswith("__"):
            raise NotFittedError(f"this Detector is not fitted ({name} is set by fit()): call "
                                 "fit() first, or Detector.load() a saved model")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_config(cls, source: ConfigSource = None, *, backbone: Optional[nn.Module] = None,
                    overrides: Sequence[str] = (), **kw_overrides: Any) -> "Detector":
        """A new, unfitted detector.

        Args:
            source: YAML path, mapping or DictConfig (None = defaults).
            backbone: any ``nn.Module`` to use instead of the config's torchvision model; its
                layers are ``backbone.layers`` from the config.
            overrides: ``key=value`` strings; kw_overrides: ``padim__n_features=100`` style.
        """
        if backbone is not None and not isinstance(backbone, nn.Module):
            raise ConfigError("backbone= takes an nn.Module; to override config keys of the "
                              "backbone section use backbone__layers=[...] or overrides=[...]")
        cfg = load_config(source, overrides, **kw_overrides)
        if backbone is not None:
            cfg = load_config(literal(to_container(cfg)), backbone={"name": CUSTOM})
        return cls(cfg, backbone=backbone)

    @property
    def layer_info(self) -> List[LayerInfo]:
        """Channels and stride of each tapped layer (from the extractor's dry run)."""
        return self.extractor.info

    def __sklearn_is_fitted__(self) -> bool:
        return "scorer_" in self.__dict__ and "threshold_" in self.__dict__

    @property
    def is_fitted(self) -> bool:
        """True once fitted (or loaded)."""
        return self.__sklearn_is_fitted__()

    @property
    def scorer(self) -> Optional[Scorer]:
        """Alias of ``scorer_`` (None before fit), kept for code written before 0.2."""
        return self.__dict__.get("scorer_")

    def _check_fitted(self) -> None:
        if not self.is_fitted:
            raise NotFittedError("this Detector is not fitted: call fit() first, or "
                                 "Detector.load() a saved model")

    # -- fitting --------------------------------------------------------------------------
    def fit(self, X: Any, y: None = None, *, progress: bool = True) -> "Detector":
        """Fit on good images ``X``: a folder (an MVTec root uses ``train/good``), a list of
        paths, or an iterable of images (``y`` only for scikit-learn's signature: it must be
        None, every training image is good). Sets the threshold from good images' scores:
        ``threshold.mode=all-images`` fits on every image and scores each out of sample (as if
        unseen), ``holdout`` keeps a fraction out of the model; ``threshold.folder`` scores a
        separate folder. Returns ``self``; a failed fit leaves a fitted detector as it was.
        The steps are :class:`anomaly_hooks.fitting.FitRun`'s (``fit_timings_`` times each).
        """
        if y is not None:
            raise FitError("fit() takes good images only: y must be None (no labels)")
        with keep_freed_memory():
            FitRun(self, X, progress=progress).run()
        return self

    def recalibrate(self, *, good: Any = None, defects: Any = None,
                    **options: Any) -> "Detector":
        """Choose the threshold again without refitting: from good images the model has not
        seen (``good``; default: the fit's stored out-of-sample scores) and labelled defective
        images (``defects``), with ``objective`` (``far`` | ``f1`` | ``recall``),
        ``false_alarm_rate``, ``target_recall``, ``prevalence`` or ``tail``
        (:mod:`anomaly_hooks.recalibration`). Sets ``threshold_`` (its ``trade_off()`` lists
        the other operating points) and returns ``self``."""
        from anomaly_hooks.recalibration import recalibrate

        self._check_fitted()
        with keep_freed_memory():
            self.threshold_ = recalibrate(self, good=good, defects=defects, **options)
        self.source_checksum = None
        return self

    def update(self, X: Any, *, defects: Optional[Sequence[Any]] = None,
               source: Optional[Dict[str, Any]] = None, progress: bool = False) -> "Detector":
        """Update the fitted model in place with new good images ``X`` (a folder, an MVTec
        root, a list of paths or folders, an iterable of images), without the images it was
        fitted on, and return ``self`` (as ``fit``: save the model first, or load it again,
        to keep the old one). PaDiM's update equals a fit on all the images up to float32 rounding;
        PatchCore's bank is reselected from the current bank and the new patches by the same
        greedy rule (merge-reduce), within the configured size. The threshold is chosen again
        by the model's out-of-sample rule over all the good images, the drift reference
        pools the new images in, and ``lineage_`` records the update (saved with the model).
        Raises :class:`FitError` for a model that cannot be updated (tiled; PaDiM with float16
        factors; no stored good scores), saying what to do; a failed update leaves the model
        as it was. ``defects``: labelled defective images (paths or images) the threshold
        uses in place of ``threshold.defects`` (the objectives ``f1`` and ``recall`` choose by
        them; ``far`` records their recall); ``source``: where the images came from, recorded
        in the lineage entry. See :mod:`anomaly_hooks.updating`, and
        :func:`anomaly_hooks.learning.update_from_results` for an update from the service's
        labelled results."""
        from anomaly_hooks.updating import update

        self._check_fitted()
        with keep_freed_memory():
            update(self, X, progress=progress, defects=defects, lineage_source=source)
        return self

    @property
    def lineage_(self) -> List[Dict[str, Any]]:
        """The updates this model went through, oldest first: ``{parent_checksum,
        images_added, labels_used, time}`` each (``[]`` for a model straight from a fit)."""
        self._check_fitted()
        return list(self.__dict__.get("_lineage", []))

    @lineage_.setter
    def lineage_(self, value: Sequence[Dict[str, Any]]) -> None:
        self.__dict__["_lineage"] = [dict(entry) for entry in value]

    @property
    def training_descriptors_(self) -> Optional[np.ndarray]:
        """The grouping descriptors ``[n, F]`` float32 of the training images in fit order
        (:func:`~anomaly_hooks.grouping.image_descriptors`, as the fit computed them) where the
        scorer keeps their embeddings, else None: an update groups the model's images with
        the new ones from these (saved with the model, so that the update need not pool the
        kept embeddings again: 0.35 s for 100 images of 3136 positions)."""
        self._check_fitted()
        return self.__dict__.get("_training_descriptors")

    @training_descriptors_.setter
    def training_descriptors_(self, value: Optional[np.ndarray]) -> None:
        self.__dict__["_training_descriptors"] = (
            None if value is None else np.ascontiguousarray(value, dtype=np.float32))

    def checksum(self) -> str:
        """The checksum :meth:`save` would record for this model (what an update records as
        its parent when the model was neither loaded nor saved since it changed). Hashes
        every tensor: about a second per GB."""
        self._check_fitted()
        tensors, meta, version = self._saved_content()
        return content_checksum(tensors, meta, version)

    def new_scorer(self) -> Scorer:
        """A fresh, unfitted scorer of the config's method, seeded as every fit seeds it (the
        shards of a sharded fit too)."""
        cfg = self.cfg
        return get_scorer(cfg.method).create(cfg[cfg.method], self.layer_info,
                                             self.backbone_name, cfg.seed + SEED_SCORER)

    def image_scores_from_patches(self, patch: torch.Tensor) -> List[float]:
        """Image scores of patch-score maps ``[n, gh, gw]`` (a tiled scorer with statistics
        per tile position: its units, ``[n * T, th, tw]``, stitched here): the heatmap pipeline
        (:func:`~anomaly_hooks.heatmap.anomaly_maps`), then each map's max (the plain image
        score, which every scorer with out-of-sample scores uses), in batches."""
        out: List[float] = []
        step = self.cfg.data.batch_size
        if self.tiling is not None:  # whole images' worth of the scorer's units
            step *= self.tiling.units_per_image
        with torch.inference_mode():
            for lo in range(0, patch.shape[0], step):
                part = patch[lo:lo + step]
                inside = None
                if self.tiling is not None:  # per tile window -> per image; content only
                    part = self.tiling.frame_scores(part)
                    boxes = self.tiling.boxes(None, part.shape[0])
                    part, inside = self.tiling.mask_padding(part, boxes)
                maps = anomaly_maps(part, self.preprocessor.input_size)
                if inside is not None:
                    maps = outside_to(maps, inside, float("-inf"))
                out.extend(maps.flatten(1).amax(dim=1).float().cpu().tolist())
        return out

    # -- the predict path's stages --------------------------------------------------------
    # prepare -> embed -> infer (scores, maps) -> heatmaps / predictions. Each stage is public:
    # the service, the export, the sharded fit and the benchmarks run the same code.
    def batches(self, items: Sequence[Any], *, batch_size: Optional[int] = None,
                num_workers: Optional[int] = None) -> Iterator[Batch]:
        """Decoded, preprocessed batches of ``items`` (:func:`anomaly_hooks.data.iter_batches`
        with this detector's ``data`` settings): ``Batch.images`` ``[b, 3, h, w]``, the item
        indices, each image's own (H, W) and the unreadable items' messages."""
        data = self.cfg.data
        return iter_batches(list(items), self.preprocessor,
                            batch_size=batch_size or data.batch_size,
                            num_workers=data.num_workers if num_workers is None else num_workers,
                            max_pixels=data.max_pixels, pin_memory=self.device.type == "cuda",
                            processes=data.worker_processes)

    def prepare(self, items: Sequence[ImageInput]) -> tuple[torch.Tensor, List[tuple[int, int]]]:
        """Decode and preprocess images: the network inputs ``[B, 3, h, w]`` (page-locked when
        the model runs on a GPU, so that the copy to it does not block the host) and each
        image's own (H, W). ``data.num_workers`` threads decode at once (``images.load_all``),
        each image decoded, preprocessed and dropped by its thread (a batch never holds more
        full images than threads). Raises :class:`ImageReadError` for an unreadable one (the
        first in input order)."""
        data = self.cfg.data
        loaded = load_all(lambda item: load_preprocessed(item, self.preprocessor, data.max_pixels),
                          items, data.num_workers)
        pre = [t for t, _ in loaded]
        out = torch.empty((len(pre), *pre[0].shape), dtype=pre[0].dtype,
                          pin_memory=self.device.type == "cuda")
        return torch.stack(pre, out=out), [size for _, size in loaded]

    def embed(self, images: torch.Tensor, *, sizes: Optional[Sequence[tuple[int, int]]] = None,
              scorer: Optional[Scorer] = None, observe: Optional[Observer] = None,
              timings: Optional[Stopwatch] = None) -> torch.Tensor:
        """Network inputs ``[B, 3, h, w]`` -> patch embeddings ``[B, D, gh, gw]``: the hooked
        backbone's layer outputs ``{layer: [B, C_l, h_l, w_l]}``, then the scorer's embedder.

        Args:
            sizes: each image's own (H, W), as in :meth:`infer` (a tiled model's observer
                learns each image's box in the frame from them).
            scorer: whose embedder (default: the fitted ``scorer_``).
            observe: ``observe(features, images, boxes)`` sees the layer outputs first (the
                drift statistics: no second backbone pass); ``boxes``: each image's own part
                of a tiled model's frame, ``(h, w)`` network pixels at its top-left (the
                rest is padding), None for an untiled model.
            timings: charged ``backbone`` and ``embedding`` seconds.
        """
        scorer = scorer if scorer is not None else self.scorer_
        with torch.inference_mode():
            if timings is not None:
                timings.mark()
            features = (self.extractor(images) if self.tiling is None
                        else self.tiling.features(self.extractor, images))
            if observe is not None:
                boxes = (None if self.tiling is None
                         else self.tiling.boxes(sizes, images.shape[0]))
                observe(features, images, boxes)
            if timings is not None:
                timings.lap("backbone")
            emb = scorer.embedder(features)
            if self.tiling is not None:  # tile windows for a scorer with tile positions
                emb = self.tiling.units(emb)
            if timings is not None:
                timings.lap("embedding")
            return emb

    def infer(self, images: torch.Tensor, *, sizes: Optional[Sequence[tuple[int, int]]] = None,
              scorer: Optional[Scorer] = None, observe: Optional[Observer] = None,
              taps: Optional[Dict[str, np.ndarray]] = None,
              timings: Optional[Stopwatch] = None) -> Inference:
        """Network inputs ``[B, 3, h, w]`` (on :attr:`device`) -> :class:`Inference`: image
        scores ``[B]`` (float32, on the CPU) and heatmaps ``[B, h, w]`` at the network input
        size (on the device).

        Args:
            sizes: each image's own (H, W) (what :meth:`prepare` gives). A tiled model places
                an image of another aspect than its frame's with padding around it: the padding
                gets the image's least patch score and no part of its image score. Without
                sizes every image is taken to fill the frame's content box.
            scorer: the scorer to use (default: the fitted ``scorer_``).
            observe: sees the layer outputs (see :meth:`embed`); without it an attached
                :attr:`monitor` gets the batch's drift statistics and scores.
            taps: if given, receives each tapped layer's per-image channel means ``[B, C_l]``
                (the service's drift view, from the same hooks).
            timings: charged ``backbone``, ``embedding``, ``scorer`` and ``heatmap`` seconds
                (synchronised with the device).
        """
        scorer = scorer if scorer is not None else self.scorer_
        pending = self.monitor.batch() if observe is None and self.monitor is not None else None
        observe = observe or pending
        if taps is not None:
            observe = _taps_observer(taps, observe)
        with torch.inference_mode(), ieee_float32():
            emb = self.embed(images, sizes=sizes, scorer=scorer, observe=observe,
                             timings=timings)
            patch = scorer.score(emb)
            inside = None
            if self.tiling is not None:  # the padding around each image is no part
                patch = self.tiling.frame_scores(patch)
                boxes = self.tiling.boxes(sizes, images.shape[0])
                patch, inside = self.tiling.mask_padding(patch, boxes)
            if timings is not None:
                timings.lap("scorer")
            maps = anomaly_maps(patch, self.preprocessor.input_size)
            scored = maps if inside is None else outside_to(maps, inside, float("-inf"))
            scores = scorer.image_scores(emb, patch, scored).float().cpu()
            if timings is not None:
                timings.lap("heatmap")
        if pending is not None:
            pending.finish(scores)
        return Inference(scores, maps)

    def heatmaps(self, maps: torch.Tensor, sizes: Sequence[tuple[int, int]]
                 ) -> Iterator[np.ndarray]:
        """Heatmaps ``[B, h, w]`` at the network input size (on the device) -> one float32
        ``[H, W]`` array per image in its own frame (``sizes``), made lazily (one full-size map
        at a time); the parts the crop cut off get the map's minimum. The small network-size
        maps come to the host in one transfer per batch (one wait for the GPU, not one each)."""
        maps = maps.float().cpu()
        fills = maps.flatten(1).amin(dim=1).tolist()
        for m, fill, size in zip(maps, fills, sizes):
            yield self.preprocessor.to_original(m, size, fill=fill).numpy()

    def predictions(self, scores: torch.Tensor, maps: torch.Tensor,
                    sizes: Sequence[tuple[int, int]]) -> Iterator[Prediction]:
        """One :class:`Prediction` per image of a batch (``scores`` ``[B]``, ``maps``
        ``[B, h, w]``, each image's (H, W)), lazily: the verdict of
        :meth:`Threshold.verdict`, the heatmap of :meth:`heatmaps` and its mask."""
        thr = self.threshold_
        for score, heatmap in zip(scores.tolist(), self.heatmaps(maps, sizes)):
            mask = heatmap > thr.value
            verdict = thr.verdict(score, anomalous_pixels=int(mask.sum()))
            yield Prediction(**vars(verdict), heatmap=heatmap, mask=mask)

    # -- predicting -----------------------------------------------------------------------
    def drift_monitor(self) -> DriftMonitor:
        """Attach a new drift monitor to this detector and return it: a sliding window over
        every image predicted from now on (:meth:`predict`, :meth:`iter_predict`,
        :meth:`decision_function`); read it with ``status()``. Raises
        :class:`NotFittedError` for a model without a drift reference (an older file)."""
        self.monitor = DriftMonitor.from_detector(self)
        return self.monitor

    def predict(self, X: Union[ImageInput, Sequence[ImageInput]], *,
                batch_size: Optional[int] = None) -> Union[Prediction, List[Prediction]]:
        """Score one image (-> :class:`Prediction`) or a sequence of images (-> a list of
        them, batched internally), always.

        An image is a path, a PIL image, a numpy array (HxW or HxWxC, uint8 or float in [0, 1])
        or a ``[C, H, W]`` tensor; anything else iterable is a sequence of images. Safe to call
        from many threads at once. Raises :class:`ImageReadError` for an unreadable image
        (use :meth:`iter_predict` to go on past bad files).
        """
        self._check_fitted()
        single = is_one_image(X)
        items = [X] if single else list(X)
        size = batch_size or self.cfg.data.batch_size
        out: List[Prediction] = []
        with keep_freed_memory(len(items) > size):
            for start in range(0, len(items), size):
                images, sizes = self.prepare(items[start:start + size])
                scores, maps = self.infer(images, sizes=sizes)
                out.extend(self.predictions(scores, maps, sizes))
        return out[0] if single else out

    def decision_function(self, X: Union[ImageInput, Sequence[ImageInput]], *,
                          batch_size: Optional[int] = None) -> np.ndarray:
        """Raw image scores ``[N]`` float64 of one image or a sequence (higher = more
        anomalous; compare with ``threshold_.value``), batched, without keeping heatmaps."""
        self._check_fitted()
        items = [X] if is_one_image(X) else list(X)
        size = batch_size or self.cfg.data.batch_size
        scores: List[float] = []
        with keep_freed_memory(len(items) > size):
            for start in range(0, len(items), size):
                images, sizes = self.prepare(items[start:start + size])
                scores.extend(self.infer(images, sizes=sizes).scores.tolist())
        return np.asarray(scores, dtype=np.float64)

    def iter_predict(self, items: Sequence[ImageInput], *, batch_size: Optional[int] = None,
                     num_workers: Optional[int] = None
                     ) -> Iterator[tuple[int, Union[Prediction, ImageReadError]]]:
        """Predict many images, decoding on ``data.num_workers`` threads (``num_workers``) while
        the model runs (worker processes with ``data.worker_processes``).

        Yields ``(index, Prediction)`` in input order, or ``(index, ImageReadError)`` for an
        item that could not be read — one bad file never stops the rest.
        """
        self._check_fitted()
        # until the last is yielded, or the iterator is closed
        with keep_freed_memory(len(items) > (batch_size or self.cfg.data.batch_size)):
            for batch in self.batches(items, batch_size=batch_size, num_workers=num_workers):
                errors = {i: ImageReadError(msg) for i, msg in batch.errors}
                preds: Iterator[Prediction] = iter(())
                if batch.indices:
                    scores, maps = self.infer(batch.images, sizes=batch.sizes)
                    # lazy: each full-size heatmap is made as it is yielded, one at a time in memory
                    preds = self.predictions(scores, maps, batch.sizes)
                good = iter(batch.indices)  # ascending, as are the predictions
                for i in sorted([*batch.indices, *errors]):
                    if i in errors:
                        yield i, errors[i]
                    else:
                        next(good)
                        yield i, next(preds)

    # -- persistence ----------------------------------------------------------------------
    def save(self, path: Union[str, Path], *, format_version: Optional[int] = None) -> Path:
        """Write the model atomically (safetensors + JSON metadata). Returns the path.

        ``format_version``: the model-file format to write (default: the newest). An older
        one (1 or 2: no per-tensor digests, the whole file verified at load) is for readers of
        an older anomaly_hooks, e.g. a fleet mid-upgrade; one below what the model holds needs
        (:meth:`min_format_version`) is a :class:`~anomaly_hooks.errors.ConfigError`.

        The file is always complete: a loaded model's state left in its file (a dense PaDiM's
        kept embeddings) is read from there for the save, and read from the new file after
        it."""
        self._check_fitted()
        if format_version is not None:
            self.check_format_version(format_version)
        tensors, meta, version = self._saved_content()
        out = save_model(path, tensors, meta, version=format_version or version)
        del tensors  # kept embeddings read from the loaded file for this save: freed now
        self.source_checksum = file_checksum(out)
        # the new file is complete: what the model reads on demand comes from it from now on
        self.scorer_.bind_model_file(out, self.source_checksum)
        return out

    def min_format_version(self) -> int:
        """The oldest model-file format that holds this model (2: a low-rank PaDiM, or one
        keeping its training embeddings; else 1)."""
        self._check_fitted()
        return self.scorer_.format_version()

    def planned_format_version(self, source: Any) -> int:
        """The oldest model-file format that the model :meth:`fit` makes from ``source`` (the
        good images, as :meth:`fit` takes them) will need, known before the fit: 2 where this
        config makes a low-rank PaDiM or one keeping its training embeddings, else 1 (a tiled
        PaDiM with ``positions: tile``, whose samples are the tiles, may need less). ``source``
        is read, not consumed: a one-pass iterator is refused (give a folder or a list)."""
        if not isinstance(source, (str, os.PathLike)) and iter(source) is source:
            raise DataError("planned_format_version() reads the images without consuming "
                            "them: give a folder or a list, not a one-pass iterator")
        n_train = len(FitPlan.of(self.cfg, source).train)
        return get_scorer(self.cfg.method).planned_format_version(self.cfg, self.layer_info,
                                                                  n_train)

    def check_format_version(self, format_version: int, train: Any = None) -> None:
        """Raise :class:`~anomaly_hooks.errors.ConfigError` unless :meth:`save` can write
        this model in ``format_version``; before a fit, with ``train`` (the good images
        :meth:`fit` will take), unless it can write the model that fit makes."""
        low = self.min_format_version() if train is None else self.planned_format_version(train)
        if isinstance(format_version, bool) or not isinstance(format_version, int) \
                or not low <= format_version <= FORMAT_VERSION:
            how = ("; for format 1 fit with padim.covariance=dense and "
                   "padim.keep_embeddings=false" if low > 1 and train is not None else "")
            raise ConfigError(f"format_version={format_version!r}: this model can be written "
                              f"in model-file formats {low}..{FORMAT_VERSION} (format {low} is "
                              "the oldest that holds it: a low-rank PaDiM or kept training "
                              f"embeddings need 2){how}")

    def _saved_content(self) -> tuple[Dict[str, torch.Tensor], Dict[str, Any], int]:
        """(tensors, metadata, format version) of the model file :meth:`save` writes: the
        newest format with per-tensor digests, or the scorer's own if it needs a newer one."""
        tensors, scorer_meta = self.scorer_.state()
        drift_tensors, drift_meta = drift.reference_state(self.drift_reference_)
        config = to_container(self.cfg)
        monitor_cfg = config.pop("monitor")  # beside the config: older readers load the file
        meta = {
            "anomaly_hooks_version": __version__,
            "method": str(self.cfg.method),
            "config": config,
            "monitor": monitor_cfg,
            "preprocess": self.preprocessor.as_dict(),
            "layers": [vars(info) for info in self.layer_info],
            "backbone": {"name": self.backbone_name,
                         "class": type(self.extractor.model).__name__,
                         "fingerprint": self.backbone_fingerprint},
            "threshold": self.threshold_.as_dict(),
            "scorer": scorer_meta,
            "fit": self.fit_info_,
            "torch_version": torch.__version__.split("+")[0],
            **drift_meta,
        }
        if self.lineage_:  # absent for a fitted model: its file is as before updates existed
            meta["lineage"] = self.lineage_
        tensors = {**tensors, **{k: torch.from_numpy(v) for k, v in drift_tensors.items()}}
        if self.training_descriptors_ is not None:
            tensors[DESCRIPTORS_TENSOR] = torch.from_numpy(self.training_descriptors_)
        return tensors, meta, max(DIGESTS_VERSION, self.scorer_.format_version())

    @classmethod
    def load(cls, path: Union[str, Path], *, device: Optional[str] = None,
             backbone: Optional[nn.Module] = None, method: Optional[str] = None,
             for_update: bool = False) -> "Detector":
        """Load a saved model; it restores its preprocessing, layers, scorer and threshold.

        Args:
            device: where to run (``cpu``, ``cuda``, ``cuda:N``, ``auto``); an error if this
                machine lacks it. Without it the saved device is used where available, else
                (with a warning) ``auto``.
            backbone: the ``nn.Module`` for a model fitted with a custom backbone.
            method: the method the caller expects (``padim``, ``patchcore``); a file of
                another method is refused.
            for_update: the model is loaded to be updated (:meth:`update`): what an update
                usually remakes rather than reads (a dense PaDiM's factors ``[P, D, D]``,
                remade from its kept embeddings) is left in the file too, and read from it
                only where it is used (the model scores before it is updated, or keeps no
                embeddings, so that its update starts from the factors).

        What scoring never reads (a dense PaDiM's kept training embeddings, ``[P, n, D]``)
        is left in the file: an update or a save reads it from there then, verified against
        its digest, checking that the file is still the one loaded
        (:class:`~anomaly_hooks.errors.ModelFileChangedError` if it was replaced, changed or
        removed meanwhile: load the model again). Every tensor read is verified (format 3:
        its own digest; older files: every tensor against the file's checksum at load).
        """
        # what scoring never reads stays in the file (scorers' on_demand_tensors)
        tensors, meta = load_model(path, defer=on_demand_tensors(for_update))
        if method is not None and meta.get("method") != method:
            raise ModelFileError(f"{path} is a {meta.get('method')} model, but a {method} model "
                                 "was expected: check the path")
        # asked for by the caller: a requirement (ConfigError); else the saved preference
        dev = resolve_device(device) if device is not None else None
        try:
            det = cls._from_saved(path, tensors, meta, dev, backbone)
            det.source_checksum = file_checksum(path)
            return det
        except ModelFileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            # the checksum proves integrity, not authorship: content that does not fit together
            raise ModelFileError(f"{path}: inconsistent model file ({type(exc).__name__}: "
                                 f"{exc}); refit or restore it from a backup") from None

    @classmethod
    def _from_saved(cls, path: Union[str, Path], tensors: Dict[str, torch.Tensor],
                    meta: Dict[str, Any], device: Optional[torch.device],
                    backbone: Optional[nn.Module]) -> "Detector":
        # stored resolved: read with no interpolation; files before the monitor have no section
        cfg = load_config(literal({**meta["config"], "monitor": meta.get("monitor") or {}}))
        if meta["backbone"]["name"] == CUSTOM and backbone is None:
            raise ModelFileError(f"{path} was fitted with a custom backbone "
                                 f"({meta['backbone']['class']}): pass it again with "
                                 "Detector.load(path, backbone=module)")
        det = cls(cfg, backbone=backbone,
                  device=device if device is not None else resolve_saved_device(cfg.device))
        if det.backbone_fingerprint != meta["backbone"]["fingerprint"]:
            raise ModelFileError(f"{path}: the backbone's weights differ from the ones the model "
                                 "was fitted with (other weights file or version?); load it with "
                                 "the same backbone weights, or refit")
        saved_layers = [LayerInfo(**d) for d in meta["layers"]]
        if saved_layers != det.layer_info:
            raise ModelFileError(f"{path}: the backbone's layers {det.layer_info} differ from "
                                 f"the saved {saved_layers}")
        scorer_cls = get_scorer(meta["method"])
        det.scorer_ = scorer_cls.from_state(cfg[cfg.method], det.layer_info, tensors,
                                           meta["scorer"], det.device)
        det.threshold_ = Threshold.from_dict(meta["threshold"])
        det.fit_info_ = dict(meta.get("fit", {}))
        det.drift_reference_ = drift.reference_from_saved(tensors, meta)
        det.lineage_ = check_lineage(meta.get("lineage", []))
        det.training_descriptors_ = saved_descriptors(path, tensors, det.scorer_)
        tiled.restore(det, meta["preprocess"])  # a tiled model's working frame
        return det

    def export_onnx(self, path: Union[str, Path], **kwargs: Any) -> Path:
        """Write the predict path as one ONNX graph for the torch-free runtime (needs the
        ``[export]`` extra); see :func:`anomaly_hooks.export.onnx.export_onnx` for ``kwargs``."""
        from anomaly_hooks.export.onnx import export_onnx

        return export_onnx(self, path, **kwargs)

    def close(self) -> None:
        """Remove the backbone hooks (the detector cannot predict afterwards)."""
        self.extractor.close()

    def __repr__(self) -> str:
        state = "fitted" if self.is_fitted else "not fitted"
        return (f"Detector(method={self.cfg.method}, backbone={self.backbone_name}, "
                f"layers={self.layers}, device={self.device}, {state})")
