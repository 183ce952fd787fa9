"""Which training images must be left out together when they are scored out of sample.

A leave-one-out score is exchangeable with an unseen good part's score only when the training
images are independent. Several images of one physical part (re-shots, views, crops of one
weld), or exact copies, are not: the left-out image's twin stays in the model and scores it as
if it were seen. Images are therefore scored by a model fitted without their whole *group*:

* ``threshold.groups``: a regular expression searched in each training file's name (its stem);
  images whose match is the same (the first capture group where the pattern has one) are one
  group. Names that do not match are alone.
* ``threshold.near_duplicates``: images whose descriptors (the patch embeddings pooled to a
  ``4 x 4`` grid, :func:`image_descriptors`) are closer than this fraction of the median
  distance between two training images are one group (linked transitively). At ``0.5`` two
  images share three quarters of their variance (squared distance a quarter of the typical
  one); independent good parts of the shared data sets never came closer than 0.57 of the
  median to any training image, while re-shots of one part and crops of one weld sit at
  0.0-0.3.

Groups are numbered in the order of their first image. :func:`blocked_folds` cuts them into
``K`` folds of consecutive groups (the fit order: sorted file names, which usually follows the
capture order, so a fold is also a stretch of production) for methods that cross-fit.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from anomaly_hooks.errors import ConfigError, FitError

POOL = 4  # descriptor grid: the embeddings averaged over a POOL x POOL grid of cells
MEDIAN_PAIRS = 200_000  # pairs sampled (seeded) for the median distance of larger fits
PAIR_CHUNK = 1024  # rows of the pairwise distance matrix at a time
SHOWN_PAIRS = 20  # near-duplicate pairs recorded by name in the model file
# Near-duplicate links chain transitively: on images that all look alike (one texture, one
# product shot the same way) the pairs below ratio x median can percolate into one group of
# most of the set, and leaving it out fits the model on a remnant (the sample data: 48 of 60
# images in one group, out-of-sample scores twice an unseen part's). Leaving a group out must
# leave the model at least half the images; a larger group is taken for links across
# independent parts, and the ratio is halved until no group exceeds this share (a re-shot
# sits at 0.0-0.3 of the median).
MAX_GROUP_SHARE = 0.5
MIN_RATIO_STEP = 1 / 16  # the ratio is halved down to this fraction of the configured one


def image_descriptors(embeddings: Any) -> np.ndarray:
    """``[B, D * POOL * POOL]`` float32 descriptors of patch embeddings ``[B, D, h, w]`` (a
    torch tensor): each channel averaged over a ``POOL x POOL`` grid of cells."""
    import torch.nn.functional as F

    pooled = F.adaptive_avg_pool2d(embeddings.float(), POOL)
    return pooled.flatten(1).cpu().numpy().astype(np.float32)


@dataclass
class Grouping:
    """The group of each training image (fit order) and how it was found.

    Attributes:
        groups: ``[n]`` int, numbered by first appearance.
        by_name: images in a multi-image group of ``threshold.groups``.
        duplicate_pairs: near-duplicate pairs found, as (i, j) fit-order indices.
        median_distance: the median distance between two training images' descriptors.
    """

    groups: np.ndarray
    by_name: int = 0
    duplicate_pairs: List[tuple] = field(default_factory=list)
    median_distance: Optional[float] = None
    ratio_used: Optional[float] = None  # the near-duplicate ratio after the chaining guard

    @property
    def n_groups(self) -> int:
        return int(self.groups.max()) + 1 if self.groups.size else 0

    @property
    def grouped_images(self) -> int:
        """Images that share their group with another image."""
        sizes = np.bincount(self.groups)
        return int(sizes[sizes > 1].sum())

    def summary(self, names: Optional[Sequence[str]] = None) -> Dict[str, Any]:
        """JSON-able facts for the model file: counts and the first near-duplicate pairs."""
        out: Dict[str, Any] = {"n_groups": self.n_groups, "grouped_images": self.grouped_images,
                               "largest_group": int(np.bincount(self.groups).max())
                               if self.groups.size else 0,
                               "grouped_by_name": self.by_name,
                               "near_duplicate_pairs": len(self.duplicate_pairs),
                               "near_duplicate_ratio": self.ratio_used}
        if names is not None and self.duplicate_pairs:
            out["near_duplicate_examples"] = [[str(names[i]), str(names[j])]
                                              for i, j in self.duplicate_pairs[:SHOWN_PAIRS]]
        return out


def _find(parent: np.ndarray, i: int) -> int:
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def _components(n: int, pairs: Sequence[tuple]) -> np.ndarray:
    """Connected components of ``n`` nodes linked by ``pairs``, numbered by first node."""
    parent = np.arange(n)
    for i, j in pairs:
        ri, rj = _find(parent, int(i)), _find(parent, int(j))
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    roots = np.array([_find(parent, i) for i in range(n)])
    _, first, inverse = np.unique(roots, return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))  # component number by its first image
    return order[inverse].astype(np.int64)


def name_pairs(names: Sequence[str], pattern: str) -> List[tuple]:
    """Pairs (consecutive within each key) of images whose stems give the same match of the
    regular expression ``pattern`` (its first group, where it has one)."""
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise ConfigError(f"threshold.groups={pattern!r} is not a regular expression: "
                          f"{exc}") from None
    last: Dict[str, int] = {}
    pairs = []
    for i, name in enumerate(names):
        m = rx.search(Path(str(name)).stem)
        if m is None:
            continue
        key = m.group(1) if rx.groups else m.group(0)
        if key in last:
            pairs.append((last[key], i))
        last[key] = i
    return pairs


def median_pair_distance(x: np.ndarray, seed: int) -> float:
    """The median Euclidean distance between two different rows of ``x`` ``[n, F]``: exact up
    to ``MEDIAN_PAIRS`` pairs, else over that many pairs drawn with ``seed``."""
    import torch

    n = x.shape[0]
    x = np.asarray(x, dtype=np.float64)
    if n * (n - 1) // 2 <= MEDIAN_PAIRS:
        # every pair, differences formed pair by pair in C: no [pairs, F] temporaries (0.9 GB
        # for 200 images of 2816 features, 10 times the time). torch's pdist rather than
        # scipy's (the same distances to a float64 rounding): no 0.19 s import of scipy.spatial
        # in every fit and update process
        return float(np.median(torch.nn.functional.pdist(torch.from_numpy(x)).numpy()))
    rng = np.random.default_rng(seed)
    i = rng.integers(0, n, MEDIAN_PAIRS)
    j = (i + rng.integers(1, n, MEDIAN_PAIRS)) % n  # never i itself
    d = np.empty(MEDIAN_PAIRS)
    step = max(1, (16 << 20) // (8 * x.shape[1]))  # pairs per chunk: 16 MB of differences
    for lo in range(0, MEDIAN_PAIRS, step):
        d[lo:lo + step] = np.linalg.norm(x[i[lo:lo + step]] - x[j[lo:lo + step]], axis=1)
    return float(np.median(d))


def duplicate_pairs(x: np.ndarray, ratio: float, seed: int) -> tuple[List[tuple], float]:
    """Pairs ``(i, j)``, ``i < j``, of rows of ``x`` closer than ``ratio`` times the median
    pairwise distance, and that median."""
    x = np.asarray(x, dtype=np.float64)
    med = median_pair_distance(x, seed)
    cut = ratio * med
    sq = (x * x).sum(axis=1)
    pairs = []
    for lo in range(0, x.shape[0], PAIR_CHUNK):
        blk = x[lo:lo + PAIR_CHUNK]
        d2 = sq[lo:lo + PAIR_CHUNK, None] + sq[None, :] - 2.0 * blk @ x.T
        ii, jj = np.nonzero(d2 < cut * cut)
        pairs.extend((int(a + lo), int(b)) for a, b in zip(ii, jj) if a + lo < b)
    return pairs, med


def find_groups(n: int, names: Optional[Sequence[str]], pattern: Optional[str],
                descriptors: Optional[np.ndarray], ratio: Optional[float],
                seed: int) -> Grouping:
    """The groups of ``n`` training images from their names (``pattern``) and their
    descriptors (``ratio``; None or 0 = no near-duplicate search)."""
    pairs: List[tuple] = []
    by_name = 0
    if pattern:
        if names is None:
            raise ConfigError("threshold.groups matches file names, but the training images "
                              "were given in memory: give file paths, or set "
                              "threshold.groups=null")
        named = name_pairs(names, pattern)
        sizes = np.bincount(_components(n, named))
        by_name = int(sizes[sizes > 1].sum())
        pairs.extend(named)
    dups: List[tuple] = []
    med = used = None
    if ratio and descriptors is not None and n > 2:
        dups, med, used = unchained_pairs(n, pairs, descriptors, ratio, seed)
        pairs.extend(dups)
    groups = _components(n, pairs)
    if n > 1 and groups.max() == 0:
        raise FitError(f"all {n} training images fall in one group (threshold.groups="
                       f"{pattern!r}, threshold.near_duplicates={ratio}): none can be scored "
                       "by a model without it; loosen the pattern or lower "
                       "threshold.near_duplicates")
    return Grouping(groups, by_name, dups, med, used)


def unchained_pairs(n: int, named: Sequence[tuple], descriptors: np.ndarray, ratio: float,
                    seed: int) -> tuple[List[tuple], float, Optional[float]]:
    """Near-duplicate pairs at ``ratio`` (halved while, with the ``named`` pairs, they link
    a group of more than ``MAX_GROUP_SHARE`` of the ``n`` images), the median distance and the
    ratio used (None: no ratio small enough; a warning says so)."""
    named_largest = int(np.bincount(_components(n, named)).max()) if named else 1
    cap = max(2, int(MAX_GROUP_SHARE * n), named_largest)
    first = None
    r = ratio
    while r >= ratio * MIN_RATIO_STEP:
        dups, med = duplicate_pairs(descriptors, r, seed)
        largest = int(np.bincount(_components(n, [*named, *dups])).max())
        first = largest if first is None else first
        if largest <= cap:
            if r < ratio:
                warnings.warn(
                    f"threshold.near_duplicates={ratio} linked {first} of the {n} training "
                    "images into one group (images that look alike throughout: the links "
                    f"chain across parts); used {r:g}, {_linked_at(n, dups, cap)}. Name "
                    "re-shots with threshold.groups to group them for certain",
                    UserWarning, stacklevel=3)
            return dups, med, r
        r /= 2
    warnings.warn(
        f"threshold.near_duplicates={ratio} linked {first} of the {n} training images into "
        f"one group, and so did every ratio down to {r * 2:g}: no near-duplicate grouping is "
        "used (leave-one-out). Name re-shots with threshold.groups to group them",
        UserWarning, stacklevel=3)
    return [], med, None


def _linked_at(n: int, dups: Sequence[tuple], cap: int) -> str:
    """What the near-duplicate pairs ``dups`` of a tightened ratio link, for its warning."""
    if not dups:
        return "at which no two images are near-duplicates (each is left out alone)"
    sizes = np.bincount(_components(n, dups))
    return (f"at which {int(sizes[sizes > 1].sum())} images link into groups of at most "
            f"{int(sizes.max())} (the limit: {cap})")


def blocked_folds(groups: np.ndarray, k: int) -> np.ndarray:
    """``[n]`` fold of each image: ``k`` folds of consecutive groups (in group number order)
    with about ``n / k`` images each; fewer folds when there are fewer groups."""
    groups = np.asarray(groups, dtype=np.int64)
    n = groups.size
    sizes = np.bincount(groups)
    k = max(1, min(k, sizes.size))
    start = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # images before each group
    # a group goes to the fold its middle image falls in: balanced, and never an empty fold
    fold_of_group = np.minimum(((start + sizes / 2.0) * k / n).astype(np.int64), k - 1)
    _, fold_of_group = np.unique(fold_of_group, return_inverse=True)  # renumber 0..k'-1
    return fold_of_group[groups]
