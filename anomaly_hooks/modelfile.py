"""Model files: safetensors (plain tensors, never pickle) + JSON metadata, versioned, checksummed,
written atomically.

Layout: a standard safetensors file whose string metadata holds
``format`` ("anomaly_hooks"), ``format_version``, ``meta`` (JSON: config, preprocessing,
threshold, ...), ``digests`` (format 3: JSON, each tensor's SHA-256 over its name, dtype, shape
and bytes) and ``checksum`` (format 3: SHA-256 over ``meta`` and ``digests``; formats 1-2:
over ``meta`` and every tensor's name, dtype, shape and bytes). A file that fails any check is
refused with :class:`ModelFileError`; so is one whose threshold, preprocessing, layers or
image-size limit break the rules of :mod:`anomaly_hooks.modelmeta` (shared with the exported
``.onnx`` reader), checksum or not.

A reader may leave tensors it does not need yet in the file (``load_model(defer=...)``); they
come back as :class:`StoredTensor`, which reads one on demand from the file verified to be the
one loaded. In format 3 a tensor left in the file is not read at load at all (its own digest
is verified when it is read); in formats 1-2 it is streamed through the whole-file checksum at
load, in bounded chunks.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple, Union

import torch

from anomaly_hooks.errors import ModelFileChangedError, ModelFileError
from anomaly_hooks.files import regular_file_problem
from anomaly_hooks.images import display
from anomaly_hooks.modelmeta import about, check_model_meta

FORMAT_NAME = "anomaly_hooks"
FORMAT_VERSION = 3  # the newest format this version reads and writes
# 1: the original format; 2: adds PaDiM's low-rank covariance form and kept embeddings;
# 3: a digest per tensor, so that a reader verifies what it reads and reads nothing else
DIGESTS_VERSION = 3  # the first format with per-tensor digests
HEADER_KEYS = {"format", "format_version", "meta", "checksum"}  # all that formats 1-2 hold
HEADER_KEYS_DIGESTS = HEADER_KEYS | {"digests"}  # all that format 3 holds
HASH_CHUNK = 16 << 20  # bytes of a tensor left on disk read (and hashed) at a time
READ_PIECE = 16 << 20  # bytes read into a kept tensor at a time (hashed while the next is read)
READ_STAGE = 4 << 20  # staging bytes of a read into a non-contiguous tensor (stays in cache)


def checksum(meta_json: str, tensors: Dict[str, torch.Tensor]) -> str:
    """The checksum of formats 1-2: SHA-256 over the metadata JSON and every tensor (sorted by
    name)."""
    digest = hashlib.sha256(meta_json.encode("utf-8"))
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        digest.update(_label(name, t.dtype, tuple(t.shape)))
        if t.numel():
            digest.update(t.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _label(name: str, dtype: torch.dtype, shape: Tuple[int, ...]) -> bytes:
    """What :func:`checksum` and :func:`tensor_digest` hash before a tensor's bytes: its name,
    dtype and shape."""
    return f"|{name}:{dtype}:{tuple(shape)}|".encode()


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """A tensor's digest in a format-3 file: SHA-256 over its name, dtype, shape and bytes."""
    t = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(_label(name, t.dtype, tuple(t.shape)))
    if t.numel():
        digest.update(t.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def digests_checksum(meta_json: str, digests_json: str) -> str:
    """The checksum of a format-3 file: SHA-256 over its metadata JSON and its digests JSON
    (both as stored), so that the header alone proves which tensor content belongs to it."""
    return hashlib.sha256(meta_json.encode("utf-8") + b"|digests|"
                          + digests_json.encode("utf-8")).hexdigest()


def digested(meta_json: str, tensors: Dict[str, torch.Tensor]) -> Tuple[str, str]:
    """(digests JSON, checksum) of a format-3 file holding ``tensors`` and ``meta_json``."""
    digests = dump_meta({name: tensor_digest(name, t) for name, t in tensors.items()})
    return digests, digests_checksum(meta_json, digests)


SETTLED_NS = 2_000_000_000  # a file last changed this long before its check: its stamp holds


@dataclass(frozen=True)
class FileStamp:
    """What identifies a file's content without reading it: device, inode, size, and the
    modification and status-change times (ns). Any write, truncation or replacement changes
    one of them (the status-change time cannot be set back by user-space tools)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileStamp":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def settled_stamp(before: os.stat_result, after: os.stat_result,
                  started_ns: int) -> Optional[FileStamp]:
    """The stamp of a file whose content was verified between the ``fstat`` calls ``before``
    and ``after`` (the check started at ``started_ns``, wall clock), when the stamp identifies
    that content: unchanged during the check and last changed at least ``SETTLED_NS`` before
    it began (a file changed just before could change again within the same timestamp tick,
    a few ms on Linux, 2 s on FAT, without its times moving). Else None."""
    stamp = FileStamp.of(before)
    if FileStamp.of(after) != stamp:
        return None
    if started_ns - max(stamp.mtime_ns, stamp.ctime_ns) < SETTLED_NS:
        return None
    return stamp


class _TensorDamaged(ModelFileError):
    """A tensor read on demand does not match its digest in the header loaded: the file is
    damaged (not a :class:`ModelFileChangedError`: loading it again cannot help)."""


@dataclass(frozen=True)
class StoredTensor:
    """A tensor that :func:`load_model` verified but left in the model file (``defer``):
    ``read()`` reads it back, checking first that the file is still the one loaded.

    ``checksum``: the verified checksum of the file it was loaded from (or last saved to).
    ``digest``: the tensor's own digest (format 3): a read checks that the file's header still
    has ``checksum`` and hashes the tensor as it reads it. Formats 1-2 (``digest`` None):
    ``stamp``, the file's :class:`FileStamp` when the load verified it (None: not known, or
    changed too recently to identify the content); a read finds the file as stamped and reads
    the tensor alone, or else verifies the whole file against ``checksum`` again (every tensor
    streamed through the hash). Either way a file replaced, changed or removed since is a
    :class:`ModelFileChangedError`, never another model's tensor.
    """

    path: Path
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    checksum: str
    stamp: Optional[FileStamp] = None
    digest: Optional[str] = None

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes (what reading it allocates)."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def read(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The tensor (CPU, freshly allocated), from the file verified to be the one loaded.
        ``out``: a CPU tensor of its shape and dtype (any strides, e.g. the leading part of a
        larger buffer) to read it into instead; returned."""
        if out is not None and (tuple(out.shape) != tuple(self.shape) or out.dtype != self.dtype
                                or out.device.type != "cpu"):
            raise ValueError(f"cannot read {self.name} {list(self.shape)} {self.dtype} into a "
                             f"{out.device.type} tensor {list(out.shape)} {out.dtype}")
        try:
            with _open_model(self.path) as fh:
                size = os.fstat(fh.fileno()).st_size
                header, base = _read_header(fh, self.path, size)
                metadata = _check_metadata(header["__metadata__"], self.path)
                if metadata.get("checksum") != self.checksum:
                    raise self._changed("was replaced by another model file")
                if self.digest is not None:  # format 3: the tensor's own digest
                    tensor = self._read_digested(fh, header, base, size, out)
                    if tensor is not None:
                        return tensor
                    # the header is the one loaded: loading it again cannot help
                    raise _TensorDamaged(
                        f"{self.path}: checksum mismatch ({self.name}): the file was modified "
                        "or damaged after it was written; refit or restore it from a backup")
                if self.stamp is not None and FileStamp.of(os.fstat(fh.fileno())) == self.stamp:
                    try:
                        tensor = _read_one(fh, header, base, size, self.name, out)
                    except (OSError, ValueError, RuntimeError, KeyError) as exc:
                        raise self._changed(f"was damaged or truncated ({exc})") from None
                    if FileStamp.of(os.fstat(fh.fileno())) == self.stamp:
                        return tensor
                    del tensor  # changed while read: verified in full below
                try:
                    tensors, digest = _read_verified(fh, header, base, size,
                                                     metadata.get("meta", ""), {self.name})
                except (OSError, ValueError, RuntimeError) as exc:
                    raise self._changed(f"was damaged or truncated ({exc})") from None
        except (ModelFileChangedError, _TensorDamaged):
            raise
        except ModelFileError as exc:  # missing, not a model file any more
            raise self._changed(f"cannot be read any more ({exc})") from None
        except OSError as exc:
            raise self._changed(f"cannot be read any more ({exc.strerror or exc})") from None
        if digest != self.checksum or self.name not in tensors:
            raise self._changed("was modified since it was loaded (checksum mismatch)")
        return tensors[self.name] if out is None else out.copy_(tensors[self.name])

    def _read_digested(self, fh: Any, header: Dict[str, Any], base: int, size: int,
                       out: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The tensor read from the open format-3 file ``fh`` whose header has the checksum
        loaded, hashed as it is read; None when it does not match its digest."""
        try:
            tensor, digest = _read_hashed(fh, header, base, size, self.name, out)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise self._changed(f"was damaged or truncated ({exc})") from None
        return tensor if digest == self.digest else None

    def at(self, path: Union[str, os.PathLike], file_checksum: str) -> "StoredTensor":
        """The same tensor in another file holding it (e.g. the one the model was saved to),
        whose recorded checksum is ``file_checksum``; its digest there is taken from that
        file's header (each read checks the header against ``file_checksum``)."""
        path = Path(path)
        metadata = read_header(path)["__metadata__"]
        digests = _parse_digests(metadata, None, path) if "digests" in metadata else {}
        return replace(self, path=path, checksum=file_checksum, stamp=None,
                       digest=digests.get(self.name))

    def _changed(self, what: str) -> ModelFileChangedError:
        return ModelFileChangedError(
            f"{self.path}: the model reads its {self.name} from the file it was loaded from, "
            f"but that file {what}: load the model again from its file (Detector.load, or "
            "reload the served model) and retry; to keep a model whose file may change, save "
            "it to its own path first (a saved model file is always complete)")


def dump_meta(meta: Dict[str, Any]) -> str:
    """The metadata as a model file stores it (sorted keys, compact)."""
    return json.dumps(meta, sort_keys=True, separators=(",", ":"))


def content_checksum(tensors: Dict[str, torch.Tensor], meta: Dict[str, Any],
                     version: int = FORMAT_VERSION) -> str:
    """The checksum :func:`save_model` records for ``tensors`` and ``meta`` in format
    ``version``, without writing a file."""
    text = dump_meta(meta)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return digested(text, tensors)[1] if version >= DIGESTS_VERSION else checksum(text, tensors)


def file_checksum(path: str | os.PathLike) -> Optional[str]:
    """The checksum recorded in a model file's header (read without the tensors, not
    verified: :func:`load_model` verifies it)."""
    return read_header(Path(path))["__metadata__"].get("checksum")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_model(path: str | os.PathLike, tensors: Dict[str, torch.Tensor], meta: Dict[str, Any],
               version: int = FORMAT_VERSION) -> Path:
    """Write tensors + metadata atomically: a temporary file in the same folder, fsync, rename.
    ``version``: the format version written (1-2: one checksum over everything; 3: a digest
    per tensor as well).

    An interrupted save leaves at most a hidden ``.tmp`` file, never a file at ``path`` that
    looks valid; a model already at ``path`` survives until the new one is complete.
    """
    from safetensors.torch import save_file

    if not 1 <= version <= FORMAT_VERSION:
        raise ValueError(f"model format version {version}: this version writes 1..{FORMAT_VERSION}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    text = dump_meta(meta)
    # the checksum is hashed on a worker thread while the tensors are written (both release
    # the GIL): the header gets placeholders of the same lengths, then the real ones
    header = {"format": FORMAT_NAME, "format_version": str(version), "meta": text,
              "checksum": "0" * 64}
    digests = version >= DIGESTS_VERSION
    if digests:
        header["digests"] = dump_meta({k: "0" * 64 for k in tensors})
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="model-hash") as pool:
            hashed = pool.submit(digested if digests else checksum, text, tensors)
            try:
                save_file(tensors, str(tmp), metadata=header)
            except Exception as exc:  # safetensors' own error type for a full disk, ...
                if isinstance(exc, OSError):
                    raise
                raise ModelFileError(f"cannot write the model file {path}: {exc}") from None
            if digests:
                digests_json, file_sum = hashed.result()
                _canonicalise_header(tmp, file_sum, digests_json)
            else:
                _canonicalise_header(tmp, hashed.result())
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a model is an ordinary file
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _canonicalise_header(path: Path, file_checksum: str,
                         digests_json: Optional[str] = None) -> None:
    """Rewrite the safetensors JSON header with sorted keys, the content's checksum
    ``file_checksum`` and (format 3) the tensors' ``digests_json``, each written over a
    placeholder of the same length, in place.

    safetensors writes its header from hash maps, so key order (and so the file's bytes) varies
    between runs; sorted keys make two saves of the same model byte-identical. The compact JSON
    has the same length whatever the key order, so only the header bytes are rewritten; if the
    length ever differed, the file is rewritten whole.
    """
    with open(path, "rb+") as fh:
        n = int.from_bytes(fh.read(8), "little")
        raw = fh.read(n)
        header = json.loads(raw.decode("utf-8"))
        header["__metadata__"]["checksum"] = file_checksum
        if digests_json is not None:
            header["__metadata__"]["digests"] = digests_json
        blob = json.dumps(header, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False).encode("utf-8")
        if len(blob) <= n:
            fh.seek(8)
            fh.write(blob + b" " * (n - len(blob)))
            return
    padded = blob + b" " * (-len(blob) % 8)
    fallback = path.with_name(path.name + ".hdr")
    try:
        with open(path, "rb") as src, open(fallback, "wb") as dst:
            src.seek(8 + n)
            dst.write(len(padded).to_bytes(8, "little") + padded)
            shutil.copyfileobj(src, dst, 16 << 20)
        os.replace(fallback, path)
    finally:
        fallback.unlink(missing_ok=True)


_MAX_HEADER_BYTES = 100_000_000


def _parse_json(raw: bytes, what: str, path: Path) -> Any:
    """JSON from the file, any failure (bad UTF-8, bad JSON, nesting deep enough to exhaust
    the parser's recursion) a :class:`ModelFileError`."""
    try:
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ModelFileError(f"{path}: damaged or not a model file ({what} is not valid "
                             "JSON)") from None


def _read_header(fh: Any, path: Path, size: int) -> Tuple[Dict[str, Any], int]:
    """The safetensors JSON header (whole) and where the tensor data starts, read from the open
    file ``fh`` without trusting it (size checks first)."""
    head = fh.read(8)
    if len(head) < 8:
        raise ModelFileError(f"{path}: too short to be a model file ({size} bytes)")
    n = int.from_bytes(head, "little")
    if n <= 0 or n > min(size - 8, _MAX_HEADER_BYTES):
        raise ModelFileError(f"{path}: not an anomaly_hooks model file (bad header; is it a "
                             "pickle or another format?)")
    header = _parse_json(fh.read(n), "header", path)
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        raise ModelFileError(f"{path}: not an anomaly_hooks model file")
    if not all(isinstance(v, str) for v in metadata.values()):
        raise ModelFileError(f"{path}: damaged header (metadata values must be strings)")
    return header, 8 + n


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _read_one(fh: Any, header: Dict[str, Any], base: int, size: int, name: str,
              out: Optional[torch.Tensor] = None,
              hasher: Optional["_HashBehind"] = None) -> torch.Tensor:
    """The tensor ``name`` of the open file ``fh`` (checked against the file's bounds), read in
    place into ``out`` (its shape and dtype; default freshly allocated), each piece fed to
    ``hasher`` when given (:meth:`StoredTensor.read`). A non-contiguous ``out`` is filled
    through a staging buffer of ``READ_STAGE`` bytes, whole rows of the first dimension at a
    time."""
    dtype, shape, start, nbytes = _entry(name, header[name], base, size)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    if not nbytes:
        return out
    feed = None if hasher is None else hasher.feed
    if out.is_contiguous():
        _read_into(fh, name, _bytes_of(out), start, nbytes, feed)
        return out
    row = nbytes // shape[0]
    rows = max(1, READ_STAGE // max(row, 1))
    stage = torch.empty((min(rows, shape[0]), *shape[1:]), dtype=dtype)
    for lo in range(0, shape[0], rows):
        part = stage[:min(rows, shape[0] - lo)]
        _read_into(fh, name, _bytes_of(part), start + lo * row, part.shape[0] * row)
        if hasher is not None:  # hashed before the stage is overwritten
            hasher.feed(_bytes_of(part)).result()
        out[lo:lo + part.shape[0]].copy_(part)
    return out


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class _HashBehind:
    """SHA-256 fed on a worker thread, in the order fed, while the caller reads the next bytes:
    ``hashlib`` and ``readinto`` both release the GIL, so a load costs about the longer of
    reading and hashing instead of their sum (612 MB from the page cache: 0.7 -> 0.5 s; the
    hash alone 0.35 s). A fed buffer must stay unchanged until the future :meth:`feed`
    returned for it is done."""

    def __init__(self, first: bytes) -> None:
        self.digest = hashlib.sha256(first)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="model-hash")

    def feed(self, data: Any) -> Any:
        """Queue ``data`` (bytes or a memoryview) for the hash; returns its future."""
        return self.pool.submit(self.digest.update, data)

    def hexdigest(self) -> str:
        self.pool.shutdown(wait=True)
        return self.digest.hexdigest()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _read_verified(fh: Any, header: Dict[str, Any], base: int, size: int, meta_json: str,
                   keep: Optional[Collection[str]] = None
                   ) -> Tuple[Dict[str, torch.Tensor], str]:
    """The file's tensors named in ``keep`` (all when None) as owned, freshly allocated CPU
    tensors, and the SHA-256 of :func:`checksum` over the metadata and *every* tensor: the
    others are streamed through the hash ``HASH_CHUNK`` bytes at a time (two buffers in turn),
    never held whole. Read from the open file ``fh`` (the same open file as the header: a file
    replaced meanwhile cannot mix two versions); each piece is hashed on a worker thread while
    the next is read (:class:`_HashBehind`).

    Each kept tensor is allocated (aligned) and filled by ``readinto`` from the file: no
    memory-mapped view (the file's data offsets are only 8-byte aligned, and BLAS kernels take
    differently rounded paths on unaligned memory; owned memory also survives the file being
    replaced while the model is in use) and no intermediate copy, so loading a 3.8 GB model
    needs 3.8 GB, not twice that. Shapes, offsets and sizes are checked against the file
    before anything is allocated.
    """
    entries = {key: _entry(key, info, base, size) for key, info in header.items()
               if key != "__metadata__"}
    hasher = _HashBehind(meta_json.encode("utf-8"))
    tensors: Dict[str, torch.Tensor] = {}
    chunks: List[memoryview] = []
    pending: List[Any] = [None, None]  # the hash future of each streaming buffer
    turn = 0
    try:
        for key in sorted(entries):
            dtype, shape, start, nbytes = entries[key]
            hasher.feed(_label(key, dtype, shape))
            if keep is None or key in keep:
                out = torch.empty(shape, dtype=dtype)
                if nbytes:
                    _read_into(fh, key, memoryview(out.reshape(-1).view(torch.uint8).numpy()),
                               start, nbytes, hasher.feed)
                tensors[key] = out
                continue
            if not chunks:
                chunks = [memoryview(bytearray(HASH_CHUNK)) for _ in range(2)]
            for lo in range(0, nbytes, HASH_CHUNK):  # streamed: at most 2 HASH_CHUNK held
                if pending[turn] is not None:
                    pending[turn].result()  # its previous bytes are hashed: reuse it
                part = chunks[turn][:min(HASH_CHUNK, nbytes - lo)]
                _read_into(fh, key, part, start + lo, len(part))
                pending[turn] = hasher.feed(part)
                turn = 1 - turn
        return tensors, hasher.hexdigest()
    finally:
        hasher.close()


def _read_hashed(fh: Any, header: Dict[str, Any], base: int, size: int, name: str,
                 out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, str]:
    """The tensor ``name`` read as :func:`_read_one` reads it (into ``out`` or a fresh, owned
    CPU tensor), and its :func:`tensor_digest` of the bytes read, each piece hashed on a worker
    thread while the next is read."""
    dtype, shape, _, _ = _entry(name, header[name], base, size)
    hasher = _HashBehind(_label(name, dtype, shape))
    try:
        tensor = _read_one(fh, header, base, size, name, out, hasher)
        return tensor, hasher.hexdigest()
    finally:
        hasher.close()


def _read_digested_all(fh: Any, header: Dict[str, Any], base: int, size: int,
                       keep: Collection[str], digests: Dict[str, str]
                       ) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """The format-3 file's tensors named in ``keep`` (:func:`_read_hashed`), and the names of
    those whose bytes do not match their digest. Nothing else is read."""
    tensors: Dict[str, torch.Tensor] = {}
    bad: List[str] = []
    for key in sorted(keep):
        tensors[key], digest = _read_hashed(fh, header, base, size, key)
        if digest != digests[key]:
            bad.append(key)
    return tensors, bad


_HEX = frozenset("0123456789abcdef")


def _parse_digests(metadata: Dict[str, str], header: Optional[Dict[str, Any]],
                   path: Path) -> Dict[str, str]:
    """A format-3 header's tensor digests (name -> 64 lowercase hex digits), one for each
    tensor of ``header`` (when given) and no other."""
    digests = _parse_json(metadata.get("digests", ""), "digests", path)
    if not isinstance(digests, dict) or not all(
            isinstance(v, str) and len(v) == 64 and set(v) <= _HEX for v in digests.values()):
        raise ModelFileError(f"{path}: damaged header (digests)")
    if header is not None and set(digests) != set(header) - {"__metadata__"}:
        raise ModelFileError(f"{path}: damaged header (the digests do not name the file's "
                             "tensors)")
    return digests


def _entry(key: str, info: Any, base: int, size: int
           ) -> Tuple[torch.dtype, Tuple[int, ...], int, int]:
    """(dtype, shape, absolute start, byte count) of one tensor described by its safetensors
    header entry ``info``, checked against the file's size."""
    try:
        dtype = _DTYPES[info["dtype"]]
        shape = tuple(_plain_int(s) for s in info["shape"])
        begin, end = (_plain_int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"tensor {key!r}: malformed header entry") from None
    # sizes in Python integers, before any allocation: a shape of 2**63 is refused here
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if min(shape, default=0) < 0 or len(shape) > 16 or not 0 <= begin <= end \
            or end - begin != nbytes:
        raise ValueError(f"tensor {key!r}: offsets {begin}..{end} do not fit shape "
                         f"{list(shape)}")
    if base + end > size:
        raise ValueError(f"tensor {key!r} ends past the end of the file (truncated)")
    return dtype, shape, base + begin, nbytes


def _read_into(fh: Any, key: str, view: memoryview, start: int, nbytes: int,
               on_piece: Optional[Callable[[memoryview], Any]] = None) -> None:
    """Fill ``view`` with the ``nbytes`` bytes of the file at ``start``, ``READ_PIECE`` bytes
    at a time; ``on_piece`` is given each piece as soon as it is read."""
    fh.seek(start)
    pos = 0
    while pos < nbytes:
        got = fh.readinto(view[pos:pos + READ_PIECE])
        if not got:
            raise ValueError(f"tensor {key!r}: the file ended early (truncated)")
        if on_piece is not None:
            on_piece(view[pos:pos + got])
        pos += got


def _plain_int(value: Any) -> int:
    """An integer of the header (JSON ints only: no floats, strings or booleans)."""
    if type(value) is not int:
        raise ValueError(value)
    return value


def load_model(path: str | os.PathLike, defer: Collection[str] = ()
               ) -> Tuple[Dict[str, Union[torch.Tensor, StoredTensor]], Dict[str, Any]]:
    """Read and verify a model file.

    ``defer``: names of tensors to leave in the file; the result holds a :class:`StoredTensor`
    for each instead, which reads it back on demand. Format 3 does not read them here (each
    read verifies the tensor's digest); formats 1-2 verify them here, streamed through the
    whole-file checksum in bounded chunks.

    Returns:
        (tensors on CPU, metadata dict).

    Raises:
        ModelFileError: missing, truncated, tampered (checksum), wrong format or newer version.
    """
    path = Path(path)
    try:
        with _open_model(path) as fh:
            started = time.time_ns()
            before = os.fstat(fh.fileno())
            size = before.st_size
            header, base = _read_header(fh, path, size)
            metadata = _check_metadata(header["__metadata__"], path)
            meta_json = metadata.get("meta", "")
            keep = [k for k in header if k != "__metadata__" and k not in defer]
            try:  # every entry checked against the file, read or not
                entries = {key: _entry(key, info, base, size) for key, info in header.items()
                           if key != "__metadata__"}
            except ValueError as exc:
                raise ModelFileError(f"{path}: damaged or truncated model file ({exc})") from None
            digests = (_parse_digests(metadata, header, path) if "digests" in metadata
                       else None)
            try:
                if digests is None:
                    tensors, digest = _read_verified(fh, header, base, size, meta_json, keep)
                    bad = [] if digest == metadata.get("checksum") else ["*"]
                else:
                    digest = digests_checksum(meta_json, metadata["digests"])
                    tensors, bad = (({}, ["*"]) if digest != metadata.get("checksum") else
                                    _read_digested_all(fh, header, base, size, keep, digests))
            except (OSError, ValueError, RuntimeError) as exc:
                raise ModelFileError(f"{path}: damaged or truncated model file ({exc})") from None
            stamp = (settled_stamp(before, os.fstat(fh.fileno()), started)
                     if digests is None else None)  # format 3: each read verifies its digest
    except OSError as exc:  # read errors (an I/O error, a file that vanished)
        raise ModelFileError(f"{path}: cannot read the model file "
                             f"({exc.strerror or exc})") from None
    if bad:
        which = "" if bad == ["*"] else f" ({', '.join(bad)})"
        raise ModelFileError(f"{path}: checksum mismatch{which}: the file was modified or "
                             "damaged after it was written; refit or restore it from a backup")
    out: Dict[str, Union[torch.Tensor, StoredTensor]] = dict(tensors)
    for key in header:
        if key != "__metadata__" and key not in tensors:
            dtype, shape, _, _ = entries[key]
            out[key] = StoredTensor(path.absolute(), key, dtype, shape, digest, stamp,
                                    None if digests is None else digests[key])
    return out, _checked_meta(meta_json, path)


def read_header(path: Path) -> Dict[str, Any]:
    """A model file's safetensors header (its ``__metadata__`` and tensor entries), read and
    bounds-checked, without the tensors; an unreadable file is a :class:`ModelFileError`."""
    try:
        with _open_model(path) as fh:
            return _read_header(fh, path, os.fstat(fh.fileno()).st_size)[0]
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read the model file "
                             f"({exc.strerror or exc})") from None


def read_meta(path: str | os.PathLike) -> Dict[str, Any]:
    """The metadata of a model file from its header alone (no tensor read, no checksum: for a
    caller that only plans work, e.g. the distributed score's batch size, and whose workers
    then :func:`load_model` the file in full)."""
    path = Path(path)
    header = read_header(path)
    return _checked_meta(_check_metadata(header["__metadata__"], path).get("meta", ""), path)


def _checked_meta(meta_json: str, path: Path) -> Dict[str, Any]:
    """The metadata JSON parsed, and its threshold, preprocessing, layers and image-size
    limit checked by the rules both model formats share (:mod:`anomaly_hooks.modelmeta`)."""
    meta = _parse_json(meta_json, "metadata", path)
    if not isinstance(meta, dict):
        raise ModelFileError(f"{path}: damaged or not a model file (metadata is not a JSON "
                             "object)")
    with about(path):
        check_model_meta(meta)
    return meta


def check_model_path(path: Any) -> None:
    """Raise :class:`ModelFileError` saying what ``path`` is unless it is a regular file
    (missing, a folder, a device such as ``/dev/zero``, a FIFO, a symbolic link loop): from
    ``os.stat`` alone, before anything is opened."""
    problem = regular_file_problem(path, "a model file")
    if problem is not None:
        raise ModelFileError(f"{display(path)}: {problem}")


def _open_model(path: Path) -> Any:
    """The model file opened for reading; a missing, unreadable or non-regular path is a
    :class:`ModelFileError` (a FIFO is refused without being opened)."""
    check_model_path(path)
    try:
        return open(path, "rb")
    except OSError as exc:  # permission denied, ...
        raise ModelFileError(f"{path}: cannot read the model file ({exc.strerror or exc})") \
            from None


def _check_metadata(header: Dict[str, str], path: Path) -> Dict[str, str]:
    """The format version and the header keys: a newer, unknown or modified file is refused."""
    try:
        version = int(header.get("format_version", ""))
    except (TypeError, ValueError):
        raise ModelFileError(f"{path}: damaged header (format_version)") from None
    if version > FORMAT_VERSION:
        raise ModelFileError(f"{path} was written in model format {version} by a newer "
                             f"anomaly_hooks; this version reads format <= {FORMAT_VERSION}: "
                             "upgrade anomaly_hooks")
    if version < 1:
        raise ModelFileError(f"{path}: unknown model format version {version}")
    keys = HEADER_KEYS_DIGESTS if version >= DIGESTS_VERSION else HEADER_KEYS
    extra = sorted(set(header) - keys)
    if extra:
        raise ModelFileError(f"{path}: unexpected header metadata {extra}: the file was modified "
                             "after it was written, or was not written by anomaly_hooks")
    if version >= DIGESTS_VERSION and "digests" not in header:
        raise ModelFileError(f"{path}: damaged header (format {version} without digests)")
    return header
