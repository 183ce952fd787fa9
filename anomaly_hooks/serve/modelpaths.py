"""Which paths the service loads as a model.

* :func:`check_model_file`: a model is a regular file; anything else (a folder, a device such as
  ``/dev/zero``, a FIFO, a symbolic link loop, a missing file) is refused with what it is, from
  ``os.stat`` alone, before a byte is read or hashed (reading ``/dev/zero`` never ends, opening a
  FIFO waits for a writer).
* :func:`check_model_extent`: the file's header (bounded, read alone) says where its data ends;
  a file of another size is refused before its data is read or hashed (a truncated or padded
  file, a huge sparse file that is no model, a ``/proc`` or ``/sys`` file: those report a size
  that a read does not give, mostly 0), and so is one larger than the machine's memory.
* :func:`inside_folder`: the admin reload route loads files from one folder only (the serving
  model's, or ``--models-dir``); symbolic links and ``..`` are resolved first, so neither can
  lead out of it.
* :func:`file_sha256`: a model file's checksum as the service computes it (its load, and the
  versions of ``--models-dir``), stopped when the server is stopping.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Optional

from anomaly_hooks import files
from anomaly_hooks.errors import ModelFileError
from anomaly_hooks.files import regular_file_problem
from anomaly_hooks.images import display
from anomaly_hooks.serve.errors import ServeError


def check_model_file(path: str | os.PathLike) -> None:
    """Raise :class:`ModelFileError` saying what ``path`` is unless it is a regular file
    (``os.stat`` only, nothing opened; the rule of
    :func:`anomaly_hooks.modelfile.check_model_path`, without importing torch)."""
    problem = regular_file_problem(path, "a model file")
    if problem is not None:
        raise ModelFileError(f"{display(path)}: {problem}")


def check_model_extent(path: str | os.PathLike) -> int:
    """The size of the model file at ``path`` (a regular file: :func:`check_model_file`),
    checked against the end of the tensor data its header declares; raise
    :class:`ModelFileError` when they differ. Reads the header only (a ``.safetensors`` file:
    the PyTorch engine's check)."""
    from anomaly_hooks.modelfile import read_header

    label = display(path)
    size = os.stat(path).st_size
    if size < 8:
        raise ModelFileError(f"{label}: {size} bytes, too short to be a model file (files of "
                             "/proc and /sys report 0 bytes whatever they hold)")
    header = read_header(Path(path))  # refuses what is not a model file, bounded read
    with open(path, "rb") as fh:
        header_bytes = int.from_bytes(fh.read(8), "little")  # safetensors: u64 LE, then JSON
    end = 8 + header_bytes + max((_data_end(entry, label) for key, entry in header.items()
                                  if key != "__metadata__"), default=0)
    if end != size:
        raise ModelFileError(f"{label}: {size:,} bytes, but its header describes {end:,}: a "
                             "truncated, padded or damaged model file, or not one")
    memory = physical_memory()
    if memory is not None and size > memory:
        raise ModelFileError(f"{label}: {size:,} bytes, more than this machine's memory "
                             f"({memory:,} bytes); a model is loaded into memory whole")
    return size


def physical_memory() -> Optional[int]:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _data_end(entry: Any, label: str) -> int:
    """Where one tensor's data ends (its header entry's second data offset)."""
    try:
        end = entry["data_offsets"][1]
    except (TypeError, KeyError, IndexError):
        end = None
    if not isinstance(end, int) or isinstance(end, bool) or end < 0:
        raise ModelFileError(f"{label}: damaged header (a tensor without valid data offsets)")
    return end


def inside_folder(path: str, folder: str) -> str:
    """The real path of ``path`` (symbolic links and ``..`` resolved; relative to the working
    directory), which must lie inside ``folder``.

    Raises:
        ServeError: 403 ``path_not_allowed`` naming the folder; 422 for a name that cannot be
            a path (a NUL character).
    """
    root = os.path.realpath(folder)
    try:
        real = os.path.realpath(path)
    except ValueError:
        raise ServeError(422, "invalid_parameter", "path is not a valid file name") from None
    if real == root or os.path.commonpath([real, root]) != root:
        raise ServeError(403, "path_not_allowed",
                         f"{display(path)} is outside the models folder {display(root)}: a "
                         "reload loads model files from that folder only (the server's "
                         "--models-dir, by default the folder of the model it started with)")
    return real


def file_sha256(path: Path, chunk: int = 4 << 20, cancel: Optional[threading.Event] = None
                ) -> str:
    """The file's SHA-256 (:func:`anomaly_hooks.files.file_sha256`); stops
    (:func:`load_cancelled`) within a chunk of ``cancel`` being set."""
    return files.file_sha256(path, chunk, between=lambda: check_cancel(cancel))


def load_cancelled() -> ServeError:
    """The error of a model load stopped because the server is shutting down."""
    return ServeError(503, "shutting_down", "the server is shutting down: the model load was "
                      "stopped")


def check_cancel(cancel: Optional[threading.Event]) -> None:
    """Raise :func:`load_cancelled` when ``cancel`` is set (a load's steps call it between
    their long parts, so that a shutdown stops a reload)."""
    if cancel is not None and cancel.is_set():
        raise load_cancelled()
