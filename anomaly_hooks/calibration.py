"""A threshold for a stated false-alarm rate, from the scores of good images only (torch-free).

Used by :mod:`anomaly_hooks.threshold` (``threshold.false_alarm_rate``).

Given ``n`` out-of-sample image scores of good images (each from a model that did not see the
image), the threshold for a false-alarm rate ``alpha`` is the ``1 - alpha`` quantile of the good
images' score distribution. With ``n`` = 37..209 and ``alpha`` = 1 %, the empirical quantile is
(nearly) the sample maximum, whose exceedance probability is itself random (about ``1/(n+1)``
on average, and > 5 % one time in six for ``n = 37``). A *fitted* tail uses all scores.

Models (``threshold.tail``):

* ``gumbel_upper``: the Gumbel (type-I extreme value) distribution fitted by maximum
  likelihood to the upper half of the scores, the lower half left-censored (counted as "below
  the median", values unused); ``t = mu - beta ln(-ln(1 - alpha))``. An image score is the
  maximum of a heatmap over tens of thousands of pixels, and maxima of light-tailed patch
  scores (Mahalanobis or nearest-neighbour distances) are Gumbel-distributed: the natural
  two-parameter family, and two parameters are what a few dozen scores can pin down. The
  censoring makes the fit follow the upper tail (the part that sets the threshold) and ignore
  low outliers: a training image with a twin (battery_weld has one pair) scores ~0 out of
  sample and would inflate a full-sample fit's scale. In the prototype's simulation over nine
  score distributions with 37 scores, its mean false-alarm rate at ``alpha`` = 1 % stayed in
  0.4-1.9 %, where the empirical quantile, GPD and GEV fits averaged 2-3.6 %.
* ``gumbel``: the same on all ``n`` scores.
* ``empirical``: the ``1 - alpha`` sample quantile (linear interpolation): about the sample
  maximum for ``n < 1 / alpha``.
* ``conformal``: the ``ceil((n + 1)(1 - alpha))``-th smallest score: a distribution-free
  guarantee ``P(false alarm) <= alpha`` (over the draw of the ``n`` images), defined only for
  ``n >= 1/alpha - 1``; below that, the maximum plus the spread of the top five scores.
* ``auto`` (default): ``conformal`` where the ``n`` scores support ``alpha``
  (:func:`supported_rate` ``<= alpha``), else ``gumbel_upper``, never below the largest score
  (a threshold below it has a mean exceedance above ``1 / (n + 1)``, whatever the tail says):
  the extrapolation, which the fit states as such (``Threshold.supported_rate``).

What ``n`` exchangeable scores can certify: the largest of them is exceeded by a new good image
with probability ``1 / (n + 1)`` on average (its exceedance is Beta(1, n) distributed), so no
rule certifies a rate below :func:`supported_rate` ``= 1 / (n + 1)`` without a model of the tail
(37 images: 2.6 %).

Uncertainty (stored with the model, both 90 %):

* ``far_interval``: the Clopper-Pearson interval of the false-alarm rate from the count of the
  ``n`` good scores above the threshold (:func:`clopper_pearson`): distribution-free, and for an
  order-statistic threshold (``conformal``) its upper end is exactly the 95 % quantile of the
  Beta distribution of the true rate. A threshold above every score gets ``[0, 1 - 0.05^(1/n)]``:
  what ``n`` images can show, whatever the tail model says.
* ``tail_far_interval`` (tail models only): a bootstrap under the fitted model (resample the
  ``n`` scores, refit, evaluate the refitted model's exceedance probability at the stored
  threshold, 5th-95th percentile): the model's own sampling uncertainty, which assumes the tail
  family is right.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from anomaly_hooks.errors import FitError

TAILS = ("auto", "gumbel_upper", "gumbel", "empirical", "conformal")
MIN_SCORES = 3  # a two-parameter tail model needs at least this many good scores
UPPER_CENSOR = 0.5  # gumbel_upper: the lower half of the scores is left-censored
BOOTSTRAP = 500
BOOTSTRAP_SEED = 1234
LEVEL = 0.9  # two-sided level of every stored interval (each end a one-sided 95 % bound)


@dataclass(frozen=True)
class TailFit:
    """A fitted tail model: its name, parameters, threshold and exceedance function."""

    name: str
    params: Dict[str, float]
    threshold: float
    sf: Callable[[float], float]  # P(score > t) under the fitted model


# -- Gumbel ------------------------------------------------------------------------------
def gumbel_mle(x: np.ndarray, censor_fraction: float = 0.0,
               iterations: int = 60) -> Tuple[np.ndarray, np.ndarray]:
    """Maximum-likelihood Gumbel ``(mu, beta)`` of each row of ``x`` ``[..., n]`` (vectorised:
    the bootstrap fits hundreds at once).

    ``censor_fraction``: the lowest ``k = floor(f n)`` scores are *left-censored* at the
    ``k``-th smallest ``c`` (only "at most ``c``" is used), so that the fit follows the upper
    tail and low outliers -- a duplicated training image scores ~0 out of sample, its twin
    being in the model -- cannot inflate the scale. With ``m = n - k`` upper scores ``U`` and
    ``w = exp(-x / beta)``, the profile likelihood gives ``exp(mu / beta) = m / A``,
    ``A = sum_U w + k w(c)``, and ``beta = mean_U(x) - (sum_U x w + k c w(c)) / A``: the
    uncensored equation with ``c`` counted ``k`` times in the weighted mean, solved by Newton
    (the weighted mean's derivative in ``beta`` is its weighted variance over ``beta^2``).
    """
    x = np.sort(np.asarray(x, dtype=np.float64), axis=-1)
    n = x.shape[-1]
    k = int(math.floor(censor_fraction * n))
    k = min(k, n - 2)
    centre = x.mean(axis=-1, keepdims=True)
    spread = x[..., k:].std(axis=-1, keepdims=True)
    spread = np.where(spread > 0, spread, 1.0)
    z = (x - centre) / spread  # scale-free: beta in units of the spread
    up = z[..., k:]
    pts = up if k == 0 else np.concatenate([z[..., k - 1:k], up], axis=-1)
    mult = np.ones(pts.shape[-1])
    if k:
        mult[0] = k
    zbar = up.mean(axis=-1, keepdims=True)
    lo = pts.min(axis=-1, keepdims=True)
    beta = np.full(z.shape[:-1] + (1,), math.sqrt(6) / math.pi)  # moment estimate
    for _ in range(iterations):
        w = mult * np.exp(-(pts - lo) / beta)  # <= k: no overflow
        s0, s1, s2 = w.sum(-1, keepdims=True), (pts * w).sum(-1, keepdims=True), \
            (pts * pts * w).sum(-1, keepdims=True)
        m1 = s1 / s0
        f = beta - zbar + m1
        df = 1.0 + (s2 / s0 - m1 * m1) / (beta * beta)
        step = f / df
        beta = np.maximum(beta - step, 0.05 * beta)
        if np.all(np.abs(step) < 1e-12 * beta):
            break
    a = (mult * np.exp(-(pts - lo) / beta)).sum(axis=-1, keepdims=True)
    mu = lo - beta * np.log(a / up.shape[-1])
    return (centre + spread * mu)[..., 0], (spread * beta)[..., 0]


def _gumbel(x: np.ndarray, alpha: float, censor_fraction: float = 0.0,
            name: str = "gumbel") -> TailFit:
    mu, beta = (float(v) for v in gumbel_mle(x, censor_fraction))
    t = mu - beta * math.log(-math.log1p(-alpha))
    return TailFit(name, {"mu": mu, "beta": beta, "censored_fraction": censor_fraction}, t,
                   lambda s, mu=mu, beta=beta: float(-np.expm1(-np.exp(-(s - mu) / beta))))


def _gumbel_upper(x: np.ndarray, alpha: float) -> TailFit:
    return _gumbel(x, alpha, UPPER_CENSOR, "gumbel_upper")


def _auto_extrapolated(x: np.ndarray, alpha: float) -> TailFit:
    """``auto`` below the supported rate: the Gumbel tail's threshold, or the largest score
    where the tail puts it lower."""
    fit = _gumbel_upper(x, alpha)
    top = float(np.max(x))
    if fit.threshold >= top:
        return fit
    return TailFit("gumbel_upper", {**fit.params, "raised_to_max": 1.0}, top, fit.sf)


# -- distribution-free rules --------------------------------------------------------------
def _empirical(x: np.ndarray, alpha: float) -> TailFit:
    xs = np.sort(x)
    return TailFit("empirical", {}, float(np.quantile(xs, 1 - alpha)),
                   lambda s: float(np.mean(xs > s)))


def _conformal(x: np.ndarray, alpha: float) -> TailFit:
    xs = np.sort(x)
    n = len(xs)
    k = math.ceil((n + 1) * (1 - alpha))
    if k <= n:
        t = float(xs[k - 1])
    else:  # not enough scores for the guarantee: the max plus the top scores' spread
        top = xs[-min(n, 5):]
        t = float(xs[-1] + (top[-1] - top[0]))
    return TailFit("conformal", {"k": float(k)}, t, lambda s: float(np.mean(xs > s)))


FITTERS: Dict[str, Callable[[np.ndarray, float], TailFit]] = {
    "gumbel_upper": _gumbel_upper, "gumbel": _gumbel, "empirical": _empirical,
    "conformal": _conformal, "auto_extrapolated": _auto_extrapolated}


def supported_rate(n: int) -> float:
    """The smallest false-alarm rate ``n`` exchangeable good scores support without a tail
    model: ``1 / (n + 1)``, the mean exceedance of their maximum."""
    return 1.0 / (n + 1)


def resolve_tail(tail: str, n: int, alpha: float) -> str:
    """``auto`` -> ``conformal`` where ``n`` scores support ``alpha``, else ``gumbel_upper``;
    any other tail name as it is."""
    if tail != "auto":
        return tail
    # a relative tolerance: 1 / (n + 1) == alpha must count as supported (99 scores at 1 %)
    return "conformal" if supported_rate(n) <= alpha * (1 + 1e-9) else "auto_extrapolated"


def clopper_pearson(k: int, n: int, level: float = LEVEL) -> Tuple[float, float]:
    """Exact (Clopper-Pearson) two-sided ``level`` interval of a binomial rate from ``k``
    successes in ``n`` trials: the Beta quantiles ``B((1 - level)/2; k, n - k + 1)`` and
    ``B((1 + level)/2; k + 1, n - k)`` (0 and 1 at the ends). ``scipy.special.betaincinv`` is
    ``scipy.stats.beta.ppf`` to the bit (every ``k``, ``n`` < 400, scipy 1.17), without the
    0.24 s import of ``scipy.stats`` in every fit and update process."""
    from scipy.special import betaincinv

    if n <= 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"{k} successes in {n} trials")
    lo = 0.0 if k == 0 else float(betaincinv(k, n - k + 1, (1 - level) / 2))
    hi = 1.0 if k == n else float(betaincinv(k + 1, n - k, (1 + level) / 2))
    return lo, hi


def fit_tail(scores: Sequence[float], alpha: float, tail: str = "gumbel_upper") -> TailFit:
    """Fit ``tail`` to the good ``scores`` and place the threshold at exceedance ``alpha``
    (``auto``: see :func:`resolve_tail`)."""
    tail = resolve_tail(tail, len(scores), alpha)
    if tail not in FITTERS or tail == "auto":
        raise ValueError(f"threshold.tail={tail!r}: one of {', '.join(TAILS)}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"false-alarm rate {alpha} must be in (0, 1)")
    x = np.asarray(scores, dtype=np.float64)
    if x.size < MIN_SCORES:
        raise FitError(f"a tail model needs at least {MIN_SCORES} good image scores; got "
                       f"{x.size}: add good images")
    if not np.isfinite(x).all():
        raise FitError("non-finite scores among the good images")
    return FITTERS[tail](x, alpha)


def far_interval(scores: Sequence[float], threshold: float, tail: str = "gumbel_upper",
                 n_boot: int = BOOTSTRAP, level: float = LEVEL,
                 seed: int = BOOTSTRAP_SEED) -> Tuple[float, float]:
    """Bootstrap interval (``level``, two-sided percentile) of the false-alarm rate at
    ``threshold``: resample the scores, refit, take each refit's exceedance probability."""
    x = np.asarray(scores, dtype=np.float64)
    rng = np.random.default_rng(seed)
    samples = x[rng.integers(0, x.size, size=(n_boot, x.size))]
    if tail in ("gumbel", "gumbel_upper"):  # vectorised
        mu, beta = gumbel_mle(samples, UPPER_CENSOR if tail == "gumbel_upper" else 0.0)
        with np.errstate(over="ignore"):  # exp(+large) = inf: an exceedance of 1, as it should
            far = -np.expm1(-np.exp(-(threshold - mu) / beta))
    elif tail in ("empirical", "conformal"):  # their exceedance is the share of scores above
        far = (samples > threshold).mean(axis=1)
    else:
        raise ValueError(f"threshold.tail={tail!r}: one of {', '.join(TAILS)}")
    lo, hi = np.quantile(far, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def goodness_of_fit(scores: Sequence[float], fit: TailFit) -> Optional[float]:
    """Largest gap between the empirical and the fitted exceedance over the top half of the
    scores (a Kolmogorov-type distance on the tail that matters); None for empirical fits."""
    if fit.name in ("empirical", "conformal"):
        return None
    xs = np.sort(np.asarray(scores, dtype=np.float64))
    n = xs.size
    gaps = [abs(fit.sf(v) - (n - i - 0.5) / n) for i, v in enumerate(xs) if i >= n // 2]
    return float(max(gaps))
