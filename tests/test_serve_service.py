"""The running service's helpers (service.py) that need no server."""
from __future__ import annotations

from anomaly_hooks.errors import ModelFileError
from anomaly_hooks.serve.service import error_text


def test_error_text_names_the_type_of_unexpected_errors():
    assert error_text(ModelFileError("m: checksum mismatch")) == "m: checksum mismatch"
    assert error_text(FileNotFoundError("gone")) == "gone"
    assert error_text(KeyError("x")) == "KeyError: 'x'"
    assert error_text(RuntimeError()) == "RuntimeError"
