"""Cross-fitted out-of-sample scores of PatchCore's own training images.

The training images are cut into folds (whole groups each: :mod:`anomaly_hooks.grouping`). A
fold's images are scored by the bank a fit *without the fold* selects: the greedy k-center
coreset of the other folds' patches, of the size a fit on those patches would keep, with the
same seeded projection and first point. So neither the coreset selection nor the search ever
sees the fold: unlike the nearest point of another image in the full bank (the
leave-one-image-out rule of :mod:`anomaly_hooks.scorers.patchcore.oos`), a twin in the fold
cannot hold a region of feature space for it, and a fold is a stretch of the fit order, so
slow changes along it are seen too.

The single-process fit has every training patch at hand and scores each fold's patches at
once (:func:`cross_fit_patch_scores`). A sharded fit selects the fold banks from the merged
candidates (:func:`fold_banks`; the shards' pre-selection saw every image) and scores the folds
in a second pass.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch

from anomaly_hooks.errors import FitError
from anomaly_hooks.scorers.patchcore.coreset import greedy_coreset
from anomaly_hooks.scorers.patchcore.knn import NearestNeighbors

QUERY_CHUNK = 65536  # fold patches per search


def fold_bank(features: torch.Tensor, outside: torch.Tensor, k: int,
              projection_dim: Optional[int], seed: int, progress: bool = False) -> torch.Tensor:
    """The bank of a fit on the points ``features[outside]`` (``outside`` ``[N]`` bool): their
    greedy coreset of ``k`` points (at most all of them), selected as a fit selects it."""
    rest = torch.nonzero(outside.to(features.device)).flatten()
    if rest.numel() == 0:
        raise FitError("one fold holds every training image: nothing is left to score it by; "
                       "add images or loosen threshold.groups")
    pts = features[rest]
    idx = greedy_coreset(pts, min(k, int(rest.numel())), projection_dim=projection_dim,
                         seed=seed, progress=progress)
    return pts[idx]


def fold_banks(features: torch.Tensor, point_fold: torch.Tensor, sizes: Sequence[int],
               projection_dim: Optional[int], seed: int,
               progress: bool = False) -> List[torch.Tensor]:
    """One bank per fold ``f``: :func:`fold_bank` of ``sizes[f]`` points among the candidates
    ``features`` ``[N, D]`` whose fold (``point_fold`` ``[N]``) is not ``f``. The candidates
    are a reduction of the patches (the shards' or the per-image pre-selection): ``sizes[f]``
    is the bank a fit on the other folds' *patches* keeps, not a share of the candidates."""
    return [fold_bank(features, point_fold != f, k, projection_dim, seed, progress)
            for f, k in enumerate(sizes)]


def knn_scores(index: NearestNeighbors, patches: torch.Tensor, k: int) -> torch.Tensor:
    """Mean distance ``[N]`` of each patch ``[N, D]`` to its ``k`` nearest bank points."""
    out = torch.empty(patches.shape[0], dtype=torch.float32, device=patches.device)
    for lo in range(0, patches.shape[0], QUERY_CHUNK):
        dist, _ = index.search(patches[lo:lo + QUERY_CHUNK], k)
        out[lo:lo + QUERY_CHUNK] = dist.mean(dim=1)
    return out


def cross_fit_patch_scores(features: torch.Tensor, image_fold: torch.Tensor, per_image: int,
                           size: Callable[[int], int], make_index: Callable[[torch.Tensor], Any],
                           k: int, projection_dim: Optional[int], seed: int,
                           progress: bool = False) -> torch.Tensor:
    """Patch scores ``[N]`` of every training patch (``features`` ``[N, D]``, image by image,
    ``per_image`` patches each) from the bank of a fit without its fold (``image_fold`` ``[n]``),
    one fold at a time; ``make_index(bank)`` builds the search index a fit would use."""
    point_fold = image_fold.to(features.device).long().repeat_interleave(per_image)
    n_folds = int(image_fold.max()) + 1
    out = torch.empty(features.shape[0], dtype=torch.float32, device=features.device)
    for f in range(n_folds):
        outside = point_fold != f
        bank = fold_bank(features, outside, size(int(outside.sum())), projection_dim, seed,
                         progress)
        mine = torch.nonzero(point_fold == f).flatten()
        out[mine] = knn_scores(make_index(bank), features[mine], k)
        del bank
    return out
