"""Per-image statistics the drift monitor watches (torch-free: numpy, or duck-typed tensors).

* input statistics of the network input (the preprocessed image, un-normalised back to [0, 1]):
  channel means (brightness), grey standard deviation (contrast), log variance of the Laplacian
  (sharpness), log of Immerkaer's noise estimate, log mean gradient magnitude;
* layer statistics: a reduction of a tapped layer's output ``[B, C, h, w]`` per image.

A tiled model places an image of another aspect at the top-left of its working frame with
padding around it (and rounds every frame up to the stride): given each image's **box**
(``(h, w)`` network pixels at the frame's top-left), both kinds of statistic read the image's
own part only -- the input statistics its pixels, the layer statistics the cells whose top-left
pixel is in the box (the rule the patch scores' padding mask follows) -- so a letterboxed
stream is compared with its reference, not with its bars.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from anomaly_hooks.errors import ConfigError, DataError

INPUT_STAT_NAMES = ("brightness_r", "brightness_g", "brightness_b", "contrast", "sharpness",
                    "noise", "gradient")


GREY_WEIGHTS = (0.299, 0.587, 0.114)


def input_statistics(images: Any, mean: Sequence[float], std: Sequence[float],
                     boxes: Any = None) -> np.ndarray:
    """``[B, 7]`` float32 statistics (:data:`INPUT_STAT_NAMES`) of normalised network inputs
    ``[B, 3, h, w]`` (``mean``/``std``: the preprocessing's normalisation). A torch tensor is
    reduced where it lives (GPU included) with its own methods -- this module never imports
    torch -- and only the ``[B, 7]`` result is copied. ``boxes``: ``[B, 2]`` each image's own
    part, ``(h, w)`` pixels at the top-left (the rest is padding: not read); None: all.

    Cost: about 20 passes over one grey plane (separable second differences shared by the
    Laplacian and Immerkaer's noise estimate)."""
    if boxes is not None:
        frame = (int(images.shape[-2]), int(images.shape[-1]))
        # a sliver of an image (an extreme aspect) is read 3 x 3 at least, as the filters need
        parts = [(min(max(h, 3), frame[0]), min(max(w, 3), frame[1]))
                 for h, w in image_boxes(boxes, images.shape[0], frame)]
        if any(part != frame for part in parts):  # else: as one batch
            return np.concatenate([input_statistics(images[i:i + 1, :, :h, :w], mean, std)
                                   for i, (h, w) in enumerate(parts)])
    torch_like = hasattr(images, "detach") and images.device.type != "cpu"  # GPU: stay there
    if torch_like:
        x = images.detach().float()
    else:  # numpy is faster than small torch ops on the CPU
        x = np.asarray(images.detach().cpu() if hasattr(images, "detach") else images,
                       dtype=np.float32)
    if x.ndim != 4 or x.shape[1] != 3:
        raise DataError(f"expected images [B, 3, h, w], got {tuple(x.shape)}")
    if x.shape[2] < 3 or x.shape[3] < 3:
        raise DataError(f"images of {tuple(x.shape[2:])} pixels are too small (3 x 3 at least)")

    def mean_over(t, axes):
        return t.mean(dim=axes) if torch_like else t.mean(axis=axes)

    # channel means and the grey plane straight from the normalised input (linear maps)
    chan = mean_over(x, (2, 3))  # [B, 3], normalised
    g = sum(float(GREY_WEIGHTS[c] * std[c]) * x[:, c] for c in range(3)) \
        + float(sum(GREY_WEIGHTS[c] * mean[c] for c in range(3)))
    gm = mean_over(g, (1, 2))
    contrast = mean_over((g - gm[:, None, None]) ** 2, (1, 2)) ** 0.5
    d2x = g[:, :, :-2] - 2 * g[:, :, 1:-1] + g[:, :, 2:]  # [B, h, w-2]
    d2y = g[:, :-2, :] - 2 * g[:, 1:-1, :] + g[:, 2:, :]  # [B, h-2, w]
    lap = d2x[:, 1:-1, :] + d2y[:, :, 1:-1]
    lm = mean_over(lap, (1, 2))
    sharp = mean_over((lap - lm[:, None, None]) ** 2, (1, 2)) + 1e-10
    # Immerkaer (1996): sigma = sqrt(pi/2) / 6 * mean |g * [1,-2,1]^T [1,-2,1]| (separable)
    imm = d2x[:, :-2] - 2 * d2x[:, 1:-1] + d2x[:, 2:]
    noise = math.sqrt(math.pi / 2) / 6 * mean_over(abs(imm), (1, 2)) + 1e-6
    grad = (mean_over(abs(g[:, 1:] - g[:, :-1]), (1, 2))
            + mean_over(abs(g[:, :, 1:] - g[:, :, :-1]), (1, 2)) + 1e-6)
    cols = [chan, contrast, sharp, noise, grad]
    if torch_like:
        cols = [t.cpu().numpy() for t in cols]  # small copies
    chan = np.asarray(cols[0], np.float64) * np.asarray(std) + np.asarray(mean)
    out = np.concatenate([chan, np.stack([np.asarray(c, np.float64) for c in cols[1:]], 1)], 1)
    out[:, 4:] = np.log(out[:, 4:])
    return out.astype(np.float32)


INPUT_BLOCK = "input"
RESERVED_BLOCKS = ("input", "score")


def image_boxes(boxes: Any, batch: int, frame: Tuple[int, int]) -> List[Tuple[int, int]]:
    """``boxes`` (``[B, 2]``: a list of pairs, an array or a tensor) as ``B`` pairs of ints
    ``(h, w)``, each within ``frame`` (H, W) and at least one pixel; ValueError for another
    count or shape."""
    rows = np.asarray(boxes.detach().cpu() if hasattr(boxes, "detach") else boxes)
    if rows.shape != (batch, 2):
        raise ValueError(f"boxes must be [B, 2] = [{batch}, 2] (each image's h, w), got "
                         f"{tuple(rows.shape)}")
    return [(min(max(int(h), 1), frame[0]), min(max(int(w), 1), frame[1])) for h, w in rows]


def box_cells(boxes: Sequence[Tuple[int, int]], frame: Tuple[int, int],
              grid: Tuple[int, int]) -> List[Tuple[int, int]]:
    """Per image, the cells of a ``grid`` (h, w) map of a ``frame`` (H, W) that hold pixels
    of its box: the ``(rows, columns)`` at the top-left whose cell's top-left pixel is in the
    box (a cell is ``frame // grid`` pixels)."""
    cell_h, cell_w = max(frame[0] // grid[0], 1), max(frame[1] // grid[1], 1)
    return [(min(grid[0], -(-h // cell_h)), min(grid[1], -(-w // cell_w))) for h, w in boxes]


def layer_statistics(features: Any, boxes: Any = None,
                     frame: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """``[B, C]`` float32 spatial mean of each channel of one layer output ``[B, C, h, w]``
    (a torch tensor is reduced where it lives, GPU included, before it is copied).
    ``boxes``: ``[B, 2]`` each image's own part of a ``frame`` (H, W) network pixels, ``(h,
    w)`` at the top-left; the mean is then over the cells that hold pixels of it
    (:func:`box_cells`), not the padding; None: over all cells."""
    torch_like = hasattr(features, "detach")
    x = features.detach().float() if torch_like else np.asarray(features, dtype=np.float32)
    if x.ndim != 4:
        raise DataError(f"expected a layer output [B, C, h, w], got {tuple(x.shape)}")
    grid = (int(x.shape[2]), int(x.shape[3]))
    if boxes is None:
        cells = [grid] * int(x.shape[0])
    else:
        if frame is None:
            raise ValueError("layer statistics over boxes need the frame's size")
        frame = (int(frame[0]), int(frame[1]))
        cells = box_cells(image_boxes(boxes, int(x.shape[0]), frame), frame, grid)
    if all(c == grid for c in cells):
        if torch_like:
            return x.mean(dim=(2, 3)).cpu().numpy()
        return x.mean(axis=(2, 3))
    # each image over its own cells (a few images per batch: a loop; only [C] rows copied)
    parts = [x[i, :, :h, :w] for i, (h, w) in enumerate(cells)]
    if torch_like:
        return np.stack([p.mean(dim=(1, 2)).cpu().numpy() for p in parts])
    return np.stack([p.mean(axis=(1, 2)) for p in parts])


def block_statistics(features: Any, images: Any, mean: Sequence[float], std: Sequence[float],
                     blocks: Any = None, boxes: Any = None,
                     frame: Optional[Tuple[int, int]] = None) -> dict:
    """Per-image statistics of a batch, by block: ``input`` (from ``images``) and one block per
    layer of ``features`` (``{layer: [B, C, h, w]}``); either may be None. ``blocks``: only the
    block names in it are computed (the others would be ignored anyway). ``boxes``: ``[B, 2]``
    each image's own part of the frame (see the module docstring; None: the whole frame), of
    ``frame`` (H, W) network pixels (default: the size of ``images``)."""
    if boxes is not None and frame is None:
        if images is None:
            raise ValueError("statistics over boxes need the frame's size (or the images)")
        frame = (int(images.shape[-2]), int(images.shape[-1]))
    out = {}
    if images is not None and (blocks is None or INPUT_BLOCK in blocks):
        out[INPUT_BLOCK] = input_statistics(images, mean, std, boxes)
    for name, feat in (features or {}).items():
        if name in RESERVED_BLOCKS:
            raise ConfigError(f"a tapped layer named {name!r} collides with the drift block of "
                             "that name")
        if blocks is None or name in blocks:
            out[name] = layer_statistics(feat, boxes, frame)
    return out


class StatisticsCollector:
    """Fit-time collector of per-image block statistics (a callable ``(features, images,
    boxes)`` that the detector's fit pass calls on every batch of good images).

    Keeps at most ``max_images`` images (a seeded reservoir sample beyond that): the reference
    and its calibration need the per-image vectors, not only their sums (about 7 KB per image
    for WRN50 layer1-3).
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], *, max_images: int = 5000,
                 seed: int = 0) -> None:
        self.mean, self.std = tuple(mean), tuple(std)
        self.max_images = int(max_images)
        self._rng = np.random.default_rng(seed)
        self._rows: list = []  # one dict {block: [d]} per kept image
        self.n_seen = 0

    def __call__(self, features: Any, images: Any, boxes: Any = None) -> None:
        stats = block_statistics(features, images, self.mean, self.std, boxes=boxes)
        n = next(iter(stats.values())).shape[0] if stats else 0
        for i in range(n):
            row = {k: v[i] for k, v in stats.items()}
            self.n_seen += 1
            if len(self._rows) < self.max_images:
                self._rows.append(row)
            else:  # reservoir sampling (Vitter's algorithm R)
                j = int(self._rng.integers(0, self.n_seen))
                if j < self.max_images:
                    self._rows[j] = row

    def state(self) -> Dict[str, Any]:
        """The kept statistics as plain data (a shard's part of a sharded fit):
        ``{"n_seen": int, "vectors": {block: [n, d] float32}}``."""
        return {"n_seen": self.n_seen, "vectors": self.vectors()}

    @classmethod
    def merged(cls, like: "StatisticsCollector", states: Sequence[Dict[str, Any]]
               ) -> "StatisticsCollector":
        """A collector holding what the shards' collectors kept (``states`` in shard order),
        with ``like``'s settings. While the images fit in ``max_images`` the rows are the
        shards' rows in order (what one collector over all the images keeps); beyond, a seeded
        uniform sample of ``max_images`` of all the images seen: how many come from each shard
        is drawn from the multivariate hypergeometric law of its ``n_seen``, then that many of
        its (uniform) reservoir."""
        out = cls(like.mean, like.std, max_images=like.max_images, seed=0)
        out._rng = like._rng
        seen = [int(s["n_seen"]) for s in states]
        out.n_seen = sum(seen)
        take = seen
        if out.n_seen > out.max_images:
            take = out._rng.multivariate_hypergeometric(seen, out.max_images).tolist()
        for state, n in zip(states, take):
            vectors = state["vectors"]
            if not vectors or n == 0:
                continue
            kept = next(iter(vectors.values())).shape[0]
            rows = (np.arange(kept) if n >= kept
                    else np.sort(out._rng.choice(kept, size=n, replace=False)))
            out._rows.extend({k: np.asarray(v[i]) for k, v in vectors.items()} for i in rows)
        return out

    def vectors(self) -> dict:
        """``{block: [N, d]}`` float32 of the kept images."""
        if not self._rows:
            return {}
        return {k: np.stack([r[k] for r in self._rows]).astype(np.float32)
                for k in self._rows[0]}
