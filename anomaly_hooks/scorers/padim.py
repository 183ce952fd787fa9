"""PaDiM (Defard et al. 2020): a Gaussian per patch position, Mahalanobis distance.

Fitting streams: per position it keeps shifted sums and sums of outer products (one float32
``[P, D, D]`` tensor that becomes the covariances, then the factors, in place), so memory does not
grow with the number of training images and the fit never holds two ``[P, D, D]`` tensors. The fitted state is the mean ``[P, D]``
and the lower Cholesky factor ``L`` ``[P, D, D]`` (float32) of each position's covariance
``Sigma + epsilon I = L L^T``. The Mahalanobis distance is ``|| L^-1 (x - mu) ||``, computed by one
batched triangular solve over all positions — no explicit inverse, no per-position loop.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, Optional, Sequence

import torch

from anomaly_hooks.embedding import PatchEmbedder, random_channel_subset
from anomaly_hooks.extractor import LayerInfo
from anomaly_hooks.scorers.base import Scorer, register

DEFAULT_FEATURES = {"wide_resnet50_2": 550, "resnet18": 100}
CHUNK_POSITIONS = 128  # positions per chunk of finalising work (bounds the temporaries)
BUFFER_SAMPLES = 128  # samples per position collected before their products are added


def default_n_features(backbone_name: str, total: int) -> int:
    """The paper's d (550 for WRN50, 100 for ResNet18); otherwise min(total, 550)."""
    return min(DEFAULT_FEATURES.get(backbone_name, 550), total)


class GaussianAccumulator:
    """Streaming per-position mean and covariance in one float32 tensor, updated in place.

    Samples are centred on a shift ``K`` (the first batch's mean) so that the sums hold small
    numbers (no cancellation in ``S2 - S1 S1^T / n``), and collected in a float32 buffer
    ``[P, buffer_samples, D]``; when it is full, its outer products are added to the float32
    sums ``S2`` ``[P, D, D]`` by one in-place batched ``baddbmm`` (the GEMM sums the
    ``buffer_samples`` products accurately; ``S2`` sees one addition per flush, so the rounding
    grows with ``n / buffer_samples``, not with ``n``: ~1e-6 relative for thousands of images).
    ``S1`` ``[P, D]`` is float64. ``mean = K + S1 / n``, ``cov = (S2 - S1 S1^T / n) / (n - 1)``.
    Memory: ``S2`` (which becomes the covariances, then the Cholesky factors, in place) plus the
    buffer — independent of the number of images, and no second ``[P, D, D]`` copy at any time.
    """

    def __init__(self, buffer_samples: int = BUFFER_SAMPLES) -> None:
        self.n = 0
        self.buffer_samples = buffer_samples
        self.shift: Optional[torch.Tensor] = None  # [P, D] float32
        self.s1: Optional[torch.Tensor] = None  # [P, D] float64
        self.s2: Optional[torch.Tensor] = None  # [P, D, D] float32
        self._buf: Optional[torch.Tensor] = None  # [P, buffer, D] float32
        self._fill = 0
        self.spent = False  # True once S2 has been turned into covariances

    def _start(self, x: torch.Tensor) -> None:
        p, _, d = x.shape
        self.shift = x.mean(dim=1, dtype=torch.float64).float()
        self.s1 = torch.zeros(p, d, dtype=torch.float64, device=x.device)
        self.s2 = torch.zeros(p, d, d, dtype=torch.float32, device=x.device)
        self._buf = torch.empty(p, self.buffer_samples, d, dtype=torch.float32, device=x.device)

    @torch.inference_mode()  # state is only ever touched in inference mode
    def update(self, x: torch.Tensor) -> None:
        """Add samples ``x`` ``[P, B, D]`` (B samples at each of P positions)."""
        if self.spent:
            raise RuntimeError("the covariances were already computed: no more samples")
        if self.shift is None:
            self._start(x)
        elif x.shape[0] != self.shift.shape[0] or x.shape[2] != self.shift.shape[1]:
            raise ValueError(f"batch of shape {tuple(x.shape)} does not match the first batch "
                             f"[P={self.shift.shape[0]}, B, D={self.shift.shape[1]}]: all images "
                             "must give the same embedding grid")
        start = 0
        while start < x.shape[1]:
            take = min(x.shape[1] - start, self.buffer_samples - self._fill)
            chunk = self._buf[:, self._fill:self._fill + take]
            torch.sub(x[:, start:start + take], self.shift.unsqueeze(1), out=chunk)
            # a float32 sum over this batch's few centred samples (4x faster than a float64
            # reduction), accumulated across batches in float64; the mean is kept in float32
            self.s1 += chunk.sum(dim=1)
            self._fill += take
            start += take
            if self._fill == self.buffer_samples:
                self._flush()
        self.n += x.shape[1]

    @torch.inference_mode()  # state is only ever touched in inference mode
    def _flush(self) -> None:
        """Add the buffered samples' outer products to ``S2`` in place."""
        buf = self._buf[:, :self._fill]
        for lo in range(0, buf.shape[0], CHUNK_POSITIONS):  # chunks keep the operands in cache
            part = buf[lo:lo + CHUNK_POSITIONS]
            self.s2[lo:lo + part.shape[0]].baddbmm_(part.transpose(1, 2), part)
        self._fill = 0

    @torch.inference_mode()  # state is only ever touched in inference mode
    def finish(self) -> None:
        """Flush what is buffered and free the buffer."""
        if self._fill:
            self._flush()
        self._buf = None

    def mean(self) -> torch.Tensor:
        """``[P, D]`` float64."""
        return self.shift.double() + self.s1 / self.n

    @torch.inference_mode()  # state is only ever touched in inference mode
    def covariances(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Turn ``S2`` into the unbiased covariances in place, ``CHUNK_POSITIONS`` positions at a
        time; yields ``(first position, view [c, D, D] float32)``. The caller may overwrite each
        view (e.g. with its Cholesky factor). The accumulator is spent afterwards."""
        self.finish()
        if self.spent:
            raise RuntimeError("the covariances were already computed")
        self.spent = True
        for lo in range(0, self.s2.shape[0], CHUNK_POSITIONS):
            cov = self.s2[lo:lo + CHUNK_POSITIONS]
            s1 = self.s1[lo:lo + cov.shape[0]].float()
            # one pass: cov = S2 / (n - 1) - S1 S1^T / (n (n - 1))
            yield lo, cov.baddbmm_(s1.unsqueeze(2), s1.unsqueeze(1), beta=1.0 / (self.n - 1),
                                   alpha=-1.0 / (self.n * (self.n - 1)))

    def release(self) -> Optional[torch.Tensor]:
        """Hand over ``S2`` (the caller's from now on) and drop every reference to it."""
        s2, self.s2 = self.s2, None
        return s2


def cholesky_factor_(cov: torch.Tensor, epsilon: float, work: torch.Tensor) -> torch.Tensor:
    """Lower ``L`` with ``L L^T = cov + epsilon I``, ``cov`` ``[c, D, D]`` float32, written over
    ``cov`` (which is returned). Factorised in float32 (``epsilon I`` bounds the condition
    number), falling back to float64 for any matrix where float32 fails. ``work``: a float32
    buffer of at least ``cov``'s shape, reused for every chunk."""
    cov.diagonal(dim1=1, dim2=2).add_(epsilon)
    out = work[:cov.shape[0]]
    info = torch.empty(cov.shape[0], dtype=torch.int32, device=cov.device)
    torch.linalg.cholesky_ex(cov, out=(out, info))
    bad = torch.nonzero(info > 0).flatten()
    if bad.numel():
        chol64, info64 = torch.linalg.cholesky_ex(cov[bad].double())
        if bool((info64 > 0).any()):
            raise ValueError("a covariance is not positive definite even with epsilon added; "
                             "raise padim.epsilon")
        out[bad] = chol64.float()
    return cov.copy_(out)


def mahalanobis(x: torch.Tensor, mean: torch.Tensor, chol: torch.Tensor,
                chunk: int = 8) -> torch.Tensor:
    """Distances ``[P, B]`` of ``x`` ``[P, D, B]`` to Gaussians (``mean`` ``[P, D]``, lower
    Cholesky factors ``chol`` ``[P, D, D]``): ``|| L^-1 (x - mu) ||`` per column.

    float32 factors are used in place (never copied); float16 factors are widened to float32
    ``chunk`` positions at a time.
    """
    if chol.dtype == torch.float32:
        diff = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # contiguous [P, D, B]
        torch.sub(x, mean.unsqueeze(2), out=diff)
        z = torch.linalg.solve_triangular(chol, diff, upper=False)
        return z.square_().sum(dim=1).sqrt_()
    out = torch.empty(x.shape[0], x.shape[2], dtype=torch.float32, device=x.device)
    for lo in range(0, x.shape[0], chunk):
        hi = min(lo + chunk, x.shape[0])
        out[lo:hi] = mahalanobis(x[lo:hi], mean[lo:hi], chol[lo:hi].float())
    return out


@register
class PadimScorer(Scorer):
    """Per-position Gaussian; patch score = Mahalanobis distance (not squared)."""

    method = "padim"
    default_layers = ["layer1", "layer2", "layer3"]
    min_train_images = 2

    def __init__(self, embedder: PatchEmbedder, epsilon: float,
                 factor_dtype: str = "float32") -> None:
        super().__init__(embedder)
        self.epsilon = epsilon
        self.factor_dtype = torch.float16 if factor_dtype == "float16" else torch.float32
        self._acc: Optional[GaussianAccumulator] = GaussianAccumulator()
        self.mean: Optional[torch.Tensor] = None  # [P, D] float32
        self.chol: Optional[torch.Tensor] = None  # [P, D, D] float32, lower Cholesky factors
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
        return cls(PatchEmbedder(layers, upsample="nearest", channel_idx=idx), cfg.epsilon,
                   cfg.factor_dtype)

    def partial_fit(self, embeddings: torch.Tensor) -> None:
        if self._acc is None:
            raise RuntimeError("this PaDiM scorer is already fitted")
        b, d, h, w = embeddings.shape
        if self.grid is None:
            self.grid = (h, w)
        self._acc.update(embeddings.flatten(2).permute(2, 0, 1).float())

    @torch.inference_mode()  # state is only ever touched in inference mode
    def finalize(self, progress: bool = False) -> None:
        acc = self._acc
        if acc is None or acc.n < self.min_train_images:
            n = 0 if acc is None else acc.n
            raise ValueError(f"PaDiM needs at least {self.min_train_images} training images "
                             f"for a covariance; got {n}")
        p, d = acc.shift.shape
        self.mean = acc.mean().float()
        work = torch.empty(min(CHUNK_POSITIONS, p), d, d, device=acc.shift.device)
        half = (torch.empty(p, d, d, dtype=self.factor_dtype, device=acc.shift.device)
                if self.factor_dtype != torch.float32 else None)
        for lo, cov in acc.covariances():  # each factor overwrites its covariance in place
            chol = cholesky_factor_(cov, self.epsilon, work)
            if half is not None:
                half[lo:lo + chol.shape[0]] = chol
        del work
        self.chol = acc.release() if half is None else half
        self.n_train = acc.n
        self._acc = None
        self.fitted = True

    def score(self, embeddings: torch.Tensor) -> torch.Tensor:
        self.check_fitted()
        b, d, h, w = embeddings.shape
        if (h, w) != self.grid or d != self.mean.shape[1]:
            raise ValueError(f"embeddings {tuple(embeddings.shape)} do not match the fitted grid "
                             f"{self.grid} and dimension {self.mean.shape[1]}")
        x = embeddings.flatten(2).permute(2, 1, 0).float()  # [P, D, B]
        return mahalanobis(x, self.mean, self.chol).t().reshape(b, h, w)

    def state(self) -> tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        self.check_fitted()
        tensors = {"padim.mean": self.mean, "padim.chol": self.chol,
                   **self.embedder.state_tensors()}
        meta = {"grid": list(self.grid), "n_train": self.n_train, "epsilon": self.epsilon}
        return tensors, meta

    @classmethod
    def from_state(cls, cfg: Any, layers: Sequence[LayerInfo], tensors: Dict[str, torch.Tensor],
                   meta: Dict[str, Any], device: torch.device) -> "PadimScorer":
        need = ("padim.mean", "padim.chol", "embed.channel_idx")
        missing = [k for k in need if k not in tensors]
        if missing:
            raise ValueError(f"not a PaDiM model: tensors {missing} are missing")
        embedder = PatchEmbedder(layers, upsample="nearest", channel_idx=tensors["embed.channel_idx"])
        scorer = cls(embedder, float(meta["epsilon"]), cfg.factor_dtype)
        p = int(meta["grid"][0]) * int(meta["grid"][1])
        d = int(embedder.out_channels)
        mean, chol = tensors["padim.mean"], tensors["padim.chol"]
        if tuple(mean.shape) != (p, d) or tuple(chol.shape) != (p, d, d):
            raise ValueError(f"padim tensors {tuple(mean.shape)} / {tuple(chol.shape)} do not fit "
                             f"the grid {meta['grid']} and {d} channels")
        scorer.mean = mean.to(device)
        scorer.chol = chol.to(device)
        if scorer.chol.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"padim.chol has dtype {scorer.chol.dtype}")
        scorer.grid = tuple(meta["grid"])
        scorer.n_train = int(meta["n_train"])
        scorer._acc = None
        scorer.fitted = True
        return scorer
