"""Per-position Gaussians for PaDiM, and Mahalanobis distances to them.

At each of ``P`` patch positions the model is ``N(mu_p, Sigma_p + eps I)``, ``Sigma_p`` the unbiased
sample covariance of the ``n`` training embeddings (``D`` dimensions) at that position. Two exact
representations of the same Gaussians:

* **dense** (:class:`DenseGaussians`): the lower Cholesky factor ``L`` of ``Sigma + eps I``,
  ``[P, D, D]``, fitted from streaming sums (:class:`GaussianAccumulator`) whose memory does not
  depend on ``n``. A distance is ``|| L^-1 (x - mu) ||``: a triangular solve, ``D^2``
  multiply-adds per patch.
* **low-rank** (:class:`LowRankGaussians`): with ``Y = (X - mu) / sqrt(n - 1)`` ``[n, D]`` the
  centred training embeddings, ``Sigma + eps I = eps I + Y^T Y`` and (Woodbury)
  ``(eps I + Y^T Y)^-1 = (I - Y^T G^-1 Y) / eps`` with ``G = eps I + Y Y^T = C C^T`` ``[n, n]``.
  Stored: ``Y`` ``[P, n, D]`` and ``C^-1`` ``[P, n, n]``. For ``x`` (centred on ``mu``)::

      a = G^-1 Y x,   r = x - Y^T a,   d^2 = |r|^2 / eps + |a|^2

  (``|r|^2 = |x|^2 - a.Yx - eps |a|^2``, so ``d^2 = (|x|^2 - a.Yx) / eps``, the Woodbury form).
  Both terms are non-negative, so nothing cancels: on MVTec bottle features the float32 distances
  are within 1e-6 of a float64 reference, where the dense float32 path is within 2e-5 to 1e-4.
  Memory ``P (n D + n^2)`` floats, fit ``O(P n^2 D)``, a distance ``4 n D + 4 n^2``
  multiply-adds in matrix products: smaller and faster to fit than dense whenever ``n < D``,
  faster to score for ``n`` up to about ``0.4 D`` (:func:`choose_covariance`).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Union

import torch

from anomaly_hooks.modelfile import StoredTensor
from anomaly_hooks.scorers.padim.loo import (
    CHUNK_POSITIONS,
    blocked_cholesky,
    blocked_inverse_cholesky,
    centred_loo_squared,
    dense_group_out_squared,
    dense_loo_squared,
    dense_terms,
    fit_chunk,
    gram_group_out_squared,
    gram_loo_squared,
    map_position_chunks,
)

SCORE_CHUNK = 256  # positions per chunk when scoring (operands stay in cache)
HALF_CHUNK = 8  # positions of float16 factors widened to float32 at a time on the CPU (cache-sized)
HALF_WIDEN_BYTES = 256 << 20  # on a GPU: float32 bytes widened at a time (few, large launches)
SAMPLES_CHUNK_BYTES = 64 << 20  # centred samples and covariances per chunk of from_samples
BUFFER_SAMPLES = 128  # samples per position collected before their products are added
BLOCK_BASE32 = 32  # float32 blocked inverse Cholesky: LAPACK below this size
BLOCK_BASE_CHOL = 64  # float32 blocked dense Cholesky on the CPU (measured best at D = 176)
LOWRANK_MAX_FRACTION = 0.4  # auto: low-rank for n <= 0.4 D training images


def choose_covariance(covariance: str, n_images: int, dim: int, factor_dtype: str) -> str:
    """The representation for ``n_images`` training images of dimension ``dim``: ``dense`` or
    ``lowrank``. ``auto`` picks low-rank for ``n_images <= 0.4 dim`` (where it is also the
    faster one to score) unless float16 factors were asked for (those are dense only)."""
    if covariance != "auto":
        return covariance
    if factor_dtype == "float16":
        return "dense"
    return "lowrank" if n_images <= lowrank_capacity(dim) else "dense"


def lowrank_capacity(dim: int) -> int:
    """The most training images ``auto`` keeps in low-rank form for dimension ``dim``."""
    return max(2, int(LOWRANK_MAX_FRACTION * dim))


def _cholesky64(mat: torch.Tensor, what: str) -> torch.Tensor:
    chol64, info64 = torch.linalg.cholesky_ex(mat.double())
    if bool((info64 > 0).any()):
        raise ValueError(f"a {what} is not positive definite even with epsilon added; "
                         "raise padim.epsilon")
    return chol64


def inverse_cholesky(mat: torch.Tensor, what: str = "Gram matrix") -> torch.Tensor:
    """``C^-1`` ``[c, m, m]`` (lower) for ``C C^T = mat``, ``mat`` ``[c, m, m]`` float32.

    Recursive 2x2 blocking, so that the work is batched matrix products (for the small
    matrices of the low-rank form, LAPACK's per-matrix calls cost twice as much):
    ``C11^-1`` of the leading block, ``C21 = M21 C11^-T``, then the trailing block's
    ``S = M22 - C21 C21^T`` the same way, and ``(C^-1)21 = -C22^-1 C21 C11^-1``. Float32, with
    the whole computation redone in float64 for any matrix where a float32 factorisation fails.
    """
    inv, info = blocked_inverse_cholesky(mat, BLOCK_BASE32)
    bad = torch.nonzero(info > 0).flatten()
    if bad.numel():
        eye = torch.eye(mat.shape[-1], dtype=torch.float64, device=mat.device)
        chol = _cholesky64(mat[bad], what)
        inv[bad] = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False).float()
    return inv


# -- dense ---------------------------------------------------------------------------------
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
        """Add samples ``x`` ``[P, B, D]`` (B samples at each of P positions; any strides)."""
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
    number), falling back to float64 for any matrix where float32 fails. On the CPU with
    several OpenMP threads by recursive blocking (:func:`loo.blocked_cholesky`: the batch's
    products spread over the threads), else one LAPACK call per matrix (single-threaded, as in
    the chunks of :func:`loo.map_position_chunks`: 14 against 22 ms for 128 matrices at
    D = 176). ``work``: a float32 buffer of at least ``cov``'s shape."""
    cov.diagonal(dim1=1, dim2=2).add_(epsilon)
    out = work[:cov.shape[0]]
    if cov.device.type == "cpu" and torch.get_num_threads() > 1:
        factor, info = blocked_cholesky(cov, BLOCK_BASE_CHOL)
        out.copy_(factor)
        del factor
    else:  # one batched library call (single-threaded on the CPU: LAPACK per matrix is best)
        info = torch.empty(cov.shape[0], dtype=torch.int32, device=cov.device)
        torch.linalg.cholesky_ex(cov, out=(out, info))
    bad = torch.nonzero(info > 0).flatten()
    if bad.numel():
        out[bad] = _cholesky64(cov[bad], "covariance").float()
    return cov.copy_(out)


def half_chunk(dim: int, device: torch.device) -> int:
    """Positions of ``[D, D]`` float16 factors widened to float32 at a time: ``HALF_CHUNK``
    (8, cache-sized) on the CPU; on a GPU as many as fit in ``HALF_WIDEN_BYTES``, at most
    ``SCORE_CHUNK`` (221 for D = 550: 15 chunks of WRN50's 3136 positions instead of 392,
    each a widening copy and a batched triangular solve)."""
    if device.type != "cuda":
        return HALF_CHUNK
    return max(1, min(SCORE_CHUNK, HALF_WIDEN_BYTES // (4 * dim * dim)))


class DenseGaussians:
    """Means ``[P, D]`` float32 and lower Cholesky factors ``[P, D, D]`` (float32 or float16) of
    ``Sigma + eps I``; optionally the training embeddings ``samples`` ``[P, n, D]`` float32
    (``padim.keep_embeddings``: unused by scoring, kept for exact updates).

    The embeddings are held in memory when fitted here; Gaussians from a model file leave them
    in the file (a :class:`~anomaly_hooks.modelfile.StoredTensor`, ``stored_samples``) and
    every read of ``samples`` reads them from it, verified to be the file loaded
    (``hold_samples`` reads them once for a span of work). Gaussians loaded for an update may
    leave their factors there too (read at their first use: :attr:`chol`)."""

    kind = "dense"

    def __init__(self, mean: torch.Tensor, chol: Union[torch.Tensor, StoredTensor],
                 samples: Union[torch.Tensor, StoredTensor, None] = None) -> None:
        self.mean, self._chol = mean, chol
        self._samples = samples
        self.loo: Optional[torch.Tensor] = None  # [P, n] LOO distances, when made from samples

    @property
    def chol(self) -> torch.Tensor:
        """The factors ``[P, D, D]`` on the means' device. A model loaded to be updated
        (``Detector.load(for_update=True)``) leaves them in its file: the first use reads them
        from there (verified, then held); an update remakes them without that read."""
        if isinstance(self._chol, StoredTensor):
            self._chol = self._chol.read().to(self.mean.device)
        return self._chol

    @chol.setter
    def chol(self, value: torch.Tensor) -> None:
        self._chol = value

    @property
    def samples(self) -> Optional[torch.Tensor]:
        """The kept training embeddings ``[P, n, D]`` float32 on the means' device, or None;
        read from the model file (whole, verified) at each access when left there: read it
        once into a variable, or within :meth:`hold_samples`."""
        if isinstance(self._samples, StoredTensor):
            return self._samples.read().to(self.mean.device)
        return self._samples

    @samples.setter
    def samples(self, value: Optional[torch.Tensor]) -> None:
        self._samples = value

    @property
    def keeps_samples(self) -> bool:
        """Whether the model keeps its training embeddings (in memory or in its file)."""
        return self._samples is not None

    @property
    def stored_samples(self) -> Optional[StoredTensor]:
        """Where the kept embeddings are when they were left in the model file; None when
        they are in memory or not kept."""
        return self._samples if isinstance(self._samples, StoredTensor) else None

    @contextmanager
    def hold_samples(self) -> Iterator[None]:
        """Within the block, embeddings left in the model file are read once and held in
        memory (so several reads cost one); afterwards they are left in the file again."""
        stored = self.stored_samples
        if stored is None:
            yield
            return
        self._samples = stored.read().to(self.mean.device)
        try:
            yield
        finally:
            self._samples = stored

    def bind_file(self, path: Path, file_checksum: str) -> None:
        """The model was saved to ``path`` (recorded ``file_checksum``): embeddings left in a
        model file are read from this one from now on (the one loaded may be replaced)."""
        if self.stored_samples is not None:
            self._samples = self.stored_samples.at(path, file_checksum)

    @classmethod
    @torch.inference_mode()  # the accumulator's state lives in inference mode
    def from_accumulator(cls, acc: GaussianAccumulator, epsilon: float,
                         dtype: torch.dtype = torch.float32) -> "DenseGaussians":
        """Factorise the accumulated covariances in place (float32), then keep them as ``dtype``
        (a float16 copy is made chunk by chunk)."""
        p, d = acc.shift.shape
        mean = acc.mean().float()
        work = torch.empty(min(CHUNK_POSITIONS, p), d, d, device=acc.shift.device)
        half = (torch.empty(p, d, d, dtype=dtype, device=acc.shift.device)
                if dtype != torch.float32 else None)
        for lo, cov in acc.covariances():  # each factor overwrites its covariance in place
            chol = cholesky_factor_(cov, epsilon, work)
            if half is not None:
                half[lo:lo + chol.shape[0]] = chol
        del work
        return cls(mean, acc.release() if half is None else half)

    @classmethod
    @torch.inference_mode()
    def from_samples(cls, samples: torch.Tensor, epsilon: float,
                     dtype: torch.dtype = torch.float32,
                     out: Optional[torch.Tensor] = None, loo: bool = False,
                     groups: Optional[torch.Tensor] = None) -> "DenseGaussians":
        """The Gaussians of every training embedding ``samples`` ``[P, n, D]`` float32: the
        mean in float64, the covariance as one float32 product of the samples centred on it,
        then factorised as :meth:`from_accumulator` does. The result depends on the samples
        alone, not on how they arrived (batch sizes, shards, an update's two halves), so an
        update that keeps every image's embeddings gives the refit's factors: with ``n < D``
        the covariance is singular but for ``eps I``, and the rounding of streaming sums,
        different for every split into batches, would reach the scores amplified by up to
        ``|Sigma| / eps`` (2.7e-4 relative on battery_weld, 37 images, D = 176). Chunks of
        positions run on :func:`loo.map_position_chunks` (each chunk's arithmetic is the same
        however they are spread over threads). ``out``: a
        float32 ``[P, D, D]`` buffer to factorise into (an accumulator's spent sums), else a
        new one. ``loo``: also the samples' exact leave-one-out distances ``[P, n]`` (``.loo``;
        leave-one-group-out with ``groups`` ``[n]``) from the Gram matrices of the same centred
        chunks (:func:`loo.centred_loo_squared`; :func:`loo.loo_distances_from_samples` gives
        the same): one pass over the samples for both."""
        p, n, d = samples.shape
        mean = torch.empty(p, d, dtype=torch.float32, device=samples.device)
        chol = (torch.empty(p, d, d, dtype=torch.float32, device=samples.device)
                if out is None else out)
        step = max(1, min(fit_chunk(n, d, samples.device),
                          SAMPLES_CHUNK_BYTES // (4 * d * (n + d))))
        half = (torch.empty(p, d, d, dtype=dtype, device=samples.device)
                if dtype != torch.float32 else None)

        loo = loo or groups is not None
        loo_sq = torch.empty(p, n, dtype=torch.float32, device=samples.device) if loo else None

        def chunk(lo: int, hi: int) -> None:
            x = samples[lo:hi]
            mean[lo:hi] = x.mean(dim=1, dtype=torch.float64)
            x = x - mean[lo:hi].unsqueeze(1)  # centred on the exact mean, rounded to float32
            cov = torch.bmm(x.transpose(1, 2), x, out=chol[lo:hi]).div_(n - 1)
            if loo_sq is not None:
                loo_sq[lo:hi] = centred_loo_squared(x, epsilon, groups, cov=cov)
            del x
            cholesky_factor_(cov, epsilon, torch.empty_like(cov))
            if half is not None:
                half[lo:hi] = cov

        map_position_chunks(chunk, p, step, samples.device)
        out_g = cls(mean, chol if half is None else half)
        if loo_sq is not None:
            out_g.loo = loo_sq.clamp_min_(0).sqrt_()
        return out_g

    def distances(self, x: torch.Tensor) -> torch.Tensor:
        """Mahalanobis distances ``[P, B]`` of ``x`` ``[P, B, D]`` (any strides)."""
        step = SCORE_CHUNK if self.chol.dtype == torch.float32 else half_chunk(
            self.chol.shape[-1], self.chol.device)
        return _chunked_distances(x, self.mean, step, self._squared)

    def loo_distances(self, x: torch.Tensor, n: int, epsilon: float) -> torch.Tensor:
        """Leave-one-out distances ``[P, B]`` of *training* samples ``x`` ``[P, B, D]``: each to
        the model refitted without it (``n`` training images; :func:`loo.dense_loo_squared`)."""
        terms = dense_terms(n)

        def squared(lo: int, hi: int, diff: torch.Tensor) -> torch.Tensor:
            return dense_loo_squared(diff, self.chol[lo:hi], n, epsilon, terms).clamp_min_(0)

        return _chunked_distances(x, self.mean, HALF_CHUNK, squared)

    def group_out_distances(self, x: torch.Tensor, n: int, epsilon: float) -> torch.Tensor:
        """Leave-one-group-out distances ``[P, m, g]`` of ``m`` whole groups of ``g`` training
        samples each, ``x`` ``[P, m, g, D]``: each to the model refitted without its group
        (:func:`loo.dense_group_out_squared`)."""
        p, m, g, d = x.shape
        out = torch.empty(p, m, g, dtype=torch.float32, device=x.device)
        for lo in range(0, p, HALF_CHUNK):
            hi = min(lo + HALF_CHUNK, p)
            diff = x[lo:hi].float() - self.mean[lo:hi].view(hi - lo, 1, 1, d)
            out[lo:hi] = dense_group_out_squared(diff, self.chol[lo:hi], n, epsilon)
        return out.clamp_min_(0).sqrt_()

    def _squared(self, lo: int, hi: int, diff: torch.Tensor) -> torch.Tensor:
        chol = self.chol[lo:hi].float()  # float32 factors: the tensor itself, no copy
        # [c, D, B] right-hand sides in column-major order: what the solver wants
        z = torch.linalg.solve_triangular(chol, diff.transpose(1, 2), upper=False)
        return z.square_().sum(dim=1)

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The model file's tensors (the kept embeddings read from the loaded file if left
        there: a saved file is always complete)."""
        out = {"padim.mean": self.mean, "padim.chol": self.chol}
        samples = self.samples
        if samples is not None:
            out["padim.dense_samples"] = samples
        return out

    @classmethod
    def from_tensors(cls, tensors: Dict[str, Union[torch.Tensor, StoredTensor]], p: int,
                     d: int, device: torch.device, n: Optional[int] = None
                     ) -> "DenseGaussians":
        """From a model file's tensors; ``n``: the training image count, which the kept
        embeddings (when there) must match. Kept embeddings left in the file
        (:class:`~anomaly_hooks.modelfile.StoredTensor`) stay there."""
        mean, chol = _get(tensors, "padim.mean", "padim.chol")
        if tuple(mean.shape) != (p, d) or tuple(chol.shape) != (p, d, d):
            raise ValueError(f"padim tensors {tuple(mean.shape)} / {tuple(chol.shape)} do not fit "
                             f"{p} positions and {d} channels")
        _check_dtype("mean", mean, (torch.float32,))
        _check_dtype("chol", chol, (torch.float32, torch.float16))
        samples = tensors.get("padim.dense_samples")
        if samples is not None:
            if len(samples.shape) != 3 or tuple(samples.shape[::2]) != (p, d) or (
                    n is not None and samples.shape[1] != n):
                raise ValueError(f"padim.dense_samples {tuple(samples.shape)} do not fit {p} "
                                 f"positions, {n} training images and {d} channels")
            _check_dtype("dense_samples", samples, (torch.float32,))
            if not isinstance(samples, StoredTensor):
                samples = samples.to(device)
        return cls(mean.to(device),
                   chol if isinstance(chol, StoredTensor) else chol.to(device), samples)


# -- low-rank ------------------------------------------------------------------------------
class SampleStore:
    """The training embeddings at every position, ``[P, capacity, D]`` float32, written as they
    arrive (capacity doubles when full; ``capacity`` given up front avoids any regrowth)."""

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self.n = 0
        self.buf: Optional[torch.Tensor] = None

    @torch.inference_mode()  # state is only ever touched in inference mode
    def update(self, x: torch.Tensor) -> None:
        """Add samples ``x`` ``[P, B, D]`` (any strides)."""
        p, b, d = x.shape
        if self.buf is None:
            self.buf = torch.empty(p, max(self.capacity, b, 2), d, dtype=torch.float32,
                                   device=x.device)
        elif p != self.buf.shape[0] or d != self.buf.shape[2]:
            raise ValueError(f"batch of shape {tuple(x.shape)} does not match the first batch "
                             f"[P={self.buf.shape[0]}, B, D={self.buf.shape[2]}]: all images "
                             "must give the same embedding grid")
        if self.n + b > self.buf.shape[1]:
            grown = torch.empty(p, max(2 * self.buf.shape[1], self.n + b), d,
                                dtype=torch.float32, device=x.device)
            grown[:, :self.n] = self.buf[:, :self.n]
            self.buf = grown
        self.buf[:, self.n:self.n + b] = x
        self.n += b

    def samples(self) -> torch.Tensor:
        """``[P, n, D]`` (a view)."""
        return self.buf[:, :self.n]


class LowRankGaussians:
    """Means ``[P, D]``, centred training embeddings ``Y = (X - mu) / sqrt(n - 1)``
    ``[P, n, D]`` and inverse Cholesky factors ``C^-1`` ``[P, n, n]`` of ``eps I + Y Y^T``, all
    float32, and ``eps`` (see the module docstring)."""

    kind = "lowrank"

    def __init__(self, mean: torch.Tensor, y: torch.Tensor, cinv: torch.Tensor,
                 epsilon: float) -> None:
        self.mean, self.y, self.cinv, self.epsilon = mean, y, cinv, epsilon
        self.loo: Optional[torch.Tensor] = None  # [P, n] LOO distances, when the fit made them

    @classmethod
    @torch.inference_mode()  # the store's state lives in inference mode
    def from_samples(cls, store: SampleStore, epsilon: float, loo: bool = False,
                     groups: Optional[torch.Tensor] = None) -> "LowRankGaussians":
        """Centre and scale the stored samples in place (they become ``Y``) and factorise
        ``eps I + Y Y^T`` position chunk by position chunk. ``loo``: also the training samples'
        exact leave-one-out distances ``[P, n]`` (in ``.loo``), from the same Gram matrices;
        with ``groups`` ``[n]``, leave-one-group-out (:func:`loo.gram_group_out_squared`)."""
        x = store.samples()
        p, n, d = x.shape
        if n < store.buf.shape[1]:  # fewer images than planned: drop the unused capacity
            x = x.contiguous()
        store.buf = None
        mean = torch.empty(p, d, dtype=torch.float32, device=x.device)
        cinv = torch.empty(p, n, n, dtype=torch.float32, device=x.device)
        eps_eye = epsilon * torch.eye(n, dtype=torch.float32, device=x.device)
        loo_sq = torch.empty(p, n, dtype=torch.float32, device=x.device) if loo else None

        def chunk(lo: int, hi: int) -> None:
            y = x[lo:hi]
            # a float32 mean (the stored one): Y is centred on exactly the mean the model keeps
            torch.mean(y, dim=1, out=mean[lo:hi])
            y.sub_(mean[lo:hi].unsqueeze(1)).mul_(1.0 / math.sqrt(n - 1))
            gram = torch.baddbmm(eps_eye, y, y.transpose(1, 2))
            cinv[lo:hi] = inverse_cholesky(gram)
            if loo_sq is not None:
                loo_sq[lo:hi] = (gram_loo_squared(gram, epsilon) if groups is None
                                 else gram_group_out_squared(gram, groups, epsilon))

        map_position_chunks(chunk, p, fit_chunk(n, d, x.device, covariance=False), x.device)
        out = cls(mean, x, cinv, epsilon)
        if loo_sq is not None:
            out.loo = loo_sq.clamp_min_(0).sqrt_()
        return out

    def distances(self, x: torch.Tensor) -> torch.Tensor:
        """Mahalanobis distances ``[P, B]`` of ``x`` ``[P, B, D]`` (any strides)."""
        return _chunked_distances(x, self.mean, SCORE_CHUNK, self._squared)

    def _squared(self, lo: int, hi: int, xc: torch.Tensor) -> torch.Tensor:
        y, cinv = self.y[lo:hi], self.cinv[lo:hi]
        w = torch.bmm(xc, y.transpose(1, 2))  # (Y x)^T: [c, B, n]
        a = torch.bmm(torch.bmm(w, cinv.transpose(1, 2)), cinv)  # (G^-1 Y x)^T
        r = torch.baddbmm(xc, a, y, alpha=-1.0)  # (x - Y^T a)^T
        return r.square_().sum(dim=2).div_(self.epsilon) + a.square_().sum(dim=2)

    def tensors(self) -> Dict[str, torch.Tensor]:
        return {"padim.mean": self.mean, "padim.lowrank_y": self.y,
                "padim.lowrank_cinv": self.cinv}

    @classmethod
    def from_tensors(cls, tensors: Dict[str, torch.Tensor], p: int, d: int, epsilon: float,
                     device: torch.device) -> "LowRankGaussians":
        mean, y, cinv = _get(tensors, "padim.mean", "padim.lowrank_y", "padim.lowrank_cinv")
        n = int(y.shape[1]) if y.ndim == 3 else -1
        if (tuple(mean.shape) != (p, d) or tuple(y.shape) != (p, n, d)
                or tuple(cinv.shape) != (p, n, n) or n < 2):
            raise ValueError(f"padim tensors {tuple(mean.shape)} / {tuple(y.shape)} / "
                             f"{tuple(cinv.shape)} do not fit {p} positions and {d} channels")
        for name, t in (("mean", mean), ("lowrank_y", y), ("lowrank_cinv", cinv)):
            _check_dtype(name, t, (torch.float32,))
        return cls(mean.to(device), y.to(device), cinv.to(device), epsilon)


def _get(tensors: Dict[str, torch.Tensor], *names: str) -> list:
    missing = [k for k in names if k not in tensors]
    if missing:
        raise ValueError(f"not a PaDiM model of this kind: tensors {missing} are missing")
    return [tensors[k] for k in names]


def _check_dtype(name: str, t: torch.Tensor, allowed: tuple) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"padim.{name} has dtype {t.dtype}, expected one of {allowed}")


def _chunked_distances(x: torch.Tensor, mean: torch.Tensor, step: int,
                       squared: Callable[[int, int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Distances ``[P, B]`` of ``x`` ``[P, B, D]``, ``step`` positions at a time (operands stay
    in cache): ``squared(lo, hi, x[lo:hi] - mean[lo:hi])`` gives the squared ones ``[c, B]``
    from the centred chunk, made contiguous ``[c, B, D]`` whatever the strides of ``x``."""
    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for lo in range(0, x.shape[0], step):
        hi = min(lo + step, x.shape[0])
        out[lo:hi] = squared(lo, hi, x[lo:hi].float() - mean[lo:hi].unsqueeze(1))
    return out.sqrt_()
