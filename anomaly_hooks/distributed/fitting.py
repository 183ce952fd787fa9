"""Sharded fit on Ray: each actor fits shards into mergeable partial states; the driver merges,
finalises and sets the threshold.

    det = fit(cfg, "data/sample", num_workers=2)     # a fitted Detector, as Detector.fit gives

* The driver resolves the items and makes ``Detector.fit``'s training / threshold split (same
  seed). The training list is cut into contiguous shards whose boundaries are multiples of
  ``data.batch_size``: every shard's batches are the single-process fit's batches (same
  embeddings), and shards in order are the training list in order.
* ``num_workers`` actors (:class:`FitWorker`) each build the backbone once; shard ``i`` goes to
  actor ``i % num_workers``. A shard task starts from a fresh scorer and returns its partial
  state (numpy arrays, ``Scorer.partial_state``), so a retried task recomputes its shard from
  scratch and a shard is counted once whatever dies. A dead actor is rebuilt
  (``max_restarts=-1``) and its pending tasks re-run, at most ``MAX_TASK_RETRIES`` times (a
  shard that kills its process every time fails the fit instead of looping).
* The driver merges the states in shard order (``Scorer.merge_states``), finalises
  (``Scorer.finalize_merged``), then scores the threshold images (decoded on the driver).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from anomaly_hooks.config import load_config, to_container
from anomaly_hooks.data import iter_batches, resolve_items
from anomaly_hooks.detector import Detector
from anomaly_hooks.devices import ieee_float32
from anomaly_hooks.distributed.cluster import connect, maybe_die, require_ray
from anomaly_hooks.errors import ConfigError, FitError
from anomaly_hooks.scorers import Scorer
from anomaly_hooks.threshold import calibrate_threshold, out_of_sample

MAX_TASK_RETRIES = 3
log = logging.getLogger("anomaly_hooks")


def new_scorer(det: Detector) -> Scorer:
    """A fresh, unfitted scorer of the detector's method (the single-process fit's seed)."""
    return det._new_scorer()


def fit_shard(det: Detector, items: List[str], n_total: int, shard: int = 0) -> Dict[str, Any]:
    """Partial fit of one shard on a built detector (Ray-free: the actor and the tests call
    it): ``{"state": partial state or None, "errors": [...], "n_used": int, "pid": int}``."""
    data = det.cfg.data
    scorer = new_scorer(det)
    scorer.begin_shard(n_total, len(items))
    errors: List[str] = []
    n_used = 0
    with ieee_float32():
        for b, batch in enumerate(iter_batches(items, det.preprocessor,
                                               batch_size=data.batch_size,
                                               num_workers=data.num_workers,
                                               max_pixels=data.max_pixels)):
            if b == 1:
                maybe_die([shard])  # tests: die mid-shard, after a batch's work
            errors.extend(msg for _, msg in batch.errors)
            if batch.indices:
                scorer.partial_fit(det._embed(scorer, batch.images))
                n_used += len(batch.indices)
    state = scorer.partial_state() if n_used else None
    return {"state": state, "errors": errors, "n_used": n_used, "pid": os.getpid()}


class FitWorker:
    """Ray actor: builds the detector (backbone, hooks) once and fits shards on request."""

    def __init__(self, cfg: Dict[str, Any], device: str, threads: int) -> None:
        torch.set_num_threads(max(1, threads))
        self.det = Detector(load_config(cfg), device=device)

    def pid(self) -> int:
        return os.getpid()

    def fit_shard(self, items: List[str], n_total: int, shard: int) -> Dict[str, Any]:
        return fit_shard(self.det, items, n_total, shard)


def shard_bounds(n: int, n_shards: int, align: int) -> List[Tuple[int, int]]:
    """Contiguous ``[lo, hi)`` ranges covering ``n`` items, boundaries multiples of ``align``
    (fewer shards than asked when there are fewer batches)."""
    blocks = -(-n // align)
    n_shards = max(1, min(n_shards, blocks))
    cuts = [round(i * blocks / n_shards) * align for i in range(n_shards)] + [n]
    return [(min(lo, n), min(hi, n)) for lo, hi in zip(cuts[:-1], cuts[1:]) if lo < hi]


def _with_holdout(cfg: Any) -> Any:
    """The config a sharded fit runs: ``threshold.mode=all-images`` needs every training
    image's out-of-sample score, which the merged states do not give, so the threshold comes
    from the hold-out (or ``threshold.folder``); the model file records the mode used."""
    if out_of_sample(cfg.threshold):
        log.warning("a sharded fit sets its threshold from a hold-out of %.0f %% of the good "
                    "images (threshold.mode=holdout): the merged shards give no out-of-sample "
                    "scores", 100 * cfg.threshold.holdout_fraction)
        cfg.threshold.mode = "holdout"
    return cfg


def fit(cfg: Any, source: Any = None, *, address: Optional[str] = None, num_workers: int = 2,
        gpus_per_worker: float = 0, cpus_per_worker: float = 1, shards_per_worker: int = 1,
        progress: bool = False) -> Detector:
    """Fit on Ray; returns a fitted :class:`Detector` (the driver builds the backbone too, for
    the threshold images). ``source``: the training images (default ``data.train``).
    ``fit_timings_`` holds the seconds of each step and ``fit_info_`` the shard count."""
    if num_workers < 1 or shards_per_worker < 1:
        raise ConfigError("num_workers and shards_per_worker must be >= 1")
    require_ray()
    cfg = _with_holdout(load_config(cfg))
    ray = connect(address)
    clock = {"start": time.perf_counter()}
    det = Detector(cfg)
    items = resolve_items(source if source is not None else cfg.data.train, training=True)
    train, held = det._split(items)
    scorer = new_scorer(det)
    if len(train) < scorer.min_train_images:
        raise FitError(f"{cfg.method} needs at least {scorer.min_train_images} training images "
                       f"after the threshold hold-out; got {len(train)}")
    train = [str(p) for p in train]
    bounds = shard_bounds(len(train), num_workers * shards_per_worker, cfg.data.batch_size)
    actor = ray.remote(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, max_restarts=-1,
                       max_task_retries=MAX_TASK_RETRIES)(FitWorker)
    device = "cuda" if gpus_per_worker else "cpu"
    workers = [actor.remote(to_container(cfg), device, max(1, int(cpus_per_worker)))
               for _ in range(min(num_workers, len(bounds)))]
    try:
        refs = [workers[i % len(workers)].fit_shard.remote(train[lo:hi], len(train), i)
                for i, (lo, hi) in enumerate(bounds)]
        results = ray.get(refs)  # in shard order
    except ray.exceptions.RayActorError as exc:
        raise FitError(f"a fit worker died {MAX_TASK_RETRIES + 1} times on the same shard "
                       f"(out of memory? a crash in native code?): {exc}") from None
    finally:
        for w in workers:
            ray.kill(w)
    clock["shards"] = time.perf_counter()
    errors = [e for r in results for e in r["errors"]]
    merged = scorer.merge_states([r.pop("state") for r in results])
    clock["merge"] = time.perf_counter()
    scorer.finalize_merged(merged, det.device, progress=progress)
    del merged
    clock["finalize"] = time.perf_counter()
    held_images, held_errors = _decode(det, held)
    det._handle_errors({"training": errors, "threshold": held_errors})
    good = det._score_images(scorer, held_images)
    clock["threshold"] = time.perf_counter()
    det.scorer_ = scorer
    det.threshold_ = calibrate_threshold(good, cfg.threshold,
                                         "folder" if cfg.threshold.folder else "holdout")
    det.drift_reference_ = None  # the shards' statistics are not gathered (yet)
    det.fit_info_ = {"n_train": scorer.n_train, "n_threshold": len(good),
                     "skipped": errors + held_errors,
                     "threshold_source": cfg.threshold.folder or "holdout"}
    steps = list(clock)
    det.fit_timings_ = {k: clock[k] - clock[p] for p, k in zip(steps[:-1], steps[1:])}
    det.fit_timings_.update(total=clock["threshold"] - clock["start"], shards=len(bounds),
                            workers=len(workers),
                            worker_pids=sorted({r["pid"] for r in results}))
    return det


def _decode(det: Detector, items: List[Any]) -> Tuple[List[torch.Tensor], List[str]]:
    """Preprocessed batches ``[b, 3, h, w]`` of ``items`` and the messages of unreadable ones."""
    data = det.cfg.data
    images, errors = [], []
    for batch in iter_batches(items, det.preprocessor, batch_size=data.batch_size,
                              num_workers=data.num_workers, max_pixels=data.max_pixels):
        errors.extend(msg for _, msg in batch.errors)
        if batch.indices:
            images.append(batch.images)
    return images, errors
