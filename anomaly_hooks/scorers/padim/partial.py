"""PaDiM's mergeable fit state, for fits sharded over processes or machines.

Every shard uses the covariance form a single-process fit on *all* the training images would use
(decided from the total, :func:`~anomaly_hooks.scorers.padim.gaussians.choose_covariance`).

* **dense**: per position the shift ``K`` ``[P, D]`` float32, ``S1 = sum(x - K)`` ``[P, D]``
  float64 and ``S2 = sum (x - K)(x - K)^T`` ``[P, D, D]`` float32 (the accumulator's own sums).
  Merging re-shifts every state onto the first state's ``K`` (exact algebra)::

      d = K_b - K,   S1' = S1_b + n_b d,   S2' = S2_b + S1_b d^T + d S1_b^T + n_b d d^T

  then adds. The first shard's shift is the single-process fit's (its first batch's mean), and
  the others' shifts are batch means too, so ``d`` is small and the update adds little rounding.
* **low-rank**: the shard's raw training embeddings ``[P, n_s, D]``; the merge concatenates them
  in shard order. Shards are contiguous runs of the training list, so the merged samples are
  the single-process fit's samples in the same order and the fitted model is bit-identical.

A *fitted* model gives the state of its training images back (:func:`fitted_state`, for
updates on new images, :mod:`anomaly_hooks.updating`): the low-rank form keeps its centred
samples ``Y`` and mean, so ``X = sqrt(n - 1) Y + mu`` (float32 rounding); the dense form keeps
the mean and the factor ``L`` of the *regularised* covariance ``Sigma + eps I`` and the image
count ``n`` (``n_train``, in the model file), which give ``S1 = 0`` about ``K = mu`` and
``S2 = (n - 1) (L L^T - eps I)`` (``L L^T`` in float64): the exact sums again, up to the float32
rounding of ``L``; where the dense model keeps its training embeddings
(``padim.keep_embeddings``), the state is their exact sums and the samples themselves. A dense
state may carry its images' samples ``[P, n_s, D]`` (``samples``): a merge keeps them, in order,
where every state has them, and the merged fit then makes every image's exact
leave-one-(group-)out distances from them, as a fit that keeps its samples does. A merge of a
low-rank and a dense state (an update that crosses ``auto``'s limit) turns the low-rank samples
into sums first (keeping the samples).

States are plain dicts of numpy arrays and ints / strings (see ``Scorer.partial_state``).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Optional, Sequence

import numpy as np
import torch

from anomaly_hooks.errors import FitError
from anomaly_hooks.scorers.padim.gaussians import (
    CHUNK_POSITIONS,
    DenseGaussians,
    GaussianAccumulator,
    LowRankGaussians,
    SampleStore,
)

State = Dict[str, Any]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def dense_state(acc: GaussianAccumulator, grid: tuple,
                samples: Optional[torch.Tensor] = None) -> State:
    """The state of a shard's streaming sums (flushed first), with its samples ``[P, n_s, D]``
    where they were kept (an update's exact out-of-sample scores need every image's)."""
    acc.finish()
    state = {"form": "dense", "n": int(acc.n), "grid": tuple(grid), "shift": _np(acc.shift),
             "s1": _np(acc.s1), "s2": _np(acc.s2)}
    if samples is not None:
        state["samples"] = _np(samples)
    return state


def samples_state(store: SampleStore, grid: tuple) -> State:
    """The dense state of a shard that kept every sample ``[P, n_s, D]`` and no sums: the
    Gaussians are made from the samples (:meth:`DenseGaussians.from_samples`); the sums only
    where a merge meets a state without samples (:func:`with_sums`)."""
    return {"form": "dense", "n": int(store.n), "grid": tuple(grid),
            "samples": _np(store.samples())}


def lowrank_state(store: SampleStore, grid: tuple) -> State:
    """The state of a shard's stored samples ``[P, n_s, D]``."""
    return {"form": "lowrank", "n": int(store.n), "grid": tuple(grid),
            "samples": _np(store.samples())}


def fitted_state(gauss: Any, n: int, grid: tuple, epsilon: float) -> State:
    """The state of the ``n`` training images of fitted Gaussians (see the module
    docstring): the low-rank form's samples, or the dense form's sums from its mean and
    factors (float32 factors only: float16 ones hold the covariances to 3 digits)."""
    if gauss.kind == "lowrank":
        p, _, d = gauss.y.shape
        samples = torch.empty(p, n, d, dtype=torch.float32)
        samples_into(gauss, n, samples)
        return {"form": "lowrank", "n": int(n), "grid": tuple(grid), "samples": samples.numpy()}
    kept = gauss.samples  # read once (from the model file, when left there)
    if kept is not None:  # the kept embeddings: the Gaussians come from them
        return {"form": "dense", "n": int(n), "grid": tuple(grid), "samples": _np(kept)}
    if gauss.chol.dtype != torch.float32:
        raise FitError("this PaDiM model keeps its covariance factors in float16 "
                       "(padim.factor_dtype=float16): they hold the covariances to about 3 "
                       "digits, so an update would not equal a fit on all the images; refit "
                       "on all the images (padim.factor_dtype=float32 for updatable models)")
    mean = gauss.mean.detach().cpu().float()
    p, d = mean.shape
    s2 = np.empty((p, d, d), dtype=np.float32)
    # L L^T in float64 where the factors are (a GPU's float64 products are fast), chunk by chunk
    eye = torch.eye(d, dtype=torch.float64, device=gauss.chol.device)
    for lo in range(0, p, CHUNK_POSITIONS):
        chol = gauss.chol[lo:lo + CHUNK_POSITIONS].detach().double()
        cov = torch.bmm(chol, chol.transpose(1, 2)).sub_(eye, alpha=epsilon)  # un-regularised
        s2[lo:lo + chol.shape[0]] = cov.mul_(n - 1).float().cpu().numpy()
    return {"form": "dense", "n": int(n), "grid": tuple(grid), "shift": _np(mean),
            "s1": np.zeros((p, d), dtype=np.float64), "s2": s2}


@torch.inference_mode()
def samples_into(gauss: Any, n: int, out: torch.Tensor) -> torch.Tensor:
    """The training embeddings ``[P, n, D]`` float32 of Gaussians that keep them, written into
    ``out`` (any device and strides; returned): the low-rank form's ``sqrt(n - 1) Y + mu``
    (float64, rounded to float32), ``CHUNK_POSITIONS`` positions at a time; the dense form's
    kept ones, read from the model file straight into ``out`` when left there."""
    if gauss.kind == "lowrank":
        for lo in range(0, out.shape[0], CHUNK_POSITIONS):
            y = gauss.y[lo:lo + CHUNK_POSITIONS].double().mul_(math.sqrt(n - 1))
            y.add_(gauss.mean[lo:lo + y.shape[0]].double().unsqueeze(1))
            out[lo:lo + y.shape[0]] = y
        return out
    stored = gauss.stored_samples
    if stored is not None and out.device.type == "cpu":
        return stored.read(out)
    kept = gauss.samples
    if kept is None:
        raise FitError("this dense PaDiM model keeps no training embeddings")
    return out.copy_(kept)


def with_sums(state: State) -> State:
    """A dense state with streaming sums: a low-rank or a samples-only dense state's samples
    turned into sums (and kept); a dense state with sums unchanged."""
    if state["form"] == "dense" and "s2" in state:
        return state
    samples = _readable(state["samples"])
    acc = GaussianAccumulator()
    acc.update(samples)
    return dense_state(acc, state["grid"], samples)


def merge(states: Sequence[State]) -> State:
    """One state from shard states given in training-list order: the low-rank form's samples
    joined; a dense merge's samples joined where every state has them (the Gaussians are then
    made from them), else every state's sums re-shifted and added (low-rank samples turned
    into sums first)."""
    states = [s for s in states if s is not None and s["n"] > 0]
    if not states:
        raise FitError("no shard gave any training image: nothing to merge")
    grids = {tuple(s["grid"]) for s in states}
    if len(grids) != 1:
        raise FitError(f"cannot merge PaDiM states of different grids: {sorted(grids)}")
    forms = {s["form"] for s in states}
    if len(states) == 1:
        return states[0]
    if all("samples" in s for s in states):  # joined in order
        return {"form": "dense" if "dense" in forms else "lowrank",
                "n": sum(s["n"] for s in states), "grid": states[0]["grid"],
                "samples": _concat_samples(states)}
    return merge_dense([with_sums(s) for s in states])


def _concat_samples(states: Sequence[State]) -> np.ndarray:
    """The states' samples ``[P, n_s, D]`` joined in order ``[P, n, D]``. ``torch.cat``: one
    parallel pass (numpy's concatenate took 0.5-1 s instead of 0.1 for two [3136, 100, 176]
    halves when the first was just read from a model file)."""
    return torch.cat([_readable(s["samples"]) for s in states], dim=1).numpy()


def _readable(array: np.ndarray) -> torch.Tensor:
    """A tensor view of an array that is only read (an object-store buffer is read-only: torch
    warns about such views, harmless where nothing writes)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


@torch.inference_mode()
def merge_dense(states: Sequence[State], chunk: int = CHUNK_POSITIONS) -> State:
    """Sum dense states re-shifted onto the first one's shift, ``chunk`` positions at a time.
    ``S1`` is summed in float64, ``S2`` in float32 (the re-shift is the rank-2 update
    ``h d^T + d h^T`` with ``h = S1_b + n_b d / 2``). Memory: one output ``S2``."""
    first = states[0]
    shift = first["shift"]
    p, d = shift.shape
    s1 = np.zeros((p, d), dtype=np.float64)
    s2 = np.empty((p, d, d), dtype=np.float32)
    out_s2, base = torch.from_numpy(s2), _readable(shift)
    for lo in range(0, p, chunk):
        hi = min(p, lo + chunk)
        out = out_s2[lo:hi]
        out.copy_(_readable(first["s2"][lo:hi]))
        s1[lo:hi] = first["s1"][lo:hi]
        for s in states[1:]:
            b1 = _readable(s["s1"][lo:hi])
            out.add_(_readable(s["s2"][lo:hi]))
            delta = _readable(s["shift"][lo:hi]).double() - base[lo:hi].double()
            half = (b1 + 0.5 * s["n"] * delta).float()
            df = delta.float()
            out.baddbmm_(half.unsqueeze(2), df.unsqueeze(1))
            out.baddbmm_(df.unsqueeze(2), half.unsqueeze(1))
            s1[lo:hi] += (b1 + s["n"] * delta).numpy()
    out = {"form": "dense", "n": sum(int(s["n"]) for s in states), "grid": first["grid"],
           "shift": shift, "s1": s1, "s2": s2}
    if all("samples" in s for s in states):  # every image's samples: kept, in order
        out["samples"] = _concat_samples(states)
    return out


def gaussians(state: State, epsilon: float, factor_dtype: str = "float32",
              device: Optional[torch.device] = None, loo: bool = False,
              groups: Optional[torch.Tensor] = None, keep_samples: bool = False):
    """Dense or low-rank Gaussians (on ``device``, default the CPU) of a merged state; ``loo``:
    the low-rank form, and the dense form where the state has every image's samples, also
    make the training samples' leave-one-out distances (``.loo``), leave-one-group-out with
    ``groups``; ``keep_samples``: the dense form keeps those samples (``.samples``).
    The arrays are copied where they are read-only (the object store hands out read-only
    buffers; the fit works in place)."""
    device = torch.device("cpu") if device is None else device
    if state["form"] == "lowrank":
        store = SampleStore()
        store.buf = _tensor(state["samples"], device)
        store.n = store.buf.shape[1]
        return LowRankGaussians.from_samples(store, epsilon, loo=loo, groups=groups)
    dtype = torch.float16 if factor_dtype == "float16" else torch.float32
    samples = _readable(state["samples"]).to(device) if "samples" in state else None
    if samples is not None:  # every image's samples: the Gaussians come from them
        out = DenseGaussians.from_samples(
            samples, epsilon, dtype, out=_tensor(state["s2"], device) if "s2" in state else None,
            loo=loo, groups=groups if loo else None)
    else:
        acc = GaussianAccumulator()
        acc.n = int(state["n"])
        acc.shift = _tensor(state["shift"], device)
        acc.s1 = _tensor(state["s1"], device)
        acc.s2 = _tensor(state["s2"], device)  # factorised in place
        out = DenseGaussians.from_accumulator(acc, epsilon, dtype)
    if keep_samples and samples is not None:
        out.samples = samples  # only ever read: a view of the state's array will do
    return out


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A writable tensor on ``device`` (a copy only where the array is read-only or the device
    is not the CPU)."""
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array).to(device)
