"""Uploaded bytes -> the canonical image (uploads.py): every hostile upload gets its status and
code, every accepted type decodes exactly as the library reads a file."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import textured_images
from serve_helpers import accepted_formats, encode, hostile_payloads

from anomaly_hooks.errors import AnomalyHooksError
from anomaly_hooks.serve.errors import ServeError
from anomaly_hooks.serve.uploads import decode_upload, sniff

HOSTILE = hostile_payloads()


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_upload_gets_its_status_and_code(name):
    data, status, code = HOSTILE[name]
    with pytest.raises(ServeError) as info:
        decode_upload(data, (64, 64), 25_000_000)
    assert (info.value.status, info.value.code) == (status, code), info.value.message
    assert isinstance(info.value, AnomalyHooksError)  # the library's one error base
    assert info.value.message and "BytesIO" not in info.value.message


@pytest.mark.parametrize("name", sorted(accepted_formats()))
def test_accepted_formats_decode_like_the_library(name, tmp_path):
    from anomaly_hooks.images import decode

    data = accepted_formats()[name]
    array, size, fmt = decode_upload(data, (64, 64), 25_000_000)
    path = tmp_path / f"img.{fmt.lower()}"
    path.write_bytes(data)
    np.testing.assert_array_equal(array, decode(path))  # [H, W, 3], torch-free
    assert array.dtype == np.float32 and size == array.shape[:2]


def test_pixel_limit_is_checked_before_decoding():
    data = encode(textured_images(1)[0])  # 112 x 96
    with pytest.raises(ServeError) as info:
        decode_upload(data, (64, 64), 112 * 96 - 1)
    assert info.value.status == 413 and "10,752 pixels" in info.value.message
    decode_upload(data, (64, 64), 112 * 96)


def test_sniff_decides_by_the_bytes_alone():
    assert sniff(encode(textured_images(1)[0])) == "PNG"
    assert sniff(b"GIF89a") is None and sniff(b"") is None
