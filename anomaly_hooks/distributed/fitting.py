"""Sharded fit on Ray: the fit run of :class:`anomaly_hooks.fitting.FitRun`, with its
accumulate step (and the second pass of out-of-sample scores) on actors.

    det = fit(cfg, "data/sample", num_workers=2)     # a fitted Detector, as Detector.fit gives

* The driver makes the run's plan (the same items, threshold split and image-count rule as
  ``Detector.fit``); for a tiled (high-resolution) model that includes the working frame,
  decided from the training images' size as ``Detector.fit`` decides it, and every actor
  embeds at that frame (:func:`anomaly_hooks.tiling.detector.attach`). The training list is
  cut into contiguous shards whose boundaries are multiples of ``data.batch_size``: every
  shard's batches are the single-process fit's batches (same embeddings), and shards in order
  are the training list in order.
* ``num_workers`` actors (:class:`FitWorker`) each build the backbone once; shard ``i`` goes to
  actor ``i % num_workers`` and runs :func:`anomaly_hooks.fitting.fit_shard` from a fresh
  scorer: its partial state (numpy arrays, ``Scorer.partial_state``) and its drift statistics.
  A retried task recomputes its shard from scratch, so a shard is counted once whatever dies.
  A dead actor is rebuilt (``max_restarts=-1``) and its pending tasks re-run, at most
  ``MAX_TASK_RETRIES`` times (a shard that kills its process every time fails the fit).
* The driver merges the states in shard order, finds the groups of images left out together
  (from the file names and the shards' image descriptors, :mod:`anomaly_hooks.grouping`) and
  finalises. With ``threshold.mode: all-images`` the training images' out-of-sample scores come
  from the finalised scorer (PaDiM's low-rank form makes them there) or from a second pass on
  the actors over units of whole groups (:func:`anomaly_hooks.fitting.second_pass_units`), each
  actor given the fitted scorer's state and what the second pass needs beyond it (the groups;
  PatchCore's fold banks, selected on the driver from the merged candidates of the other
  folds); with a hold-out the driver scores the held images. The driver scores the labelled
  defects (``threshold.defects``). Then the threshold and the drift reference, as in every
  fit.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from anomaly_hooks.config import load_config, to_container
from anomaly_hooks.detector import Detector
from anomaly_hooks.devices import ieee_float32
from anomaly_hooks.distributed.cluster import connect, maybe_die, require_ray
from anomaly_hooks.errors import ConfigError, FitError
from anomaly_hooks.fitting import FitRun, fit_shard, out_of_sample_scores
from anomaly_hooks.framing import Frame
from anomaly_hooks.heap import keep_freed_memory
from anomaly_hooks.scorers import Scorer, get_scorer
from anomaly_hooks.tiling import detector as tiled

MAX_TASK_RETRIES = 3
log = logging.getLogger("anomaly_hooks")


Payload = Tuple[Dict[str, np.ndarray], Dict[str, Any], Dict[str, np.ndarray]]


def _arrays(tensors: Dict[str, torch.Tensor]) -> Dict[str, np.ndarray]:
    return {k: v.detach().cpu().contiguous().numpy() for k, v in tensors.items()}


def _tensors(arrays: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v)) for k, v in arrays.items()}  # writable copies


def scorer_payload(scorer: Scorer) -> Payload:
    """A fitted scorer's state as numpy arrays and JSON-able metadata, and what its second
    pass of out-of-sample scores needs beyond it (what an actor rebuilds it from, through
    Ray's object store)."""
    tensors, meta = scorer.state()
    return _arrays(tensors), meta, _arrays(scorer.out_of_sample_state())


def scorer_from_payload(det: Detector, payload: Payload) -> Scorer:
    """The fitted scorer of :func:`scorer_payload`, on ``det``'s device."""
    arrays, meta = payload[0], payload[1]
    cfg = det.cfg
    scorer = get_scorer(cfg.method).from_state(cfg[cfg.method], det.layer_info,
                                               _tensors(arrays), meta, det.device)
    if len(payload) > 2 and payload[2]:
        scorer.load_out_of_sample_state(_tensors(payload[2]))
    return scorer


class FitWorker:
    """Ray actor: builds the detector (backbone, hooks) once and runs shards on request.
    ``frame``: a tiled model's working frame (``Frame.as_dict``), the driver's decision."""

    def __init__(self, cfg: Dict[str, Any], device: str, threads: int,
                 frame: Optional[Dict[str, Any]] = None) -> None:
        torch.set_num_threads(max(1, threads))
        self.det = Detector(load_config(cfg), device=device)
        if frame is not None:
            tiled.attach(self.det, Frame.from_dict(frame))

    def pid(self) -> int:
        return os.getpid()

    def fit_shard(self, items: List[str], n_total: int, shard: int,
                  descriptors: bool = False) -> Dict[str, Any]:
        # tests: die mid-shard, after a batch's work (a no-op unless the fault hook is set)
        with keep_freed_memory():  # a job, as Detector.fit is
            out = fit_shard(self.det, items, n_total,
                            on_batch=lambda b: maybe_die([shard]) if b == 0 else None,
                            descriptors=descriptors)
        return {**out, "pid": os.getpid()}

    def out_of_sample(self, payload: Any, items: List[str], images: List[int]) -> List[float]:
        with keep_freed_memory():
            with ieee_float32():
                scorer = scorer_from_payload(self.det, payload)
            return out_of_sample_scores(self.det, scorer, items, images)


def shard_bounds(n: int, n_shards: int, align: int) -> List[Tuple[int, int]]:
    """Contiguous ``[lo, hi)`` ranges covering ``n`` items, boundaries multiples of ``align``
    (fewer shards than asked when there are fewer batches)."""
    blocks = -(-n // align)
    n_shards = max(1, min(n_shards, blocks))
    cuts = [round(i * blocks / n_shards) * align for i in range(n_shards)] + [n]
    return [(min(lo, n), min(hi, n)) for lo, hi in zip(cuts[:-1], cuts[1:]) if lo < hi]


def fit(cfg: Any, source: Any = None, *, address: Optional[str] = None, num_workers: int = 2,
        gpus_per_worker: float = 0, cpus_per_worker: float = 1, shards_per_worker: int = 1,
        progress: bool = False) -> Detector:
    """Fit on Ray; returns a fitted :class:`Detector` (the driver builds the backbone too, for
    its own threshold images). ``source``: the training images (default ``data.train``).
    ``fit_timings_`` holds the seconds of each step, ``fit_info_`` the shards and workers."""
    if num_workers < 1 or shards_per_worker < 1:
        raise ConfigError("num_workers and shards_per_worker must be >= 1")
    cfg = load_config(cfg)
    require_ray()
    ray = connect(address)
    det = Detector(cfg)
    run = FitRun(det, source if source is not None else cfg.data.train, progress=progress)
    # a tiled model's frame, decided here; the driver's merge and finalisation are a job
    with tiled.frame_for_fit(det, run.frame), keep_freed_memory():
        _fit_on_actors(ray, det, run, num_workers=num_workers, gpus_per_worker=gpus_per_worker,
                       cpus_per_worker=cpus_per_worker, shards_per_worker=shards_per_worker)
    return det


def _fit_on_actors(ray: Any, det: Detector, run: FitRun, *, num_workers: int,
                   gpus_per_worker: float, cpus_per_worker: float,
                   shards_per_worker: int) -> None:
    """The run's accumulate (and second pass) on actors, the rest on the driver."""
    cfg = det.cfg
    train = [str(p) for p in run.plan.train]
    bounds = shard_bounds(len(train), num_workers * shards_per_worker, cfg.data.batch_size)
    actor = ray.remote(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, max_restarts=-1,
                       max_task_retries=MAX_TASK_RETRIES)(FitWorker)
    device = "cuda" if gpus_per_worker else "cpu"
    frame = run.frame.as_dict() if run.frame is not None else None
    workers = [actor.remote(to_container(cfg), device, max(1, int(cpus_per_worker)), frame)
               for _ in range(min(num_workers, len(bounds)))]
    describe = bool(run.plan.out_of_sample and cfg.threshold.near_duplicates)
    try:
        results = _on_actors(ray, [workers[i % len(workers)].fit_shard.remote(
            train[lo:hi], len(train), i, describe) for i, (lo, hi) in enumerate(bounds)])
        merged = run.add_shards(results)
        run.set_groups()
        run.finalize(merged)
        del merged
        if not run.plan.out_of_sample:
            run.decode_held()

        def second_pass(scorer: Scorer, units: List[List[int]]) -> List[List[float]]:
            payload = ray.put(scorer_payload(scorer))
            return _on_actors(ray, [workers[i % len(workers)].out_of_sample.remote(
                payload, [str(p) for p in run.unit_items(u)], u) for i, u in enumerate(units)])

        with ieee_float32():
            good = run.threshold_scores(second_pass)
            run.defect_scores()
    finally:
        for w in workers:
            ray.kill(w)
    run.info.update(shards=len(bounds), workers=len(workers),
                    worker_pids=sorted({r["pid"] for r in results}))
    run.complete(good)


def _on_actors(ray: Any, refs: Sequence[Any]) -> List[Any]:
    """``ray.get`` of actor tasks, in order; a task whose actor died on every retry is a
    :class:`FitError`."""
    try:
        return ray.get(list(refs))
    except ray.exceptions.RayActorError as exc:
        raise FitError(f"a fit worker died {MAX_TASK_RETRIES + 1} times on the same shard "
                       f"(out of memory? a crash in native code?): {exc}") from None
