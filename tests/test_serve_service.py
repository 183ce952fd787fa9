"""The running service's helpers (service.py) that need no server."""
from __future__ import annotations

import platform

from anomaly_hooks.errors import ModelFileError
from anomaly_hooks.serve.service import error_text, release_free_memory


def test_free_heap_is_given_back_without_error():
    """The soak's RSS fix: malloc_trim through ctypes where glibc has it, a no-op elsewhere."""
    glibc = platform.libc_ver()[0] == "glibc"
    assert release_free_memory() is glibc, "glibc's malloc_trim was not found"
    assert release_free_memory() is glibc  # loaded once, then reused


def test_error_text_names_the_type_of_unexpected_errors():
    assert error_text(ModelFileError("m: checksum mismatch")) == "m: checksum mismatch"
    assert error_text(FileNotFoundError("gone")) == "gone"
    assert error_text(KeyError("x")) == "KeyError: 'x'"
    assert error_text(RuntimeError()) == "RuntimeError"
