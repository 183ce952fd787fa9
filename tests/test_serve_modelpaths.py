"""Which paths the service loads as a model (modelpaths.py): what each non-model target is,
said from ``os.stat`` alone, and the models folder that symbolic links and ``..`` cannot leave."""
from __future__ import annotations

import os
import stat

import pytest

from anomaly_hooks.errors import ModelFileError
from anomaly_hooks.serve.errors import ServeError
from anomaly_hooks.serve.modelpaths import check_model_file, inside_folder


def _refusal(path) -> str:
    with pytest.raises(ModelFileError) as err:
        check_model_file(path)
    return str(err.value)


def test_each_kind_of_non_model_target_is_named(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    os.symlink(tmp_path / "a", tmp_path / "b")
    os.symlink(tmp_path / "b", tmp_path / "a")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "file").write_bytes(b"x")
    assert _refusal("/dev/zero") == ("/dev/zero: not a regular file (a character device), "
                                     "not a model file")
    assert _refusal(tmp_path / "pipe").endswith(": not a regular file (a FIFO), not a model file")
    assert _refusal(tmp_path).endswith(": is a folder, not a model file")
    assert _refusal(tmp_path / "a").endswith(": is a symbolic link loop, not a model file")
    assert _refusal(tmp_path / "missing").endswith(": model file not found")
    assert _refusal(tmp_path / "dangling").endswith(": model file not found")
    assert _refusal(tmp_path / "file" / "x").endswith(": model file not found")
    assert _refusal("bad\x00name").endswith("not a valid file name")
    check_model_file(tmp_path / "file")  # a regular file passes (its content is not read here)


def test_stdin_is_said_for_what_it_is():
    """/dev/stdin is whatever this process's descriptor 0 is: a terminal or /dev/null (a
    character device), a pipe (a FIFO), or a file redirected in (regular: passes)."""
    mode = os.fstat(0).st_mode
    if stat.S_ISREG(mode):
        check_model_file("/dev/stdin")
        return
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(
        mode) else "a socket"
    assert f"not a regular file ({kind})" in _refusal("/dev/stdin")


def test_messages_escape_control_characters(tmp_path):
    assert "\\x0a" in _refusal(tmp_path / "new\nline")


def test_inside_folder_resolves_links_and_dots(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "m.safetensors").write_bytes(b"x")
    (folder / "sub").mkdir()
    (folder / "sub" / "n.safetensors").write_bytes(b"x")
    (folder / "out").symlink_to(tmp_path)
    (folder / "in").symlink_to(folder / "m.safetensors")
    real = os.path.realpath(folder)
    assert inside_folder(str(folder / "m.safetensors"), str(folder)) == os.path.join(
        real, "m.safetensors")
    assert inside_folder(str(folder / "sub" / ".." / "sub" / "n.safetensors"),
                         str(folder)).endswith("sub/n.safetensors")
    assert inside_folder(str(folder / "in"), str(folder)).endswith("m.safetensors")
    for escape in (folder / ".." / "x", folder / "out" / "x", "/etc/passwd", folder,
                   str(folder) + "-sibling/m.safetensors"):
        with pytest.raises(ServeError) as err:
            inside_folder(str(escape), str(folder))
        assert (err.value.status, err.value.code) == (403, "path_not_allowed")
        assert real in err.value.message
    with pytest.raises(ServeError) as err:
        inside_folder("a\x00b", str(folder))
    assert err.value.status == 422
