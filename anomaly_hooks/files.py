"""What a path is, from ``os.stat`` alone (torch-free): the one check behind every reader that
must refuse a non-regular file before opening it (opening a FIFO waits for a writer; reading
``/dev/zero`` never ends). The image reader, the model-file reader and the service's reload
use it. And a file's SHA-256 (:func:`file_sha256`: the service's model checksum, the
evaluation's copies of training images)."""
from __future__ import annotations

import errno
import hashlib
import os
import stat
from typing import Any, Callable, Optional

# what each kind of non-regular file is called in a refusal
KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> Optional[str]:
    """None for a regular file's ``st_mode``; else what it is (``"a folder"``, ``"a FIFO"``,
    ... or ``"not a regular file"``)."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in KINDS if test(mode)), "not a regular file")


def kind_refusal(kind: str, what: str) -> str:
    """The refusal of a non-regular file of ``kind`` where ``what`` (``"a model file"``) was
    expected: ``is a folder, not a model file`` / ``not a regular file (a FIFO), not ...``."""
    if kind == "a folder":
        return f"is a folder, not {what}"
    detail = "" if kind == "not a regular file" else f" ({kind})"
    return f"not a regular file{detail}, not {what}"


def regular_file_problem(path: Any, what: str) -> Optional[str]:
    """None when ``path`` is a regular file (symbolic links followed); else why it cannot be
    read as ``what`` (``"a model file"``): not found, a symbolic link loop, not a valid name,
    unreadable, or what kind of file it is. Only ``os.stat`` is called."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return f"{what.split(' ', 1)[-1]} not found"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"is a symbolic link loop, not {what}"
        return f"cannot read {what.split(' ', 1)[-1]} ({exc.strerror or exc})"
    except ValueError:  # a NUL character in the name
        return "not a valid file name"
    kind = file_kind(mode)
    return None if kind is None else kind_refusal(kind, what)


def file_sha256(path: Any, chunk: int = 4 << 20,
                between: Optional[Callable[[], None]] = None) -> str:
    """The SHA-256 (hex) of the file at ``path``, read ``chunk`` bytes at a time;
    ``between()``, where given, runs before each read (a caller's cancellation check)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            if between is not None:
                between()
            block = fh.read(chunk)
            if not block:
                return digest.hexdigest()
            digest.update(block)
