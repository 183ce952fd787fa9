"""Fit-time reference of the drift monitor and the calibration of its alarm thresholds.

A *block* is one group of per-image statistics: the input statistics, one tapped layer's channel
means, the image score. For a window of the last ``W`` images the monitor compares the window
mean ``xbar`` of each block with the reference of the good images:

* ``shift`` (every block): ``W * mean_c ((xbar_c - mu_c) / sd_c)^2`` -- the mean squared z-score
  of the window mean over all channels (a diagonal, covariance-free Hotelling statistic: it
  needs no covariance estimate, so it stays well-behaved with 1024 channels and 30 images);
* ``pca`` (blocks with more than one channel): ``W / k * sum_j (v_j . zbar)^2 / lambda_j`` --
  Hotelling's T^2 in the top-``k`` principal directions of the standardised good vectors
  (correlated shifts that each channel alone shows weakly);
* ``score`` (the image-score block, one channel, log scores): one-sided,
  ``sqrt(W) * (mean log s - m) / sd`` (a rise of the anomaly scores).

Calibration, without any drifted image: *leave-window-out*. Draw ``W`` distinct good images,
rebuild the reference (mean, spread, PCA variances) from the other ``N - W`` images, compute each
statistic of the drawn window; repeat. This reproduces the serving situation exactly for
exchangeable good images -- a window of ``W`` images that the reference never saw, compared with
a reference estimated from a finite sample -- and so accounts for the reference's own sampling
error, which dominates for small ``N`` (30 images). The thresholds of all layer/input statistics
are one quantile level ``q`` of their calibration distributions, with ``q`` chosen so that the
fraction of calibration windows in which *any* statistic exceeds its threshold is ``alpha_main``
(joint calibration: correlated statistics do not cost power as a Bonferroni split would).
The score statistic is calibrated on the out-of-sample good scores (the threshold hold-out):
leave-window-out when there are enough of them, else a Student-t bound (normal log scores),
with the share ``alpha_score`` of the false-alarm budget; ``alpha_main + alpha_score = alpha``.

Everything here is numpy; nothing is pickled: :meth:`DriftReference.state` gives float32 arrays
and a JSON-able dict.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from anomaly_hooks.errors import ConfigError, FitError, ModelFileError

SCORE_BLOCK = "score"
STATE_PREFIX = "drift."
MIN_IMAGES_PER_WINDOW = 2  # the reference needs at least 2 * window images (else W is lowered)
MIN_REFERENCE_IMAGES = 4  # fewer good images than this: no reference at all


def _safe_sd(sd: np.ndarray) -> np.ndarray:
    """A floor for near-constant channels (dead ReLU channels, R=G=B of grey images)."""
    pos = sd[sd > 0]
    floor = 1e-3 * (float(np.median(pos)) if pos.size else 1.0) + 1e-12
    return np.maximum(sd, floor)


@dataclass
class Block:
    """The reference of one block: per-channel mean and spread, top principal directions."""

    name: str
    mean: np.ndarray  # [d]
    scale: np.ndarray  # [d]
    basis: np.ndarray  # [d, k] (k = 0 for one-channel blocks)
    eigvals: np.ndarray  # [k]
    log: bool = False  # statistics of log(x) (the score block)
    one_sided: bool = False  # only a rise counts (the score block)

    @property
    def dim(self) -> int:
        return int(self.mean.shape[0])

    @property
    def stat_names(self) -> List[str]:
        if self.one_sided:
            return [f"{self.name}:shift"]
        names = [f"{self.name}:shift"]
        if self.basis.shape[1]:
            names.append(f"{self.name}:pca")
        return names

    def prepare(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        return np.log(np.maximum(x, 1e-12)) if self.log else x

    @classmethod
    def fit(cls, name: str, x: np.ndarray, k: int, *, log: bool = False,
            one_sided: bool = False) -> "Block":
        """Reference from per-image vectors ``x`` ``[N, d]`` with (at most) ``k`` principal
        directions."""
        b = cls(name, np.zeros(0), np.zeros(0), np.zeros((0, 0)), np.zeros(0), log, one_sided)
        x = b.prepare(x)
        n, d = x.shape
        mean = x.mean(0)
        scale = _safe_sd(x.std(0, ddof=1))
        k = min(k, d) if not one_sided else 0
        if k:
            z = (x - mean) / scale
            _, s, vt = np.linalg.svd(z, full_matrices=False)
            lam = s ** 2 / (n - 1)
            keep = lam[:k] > 1e-6 * lam[0]  # drop degenerate directions (identical channels)
            basis, eigvals = vt[:k][keep].T, lam[:k][keep]
        else:
            basis, eigvals = np.zeros((d, 0)), np.zeros(0)
        b.mean, b.scale, b.basis, b.eigvals = mean, scale, basis, eigvals
        return b

    def pooled(self, x: np.ndarray, n_old: int) -> "Block":
        """This reference (of ``n_old`` images) with new images' vectors ``x`` ``[m, d]``
        pooled in: the mean and spread of all ``n_old + m`` images exactly (the pooled
        moments); the principal directions kept, their variances pooled, the old images' part
        re-expressed in the new standardisation to first order (along ``v`` the old
        standardised variance ``lambda`` becomes ``lambda |a * v|^2``, ``a`` the ratio of old
        to new spreads: exact where the spreads do not change)."""
        x = self.prepare(x)
        m = x.shape[0]
        n = n_old + m
        mean_new = x.mean(0)
        var_new = x.var(0, ddof=1) if m > 1 else np.zeros_like(mean_new)
        mean = (n_old * self.mean + m * mean_new) / n
        var = ((n_old - 1) * self.scale ** 2 + (m - 1) * var_new
               + n_old * m / n * (self.mean - mean_new) ** 2) / (n - 1)
        scale = _safe_sd(np.sqrt(np.maximum(var, 0.0)))
        eigvals = self.eigvals
        if self.basis.shape[1]:
            a = self.scale / scale
            old_var = self.eigvals * ((a[:, None] * self.basis) ** 2).sum(0)
            old_mean = ((self.mean - mean) / scale) @ self.basis
            p = ((x - mean) / scale) @ self.basis  # [m, k]
            p_mean = p.mean(0)
            p_var = p.var(0, ddof=1) if m > 1 else np.zeros_like(p_mean)
            eigvals = ((n_old - 1) * old_var + (m - 1) * p_var
                       + n_old * m / n * (old_mean - p_mean) ** 2) / (n - 1)
            eigvals = np.maximum(eigvals, 1e-12)
        return Block(self.name, mean, scale, self.basis, eigvals, self.log, self.one_sided)

    def stats_of_means(self, xbar: np.ndarray, window: int) -> Dict[str, np.ndarray]:
        """Statistics of window means ``xbar`` ``[M, d]`` (already ``prepare``d)."""
        z = (xbar - self.mean) / self.scale
        if self.one_sided:
            return {f"{self.name}:shift": math.sqrt(window) * z[:, 0]}
        out = {f"{self.name}:shift": window * (z ** 2).mean(1)}
        if self.basis.shape[1]:
            p = (z @ self.basis) / np.sqrt(self.eigvals)
            out[f"{self.name}:pca"] = window * (p ** 2).mean(1)
        return out

    def effect(self, stat: str, value: float, window: int) -> float:
        """A statistic's value as the shift of the window mean in good-image spreads: the RMS
        over channels (``shift``) or principal directions (``pca``), the signed shift of the
        mean log score (``score``)."""
        if self.one_sided:
            return value / math.sqrt(window)
        return math.sqrt(max(value, 0.0) / window)

    def floor(self, stat: str, min_shift: float, window: int) -> float:
        """The statistic's value at an effect of ``min_shift`` spreads."""
        return math.sqrt(window) * min_shift if self.one_sided else window * min_shift ** 2

    def leave_window_out(self, x: np.ndarray, windows: np.ndarray) -> Dict[str, np.ndarray]:
        """Calibration statistics: for each row of ``windows`` (``[M, W]`` distinct image
        indices into ``x``), the statistics of that window against a reference rebuilt from
        the other images (same principal directions, re-estimated mean, spread and variances
        along them)."""
        x = self.prepare(x)
        n = x.shape[0]
        m, w = windows.shape
        rest = n - w
        x2 = x ** 2
        s1, s2 = x.sum(0), x2.sum(0)
        out: Dict[str, List[np.ndarray]] = {s: [] for s in self.stat_names}
        k = self.basis.shape[1]
        if k:
            p_all = ((x - self.mean) / self.scale) @ self.basis  # [n, k]
            p2 = p_all ** 2
            ps1, ps2 = p_all.sum(0), p2.sum(0)
        for lo in range(0, m, 256):
            pick = _indicator(windows[lo:lo + 256], n)  # [b, n]: window sums as one product
            ws1, ws2 = pick @ x, pick @ x2
            mu = (s1 - ws1) / rest
            var = ((s2 - ws2) - rest * mu ** 2) / (rest - 1)
            sd = _safe_sd(np.sqrt(np.maximum(var, 0)))
            z = (ws1 / w - mu) / sd
            if self.one_sided:
                out[f"{self.name}:shift"].append(math.sqrt(w) * z[:, 0])
                continue
            out[f"{self.name}:shift"].append(w * (z ** 2).mean(1))
            if k:
                pw1, pw2 = pick @ p_all, pick @ p2  # [b, k]
                pm = (ps1 - pw1) / rest
                # variances along the (fixed) directions, re-estimated without the window
                var_p = ((ps2 - pw2) - rest * pm ** 2) / (rest - 1)
                diff = (pw1 / w - pm) / np.sqrt(np.maximum(var_p, 1e-12))
                out[f"{self.name}:pca"].append(w * (diff ** 2).mean(1))
        return {s: np.concatenate(v) for s, v in out.items()}

    # -- persistence -----------------------------------------------------------------------
    def state(self) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
        p = f"{STATE_PREFIX}{self.name}."
        tensors = {p + "mean": self.mean, p + "scale": self.scale, p + "basis": self.basis,
                   p + "eigvals": self.eigvals}
        return ({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
                {"name": self.name, "dim": self.dim, "components": int(self.basis.shape[1]),
                 "log": self.log, "one_sided": self.one_sided})

    @classmethod
    def from_state(cls, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> "Block":
        p = f"{STATE_PREFIX}{meta['name']}."
        get = {k: np.asarray(_to_numpy(tensors[p + k]), dtype=np.float64)
               for k in ("mean", "scale", "basis", "eigvals")}
        d, k = int(meta["dim"]), int(meta["components"])
        if get["mean"].shape != (d,) or get["scale"].shape != (d,) or \
                get["basis"].shape != (d, k) or get["eigvals"].shape != (k,):
            raise ModelFileError(f"drift block {meta['name']!r}: tensor shapes do not match "
                             f"dim={d}, components={k}")
        return cls(str(meta["name"]), get["mean"], get["scale"], get["basis"], get["eigvals"],
                   bool(meta["log"]), bool(meta["one_sided"]))


def _indicator(windows: np.ndarray, n: int) -> np.ndarray:
    """``[b, n]`` float64 rows with 1 at each window's image indices (``windows`` ``[b, W]``)."""
    pick = np.zeros((windows.shape[0], n))
    pick[np.arange(windows.shape[0])[:, None], windows] = 1.0
    return pick


def sample_windows(rng: np.random.Generator, n: int, w: int, m: int) -> np.ndarray:
    """``m`` windows ``[m, W]`` of ``w`` distinct indices in ``range(n)``, each a uniform
    ``w``-subset: the first ``w`` of a random permutation (vectorised; one ``rng.choice`` per
    window cost 15 ms per 1000 windows), or for many images, uniform draws with the rows that
    repeat an index drawn again."""
    if n * m <= 1 << 23:
        return np.argsort(rng.random((m, n)), axis=1)[:, :w]
    out = rng.integers(0, n, (m, w))
    while True:
        srt = np.sort(out, axis=1)
        again = (srt[:, 1:] == srt[:, :-1]).any(axis=1)
        if not again.any():
            return out
        out[again] = rng.integers(0, n, (int(again.sum()), w))


def _to_numpy(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):
        t = t.detach().cpu().numpy()
    return np.asarray(t)


def _n_components(n: int, d: int, k_max: int, window: int) -> int:
    """Principal directions of the ``pca`` statistic: at most ``k_max`` and ``d``, and few
    enough (a third of the images left out of a calibration window) that their variances can be
    estimated from the ``n - window`` images of a leave-window-out reference."""
    return max(0, min(k_max, d, (n - window) // 3))


@dataclass
class DriftReference:
    """Everything the monitor needs: block references and calibrated thresholds."""

    window: int
    alpha: float
    blocks: Dict[str, Block]
    thresholds: Dict[str, float]
    info: Dict[str, Any] = field(default_factory=dict)

    @property
    def stat_names(self) -> List[str]:
        return [s for b in self.blocks.values() for s in b.stat_names]

    @classmethod
    def fit(cls, vectors: Mapping[str, np.ndarray], good_scores: Optional[np.ndarray] = None, *,
            window: int = 16, alpha: float = 0.01, components: int = 8,
            n_windows: int = 4000, score_share: float = 0.25, min_shift: float = 1.0,
            seed: int = 0) -> "DriftReference":
        """Fit the reference and calibrate the thresholds.

        Args:
            vectors: block name -> per-image statistics ``[N, d]`` of the good training images
                (the same ``N`` images, in the same order, in every block).
            good_scores: out-of-sample image scores of good images (e.g. the threshold
                hold-out), or None for no score statistic.
            window: images per sliding window (lowered to ``N // 2`` for small ``N``).
            alpha: false-alarm probability of one check (one full window of good images).
            components: principal directions of the ``pca`` statistic (at most).
            n_windows: calibration windows (the alpha quantile needs ``>= 20 / alpha``).
            score_share: the share of ``alpha`` given to the score statistic.
            min_shift: the smallest drift that may raise the alarm, in good-image spreads: a
                statistic alarms only above both its calibrated threshold and the value of a
                window-mean shift of ``min_shift`` spreads (RMS over a block's channels /
                principal directions; the mean log score's rise). Slow, harmless changes of the
                same source (MVTec bottle's test/good images are 0.8 spreads brighter than its
                train/good) stay quiet; 0 = any statistically significant shift.
        """
        if not vectors:
            raise FitError("no per-image statistics to build a drift reference from")
        sizes = {name: np.asarray(v).shape[0] for name, v in vectors.items()}
        n = min(sizes.values())
        if len(set(sizes.values())) != 1:
            raise FitError(f"blocks hold different numbers of images: {sizes}")
        if not 0 < alpha < 0.5:
            raise ConfigError(f"alpha={alpha}: a false-alarm probability in (0, 0.5)")
        w = int(window)
        if n < MIN_IMAGES_PER_WINDOW * w:
            w = max(2, n // MIN_IMAGES_PER_WINDOW)
        if n < MIN_REFERENCE_IMAGES:
            raise FitError(f"{n} good images are too few for a drift reference "
                           f"({MIN_REFERENCE_IMAGES} at least)")
        rng = np.random.default_rng(seed)
        has_score = good_scores is not None and len(good_scores) >= 3
        a_score = alpha * score_share if has_score else 0.0
        a_main = alpha - a_score
        blocks: Dict[str, Block] = {}
        for name, x in vectors.items():
            x = np.asarray(x)
            blocks[name] = Block.fit(name, x, _n_components(n, x.shape[1], components, w))
        windows = sample_windows(rng, n, w, n_windows)
        cal: Dict[str, np.ndarray] = {}
        for name, x in vectors.items():
            cal.update(blocks[name].leave_window_out(np.asarray(x), windows))
        thresholds, level = _joint_thresholds(cal, a_main)
        info: Dict[str, Any] = {"n_images": n, "method": "leave-window-out",
                                "n_windows": int(n_windows), "quantile_level": level,
                                "alpha_main": a_main, "window_requested": int(window)}
        if has_score:
            s = np.asarray(good_scores, dtype=np.float64)
            blocks[SCORE_BLOCK] = Block.fit(SCORE_BLOCK, s[:, None], 0, log=True, one_sided=True)
            thr, how = _score_threshold(blocks[SCORE_BLOCK], s, w, a_score, rng, n_windows)
            thresholds[f"{SCORE_BLOCK}:shift"] = thr
            info.update({"n_scores": int(s.size), "score_calibration": how,
                         "alpha_score": a_score})
        # the effect-size floor: an alarm needs a shift of at least min_shift spreads too
        info["calibrated_thresholds"] = dict(thresholds)
        info["min_shift"] = float(min_shift)
        owner = {st: b for b in blocks.values() for st in b.stat_names}
        thresholds = {st: max(t, owner[st].floor(st, min_shift, w))
                      for st, t in thresholds.items()}
        return cls(w, float(alpha), blocks, thresholds, info)

    def updated(self, vectors: Mapping[str, np.ndarray],
                good_scores: Optional[np.ndarray] = None, *, n_windows: int = 4000,
                seed: int = 0) -> "DriftReference":
        """This reference with new good images pooled in (a model update): ``vectors``
        (block name -> ``[m, d]`` statistics of the new images), ``good_scores`` the
        out-of-sample scores of *all* the good images.

        Each layer/input block's mean, spread and principal variances are pooled
        (:meth:`Block.pooled`); its calibrated thresholds are kept: they were calibrated on
        the fit's images by leave-window-out, and a reference of more images varies less
        under a window of good images, so they stay on the safe side (fewer false alarms, not
        more); a refit calibrates them again. The score block and its threshold are fitted
        again on ``good_scores`` (as a fit does). ``info`` counts the images and updates."""
        n_old = int(self.info.get("n_images", 0))
        missing = sorted(set(self.blocks) - {SCORE_BLOCK} - set(vectors))
        if missing or n_old < MIN_REFERENCE_IMAGES:
            raise FitError(f"cannot update the drift reference: statistics of {missing} are "
                           "missing" if missing else
                           f"cannot update a drift reference of {n_old} images")
        blocks = {name: b.pooled(np.asarray(vectors[name]), n_old)
                  for name, b in self.blocks.items() if name != SCORE_BLOCK}
        m = next(iter(np.asarray(v).shape[0] for v in vectors.values()))
        calibrated = dict(self.info.get("calibrated_thresholds") or self.thresholds)
        thresholds = {st: calibrated[st] for b in blocks.values() for st in b.stat_names}
        info = {**self.info, "n_images": n_old + m,
                "updates": int(self.info.get("updates", 0)) + 1,
                "calibration": f"leave-window-out on the fit's {self.info.get('n_images')} "
                               "images, kept by the updates"}
        alpha_score = float(self.info.get("alpha_score", 0.0))
        if good_scores is not None and len(good_scores) >= 3 and alpha_score > 0:
            s = np.asarray(good_scores, dtype=np.float64)
            blocks[SCORE_BLOCK] = Block.fit(SCORE_BLOCK, s[:, None], 0, log=True,
                                            one_sided=True)
            thr, how = _score_threshold(blocks[SCORE_BLOCK], s, self.window, alpha_score,
                                        np.random.default_rng(seed), n_windows)
            thresholds[f"{SCORE_BLOCK}:shift"] = thr
            info.update({"n_scores": int(s.size), "score_calibration": how})
        elif SCORE_BLOCK in self.blocks:  # no new scores: the fit's block as it was
            blocks[SCORE_BLOCK] = self.blocks[SCORE_BLOCK]
            thresholds[f"{SCORE_BLOCK}:shift"] = calibrated[f"{SCORE_BLOCK}:shift"]
        info["calibrated_thresholds"] = dict(thresholds)
        min_shift = float(self.info.get("min_shift", 0.0))
        owner = {st: b for b in blocks.values() for st in b.stat_names}
        thresholds = {st: max(t, owner[st].floor(st, min_shift, self.window))
                      for st, t in thresholds.items()}
        return DriftReference(self.window, self.alpha, blocks, thresholds, info)

    def block_of(self, stat: str) -> Block:
        return self.blocks[stat.rsplit(":", 1)[0]]

    def effect(self, stat: str, value: float) -> float:
        """``value`` of ``stat`` as a shift in good-image spreads (see :meth:`Block.effect`)."""
        return self.block_of(stat).effect(stat, value, self.window)

    # -- persistence -----------------------------------------------------------------------
    def state(self) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
        """float32 arrays (names prefixed ``drift.``) and a JSON-able dict."""
        tensors: Dict[str, np.ndarray] = {}
        metas = []
        for b in self.blocks.values():
            t, m = b.state()
            tensors.update(t)
            metas.append(m)
        return tensors, {"version": 1, "window": self.window, "alpha": self.alpha,
                         "blocks": metas, "thresholds": dict(self.thresholds),
                         "info": dict(self.info)}

    @classmethod
    def from_state(cls, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> "DriftReference":
        if int(meta.get("version", 0)) != 1:
            raise ModelFileError(f"drift reference version {meta.get('version')} is not supported")
        blocks = {m["name"]: Block.from_state(tensors, m) for m in meta["blocks"]}
        ref = cls(int(meta["window"]), float(meta["alpha"]), blocks,
                  {k: float(v) for k, v in meta["thresholds"].items()}, dict(meta["info"]))
        missing = set(ref.stat_names) - set(ref.thresholds)
        if missing:
            raise ModelFileError(f"drift reference without thresholds for {sorted(missing)}")
        return ref


def _joint_thresholds(cal: Mapping[str, np.ndarray], alpha: float
                      ) -> Tuple[Dict[str, float], float]:
    """One quantile level ``q`` for every statistic such that the fraction of calibration
    windows with any statistic above its ``q``-quantile is at most ``alpha`` (bisection)."""
    names = list(cal)
    mat = np.stack([cal[s] for s in names], 1)  # [M, S]
    srt = np.sort(mat, 0)
    m = mat.shape[0]

    def thr_at(q: float) -> np.ndarray:
        i = min(m - 1, int(math.ceil(q * m)) - 1)
        return srt[max(i, 0)]

    def rate(q: float) -> float:
        return float((mat > thr_at(q)).any(1).mean())

    lo, hi = 1.0 - alpha, 1.0
    if rate(lo) <= alpha:
        hi = lo
    for _ in range(40):
        if hi - lo < 0.1 / m:
            break
        mid = 0.5 * (lo + hi)
        if rate(mid) <= alpha:
            hi = mid
        else:
            lo = mid
    thr = thr_at(hi)
    return {s: float(t) for s, t in zip(names, thr)}, hi


def _score_threshold(block: Block, scores: np.ndarray, w: int, alpha: float,
                     rng: np.random.Generator, n_windows: int) -> Tuple[float, str]:
    """The one-sided score statistic's threshold at ``alpha``: leave-window-out on the
    out-of-sample good scores when there are at least ``2 W`` of them, else the Student-t
    bound of a new window mean against a reference mean of ``n`` normal log scores."""
    n = scores.size
    if n >= MIN_IMAGES_PER_WINDOW * w and alpha * n_windows >= 10:
        windows = sample_windows(rng, n, w, n_windows)
        stat = block.leave_window_out(scores[:, None], windows)[f"{block.name}:shift"]
        return float(np.quantile(stat, 1 - alpha)), "leave-window-out"
    from scipy.special import stdtrit  # Student's t quantile (scipy.stats.t.ppf's, lighter)

    # (mean_W - m) / (s sqrt(1/W + 1/n)) ~ t_{n-1}; the statistic is sqrt(W) (mean_W - m) / s
    t = float(stdtrit(max(n - 1, 1), 1 - alpha))
    return t * math.sqrt(1 + w / n), "student-t"
