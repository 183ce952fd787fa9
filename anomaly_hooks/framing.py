"""Where the network input comes from in an image (torch-free): resize, centre crop and the
normalisation constants, shared by the PyTorch :class:`~anomaly_hooks.preprocess.Preprocessor`
and the edge runtime's numpy twin (``runtime.preprocess``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MAX_SIDE = 8192  # a resize or crop side: beyond it no backbone fits in memory


@dataclass(frozen=True)
class Framing:
    """Resize to ``resize`` (H, W), then centre crop to ``crop`` (H, W) or not at all; the
    normalisation ``mean`` / ``std`` per RGB channel."""

    resize: Tuple[int, int] = (256, 256)
    crop: Optional[Tuple[int, int]] = (224, 224)
    mean: Tuple[float, float, float] = IMAGENET_MEAN
    std: Tuple[float, float, float] = IMAGENET_STD

    @property
    def input_size(self) -> Tuple[int, int]:
        """(H, W) of the network input."""
        return tuple(self.crop) if self.crop is not None else tuple(self.resize)

    @property
    def min_source_size(self) -> Tuple[int, int]:
        """(H, W) that a huge image may be reduced to before preprocessing without changing
        what the network sees much: twice the resize, so the antialiased resize still averages
        at least 2 x 2 source pixels per output pixel (``images.decode_reduced``)."""
        return 2 * self.resize[0], 2 * self.resize[1]

    def crop_box(self) -> Tuple[int, int, int, int]:
        """(top, left, height, width) of the crop inside the resized image (torchvision rule)."""
        rh, rw = self.resize
        ch, cw = self.input_size
        return int(round((rh - ch) / 2.0)), int(round((rw - cw) / 2.0)), ch, cw
