"""Exact leave-one-out (LOO) Mahalanobis distances of PaDiM's own training samples.

At one patch position the model fitted on all ``n`` training embeddings ``x_1..x_n`` is
``N(mu, Sigma + eps I)`` with ``Sigma = S / (n - 1)``, ``S = sum_j u_j u_j^T``, ``u_j = x_j - mu``.
The LOO model of image ``i`` is what a refit without ``x_i`` gives, *with the same* ``eps``::

    mu_-i = mu - u_i / (n - 1),   S_-i = S - n/(n-1) u_i u_i^T,   A_-i = S_-i / (n - 2) + eps I

and ``x_i - mu_-i = n/(n-1) u_i``. Write ``B = S + eps (n - 2) I`` (note ``n - 2``: the full
model's ``(n - 1) (Sigma + eps I)`` is ``S + eps (n - 1) I``, so ``eps`` makes the LOO covariance
*not* a rank-one update of the full one; without ``eps`` it is, and this reduces to the classic
leverage identity). Sherman-Morrison on ``(n - 2) A_-i = B - n/(n-1) u_i u_i^T``, with
``h_i = u_i^T B^-1 u_i``::

    d^2_-i(x_i) = (n/(n-1))^2 (n - 2) h_i / (1 - n h_i / (n - 1))                      (1)

**From the samples** (the low-rank form keeps ``Y = U / sqrt(n-1)``; the dense form keeps them
during the fit when ``n <= 2 D``): ``h_i`` is a diagonal entry of the ``n x n`` Gram world.
``K 1 = 0`` (centred samples), so ``(K + eps' I)^-1`` has the eigenvalue ``1 / eps'`` along
``1``; taking it out (``P = I - 1 1^T / n``) turns (1) into::

    d^2_-i(x_i) = (n - 1) / (eps g_i) - n (n - 2) / (n - 1),
    g_i = [P (Y Y^T + eps'' I)^-1 P]_ii,   eps'' = eps (n - 2) / (n - 1)                 (2)

without the cancellation of ``1 - n h_i / (n - 1)`` in (1). ``g`` comes from the inverse
Cholesky factor ``C^-1`` of ``M = Y Y^T + eps'' I + c 1 1^T / n`` (``c`` = the mean diagonal of
``Y Y^T``: the ``1`` direction gets an eigenvalue of the data's scale instead of the tiny
``eps''``, and ``P M^-1 P = P (Y Y^T + eps'' I)^-1 P``): ``g_i = || C^-1 P e_i ||^2``. Cost per
position: one more ``n x n`` float64 factorisation of the Gram matrix the fit builds anyway.
With more samples than dimensions (``n > D``) the samples give (1) from their covariance
instead (:func:`covariance_group_out_squared`): cheaper, and better conditioned than the
rank-``D`` Gram matrix.

**From the dense factor** (``n > 2 D``; only ``L L^T = Sigma + eps I`` is kept):
``B = (n - 1) L L^T - eps I`` is solved by the series ``h = sum_k eps^k u^T A^-(k+1) u /
(n - 1)^(k+1)``, whose terms shrink by at least ``1 / (n - 1)`` each (``eps I`` bounds them):
:func:`dense_terms` triangular solves reach ``DENSE_TOLERANCE``. It needs each training
embedding again (a second pass over the images).

Both are checked against a float64 brute-force refit without the image (tests/test_threshold.py).
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from anomaly_hooks.errors import FitError

DENSE_TOLERANCE = 1e-9  # relative truncation error of the dense series
CHUNK_POSITIONS = 128  # positions per chunk of fitting work, here and in gaussians.py
CHUNK_CACHE_BYTES = 5 << 20  # a CPU chunk's working set of per-position fit work


def fit_chunk(n: int, d: int, device: torch.device, covariance: bool = True) -> int:
    """Positions per chunk of the per-position fit work on ``n`` samples of dimension ``d``.
    On the CPU as many as keep a chunk's working set (the float64 ``n x n`` Gram and its
    inverse factor, the float32 Gram, the samples, and with ``covariance`` the ``D x D``
    covariance: about ``20 n^2 + 4 n D + 8 D^2`` bytes a position; the low-rank form has no
    ``D x D`` work) within ``CHUNK_CACHE_BYTES``, at least one: the chunks that the threads of
    :func:`map_position_chunks` work on at once stay in the last-level cache together, each
    between its steps. Gaussians and leave-one-out of visa_macaroni1's EfficientNet-Lite0
    embeddings (176 dimensions, 3136 positions) on 2 cores, 5 against 16 MiB
    (``benchmarks/bench_loo.py --chunk-mib 16 5``): 200 images 1.00 against 1.16 s (4 positions
    a chunk against 14), 100 images 0.58 against 0.64 s, 37 images 0.31 against 0.44 s; the
    same results to the bit. Where chunks are small the ops' fixed costs weigh: the low-rank
    form of battery_weld's 37 images (leave-one-group-out, four group sizes) is finalised in
    0.16-0.18 s with the 98 positions a chunk its own working set allows, 0.28-0.30 s with
    the 17 the ``D x D`` term would leave (``benchmarks/bench_loop.py``'s finalize steps),
    to the same bits. On a GPU ``CHUNK_POSITIONS`` (few, large launches)."""
    if device.type != "cpu":
        return CHUNK_POSITIONS
    per_position = 20 * n * n + 4 * n * d + (8 * d * d if covariance else 0)
    return max(1, min(CHUNK_POSITIONS, CHUNK_CACHE_BYTES // per_position))


def map_position_chunks(fn: Callable[[int, int], None], p: int, chunk: int,
                        device: torch.device) -> None:
    """``fn(lo, hi)`` for every chunk ``[lo, hi)`` of ``p`` positions, each chunk's work
    independent of the others' (``fn`` writes its own slices).

    On the CPU with several intra-op threads the chunks run on as many Python threads, each op
    single-threaded (``torch.set_num_threads(1)`` meanwhile, process-wide): the fit's batched
    small factorisations otherwise meet an OpenMP barrier per call, and beside another busy
    process (a serving replica on the same cores) those barriers stall: leave-one-out of 1024
    positions of 200 samples took 2.4-37 s with 2 OpenMP threads and 1.5 s this way, 0.8 s
    either way on idle cores. Each chunk's arithmetic is the same, so are the results."""
    bounds = [(lo, min(lo + chunk, p)) for lo in range(0, p, chunk)]
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads <= 1 or len(bounds) < 2:
        for lo, hi in bounds:
            fn(lo, hi)
        return

    def run(bound: tuple) -> None:
        with torch.inference_mode():  # inference mode is per thread; the outputs live in it
            fn(*bound)

    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(min(threads, len(bounds))) as pool:
            for _ in pool.map(run, bounds):  # re-raises a chunk's error here
                pass
    finally:
        torch.set_num_threads(threads)


def _check_n(n: int) -> None:
    if n < 3:
        raise FitError("leave-one-out distances need at least 3 training images; got "
                       f"{n}: add images or use threshold.mode=holdout")


BLOCK_BASE64 = 64  # float64 blocked inverse Cholesky: LAPACK below this size (measured best)


def blocked_inverse_cholesky(mat: torch.Tensor, base: int, overwrite: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C^-1, info)``: ``C^-1`` ``[c, m, m]`` (lower) for ``C C^T = mat`` ``[c, m, m]`` (any
    float dtype), and LAPACK's ``info`` ``[c]`` (> 0 where a matrix is not positive definite).

    Recursive 2x2 blocking, so that the work is batched matrix products (for a batch of small
    matrices, LAPACK's per-matrix calls cost 2-5 times as much): ``C11^-1`` of the leading
    block, ``C21 = M21 C11^-T``, then the trailing block's ``S = M22 - C21 C21^T`` the same way,
    and ``(C^-1)21 = -C22^-1 C21 C11^-1``; LAPACK for blocks of at most ``base``. Every block
    is written into one output (and ``S`` over ``mat``'s trailing block): no per-level copies.
    ``overwrite``: ``mat`` may be used as the work space (else it is copied first)."""
    work = mat if overwrite else mat.clone()
    out = torch.zeros_like(mat)
    return out, _inverse_cholesky_into(work, out, base)


def _inverse_cholesky_into(mat: torch.Tensor, out: torch.Tensor, base: int) -> torch.Tensor:
    """:func:`blocked_inverse_cholesky` of ``mat`` (overwritten) into ``out``'s lower triangle
    (its upper one left as it is); returns ``info``."""
    m = mat.shape[-1]
    if m <= base:
        chol, info = torch.linalg.cholesky_ex(mat)
        eye = torch.eye(m, dtype=mat.dtype, device=mat.device).expand_as(chol)
        out.copy_(torch.linalg.solve_triangular(chol, eye, upper=False))
        return info
    h = m // 2
    info1 = _inverse_cholesky_into(mat[:, :h, :h], out[:, :h, :h], base)
    inv11 = out[:, :h, :h]
    c21 = torch.bmm(mat[:, h:, :h], inv11.transpose(1, 2))
    schur = mat[:, h:, h:].baddbmm_(c21, c21.transpose(1, 2), alpha=-1.0)
    info2 = _inverse_cholesky_into(schur, out[:, h:, h:], base)
    out[:, h:, :h] = torch.bmm(out[:, h:, h:], torch.bmm(c21, inv11)).neg_()
    return torch.maximum(info1, info2)


def blocked_cholesky(mat: torch.Tensor, base: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L, info)``: the lower Cholesky factor ``[c, m, m]`` of ``mat`` ``[c, m, m]`` and
    LAPACK's ``info`` ``[c]``, by the same recursive blocking as
    :func:`blocked_inverse_cholesky`: ``L21 = M21 L11^-T`` (a batched triangular solve) and the
    trailing block's ``M22 - L21 L21^T`` factorised the same way; LAPACK for blocks of at most
    ``base`` (on the CPU, 4 times faster than one LAPACK call per matrix at ``m = 176``)."""
    m = mat.shape[-1]
    if m <= base:
        return torch.linalg.cholesky_ex(mat)
    h = m // 2
    l11, info1 = blocked_cholesky(mat[:, :h, :h], base)
    l21 = torch.linalg.solve_triangular(l11, mat[:, h:, :h].transpose(1, 2),
                                        upper=False).transpose(1, 2)
    l22, info2 = blocked_cholesky(
        torch.baddbmm(mat[:, h:, h:], l21, l21.transpose(1, 2), alpha=-1.0), base)
    out = torch.zeros_like(mat)
    out[:, :h, :h] = l11
    out[:, h:, :h] = l21
    out[:, h:, h:] = l22
    return out, torch.maximum(info1, info2)


def inverse_cholesky64(mat: torch.Tensor) -> torch.Tensor:
    """``C^-1`` ``[c, m, m]`` (lower) for ``C C^T = mat``, ``mat`` float64 positive definite,
    used as work space (overwritten; :func:`blocked_inverse_cholesky`)."""
    inv, info = blocked_inverse_cholesky(mat, BLOCK_BASE64, overwrite=True)
    if bool((info > 0).any()):
        raise FitError("a leave-one-out Gram matrix is not positive definite; raise "
                       "padim.epsilon")
    return inv


def centred_column_norms_(cinv: torch.Tensor) -> torch.Tensor:
    """``g_i = || C^-1 P e_i ||^2`` ``[c, n]`` from ``C^-1`` ``[c, n, n]``, which it overwrites
    with ``C^-1 P`` (``P = I - 1 1^T / n``: each row minus its mean) and then its squares."""
    n = cinv.shape[-1]
    cinv.sub_(cinv.sum(dim=2, keepdim=True).div_(n))
    return cinv.square_().sum(dim=1)


def gram_loo_squared(gram: torch.Tensor, epsilon: float) -> torch.Tensor:
    """LOO squared distances ``[c, n]`` of the ``n`` training samples at ``c`` positions, from
    ``gram`` ``[c, n, n]`` = ``Y Y^T + eps I`` (not modified), by (2). The ``n x n`` part runs in
    float64 (``M`` has the condition number of the data over ``eps``, ~1e5 on real features:
    float32 loses digits on near-duplicate images)."""
    c, n, _ = gram.shape
    _check_n(n)
    m = gram.double()  # a new tensor: modified below
    diag = m.diagonal(dim1=1, dim2=2)
    scale = (diag.mean(dim=1) - epsilon).clamp_min(epsilon)  # mean diag of Y Y^T [c]
    # M = Y Y^T + eps'' I + scale 1 1^T / n = gram - (eps - eps'') I + scale / n
    diag -= epsilon / (n - 1)
    m += (scale / n).view(c, 1, 1)
    del diag
    g = centred_column_norms_(inverse_cholesky64(m))  # [c, n]
    return ((n - 1) / (epsilon * g) - n * (n - 2) / (n - 1)).float()


def centred_loo_squared(xc: torch.Tensor, epsilon: float,
                        groups: Optional[torch.Tensor] = None,
                        cov: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Leave-one-out squared distances ``[c, n]`` of samples ``xc`` ``[c, n, D]`` float32
    centred on their mean (leave-one-group-out with ``groups`` ``[n]``).

    ``n <= D``: from the Gram matrix ``Y Y^T + eps I``, ``Y = xc / sqrt(n - 1)``, by (2) or (4).
    ``n > D``: from the covariance ``cov`` ``[c, D, D]`` (``xc^T xc / (n - 1)``, computed here
    when not given) by (1) or (3) (:func:`covariance_group_out_squared`): there the Gram
    matrix has ``n - D`` eigenvalues of exactly ``eps''`` whose float32 rounding the float64
    factorisation inherits, while the covariance keeps the data's own smallest variances, and
    the ``D x D`` work is the smaller (visa_macaroni1's EfficientNet-Lite0 embeddings, 200
    images of 176 dimensions: 0.25 against 0.48 ms a position on one thread, largest error
    against a float64 refit 4.0e-5 against 2.7e-4; ``benchmarks/bench_loo.py``)."""
    n, d = xc.shape[1], xc.shape[2]
    _check_n(n)
    if n > d:
        if cov is None:
            cov = torch.bmm(xc.transpose(1, 2), xc).div_(n - 1)
        return covariance_group_out_squared(xc, cov, epsilon, groups)
    eps_eye = epsilon * torch.eye(n, dtype=torch.float32, device=xc.device)
    gram = torch.baddbmm(eps_eye, xc, xc.transpose(1, 2), alpha=1.0 / (n - 1))
    if groups is None:
        return gram_loo_squared(gram, epsilon)
    return gram_group_out_squared(gram, groups, epsilon)


@torch.inference_mode()
def loo_distances_from_samples(x: torch.Tensor, epsilon: float,
                               groups: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Exact leave-one-out distances ``[P, n]`` of the samples ``x`` ``[P, n, D]`` (not
    modified), leave-one-group-out with ``groups`` ``[n]``, :func:`fit_chunk` positions at a
    time, each chunk centred on its float64 mean rounded to float32 (as
    :meth:`~anomaly_hooks.scorers.padim.gaussians.DenseGaussians.from_samples` does, which
    makes them with the Gaussians: the same distances)."""
    p, n, _ = x.shape
    _check_n(n)
    out = torch.empty(p, n, dtype=torch.float32, device=x.device)

    def chunk(lo: int, hi: int) -> None:
        xc = x[lo:hi] - x[lo:hi].mean(dim=1, dtype=torch.float64).float().unsqueeze(1)
        out[lo:hi] = centred_loo_squared(xc, epsilon, groups)

    d = x.shape[2]
    map_position_chunks(chunk, p, fit_chunk(n, d, x.device, covariance=n > d), x.device)
    return out.clamp_min_(0).sqrt_()


def dense_terms(n: int, tol: float = DENSE_TOLERANCE) -> int:
    """Terms of the dense series that bring its relative truncation error below ``tol``: the
    ``k``-th term is at most ``(n - 1)^-k`` times the first."""
    _check_n(n)
    return max(1, math.ceil(math.log(tol) / math.log(1.0 / (n - 1))))


def dense_loo_squared(u: torch.Tensor, chol: torch.Tensor, n: int, epsilon: float,
                      terms: int) -> torch.Tensor:
    """LOO squared distances ``[c, B]`` of training samples from the full dense model.

    ``h = u^T B^-1 u`` with ``B = (n - 1) A - eps I``, ``A = L L^T``, summed as the series above:
    each power costs one triangular solve, ``u^T A^-2m u = |A^-m u|^2`` and
    ``u^T A^-(2m+1) u = |L^-1 A^-m u|^2``. Float64 (the factor widened): ``1 - n h / (n - 1)``
    cancels for far samples.

    Args:
        u: ``[c, B, D]`` the samples centred on the full model's mean.
        chol: ``[c, D, D]`` lower factors of ``Sigma + eps I`` (float32 or float16).
        n: the number of training images the model was fitted on.
        terms: from :func:`dense_terms`.
    """
    chol = chol.double()
    v = u.transpose(1, 2).double()  # [c, D, B]
    h = torch.zeros(v.shape[0], v.shape[2], dtype=torch.float64, device=v.device)
    coef = 1.0 / (n - 1)
    for k in range(terms):
        if k % 2 == 0:  # v = L^-1 A^-m u: the term is |v|^2
            v = torch.linalg.solve_triangular(chol, v, upper=False)
        else:  # v = A^-(m+1) u = L^-T (L^-1 A^-m u)
            v = torch.linalg.solve_triangular(chol.transpose(1, 2), v, upper=True)
        h += coef * v.square().sum(dim=1)
        coef *= epsilon / (n - 1)
    return ((n / (n - 1)) ** 2 * (n - 2) * h / (1.0 - n * h / (n - 1))).float()


# -- leave-one-group-out ------------------------------------------------------------------
# Images of one group G (g images; n_R = n - g others) are scored by the refit without all of
# them: mu_R, A_R = S_R / (n_R - 1) + eps I. With u_j = x_j - mu and C = I_g + 1 1^T / n_R,
# S_R = S - U_G^T C U_G and x_i - mu_R = U_G^T a_i, a_i = e_i + 1 / n_R. Woodbury with
# B = S + eps (n_R - 1) I and H = U_G B^-1 U_G^T (g x g) gives
#
#     d^2_R(x_i) = (n_R - 1) a_i^T H (I - C H)^-1 a_i                                     (3)
#
# (g = 1: formula (1)). In the Gram world, H = P_GG - eps'' [P M^-1 P]_GG with
# eps'' = eps (n_R - 1) / (n - 1) and M as in (2); C P_GG = I exactly, so I - C H =
# eps'' C W with W = [P M^-1 P]_GG = Z_G^T Z_G (Z = C^-1 P), and (3) becomes
#
#     d^2_R(x_i) = (n_R - 1) ([W^-1]_ii / eps'' - (n_R + 1) / n_R)                         (4)
#
# without cancellation (g = 1: formula (2)). One factorisation per distinct group size.


def group_members(groups: torch.Tensor) -> dict:
    """``{g: [m, g] long}``: the image indices of every group of size ``g`` (ascending)."""
    groups = groups.long().cpu()
    order = torch.argsort(groups, stable=True)
    sizes = torch.bincount(groups)
    starts = torch.cumsum(sizes, 0) - sizes
    out: dict = {}
    for g in sorted(set(sizes[sizes > 0].tolist())):
        which = torch.nonzero(sizes == g).flatten()
        out[g] = order[starts[which].unsqueeze(1) + torch.arange(g)]
    return out


def gram_group_out_squared(gram: torch.Tensor, groups: torch.Tensor,
                           epsilon: float) -> torch.Tensor:
    """Leave-one-group-out squared distances ``[c, n]`` of the ``n`` training samples, from
    ``gram`` ``[c, n, n]`` = ``Y Y^T + eps I`` (not modified) and the group of each sample
    ``groups`` ``[n]``, by (4), in float64. Singletons give exactly :func:`gram_loo_squared`'s
    distances."""
    c, n, _ = gram.shape
    _check_n(n)
    out = torch.empty(c, n, dtype=torch.float64, device=gram.device)
    for g, members in group_members(groups).items():
        n_r = n - g
        if n_r < 2:
            raise FitError(f"a group of {g} of the {n} training images leaves fewer than two "
                           "to fit a covariance without it: loosen threshold.groups or lower "
                           "threshold.near_duplicates")
        eps2 = epsilon * (n_r - 1) / (n - 1)
        m = gram.to(torch.float64, copy=True)  # modified below
        diag = m.diagonal(dim1=1, dim2=2)
        scale = (diag.mean(dim=1) - epsilon).clamp_min(epsilon)
        diag -= epsilon - eps2
        m += (scale / n).view(c, 1, 1)
        del diag
        z = inverse_cholesky64(m)
        del m
        z.sub_(z.sum(dim=2, keepdim=True).div_(n))  # C^-1 P  [c, n, n], in place
        members = members.to(gram.device)
        zg = z[:, :, members]  # [c, n, m, g]
        w = torch.einsum("cnmi,cnmj->cmij", zg, zg)  # [c, m, g, g]
        winv_diag = torch.cholesky_inverse(torch.linalg.cholesky(w)).diagonal(dim1=2, dim2=3)
        d2 = (n_r - 1) * (winv_diag / eps2 - (n_r + 1) / n_r)  # [c, m, g]
        out[:, members.reshape(-1)] = d2.reshape(c, -1)
    return out.float()


def covariance_group_out_squared(xc: torch.Tensor, cov: torch.Tensor, epsilon: float,
                                 groups: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Leave-one-group-out squared distances ``[c, n]`` of the samples ``xc`` ``[c, n, D]``
    (centred on their mean) from their covariance ``cov`` ``[c, D, D]``, by (3) (leave-one-out,
    ``groups`` None: (1)).

    For each distinct group size ``g``, ``B = (n - 1) cov + eps (n - g - 1) I`` is factorised in
    float64 (``B = L L^T``, one LAPACK call per matrix) and ``H = U_G B^-1 U_G^T`` comes from
    ``V = U_G L^-T`` (one triangular solve on the rows of those groups, in the samples' own
    precision; ``H`` summed in float64): ``D^3 / 3 + n D^2`` multiply-adds a position against
    the Gram form's ``n^2 D`` and ``2 n^3 / 3``.

    Precision: for a far sample ``1 - n h / (n - 1)`` cancels, amplifying every error of ``h``
    by ``1 / (1 - n h / (n - 1))``. The float32 covariance's own rounding (``kappa``
    float32 units, ``kappa`` the condition number of ``B``) is then the largest error, so the
    factor is float64 (a float32 factor adds ``kappa`` float32 units more), while the solve
    on the factor rounded to float32 adds ``sqrt(kappa)`` units, below that rounding: on
    visa_macaroni1's 200 images (EfficientNet-Lite0) the largest error against a float64 refit
    is 4.0e-5 with a float32 solve, 3.8e-5 with a float64 one, whose route takes 1.4 times as
    long (``benchmarks/bench_loo.py``). Float64 samples are solved in float64."""
    c, n, d = xc.shape
    _check_n(n)
    s = cov.double().mul_(n - 1)  # S = U^T U
    out = torch.empty(c, n, dtype=torch.float64, device=xc.device)
    sizes = [(1, None)] if groups is None else list(group_members(groups).items())
    for k, (g, members) in enumerate(sizes):
        n_r = n - g
        if n_r < 2:
            raise FitError(f"a group of {g} of the {n} training images leaves fewer than two "
                           "to fit a covariance without it: loosen threshold.groups or lower "
                           "threshold.near_duplicates")
        b = s if k == len(sizes) - 1 else s.clone()  # the last size factorises S in place
        b.diagonal(dim1=1, dim2=2).add_(epsilon * (n_r - 1))
        chol, info = torch.linalg.cholesky_ex(b)
        if bool((info > 0).any()):
            raise FitError("a leave-one-out covariance is not positive definite; raise "
                           "padim.epsilon")
        del b
        flat = slice(None) if members is None else members.reshape(-1).to(xc.device)
        rows = xc if members is None else xc[:, flat]
        # V = U_G L^-T: the rows solved in place of their transposes (no copy to columns)
        v = torch.linalg.solve_triangular(chol.to(xc.dtype).mT, rows, upper=True,
                                          left=False)  # [c, m g, D]
        if g == 1:  # (1)
            h = v.square_().sum(dim=2, dtype=torch.float64)  # [c, m]
            q = h * (n / (n - 1))
            if bool((q >= 1).any()):
                raise FitError("a leave-one-out covariance is not positive definite at "
                               "float32 precision; raise padim.epsilon")
            out[:, flat] = (n / (n - 1)) ** 2 * (n - 2) * h / (1.0 - q)
            continue
        vg = v.double().reshape(c, -1, g, d)
        h = torch.einsum("cmid,cmjd->cmij", vg, vg)  # [c, m, g, g]
        out[:, flat] = group_distances_squared(h, n, g).reshape(c, -1)
    return out.float()


def group_distances_squared(h: torch.Tensor, n: int, g: int) -> torch.Tensor:
    """(3): ``d^2_R(x_i) = (n_R - 1) a_i^T H (I - C H)^-1 a_i`` ``[c, m, g]`` float64 from
    ``H = U_G B^-1 U_G^T`` ``[c, m, g, g]`` float64 of ``m`` groups of ``g`` of ``n`` samples."""
    n_r = n - g
    c, m = h.shape[:2]
    eye = torch.eye(g, dtype=torch.float64, device=h.device)
    cmat = eye + 1.0 / n_r  # C = I + 1 1^T / n_R; its columns are also the a_i
    x = torch.linalg.solve(eye - cmat @ h, cmat.expand(c, m, g, g))  # (I - C H)^-1 a_i
    return (n_r - 1) * (cmat * (h @ x)).sum(dim=2)  # diag(A^T H X)


def dense_group_terms(n: int, g: int, tol: float = DENSE_TOLERANCE) -> int:
    """Terms of the group series (``B = (n - 1) A - eps g I``): its ``k``-th term is at most
    ``(g / (n - 1))^k`` times the first."""
    ratio = g / (n - 1)
    if ratio >= 1:
        raise FitError(f"a group of {g} of the {n} training images leaves too few to fit "
                       "without it")
    return max(1, math.ceil(math.log(tol) / math.log(ratio)))


def dense_group_out_squared(u: torch.Tensor, chol: torch.Tensor, n: int,
                            epsilon: float) -> torch.Tensor:
    """Leave-one-group-out squared distances ``[c, m, g]`` of ``m`` groups of ``g`` training
    samples each from the full dense model, by (3), in float64.

    ``H = U_G B^-1 U_G^T`` with ``B = (n - 1) A - eps g I``, ``A = L L^T``, is summed as the
    series ``B^-1 = sum_k (eps g)^k A^-(k+1) / (n - 1)^(k+1)`` (:func:`dense_loo_squared` for
    ``g = 1``), each power one triangular solve on the ``m g`` columns.

    Args:
        u: ``[c, m, g, D]`` the samples centred on the full model's mean.
        chol: ``[c, D, D]`` lower factors of ``Sigma + eps I``.
        n: the number of training images the model was fitted on.
    """
    c, m, g, d = u.shape
    terms = dense_group_terms(n, g)
    chol = chol.double()
    v = u.reshape(c, m * g, d).transpose(1, 2).double()  # [c, D, m g]
    h = torch.zeros(c, m, g, g, dtype=torch.float64, device=v.device)
    coef = 1.0 / (n - 1)
    for k in range(terms):
        if k % 2 == 0:  # v = L^-1 A^-j u: the term is v^T v
            v = torch.linalg.solve_triangular(chol, v, upper=False)
        else:  # v = A^-(j+1) u = L^-T (L^-1 A^-j u)
            v = torch.linalg.solve_triangular(chol.transpose(1, 2), v, upper=True)
        vg = v.reshape(c, d, m, g)
        h += coef * torch.einsum("cdmi,cdmj->cmij", vg, vg)
        coef *= epsilon * g / (n - 1)
    return group_distances_squared(h, n, g).float()
