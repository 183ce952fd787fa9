"""One fit run: every fit of a :class:`~anomaly_hooks.detector.Detector`, in one process
(``Detector.fit``) or sharded over Ray actors (``distributed.fit``), goes through these steps,
each timed by one :class:`~anomaly_hooks.timing.Stopwatch`::

    plan        the items; the threshold split (all-images | holdout | folder); the
                too-few-images rule                                      (FitPlan.of)
    begin       a fresh seeded scorer; the memory guard; the drift collector
    accumulate  training batches -> Detector.embed -> scorer.partial_fit (+ the collector),
                the threshold images decoded in the same pass              (FitRun.accumulate)
                -- or shards on actors: fit_shard -> partial states -> merge (FitRun.add_shards)
    groups      all-images: which images are left out together (file-name groups, near-
                duplicates; cut into folds for a cross-fitting method)     (FitRun.set_groups)
    finalize    scorer.finalize()  |  scorer.finalize_merged(state)
    threshold   the good images' scores: every training image out of sample (from finalize,
                or a second pass over whole groups -- on the actors for a sharded fit), or
                the held-out images
    defects     the labelled defective images' scores (threshold.defects)   (FitRun.defect_scores)
    reference   the drift reference from the collected statistics and the good scores
    complete    the threshold (objective, operating point, provenance) and every fitted
                attribute set on the detector, all at once

A failed run leaves the detector as it was: nothing is set before ``complete``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from tqdm.auto import tqdm

from anomaly_hooks.data import format_errors, list_images, resolve_items
from anomaly_hooks.devices import ieee_float32
from anomaly_hooks.errors import ConfigError, FitError
from anomaly_hooks.grouping import Grouping, blocked_folds, find_groups, image_descriptors
from anomaly_hooks.monitor import fitting as drift
from anomaly_hooks.monitor.stats import StatisticsCollector
from anomaly_hooks.resources import check_fit_memory
from anomaly_hooks.scorers import Scorer, get_scorer
from anomaly_hooks.threshold import calibrate_threshold
from anomaly_hooks.threshold import out_of_sample as threshold_out_of_sample
from anomaly_hooks.tiling import detector as tiled
from anomaly_hooks.timing import Stopwatch

if TYPE_CHECKING:
    from anomaly_hooks.detector import Detector

log = logging.getLogger(__name__)

SEED_HOLDOUT = 1  # offsets so that each random choice has its own stream from the one seed
SEED_SCORER = 2
SEED_DRIFT = 3
SEED_GROUPS = 4  # the pairs sampled for the median distance of a large fit (grouping.py)
SEED_THRESHOLD_DEFECTS = 5  # evaluate --threshold-defects: the draw of labelled defects


# -- plan -----------------------------------------------------------------------------------
@dataclass
class FitPlan:
    """Which images train the model and which set the threshold.

    Attributes:
        train: the training items, in fit order.
        held: the threshold items kept out of the model (``holdout`` or ``folder``; empty for
            ``all-images``, where every training image is scored out of sample).
        out_of_sample: whether the threshold comes from out-of-sample scores of ``train``.
    """

    train: List[Any]
    held: List[Any]
    out_of_sample: bool

    @property
    def source(self) -> str:
        """Where the good scores come from: ``all-images``, ``holdout`` or ``folder``."""
        return "all-images" if self.out_of_sample else ("folder" if self.folder else "holdout")

    folder: Optional[str] = None

    @classmethod
    def of(cls, cfg: Any, source: Any) -> "FitPlan":
        """The plan for the config's threshold section on the good images ``source``; raises
        :class:`FitError` when there are too few images for the method and the mode."""
        items = resolve_items(source, training=True)
        thr = cfg.threshold
        if str(thr.objective) != "far" and not thr.defects:
            raise ConfigError(f"threshold.objective={thr.objective} needs labelled defective "
                              "images: set threshold.defects to a folder of them (fit "
                              "--defects DIR), or use threshold.objective=far")
        oos = threshold_out_of_sample(thr)
        train, held = (items, []) if oos else split_holdout(cfg, items)
        check_image_count(cfg, len(train), len(items), oos)
        return cls(train, held, oos, thr.folder or None)


def split_holdout(cfg: Any, items: List[Any]) -> Tuple[List[Any], List[Any]]:
    """(training, threshold) items for ``threshold.mode=holdout``: the images of
    ``threshold.folder``, else a seeded ``holdout_fraction`` of ``items`` (kept in order)."""
    thr = cfg.threshold
    if thr.folder:
        return items, list_images(Path(thr.folder))
    if thr.holdout_fraction <= 0:
        raise FitError("no threshold images: set threshold.holdout_fraction > 0 or "
                       "threshold.folder to a folder of good images")
    n_held = max(1, int(round(thr.holdout_fraction * len(items))))
    if n_held >= len(items):
        raise FitError(f"{len(items)} image(s) cannot be split into training and threshold "
                       "images: add good images")
    gen = torch.Generator().manual_seed(cfg.seed + SEED_HOLDOUT)
    perm = torch.randperm(len(items), generator=gen).tolist()
    held = sorted(perm[:n_held])
    held_set = set(held)
    return [it for i, it in enumerate(items) if i not in held_set], [items[i] for i in held]


def check_image_count(cfg: Any, n_train: int, n_items: int, out_of_sample: bool) -> None:
    """The one too-few-images rule of every fit (the method's minimum, and for
    ``all-images`` the minimum to score each image by a model without it)."""
    scorer_cls = get_scorer(cfg.method)
    if out_of_sample and n_train < scorer_cls.min_out_of_sample_images:
        raise FitError(f"{cfg.method} needs at least {scorer_cls.min_out_of_sample_images} "
                       "training images for threshold.mode=all-images (each scored by a "
                       f"model without it); got {n_train}: add images")
    if n_train < scorer_cls.min_train_images:
        raise FitError(f"{cfg.method} needs at least {scorer_cls.min_train_images} training "
                       f"images after the threshold hold-out; got {n_train} of "
                       f"{n_items}: add images or lower threshold.holdout_fraction")


def report_unreadable(cfg: Any, errors: Dict[str, List[str]]) -> None:
    """Raise :class:`FitError` listing every unreadable image (``data.on_error=raise``), or
    warn and go on (``skip``). ``errors``: ``{"training": [...], "threshold": [...]}``."""
    bad = {what: errs for what, errs in errors.items() if errs}
    if bad and cfg.data.on_error == "raise":
        every = [e for errs in bad.values() for e in errs]
        raise FitError(f"{len(every)} {' and '.join(bad)} image(s) could not be read:\n"
                       f"{format_errors(every)}\nFix or remove them, or set "
                       "data.on_error=skip to fit without them")
    for what, errs in bad.items():
        log.warning("skipped %d unreadable %s image(s):\n%s", len(errs), what,
                    format_errors(errs))


def new_collector(det: "Detector") -> Optional[StatisticsCollector]:
    """The drift reference's collector for a fit of ``det`` (None with monitoring off)."""
    pre = det.preprocessor
    return drift.fit_collector(det.cfg.monitor, pre.mean, pre.std, det.cfg.seed + SEED_DRIFT)


def descriptors_of(det: "Detector", emb: torch.Tensor) -> np.ndarray:
    """One grouping descriptor per image ``[B, F]`` of a batch's embeddings: a tiled scorer's
    units (``T`` tile windows per image, image by image) are joined per image."""
    desc = image_descriptors(emb)
    per = tiled.units_per_image(det)
    return desc.reshape(desc.shape[0] // per, -1) if per > 1 else desc


# -- the steps that also run on shards -------------------------------------------------------
def fit_shard(det: "Detector", items: Sequence[Any], n_total: int,
              on_batch: Optional[Callable[[int], None]] = None,
              descriptors: bool = False) -> Dict[str, Any]:
    """The accumulate step on one shard of ``n_total`` training images, from a fresh seeded
    scorer (so a retried shard recomputes the same state): ``{"state": partial state or None,
    "drift": the collector's state or None, "errors": [...], "n_used": int, "used": the
    shard-local indices of the images read, "descriptors": their grouping descriptors
    [n_used, F] or None}``, plain data for Ray. ``on_batch(b)`` is called after batch ``b``'s
    work (the fault-injection hook)."""
    scorer = det.new_scorer()
    per = tiled.units_per_image(det)  # a tiled scorer's samples: each image's tile windows
    scorer.begin_shard(n_total * per, len(items) * per)
    collector = new_collector(det)
    errors: List[str] = []
    used: List[int] = []
    desc: List[np.ndarray] = []
    with ieee_float32():
        for b, batch in enumerate(det.batches(items)):
            errors.extend(msg for _, msg in batch.errors)
            if batch.indices:
                emb = det.embed(batch.images, sizes=batch.sizes, scorer=scorer,
                                observe=collector)
                if descriptors:
                    desc.append(descriptors_of(det, emb))
                scorer.partial_fit(emb)
                used.extend(batch.indices)
            if on_batch is not None:
                on_batch(b)
    return {"state": scorer.partial_state() if used else None,
            "drift": collector.state() if collector is not None else None,
            "errors": errors, "n_used": len(used), "used": used, "n_items": len(items),
            "descriptors": np.concatenate(desc) if desc else None}


def second_pass_units(scorer: Scorer, n: int, batch_size: int,
                      per_image: int = 1) -> List[List[int]]:
    """The fit-order images each call of the second pass scores: consecutive batches of
    ``batch_size``, or, where the scorer needs whole groups, whole groups packed up to
    ``batch_size`` images (a larger group alone). ``per_image``: the scorer's samples per
    image (a tiled scorer's tile windows, :func:`tiling.detector.units_per_image`), whose
    groups are given per sample: an image's samples share its group."""
    if not scorer.out_of_sample_whole_groups:
        return [list(range(lo, min(lo + batch_size, n))) for lo in range(0, n, batch_size)]
    groups = scorer.oos_groups.tolist()[::per_image]
    members: Dict[int, List[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    units: List[List[int]] = [[]]
    for group in members.values():  # in order of first image
        if units[-1] and len(units[-1]) + len(group) > batch_size:
            units.append([])
        units[-1].extend(group)
    return units


def out_of_sample_scores(det: "Detector", scorer: Scorer, items: Sequence[Any],
                         images: Sequence[int]) -> List[float]:
    """Image scores of training ``items`` (fit-order images ``images``, all read by the fit)
    from ``scorer`` as if each were unseen: the second pass of a fit whose scorer kept too
    little to make them in ``finalize`` (and, on the actors, of a sharded fit). A scorer that
    needs whole groups gets the items' embeddings in one call. A tiled scorer with statistics
    per tile position is told the fit-order ids of its samples (each image's tile windows)."""
    images = list(images)
    per = tiled.units_per_image(det)
    embs: List[torch.Tensor] = []
    ids: List[List[int]] = []
    scores: List[float] = []
    whole = scorer.out_of_sample_whole_groups
    with ieee_float32():
        for batch in det.batches(items):
            if batch.errors:
                raise FitError("a training image could not be read again for its "
                               f"out-of-sample score:\n{format_errors(m for _, m in batch.errors)}")
            emb = det.embed(batch.images, scorer=scorer)
            mine = [images[i] * per + t for i in batch.indices for t in range(per)]
            if whole:
                embs.append(emb)
                ids.append(mine)
                continue
            with torch.inference_mode():
                patch = scorer.out_of_sample_scores(emb, mine)
            scores.extend(det.image_scores_from_patches(patch))
        if whole and embs:
            with torch.inference_mode():
                patch = scorer.out_of_sample_scores(torch.cat(embs),
                                                    [i for part in ids for i in part])
            scores.extend(det.image_scores_from_patches(patch))
    return scores


def describe_cross_fit(grouping: Optional[Grouping], folds: Optional[np.ndarray],
                       names: Optional[Sequence[str]]) -> Dict[str, Any]:
    """How the out-of-sample scores left images out, for the threshold's provenance. Folds
    of one image each (no more groups than images per fold allow) leave one image out: the
    scorer gets no groups then, so they are described as that."""
    if grouping is None:
        return {"scheme": "leave-one-image-out"}
    out: Dict[str, Any] = grouping.summary(names)
    if folds is not None and int(np.bincount(folds).max()) > 1:
        out["scheme"] = f"{int(folds.max()) + 1} blocked folds of whole groups (cross-fit)"
    elif grouping.grouped_images:
        out["scheme"] = "leave-one-group-out"
    else:
        out["scheme"] = "leave-one-image-out (no groups found)"
    return out


# -- the run ---------------------------------------------------------------------------------
class FitRun:
    """One fit of ``det`` on the good images ``source`` (see the module docstring).

    ``run()`` is the whole single-process fit; the sharded fit calls :meth:`add_shards` in
    place of :meth:`accumulate` and hands :meth:`threshold_scores` its second pass.
    """

    def __init__(self, det: "Detector", source: Any, *, progress: bool = True) -> None:
        self.clock = Stopwatch(det.device)
        self.det, self.cfg, self.progress = det, det.cfg, progress
        self.plan = FitPlan.of(det.cfg, source)
        # a tiled model's working frame, from these training images' size (None: untiled)
        self.frame = tiled.fit_frame(det, self.plan.train)
        self.scorer = det.new_scorer()
        if self.plan.out_of_sample:
            self.scorer.request_out_of_sample()
        self.collector = new_collector(det)
        self.errors: Dict[str, List[str]] = {"training": [], "threshold": [], "defect": []}
        self.held_images: List[torch.Tensor] = []  # [b, 3, h, w] per batch
        self.held_sizes: List[Tuple[int, int]] = []  # each held image's own (H, W)
        self.n_used = 0
        self.used: List[int] = []  # indices into plan.train of the images the fit read
        self.descriptors: List[np.ndarray] = []  # grouping descriptors, one array per batch
        self.all_descriptors: Optional[np.ndarray] = None  # [n_used, F], joined by set_groups
        self.cross_fit: Dict[str, Any] = {}
        self.defects: Optional[Tuple[List[float], List[str]]] = None  # (scores, names)
        self.memory: Optional[Dict[str, int]] = None
        self.info: Dict[str, Any] = {}
        self.clock.lap("plan")

    def run(self) -> None:
        """The single-process fit, start to end (sets the detector's fitted attributes)."""
        with tiled.frame_for_fit(self.det, self.frame):  # put back if the fit fails
            self._run()

    def _run(self) -> None:
        plan = self.plan
        self.memory = check_fit_memory(get_scorer(self.cfg.method), self.cfg,
                                       self.det.layer_info, self.det.preprocessor.input_size,
                                       len(plan.train), self.det.device,
                                       n_threshold=len(plan.held), tiling=self.det.tiling)
        self.scorer.begin(len(plan.train) * tiled.units_per_image(self.det))
        self.clock.lap("begin")
        with ieee_float32():
            self.accumulate()
            self.set_groups()
            self.finalize()
            good = self.threshold_scores()
            self.defect_scores()
        self.complete(good)

    # -- accumulate ---------------------------------------------------------------------------
    def accumulate(self) -> None:
        """Feed the training images to the scorer (and the drift collector) in one pass that
        also decodes the threshold images (kept preprocessed, to be scored once the model is
        fitted: their decoding overlaps the training compute). Unreadable images of either kind
        are listed in one error or skipped with a warning (``data.on_error``)."""
        det, train, held = self.det, self.plan.train, self.plan.held
        n_train = len(train)
        parts = Stopwatch(det.device)
        bar = tqdm(total=n_train + len(held), desc=f"fit {self.cfg.method}", unit="img",
                   disable=not self.progress, dynamic_ncols=True)
        for batch in det.batches([*train, *held]):
            parts.lap("waiting for images")
            for i, msg in batch.errors:
                self.errors["training" if i < n_train else "threshold"].append(msg)
            # batches come in item order and the training items come first: a prefix of each
            k = sum(i < n_train for i in batch.indices)
            if k < len(batch.indices):  # a copy, so that a mixed batch is not kept whole
                self.held_images.append(batch.images[k:].clone() if k else batch.images)
                self.held_sizes.extend(batch.sizes[k:])
            if k:
                emb = det.embed(batch.images[:k], sizes=batch.sizes[:k], scorer=self.scorer,
                                observe=self.collector)
                parts.lap("features")
                if self.plan.out_of_sample:
                    self.descriptors.append(descriptors_of(det, emb))
                self.used.extend(batch.indices[:k])
                self.scorer.partial_fit(emb)
                del emb
                parts.lap("statistics")
                self.n_used += k
            bar.update(len(batch.indices) + len(batch.errors))
        bar.close()
        report_unreadable(self.cfg, self.errors)
        self.clock.lap("accumulate")
        for name, seconds in parts.seconds.items():
            self.clock.add(f"accumulate: {name}", seconds)

    def add_shards(self, results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        """The accumulate step's outcome from the shards' :func:`fit_shard` results (in shard
        order): their errors and image counts, the drift statistics; returns the merged state
        (``Scorer.merge_states``)."""
        offset = 0
        for r in results:
            self.errors["training"].extend(r["errors"])
            self.n_used += int(r["n_used"])
            self.used.extend(offset + i for i in r.get("used", []))
            offset += int(r.get("n_items", 0))
            if r.get("descriptors") is not None:
                self.descriptors.append(np.asarray(r["descriptors"]))
        report_unreadable(self.cfg, self.errors)
        if self.collector is not None:
            self.collector = StatisticsCollector.merged(
                self.collector, [r["drift"] for r in results if r.get("drift") is not None])
        self.clock.lap("accumulate")
        merged = self.scorer.merge_states([r["state"] for r in results])
        self.clock.lap("merge")
        return merged

    def decode_held(self) -> None:
        """Decode the threshold images on this process (the sharded fit's driver)."""
        for batch in self.det.batches(self.plan.held):
            self.errors["threshold"].extend(msg for _, msg in batch.errors)
            if batch.indices:
                self.held_images.append(batch.images)
                self.held_sizes.extend(batch.sizes)
        report_unreadable(self.cfg, self.errors)

    # -- groups, finalize, threshold, reference ----------------------------------------------
    def names(self) -> Optional[List[str]]:
        """The file names of the images the fit read (None for in-memory images)."""
        items = [self.plan.train[i] for i in self.used]
        if not all(isinstance(it, (str, os.PathLike)) for it in items):
            return None
        return [Path(it).name for it in items]

    def set_groups(self) -> None:
        """All-images: the groups of images left out together (``threshold.groups``, near-
        duplicates), cut into folds for a cross-fitting scorer (``threshold.folds`` or the
        scorer's own); handed to the scorer before it finalises."""
        if not self.plan.out_of_sample or self.n_used < 2:
            return  # with fewer images, finalize says what is missing
        thr, names = self.cfg.threshold, self.names()
        desc = np.concatenate(self.descriptors) if self.descriptors else None
        self.descriptors, self.all_descriptors = [], desc
        grouping = find_groups(self.n_used, names, thr.groups, desc, thr.near_duplicates,
                               self.cfg.seed + SEED_GROUPS)
        n_folds = thr.folds or self.scorer.out_of_sample_folds
        folds = None if n_folds is None else blocked_folds(grouping.groups, n_folds)
        partition = grouping.groups if folds is None else folds
        per = tiled.units_per_image(self.det)  # a tiled scorer's samples: an image's units
        if per > 1 or int(np.bincount(partition).max()) > 1:  # not plain leave-one-out
            self.scorer.set_out_of_sample_groups(np.repeat(partition, per))
        self.cross_fit = describe_cross_fit(grouping, folds, names)
        if grouping.grouped_images:
            log.info("out-of-sample scores: %d of %d images share a group with another (%d "
                     "near-duplicate pairs)", grouping.grouped_images, self.n_used,
                     len(grouping.duplicate_pairs))
        self.clock.lap("groups")

    def finalize(self, merged: Optional[Dict[str, Any]] = None) -> None:
        """``scorer.finalize()``, or ``finalize_merged(merged)`` for a sharded fit."""
        if merged is None:
            self.scorer.finalize(progress=self.progress)
        else:
            self.scorer.finalize_merged(merged, self.det.device, progress=self.progress)
        self.clock.lap("finalize")
        for name, seconds in getattr(self.scorer, "finalize_timings_", {}).items():
            self.clock.add(f"finalize: {name}", seconds)

    def threshold_scores(self, second_pass: Optional[Callable[[Scorer, List[List[int]]],
                                                              List[List[float]]]] = None
                         ) -> List[float]:
        """The good images' scores the threshold is set from: out-of-sample scores of every
        training image (made by ``finalize``, else by a second pass over the units of
        :func:`second_pass_units`: ``second_pass(scorer, units)`` gives each unit's scores,
        by default :func:`out_of_sample_scores` here), or the held-out images' scores (the
        drift collector sees those too)."""
        det, scorer = self.det, self.scorer
        if self.plan.out_of_sample:
            patch = scorer.take_out_of_sample_scores()
            if patch is not None:
                good = det.image_scores_from_patches(patch)
            else:
                units = second_pass_units(scorer, self.n_used, self.cfg.data.batch_size,
                                          tiled.units_per_image(det))
                if second_pass is not None:
                    parts = second_pass(scorer, units)
                else:
                    parts = [out_of_sample_scores(det, scorer, self.unit_items(u), u)
                             for u in units]
                good = [0.0] * self.n_used
                for unit, part in zip(units, parts):
                    for i, v in zip(unit, part):
                        good[i] = v
            scorer.drop_out_of_sample_state()
        else:
            good = []
            images = torch.cat(self.held_images) if self.held_images else None
            sizes, self.held_images, self.held_sizes = self.held_sizes, [], []
            step = self.cfg.data.batch_size
            for lo in range(0, 0 if images is None else images.shape[0], step):
                good.extend(det.infer(images[lo:lo + step], sizes=sizes[lo:lo + step],
                                      scorer=scorer, observe=self.collector).scores.tolist())
        self.clock.lap("threshold")
        return good

    def unit_items(self, unit: Sequence[int]) -> List[Any]:
        """The training items of fit-order images ``unit``."""
        return [self.plan.train[self.used[i]] for i in unit]

    def defect_scores(self) -> None:
        """Score the labelled defective images of ``threshold.defects`` with the fitted model
        (not seen by the drift collector); unreadable ones as ``data.on_error`` says."""
        folder = self.cfg.threshold.defects
        if not folder:
            return
        self.defects = score_images(self.det, list_images(Path(folder)), self.scorer,
                                    self.errors["defect"])
        report_unreadable(self.cfg, {"defect": self.errors["defect"]})
        if not self.defects[0]:
            raise FitError(f"threshold.defects={folder}: none of its images could be read")
        self.clock.lap("defects")

    def complete(self, good: Sequence[float]) -> None:
        """The threshold and drift reference from ``good``; then every fitted attribute of
        the detector, at once."""
        det, cfg = self.det, self.cfg
        reference = drift.fit_reference(self.collector, good, cfg.monitor,
                                        cfg.seed + SEED_DRIFT)
        self.clock.lap("drift reference")
        if det.device.type == "cuda":
            # the fit's temporaries (patch buffers, coreset distances) go back to the driver
            # rather than staying reserved by this process for predict, which needs far less
            torch.cuda.empty_cache()
        threshold = calibrate_threshold(good, cfg.threshold, self.plan.source,
                                        defects=self.defects[0] if self.defects else None,
                                        provenance=self.provenance(len(good)))
        det.scorer_, det.threshold_, det.memory_estimate_ = self.scorer, threshold, self.memory
        det.drift_reference_ = reference
        det.monitor = None  # a monitor of the previous fit compares with its reference
        det.lineage_ = []  # a fit starts a new lineage (updates append to it)
        det.training_descriptors_ = (  # what an update groups the model's images by
            self.all_descriptors if self.scorer.keeps_training_embeddings
            and det.tiling is None else None)
        det.source_checksum = None  # saved by no file yet
        det.fit_info_ = {"n_train": self.n_used, "n_threshold": len(good),
                         "skipped": self.errors["training"] + self.errors["threshold"],
                         "threshold_source": self.plan.folder or self.plan.source,
                         "framing": tiled.framing_info(det), **self.info}
        # Timings are not saved: model files are byte-identical across fits.
        det.fit_timings_ = self.clock.as_dict(total=True)

    def provenance(self, n_good: int) -> Dict[str, Any]:
        """Which images set the threshold and how (stored with it)."""
        thr = self.cfg.threshold
        good: Dict[str, Any] = {"source": self.plan.folder or self.plan.source, "n": n_good}
        if self.plan.out_of_sample:
            good["out_of_sample"] = self.cross_fit
        out: Dict[str, Any] = {"set_by": "fit", "objective": str(thr.objective),
                               "good": good}
        if self.defects is not None:
            out["defects"] = {"source": str(thr.defects), "n": len(self.defects[0]),
                              "files": self.defects[1]}
        return out


def score_images(det: "Detector", items: Sequence[Any], scorer: Scorer,
                 errors: List[str]) -> Tuple[List[float], List[str]]:
    """Image scores of ``items`` with ``scorer`` (fitted) and the names of the images read;
    the unreadable ones' messages go to ``errors``."""
    scores: List[float] = []
    names: List[str] = []
    for batch in det.batches(items):
        errors.extend(msg for _, msg in batch.errors)
        if batch.indices:
            scores.extend(det.infer(batch.images, sizes=batch.sizes, scorer=scorer,
                                    observe=lambda *a: None)
                          .scores.tolist())
            names.extend(_name(items[i]) for i in batch.indices)
    return scores, names


def _name(item: Any) -> str:
    return Path(item).name if isinstance(item, (str, os.PathLike)) else "<in memory>"
