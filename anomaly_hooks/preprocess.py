"""The preprocessing stored with every model: resize, centre crop, normalise — and its inverse
for heatmaps, so that a heatmap comes back in the frame of the image the caller gave."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple, Union

import torch
import torch.nn.functional as F

from anomaly_hooks.framing import Framing


@dataclass(frozen=True)
class Preprocessor(Framing):
    """Resize to ``resize`` (H, W), centre crop to ``crop`` (H, W) or not at all, normalise.

    Resizing is bilinear with antialiasing (as torchvision's ``Resize`` on tensors).
    """

    @classmethod
    def from_config(cls, pre) -> "Preprocessor":
        """From the ``preprocess`` section of a config."""
        crop = tuple(pre.crop) if pre.crop is not None else None
        return cls(tuple(pre.resize), crop, tuple(pre.mean), tuple(pre.std))  # type: ignore[arg-type]

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        """``[3, H, W]`` float in [0, 1] -> normalised ``[3, h, w]`` with (h, w) = input_size."""
        out = F.interpolate(image.unsqueeze(0), size=self.resize, mode="bilinear",
                            align_corners=False, antialias=True).squeeze(0)
        top, left, ch, cw = self.crop_box()
        out = out[:, top:top + ch, left:left + cw]
        mean = torch.tensor(self.mean, dtype=out.dtype).view(3, 1, 1)
        std = torch.tensor(self.std, dtype=out.dtype).view(3, 1, 1)
        return ((out - mean) / std).contiguous()

    def to_original(self, maps: torch.Tensor, size: Tuple[int, int],
                    fill: Union[float, torch.Tensor]) -> torch.Tensor:
        """Map heatmaps from the network frame back to an original image frame.

        Args:
            maps: ``[h, w]`` heatmap in the cropped frame (h, w = input_size).
            size: (H, W) of the original image.
            fill: value for the parts the crop cut off (they were not inspected): a number, or
                a 0-d tensor on ``maps``' device (read there, without waiting for the GPU).

        Returns:
            ``[H, W]`` heatmap aligned with the original image.
        """
        rh, rw = self.resize
        top, left, ch, cw = self.crop_box()
        canvas = maps.new_empty((rh, rw)).fill_(fill)
        canvas[top:top + ch, left:left + cw] = maps
        out = F.interpolate(canvas[None, None], size=tuple(size), mode="bilinear",
                            align_corners=False)
        return out[0, 0]

    def as_dict(self) -> dict:
        """JSON-serialisable description (stored with the model)."""
        return {"resize": list(self.resize), "crop": list(self.crop) if self.crop else None,
                "mean": list(self.mean), "std": list(self.std)}
