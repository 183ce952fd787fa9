"""The preprocessing stored with every model: resize, centre crop, normalise — and its inverse
for heatmaps, so that a heatmap comes back in the frame of the image the caller gave.

Two framings: the published one (``resize`` to a fixed (H, W), whatever the image's aspect,
then a centre ``crop``), and a high-resolution model's working :class:`~anomaly_hooks.framing.
Frame` (the image's own aspect kept, the whole image inspected unless a crop is configured,
padded to a fixed network input; set by :mod:`anomaly_hooks.tiling`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from anomaly_hooks.framing import Frame, Framing


@dataclass(frozen=True)
class Preprocessor(Framing):
    """Resize to ``resize`` (H, W), centre crop to ``crop`` (H, W) or not at all, normalise;
    or, with ``frame`` set, the working frame's crop, aspect-keeping resize and padding (then
    ``resize`` / ``crop`` are not used).

    Resizing is bilinear with antialiasing (as torchvision's ``Resize`` on tensors).
    """

    @classmethod
    def from_config(cls, pre) -> "Preprocessor":
        """From the ``preprocess`` section of a config."""
        crop = tuple(pre.crop) if pre.crop is not None else None
        return cls(tuple(pre.resize), crop, tuple(pre.mean), tuple(pre.std))  # type: ignore[arg-type]

    @classmethod
    def framed(cls, frame: Frame, mean: Tuple[float, float, float],
               std: Tuple[float, float, float]) -> "Preprocessor":
        """The preprocessing of a working ``frame`` (``resize`` records its content box)."""
        return cls(tuple(frame.content), None, tuple(mean), tuple(std), frame)  # type: ignore

    def __call__(self, image: torch.Tensor,
                 size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """``[3, H, W]`` float in [0, 1] -> normalised ``[3, h, w]`` with (h, w) = input_size.

        ``size``: the image's original (H, W) when ``image`` is a reduced decode of it
        (``images.decode_reduced``); a working frame places the image by its original size,
        so that the heatmap's way back (which knows only that size) is its exact inverse.
        """
        if self.frame is not None:
            return self._framed(image, tuple(image.shape[-2:]) if size is None else size)
        out = F.interpolate(image.unsqueeze(0), size=self.resize, mode="bilinear",
                            align_corners=False, antialias=True).squeeze(0)
        top, left, ch, cw = self.crop_box()
        out = out[:, top:top + ch, left:left + cw]
        return self._normalise(out).contiguous()

    def _normalise(self, out: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(self.mean, dtype=out.dtype).view(3, 1, 1)
        std = torch.tensor(self.std, dtype=out.dtype).view(3, 1, 1)
        return (out - mean) / std

    def _framed(self, image: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
        """The working frame: crop, aspect-keeping resize, normalise, pad (zeros)."""
        frame = self.frame
        top, left, bh, bw = frame.source_box(size)
        ih, iw = image.shape[-2:]
        if (ih, iw) != tuple(size):  # a reduced decode: the same box in its pixels
            fy, fx = ih / size[0], iw / size[1]
            top, left = int(round(top * fy)), int(round(left * fx))
            bh, bw = max(1, int(round(bh * fy))), max(1, int(round(bw * fx)))
        h, w = frame.placement(size)
        part = image[:, top:top + bh, left:left + bw].unsqueeze(0)
        resized = F.interpolate(part, size=(h, w), mode="bilinear", align_corners=False,
                                antialias=True).squeeze(0)
        out = resized.new_zeros((3, *frame.size))
        out[:, :h, :w] = self._normalise(resized)
        return out

    def to_original(self, maps: torch.Tensor, size: Tuple[int, int],
                    fill: Union[float, torch.Tensor]) -> torch.Tensor:
        """Map heatmaps from the network frame back to an original image frame.

        Args:
            maps: ``[h, w]`` heatmap in the network frame (h, w = input_size).
            size: (H, W) of the original image.
            fill: value for the parts the crop cut off (they were not inspected): a number, or
                a 0-d tensor on ``maps``' device (read there, without waiting for the GPU).

        Returns:
            ``[H, W]`` heatmap aligned with the original image.
        """
        if self.frame is not None:
            return self._framed_back(maps, size, fill)
        rh, rw = self.resize
        top, left, ch, cw = self.crop_box()
        canvas = maps.new_empty((rh, rw)).fill_(fill)
        canvas[top:top + ch, left:left + cw] = maps
        out = F.interpolate(canvas[None, None], size=tuple(size), mode="bilinear",
                            align_corners=False)
        return out[0, 0]

    def _framed_back(self, maps: torch.Tensor, size: Tuple[int, int],
                     fill: Union[float, torch.Tensor]) -> torch.Tensor:
        """The working frame's inverse: the image's own part of the frame (its placement,
        never the padding) resized to the inspected box; the crop's cut-off gets ``fill``."""
        h, w = self.frame.placement(size)
        top, left, bh, bw = self.frame.source_box(size)
        back = F.interpolate(maps[:h, :w][None, None], size=(bh, bw), mode="bilinear",
                             align_corners=False)[0, 0]
        if (bh, bw) == tuple(size):
            return back
        canvas = maps.new_empty(tuple(size)).fill_(fill)
        canvas[top:top + bh, left:left + bw] = back
        return canvas

    def as_dict(self) -> dict:
        """JSON-serialisable description (stored with the model)."""
        out = {"resize": list(self.resize), "crop": list(self.crop) if self.crop else None,
               "mean": list(self.mean), "std": list(self.std)}
        if self.frame is not None:
            out["frame"] = self.frame.as_dict()
        return out
