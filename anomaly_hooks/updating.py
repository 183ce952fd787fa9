"""Model updates from new good images, without the images the model was fitted on.

    det = Detector.load("models/padim.safetensors", for_update=True)
    det.update("new_good/")                        # in place; returns det
    det.save("models/padim-2.safetensors")

``anomaly-hooks update --model M --good DIR [DIR ...] --out M2`` does the same from the shell.

An update is a fit sharded in two (the merge of the sharded fit, ``distributed``): the model's
own state (``Scorer.fitted_state``) and a shard of the new images (``begin_update`` ->
``partial_fit`` -> ``partial_state``), merged by ``Scorer.merge_states`` and fitted on a fresh
scorer by ``finalize_merged``:

* **PaDiM**: exact. The low-rank form keeps its centred samples; the dense form, with an
  all-images threshold and at most ``2 D`` images, its training embeddings
  (``padim.keep_embeddings``: the merge joins them with the new images', and the Gaussians are
  made from all of them, as the fit makes them: the refit's factors bit for bit), else its
  mean, the factor of the regularised covariance and the image count ``n_train``, from which
  the sums ``S1``, ``S2`` come back (``epsilon I`` taken off again) for the sharded fit's exact
  re-shift. Where the model keeps its embeddings and the update every sample, the new scorer
  joins them in place instead of a merge (``Scorer.joins`` / ``Scorer.join``: read from a
  loaded model's file straight into the sample store the new images join, beside their
  pass); else a loaded model's kept embeddings are read from its file once
  (``Scorer.holding_on_demand``). The updated model equals a fit on all the images up to
  float32 rounding (``tests/test_updating.py``: image scores within 1e-4 relative), in the
  form that fit would choose (``covariance: auto`` crossing its limit turns the low-rank
  samples into sums).
* **PatchCore**: merge-reduce. The new bank is the greedy k-center coreset of the current bank
  and every patch of the new images, of the size a fit on all the images' patches keeps
  (``coreset_ratio`` of them, or ``coreset_count``): the bank never exceeds the configured size.
  Every patch seen by a fit is within the old bank's radius plus the new selection's radius of
  the new bank (the sharded fit's bound, ``scorers/patchcore/partial.py``); the new images'
  patches, candidates themselves, within the new selection's radius.

**Threshold**: the model's out-of-sample rule over all the good images. ``all-images``: the
stored out-of-sample scores of the images already in the model (the threshold keeps them) and
the new images scored by the updated model as if unseen (PaDiM: exact leave-one(-group)-out;
PatchCore: cross-fitted folds of the new images, each scored by the bank selected without its
fold, from the new patches the merged state holds, no image read twice; the images already in
the model form one more fold, never scored). The stored scores came
from the model of their time, fitted on fewer images: higher than a refit would give them, so
the threshold leans to fewer false alarms. Where the model keeps every image's embeddings
(PaDiM low-rank, PaDiM dense with ``padim.keep_embeddings``), every image is grouped and scored
afresh instead, from those embeddings (the model's images are not read again): the threshold
is then a refit's. ``holdout``: the new images are split by the
same rule, their held part scored by the updated model and added to the stored held-out scores;
``threshold.folder``: that folder scored again. The labelled defects given to the update
(``defects``: the results an operator labelled defect, :mod:`anomaly_hooks.learning`) or else
those of ``threshold.defects`` (when the folder is there) are scored by the updated model.
The threshold is then chosen as a fit chooses it
(``calibrate_threshold``, the config's objective and rate).

**Drift reference**: the new images' statistics pooled in (``DriftReference.updated``).

**Lineage**: each update appends ``{parent_checksum, images_added, labels_used, time}`` (and
``source``, where the images came from, when the caller gives it: the results log of an update
from labelled results) to the model's ``lineage_`` (saved in the model file's metadata, checked by
``modelmeta.check_lineage``); a fit starts a new one.

Refused with a :class:`FitError` that says what to do: tiled (high-resolution) models, models
without the statistics (PaDiM with float16 factors, a threshold without stored good scores, a
PatchCore bank without its images' ids where the threshold needs them).
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from anomaly_hooks.data import list_images, resolve_items
from anomaly_hooks.devices import ieee_float32
from anomaly_hooks.errors import FitError, NotFittedError
from anomaly_hooks.fitting import (
    SEED_DRIFT,
    SEED_GROUPS,
    describe_cross_fit,
    descriptors_of,
    new_collector,
    out_of_sample_scores,
    report_unreadable,
    score_images,
    split_holdout,
)
from anomaly_hooks.grouping import blocked_folds, find_groups, image_descriptors
from anomaly_hooks.modelmeta import check_lineage_source
from anomaly_hooks.monitor import fitting as drift
from anomaly_hooks.resources import check_fit_memory
from anomaly_hooks.scorers import Scorer, get_scorer
from anomaly_hooks.threshold import calibrate_threshold
from anomaly_hooks.threshold import out_of_sample as threshold_out_of_sample
from anomaly_hooks.timing import Stopwatch

if TYPE_CHECKING:
    from anomaly_hooks.detector import Detector

log = logging.getLogger(__name__)


def check_updatable(det: "Detector") -> None:
    """Raise :class:`FitError` (saying what to do) unless ``det`` can be updated: fitted,
    not tiled, with the good scores its threshold rule adds to."""
    if not det.is_fitted:
        raise NotFittedError("this Detector is not fitted: fit() or Detector.load() a model "
                             "before update()")
    if det.tiling is not None:
        raise FitError("a tiled (high-resolution) model cannot be updated yet: refit it on all "
                       "the good images (old and new)")
    thr = det.threshold_
    if not thr.scores and not det.cfg.threshold.folder:
        raise FitError("this model's threshold stores no good scores (a file written before "
                       "they were saved): refit it on all the good images to update it later")


def update(det: "Detector", source: Any, *, progress: bool = False,
           parent_checksum: Optional[str] = None, defects: Optional[Sequence[Any]] = None,
           lineage_source: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Update the fitted ``det`` in place with the good images ``source`` (a folder, an MVTec
    root, a list of paths or folders, an iterable of images): see the module docstring.
    ``parent_checksum``: the checksum of the model file ``det`` was loaded from (default: the
    one it had when loaded or saved, else that of its content as :meth:`Detector.save` would
    write it). ``defects``: labelled defective images (paths or images) for the threshold, in
    place of ``threshold.defects``. ``lineage_source``: where the images came from, recorded
    as the lineage entry's ``source`` (:func:`~anomaly_hooks.modelmeta.check_lineage`).
    Returns the lineage entry added. A failed update leaves ``det`` as it was."""
    check_updatable(det)
    run = UpdateRun(det, source, progress=progress, parent_checksum=parent_checksum,
                    defects=defects, lineage_source=lineage_source)
    # the state a loaded model left in its file (PaDiM's kept embeddings): read straight into
    # the new scorer's state where it joins the model's images (Scorer.join), else read from
    # the file once for the whole update (its state, its images' grouping, their scores)
    with nullcontext() if run.joins else det.scorer_.holding_on_demand():
        return run.run()


class UpdateRun:
    """One update of ``det`` with the good images ``source`` (see the module docstring)."""

    def __init__(self, det: "Detector", source: Any, *, progress: bool = False,
                 parent_checksum: Optional[str] = None, defects: Optional[Sequence[Any]] = None,
                 lineage_source: Optional[Dict[str, Any]] = None) -> None:
        check_updatable(det)
        if lineage_source is not None:
            check_lineage_source(lineage_source)
        self.defects = None if defects is None else list(defects)
        if self.defects is not None and not self.defects:
            raise FitError("defects=[]: give labelled defective images, or None to use "
                           "threshold.defects")
        self.lineage_source = lineage_source
        self.det, self.cfg, self.progress = det, det.cfg, progress
        self.clock = Stopwatch(det.device)
        # the parent, as it was: before anything changes
        self.parent = parent_checksum or det.source_checksum or det.checksum()
        items = resolve_items(source, training=True)
        thr = self.cfg.threshold
        self.out_of_sample = threshold_out_of_sample(thr)
        self.train, self.held = (items, []) if self.out_of_sample or thr.folder \
            else split_holdout(self.cfg, items)
        self.old: Scorer = det.scorer_
        self.n_old = int(self.old.n_train)
        # the scorer the new images go into: it joins the model's images in place, or its
        # state is merged with the model's (fitted_state, made in run)
        self.scorer = self.fresh_scorer()
        if self.out_of_sample:  # a shard of an out-of-sample fit (PaDiM dense: keeps samples)
            self.scorer.request_out_of_sample()
        self.scorer.begin_update(self.n_old, len(self.train))
        self.joins = self.scorer.joins(self.old)
        self.old_state: Optional[Dict[str, Any]] = None
        self.model_descriptors: Optional[np.ndarray] = None  # see model_state
        self.all_descriptors: Optional[np.ndarray] = None  # every image's (set by regroup)
        self.errors: Dict[str, List[str]] = {"training": [], "threshold": [], "defect": []}
        self.used: List[int] = []
        self.descriptors: List[np.ndarray] = []
        self.held_images: List[torch.Tensor] = []
        self.cross_fit: Dict[str, Any] = {}
        self.folds: Optional[int] = None  # the cross-fit's folds of the new images (None: none)
        self.rescored = False  # the model's images' scores made afresh (rescore_model_images)
        self.regrouped = False  # every image grouped afresh (regroup)
        self.collector = new_collector(det) if det.drift_reference_ is not None else None
        self.clock.lap("plan")

    def model_state(self) -> None:
        """What the update reads of the model: its state (unless the new scorer joins its
        images) and its images' grouping descriptors, where the scorer keeps their embeddings
        and no file-name pattern groups them (their names are gone): every image is then
        grouped and scored out of sample afresh, as a fit on all of them would (set_groups)."""
        det, thr = self.det, self.cfg.threshold
        if not self.joins:
            self.old_state = self.old.fitted_state()
        if self.out_of_sample and not thr.groups and self.old.keeps_training_embeddings:
            self.model_descriptors = det.training_descriptors_  # as the fit computed them
            if self.model_descriptors is None:  # a file without them: pooled again
                self.model_descriptors = image_descriptors(self.old.training_embeddings())
        self.clock.lap("model state")

    def fresh_scorer(self) -> Scorer:
        """A fresh seeded scorer of the config's method with the model's own embedder (the
        channel subset or projection the model was fitted with, as loaded)."""
        scorer = self.det.new_scorer()
        scorer.embedder = self.old.embedder
        return scorer

    def run(self) -> Dict[str, Any]:
        """Accumulate the new images, merge, finalize, threshold, drift reference; then set
        the detector's fitted attributes, all at once."""
        det, cfg = self.det, self.cfg
        check_fit_memory(get_scorer(cfg.method), cfg, det.layer_info,
                         det.preprocessor.input_size, self.n_old + len(self.train), det.device,
                         n_threshold=len(self.held))
        with ieee_float32():
            merged = self.accumulate()
            scorer = self.finalize(merged)
            new_good = self.threshold_scores(scorer)
            defects = self.defect_scores(scorer)
        return self.complete(scorer, new_good, defects)

    # -- the new images ------------------------------------------------------------------------
    def accumulate(self) -> Dict[str, Any]:
        """The new training images through the model's embedder into a fresh scorer (and the
        drift collector), the held-out ones decoded in the same pass; the merged state."""
        det, train, held, scorer = self.det, self.train, self.held, self.scorer
        self.model_state()
        bar = tqdm(total=len(train) + len(held), desc=f"update {self.cfg.method}", unit="img",
                   disable=not self.progress, dynamic_ncols=True)
        parts = Stopwatch(det.device)  # as the fit's accumulate step reports them
        with ThreadPoolExecutor(1, thread_name_prefix="update-join") as pool:
            # the model's images read into the new scorer beside the new images' pass
            joining = pool.submit(scorer.join(self.old)) if self.joins else None
            for batch in det.batches([*train, *held]):
                parts.lap("waiting for images")
                for i, msg in batch.errors:
                    self.errors["training" if i < len(train) else "threshold"].append(msg)
                k = sum(i < len(train) for i in batch.indices)
                if k < len(batch.indices):
                    self.held_images.append(batch.images[k:].clone() if k else batch.images)
                if k:
                    emb = det.embed(batch.images[:k], scorer=scorer, observe=self.collector)
                    parts.lap("features")
                    if self.out_of_sample:
                        self.descriptors.append(descriptors_of(det, emb))
                    scorer.partial_fit(emb)
                    self.used.extend(batch.indices[:k])
                    del emb
                    parts.lap("statistics")
                bar.update(len(batch.indices) + len(batch.errors))
            bar.close()
            if joining is not None:
                joining.result()  # re-raises its error
                parts.lap("waiting for the model's images")
        report_unreadable(self.cfg, self.errors)
        if not self.used:
            raise FitError("none of the new images could be used to update the model (all "
                           "unreadable, or all held out for the threshold): add good images")
        state = scorer.partial_state()
        self.clock.lap("accumulate")
        for name, seconds in parts.seconds.items():
            self.clock.add(f"accumulate: {name}", seconds)
        if self.joins:  # the state of all the images already
            return state
        merged = scorer.merge_states([self.old_state, state])
        self.old_state = None
        self.clock.lap("merge")
        return merged

    def names(self) -> Optional[List[str]]:
        """The file names of the new images used (None for in-memory images)."""
        items = [self.train[i] for i in self.used]
        if not all(isinstance(it, (str, os.PathLike)) for it in items):
            return None
        return [Path(it).name for it in items]

    def set_groups(self, scorer: Scorer) -> None:
        """All-images: which images the new images' out-of-sample scores leave out together.
        The new images are grouped as a fit groups them (file names, near-duplicates: among
        the new images only, the model's own images being gone); a cross-fitting scorer
        (``threshold.folds`` or its own ``K``) cuts them into blocked folds of about the size
        of a fit's folds on all the images, the images already in the model forming one more
        fold (never scored); otherwise each image already in the model is alone."""
        thr, n_new = self.cfg.threshold, len(self.used)
        names = self.names()
        desc = np.concatenate(self.descriptors) if self.descriptors else None
        self.descriptors = []
        n_folds = thr.folds or scorer.out_of_sample_folds
        self.folds = n_folds
        if self.model_descriptors is not None and desc is not None:
            self.regroup(scorer, np.concatenate([self.model_descriptors, desc]), n_folds)
            return
        grouping = None
        groups = np.arange(n_new)
        if n_new >= 2:
            grouping = find_groups(n_new, names, thr.groups, desc, thr.near_duplicates,
                                   self.cfg.seed + SEED_GROUPS)
            groups = grouping.groups
        folds = None
        if n_folds is None:
            partition = np.concatenate([np.arange(self.n_old), self.n_old + groups])
        else:
            # folds of about the size a fit on all the images cuts (n_total / K images each:
            # as many images, and their neighbours in the fit order, left out together); a few
            # new images are one fold, scored by the bank of the model's own images
            k = max(1, int(round(n_folds * n_new / (self.n_old + n_new))))
            folds = blocked_folds(groups, k)
            partition = np.concatenate([np.zeros(self.n_old, dtype=np.int64), 1 + folds])
        if int(np.bincount(partition).max()) > 1:
            scorer.set_out_of_sample_groups(partition)
        self.cross_fit = describe_cross_fit(grouping, folds, names)

    def regroup(self, scorer: Scorer, desc: np.ndarray, n_folds: Optional[int]) -> None:
        """All the images grouped and cut into folds as a fit on all of them does
        (``FitRun.set_groups``), from every image's descriptors."""
        n = desc.shape[0]
        self.all_descriptors = desc
        grouping = find_groups(n, None, None, desc, self.cfg.threshold.near_duplicates,
                               self.cfg.seed + SEED_GROUPS)
        folds = None if n_folds is None else blocked_folds(grouping.groups, n_folds)
        partition = grouping.groups if folds is None else folds
        if int(np.bincount(partition).max()) > 1:
            scorer.set_out_of_sample_groups(partition)
        self.cross_fit = describe_cross_fit(grouping, folds, None)
        self.regrouped = True

    def finalize(self, merged: Dict[str, Any]) -> Scorer:
        """A fresh scorer fitted from the merged state (with what the out-of-sample scores of
        the new images need)."""
        scorer = self.fresh_scorer()
        if self.out_of_sample:
            scorer.request_out_of_sample()
            self.set_groups(scorer)
        scorer.finalize_merged(merged, self.det.device, progress=self.progress)
        self.clock.lap("finalize")
        return scorer

    # -- threshold, defects ----------------------------------------------------------------------
    def threshold_scores(self, scorer: Scorer) -> List[float]:
        """The good scores the new threshold adds (or, for ``threshold.folder``, all of them)."""
        det, cfg = self.det, self.cfg
        if self.out_of_sample:
            n_new = len(self.used)
            # made by finalize: every image's, or (PatchCore) the new images' from their patches
            made = scorer.out_of_sample_made_from
            if made == 0 and self.rescore_model_images():
                good = det.image_scores_from_patches(scorer.take_out_of_sample_scores())
                self.rescored = True  # every image, afresh
            elif made is not None and made <= self.n_old and not self.regrouped:
                good = det.image_scores_from_patches(  # the new ones
                    scorer.take_out_of_sample_scores(self.n_old))
            elif self.regrouped:  # groups across old and new images: every image, in one call
                good = self.second_pass_all(scorer)
                self.rescored = True
            else:
                good = out_of_sample_scores(det, scorer, [self.train[i] for i in self.used],
                                            range(self.n_old, self.n_old + n_new))
            scorer.drop_out_of_sample_state()
        elif cfg.threshold.folder:
            folder = Path(cfg.threshold.folder)
            if not folder.is_dir():
                raise FitError(f"threshold.folder={folder}: not a folder here; the updated "
                               "model's threshold scores it again: restore it, or refit")
            good, _ = score_images(det, list_images(folder), scorer, self.errors["threshold"])
            report_unreadable(cfg, {"threshold": self.errors["threshold"]})
        else:
            good = []
            images = torch.cat(self.held_images) if self.held_images else None
            self.held_images = []
            step = cfg.data.batch_size
            for lo in range(0, 0 if images is None else images.shape[0], step):
                good.extend(det.infer(images[lo:lo + step], scorer=scorer,
                                      observe=self.collector).scores.tolist())
        self.clock.lap("threshold")
        return good

    def second_pass_all(self, scorer: Scorer) -> List[float]:
        """Out-of-sample scores of every image (the model's from the embeddings it keeps, the
        new ones embedded again), in one call: whole groups, as the fit's second pass."""
        det = self.det
        embs = [self.old.training_embeddings().to(det.device)]
        for batch in det.batches([self.train[i] for i in self.used]):
            if batch.errors:
                raise FitError("a new image could not be read again for its out-of-sample "
                               "score: " + "; ".join(m for _, m in batch.errors))
            embs.append(det.embed(batch.images, scorer=scorer))
        emb = torch.cat(embs)
        del embs
        with torch.inference_mode():
            patch = scorer.out_of_sample_scores(emb, list(range(emb.shape[0])))
        return det.image_scores_from_patches(patch)

    def rescore_model_images(self) -> bool:
        """Whether the out-of-sample scores ``finalize`` made for the images already in the
        model replace their stored ones: where the model's images were each left out alone
        (its threshold's provenance says so, and the update leaves them alone too), they are
        those images' scores under the rule of a fit on all the images (PaDiM's low-rank
        form: exact leave-one-out of every sample)."""
        if self.regrouped:
            return True
        prov = self.det.threshold_.provenance or {}
        scheme = str(((prov.get("good") or {}).get("out_of_sample") or {}).get("scheme", ""))
        return (self.folds is None and scheme.startswith("leave-one-image-out")
                and len(self.det.threshold_.scores or []) == self.n_old)

    def defect_scores(self, scorer: Scorer) -> Optional[List[float]]:
        """The labelled defects of ``threshold.defects`` scored by the updated model, where
        the folder is here; without it, an objective that needs them is an error."""
        thr = self.cfg.threshold
        if self.defects is not None:  # given: the operator's labelled defects
            scores, _ = score_images(self.det, self.defects, scorer, self.errors["defect"])
            report_unreadable(self.cfg, {"defect": self.errors["defect"]})
            if not scores:
                raise FitError("none of the labelled defective images could be read")
            self.clock.lap("defects")
            return scores
        folder = Path(thr.defects) if thr.defects else None
        if folder is not None and folder.is_dir():
            scores, _ = score_images(self.det, list_images(folder), scorer,
                                     self.errors["defect"])
            report_unreadable(self.cfg, {"defect": self.errors["defect"]})
            if not scores:
                raise FitError(f"threshold.defects={folder}: none of its images could be read")
            self.clock.lap("defects")
            return scores
        if str(thr.objective) != "far":
            raise FitError(f"threshold.objective={thr.objective} chooses the threshold from "
                           f"labelled defects, scored by the updated model: "
                           f"threshold.defects={thr.defects} is not a folder here")
        if self.det.threshold_.defect_scores:
            log.warning("threshold.defects=%s is not a folder here: the updated threshold "
                        "records no recall on labelled defects", thr.defects)
        return None

    # -- the end ---------------------------------------------------------------------------------
    def complete(self, scorer: Scorer, new_good: List[float],
                 defects: Optional[List[float]]) -> Dict[str, Any]:
        """The threshold, the drift reference and the lineage entry; then every fitted
        attribute of the detector at once. Returns the lineage entry."""
        det, cfg = self.det, self.cfg
        old = det.threshold_
        # threshold.folder: the folder, scored again, is every threshold image
        stored = [] if cfg.threshold.folder or self.rescored else list(old.scores or [])
        good = [*stored, *new_good]
        prov: Dict[str, Any] = {
            "set_by": "update", "objective": str(cfg.threshold.objective),
            "parent": {"checksum": self.parent},
            "good": {"source": old.source, "n": len(good), "stored": len(stored),
                     "scored": len(new_good)}}
        if self.out_of_sample:
            prov["good"]["out_of_sample"] = self.cross_fit
        if defects is not None:
            prov["defects"] = {"source": "labelled defects given to the update"
                               if self.defects is not None else str(cfg.threshold.defects),
                               "n": len(defects)}
        threshold = calibrate_threshold(good, cfg.threshold, old.source, defects=defects,
                                        provenance=prov)
        reference = drift.update_reference(det.drift_reference_, self.collector, good,
                                           cfg.monitor, cfg.seed + SEED_DRIFT)
        self.clock.lap("drift reference")
        if det.device.type == "cuda":
            torch.cuda.empty_cache()
        entry = {"parent_checksum": self.parent, "images_added": len(self.used),
                 "labels_used": len(defects or []),
                 "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        if self.lineage_source is not None:
            entry["source"] = dict(self.lineage_source)
        info = dict(det.fit_info_)
        skipped = [*info.get("skipped", []), *self.errors["training"],
                   *self.errors["threshold"]]
        det.scorer_, det.threshold_, det.drift_reference_ = scorer, threshold, reference
        det.monitor = None  # a monitor of the previous model compares with its reference
        det.fit_info_ = {**info, "n_train": int(scorer.n_train), "n_threshold": len(good),
                         "skipped": skipped}
        det.lineage_ = [*det.lineage_, entry]
        det.training_descriptors_ = (self.all_descriptors if scorer.keeps_training_embeddings
                                     else None)
        det.source_checksum = None
        det.update_timings_ = self.clock.as_dict(total=True)
        return entry
