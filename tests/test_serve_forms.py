"""Multipart bodies (forms.py, routes/predict.py) in process: the part bounds, each refused
with its code; 30 malformed bodies answered with a 4xx JSON error (never a 5xx); a batch
admitted before its body is read."""
from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
import serve_helpers  # noqa: E402
from serve_helpers import assert_error, good_png, hold_inference, serving  # noqa: E402

from anomaly_hooks.serve.forms import FIELD_MAX_BYTES, PART_HEAD_MAX_BYTES  # noqa: E402

models = serve_helpers.models
B = "BOUNDARY"
MULTIPART = f"multipart/form-data; boundary={B}"
ROUTES = ("/v1/predict", "/v1/predict/batch")


@pytest.fixture(scope="module")
def api(models, tmp_path_factory):
    with serving(models["good"], tmp_path_factory.mktemp("serve_forms"), max_batch_files=4,
                 max_upload_bytes=200_000) as (client, service):
        yield client, service


def part(name: str, value: bytes, filename: str = None, extra: bytes = b"") -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return (f"--{B}\r\nContent-Disposition: {disposition}\r\n".encode() + extra + b"\r\n"
            + value + b"\r\n")


def body(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{B}--\r\n".encode()


def post(client, route: str, data: bytes, content_type: str = MULTIPART):
    return client.post(route, content=data, headers={"Content-Type": content_type})


# ---- the bounds -----------------------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES)
def test_each_part_bound_is_refused_with_its_code(api, route):
    client, _ = api
    image = part("files", good_png(), "a.png")
    cases = [
        (body(part("part_id", b"x" * (FIELD_MAX_BYTES + 1)), image), 413, "payload_too_large"),
        (body(*[part("part_id", b"p") for _ in range(17)], image), 413, "payload_too_large"),
        (body(part("files", b"\x89PNG" + b"\x00" * 200_000, "big.png")), 413,
         "payload_too_large"),
        (body(*[part("files", good_png(i), f"{i}.png") for i in range(5)]), 413,
         "too_many_images"),
        (body(part("files", good_png(), "a.png",
                   b"X-Pad: " + b"p" * PART_HEAD_MAX_BYTES + b"\r\n")), 400, "malformed_request"),
    ]
    for data, status, code in cases:
        r = post(client, route, data)
        assert_error(r, status, code)
        assert r.headers.get("connection") == "close"  # the rest of the body is not read
    assert post(client, route, body(part("part_id", b"x" * 200), image)).status_code == 200


def test_fields_at_their_bound_are_read(api):
    client, _ = api
    data = body(part("source", "é".encode() * 250), part("file", good_png(), "a.png"))
    r = post(client, "/v1/predict", data)
    assert r.status_code == 200 and r.json()["source"] == "é" * 250


# ---- malformed bodies -----------------------------------------------------------------------
IMAGE = good_png()
MALFORMED = {
    "no_boundary": (body(part("file", IMAGE, "a.png")), "multipart/form-data"),
    "empty_body": (b"", MULTIPART),
    "only_closing_boundary": (f"--{B}--\r\n".encode(), MULTIPART),
    "other_boundary": (body(part("file", IMAGE, "a.png")), "multipart/form-data; boundary=OTHER"),
    "truncated": (body(part("file", IMAGE, "a.png"))[:-20], MULTIPART),
    "no_final_boundary": (part("file", IMAGE, "a.png"), MULTIPART),
    "part_without_headers": (f"--{B}\r\n\r\n".encode() + IMAGE + f"\r\n--{B}--\r\n".encode(),
                             MULTIPART),
    "no_content_disposition": (f"--{B}\r\nContent-Type: image/png\r\n\r\n".encode() + IMAGE
                               + f"\r\n--{B}--\r\n".encode(), MULTIPART),
    "disposition_without_name": (f"--{B}\r\nContent-Disposition: form-data\r\n\r\n".encode()
                                 + IMAGE + f"\r\n--{B}--\r\n".encode(), MULTIPART),
    "header_without_colon": (f"--{B}\r\nContent-Disposition form-data\r\n\r\nx\r\n--{B}--\r\n"
                             .encode(), MULTIPART),
    "nul_in_header": (body(part("file", IMAGE, "a.png", b"X-A: a\x00b\r\n")), MULTIPART),
    "nine_headers": (body(part("file", IMAGE, "a.png",
                               b"".join(b"X-%d: v\r\n" % i for i in range(9)))), MULTIPART),
    "header_line_5k": (body(part("file", IMAGE, "a.png", b"X-L: " + b"l" * 5000 + b"\r\n")),
                       MULTIPART),
    "boundary_of_100_chars": (body(part("file", IMAGE, "a.png")).replace(B.encode(), b"b" * 100),
                              "multipart/form-data; boundary=" + "b" * 100),
    "unclosed_quoted_boundary": (body(part("file", IMAGE, "a.png")),
                                 f'multipart/form-data; boundary="{B}'),
    "bare_lf": (body(part("file", IMAGE, "a.png")).replace(b"\r\n", b"\n"), MULTIPART),
    "preamble_and_no_file": (b"garbage before\r\n" + body(part("part_id", b"x")), MULTIPART),
    "text_file_with_traversal_name": (body(part("file", b"hello", "../../../etc/passwd")),
                                      MULTIPART),
    "nul_in_file_name": (body(part("file", IMAGE, "a\x00.png")), MULTIPART),
    "non_utf8_field_name": (f"--{B}\r\nContent-Disposition: form-data; name=\"".encode()
                            + b"\xff\xfe" + f"\"\r\n\r\nx\r\n--{B}--\r\n".encode(), MULTIPART),
    "bogus_charset": (body(part("file", b"text", "a.png")), MULTIPART + "; charset=no-such"),
    "nested_multipart": (body(part("file", body(part("inner", IMAGE, "b.png")), "a.png",
                                   f"Content-Type: multipart/mixed; boundary={B}\r\n".encode())),
                         MULTIPART),
    "base64_transfer_encoding": (body(part("file", base64.b64encode(IMAGE), "a.png",
                                           b"Content-Transfer-Encoding: base64\r\n")),
                                 MULTIPART),
    "empty_file": (body(part("file", b"", "a.png")), MULTIPART),
    "two_dispositions": (body(part("file", IMAGE, "a.png",
                                   b"Content-Disposition: form-data; name=\"x\"\r\n")), MULTIPART),
    "crlf_in_file_name": (body(part("file", b"text", "a\r\nX-Injected: 1")), MULTIPART),
    "only_fields": (body(part("part_id", b"1"), part("source", b"s")), MULTIPART),
    "1000_empty_fields": (body(*[part("f", b"") for _ in range(1000)]), MULTIPART),
    "40_empty_files": (body(*[part("files", b"", f"{i}.png") for i in range(40)]), MULTIPART),
    "form_urlencoded": (b"file=%89PNG", "application/x-www-form-urlencoded"),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_multipart_bodies_get_a_4xx_json_error(api, route, name):
    """Refused with the service's JSON error, or (a lenient reading: a long boundary, bare
    line feeds) scored: never a 5xx."""
    client, _ = api
    data, content_type = MALFORMED[name]
    r = post(client, route, data, content_type)
    if r.status_code == 200:
        results = r.json()["results"] if route.endswith("batch") else [r.json()]
        assert all("error" in x or "score" in x for x in results), r.text
    else:
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert set(r.json()) == {"code", "status", "message"}, r.text


# ---- admission first ------------------------------------------------------------------------
def test_a_batch_is_admitted_before_its_body_is_read(models, tmp_path):
    """With the server at its limit, a batch answers 503 at once, even one whose body would
    be refused: nothing of it was read."""
    with serving(models["good"], tmp_path, max_batch=1, max_queue=1) as (client, service):
        release = hold_inference(service)
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(client.post, "/v1/predict", content=good_png(1))
            deadline = time.monotonic() + 30
            while service.admission.used < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            broken = post(client, "/v1/predict/batch", b"--nothing like a body")
            assert_error(broken, 503, "overloaded")
            release.set()
            assert held.result(60).status_code == 200
        assert_error(post(client, "/v1/predict/batch", b"--nothing like a body"), 400,
                     "malformed_request")
        assert service.admission.used == 0
