"""PatchCore's mergeable fit state, for fits sharded over processes or machines (merge-reduce).

The rule: the final bank has the single-process fit's size ``k = coreset_size(N, ratio,
count)`` for the ``N`` patches of *all* the training images. A shard with ``N_s`` patches keeps
``ceil(oversample * k * N_s / N)`` of them (``oversample`` x its share of the final bank) by the
same seeded greedy k-center rule; a shard holding every training image keeps all its patches,
so a one-shard fit is the single-process fit exactly. The merge concatenates the shards' kept
patches in shard order; the final bank is the greedy k-center coreset of that union.

Quality: the shard coresets cover their patches within their radii ``r_s``; the final coreset
covers the union within ``r_u``, so every training patch is within ``max(r_s) + r_u`` of the
bank (triangle inequality). ``oversample = 4``: measured on bottle and battery_weld with 2 and 4
shards, the radius stayed within 1.01-1.08x the one-shot coreset's (with 2: up to 1.26x), at
twice the shard selection time (docs/benchmarks.md, "More than one machine").
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from anomaly_hooks.errors import FitError
from anomaly_hooks.scorers.patchcore.coreset import coreset_size, greedy_coreset

State = Dict[str, Any]
OVERSAMPLE = 4.0  # a shard keeps this many times its share of the final bank


def final_size(cfg: Any, n_patches: int) -> int:
    """The bank size of a single-process fit on ``n_patches`` patches."""
    return coreset_size(n_patches, cfg.coreset_ratio if cfg.coreset_count is None else None,
                        cfg.coreset_count)


def shard_state(features: torch.Tensor, cfg: Any, seed: int, n_train: int, n_total: int,
                grid: tuple, oversample: float = OVERSAMPLE, with_images: bool = True,
                images: Optional[torch.Tensor] = None) -> State:
    """Reduce a shard's patches ``features`` ``[N_s, D]`` (from ``n_train`` of the ``n_total``
    training images, in image order: all their patches, or the rows the per-image
    pre-reduction kept of them) to its share of the final bank, ``oversample`` times over.
    ``images`` ``[N_s]`` int32: the shard-local image of each row (None: every patch, ``h * w``
    per image). ``image`` ``[k]`` int32 in the state: the shard-local image of each kept patch
    (None without ``with_images``: a bounded fit's kept patches are not in image order)."""
    per_image = grid[0] * grid[1]
    keep = features.shape[0]
    if n_train < n_total:
        # the share of the shard's patches (not of the rows a pre-reduction kept of them)
        share = final_size(cfg, n_total * per_image) * n_train / n_total
        keep = min(features.shape[0], max(1, math.ceil(oversample * share)))
    # every patch of every image, in image order: the images can be scored from the state
    complete = keep == features.shape[0] and images is None and with_images
    idx = torch.arange(features.shape[0])
    if keep < features.shape[0]:
        idx = greedy_coreset(features, keep, projection_dim=cfg.projection_dim,
                             seed=seed).cpu()
        features = features[idx.to(features.device)]
    if not with_images:
        image = None
    elif images is not None:
        image = images[idx].to(torch.int32).numpy()
    else:  # patches come image by image, h * w of each
        image = (idx // per_image).to(torch.int32).numpy()
    return {"form": "coreset", "n_train": int(n_train), "n_patches": int(n_train * per_image),
            "grid": tuple(grid), "features": features.detach().cpu().contiguous().numpy(),
            "image": image, "complete_from": 0 if complete else None}


def merge(states: Sequence[Optional[State]]) -> State:
    """One state from shard states given in training-list order: the union of their patches."""
    states = [s for s in states if s is not None and s["n_train"] > 0]
    if not states:
        raise FitError("no shard gave any training image: nothing to merge")
    grids = {tuple(s["grid"]) for s in states}
    if len(grids) != 1:
        raise FitError(f"cannot merge PatchCore states of different grids: {sorted(grids)}")
    if len(states) == 1:
        return states[0]
    image = None
    offsets = np.cumsum([0] + [s["n_train"] for s in states[:-1]])
    if all(s.get("image") is not None for s in states):  # shard-local -> fit-wide image ids
        image = np.concatenate([s["image"] + np.int32(o) for s, o in zip(states, offsets)])
    return {**states[0], "n_train": sum(s["n_train"] for s in states),
            "n_patches": sum(s["n_patches"] for s in states),
            "features": np.concatenate([s["features"] for s in states], axis=0),
            "image": image, "complete_from": complete_tail(states, offsets)}


def complete_tail(states: Sequence[State], offsets: Sequence[int]) -> Optional[int]:
    """The first fit-wide image of the merged states' complete tail: the last states that
    keep every patch of their images (in image order, ``complete_from`` 0), whose rows end
    the merged features; None where the last state is not complete (a shard reduced to its
    share, a current bank)."""
    first = None
    for state, offset in zip(reversed(states), reversed(list(offsets))):
        if state.get("complete_from") != 0:
            break
        first = int(offset)
    return first


def select(state: State, cfg: Any, seed: int, device: torch.device,
           progress: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The final bank ``[k, D]`` float32 on ``device`` of a merged state (the greedy rule on
    the union, on ``device`` as the single-process fit runs it), and the fit-wide image of each
    bank point ``[k]`` int32 (None when the state has none)."""
    features = torch.from_numpy(np.ascontiguousarray(state["features"])).to(device)
    k = min(features.shape[0], final_size(cfg, int(state["n_patches"])))
    idx = greedy_coreset(features, k, projection_dim=cfg.projection_dim, seed=seed,
                         progress=progress)
    image = state.get("image")
    bank_image = (None if image is None
                  else torch.from_numpy(np.asarray(image))[idx.cpu()].to(torch.int32))
    # advanced indexing: a new tensor (the state's buffer may be read-only)
    return features[idx], bank_image
