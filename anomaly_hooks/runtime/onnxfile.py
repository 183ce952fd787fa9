"""An exported ``.onnx`` file read as protobuf records, and the checksum of its content.

An ONNX model is one protobuf message (``ModelProto``): a sequence of top-level records (tag,
then a varint or a length-delimited payload). ``metadata_props`` entries are records of field
14, each a small message with a ``key`` (field 1) and a ``value`` (field 2). This module reads
those records itself, streaming, with the standard library only: neither ONNX Runtime nor the
``onnx`` package sees a byte of a file before its checksum is verified.

The checksum (``metadata_props["checksum"]``, SHA-256 in hex) covers every byte of the file
except the record of that entry itself (graph, weights, every other metadata entry, in file
order) and, when ``metadata_props["external_data"]`` names a side file of weights, that file's
bytes after a separator. :func:`seal` appends the entry to a finished file: protobuf readers
merge records in file order, so the appended entry is simply the last of ``metadata_props``,
and the bytes it covers are exactly the file as it was before.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Dict, List, Optional, Tuple

from anomaly_hooks.errors import ModelFileError
from anomaly_hooks.files import regular_file_problem
from anomaly_hooks.images import display
from anomaly_hooks.modelmeta import MAX_JSON_CHARS, about, refuse

CHECKSUM_KEY = "checksum"
EXTERNAL_KEY = "external_data"
METADATA_FIELD = 14  # ModelProto.metadata_props
MAX_ENTRY = MAX_JSON_CHARS + 4096  # one metadata entry: its JSON value plus the key
SIDE_SEPARATOR = b"\x00external_data\x00"
_CHUNK = 16 << 20


class DamagedFile(ValueError):
    """The bytes are not a well-formed protobuf message (the reason says where)."""


@dataclass
class Stamp:
    """A file's identity (device, inode, size, modification time): a file replaced or
    rewritten between two looks has another stamp."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "Stamp":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class OnnxContent:
    """What :func:`read_content` found: the metadata entries in file order (duplicated keys
    included), the digest of the content, where the checksum entry is, and the stamps of the
    files read."""

    entries: List[Tuple[str, str]] = field(default_factory=list)
    digest: str = ""
    checksum_records: int = 0
    stamps: Dict[Path, Stamp] = field(default_factory=dict)

    @property
    def metadata(self) -> Dict[str, str]:
        """The entries as a mapping (the last of a duplicated key; callers refuse those)."""
        return dict(self.entries)


def regular_file(path: Path, what: str = "model file") -> os.stat_result:
    """``os.stat`` of ``path``; a missing or non-regular path (a folder, a FIFO that would
    block a reader) is a :class:`ModelFileError`."""
    problem = regular_file_problem(path, f"a {what}")
    if problem is not None:
        raise ModelFileError(f"{display(path)}: {problem}")
    return os.stat(path)


def side_file(path: Path, name: str) -> Path:
    """The side file of weights ``name`` of the model at ``path``: a plain file name in the
    model's folder (ONNX Runtime resolves it there), never a path."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\x00") or len(name) > 255:
        raise refuse(EXTERNAL_KEY, name, "the plain file name of the weights next to the model")
    return path.parent / name


# -- reading ------------------------------------------------------------------------------
def _varint(fh: BinaryIO, raw: bytearray) -> Optional[int]:
    """A base-128 varint from ``fh`` (its bytes appended to ``raw``); None at a clean end of
    file."""
    value = shift = 0
    for i in range(10):
        byte = fh.read(1)
        if not byte:
            if i == 0:
                return None
            raise DamagedFile("the file ends inside a record header (truncated)")
        raw += byte
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value
        shift += 7
    raise DamagedFile("a varint longer than 10 bytes")


def _fields(payload: bytes) -> List[Tuple[int, bytes]]:
    """The length-delimited fields of a small message (a metadata entry)."""
    out = []
    pos = 0
    while pos < len(payload):
        tag, pos = _varint_at(payload, pos)
        size, pos = _varint_at(payload, pos)
        if tag & 7 != 2 or pos + size > len(payload):
            raise DamagedFile("a damaged metadata entry")
        out.append((tag >> 3, payload[pos:pos + size]))
        pos += size
    return out


def _varint_at(buf: bytes, pos: int) -> Tuple[int, int]:
    value = shift = 0
    for i in range(pos, min(pos + 10, len(buf))):
        value |= (buf[i] & 0x7F) << shift
        if buf[i] < 0x80:
            return value, i + 1
        shift += 7
    raise DamagedFile("a damaged metadata entry")


def _entry(payload: bytes) -> Tuple[str, str]:
    """(key, value) of a ``StringStringEntryProto`` (field 1 and field 2, each at most once)."""
    fields = _fields(payload)
    parts = dict(fields)
    if set(parts) - {1, 2} or len(parts) != len(fields):
        raise DamagedFile("a damaged metadata entry")
    try:
        return parts.get(1, b"").decode("utf-8"), parts.get(2, b"").decode("utf-8")
    except UnicodeDecodeError:
        raise DamagedFile("a metadata entry that is not UTF-8 text") from None


def _copy(fh: BinaryIO, size: int, digest: Any) -> None:
    """Hash the next ``size`` bytes of ``fh`` in chunks (a graph may be 2 GB)."""
    while size:
        chunk = fh.read(min(size, _CHUNK))
        if not chunk:
            raise DamagedFile("a record runs past the end of the file (truncated)")
        digest.update(chunk)
        size -= len(chunk)


def _record(fh: BinaryIO, digest: Any, content: OnnxContent) -> bool:
    """Read (and hash, unless it is the checksum entry) one top-level record; False at the
    end of the file."""
    raw = bytearray()
    tag = _varint(fh, raw)
    if tag is None:
        return False
    number, wire = tag >> 3, tag & 7
    if number == 0 or wire not in (0, 1, 2, 5):
        raise DamagedFile(f"not a protobuf message (field {number}, wire type {wire})")
    if wire != 2:
        width = {1: 8, 5: 4}.get(wire)
        if width is None:
            _varint(fh, raw)
        else:
            raw += _exactly(fh, width)
        digest.update(raw)
        return True
    size = _varint(fh, raw)
    if size is None:
        raise DamagedFile("the file ends inside a record header (truncated)")
    if number != METADATA_FIELD:
        digest.update(raw)
        _copy(fh, size, digest)
        return True
    if size > MAX_ENTRY:
        raise DamagedFile(f"a metadata entry of {size:,} bytes (the limit is {MAX_ENTRY:,})")
    payload = _exactly(fh, size)
    key, value = _entry(payload)
    content.entries.append((key, value))
    if key == CHECKSUM_KEY:
        content.checksum_records += 1
    else:
        digest.update(raw)
        digest.update(payload)
    return True


def _exactly(fh: BinaryIO, size: int) -> bytes:
    data = fh.read(size)
    if len(data) != size:
        raise DamagedFile("a record runs past the end of the file (truncated)")
    return data


def read_content(path: Path) -> OnnxContent:
    """Read the model at ``path`` record by record: its metadata and the digest of its content
    (the side file of weights included, when the metadata names one).

    Raises:
        ModelFileError: missing, not a regular file, not a well-formed protobuf message
            ("not a loadable ONNX model"), or its side file missing.
    """
    path = Path(path)
    regular_file(path)
    content = OnnxContent()
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            content.stamps[path] = Stamp.of(os.fstat(fh.fileno()))
            while _record(fh, digest, content):
                pass
    except DamagedFile as exc:
        raise ModelFileError(f"{path}: not a loadable ONNX model ({exc})") from None
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read the model file "
                             f"({exc.strerror or exc})") from None
    name = content.metadata.get(EXTERNAL_KEY, "")
    if name:
        _hash_side(path, name, digest, content)
    content.digest = digest.hexdigest()
    return content


def _hash_side(path: Path, name: str, digest: Any, content: OnnxContent) -> None:
    with about(path):
        side = side_file(path, name)
    regular_file(side, "weights file (external data) of the model")
    digest.update(SIDE_SEPARATOR)
    try:
        with open(side, "rb") as fh:
            content.stamps[side] = Stamp.of(os.fstat(fh.fileno()))
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    except OSError as exc:
        raise ModelFileError(f"{side}: cannot read the weights file "
                             f"({exc.strerror or exc})") from None


def unchanged(content: OnnxContent) -> bool:
    """Whether every file read for ``content`` is still the same file, unmodified."""
    for path, before in content.stamps.items():
        try:
            if Stamp.of(os.stat(path)) != before:
                return False
        except OSError:
            return False
    return True


# -- writing ------------------------------------------------------------------------------
def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | 2) + _encode_varint(len(payload)) + payload


def seal(path: Path) -> str:
    """Append the checksum entry to the finished model at ``path`` (its side file of weights,
    if any, already in place under the name its ``external_data`` entry gives); returns the
    checksum. The file must not hold one yet (a copy rewritten from a sealed model drops it
    first)."""
    path = Path(path)
    content = read_content(path)
    if content.checksum_records:
        raise ValueError(f"{path} already holds a checksum entry")
    entry = _length_delimited(1, CHECKSUM_KEY.encode()) + \
        _length_delimited(2, content.digest.encode())
    with open(path, "ab") as fh:
        fh.write(_length_delimited(METADATA_FIELD, entry))
        fh.flush()
        os.fsync(fh.fileno())
    return content.digest


__all__ = ["CHECKSUM_KEY", "EXTERNAL_KEY", "OnnxContent", "read_content", "seal", "side_file",
           "unchanged"]
