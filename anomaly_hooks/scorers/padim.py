"""PaDiM (Defard et al. 2020): a Gaussian per patch position, Mahalanobis distance.

Fitting streams: per position it keeps shifted sums and sums of outer products in float64, so
memory does not grow with the number of training images. The fitted state is the mean ``[P, D]``
and the inverse Cholesky factor ``W = L^-1`` ``[P, D, D]`` (lower triangular, float32) of each
position's covariance ``Sigma = L L^T`` (+ epsilon I), so that the squared Mahalanobis distance is
``|| W (x - mu) ||^2`` — a batched matrix product, no per-position loop, no explicit inverse of
``Sigma``.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch

from anomaly_hooks.embedding import PatchEmbedder, random_channel_subset
from anomaly_hooks.extractor import LayerInfo
from anomaly_hooks.scorers.base import Scorer, register

DEFAULT_FEATURES = {"wide_resnet50_2": 550, "resnet18": 100}
CHUNK_POSITIONS = 256  # positions per Cholesky chunk (bounds the float64 temporaries)


def default_n_features(backbone_name: str, total: int) -> int:
    """The paper's d (550 for WRN50, 100 for ResNet18); otherwise min(total, 550)."""
    return min(DEFAULT_FEATURES.get(backbone_name, 550), total)


class GaussianAccumulator:
    """Streaming per-position mean and covariance in float64.

    Sums are taken around a shift ``K`` (the first batch's mean) for numerical stability:
    ``mean = K + S1 / n``, ``cov = (S2 - S1 S1^T / n) / (n - 1)``.
    """

    def __init__(self) -> None:
        self.n = 0
        self.shift: Optional[torch.Tensor] = None  # [P, D]
        self.s1: Optional[torch.Tensor] = None  # [P, D]
        self.s2: Optional[torch.Tensor] = None  # [P, D, D]

    def update(self, x: torch.Tensor) -> None:
        """Add samples ``x`` ``[P, B, D]`` (B samples at each of P positions)."""
        x = x.to(torch.float64)
        if self.shift is None:
            p, _, d = x.shape
            self.shift = x.mean(dim=1)
            self.s1 = torch.zeros(p, d, dtype=torch.float64, device=x.device)
            self.s2 = torch.zeros(p, d, d, dtype=torch.float64, device=x.device)
        elif x.shape[0] != self.shift.shape[0] or x.shape[2] != self.shift.shape[1]:
            raise ValueError(f"batch of shape {tuple(x.shape)} does not match the first batch "
                             f"[P={self.shift.shape[0]}, B, D={self.shift.shape[1]}]: all images "
                             "must give the same embedding grid")
        xc = x - self.shift.unsqueeze(1)
        self.s1 += xc.sum(dim=1)
        self.s2.baddbmm_(xc.transpose(1, 2), xc)
        self.n += x.shape[1]

    def mean(self) -> torch.Tensor:
        """``[P, D]`` float64."""
        return self.shift + self.s1 / self.n

    def covariance_chunk(self, start: int, stop: int) -> torch.Tensor:
        """Unbiased covariance ``[stop - start, D, D]`` float64 of a range of positions."""
        s1 = self.s1[start:stop]
        outer = s1.unsqueeze(2) * s1.unsqueeze(1) / self.n
        return (self.s2[start:stop] - outer) / (self.n - 1)


def inverse_cholesky(cov: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``W = L^-1`` with ``L L^T = cov + epsilon I``, ``[P, D, D]`` (same dtype as ``cov``)."""
    eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
    chol, info = torch.linalg.cholesky_ex(cov + epsilon * eye)
    if bool((info > 0).any()):
        raise ValueError("a covariance is not positive definite even with epsilon added; "
                         "raise padim.epsilon")
    return torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False)


@register
class PadimScorer(Scorer):
    """Per-position Gaussian; patch score = Mahalanobis distance (not squared)."""

    method = "padim"
    default_layers = ["layer1", "layer2", "layer3"]
    min_train_images = 2

    def __init__(self, embedder: PatchEmbedder, epsilon: float) -> None:
        super().__init__(embedder)
        self.epsilon = epsilon
        self._acc: Optional[GaussianAccumulator] = GaussianAccumulator()
        self.mean: Optional[torch.Tensor] = None  # [P, D] float32
        self.whitener: Optional[torch.Tensor] = None  # [P, D, D] float32, lower triangular
        self.grid: Optional[tuple[int, int]] = None
        self.n_train = 0

    @classmethod
    def create(cls, cfg: Any, layers: Sequence[LayerInfo], backbone_name: str,
               seed: int) -> "PadimScorer":
        total = sum(info.channels for info in layers)
        n = cfg.n_features if cfg.n_features is not None else default_n_features(backbone_name,
                                                                                  total)
        if n > total:
            raise ValueError(f"padim.n_features={n} is larger than the {total} channels the "
                             f"layers {[i.name for i in layers]} give: choose 1..{total}")
        idx = random_channel_subset(total, n, seed)
        return cls(PatchEmbedder(layers, upsample="nearest", channel_idx=idx), cfg.epsilon)

    def partial_fit(self, embeddings: torch.Tensor) -> None:
        if self._acc is None:
            raise RuntimeError("this PaDiM scorer is already fitted")
        b, d, h, w = embeddings.shape
        if self.grid is None:
            self.grid = (h, w)
        self._acc.update(embeddings.flatten(2).permute(2, 0, 1))

    def finalize(self) -> None:
        acc = self._acc
        if acc is None or acc.n < self.min_train_images:
            n = 0 if acc is None else acc.n
            raise ValueError(f"PaDiM needs at least {self.min_train_images} training images "
                             f"for a covariance; got {n}")
        p, d = acc.shift.shape
        self.mean = acc.mean().float()
        self.whitener = torch.empty(p, d, d, dtype=torch.float32, device=acc.shift.device)
        for start in range(0, p, CHUNK_POSITIONS):
            stop = min(p, start + CHUNK_POSITIONS)
            cov = acc.covariance_chunk(start, stop)
            self.whitener[start:stop] = inverse_cholesky(cov, self.epsilon).float()
        self.n_train = acc.n
        self._acc = None
        self.fitted = True

    def score(self, embeddings: torch.Tensor) -> torch.Tensor:
        self.check_fitted()
        b, d, h, w = embeddings.shape
        if (h, w) != self.grid or d != self.mean.shape[1]:
            raise ValueError(f"embeddings {tuple(embeddings.shape)} do not match the fitted grid "
                             f"{self.grid} and dimension {self.mean.shape[1]}")
        x = embeddings.flatten(2).permute(2, 0, 1).float()  # [P, B, D]
        diff = x - self.mean.unsqueeze(1)
        z = torch.bmm(diff, self.whitener.transpose(1, 2))  # [P, B, D]
        dist = z.square_().sum(dim=2).sqrt_()  # [P, B]
        return dist.t().reshape(b, h, w)

    def state(self) -> tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        self.check_fitted()
        tensors = {"padim.mean": self.mean, "padim.whitener": self.whitener,
                   **self.embedder.state_tensors()}
        meta = {"grid": list(self.grid), "n_train": self.n_train, "epsilon": self.epsilon}
        return tensors, meta

    @classmethod
    def from_state(cls, cfg: Any, layers: Sequence[LayerInfo], tensors: Dict[str, torch.Tensor],
                   meta: Dict[str, Any], device: torch.device) -> "PadimScorer":
        need = ("padim.mean", "padim.whitener", "embed.channel_idx")
        missing = [k for k in need if k not in tensors]
        if missing:
            raise ValueError(f"not a PaDiM model: tensors {missing} are missing")
        embedder = PatchEmbedder(layers, upsample="nearest", channel_idx=tensors["embed.channel_idx"])
        scorer = cls(embedder, float(meta["epsilon"]))
        scorer.mean = tensors["padim.mean"].to(device)
        scorer.whitener = tensors["padim.whitener"].to(device)
        scorer.grid = tuple(meta["grid"])
        scorer.n_train = int(meta["n_train"])
        scorer._acc = None
        scorer.fitted = True
        return scorer
