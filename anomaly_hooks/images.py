"""Read any supported image input into one canonical form: float32 RGB ``[3, H, W]`` in [0, 1].

The decoding itself is torch-free (numpy float32 ``[H, W, 3]``, :func:`decode`), so the ONNX
runtime reads images exactly as the PyTorch path does; :func:`read_image` gives the tensor.

Accepted: a path (str / Path), a PIL image, a numpy array (``HxW`` or ``HxWxC`` with C in 1, 3, 4;
uint8, uint16 or float in [0, 1]) or a torch tensor ``[C, H, W]`` (uint8 or float in [0, 1]).
Grayscale, palette, RGBA, CMYK and 16-bit images become RGB; EXIF orientation is applied.
The same picture gives the same tensor whatever form it came in.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
from PIL import Image, ImageOps

from anomaly_hooks.errors import ImageReadError

if TYPE_CHECKING:  # pragma: no cover
    import torch

ImageInput = Union[str, os.PathLike, Image.Image, np.ndarray, "torch.Tensor"]

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".pgm",
                  ".ppm", ".pbm"}
DEFAULT_MAX_PIXELS = 100_000_000  # decompression-bomb guard (data.max_pixels)


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


def _to_array(tensor: Any, label: str) -> np.ndarray:
    """A torch tensor ``[C, H, W]`` (or ``[H, W]``) -> numpy ``[H, W, C]`` (torch is already
    imported when a tensor exists, so this module never imports it itself)."""
    tensor = tensor.detach().cpu()
    if tensor.dim() == 2:
        tensor = tensor.unsqueeze(0)
    if tensor.dim() != 3 or tensor.shape[0] not in (1, 3, 4):
        raise ImageReadError(f"{label}: tensor of shape {tuple(tensor.shape)} is not [C, H, W] "
                             "with C in 1, 3, 4")
    try:
        return tensor.permute(1, 2, 0).numpy()
    except TypeError:  # bfloat16 and other dtypes numpy lacks
        raise ImageReadError(f"{label}: unsupported dtype {tensor.dtype}; use uint8, uint16 or "
                             "float") from None


def _channels(arr: np.ndarray, label: str) -> np.ndarray:
    """``[H, W]`` or ``[H, W, C]`` (C in 1, 3, 4) -> ``[H, W, 3]`` (alpha dropped, gray repeated)."""
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3 or arr.shape[2] not in (1, 3, 4):
        raise ImageReadError(f"{label}: array of shape {arr.shape} is not HxW or HxWxC (C=1,3,4)")
    if arr.shape[2] == 4:
        arr = arr[:, :, :3]
    if arr.shape[2] == 1:
        arr = np.repeat(arr, 3, axis=2)
    return arr


def _scale(arr: np.ndarray, label: str) -> np.ndarray:
    """Pixel values -> float32 in [0, 1] by dtype: uint8 / 255, uint16 and int32 / 65535,
    float as is (must be finite and in [0, 1])."""
    if arr.dtype == np.uint8:
        return arr.astype(np.float32) / np.float32(255.0)
    if arr.dtype in (np.uint16, np.int32):
        if arr.size and (arr.min() < 0 or arr.max() > 65535):
            raise ImageReadError(f"{label}: {arr.dtype} image values must be in [0, 65535]")
        return arr.astype(np.float32) / np.float32(65535.0)
    if arr.dtype.kind == "f" and arr.dtype.itemsize in (2, 4, 8):
        out = arr.astype(np.float32)
        if out.size and (not np.isfinite(out).all() or out.min() < 0 or out.max() > 1):
            raise ImageReadError(f"{label}: float image values must be finite and in [0, 1]")
        return out
    raise ImageReadError(f"{label}: unsupported dtype {arr.dtype}; use uint8, uint16 or float")


def decode(image: ImageInput, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Canonical float32 RGB array ``[H, W, 3]`` in [0, 1] of any supported input (torch-free:
    the ONNX runtime uses it as it is).

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
    elif type(image).__module__.split(".")[0] == "torch" and hasattr(image, "permute"):
        label = "tensor"
        arr = _to_array(image, label)
    else:
        raise ImageReadError(
            f"unsupported image input of type {type(image).__name__}: give a path, a PIL image, "
            "a numpy array (HxW or HxWxC) or a [C, H, W] tensor"
        )
    arr = _channels(arr, label)
    _check_pixels(arr.shape[1], arr.shape[0], max_pixels, label)
    if not arr.dtype.isnative:  # e.g. big-endian uint16 from np.frombuffer(..., ">u2")
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return _scale(arr, label)


def read_image(image: ImageInput, max_pixels: int = DEFAULT_MAX_PIXELS) -> "torch.Tensor":
    """Canonical float32 RGB tensor ``[3, H, W]`` in [0, 1] of any supported input (a view of
    :func:`decode`'s ``[H, W, 3]`` array).

    Raises:
        ImageReadError: unreadable file, unsupported type/shape/dtype, too many pixels.
    """
    import torch

    return torch.from_numpy(np.ascontiguousarray(decode(image, max_pixels))).permute(2, 0, 1)


def describe(image: Any) -> str:
    """A short name for an input, for messages and result tables."""
    if isinstance(image, (str, os.PathLike)):
        return str(image)
    if isinstance(image, np.ndarray):
        return f"array{tuple(image.shape)}"
    if type(image).__module__.split(".")[0] == "torch":
        return f"tensor{tuple(image.shape)}"
    if isinstance(image, Image.Image):
        return f"PIL{image.size}"
    return type(image).__name__


def is_image_file(path: Path) -> bool:
    """True for a file whose suffix is a supported image format."""
    return path.suffix.lower() in IMAGE_SUFFIXES
