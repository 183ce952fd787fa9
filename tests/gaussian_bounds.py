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
