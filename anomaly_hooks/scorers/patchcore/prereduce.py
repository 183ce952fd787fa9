"""Per-image pre-reduction of PatchCore's training patches, streamed during the fit.

At high resolution the training patches number millions (200 images of a 0.5 MP working frame
at stride 8: 1.6 M) and the greedy k-center selection costs ``O(N k p)`` with ``k`` a fixed
fraction of ``N``: quadratic in the pixels. The pre-reduction applies the same greedy rule to
each image's patches as the image arrives and keeps ``oversample`` times the image's share of
the final bank (``ceil(oversample * ratio * P)`` of its ``P`` patches); the final selection
then runs over ``oversample * k`` points instead of ``N``:

* cost: ``sum_i P * m`` for the images (linear in the number of images) plus
  ``oversample * k * k * p`` for the final selection, instead of ``N * k * p``: with
  ``ratio`` = 1 % and ``oversample`` = 8 the final step is ``8 * ratio`` = 8 % of the exact
  greedy's;
* memory: the kept points only (``oversample * ratio`` of the patches), never every patch;
* quality: each image's reduction covers its patches within its radius ``r_i`` (in the
  projected space where the greedy runs), the final selection covers the kept points within
  ``r_u``, so every training patch is within ``max(r_i) + r_u`` of the bank (triangle
  inequality; the bound of the sharded fit's merge-reduce, ``partial.py``). An image keeps
  ``oversample * ratio`` of its own patches, far more than its ``ratio`` share of a bank that
  covers every image, so ``r_i`` is small next to ``r_u``: measured against the exact greedy on
  a subsample, ``benchmarks/bench_highres.py`` (docs/high-resolution.md).

Each kept point remembers its image (the bank's ``bank_image``), so the out-of-sample scores of
``threshold.mode=all-images`` keep working (in a second pass over the images: the fit no longer
holds every patch).
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from anomaly_hooks.scorers.patchcore.coreset import greedy_coreset


class PerImageReduction:
    """Reduce each training image's patches to ``oversample`` times its share of the final
    bank as they arrive; keep the reduced points and their images, in image order.

    Args:
        oversample: kept points per image, as a multiple of its share of the final bank.
        ratio / count: the final bank's size rule (``coreset_size``): a fraction of all
            patches, or an absolute count (then the share of an image is ``count / n_images``).
        n_images: training images announced by ``begin`` (None: unknown; a ``count`` is then
            shared as if by one image, which keeps more points, never fewer).
        projection_dim, seed: the greedy's random projection and first point (seeded).
    """

    def __init__(self, oversample: float, ratio: Optional[float], count: Optional[int],
                 n_images: Optional[int], projection_dim: Optional[int], seed: int) -> None:
        if oversample < 1.0:
            raise ValueError(f"oversample must be >= 1, got {oversample}")
        self.oversample, self.ratio, self.count = float(oversample), ratio, count
        self.n_images = n_images
        self.projection_dim, self.seed = projection_dim, seed
        self._kept: List[torch.Tensor] = []
        self._images: List[torch.Tensor] = []
        self.n_kept = 0

    def keep_count(self, per_image: int) -> int:
        """Points kept of an image's ``per_image`` patches (all of them when the share times
        the oversampling reaches them)."""
        if self.count is not None:
            share = self.count / max(1, self.n_images or 1)
        else:
            share = float(self.ratio) * per_image
        return min(per_image, max(1, math.ceil(self.oversample * share)))

    def add(self, patches: torch.Tensor, first_image: int, keep: bool = True) -> torch.Tensor:
        """Reduce a batch's patches ``[b, P, D]`` (images ``first_image ..``); returns the kept
        points ``[b * m, D]``, also kept here with their images unless ``keep`` is False (a
        bounded fit streams them on)."""
        b, p, _ = patches.shape
        m = self.keep_count(p)
        out = []
        for i in range(b):
            x = patches[i]
            if m < p:
                idx = greedy_coreset(x, m, projection_dim=self.projection_dim, seed=self.seed)
                x = x.index_select(0, idx)
            else:
                x = x.clone()
            out.append(x)
            if keep:
                self._images.append(torch.full((x.shape[0],), first_image + i,
                                               dtype=torch.int32))
        kept = torch.cat(out)
        if keep:
            self._kept.append(kept)
            self.n_kept += kept.shape[0]
        return kept

    def take(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """All kept points ``[M, D]`` float32 and their images ``[M]`` int32, handed over once
        (the chunks are freed as they are joined)."""
        if not self._kept:
            raise ValueError("no patches were added to the pre-reduction")
        out = torch.empty(self.n_kept, self._kept[0].shape[1], dtype=torch.float32,
                          device=self._kept[0].device)
        start = 0
        while self._kept:
            chunk = self._kept.pop(0)
            out[start:start + chunk.shape[0]] = chunk
            start += chunk.shape[0]
        images = torch.cat(self._images)
        self._images = []
        self.n_kept = 0
        return out, images
