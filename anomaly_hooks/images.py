"""Read any supported image input into one canonical form: float32 RGB ``[3, H, W]`` in [0, 1].

The decoding itself is torch-free (numpy float32 ``[H, W, 3]``, :func:`decode`), so the ONNX
runtime reads images exactly as the PyTorch path does; :func:`read_image` gives the tensor.

Accepted: a path (str / Path), the bytes of an image file (an upload: checked exactly as a
file is), a PIL image, a numpy array (``HxW`` or ``HxWxC`` with C in 1, 3, 4;
uint8, uint16 / int32 holding 16-bit values, or float in [0, 1]) or a torch tensor ``[C, H, W]``
(same dtypes). Grayscale, palette, RGBA, CMYK and 16-bit images become RGB; EXIF orientation is
applied. The same picture gives the same tensor whatever form it came in: pixel values are scaled
by their type's bit depth, never by their content, and the same range rules apply to files and
arrays (a float image must hold values in [0, 1], whether a float TIFF or a float array).

Hostile files: only regular files are opened (a FIFO, device or socket is refused without being
read, so nothing blocks), only the formats of :data:`IMAGE_SUFFIXES` are decoded (no EPS and
other plugins that run programs or rarely-used decoders), pixel counts are checked from the
header before decoding (``max_pixels``), and JPEG entropy data is checked strictly (libjpeg's
"premature end of data" / "corrupt data" warnings, which Pillow ignores, are errors). An 8-bit
RGB or grey JPEG read at full resolution is decoded by that strict libjpeg-turbo pass itself
(the pixels Pillow's decoder gives; decoding and preprocessing a third cheaper than checking,
then decoding with Pillow: ``benchmarks/bench_decode.py``).

Memory: :func:`decode_reduced` decodes an image of more than :data:`FULL_DECODE_PIXELS` pixels
at a reduced scale (JPEG: libjpeg's DCT scaling through Pillow's draft mode; other formats and
arrays: a block mean over row bands) that still keeps it at least the given size, so that one
huge image costs about its decoded 8-bit form, not several float32 copies.
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import re
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

import numpy as np
from PIL import Image

from anomaly_hooks.errors import ImageReadError, ImageTooLargeError
from anomaly_hooks.files import file_kind

if TYPE_CHECKING:  # pragma: no cover
    import torch

ImageInput = Union[str, os.PathLike, bytes, Image.Image, np.ndarray, "torch.Tensor"]
# the bytes of an image file (an upload) are one image, not a sequence of numbers
BYTES_TYPES = (bytes, bytearray, memoryview)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".pgm",
                  ".ppm", ".pbm"}
# The Pillow decoders a file may reach (whatever its suffix says): those of IMAGE_SUFFIXES
# (JPEG includes multi-picture MPO files).
PIL_FORMATS = ("PNG", "JPEG", "BMP", "TIFF", "WEBP", "GIF", "PPM")
DEFAULT_MAX_PIXELS = 100_000_000  # decompression-bomb guard (data.max_pixels)
# Images up to this many pixels are decoded at full resolution; larger ones
# at a reduced scale by decode_reduced (4096 x 4096, a 16.8 MP camera frame, is still full).
FULL_DECODE_PIXELS = 4096 * 4096
_BAND_BYTES = 32 << 20  # float32 working set of one band of a reduced decode
_FULL_SCALE_16 = 65535.0  # 16-bit data (uint16, or int32 / Pillow mode "I" holding it)
# A JPEG holds well under 4 bytes per pixel even at quality 100 (cameras: 0.2-1); metadata
# (EXIF, ICC, thumbnails) is bounded by its 64 KB segments times a few hundred.
_JPEG_BYTES_PER_PIXEL = 4
_JPEG_METADATA_BYTES = 16 << 20

# libjpeg warnings about metadata only (the pixels are intact): not a reason to refuse a file.
_BENIGN_JPEG_WARNINGS = ("bad ICC marker", "unknown JFIF revision", "Unknown Adobe color",
                         "extraneous bytes before marker 0xd9")
# libjpeg warnings about the entropy-coded data: parts of the picture are made up.
_CORRUPT_JPEG_WARNINGS = ("Corrupt JPEG data", "Premature end", "Inconsistent progression",
                          "Invalid SOS parameters", "too many scanlines")
# EXIF orientation -> the transpose that shows the picture upright (as ImageOps.exif_transpose)
_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
              4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
              6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}

_CALLER_PIL_LOCK = threading.Lock()
DECODE_THREADS = 8  # the most threads decode_threads() gives by default
DECODE_BUDGET_PIXELS = 2 * FULL_DECODE_PIXELS  # pixels one load_all call decodes at once (~0.5 GB)
T = TypeVar("T")


def decode_threads(requested: Optional[int] = None) -> int:
    """Threads that decode one batch of images where no count is configured (the ONNX
    runtime's ``decode_threads``): ``requested``, or (None) the CPUs this process may run on,
    at most :data:`DECODE_THREADS`."""
    if requested is not None:
        return max(1, requested)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(DECODE_THREADS, cpus))


class PixelBudget:
    """Pixels being decoded at once by the threads of one :func:`load_all` call: a decode
    reserves its image's pixels (as decoded: after a reduced JPEG decode's scaling) before
    the pixel data is read and holds them until its item is done (preprocessed too), so a
    batch of huge images decodes about as one thread would, and small ones all at once. A
    request above the whole budget waits until nothing else is held, then runs alone."""

    def __init__(self, total: int = DECODE_BUDGET_PIXELS) -> None:
        self.total = total
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, pixels: int, wait: bool = True) -> int:
        """Reserve ``pixels`` (at most the whole budget); returns what was reserved.
        ``wait=False``: at once, even beyond the budget (a thread already holding some
        never waits for more: no thread holds while it waits)."""
        want = max(0, min(pixels, self.total))
        with self._cond:
            while wait and self.used and self.used + want > self.total:
                self._cond.wait()
            self.used += want
        return want

    def release(self, pixels: int) -> None:
        with self._cond:
            self.used -= pixels
            self._cond.notify_all()

    def run(self, load: Callable[[Any], T], item: Any) -> T:
        """``load(item)`` on this thread, its decodes reserving pixels of this budget (held
        until it returns)."""
        _held.budget, _held.pixels = self, 0
        try:
            return load(item)
        finally:
            self.release(_held.pixels)
            _held.budget = None


_held = threading.local()  # this thread's PixelBudget and what it holds of it, in load_all


def _reserve(pixels: int) -> None:
    """Reserve ``pixels`` of this thread's :class:`PixelBudget` before decoding them (nothing
    outside :func:`load_all`'s threads)."""
    budget = getattr(_held, "budget", None)
    if budget is not None:
        _held.pixels += budget.acquire(pixels, wait=not _held.pixels)


@contextlib.contextmanager
def decode_pool(threads: int, budget_pixels: int = DECODE_BUDGET_PIXELS
                ) -> Iterator[Callable[[Callable[[Any], T], Any], "Future[T]"]]:
    """``threads`` decoding threads whose tasks share one :class:`PixelBudget` of
    ``budget_pixels``: yields ``submit(load, item)`` (a future of ``load(item)``). On leaving,
    the tasks not started are cancelled and the running ones awaited."""
    budget = PixelBudget(budget_pixels)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="anomaly-hooks-decode")
    try:
        yield lambda load, item: pool.submit(budget.run, load, item)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def load_all(load: Callable[[Any], T], items: Sequence[Any], threads: int,
             budget_pixels: int = DECODE_BUDGET_PIXELS) -> List[T]:
    """``[load(item) for item in items]``, in input order, on up to ``threads`` threads.

    Pillow's decoders and resizes release the GIL, so a batch of JPEGs decodes on several
    cores (visa_macaroni1's 1500 x 1000 images: 9.5 ms each on one thread, 6.9 ms on two
    of 2 cores). At most ``threads`` items are in flight at once, and the images they decode
    (:func:`decode` and the functions built on it) hold at most ``budget_pixels`` between
    them (:class:`PixelBudget`). The first item that fails, in input order, raises its
    error; the items not started yet are not read."""
    n = min(threads, len(items))
    if n <= 1:
        return [load(item) for item in items]
    with decode_pool(n, budget_pixels) as submit:
        futures = [submit(load, item) for item in items]
        return [future.result() for future in futures]


def display(path: Any) -> str:
    """A path for messages and tables: control characters (a newline in a file name) and
    undecodable bytes escaped, so one name can never forge another line or break an encoder."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        text = "".join(c if 32 <= ord(c) != 127 else f"\\x{ord(c):02x}" for c in text)
    return text


def _check_pixels(width: int, height: int, max_pixels: int, label: str) -> None:
    if width < 1 or height < 1:
        raise ImageReadError(f"{label}: empty image ({width}x{height})")
    if width * height > max_pixels:
        raise ImageTooLargeError(
            f"{label}: {width}x{height} = {width * height:,} pixels exceeds the limit of "
            f"{max_pixels:,} (decompression-bomb guard); raise data.max_pixels if it is genuine"
        )


def _refuse_kind(kind: str, label: str) -> ImageReadError:
    if kind == "a folder":
        return ImageReadError(f"{label}: is a folder, not an image file")
    return ImageReadError(f"{label}: not a regular file ({kind}); only image files are read")


def _open_fd(path: Path, label: str) -> int:
    """A read-only descriptor of a regular, non-empty file; anything else is refused before a
    byte is read (``O_NONBLOCK``: opening a FIFO never waits for a writer)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        kind = file_kind(os.stat(path).st_mode)
        fd = os.open(path, flags) if kind is None else -1  # a socket cannot even be opened
    except FileNotFoundError:
        raise ImageReadError(f"{label}: file not found") from None
    except (OSError, ValueError) as exc:  # permission, name too long, a NUL in the name
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ImageReadError(f"{label}: cannot open ({reason})") from None
    if kind is not None:
        raise _refuse_kind(kind, label)
    st = os.fstat(fd)  # the file opened, not what the name pointed to a moment ago
    kind = file_kind(st.st_mode)
    if kind is not None or st.st_size == 0:
        os.close(fd)
        raise _refuse_kind(kind, label) if kind else ImageReadError(
            f"{label}: empty file (0 bytes)")
    return fd


def _check_jpeg_size(size: int, pixels: int, label: str) -> None:
    """A file far larger than any JPEG of its pixel count is refused unread."""
    limit = _JPEG_BYTES_PER_PIXEL * pixels + _JPEG_METADATA_BYTES
    if size > limit:
        raise ImageReadError(f"{label}: {size:,} bytes is more than a JPEG of {pixels:,} pixels "
                             f"can hold ({limit:,}): not a plain JPEG file")


def _read_jpeg(fd: int, size: int, pixels: int, label: str) -> bytes:
    """The whole file, read once (Pillow then decodes these very bytes: what was checked is
    what is decoded)."""
    _check_jpeg_size(size, pixels, label)
    parts, pos = [], 0
    while pos < size:
        part = os.pread(fd, min(size - pos, 64 << 20), pos)
        if not part:
            break
        parts.append(part)
        pos += len(part)
    return b"".join(parts)


def _check_jpeg(data: bytes, label: str) -> None:
    """Decode the JPEG's entropy data strictly at 1/8 scale (cheap: the Huffman decoding of the
    whole file, 1/64 of the pixels): libjpeg's corrupt-data warnings, which Pillow swallows
    (a truncated file with an end marker decodes as grey), become an :class:`ImageReadError`."""
    import simplejpeg

    try:
        space = simplejpeg.decode_jpeg_header(data, strict=False)[2]
        colorspace = {"Gray": "GRAY", "CMYK": "CMYK", "YCCK": "CMYK"}.get(space, "RGB")
        simplejpeg.decode_jpeg(data, colorspace=colorspace, min_factor=8, strict=True)
    except ValueError as exc:
        _refuse_if_corrupt(str(exc), label)
        # anything else (an unsupported JPEG process, a metadata warning): Pillow decides


def _refuse_if_corrupt(msg: str, label: str) -> None:
    """A libjpeg warning about the entropy-coded data (parts of the picture made up) becomes
    an :class:`ImageReadError`; any other message is left to the caller."""
    if (any(s in msg for s in _CORRUPT_JPEG_WARNINGS)
            and not any(s in msg for s in _BENIGN_JPEG_WARNINGS)):
        raise ImageReadError(f"{label}: corrupt JPEG data ({msg}); the file is damaged or was "
                             "cut short") from None


def _decode_jpeg_strict(data: bytes, mode: str, label: str) -> Optional[np.ndarray]:
    """An 8-bit RGB or grey JPEG's full-resolution pixels (uint8 ``[H, W, 3]`` or ``[H, W]``,
    as Pillow decodes them) in one strict libjpeg-turbo pass, which is also
    :func:`_check_jpeg`'s check (instead of that check and then Pillow's decoder: decoding and
    preprocessing visa_macaroni1's 1500 x 1000 images a third cheaper,
    ``benchmarks/bench_decode.py``). None where libjpeg warned of something other than
    corrupt data (Pillow then decodes it, after the check)."""
    import simplejpeg

    try:
        arr = simplejpeg.decode_jpeg(data, colorspace="GRAY" if mode == "L" else "RGB",
                                     strict=True)
    except ValueError as exc:
        _refuse_if_corrupt(str(exc), label)
        return None
    return arr[:, :, 0] if mode == "L" else arr


def _orientation(img: Image.Image) -> int:
    """The EXIF orientation (1-8; 1 for none or a broken EXIF block: the pixels are fine)."""
    try:
        value = int(img.getexif().get(0x0112, 1))
    except Exception:  # noqa: BLE001 (Pillow's EXIF parser raises many types on damaged tags)
        return 1
    return value if 1 <= value <= 8 else 1


def _orient(arr: np.ndarray, orientation: int) -> np.ndarray:
    """Apply an EXIF orientation to an ``[H, W, ...]`` array (pure permutations of pixels: the
    same values as Pillow's ``exif_transpose``)."""
    if orientation in (5, 6, 7, 8):
        arr = np.swapaxes(arr, 0, 1)  # transpose, then the flips below complete the rotation
    flips = {2: (1,), 3: (0, 1), 4: (0,), 5: (), 6: (1,), 7: (0, 1), 8: (0,)}.get(orientation, ())
    for axis in flips:
        arr = np.flip(arr, axis)
    return arr


def _pil_to_array(img: Image.Image) -> np.ndarray:
    """Pixels of a PIL image as ``[H, W]`` or ``[H, W, 3]``: uint8 for 8-bit images, the
    stored integer type for 16-bit (uint16) and mode "I" (int32) images, float32 for mode "F";
    scaled by :func:`_scale` like any array."""
    mode = img.mode
    if mode.startswith("I;16") and mode[4:] in ("", "B", "L", "N"):
        return np.asarray(img)  # uint16 (big-endian for I;16B; made native by decode)
    if mode in ("I", "F", "L", "RGB"):
        return np.asarray(img)
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    return np.asarray(img.convert("RGB"))


def _check_int_depth(img: Image.Image, label: str) -> None:
    """Mode "I" holds 16-bit data (16-bit PGM/PNG/TIFF); a 32-bit integer TIFF has no 16-bit
    scale, and scaling it by its content would make the result depend on the picture."""
    if img.mode == "I" and img.format == "TIFF":
        bits = getattr(img, "tag_v2", {}).get(258, (16,))
        if max(bits if isinstance(bits, tuple) else (bits,)) > 16:
            raise ImageReadError(f"{label}: 32-bit integer TIFF images are not supported: "
                                 "save it as 8- or 16-bit, or as float in [0, 1]")


def _scale(arr: np.ndarray, label: str) -> np.ndarray:
    """Pixel values -> float32 in [0, 1] by dtype (never by content): uint8 / 255; uint16 and
    int32 (16-bit data, as Pillow's mode "I") / 65535, values outside [0, 65535] refused;
    float as is, values must be finite and in [0, 1]."""
    if arr.dtype == np.uint8:
        return arr.astype(np.float32) / np.float32(255.0)
    if arr.dtype in (np.uint16, np.int32):
        if arr.size and (arr.min() < 0 or arr.max() > 65535):
            raise ImageReadError(f"{label}: {arr.dtype} image values must be in [0, 65535] "
                                 "(16-bit data)")
        return arr.astype(np.float32) / np.float32(_FULL_SCALE_16)
    if arr.dtype.kind == "f" and arr.dtype.itemsize in (2, 4, 8):
        out = arr.astype(np.float32)
        if out.size and (not np.isfinite(out).all() or out.min() < 0 or out.max() > 1):
            raise ImageReadError(f"{label}: float image values must be finite and in [0, 1] "
                                 "(divide 8-bit data by 255, 16-bit data by 65535)")
        return out
    raise ImageReadError(f"{label}: unsupported dtype {arr.dtype}; use uint8, uint16 or float")


def _channels(arr: np.ndarray, label: str) -> np.ndarray:
    """``[H, W]`` or ``[H, W, C]`` (C in 1, 3, 4) -> ``[H, W, 3]`` (alpha dropped, gray
    repeated)."""
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
    return arr


def _canonical(arr: np.ndarray, label: str) -> np.ndarray:
    """Any accepted array -> float32 ``[H, W, 3]`` in [0, 1]."""
    return _scale(_channels(arr, label), label)


def _factor(size: Tuple[int, int], min_size: Optional[Tuple[int, int]]) -> int:
    """The integer reduction that keeps ``size`` (H, W) at least ``min_size``; 1 for images of
    at most :data:`FULL_DECODE_PIXELS` pixels (decoded at full resolution)."""
    if min_size is None or size[0] * size[1] <= FULL_DECODE_PIXELS:
        return 1
    return max(1, min(size[0] // max(1, min_size[0]), size[1] // max(1, min_size[1])))


def _block_mean(rows: Callable[[int, int], np.ndarray], height: int, width: int, k: int,
                label: str) -> np.ndarray:
    """float32 ``[height // k, width // k, 3]``: the mean of each k x k block of the image whose
    rows ``rows(y0, y1)`` gives (any accepted array form), converted one band of rows at a time
    so that no full-size float copy exists."""
    oh, ow = height // k, width // k
    out = np.empty((oh, ow, 3), np.float32)
    step = max(1, _BAND_BYTES // (12 * width * k)) * k  # rows per band, a multiple of k
    for y0 in range(0, oh * k, step):
        y1 = min(y0 + step, oh * k)
        band = _canonical(rows(y0, y1), label)[:, :ow * k]
        out[y0 // k:y1 // k] = band.reshape((y1 - y0) // k, k, ow, k, 3).mean(axis=(1, 3))
    return out


def _decode_pil(img: Image.Image, label: str, max_pixels: int,
                min_size: Optional[Tuple[int, int]], own: bool = True,
                jpeg: Optional[bytes] = None) -> Tuple[np.ndarray, Tuple[int, int]]:
    """A PIL image (possibly not loaded yet) -> (float32 ``[h, w, 3]``, original (H, W)).
    ``own``: the image was opened here, so its JPEG decoding may be drafted (a caller's image
    object is never changed that way). ``jpeg``: the bytes of a JPEG opened here, not checked
    yet: an 8-bit RGB or grey one decoded at full resolution is decoded and checked in one
    strict pass (:func:`_decode_jpeg_strict`), any other checked (:func:`_check_jpeg`) before
    Pillow decodes it."""
    if getattr(img, "is_animated", False):
        img.seek(0)
    orientation = _orientation(img)
    width, height = img.size
    if orientation >= 5:
        width, height = height, width
    _check_pixels(width, height, max_pixels, label)
    k = _factor((height, width), min_size)
    reserved = False
    if jpeg is not None:
        if k == 1 and img.format == "JPEG" and img.mode in ("RGB", "L"):
            _reserve(img.size[0] * img.size[1])  # the pixels the decode writes
            reserved = True
            pixels = _decode_jpeg_strict(jpeg, img.mode, label)
            if pixels is not None:
                arr = _orient(_canonical(pixels, label), orientation)
                return np.ascontiguousarray(arr), (height, width)
        _check_jpeg(jpeg, label)
    drafted = k > 1 and own and img.format in ("JPEG", "MPO") and getattr(img, "tile", None)
    if drafted:
        # libjpeg scales by 1/2, 1/4 or 1/8 while decoding (at most k): never the full image
        img.draft(None, (math.ceil(img.size[0] / k), math.ceil(img.size[1] / k)))
    if not reserved:
        _reserve(img.size[0] * img.size[1])  # the pixels the load reads (after the draft's scaling)
    img.load()
    if drafted:
        h1, w1 = img.size[::-1] if orientation < 5 else img.size
        k = max(1, min(h1 // min_size[0], w1 // min_size[1]))  # type: ignore[index]
    _check_int_depth(img, label)
    if k > 1:
        w, h = img.size
        arr = _block_mean(lambda y0, y1: _pil_to_array(img.crop((0, y0, w, y1))), h, w, k,
                          label)
    else:
        arr = _canonical(_pil_to_array(img), label)
    return np.ascontiguousarray(_orient(arr, orientation)), (height, width)


@contextlib.contextmanager
def _pil_errors(label: str) -> Iterator[None]:
    """Every failure of Pillow inside the block becomes an :class:`ImageReadError` naming the
    input (Pillow raises many types for broken files)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    except ImageReadError:
        raise
    except Image.DecompressionBombError as exc:  # Pillow's own guard, before ours
        raise ImageTooLargeError(f"{label}: too many pixels (decompression-bomb guard: {exc}); "
                                 "if it is genuine, raise data.max_pixels and Pillow's limit "
                                 "PIL.Image.MAX_IMAGE_PIXELS") from None
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 (Pillow's decoders raise many types on damaged data)
        # Pillow names its stream ("<_io.BytesIO object at 0x...>"): noise in a message
        reason = re.sub(r"\s*<_io\.\w+[^>]*>", "", str(exc)) or type(exc).__name__
        raise ImageReadError(f"{label}: not a readable image ({reason})") from None


def _open_checked(fh: Any, read_jpeg: Callable[[int], bytes], label: str, max_pixels: int,
                  check: bool = True) -> Tuple[Image.Image, Optional[bytes]]:
    """The PIL image (not decoded yet) of an open file or buffer ``fh``, limited to
    :data:`PIL_FORMATS`, and a JPEG's bytes (None for other formats). A JPEG is read whole
    (``read_jpeg(pixels)``) and checked strictly first (``check``; else the caller decodes or
    checks these bytes, :func:`_decode_pil`), and Pillow decodes the very bytes read."""
    img = Image.open(fh, formats=PIL_FORMATS)
    if img.format not in ("JPEG", "MPO"):
        return img, None
    _check_pixels(*img.size, max_pixels, label)  # before reading it all
    data = read_jpeg(img.size[0] * img.size[1])
    if check:
        _check_jpeg(data, label)
    return Image.open(io.BytesIO(data), formats=PIL_FORMATS), data


@contextlib.contextmanager
def _opened(path: Path, max_pixels: int, check: bool = True
            ) -> Iterator[Tuple[Image.Image, str, Optional[bytes]]]:
    """The file's PIL image (not decoded yet), its label and a JPEG's bytes (checked unless
    ``check`` is False: :func:`_open_checked`); every failure inside the block becomes an
    :class:`ImageReadError` naming the file."""
    label = display(path)
    fd = _open_fd(path, label)
    with os.fdopen(fd, "rb") as fh, _pil_errors(label):
        size = os.fstat(fd).st_size
        img, data = _open_checked(fh, lambda pixels: _read_jpeg(fd, size, pixels, label), label,
                                  max_pixels, check)
        yield img, label, data


def _decode_bytes(data: bytes, max_pixels: int, min_size: Optional[Tuple[int, int]]
                  ) -> Tuple[np.ndarray, Tuple[int, int]]:
    """The bytes of an image file (an upload), checked and decoded exactly as a file is."""
    label = "image data"
    if not data:
        raise ImageReadError(f"{label}: empty (0 bytes)")

    def whole(pixels: int) -> bytes:
        _check_jpeg_size(len(data), pixels, label)
        return data

    with _pil_errors(label):
        img, jpeg = _open_checked(io.BytesIO(data), whole, label, max_pixels, check=False)
        return _decode_pil(img, label, max_pixels, min_size, jpeg=jpeg)


def _decode_path(path: Path, max_pixels: int, min_size: Optional[Tuple[int, int]]
                 ) -> Tuple[np.ndarray, Tuple[int, int]]:
    with _opened(path, max_pixels, check=False) as (img, label, jpeg):
        return _decode_pil(img, label, max_pixels, min_size, jpeg=jpeg)


def load_oriented(path: Union[str, os.PathLike], max_pixels: int = DEFAULT_MAX_PIXELS
                  ) -> Image.Image:
    """The file's first frame as a decoded PIL image at full resolution, EXIF-oriented, checked
    as :func:`decode` checks it; :func:`canonical_rows` converts it a band at a time (for
    pictures of huge images without a full float copy).

    Raises:
        ImageReadError: as :func:`decode`.
    """
    with _opened(Path(path), max_pixels) as (img, label, _):
        if getattr(img, "is_animated", False):
            img.seek(0)
        _check_pixels(*img.size, max_pixels, label)
        img.load()
        _check_int_depth(img, label)
        orientation = _orientation(img)
        if orientation != 1:
            img = img.transpose(_TRANSPOSE[orientation])
        return img


def canonical_rows(img: Image.Image, top: int, bottom: int) -> np.ndarray:
    """Rows ``top:bottom`` of a PIL image as :func:`decode` gives them (float32 ``[rows, W, 3]``
    in [0, 1]).

    Raises:
        ImageReadError: values outside what the image's type allows.
    """
    return _canonical(_pil_to_array(img.crop((0, top, img.size[0], bottom))), "PIL image")


def _plain_array(image: np.ndarray, label: str) -> np.ndarray:
    """A plain ndarray of any array subclass (np.matrix, memmap, record arrays reach numpy
    paths that crash or misbehave otherwise); a masked array only when nothing is masked."""
    if isinstance(image, np.ma.MaskedArray):
        masked = int(np.ma.count_masked(image))
        if masked:
            raise ImageReadError(f"{label}: masked array with {masked} masked value(s): fill "
                                 "them first (arr.filled(value))")
        image = image.data
    arr = np.asarray(image)
    if type(arr) is not np.ndarray:  # an exotic subclass whose asarray keeps it
        arr = np.array(arr, subok=False)
    if arr.dtype.fields is not None or arr.dtype.kind in "OVSUMmc":
        raise ImageReadError(f"{label}: unsupported dtype {arr.dtype}; use uint8, uint16 or "
                             "float")
    return arr


def _tensor_to_array(tensor: Any, label: str) -> np.ndarray:
    """A torch tensor ``[C, H, W]`` (or ``[H, W]``) -> numpy ``[H, W, C]`` (torch is already
    imported when a tensor exists, so this module never imports it itself)."""
    if getattr(tensor, "is_meta", False) or str(getattr(tensor, "device", "")) == "meta":
        raise ImageReadError(f"{label}: a tensor on the meta device has no data")
    if str(getattr(tensor, "layout", "torch.strided")) != "torch.strided" or \
            getattr(tensor, "is_nested", False) or getattr(tensor, "is_quantized", False):
        raise ImageReadError(f"{label}: a {getattr(tensor, 'layout', 'special')} tensor is not "
                             "an image: give a dense (strided) tensor (tensor.to_dense())")
    if tensor.is_complex():
        raise ImageReadError(f"{label}: unsupported dtype {tensor.dtype}; use uint8, uint16 or "
                             "float")
    tensor = tensor.detach().cpu()
    if tensor.dim() == 2:
        tensor = tensor.unsqueeze(0)
    if tensor.dim() != 3 or tensor.shape[0] not in (1, 3, 4):
        raise ImageReadError(f"{label}: tensor of shape {tuple(tensor.shape)} is not [C, H, W] "
                             "with C in 1, 3, 4")
    if str(tensor.dtype) == "torch.bfloat16":
        tensor = tensor.float()  # exact: every bfloat16 value is a float32 value
    try:
        return tensor.permute(1, 2, 0).numpy()
    except (TypeError, RuntimeError):  # dtypes numpy lacks
        raise ImageReadError(f"{label}: unsupported dtype {tensor.dtype}; use uint8, uint16 or "
                             "float") from None


def _is_tensor(image: Any) -> bool:
    return type(image).__module__.split(".")[0] == "torch" and hasattr(image, "permute")


def is_one_image(x: Any) -> bool:
    """Whether ``predict``-style input is one image (a path, encoded bytes, a PIL image, an
    array or a tensor) rather than a sequence of them (no torch import)."""
    return isinstance(x, (str, os.PathLike, *BYTES_TYPES, Image.Image, np.ndarray)) \
        or _is_tensor(x)


def _decode(image: ImageInput, max_pixels: int, min_size: Optional[Tuple[int, int]]
            ) -> Tuple[np.ndarray, Tuple[int, int]]:
    if isinstance(image, (str, os.PathLike)):
        return _decode_path(Path(image), max_pixels, min_size)
    if isinstance(image, BYTES_TYPES):
        return _decode_bytes(bytes(image), max_pixels, min_size)
    if isinstance(image, Image.Image):
        label = "PIL image"
        try:
            # a caller's image object may be shared between threads (the same object twice in
            # one batch, or in concurrent calls): Pillow's lazy load and seek are not
            # thread-safe, so such images decode one at a time
            with _CALLER_PIL_LOCK:
                return _decode_pil(image, label, max_pixels, min_size, own=False)
        except (ImageReadError, MemoryError):
            raise
        # an image PIL cannot convert, or lazy data that is broken
        except Exception as exc:  # noqa: BLE001
            raise ImageReadError(f"{label}: not a readable image "
                                 f"({str(exc) or type(exc).__name__})") from None
    if isinstance(image, np.ndarray):
        label = "numpy array"
        arr = _plain_array(image, label)
    elif _is_tensor(image):
        label = "tensor"
        arr = _tensor_to_array(image, label)
    else:
        raise ImageReadError(
            f"unsupported image input of type {type(image).__name__}: give a path, the bytes of "
            "an image file, a PIL image, "
            "a numpy array (HxW or HxWxC) or a [C, H, W] tensor"
        )
    if arr.ndim not in (2, 3):
        raise ImageReadError(f"{label}: array of shape {arr.shape} is not HxW or HxWxC (C=1,3,4)")
    size = (int(arr.shape[0]), int(arr.shape[1]))
    _check_pixels(size[1], size[0], max_pixels, label)
    k = _factor(size, min_size)
    _reserve((size[0] // k) * (size[1] // k))  # the float32 copy made below
    if k > 1:
        _channels(arr[:1], label)  # the shape check, before any work
        return _block_mean(lambda y0, y1: arr[y0:y1], size[0], size[1], k, label), size
    return _canonical(arr, label), size


def decode(image: ImageInput, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Canonical float32 RGB array ``[H, W, 3]`` in [0, 1] of any supported input, at full
    resolution (torch-free: the ONNX runtime uses it as it is).

    Raises:
        ImageReadError: unreadable or non-regular file, corrupt data, unsupported
            type/shape/dtype/values, too many pixels.
    """
    return _decode(image, max_pixels, None)[0]


def decode_reduced(image: ImageInput, min_size: Tuple[int, int],
                   max_pixels: int = DEFAULT_MAX_PIXELS) -> Tuple[np.ndarray, Tuple[int, int]]:
    """Like :func:`decode`, for a model whose input is much smaller than the image: an image of
    more than :data:`FULL_DECODE_PIXELS` pixels comes back reduced by an integer factor that
    keeps it at least ``min_size`` (H, W) (JPEG: decoded at 1/2, 1/4 or 1/8 scale by libjpeg;
    others: k x k block means, one band of rows at a time). Smaller images are exactly
    :func:`decode`'s.

    Returns:
        (float32 ``[h, w, 3]`` in [0, 1], the original (H, W) of the image).
    """
    return _decode(image, max_pixels, tuple(min_size))  # type: ignore[arg-type]


def read_image(image: ImageInput, max_pixels: int = DEFAULT_MAX_PIXELS) -> "torch.Tensor":
    """Canonical float32 RGB tensor ``[3, H, W]`` in [0, 1] of any supported input (a view of
    :func:`decode`'s ``[H, W, 3]`` array).

    Raises:
        ImageReadError: as :func:`decode`.
    """
    return _to_tensor(decode(image, max_pixels))


def _to_tensor(arr: np.ndarray) -> "torch.Tensor":
    import torch

    return torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1)


def read_image_reduced(image: ImageInput, min_size: Tuple[int, int],
                       max_pixels: int = DEFAULT_MAX_PIXELS
                       ) -> Tuple["torch.Tensor", Tuple[int, int]]:
    """:func:`decode_reduced` as a ``[3, h, w]`` tensor, with the original (H, W)."""
    arr, size = decode_reduced(image, min_size, max_pixels)
    return _to_tensor(arr), size


def describe(image: Any) -> str:
    """A short name for an input, for messages and result tables."""
    if isinstance(image, (str, os.PathLike)):
        return display(image)
    if isinstance(image, BYTES_TYPES):
        return f"bytes({len(image):,})"
    if isinstance(image, np.ndarray):
        return f"array{tuple(image.shape)}"
    if _is_tensor(image):
        return f"tensor{tuple(image.shape)}"
    if isinstance(image, Image.Image):
        return f"PIL{image.size}"
    return type(image).__name__


def is_folder(path: Any) -> bool:
    """``Path(path).is_dir()``, False for a name the system cannot even look up (too long, a NUL
    byte): such an item is then reported as an unreadable image, never a crash."""
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False


def is_image_file(path: Path) -> bool:
    """True for a file whose suffix is a supported image format."""
    return path.suffix.lower() in IMAGE_SUFFIXES
