"""Uploaded bytes -> the network input, through the library's own hardened reader.

The service adds only its policy to :func:`anomaly_hooks.images.decode_reduced` (which
checks and decodes the bytes of an upload exactly as it does a file: format allow-list, pixel
count from the header, strict JPEG entropy check, reduced decoding of huge images): which
media types it accepts (decided by the first bytes, never by the client's Content-Type or file
name) and how each refusal maps to an HTTP status. The byte-size limit is checked before this,
while the body is read (:mod:`.middleware`, :mod:`.routes.predict`).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from anomaly_hooks.errors import ImageReadError, ImageTooLargeError
from anomaly_hooks.serve.errors import ServeError

ACCEPTED_TEXT = "PNG, JPEG, TIFF, BMP or WebP"


def sniff(data: bytes) -> Optional[str]:
    """The format of ``data`` from its signature, or None for anything the service refuses."""
    head = data[:16]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        return "TIFF"
    if head.startswith(b"BM"):
        return "BMP"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    return None


def _describe_head(data: bytes) -> str:
    """What a refused upload looks like, for the 415 message."""
    head = data[:8]
    stripped = head.lstrip()[:1]
    known = ((head.startswith(b"GIF8"), "a GIF image"), (stripped in (b"{", b"["), "JSON text"),
             (stripped == b"<", "HTML/XML text"), (head.startswith(b"%PDF"), "a PDF document"),
             (head.startswith(b"PK\x03\x04"), "a ZIP archive"))
    return next((text for hit, text in known if hit), f"first bytes {head.hex(' ')}")


def decode_upload(data: bytes, min_size: Tuple[int, int], max_pixels: int
                  ) -> Tuple[Any, Tuple[int, int], str]:
    """Decode an upload into the canonical float32 ``[h, w, 3]`` array in [0, 1] (reduced,
    keeping at least ``min_size``, when the image is huge), by the torch-free
    :func:`~anomaly_hooks.images.decode_reduced` (an engine makes its network input of it).

    Returns:
        (array, the image's own (H, W), format name).
    Raises:
        ServeError: 400 empty_body / unreadable_image, 413 too_many_pixels,
            415 unsupported_media_type.
    """
    from anomaly_hooks.images import decode_reduced

    if not data:
        raise ServeError(400, "empty_body", "the request carries no image data: send the image "
                         "as the raw body or as a multipart file field")
    fmt = sniff(data)
    if fmt is None:
        raise ServeError(415, "unsupported_media_type",
                         f"not a {ACCEPTED_TEXT} image ({_describe_head(data)})")
    try:
        array, size = decode_reduced(data, min_size, max_pixels)
    except ImageTooLargeError as exc:
        raise ServeError(413, "too_many_pixels", f"{fmt} {exc} (the server's --max-pixels)"
                         ) from None
    except ImageReadError as exc:
        raise ServeError(400, "unreadable_image", f"{fmt} {exc}") from None
    return array, size, fmt
