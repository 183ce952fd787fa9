"""PaDiM (Defard et al. 2020): a Gaussian per patch position, Mahalanobis distance.

Fitting streams: per position it keeps shifted sums and sums of outer products in float64, so
memory does not grow with the number of training images. The fitted state is the mean ``[P, D]``
and the lower Cholesky factor ``L`` ``[P, D, D]`` (float32) of each position's covariance
``Sigma + epsilon I = L L^T``. The Mahalanobis distance is ``|| L^-1 (x - mu) ||``, computed by one
batched triangular solve over all positions — no explicit inverse, no per-position loop.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from anomaly_hooks.embedding import PatchEmbedder, random_channel_subset
from anomaly_hooks.extractor import LayerInfo
from anomaly_hooks.scorers.base import Scorer, register

DEFAULT_FEATURES = {"wide_resnet50_2": 550, "resnet18": 100}
CHUNK_POSITIONS = 128  # positions per chunk of float64 work (bounds the temporaries)
BUFFER_SAMPLES = 128  # samples per position collected (float32) before a float64 flush


def default_n_features(backbone_name: str, total: int) -> int:
    """The paper's d (550 for WRN50, 100 for ResNet18); otherwise min(total, 550)."""
    return min(DEFAULT_FEATURES.get(backbone_name, 550), total)


class GaussianAccumulator:
    """Streaming per-position mean and covariance, accumulated in float64.

    Samples are centred on a shift ``K`` (the first batch's mean) for numerical stability and
    collected in a float32 buffer ``[P, BUFFER_SAMPLES, D]``; when it is full, its outer products
    (a float32 batched matrix product over ``BUFFER_SAMPLES`` samples) are added to the float64
    sums. ``mean = K + S1 / n``, ``cov = (S2 - S1 S1^T / n) / (n - 1)``.
    Memory: ``S2`` ``[P, D, D]`` float64 plus the buffer — independent of the number of images.
    """

    def __init__(self, buffer_samples: int = BUFFER_SAMPLES) -> None:
        self.n = 0
        self.buffer_samples = buffer_samples
        self.shift: Optional[torch.Tensor] = None  # [P, D] float32
        self.s1: Optional[torch.Tensor] = None  # [P, D] float64
        self.s2: List[Optional[torch.Tensor]] = []  # per chunk of positions: [c, D, D] float64
        self._buf: Optional[torch.Tensor] = None  # [P, buffer, D] float32
        self._fill = 0
        self._prod: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def _start(self, x: torch.Tensor) -> None:
        p, _, d = x.shape
        self.shift = x.mean(dim=1, dtype=torch.float64).float()
        self.s1 = torch.zeros(p, d, dtype=torch.float64, device=x.device)
        self.s2 = [torch.zeros(min(CHUNK_POSITIONS, p - lo), d, d, dtype=torch.float64,
                               device=x.device) for lo in range(0, p, CHUNK_POSITIONS)]
        self._buf = torch.empty(p, self.buffer_samples, d, dtype=torch.float32, device=x.device)

    @torch.inference_mode()  # state is only ever touched in inference mode
    def update(self, x: torch.Tensor) -> None:
        """Add samples ``x`` ``[P, B, D]`` (B samples at each of P positions)."""
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
            self.s1 += chunk.sum(dim=1, dtype=torch.float64)
            self._fill += take
            start += take
            if self._fill == self.buffer_samples:
                self._flush()
        self.n += x.shape[1]

    @torch.inference_mode()  # state is only ever touched in inference mode
    def _flush(self) -> None:
        """Add the buffered samples' outer products to ``S2`` (chunks of positions)."""
        buf = self._buf[:, :self._fill]
        prod32, prod64 = self._scratch(buf.shape[2], buf.device)
        for i, s2 in enumerate(self.s2):
            part = buf[i * CHUNK_POSITIONS:(i + 1) * CHUNK_POSITIONS]
            c = part.shape[0]
            torch.bmm(part.transpose(1, 2), part, out=prod32[:c])
            prod64[:c].copy_(prod32[:c])
            s2 += prod64[:c]  # a same-dtype add: several times faster than a mixed one
        self._fill = 0

    def _scratch(self, d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Reused float32/float64 ``[CHUNK_POSITIONS, D, D]`` product buffers: fresh large
        allocations each flush would page-fault gigabytes of new memory every time."""
        if self._prod is None:
            self._prod = (torch.empty(CHUNK_POSITIONS, d, d, dtype=torch.float32, device=device),
                          torch.empty(CHUNK_POSITIONS, d, d, dtype=torch.float64, device=device))
        return self._prod

    @torch.inference_mode()  # state is only ever touched in inference mode
    def finish(self) -> None:
        """Flush what is buffered and free the buffer."""
        if self._fill:
            self._flush()
        self._buf = None
        self._prod = None

    def mean(self) -> torch.Tensor:
        """``[P, D]`` float64."""
        return self.shift.double() + self.s1 / self.n

    @torch.inference_mode()  # state is only ever touched in inference mode
    def covariance_chunk(self, i: int, release: bool = False,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Unbiased covariance ``[c, D, D]`` float64 of the ``i``-th chunk of positions
        (positions ``i * CHUNK_POSITIONS`` onwards). ``release`` frees that chunk's sums (the
        accumulator cannot give it again), so that finalising does not hold two copies."""
        if self._fill:
            self._flush()
        s2 = self.s2[i]
        if s2 is None:
            raise RuntimeError(f"covariance chunk {i} was already released")
        s1 = self.s1[i * CHUNK_POSITIONS:i * CHUNK_POSITIONS + s2.shape[0]]
        if release:
            self.s2[i] = None
        # out of place: the sums may be inference tensors (accumulated under inference_mode)
        if out is not None:
            out = out[:s2.shape[0]]
        cov = torch.baddbmm(s2, s1.unsqueeze(2), s1.unsqueeze(1), alpha=-1.0 / self.n, out=out)
        del s2
        return cov.div_(self.n - 1)


def cholesky_factor(cov: torch.Tensor, epsilon: float, work: Optional[torch.Tensor] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Lower float32 ``L`` with ``L L^T = cov + epsilon I``, ``[P, D, D]``; ``cov`` (float64) is
    modified in place. Factorised in float32 (twice as fast; ``epsilon I`` bounds the condition
    number), falling back to float64 for any matrix where float32 fails. ``work``: an optional
    float32 buffer of ``cov``'s shape, reused (and overwritten) instead of a fresh copy; ``out``:
    an optional contiguous float32 tensor of that shape to write ``L`` into."""
    cov.diagonal(dim1=1, dim2=2).add_(epsilon)
    cov32 = work.copy_(cov) if work is not None else cov.float()
    if out is not None:
        info = torch.empty(cov.shape[0], dtype=torch.int32, device=cov.device)
        chol, info = torch.linalg.cholesky_ex(cov32, out=(out, info))
    else:
        chol, info = torch.linalg.cholesky_ex(cov32)
    bad = torch.nonzero(info > 0).flatten()
    if bad.numel():
        chol64, info64 = torch.linalg.cholesky_ex(cov[bad])
        if bool((info64 > 0).any()):
            raise ValueError("a covariance is not positive definite even with epsilon added; "
                             "raise padim.epsilon")
        chol[bad] = chol64.float()
    return chol


def mahalanobis(x: torch.Tensor, mean: torch.Tensor, chol: torch.Tensor,
                chunk: int = 256) -> torch.Tensor:
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
        acc.finish()
        p, d = acc.shift.shape
        self.mean = acc.mean().float()
        # torch.empty touches no pages: resident memory grows as the float64 sums are freed
        self.chol = torch.empty(p, d, d, dtype=self.factor_dtype, device=acc.shift.device)
        # work buffers reused for every chunk (fresh ones would page-fault each time)
        cov64 = torch.empty(CHUNK_POSITIONS, d, d, dtype=torch.float64, device=acc.shift.device)
        cov32 = torch.empty(CHUNK_POSITIONS, d, d, device=acc.shift.device)
        for i in range(len(acc.s2)):
            start = i * CHUNK_POSITIONS
            cov = acc.covariance_chunk(i, release=True, out=cov64)
            c = cov.shape[0]
            if self.chol.dtype == torch.float32:  # factorise straight into the model tensor
                cholesky_factor(cov, self.epsilon, cov32[:c], out=self.chol[start:start + c])
            else:
                self.chol[start:start + c] = cholesky_factor(cov, self.epsilon, cov32[:c])
            del cov
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
