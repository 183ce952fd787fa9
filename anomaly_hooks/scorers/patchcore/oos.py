"""Out-of-sample patch scores of PatchCore's own training images.

Every bank point remembers the training image it came from (``bank_image`` ``[M]`` int32). The
out-of-sample (OOS) score of a patch of training image ``i`` is its distance to the nearest bank
points of *another* image (mean over the ``k`` nearest such points, as in scoring): the bank as
image ``i`` would see it had its own points not been kept.

How this differs from a true hold-out: the coreset was selected with image ``i``'s patches among
the candidates. Where ``i``'s own point covers a region of feature space, the greedy k-center
rule had less reason to keep another image's point there, so the nearest *foreign* point can be
farther than in a coreset built without ``i``: OOS scores lean high (a conservative threshold).

Search: the ``k + 2`` nearest bank points of each query through the model's own index (exact,
sorted distances); a query with at least ``k`` foreign points among them is settled (its first
``k`` foreign ones are its ``k`` nearest foreign ones). The others are searched again for
``k + 16``, and the few left after that exactly against the whole bank with the query image's
points masked out.
"""
from __future__ import annotations

from typing import Tuple

import torch

from anomaly_hooks.errors import FitError
from anomaly_hooks.scorers.patchcore.knn import NearestNeighbors, pair_distances

STAGES: Tuple[int, ...] = (2, 16)  # neighbours searched beyond k, stage by stage
MASKED_BLOCK_ELEMENTS = 1 << 22  # queries x bank rows per block of the masked search


def foreign_neighbor_distances(index: NearestNeighbors, bank_image: torch.Tensor,
                               queries: torch.Tensor, query_image: torch.Tensor, k: int,
                               stages: Tuple[int, ...] = STAGES) -> torch.Tensor:
    """Distances ``[N, k]`` (ascending) from each query ``[N, D]`` to its ``k`` nearest bank
    points whose image differs from the query's (``query_image`` ``[N]``)."""
    bank = index.bank
    m = bank.shape[0]
    bank_image = bank_image.to(queries.device).long()
    query_image = query_image.to(queries.device).long()
    own = torch.bincount(bank_image, minlength=int(query_image.max()) + 1)
    if int((m - own[query_image]).min()) < k:
        raise FitError(f"out-of-sample scores need at least k={k} bank points from other images "
                       "than each training image's own: add images or use "
                       "threshold.mode=holdout")
    out = torch.empty(queries.shape[0], k, dtype=torch.float32, device=queries.device)
    rest = torch.arange(queries.shape[0], device=queries.device)
    for extra in stages:
        k0 = min(m, k + extra)
        dist, idx = index.search(queries[rest], k0)  # sorted, exact distances
        foreign = bank_image[idx] != query_image[rest].unsqueeze(1)  # [r, k0]
        settled = foreign.sum(dim=1) >= k
        if bool(settled.any()):
            # each foreign column keeps its position, own columns go past the end: the k
            # smallest positions are the first k foreign neighbours, nearest first
            cols = torch.arange(k0, device=queries.device).expand_as(idx[settled])
            order = torch.where(foreign[settled], cols, torch.full_like(cols, k0))
            first = order.topk(k, dim=1, largest=False).values.sort(dim=1).values
            out[rest[settled]] = dist[settled].gather(1, first)
        rest = rest[~settled]
        if rest.numel() == 0 or k0 == m:
            break
    if rest.numel():
        out[rest] = _masked_search(bank, bank_image, queries[rest], query_image[rest], k)
    return out


def _masked_search(bank: torch.Tensor, bank_image: torch.Tensor, queries: torch.Tensor,
                   query_image: torch.Tensor, k: int) -> torch.Tensor:
    """Exact ``k`` nearest foreign distances ``[N, k]`` by a full matrix-product search with each
    query's own image masked out; the winners' distances recomputed on the differences."""
    pts = bank.float()
    sq = pts.square().sum(dim=1)
    rows = max(1, MASKED_BLOCK_ELEMENTS // pts.shape[0])
    out = torch.empty(queries.shape[0], k, dtype=torch.float32, device=queries.device)
    for lo in range(0, queries.shape[0], rows):
        q = queries[lo:lo + rows].float()
        d2 = torch.addmm(sq, q, pts.t(), alpha=-2.0)
        d2.masked_fill_(bank_image.unsqueeze(0) == query_image[lo:lo + rows].unsqueeze(1),
                        float("inf"))
        idx = d2.topk(k, dim=1, largest=False).indices
        qi = torch.arange(q.shape[0], device=q.device).repeat_interleave(k)
        exact = pair_distances(bank, q, qi, idx.reshape(-1)).view(-1, k)
        out[lo:lo + rows] = exact.sort(dim=1).values
    return out
