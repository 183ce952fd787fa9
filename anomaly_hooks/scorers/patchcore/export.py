"""PatchCore's part of the exported predict graph: exact k-NN distances to the bank in graph.

Two exact searches, with the eager search's answers:

* ``brute``: one GEMM against the whole bank + TopK, the k distances recomputed on the
  differences. The GEMM computes ``|b|^2 - 2 q.b`` itself (``Gemm`` with ``alpha=-2`` and the
  squared norms as its bias, as the eager search's ``addmm``: no separate passes over the
  ``[n, M]`` block). The exporter's transposed copy of the bank is folded back into a
  ``Gemm(transB=1)`` by :func:`anomaly_hooks.export.onnx.gemm_transposed_initializers`, so the
  bank is stored once;
* ``projected``: :class:`~anomaly_hooks.scorers.patchcore.knn.ProjectedSearch` in graph (the
  PCA lower-bound candidates, their bounds by the same one-GEMM form, exact distances only
  where a bound can beat the k-th, a full search for the few uncertified queries).

Both run on static blocks of each image's patches (:data:`BLOCK_ELEMENTS` distances per image
per block, :func:`query_block`), so ONNX Runtime never holds the whole ``[B x P, M]`` distance
(or bound) matrix and each block is read back by TopK while it is still in cache.

The eq. 7 reweighting (``patchcore.reweight``) uses each bank row's ``reweight_neighbors``
nearest bank rows, precomputed at export.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import nn

from anomaly_hooks.errors import ExportError
from anomaly_hooks.scorers.base import ScorerGraph
from anomaly_hooks.scorers.patchcore.knn import PROJECTED_CANDIDATES, principal_basis

SEARCHES = ("auto", "projected", "brute")
# distances (or bounds) per image in one block of the exported search (4 MB of float32 per
# image: a service batch of a few images stays within the last-level cache, as the eager
# search's blocks do), and at most this many blocks (graph size)
BLOCK_ELEMENTS = 1 << 20
MAX_BLOCKS = 32


def exact_distances(q: torch.Tensor, bank: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``|q_i - bank[idx[i, j]]|`` ``[n, k]`` on the differences (as the eager search)."""
    n, k = idx.shape
    diff = bank.index_select(0, idx.reshape(-1)).reshape(n, k, bank.shape[1]) - q.unsqueeze(1)
    return (diff * diff).sum(dim=2).sqrt()


def _brute(q: torch.Tensor, bank: torch.Tensor, sq: torch.Tensor, k: int
           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact distances ``[n, k]`` (unsorted) and rows of the k nearest by one GEMM + TopK."""
    # |b|^2 - 2 q.b in one Gemm (bias, alpha); |q|^2 does not change the order
    d2 = torch.addmm(sq, q, bank.t(), alpha=-2.0)
    _, idx = torch.topk(d2, k, dim=1, largest=False)
    return exact_distances(q, bank, idx), idx


class BruteKnn(nn.Module):
    """Exact k-NN over the whole bank ``[M, D]``."""

    def __init__(self, bank: torch.Tensor, k: int) -> None:
        super().__init__()
        self.register_buffer("bank", bank)
        self.register_buffer("sq", bank.square().sum(dim=1))
        self.k = k

    def forward(self, q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``[n, D]`` -> distances and rows ``[n, k]``, nearest first."""
        dist, idx = _brute(q, self.bank, self.sq, self.k)
        dist, order = torch.sort(dist, dim=1)
        return dist, torch.gather(idx, 1, order)


class ProjectedKnn(nn.Module):
    """The exact PCA lower-bound search in graph (see the module docstring).

    Candidates: the ``c = k + 16`` bank rows of smallest lower bound (a GEMM in ``r + 1``
    dimensions instead of ``D``); exact distances of the first ``k`` and of the other
    candidates whose bound is below the current k-th distance (NonZero + Gather). A query is
    certified when its k-th distance is at most the bound of the c-th candidate; the rest
    (typically < 1 %) get a full brute-force search (a dynamic-size GEMM).
    """

    def __init__(self, bank: torch.Tensor, k: int) -> None:
        super().__init__()
        mean, basis, _ = principal_basis(bank)
        self.k = k
        self.c = min(bank.shape[0], k + PROJECTED_CANDIDATES)
        self.register_buffer("bank", bank)
        self.register_buffer("sq", bank.square().sum(dim=1))
        self.register_buffer("mean", mean.float())
        self.register_buffer("basis", basis.float().contiguous())
        pts = torch.cat([self._augment(bank[lo:lo + 4096]) for lo in range(0, len(bank), 4096)])
        self.register_buffer("pts", pts.contiguous())
        self.register_buffer("psq", pts.square().sum(dim=1))
        self.sq_max = float(self.psq.max())

    def _augment(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, D]`` -> ``[n, r + 1]``: subspace coordinates and the residual norm."""
        centred = x - self.mean
        coords = centred @ self.basis
        resid = (centred * centred).sum(dim=1) - (coords * coords).sum(dim=1)
        return torch.cat([coords, resid.clamp_min(0).sqrt().unsqueeze(1)], dim=1)

    def forward(self, q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``[n, D]`` -> distances and rows ``[n, k]``, nearest first."""
        k, c, n = self.k, self.c, q.shape[0]
        qa = self._augment(q)  # [n, r + 1]
        qsq = (qa * qa).sum(dim=1, keepdim=True)
        # [n, M] squared lower bounds less |qa|^2 (one Gemm), which is added to the c kept
        lb2 = torch.addmm(self.psq, qa, self.pts.t(), alpha=-2.0)
        lb2, cand = torch.topk(lb2, c, dim=1, largest=False)  # ascending
        lb2 = lb2 + qsq
        tol = 1e-4 * (qsq.squeeze(1) + self.sq_max)  # float32 rounding of the bounds
        first = exact_distances(q, self.bank, cand[:, :k])  # [n, k]
        kth2 = first.amax(dim=1) ** 2
        # the other candidates: an exact distance only where the bound can beat the k-th
        pos = torch.nonzero(lb2[:, k:] < (kth2 + tol).unsqueeze(1))  # [m, 2]
        flat = pos[:, 0] * c + pos[:, 1] + k
        d = self.bank.index_select(0, cand.reshape(-1).index_select(0, flat)) \
            - q.index_select(0, pos[:, 0])
        rest = torch.full((n * c,), float("inf"), dtype=q.dtype)
        rest = rest.scatter(0, flat, (d * d).sum(dim=1).sqrt()).reshape(n, c)
        dist, order = torch.topk(torch.cat([first, rest[:, k:]], dim=1), k, dim=1,
                                 largest=False)
        idx = torch.gather(cand, 1, order)
        if c < self.bank.shape[0]:  # uncertified: k-th distance above the c-th bound
            bad = torch.nonzero(dist.amax(dim=1) ** 2 > lb2[:, c - 1].clamp_min(0) - tol)
            bad = bad.reshape(-1)
            fdist, fidx = _brute(q.index_select(0, bad), self.bank, self.sq, k)
            scat = bad.unsqueeze(1).expand(-1, k)
            dist, idx = dist.scatter(0, scat, fdist), idx.scatter(0, scat, fidx)
        dist, order = torch.sort(dist, dim=1)
        return dist, torch.gather(idx, 1, order)


def query_block(patches: int, bank_rows: int, elements: int = BLOCK_ELEMENTS) -> int:
    """Patches of one image per block of the exported search: ``elements`` distances per
    image (at least one patch, at most all), at most :data:`MAX_BLOCKS` blocks.

    Raises:
        ValueError: a count below 1."""
    if patches < 1 or bank_rows < 1 or elements < 1:
        raise ValueError(f"query_block({patches}, {bank_rows}, {elements}): all must be >= 1")
    return max(min(patches, elements // bank_rows), -(-patches // MAX_BLOCKS), 1)


class PatchCoreGraph(ScorerGraph):
    """Patch scores (mean of the k exact distances) and the eq. 7 image-score weight.

    Args:
        block_elements: distances per image in one query block of the search
            (:func:`query_block`; default :data:`BLOCK_ELEMENTS`).
    """

    def __init__(self, scorer: Any, search: str, block_elements: Optional[int] = None) -> None:
        super().__init__()
        bank = scorer.bank.float().contiguous()
        k = int(scorer.cfg.k)
        self.form = search
        self.block_elements = int(BLOCK_ELEMENTS if block_elements is None else block_elements)
        self.knn = ProjectedKnn(bank, k) if search == "projected" else BruteKnn(bank, k)
        self.reweight = bool(scorer.cfg.reweight)
        if self.reweight:
            n_b = min(int(scorer.cfg.reweight_neighbors), bank.shape[0])
            support = [scorer.index.search(bank[lo:lo + 4096], n_b)[1]
                       for lo in range(0, bank.shape[0], 4096)]
            self.register_buffer("support", torch.cat(support).cpu())  # [M, n_b]

    def forward(self, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``[B, P, D]`` -> patch scores ``[B, P]`` and each patch's nearest bank row (the
        search in static blocks of patches, see the module docstring)."""
        b, p, d = rows.shape
        # a model's patch count is fixed: Python ints, so that a trace holds constant slices
        # (a traced shape would turn the block arithmetic into graph ops)
        p_int = int(p)
        step = query_block(p_int, int(self.knn.bank.shape[0]), self.block_elements)
        scores, nearest = [], []
        for lo in range(0, p_int, step):
            hi = min(lo + step, p_int)
            dist, idx = self.knn(rows[:, lo:hi].reshape(-1, d))
            scores.append(dist.mean(dim=1).reshape(b, hi - lo))
            nearest.append(idx[:, 0].reshape(b, hi - lo))
        if len(scores) == 1:
            return scores[0], nearest[0]
        return torch.cat(scores, dim=1), torch.cat(nearest, dim=1)

    def image_scores(self, rows: torch.Tensor, scores: torch.Tensor, aux: torch.Tensor,
                     peak: torch.Tensor) -> torch.Tensor:
        """The heatmap's max, times eq. 7's weight (``PatchCoreScorer.reweight_factors``)."""
        if not self.reweight:
            return peak
        arg = scores.argmax(dim=1, keepdim=True)  # [B, 1] the worst patch
        worst = torch.gather(rows, 1, arg.unsqueeze(2).expand(-1, -1, rows.shape[2]))
        sup = self.support.index_select(0, torch.gather(aux, 1, arg).reshape(-1))  # [B, n_b]
        bank = self.knn.bank
        pts = bank.index_select(0, sup.reshape(-1)).reshape(sup.shape[0], sup.shape[1], -1)
        diff = pts - worst
        weight = 1.0 - torch.softmax((diff * diff).sum(dim=2).sqrt(), dim=1)[:, 0]
        return peak * weight


def patchcore_graph(scorer: Any, search: Optional[str] = "auto",
                    block_elements: Optional[int] = None) -> PatchCoreGraph:
    """The graph module of a fitted PatchCore scorer; ``search``: ``auto`` (the projected
    search where the eager model uses it, else brute force), ``projected`` or ``brute``;
    ``block_elements``: see :class:`PatchCoreGraph`."""
    search = search or "auto"
    if search not in SEARCHES:
        raise ExportError(f"search={search!r}: one of {', '.join(SEARCHES)}")
    if search == "auto":
        search = "projected" if scorer.index.projected is not None else "brute"
    return PatchCoreGraph(scorer, search, block_elements)
