"""PaDiM's part of the exported predict graph: Mahalanobis distances in both covariance forms.

Both are batched matrix products over the ``P`` positions (ONNX has no triangular solve):

* low-rank: the eager Woodbury form with the same products, ``a = G^-1 Y x``,
  ``d^2 = |x - Y^T a|^2 / eps + |a|^2``, with ``Y`` ``[P, n, D]`` and ``C^-1`` ``[P, n, n]`` each
  stored once, as saved (ONNX MatMul has no transpose flag: only the small per-batch operands
  are transposed);
* dense: ``d = |L^-1 (x - mu)|`` with ``L^-1`` precomputed from the Cholesky factors in float64
  and stored float32.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch

from anomaly_hooks.scorers.base import ScorerGraph


class PadimLowRankGraph(ScorerGraph):
    """Distances to :class:`~anomaly_hooks.scorers.padim.gaussians.LowRankGaussians`."""

    form = "lowrank"

    def __init__(self, g: Any) -> None:
        super().__init__()
        self.register_buffer("mean", g.mean.float().clone())  # [P, D]
        self.register_buffer("y", g.y.float().contiguous())  # [P, n, D]
        self.register_buffer("cinv", g.cinv.float().contiguous())  # [P, n, n]
        self.inv_eps = 1.0 / float(g.epsilon)

    def forward(self, rows: torch.Tensor) -> Tuple[torch.Tensor, None]:
        """``[B, P, D]`` -> ``[B, P]`` distances."""
        xc = rows.transpose(0, 1) - self.mean.unsqueeze(1)  # [P, B, D]
        u_t = self.cinv @ (self.y @ xc.transpose(1, 2))  # C^-1 Y x: [P, n, B]
        a = u_t.transpose(1, 2) @ self.cinv  # (C^-T C^-1 Y x)^T = (G^-1 Y x)^T: [P, B, n]
        r = xc - a @ self.y  # (x - Y^T a)^T
        d2 = (r * r).sum(dim=2) * self.inv_eps + (a * a).sum(dim=2)
        return d2.sqrt().transpose(0, 1), None


class PadimDenseGraph(ScorerGraph):
    """Distances to :class:`~anomaly_hooks.scorers.padim.gaussians.DenseGaussians`."""

    form = "dense"

    def __init__(self, g: Any) -> None:
        super().__init__()
        self.register_buffer("mean", g.mean.float().clone())  # [P, D]
        self.register_buffer("linv", inverse_lower(g.chol))  # [P, D, D]

    def forward(self, rows: torch.Tensor) -> Tuple[torch.Tensor, None]:
        """``[B, P, D]`` -> ``[B, P]`` distances."""
        xc = rows.transpose(0, 1) - self.mean.unsqueeze(1)  # [P, B, D]
        z_t = self.linv @ xc.transpose(1, 2)  # [P, D, B]
        return (z_t * z_t).sum(dim=1).sqrt().transpose(0, 1), None


def inverse_lower(chol: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """``L^-1`` ``[P, D, D]`` float32 of lower-triangular factors (float64 solve)."""
    p, d, _ = chol.shape
    out = torch.empty(p, d, d, dtype=torch.float32)
    eye = torch.eye(d, dtype=torch.float64)
    for lo in range(0, p, chunk):
        c = chol[lo:lo + chunk].double().cpu()
        out[lo:lo + chunk] = torch.linalg.solve_triangular(c, eye.expand_as(c), upper=False)
    return out


def padim_graph(gaussians: Any) -> ScorerGraph:
    """The graph module of fitted Gaussians of either form."""
    return PadimLowRankGraph(gaussians) if gaussians.kind == "lowrank" else \
        PadimDenseGraph(gaussians)
