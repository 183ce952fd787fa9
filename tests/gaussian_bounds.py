"""Float32 tolerances of PaDiM's Gaussian statistics, derived from the accumulator's
operations (anomaly_hooks.scorers.padim.gaussians.GaussianAccumulator) and first-order
perturbation bounds of the factor and the Mahalanobis distances."""
from __future__ import annotations

import torch
from conftest import f32_tol


def accumulation_tolerances(x: torch.Tensor, shifts: list,
                            epsilon: float = 0.01) -> tuple[float, torch.Tensor]:
    """Tolerances of a float32 GaussianAccumulator fit of the samples ``x`` ``[P, n, D]``
    against float64: (mean, covariance entries ``[P, D, D]``). The accumulator centres the
    samples on a shift K, the mean of one of the batches ``shifts`` (``[lo, hi)`` index
    ranges), sums them in float32 within a batch (at most ``hi - lo`` terms) and in float64
    across batches, sums their outer products in float32 over all n, and stores the results in
    float32; factorising Sigma + epsilon I adds D + 1 roundings and reading the float32 factor
    back 2, relative to that matrix.
    Mean: its own rounding, plus the centring's and the batch sum's roundings of centred values
    (|x - K| <= 2 m, m = max |x - mean|). Covariance entry (i, j): n roundings of a sum bounded
    by sqrt(Q_ii Q_jj) (Cauchy-Schwarz), Q the second moment about K: the variance plus
    (mean - K)**2; then D + 3 of sqrt(A_ii A_jj), A = Q + epsilon I."""
    n, d = x.shape[1], x.shape[2]
    mean = x.mean(dim=1)
    m = float((x - mean.unsqueeze(1)).abs().max())
    batch = max(hi - lo for lo, hi in shifts)
    mean_tol = f32_tol(1, float(mean.abs().max())) + f32_tol(1 + batch, 2 * m)
    off = torch.stack([(mean - x[:, lo:hi].mean(dim=1)).abs() for lo, hi in shifts]).amax(0)
    q = x.var(dim=1) + off ** 2  # [P, D]
    a = q + epsilon
    cov_tol = (f32_tol(n) * (q.unsqueeze(2) * q.unsqueeze(1)).sqrt()
               + f32_tol(d + 3) * (a.unsqueeze(2) * a.unsqueeze(1)).sqrt())
    return mean_tol, cov_tol


def batches(n: int, size: int) -> list:
    """The ``[lo, hi)`` batches of ``n`` training images fitted ``size`` at a time."""
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def distance_rtol(cov64: torch.Tensor, cov_tol: torch.Tensor, epsilon: float,
                  lambda_min: float | None = None) -> torch.Tensor:
    """Relative tolerance ``[P]`` of Mahalanobis distances d = |L^-1 v| (A = Sigma + epsilon I
    = L L^T) from a float32 fit whose covariance entries are within ``cov_tol`` of ``cov64``.
    d**2 = v^T A^-1 v moves by at most d**2 |dA| / lambda_min(A) (2-norms), so d by half that,
    relative; the entries' bound c sqrt(Q_ii Q_jj) is a rank-one matrix of 2-norm c trace(Q).
    The float32 triangular solve adds D roundings amplified by the factor's condition number
    sqrt(lambda_max / lambda_min). ``lambda_min``: a lower bound to use instead of A's own
    (``epsilon`` bounds every leave-one-out refit's)."""
    d = cov64.shape[-1]
    lam = torch.linalg.eigvalsh(cov64 + epsilon * torch.eye(d, dtype=cov64.dtype))
    if lambda_min is not None:
        lam[:, 0] = lambda_min
    norm = cov_tol.diagonal(dim1=1, dim2=2).sum(1)
    return norm / (2 * lam[:, 0]) + f32_tol(d, 1.0) * (lam[:, -1] / lam[:, 0]).sqrt()


def shifts_of_splits(n: int, splits) -> list:
    """The ``[lo, hi)`` batches of ``n`` samples cut at the indices ``splits``."""
    edges = [0, *[int(s) for s in splits if 0 < int(s) < n], n]
    return [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo]


def mahalanobis_rtol(train: torch.Tensor, test: torch.Tensor, shifts: list, epsilon: float,
                     dist: torch.Tensor) -> torch.Tensor:
    """Relative tolerances ``[P, T]`` of float32 Mahalanobis distances of ``test`` ``[P, T, D]``
    to a float32 fit of ``train`` ``[P, n, D]`` (batches ``shifts``), against the float64
    distances ``dist`` ``[P, T]``. First order in each float32 rounding, with v = x - mean,
    A = Sigma + epsilon I = L L^T, z = L^-1 v, w = A^-1 v, d**2 = v.w, |.| elementwise:

    - the covariance's float32 sums of n outer products of the samples centred on the shift
      K (|x_k - K| <= |x_k - mean| + |mean - K|, :func:`accumulation_tolerances`), each entry
      within f32_tol(n) / (n - 1) sum_k |x_k - K|_i |x_k - K|_j, or by Cauchy-Schwarz within
      f32_tol(n) sqrt(Q_ii Q_jj) (Q: the second moments about K): d**2 moves by |w^T dA w| <=
      the smaller of f32_tol(n) / (n - 1) sum_k (|w|^T |x_k - K|)**2 and
      f32_tol(n) (sum_i |w_i| sqrt(Q_ii))**2;
    - the factorisation (L L^T = A + dA, |dA| <= (D + 1) eps / 2 |L| |L|^T):
      f32_tol(D + 1) / 2 | |L|^T |w| |**2;
    - the triangular solve (backward stable: |dL| <= D eps / 2 |L|): f32_tol(D) |w|^T |L| |z|;
    - v itself (x and the mean rounded once each, the mean within its accumulation tolerance):
      2 |w|^T |dv|.

    d moves by half of d**2's relative change."""
    n, d = train.shape[1], train.shape[-1]
    mean = train.mean(dim=1)
    centred = train - mean.unsqueeze(1)
    a = centred.transpose(1, 2) @ centred / (n - 1) + epsilon * torch.eye(d, dtype=train.dtype)
    chol = torch.linalg.cholesky(a)
    v = (test - mean.unsqueeze(1)).transpose(1, 2)  # [P, D, T]
    z = torch.linalg.solve_triangular(chol, v, upper=False)
    w = torch.cholesky_solve(v, chol)
    mean_tol, _ = accumulation_tolerances(train, shifts, epsilon)
    off = torch.stack([(mean - train[:, lo:hi].mean(dim=1)).abs() for lo, hi in shifts]).amax(0)
    far = centred.abs() + off.unsqueeze(1)  # [P, n, D]: |x_k - K| at most
    q_sqrt = (train.var(dim=1) + off ** 2).sqrt().unsqueeze(2)  # [P, D, 1]
    stats = torch.minimum(f32_tol(n) / (n - 1) * ((far @ w.abs()) ** 2).sum(1),  # [P, T]
                          f32_tol(n) * (w.abs() * q_sqrt).sum(1) ** 2)
    factor = f32_tol(d + 1) / 2 * ((chol.abs().transpose(1, 2) @ w.abs()) ** 2).sum(1)
    solve = f32_tol(d) * (w.abs() * (chol.abs() @ z.abs())).sum(1)
    dv = f32_tol(1) * (test.abs() + mean.abs().unsqueeze(1)) + mean_tol  # [P, T, D]
    inputs = 2 * (w.abs() * dv.transpose(1, 2)).sum(1)
    return (stats + factor + solve + inputs) / (2 * dist ** 2)
