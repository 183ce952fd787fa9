"""The public entry point: fit on good images, predict scores, verdicts and heatmaps.

Example (in a service: load once, predict from many threads)::

    from anomaly_hooks import Detector
    det = Detector.load("models/padim.safetensors")
    pred = det.predict("part_0001.png")
    pred.score, pred.is_anomalous, pred.heatmap.shape  # heatmap: H x W of the input image
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np
import torch
from omegaconf import DictConfig
from torch import nn
from tqdm.auto import tqdm

from anomaly_hooks import __version__
from anomaly_hooks.backbones import CUSTOM, build_backbone, fingerprint
from anomaly_hooks.config import ConfigSource, literal, load_config, to_container
from anomaly_hooks.data import (
    format_errors,
    iter_batches,
    list_images,
    load_preprocessed,
    resolve_items,
)
from anomaly_hooks.devices import ieee_float32, resolve_device, resolve_saved_device, synchronize
from anomaly_hooks.errors import ConfigError, FitError, ModelFileError, NotFittedError
from anomaly_hooks.extractor import HookFeatureExtractor, LayerInfo
from anomaly_hooks.heatmap import anomaly_maps
from anomaly_hooks.images import ImageInput, ImageReadError, is_one_image
from anomaly_hooks.modelfile import load_model, save_model
from anomaly_hooks.monitor import fitting as drift
from anomaly_hooks.monitor.monitor import DriftMonitor
from anomaly_hooks.monitor.stats import layer_statistics
from anomaly_hooks.prediction import Prediction
from anomaly_hooks.preprocess import Preprocessor
from anomaly_hooks.resources import check_fit_memory
from anomaly_hooks.scorers import Scorer, get_scorer
from anomaly_hooks.threshold import Threshold, calibrate_threshold
from anomaly_hooks.threshold import out_of_sample as threshold_out_of_sample  # (a local name)

log = logging.getLogger(__name__)

SEED_HOLDOUT = 1  # offsets so that each random choice has its own stream from the one seed
SEED_SCORER = 2
SEED_DRIFT = 3
# sees a batch's layer outputs {layer: [B, C, h, w]} and its network input [B, 3, h, w]
Observer = Callable[[Dict[str, torch.Tensor], torch.Tensor], None]


def _taps_observer(taps: Dict[str, np.ndarray], then: Optional[Observer]) -> Observer:
    """An observer that puts each layer's per-image channel means into ``taps`` (and calls
    ``then``, if any)."""
    def observe(features: Dict[str, torch.Tensor], images: torch.Tensor) -> None:
        # the drift monitor's layer statistic, on maps the scorer reads anyway
        taps.update({name: layer_statistics(f) for name, f in features.items()})
        if then is not None:
            then(features, images)
    return observe


def resolve_layer_names(cfg: DictConfig) -> List[str]:
    """The layers to tap: the config's, else the method's default for the backbone."""
    return list(cfg.backbone.layers or get_scorer(cfg.method).layers_for(cfg.backbone.name))


def _add_lap(acc: Dict[str, float], key: str, since: float,
             device: Optional[torch.device] = None) -> float:
    """Add the seconds since ``since`` to ``acc[key]`` (after a CUDA sync); returns now."""
    if device is not None:
        synchronize(device)
    now = time.perf_counter()
    acc[key] += now - since
    return now


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
        self._backbone_fingerprint: Optional[str] = None  # on first use (see the property)
        # a module the caller gave is copied (theirs is left as it was, see the README);
        # one this detector built is its own
        self.extractor = HookFeatureExtractor(model, self.layers, self.device,
                                              probe_size=self.preprocessor.input_size,
                                              precision=cfg.backbone.precision,
                                              channels_last=cfg.backbone.channels_last,
                                              copy_module=backbone is not None)
        # drift monitor fed by every predict (see drift_monitor()); None = not monitored
        self.monitor: Optional[DriftMonitor] = None

    @property
    def backbone_fingerprint(self) -> str:
        """SHA-256 of the backbone's parameters and buffers (:func:`backbones.fingerprint`),
        stored in the model file. Computed on first use (a save, an export, a load's check), not
        at construction: ~30 ms for a ResNet18, 0.2 s for a WRN50."""
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
        """
        if y is not None:
            raise FitError("fit() takes good images only: y must be None (no labels)")
        cfg = self.cfg
        items = resolve_items(X, training=True)
        out_of_sample = threshold_out_of_sample(cfg.threshold)
        train, held = (items, []) if out_of_sample else self._split(items)
        scorer_cls = get_scorer(cfg.method)
        if out_of_sample and len(train) < scorer_cls.min_out_of_sample_images:
            raise FitError(f"{cfg.method} needs at least {scorer_cls.min_out_of_sample_images} "
                           "training images for threshold.mode=all-images (each scored by a "
                           f"model without it); got {len(train)}: add images")
        if len(train) < scorer_cls.min_train_images:
            raise FitError(f"{cfg.method} needs at least {scorer_cls.min_train_images} training "
                           f"images after the threshold hold-out; got {len(train)} of "
                           f"{len(items)}: add images or lower threshold.holdout_fraction")
        scorer = self._new_scorer()
        if out_of_sample:
            scorer.request_out_of_sample()
        memory = check_fit_memory(scorer_cls, cfg, self.layer_info, self.preprocessor.input_size,
                                  len(train), self.device, n_threshold=len(held))
        scorer.begin(len(train))
        clock = [time.perf_counter()]

        def lap() -> float:
            synchronize(self.device)  # queued GPU work belongs to the step that queued it
            clock.append(time.perf_counter())
            return clock[-1] - clock[-2]

        # the drift reference's statistics come from the same forward passes (the hooks)
        collector = drift.fit_collector(cfg.monitor, self.preprocessor.mean,
                                        self.preprocessor.std, cfg.seed + SEED_DRIFT)
        with ieee_float32():
            n_used, errors, held_images, split = self._accumulate(scorer, train, held, progress,
                                                                  collector)
            timings = {"accumulate": lap(),
                       **{f"accumulate: {k}": v for k, v in split.items()}}
            scorer.finalize(progress=progress)
            timings["finalize"] = lap()
            timings.update({f"finalize: {k}": v
                            for k, v in getattr(scorer, "finalize_timings_", {}).items()})
            if out_of_sample:
                good_scores, source = self._out_of_sample_scores(scorer, train), "all-images"
            else:
                good_scores = self._score_images(scorer, held_images, collector)
                source = "folder" if cfg.threshold.folder else "holdout"
            timings["threshold"] = lap()
        reference = drift.fit_reference(collector, good_scores, cfg.monitor, cfg.seed + SEED_DRIFT)
        timings["drift reference"] = lap()
        if self.device.type == "cuda":
            # the fit's temporaries (patch buffers, coreset distances) go back to the driver
            # rather than staying reserved by this process for predict, which needs far less
            torch.cuda.empty_cache()
        threshold = calibrate_threshold(good_scores, cfg.threshold, source)
        self.scorer_, self.threshold_, self.memory_estimate_ = scorer, threshold, memory
        self.drift_reference_ = reference
        self.monitor = None  # a monitor of the previous fit compares with its reference
        self.fit_info_ = {"n_train": n_used, "n_threshold": len(good_scores),
                          "skipped": errors,
                          "threshold_source": cfg.threshold.folder or source}
        # Timings are not saved: model files are byte-identical across fits.
        self.fit_timings_ = {**timings, "total": clock[-1] - clock[0]}
        return self

    def _out_of_sample_scores(self, scorer: Scorer, train: List[Any]) -> List[float]:
        """Image scores of every training image from a model that did not see it: from the
        out-of-sample patch scores the fit made, else by a second pass over the training images
        (read again, in fit order; unreadable ones were skipped in the fit and are again)."""
        patch = scorer.take_out_of_sample_scores()
        if patch is not None:
            return self._scores_from_patches(patch)
        data = self.cfg.data
        scores: List[float] = []
        first = 0
        for batch in iter_batches(list(train), self.preprocessor, batch_size=data.batch_size,
                                  num_workers=data.num_workers, max_pixels=data.max_pixels,
                                  pin_memory=self.device.type == "cuda"):
            if not batch.indices:
                continue
            with torch.inference_mode():
                patch = scorer.out_of_sample_scores(self._embed(scorer, batch.images), first)
            scores.extend(self._scores_from_patches(patch))
            first += len(batch.indices)
        return scores

    def _scores_from_patches(self, patch: torch.Tensor) -> List[float]:
        """Image scores of patch-score maps ``[n, h, w]``: the heatmap pipeline, then its max
        (the scorers that support out-of-sample scores use the plain max as image score)."""
        out: List[float] = []
        step = self.cfg.data.batch_size
        with torch.inference_mode():
            for lo in range(0, patch.shape[0], step):
                maps = anomaly_maps(patch[lo:lo + step], self.preprocessor.input_size)
                out.extend(maps.flatten(1).amax(dim=1).float().cpu().tolist())
        return out

    def _new_scorer(self) -> Scorer:
        """A fresh, unfitted scorer of the config's method, seeded as every fit seeds it (the
        sharded fit's shards too)."""
        cfg = self.cfg
        return get_scorer(cfg.method).create(cfg[cfg.method], self.layer_info,
                                             self.backbone_name, cfg.seed + SEED_SCORER)

    def _split(self, items: List[Any]) -> tuple[List[Any], List[Any]]:
        thr = self.cfg.threshold
        if thr.folder:
            return items, list_images(Path(thr.folder))
        if thr.holdout_fraction <= 0:
            raise FitError("no threshold images: set threshold.holdout_fraction > 0 or "
                           "threshold.folder to a folder of good images")
        n_held = max(1, int(round(thr.holdout_fraction * len(items))))
        if n_held >= len(items):
            raise FitError(f"{len(items)} image(s) cannot be split into training and threshold "
                           "images: add good images")
        gen = torch.Generator().manual_seed(self.cfg.seed + SEED_HOLDOUT)
        perm = torch.randperm(len(items), generator=gen).tolist()
        held = sorted(perm[:n_held])
        held_set = set(held)
        return [it for i, it in enumerate(items) if i not in held_set], [items[i] for i in held]

    def _accumulate(self, scorer: Scorer, train: List[Any], held: List[Any], progress: bool,
                    observe: Optional[Observer] = None
                    ) -> tuple[int, List[str], List[torch.Tensor], Dict[str, float]]:
        """Feed the ``train`` items to the scorer, in one pass that also decodes the threshold
        images ``held`` (kept preprocessed, ``[b, 3, h, w]`` per batch, to be scored once the
        model is fitted: their decoding overlaps the training compute). Unreadable images of
        either kind are all listed in one error (``data.on_error=raise``) or skipped with a
        warning. Returns the training images used, the error messages, the threshold images
        and the seconds spent waiting for images / on features / on the scorer's statistics.
        ``observe`` sees every training batch (the drift reference's collector)."""
        data = self.cfg.data
        n_train = len(train)
        errors: Dict[str, List[str]] = {"training": [], "threshold": []}
        held_images: List[torch.Tensor] = []
        n_used = 0
        bar = tqdm(total=n_train + len(held), desc=f"fit {self.cfg.method}", unit="img",
                   disable=not progress, dynamic_ncols=True)
        split = {"waiting for images": 0.0, "features": 0.0, "statistics": 0.0}
        mark = time.perf_counter()
        for batch in iter_batches(list(train) + list(held), self.preprocessor,
                                  batch_size=data.batch_size, num_workers=data.num_workers,
                                  max_pixels=data.max_pixels,
                                  pin_memory=self.device.type == "cuda"):
            mark = _add_lap(split, "waiting for images", mark)
            for i, msg in batch.errors:
                errors["training" if i < n_train else "threshold"].append(msg)
            # batches come in item order and the training items come first: a prefix of each
            k = sum(i < n_train for i in batch.indices)
            if k < len(batch.indices):  # a copy, so that a mixed batch is not kept whole
                held_images.append(batch.images[k:].clone() if k else batch.images)
            if k:
                emb = self._embed(scorer, batch.images[:k], observe)
                mark = _add_lap(split, "features", mark, self.device)
                scorer.partial_fit(emb)
                del emb
                mark = _add_lap(split, "statistics", mark, self.device)
                n_used += k
            bar.update(len(batch.indices) + len(batch.errors))
        bar.close()
        self._handle_errors(errors)
        return n_used, errors["training"] + errors["threshold"], held_images, split

    def _handle_errors(self, errors: Dict[str, List[str]]) -> None:
        """Raise listing every unreadable image, or (``data.on_error=skip``) warn and go on."""
        bad = {what: errs for what, errs in errors.items() if errs}
        if bad and self.cfg.data.on_error == "raise":
            every = [e for errs in bad.values() for e in errs]
            raise FitError(f"{len(every)} {' and '.join(bad)} image(s) could not be read:\n"
                           f"{format_errors(every)}\nFix or remove them, or set "
                           "data.on_error=skip to fit without them")
        for what, errs in bad.items():
            log.warning("skipped %d unreadable %s image(s):\n%s", len(errs), what,
                        format_errors(errs))

    def _score_images(self, scorer: Scorer, batches: List[torch.Tensor],
                      observe: Optional[Observer] = None) -> List[float]:
        """Image scores of preprocessed images (``[b, 3, h, w]`` tensors), in batches;
        ``observe`` sees their layer outputs."""
        scores: List[float] = []
        if not batches:
            return scores
        images = torch.cat(batches)
        step = self.cfg.data.batch_size
        for start in range(0, images.shape[0], step):
            scores.extend(self._infer(images[start:start + step], scorer, observe)[0].tolist())
        return scores

    # -- inference ------------------------------------------------------------------------
    def _embed(self, scorer: Scorer, images: torch.Tensor, observe: Optional[Observer] = None
               ) -> torch.Tensor:
        """``[B, 3, h, w]`` preprocessed images -> ``[B, D, gh, gw]`` embeddings;
        ``observe(features, images)`` sees the hooked layer outputs first (drift statistics:
        no second backbone pass)."""
        with torch.inference_mode():
            features = self.extractor(images)
            if observe is not None:
                observe(features, images)
            return scorer.embedder(features)

    def _infer(self, images: torch.Tensor, scorer: Optional[Scorer] = None,
               observe: Optional[Observer] = None, *,
               taps: Optional[Dict[str, np.ndarray]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Image scores ``[B]`` (CPU) and heatmaps ``[B, h, w]`` (on the device) at the network
        input size. Without ``observe`` (fit passes its own), an attached :attr:`monitor` gets
        the batch's drift statistics and scores. ``taps`` (the service's view), if given,
        receives each tapped layer's per-image channel means ``[B, C_l]``."""
        scorer = scorer if scorer is not None else self.scorer_
        pending = self.monitor.batch() if observe is None and self.monitor is not None else None
        observe = observe or pending
        if taps is not None:
            observe = _taps_observer(taps, observe)
        with torch.inference_mode(), ieee_float32():
            emb = self._embed(scorer, images, observe)
            patch = scorer.score(emb)
            maps = anomaly_maps(patch, self.preprocessor.input_size)
            scores = scorer.image_scores(emb, patch, maps).float().cpu()
        if pending is not None:
            pending.finish(scores)
        return scores, maps

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
        for start in range(0, len(items), size):
            out.extend(self._predict_batch(items[start:start + size]))
        return out[0] if single else out

    def decision_function(self, X: Union[ImageInput, Sequence[ImageInput]], *,
                          batch_size: Optional[int] = None) -> np.ndarray:
        """Raw image scores ``[N]`` float64 of one image or a sequence (higher = more
        anomalous; compare with ``threshold_.value``), batched, without keeping heatmaps."""
        self._check_fitted()
        items = [X] if is_one_image(X) else list(X)
        size = batch_size or self.cfg.data.batch_size
        scores: List[float] = []
        for start in range(0, len(items), size):
            batch, _ = self._load(items[start:start + size])
            scores.extend(self._infer(batch)[0].tolist())
        return np.asarray(scores, dtype=np.float64)

    def iter_predict(self, items: Sequence[ImageInput], *, batch_size: Optional[int] = None,
                     num_workers: Optional[int] = None
                     ) -> Iterator[tuple[int, Union[Prediction, ImageReadError]]]:
        """Predict many images, decoding in worker processes while the model runs.

        Yields ``(index, Prediction)`` in input order, or ``(index, ImageReadError)`` for an
        item that could not be read — one bad file never stops the rest.
        """
        self._check_fitted()
        data = self.cfg.data
        for batch in iter_batches(list(items), self.preprocessor,
                                  batch_size=batch_size or data.batch_size,
                                  num_workers=data.num_workers if num_workers is None
                                  else num_workers, max_pixels=data.max_pixels,
                                  pin_memory=self.device.type == "cuda"):
            errors = {i: ImageReadError(msg) for i, msg in batch.errors}
            preds: Iterator[Prediction] = iter(())
            if batch.indices:
                scores, maps = self._infer(batch.images)
                # lazy: each full-size heatmap is made as it is yielded, one at a time in memory
                preds = self._predictions(scores, maps, batch.sizes)
            good = iter(batch.indices)  # ascending, as are the predictions
            for i in sorted([*batch.indices, *errors]):
                if i in errors:
                    yield i, errors[i]
                else:
                    next(good)
                    yield i, next(preds)

    def _load(self, items: Sequence[ImageInput]) -> tuple[torch.Tensor, List[tuple[int, int]]]:
        """Preprocessed images ``[B, 3, h, w]`` (page-locked when the model runs on a GPU, so
        that the copy to it does not block the host) and their own (H, W) sizes; each image is
        decoded, preprocessed and dropped before the next (a batch never holds full images)."""
        loaded = [load_preprocessed(item, self.preprocessor, self.cfg.data.max_pixels)
                  for item in items]
        pre = [t for t, _ in loaded]
        out = torch.empty((len(pre), *pre[0].shape), dtype=pre[0].dtype,
                          pin_memory=self.device.type == "cuda")
        return torch.stack(pre, out=out), [size for _, size in loaded]

    def _predict_batch(self, items: Sequence[ImageInput]) -> List[Prediction]:
        batch, sizes = self._load(items)
        scores, maps = self._infer(batch)
        return list(self._predictions(scores, maps, sizes))

    def _heatmaps(self, maps: torch.Tensor, sizes: Sequence[tuple[int, int]]
                  ) -> Iterator[np.ndarray]:
        """Heatmaps ``[B, h, w]`` at the network input size (on the device) -> one float32
        ``[H, W]`` array per image in its own frame, made lazily (one full-size map at a time);
        the parts the crop cut off get the map's minimum. The small network-size maps come to
        the host in one transfer per batch (one wait for the GPU, not one per image)."""
        maps = maps.float().cpu()
        fills = maps.flatten(1).amin(dim=1).tolist()
        for m, fill, size in zip(maps, fills, sizes):
            yield self.preprocessor.to_original(m, size, fill=fill).numpy()

    def _predictions(self, scores: torch.Tensor, maps: torch.Tensor,
                     sizes: Sequence[tuple[int, int]]) -> Iterator[Prediction]:
        """One :class:`Prediction` per image of a batch, lazily (see :meth:`_heatmaps`)."""
        thr = self.threshold_
        for score, heatmap in zip(scores.tolist(), self._heatmaps(maps, sizes)):
            yield Prediction(score=score, normalized_score=thr.normalize(score),
                             is_anomalous=bool(score > thr.value), heatmap=heatmap,
                             mask=heatmap > thr.value, threshold=thr.value)

    # -- persistence ----------------------------------------------------------------------
    def save(self, path: Union[str, Path]) -> Path:
        """Write the model atomically (safetensors + JSON metadata). Returns the path."""
        self._check_fitted()
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
        tensors = {**tensors, **{k: torch.from_numpy(v) for k, v in drift_tensors.items()}}
        return save_model(path, tensors, meta, version=self.scorer_.format_version())

    @classmethod
    def load(cls, path: Union[str, Path], *, device: Optional[str] = None,
             backbone: Optional[nn.Module] = None, method: Optional[str] = None) -> "Detector":
        """Load a saved model; it restores its preprocessing, layers, scorer and threshold.

        Args:
            device: where to run (``cpu``, ``cuda``, ``cuda:N``, ``auto``); an error if this
                machine lacks it. Without it the saved device is used where available, else
                (with a warning) ``auto``.
            backbone: the ``nn.Module`` for a model fitted with a custom backbone.
            method: the method the caller expects (``padim``, ``patchcore``); a file of
                another method is refused.
        """
        tensors, meta = load_model(path)
        if method is not None and meta.get("method") != method:
            raise ModelFileError(f"{path} is a {meta.get('method')} model, but a {method} model "
                                 "was expected: check the path")
        # asked for by the caller: a requirement (ConfigError); else the saved preference
        dev = resolve_device(device) if device is not None else None
        try:
            return cls._from_saved(path, tensors, meta, dev, backbone)
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
