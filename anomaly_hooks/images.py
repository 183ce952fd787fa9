"""Read any supported image input into one canonical form: float32 RGB ``[3, H, W]`` in [0, 1].

Accepted: a path (str / Path), a PIL image, a numpy array (``HxW`` or ``HxWxC`` with C in 1, 3, 4;
uint8, uint16 or float in [0, 1]) or a torch tensor ``[C, H, W]`` (uint8 or float in [0, 1]).
Grayscale, palette, RGBA, CMYK and 16-bit images become RGB; EXIF orientation is applied.
The same picture gives the same tensor whatever form it came in.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from PIL import Image, ImageOps

ImageInput = Union[str, os.PathLike, Image.Image, np.ndarray, torch.Tensor]

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".pgm",
                  ".ppm", ".pbm"}
DEFAULT_MAX_PIXELS = 100_000_000


class ImageReadError(ValueError):
    """An image could not be read; the message names the file and the reason."""


def _check_pixels(width: int, height: int, max_pixels: int, label: str) -> None:
    if width < 1 or height < 1:
        raise ImageReadError(f"{label}: empty image ({width}x{height})")
    if width * height > max_pixels:
        raise ImageReadError(
            f"{label}: {width}x{height} = {width * height:,} pixels exceeds the limit of "
            f"{max_pixels:,} (decompression-bomb guard); raise data.max_pixels if it is genuine"
        )


def _open_path(path: Path, max_pixels: int) -> Image.Image:
    if path.is_dir():
        raise ImageReadError(f"{path}: is a directory, not an image file")
    if not path.exists():
        raise ImageReadError(f"{path}: file not found")
    if path.stat().st_size == 0:
        raise ImageReadError(f"{path}: empty file (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(path)
            _check_pixels(*img.size, max_pixels, str(path))
            img.load()
    except ImageReadError:
        raise
    except Image.DecompressionBombError as exc:  # Pillow's own guard, before data.max_pixels
        raise ImageReadError(f"{path}: too many pixels (decompression-bomb guard: {exc}); if "
                             "it is genuine, raise data.max_pixels and Pillow's limit "
                             "PIL.Image.MAX_IMAGE_PIXELS") from None
    except Exception as exc:  # PIL raises many types for broken files
        reason = str(exc) or type(exc).__name__
        raise ImageReadError(f"{path}: not a readable image ({reason})") from None
    return img


def _pil_to_array(img: Image.Image) -> np.ndarray:
    """HxWx3 array (uint8, or float32 in [0, 1] for 16/32-bit images)."""
    try:
        img = ImageOps.exif_transpose(img) if img.getexif() else img
    except Exception:  # a broken EXIF block: the pixels are fine, keep them as stored
        pass
    if getattr(img, "is_animated", False):
        img.seek(0)
    mode = img.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        arr = np.asarray(img, dtype=np.float32)
        scale = 65535.0 if mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        arr = np.clip(arr / scale, 0.0, 1.0)
        return np.repeat(arr[:, :, None], 3, axis=2)
    if mode == "F":
        arr = np.clip(np.asarray(img, dtype=np.float32), 0.0, 1.0)
        return np.repeat(arr[:, :, None], 3, axis=2)
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode != "RGB":
        img = img.convert("RGB")
    return np.asarray(img)


def _array_to_tensor(arr: np.ndarray, label: str) -> torch.Tensor:
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3 or arr.shape[2] not in (1, 3, 4):
        raise ImageReadError(f"{label}: array of shape {arr.shape} is not HxW or HxWxC (C=1,3,4)")
    if arr.shape[2] == 4:
        arr = arr[:, :, :3]
    if arr.shape[2] == 1:
        arr = np.repeat(arr, 3, axis=2)
    if not arr.dtype.isnative:  # e.g. big-endian uint16 from np.frombuffer(..., ">u2")
        arr = arr.astype(arr.dtype.newbyteorder("="))
    arr = np.ascontiguousarray(arr)
    if not arr.flags.writeable:
        arr = arr.copy()
    try:
        tensor = torch.from_numpy(arr).permute(2, 0, 1)
    except TypeError:  # object, string, ... arrays
        raise ImageReadError(f"{label}: unsupported dtype {arr.dtype}; use uint8, uint16 or "
                             "float") from None
    return _scale(tensor, label)


def _scale(tensor: torch.Tensor, label: str) -> torch.Tensor:
    if tensor.dtype == torch.uint8:
        return tensor.to(torch.float32).div_(255.0)
    if tensor.dtype == torch.uint16 or tensor.dtype == torch.int32:
        out = tensor.to(torch.float32)
        if out.numel() and (out.min() < 0 or out.max() > 65535):
            raise ImageReadError(f"{label}: {tensor.dtype} image values must be in [0, 65535]")
        return out.div_(65535.0)
    if tensor.is_floating_point():
        out = tensor.to(torch.float32)
        if out.numel() and (not torch.isfinite(out).all() or out.min() < 0 or out.max() > 1):
            raise ImageReadError(f"{label}: float image values must be finite and in [0, 1]")
        return out
    raise ImageReadError(f"{label}: unsupported dtype {tensor.dtype}; use uint8, uint16 or float")


def _tensor_input(tensor: torch.Tensor, label: str) -> torch.Tensor:
    tensor = tensor.detach().cpu()
    if tensor.dim() == 2:
        tensor = tensor.unsqueeze(0)
    if tensor.dim() != 3 or tensor.shape[0] not in (1, 3, 4):
        raise ImageReadError(f"{label}: tensor of shape {tuple(tensor.shape)} is not [C, H, W] "
                             "with C in 1, 3, 4")
    if tensor.shape[0] == 4:
        tensor = tensor[:3]
    if tensor.shape[0] == 1:
        tensor = tensor.expand(3, -1, -1)
    return _scale(tensor.contiguous(), label)


def read_image(image: ImageInput, max_pixels: int = DEFAULT_MAX_PIXELS) -> torch.Tensor:
    """Canonical float32 RGB tensor ``[3, H, W]`` in [0, 1] of any supported input.

    Raises:
        ImageReadError: unreadable file, unsupported type/shape/dtype, too many pixels.
    """
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        img = _open_path(path, max_pixels)
        try:
            arr = _pil_to_array(img)
        except Exception as exc:  # a decodable header but unconvertible pixels
            reason = str(exc) or type(exc).__name__
            raise ImageReadError(f"{path}: not a readable image ({reason})") from None
        label = str(path)
    elif isinstance(image, Image.Image):
        label = "PIL image"
        _check_pixels(*image.size, max_pixels, label)
        arr = _pil_to_array(image)
    elif isinstance(image, np.ndarray):
        label = "numpy array"
        arr = image
    elif isinstance(image, torch.Tensor):
        tensor = _tensor_input(image, "tensor")
        _check_pixels(tensor.shape[2], tensor.shape[1], max_pixels, "tensor")
        return tensor
    else:
        raise ImageReadError(
            f"unsupported image input of type {type(image).__name__}: give a path, a PIL image, "
            "a numpy array (HxW or HxWxC) or a [C, H, W] tensor"
        )
    if arr.ndim >= 2:
        _check_pixels(arr.shape[1], arr.shape[0], max_pixels, label)
    if arr.dtype == np.uint16:
        arr = arr.astype(np.int32)
    return _array_to_tensor(arr, label)


def describe(image: Any) -> str:
    """A short name for an input, for messages and result tables."""
    if isinstance(image, (str, os.PathLike)):
        return str(image)
    if isinstance(image, np.ndarray):
        return f"array{tuple(image.shape)}"
    if isinstance(image, torch.Tensor):
        return f"tensor{tuple(image.shape)}"
    if isinstance(image, Image.Image):
        return f"PIL{image.size}"
    return type(image).__name__


def is_image_file(path: Path) -> bool:
    """True for a file whose suffix is a supported image format."""
    return path.suffix.lower() in IMAGE_SUFFIXES
