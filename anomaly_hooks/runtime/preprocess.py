"""Torch-free preprocessing: the numpy twin of :class:`anomaly_hooks.preprocess.Preprocessor`.

* Resize: bilinear with antialiasing, as ``F.interpolate(mode="bilinear", align_corners=False,
  antialias=True)`` (the PIL-style separable filter: a triangle of support ``max(scale, 1)``
  around ``scale * (i + 0.5)``, taps normalised to sum 1; width first, then height). Two
  implementations: ``numpy`` (weights computed in float32 exactly as torch's CPU kernel, applied
  as two float32 matrix products) and ``pillow`` (Pillow's resize of one mode-"F" image per
  channel: the same filter in double precision, faster on big images).
* Centre crop (torchvision's rounding), normalisation.
* :meth:`NumpyPreprocessor.to_original`: the heatmap back into the caller's frame (bilinear,
  ``align_corners=False``, no antialias, exactly torch's index and weight arithmetic in float32).
* A tiled model's working :class:`~anomaly_hooks.framing.Frame`: the crop, the aspect-keeping
  resize to the image's placement, zeros padding to the frame; the heatmap's way back reads the
  image's own part of the frame only (the eager ``Preprocessor``'s framed path, step for step).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Tuple

import numpy as np

from anomaly_hooks.framing import Frame, Framing
from anomaly_hooks.modelmeta import check_preprocess

F32 = np.float32


@lru_cache(maxsize=64)
def aa_weights(in_size: int, out_size: int) -> np.ndarray:
    """``[out, in]`` float32 antialiased-bilinear weights, torch's arithmetic (float32)."""
    scale = F32(in_size) / F32(out_size)
    support = scale if scale >= 1.0 else F32(1.0)
    invscale = F32(1.0) / scale if scale >= 1.0 else F32(1.0)
    w = np.zeros((out_size, in_size), dtype=F32)
    for i in range(out_size):
        center = scale * (F32(i) + F32(0.5))
        xmin = max(int(center - support + F32(0.5)), 0)
        xmax = min(int(center + support + F32(0.5)), in_size)
        j = np.arange(xmin, xmax, dtype=F32)
        taps = F32(1.0) - np.abs((j - center + F32(0.5)) * invscale)
        taps = np.where(taps > 0, taps, F32(0)).astype(F32)
        total = taps.sum(dtype=F32)
        if total != 0:
            taps = (taps / total).astype(F32)
        w[i, xmin:xmax] = taps
    return w


def resize_aa(image: np.ndarray, size: Tuple[int, int], method: str = "numpy") -> np.ndarray:
    """``[H, W, C]`` float32 -> ``[C, h, w]`` float32 (antialiased bilinear, torch's rule)."""
    h, w = int(size[0]), int(size[1])
    if method == "pillow":
        from PIL import Image
        chans = [np.asarray(Image.fromarray(np.ascontiguousarray(image[:, :, c]), mode="F")
                            .resize((w, h), Image.BILINEAR, reducing_gap=None), dtype=F32)
                 for c in range(image.shape[2])]
        return np.stack(chans, axis=0)
    if method != "numpy":
        raise ValueError(f"method={method!r}: numpy or pillow")
    ih, iw, c = image.shape
    if iw != w:  # horizontal first (torch's order): [w, W] @ [H, W, C] -> [H, w, C], read in
        # place (no transposed copy of a large image), then [C, H, w]
        out = np.matmul(aa_weights(iw, w), image.astype(F32, copy=False)).transpose(2, 0, 1)
    else:
        out = image.transpose(2, 0, 1)
    out = np.ascontiguousarray(out, dtype=F32)  # [C, H, w]
    if ih != h:  # vertical: [h, H] @ [C, H, w]
        out = np.matmul(aa_weights(ih, h), out)
    return np.ascontiguousarray(out, dtype=F32)


def bilinear_indices(in_size: int, out_size: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray,
                                                           np.ndarray]:
    """torch's ``upsample_bilinear2d`` (``align_corners=False``) source indices and weights."""
    scale = F32(in_size) / F32(out_size)
    dst = np.arange(out_size, dtype=F32)
    src = np.maximum(scale * (dst + F32(0.5)) - F32(0.5), F32(0))
    i0 = src.astype(np.int64)  # floor of a non-negative value
    i1 = np.minimum(i0 + 1, in_size - 1)
    lam1 = (src - i0.astype(F32)).astype(F32)
    lam0 = (F32(1) - lam1).astype(F32)
    return i0, i1, lam0, lam1


def resize_bilinear(maps: np.ndarray, size: Tuple[int, int]) -> np.ndarray:
    """``[H, W]`` float32 -> ``[h, w]`` bilinear (``align_corners=False``, no antialias)."""
    h0, h1, a0, a1 = bilinear_indices(maps.shape[0], int(size[0]))
    w0, w1, b0, b1 = bilinear_indices(maps.shape[1], int(size[1]))
    m = maps.astype(F32, copy=False)
    # torch: h0l * (w0l * x00 + w1l * x01) + h1l * (w0l * x10 + w1l * x11). The horizontal
    # step of every source row first ([H, w], small), then the rows each output row needs:
    # the same float32 operations in the same order, with two full-size gathers instead of
    # four, the products and the sum computed in place (two full-size arrays, not five: a
    # heatmap back at a large upload's resolution is mostly memory traffic)
    rows = b0 * m[:, w0] + b1 * m[:, w1]
    out = np.take(rows, h0, axis=0)
    out *= a0[:, None]
    lower = np.take(rows, h1, axis=0)
    lower *= a1[:, None]
    out += lower
    return out


@dataclass(frozen=True)
class NumpyPreprocessor(Framing):
    """Resize (antialiased bilinear), centre crop, normalise; and the heatmap's way back. With
    ``frame`` (a tiled model's): its crop, aspect-keeping resize and padding instead."""

    method: str = "numpy"

    @classmethod
    def from_dict(cls, d: dict, method: str = "numpy") -> "NumpyPreprocessor":
        """From ``Preprocessor.as_dict()`` (what the model metadata holds), checked by
        :func:`anomaly_hooks.modelmeta.check_preprocess` (sizes, finite mean, std > 0)."""
        pre = check_preprocess(d)
        frame = Frame.from_dict(pre["frame"]) if pre.get("frame") is not None else None
        return cls(pre["resize"], pre["crop"], pre["mean"], pre["std"], frame, method)

    def _normalise(self, out: np.ndarray) -> np.ndarray:
        mean = np.asarray(self.mean, dtype=F32).reshape(3, 1, 1)
        std = np.asarray(self.std, dtype=F32).reshape(3, 1, 1)
        return np.ascontiguousarray((out - mean) / std, dtype=F32)

    def __call__(self, image: np.ndarray, size: Optional[Sequence[int]] = None) -> np.ndarray:
        """``[H, W, 3]`` float32 in [0, 1] -> normalised ``[3, h, w]`` float32. ``size``: the
        image's original (H, W) when ``image`` is a reduced decode of it (a working frame
        places an image by its original size, as the eager preprocessing does)."""
        if self.frame is not None:
            return self._framed(image, tuple(image.shape[:2]) if size is None else tuple(size))
        out = resize_aa(image, self.resize, self.method)
        top, left, ch, cw = self.crop_box()
        return self._normalise(out[:, top:top + ch, left:left + cw])

    def _framed(self, image: np.ndarray, size: Tuple[int, int]) -> np.ndarray:
        """The working frame: crop, aspect-keeping resize, normalise, pad (zeros)."""
        frame = self.frame
        top, left, bh, bw = frame.source_box(size)
        ih, iw = image.shape[:2]
        if (ih, iw) != tuple(size):  # a reduced decode: the same box in its pixels
            fy, fx = ih / size[0], iw / size[1]
            top, left = int(round(top * fy)), int(round(left * fx))
            bh, bw = max(1, int(round(bh * fy))), max(1, int(round(bw * fx)))
        h, w = frame.placement(size)
        part = resize_aa(image[top:top + bh, left:left + bw], (h, w), self.method)
        out = np.zeros((3, *frame.size), dtype=F32)
        out[:, :h, :w] = self._normalise(part)
        return out

    def placement(self, size: Sequence[int]) -> Tuple[int, int]:
        """A tiled model's box of an image of ``size`` (H, W) in its frame (its own part,
        at the top-left); the whole network input for an untiled one."""
        if self.frame is None:
            return self.input_size
        return self.frame.placement((int(size[0]), int(size[1])))

    def to_original(self, heat: np.ndarray, size: Sequence[int], fill: float) -> np.ndarray:
        """``[h, w]`` heatmap in the network frame -> ``[H, W]`` in the original frame; parts
        the crop cut off get ``fill`` (a working frame: only the image's own part is read)."""
        if self.frame is not None:
            return self._framed_back(heat, (int(size[0]), int(size[1])), fill)
        rh, rw = self.resize
        top, left, ch, cw = self.crop_box()
        canvas = np.full((rh, rw), fill, dtype=F32)
        canvas[top:top + ch, left:left + cw] = heat
        return resize_bilinear(canvas, (int(size[0]), int(size[1])))

    def _framed_back(self, heat: np.ndarray, size: Tuple[int, int], fill: float) -> np.ndarray:
        """The working frame's inverse: the image's part of the frame resized to the
        inspected box; the crop's cut-off gets ``fill``."""
        h, w = self.frame.placement(size)
        top, left, bh, bw = self.frame.source_box(size)
        back = resize_bilinear(heat[:h, :w], (bh, bw))
        if (bh, bw) == tuple(size):
            return back
        canvas = np.full(size, fill, dtype=F32)
        canvas[top:top + bh, left:left + bw] = back
        return canvas
