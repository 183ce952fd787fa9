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
    normalisation ``mean`` / ``std`` per RGB channel. With ``frame`` (a tiled model's working
    :class:`Frame`), its crop, resize and padding instead (``resize`` records its content box).
    Shared by the PyTorch and the numpy preprocessing."""

    resize: Tuple[int, int] = (256, 256)
    crop: Optional[Tuple[int, int]] = (224, 224)
    mean: Tuple[float, float, float] = IMAGENET_MEAN
    std: Tuple[float, float, float] = IMAGENET_STD
    frame: Optional["Frame"] = None

    @property
    def input_size(self) -> Tuple[int, int]:
        """(H, W) of the network input (a tiled model's: its frame)."""
        if self.frame is not None:
            return tuple(self.frame.size)  # type: ignore[return-value]
        return tuple(self.crop) if self.crop is not None else tuple(self.resize)

    @property
    def min_source_size(self) -> Tuple[int, int]:
        """(H, W) that a huge image may be reduced to before preprocessing without changing
        what the network sees much: twice what the network sees of it (the resize, or the
        frame's content box), so the antialiased resize still averages at least 2 x 2 source
        pixels per output pixel (``images.decode_reduced``)."""
        h, w = self.frame.content if self.frame is not None else self.resize
        return 2 * h, 2 * w

    def crop_box(self) -> Tuple[int, int, int, int]:
        """(top, left, height, width) of the crop inside the resized image (torchvision rule)."""
        rh, rw = self.resize
        ch, cw = self.input_size
        return int(round((rh - ch) / 2.0)), int(round((rw - cw) / 2.0)), ch, cw


def uninspected_fraction(framing: Framing) -> float:
    """The fraction of every image's area that a stretch-and-crop framing never looks at
    (the centre crop's cut-off border): ``1 - crop area / resize area``; 0 without a crop."""
    if framing.crop is None:
        return 0.0
    (rh, rw), (ch, cw) = framing.resize, framing.input_size
    return 1.0 - (ch * cw) / float(rh * rw)


ASPECTS = ("keep", "stretch")  # a working frame's rule for an image of another aspect


@dataclass(frozen=True)
class Frame:
    """The working frame of a high-resolution (tiled) model: where an image of any size lands
    in the fixed network input, and the way back (torch-free: shared with the runtime).

    An image of (H, W) pixels is first centre-cropped to ``crop`` (the fractions of its height
    and width kept; None = the whole image), then resized *keeping its aspect* to fit in
    ``content`` (h, w) network pixels, and placed at the top-left of the network input of
    ``size`` (h, w) >= ``content`` (``size`` is ``content`` rounded up to the tiles' stride);
    the rest is padding (zeros after normalisation: the mean colour). An image of the aspect
    of ``content`` fills it exactly (a side within one pixel of the box's is snapped to it);
    any other is letterboxed inside it. With ``aspect="stretch"`` every image fills ``content``
    whatever its aspect (the default framing's rule, at the working scale): parts of one kind
    imaged at varying sizes then land on the same positions, which PaDiM's Gaussian per
    position of the frame needs.

    The model scores the ``content`` box; :meth:`placement` is where one image's pixels are,
    and the heatmap's way back (``Preprocessor.to_original``) reads exactly that part.
    """

    content: Tuple[int, int]
    size: Tuple[int, int]
    crop: Optional[Tuple[float, float]] = None
    aspect: str = "keep"  # "keep": letterbox an image of another aspect; "stretch": fill

    def __post_init__(self) -> None:
        if not (0 < self.content[0] <= self.size[0] and 0 < self.content[1] <= self.size[1]):
            raise ValueError(f"frame content {self.content} must fit in its size {self.size}")
        if self.crop is not None and not all(0.0 < f <= 1.0 for f in self.crop):
            raise ValueError(f"crop fractions {self.crop} must lie in (0, 1]")
        if self.aspect not in ASPECTS:
            raise ValueError(f"frame aspect {self.aspect!r} must be one of {ASPECTS}")

    def source_box(self, image_size: Tuple[int, int]) -> Tuple[int, int, int, int]:
        """(top, left, height, width) of the inspected part of an image of ``image_size``
        (H, W): the centre crop (the whole image without one)."""
        height, width = int(image_size[0]), int(image_size[1])
        if self.crop is None:
            return 0, 0, height, width
        ch = max(1, min(height, int(round(height * self.crop[0]))))
        cw = max(1, min(width, int(round(width * self.crop[1]))))
        return int(round((height - ch) / 2.0)), int(round((width - cw) / 2.0)), ch, cw

    def placement(self, image_size: Tuple[int, int]) -> Tuple[int, int]:
        """(h, w) network pixels the inspected part of an image of ``image_size`` (H, W) is
        resized to, at the top-left of the frame: the largest aspect-keeping fit in
        ``content`` (sides within one pixel of the box's snapped to it); ``content`` itself
        when the frame stretches."""
        _, _, sh, sw = self.source_box(image_size)
        bh, bw = self.content
        if self.aspect == "stretch":
            return bh, bw
        scale = min(bh / sh, bw / sw)
        h = min(bh, max(1, int(round(sh * scale))))
        w = min(bw, max(1, int(round(sw * scale))))
        if bh - h <= 1 and bw - w <= 1:  # the model's own aspect, up to rounding
            return bh, bw
        return h, w

    @property
    def uninspected_fraction(self) -> float:
        """The fraction of every image's area the crop cuts off (0 without one)."""
        return 0.0 if self.crop is None else 1.0 - self.crop[0] * self.crop[1]

    def as_dict(self) -> dict:
        """JSON-serialisable description (stored with the model)."""
        return {"content": list(self.content), "size": list(self.size),
                "crop": list(self.crop) if self.crop is not None else None,
                "aspect": self.aspect}

    @classmethod
    def from_dict(cls, d: dict) -> "Frame":
        """From :meth:`as_dict`."""
        crop = d.get("crop")
        return cls(tuple(int(v) for v in d["content"]),  # type: ignore[arg-type]
                   tuple(int(v) for v in d["size"]),  # type: ignore[arg-type]
                   tuple(float(v) for v in crop) if crop is not None else None,  # type: ignore
                str(d.get("aspect", "keep")))
