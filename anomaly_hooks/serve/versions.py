"""Model versions of a ``--models-dir``: the model files there as versions, and the record of
which one serves and which served before it (the rollback stack).

* :class:`VersionShelf` lists the folder's model files (``*.safetensors``, ``*.onnx``; hidden
  files and ``*.tmp`` files are no versions: an atomic writer's file in progress is one of
  those) with their SHA-256 (the checksum the service computes when it loads a file), size,
  modification time, method and lineage summary. What the listing reads is read for display
  only: a promote loads the file through the service's one loader
  (:meth:`~anomaly_hooks.serve.service.Service.reload`), which verifies everything again and
  refuses a file that is incomplete, damaged or changing.
* The record (``versions.json`` in the folder) holds, for each served model (a
  :class:`VersionTrack`: the default model's at the top level, those of ``--model NAME=PATH``
  under ``models``, by name), the serving version, the stack of earlier ones and the
  ``--model`` path it was started with; it is written atomically (a temporary
  file, fsync, rename, fsync of the folder), so a crash leaves the old record or the new one,
  and a restarted server finds its rollback stack where it was.

Torch-free: the header of a ``.safetensors`` file is read here as JSON, the ``.onnx`` reader
is the runtime's (:func:`anomaly_hooks.runtime.metadata.read_exported`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from anomaly_hooks.errors import AnomalyHooksError
from anomaly_hooks.files import regular_file_problem
from anomaly_hooks.images import display
from anomaly_hooks.serve.errors import ServeError
from anomaly_hooks.serve.modelpaths import file_sha256, inside_folder

log = logging.getLogger("anomaly_hooks.serve")

STATE_FILE = "versions.json"          # the record, in the models folder
STATE_FORMAT = "anomaly_hooks.versions"
MODEL_SUFFIXES = (".safetensors", ".onnx")
MAX_HISTORY = 100                     # earlier versions kept on the rollback stack
DEFAULT_TRACK = ""                   # the default model's key in VersionShelf.tracks
MIN_PREFIX = 6                        # hex digits of a checksum prefix
MAX_HEADER_BYTES = 100_000_000        # a safetensors header (the model reader's own bound)
MAX_TEXT = 200                        # characters of a metadata string shown
_HEX = re.compile(r"[0-9a-f]{%d,64}" % MIN_PREFIX)


@dataclass
class Version:
    """One model file of the folder, as listed."""

    name: str
    path: str
    size: int
    mtime: float
    checksum: Optional[str] = None          # SHA-256 of the file (None: not computed, see problem)
    kind: Optional[str] = None              # torch (.safetensors) or onnx
    method: Optional[str] = None
    content_checksum: Optional[str] = None  # the checksum recorded inside the file
    lineage: Optional[Dict[str, Any]] = None
    problem: Optional[str] = None           # why it cannot be served as it is now

    def as_dict(self) -> Dict[str, Any]:
        from anomaly_hooks.serve.results import iso_time

        return {"name": self.name, "checksum": self.checksum, "size": self.size,
                "mtime": self.mtime, "mtime_iso": iso_time(self.mtime), "engine": self.kind,
                "method": self.method,
                "model_id": f"{self.method}-{self.checksum[:12]}"
                if self.method and self.checksum else None,
                "content_checksum": self.content_checksum, "lineage": self.lineage,
                "problem": self.problem}


def is_version_name(name: str) -> bool:
    """Whether a file name is one of a version: a model suffix, not hidden (an atomic
    writer's temporary file is hidden or ends in ``.tmp``)."""
    return not name.startswith(".") and name.lower().endswith(MODEL_SUFFIXES)


def _signature(st: os.stat_result) -> Tuple[int, int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _text(value: Any) -> Optional[str]:
    return value[:MAX_TEXT] if isinstance(value, str) else None


def _count(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def lineage_summary(lineage: Any) -> Optional[Dict[str, Any]]:
    """A short summary of a model's ``lineage`` (the updates it went through, oldest first:
    ``{parent_checksum, images_added, labels_used, time}`` each): how many, the images they
    added, and the last one's parent, labels and time. None for a model without one. Read
    defensively: entries that are not of that form count, but add nothing."""
    if not isinstance(lineage, list) or not lineage:
        return None
    entries = [e for e in lineage if isinstance(e, dict)]
    last = entries[-1] if entries else {}
    return {"updates": len(lineage),
            "images_added": sum(_count(e.get("images_added")) or 0 for e in entries),
            "parent_checksum": _text(last.get("parent_checksum")),
            "labels_used": _count(last.get("labels_used")),
            "last_update": _text(last.get("time"))}


def read_safetensors_meta(path: str) -> Tuple[Dict[str, Any], Dict[str, Any], int]:
    """(the header's ``__metadata__``, the parsed ``meta`` JSON, the size the header
    declares) of a ``.safetensors`` model file, read without torch (for the listing; the
    loader verifies the file itself). Raises ``ValueError`` saying what is wrong."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes, too short to be a model file")
        n = int.from_bytes(head, "little")
        if n <= 0 or n > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError("not a model file, or its header is incomplete")
        header = json.loads(fh.read(n))
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise ValueError("not an anomaly_hooks model file")
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_count(x) is not None for x in offsets)):
            raise ValueError("damaged header (a tensor without valid data offsets)")
        end = max(end, offsets[1])
    metadata = header["__metadata__"]
    meta = json.loads(metadata.get("meta", "{}")) if isinstance(metadata.get("meta"), str) \
        else {}
    return metadata, meta if isinstance(meta, dict) else {}, 8 + n + end


def model_lineage(path: str) -> Optional[Dict[str, Any]]:
    """:func:`lineage_summary` of a model file's metadata (None: none, an ``.onnx`` export,
    or unreadable)."""
    if str(path).lower().endswith(".onnx"):
        return None
    try:
        return lineage_summary(read_safetensors_meta(path)[1].get("lineage"))
    except (OSError, ValueError, AttributeError):
        return None


def _describe(path: str, name: str, st: os.stat_result,
              cancel: Optional[threading.Event]) -> Version:
    """Read one file for the listing: its metadata, then its SHA-256; a file that changes
    meanwhile, or whose size is not the one its header declares, has a ``problem``."""
    v = Version(name=name, path=path, size=st.st_size, mtime=st.st_mtime)
    try:
        if name.lower().endswith(".onnx"):
            from anomaly_hooks.runtime.metadata import read_exported

            v.kind = "onnx"
            exported = read_exported(path)  # verifies the export's own checksum
            v.method, v.content_checksum = _text(exported.method), exported.checksum
        else:
            v.kind = "torch"
            metadata, meta, declared = read_safetensors_meta(path)
            if declared != st.st_size:
                raise ValueError(f"{st.st_size:,} bytes, but its header describes "
                                 f"{declared:,}: incomplete (still being written?) or damaged")
            v.method = _text(meta.get("method"))
            v.content_checksum = _text(metadata.get("checksum"))
            v.lineage = lineage_summary(meta.get("lineage"))
        v.checksum = file_sha256(Path(path), cancel=cancel)
    except ServeError:
        raise  # the server is stopping
    except (OSError, ValueError, AnomalyHooksError) as exc:
        v.problem = str(exc) or type(exc).__name__
        v.checksum = None
    try:
        if _signature(os.stat(path)) != _signature(st):
            v.problem, v.checksum = "the file changed while it was read (still being written?)", \
                None
    except OSError:
        v.problem, v.checksum = "the file went away while it was read", None
    return v


@dataclass
class VersionTrack:
    """The serving version of one served model and the versions that served it before (its
    rollback stack), as the record keeps them."""

    history: List[Dict[str, Any]] = field(default_factory=list)  # oldest first; top = last
    serving: Optional[Dict[str, Any]] = None
    model_option: Optional[str] = None      # the --model path the model was started with

    def switched(self, old: Optional[Dict[str, Any]], new: Dict[str, Any],
                 rollback_of: Optional[Dict[str, Any]] = None) -> None:
        """Record a switch of the serving model from ``old`` to ``new`` (``{name, checksum}``
        each): ``old`` goes on the stack, or, for a rollback to ``rollback_of`` (the stack's
        top), that comes off it."""
        if rollback_of is not None and self.history and self.history[-1] is rollback_of:
            self.history.pop()
        elif old is not None and old.get("checksum") != new.get("checksum"):
            self.history.append({**old, "until": _now()})
            del self.history[:-MAX_HISTORY]
        self.serving = {**new, "since": _now()}

    def as_record(self) -> Dict[str, Any]:
        return {"serving": self.serving, "history": list(self.history),
                "model_option": self.model_option}

    @classmethod
    def from_record(cls, data: Any) -> "VersionTrack":
        """A track from its record (``ValueError``/``TypeError``/``KeyError`` when damaged)."""
        if not isinstance(data, dict):
            raise ValueError("a model's versions are not an object")
        history = [_entry(e) for e in data.get("history") or []]
        serving = _entry(data["serving"]) if data.get("serving") else None
        option = data.get("model_option")
        if option is not None and not isinstance(option, str):
            raise ValueError("model_option is not a path")
        return cls(history[-MAX_HISTORY:], serving, option)


@dataclass
class VersionShelf:
    """The versions of one models folder and the record of which serves (see the module):
    one :class:`VersionTrack` per served model, :meth:`track` (the default model's by
    default; ``history``, ``serving``, ``model_option`` and :meth:`switched` are its)."""

    folder: str
    tracks: Dict[str, VersionTrack] = field(default_factory=dict)  # name -> track; "": default
    recorded: bool = False                  # whether the record exists on disk

    def __post_init__(self) -> None:
        self.folder = os.path.realpath(self.folder)
        self._cache: Dict[str, Tuple[Tuple[int, int, int, int], Version]] = {}
        self._lock = threading.Lock()       # the cache (listings run in a thread pool)
        self._write_lock = threading.Lock()

    @property
    def state_path(self) -> Path:
        return Path(self.folder) / STATE_FILE

    def track(self, model: Optional[str] = None) -> VersionTrack:
        """The track of the served model ``model`` (None: the default model's)."""
        return self.tracks.setdefault(model or DEFAULT_TRACK, VersionTrack())

    @property
    def history(self) -> List[Dict[str, Any]]:
        return self.track().history

    @property
    def serving(self) -> Optional[Dict[str, Any]]:
        return self.track().serving

    @serving.setter
    def serving(self, value: Optional[Dict[str, Any]]) -> None:
        self.track().serving = value

    @property
    def model_option(self) -> Optional[str]:
        return self.track().model_option

    @model_option.setter
    def model_option(self, value: Optional[str]) -> None:
        self.track().model_option = value

    def switched(self, old: Optional[Dict[str, Any]], new: Dict[str, Any],
                 rollback_of: Optional[Dict[str, Any]] = None) -> None:
        """:meth:`VersionTrack.switched` of the default model's track."""
        self.track().switched(old, new, rollback_of)

    # -- the listing -----------------------------------------------------------------------
    def describe(self, path: str, cancel: Optional[threading.Event] = None) -> Optional[Version]:
        """The version of the model file at ``path`` (cached while its inode, size and times
        are unchanged); None for what is no version of this folder."""
        name = os.path.basename(path)
        if not is_version_name(name):
            return None
        try:
            real = inside_folder(os.path.join(self.folder, name), self.folder)
        except ServeError:
            return None  # a symbolic link leading out of the folder
        problem = regular_file_problem(real, "a model file")
        if problem is not None:
            if "not found" in problem:
                return None
            return Version(name=name, path=real, size=0, mtime=0.0, problem=problem)
        st = os.stat(real)
        sig = _signature(st)
        with self._lock:
            cached = self._cache.get(name)
        if cached is not None and cached[0] == sig:
            return cached[1]
        version = _describe(real, name, st, cancel)
        if version.problem is None:
            with self._lock:
                self._cache[name] = (sig, version)
        return version

    def scan(self, cancel: Optional[threading.Event] = None) -> List[Version]:
        """Every version of the folder, newest first."""
        try:
            names = sorted(os.listdir(self.folder))
        except OSError as exc:
            raise ServeError(500, "internal_error", f"the models folder "
                             f"{display(self.folder)} cannot be listed ({exc})") from None
        out = [v for v in (self.describe(os.path.join(self.folder, n), cancel)
                           for n in names if is_version_name(n)) if v is not None]
        with self._lock:  # files that are gone leave the cache
            for gone in set(self._cache) - set(names):
                del self._cache[gone]
        return sorted(out, key=lambda v: (-v.mtime, v.name))

    def resolve(self, ref: str, cancel: Optional[threading.Event] = None) -> Version:
        """The version a client named: a file name of the folder, else a checksum prefix (at
        least :data:`MIN_PREFIX` hex digits). 404 for none; 422 for an ambiguous prefix."""
        if "/" not in ref and "\x00" not in ref and ref not in (".", ".."):
            path = os.path.join(self.folder, ref)
            if is_version_name(ref) and os.path.lexists(path):
                inside_folder(path, self.folder)  # 403 for a link leading out
                version = self.describe(path, cancel)
                if version is not None:
                    return version
        prefix = ref.lower()
        if _HEX.fullmatch(prefix):
            found = [v for v in self.scan(cancel) if v.checksum and v.checksum.startswith(prefix)]
            if len({v.checksum for v in found}) > 1:
                raise ServeError(422, "invalid_parameter", f"{len(found)} versions have a "
                                 f"checksum starting with {prefix}: give more digits")
            if found:  # the same content under several names: the first by name
                return sorted(found, key=lambda v: v.name)[0]
        hint = (" (a *.tmp file is one still being written: versions are the *.safetensors "
                "and *.onnx files of the folder)" if ref.endswith(".tmp") else "")
        raise ServeError(404, "not_found", f"no version {ref[:MAX_TEXT]!r} in the models folder "
                         f"{display(self.folder)}: give a file name listed by "
                         f"GET /v1/models/versions or at least {MIN_PREFIX} hex digits of its "
                         f"checksum{hint}")

    def by_checksum(self, checksum: str, name: Optional[str] = None,
                    cancel: Optional[threading.Event] = None) -> Optional[Version]:
        """A version with this SHA-256 (the one named ``name`` first), or None."""
        if name and "/" not in name:
            v = self.describe(os.path.join(self.folder, name), cancel)
            if v is not None and v.checksum == checksum:
                return v
        return next((v for v in sorted(self.scan(cancel), key=lambda v: v.name)
                     if v.checksum == checksum), None)

    def name_of(self, path: str) -> str:
        """A model file's name in the record: its file name inside the folder, else its path."""
        real = os.path.realpath(path)
        return os.path.basename(real) if os.path.dirname(real) == self.folder else real

    # -- the record ------------------------------------------------------------------------
    def load(self) -> "VersionShelf":
        """Read the record (a missing one is an empty record; a damaged one is logged and
        ignored: the folder's files are untouched, only the rollback stack is lost)."""
        try:
            raw = self.state_path.read_bytes()
        except FileNotFoundError:
            return self
        except OSError as exc:
            log.warning("the versions record %s cannot be read (%s): starting without it",
                        self.state_path, exc)
            return self
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
                raise ValueError("not a versions record")
            tracks = {DEFAULT_TRACK: VersionTrack.from_record(data)}
            models = data.get("models") or {}
            if not isinstance(models, dict):
                raise ValueError("models is not an object")
            for name, entry in models.items():
                if name != DEFAULT_TRACK:
                    tracks[str(name)] = VersionTrack.from_record(entry)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("the versions record %s is damaged (%s): starting without it",
                        self.state_path, exc)
            return self
        self.tracks = tracks
        self.recorded = True
        return self

    def snapshot(self) -> Dict[str, Any]:
        """The record as written."""
        # the default model's track at the top (as a record of one model has it), the
        # other served models' under "models", by name
        others = {name: t.as_record() for name, t in sorted(self.tracks.items())
                  if name != DEFAULT_TRACK}
        return {"format": STATE_FORMAT, "version": 1, **self.track().as_record(),
                **({"models": others} if others else {})}

    def save(self, snapshot: Dict[str, Any]) -> None:
        """Write ``snapshot`` as the record, atomically (temporary file, fsync, rename, fsync
        of the folder)."""
        data = json.dumps(snapshot, indent=1, sort_keys=True).encode()
        with self._write_lock:
            fd, tmp = tempfile.mkstemp(prefix=f".{STATE_FILE}.", suffix=".tmp", dir=self.folder)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, self.state_path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            with contextlib.suppress(OSError):  # a folder that cannot be fsynced
                dfd = os.open(self.folder, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        self.recorded = True


def _entry(data: Any) -> Dict[str, Any]:
    """One version of the record: ``{name, checksum, ...}`` with a 64-hex checksum."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) \
            or not re.fullmatch(r"[0-9a-f]{64}", str(data.get("checksum"))):
        raise ValueError(f"a version entry {str(data)[:80]!r} is not {{name, checksum}}")
    return {k: v for k, v in data.items() if isinstance(v, (str, int, float)) or v is None}


def _now() -> str:
    from anomaly_hooks.serve.results import iso_time

    return iso_time(time.time())
