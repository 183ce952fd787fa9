"""Every route's path and query parameters fuzzed against a real app with a small fitted model,
driven by the served OpenAPI document: never a 5xx, every status one the document declares for
the operation, every body JSON of the declared model (or of the declared media type).

Hypothesis draws an operation, then for each of its parameters either a value that fits the
schema or a hostile one (integers beyond 64 bits, NaN, infinities, NUL, path tricks, long
strings), with or without the token. ``test_schemathesis_conformance`` runs the same promise
through schemathesis where it is installed."""
from __future__ import annotations

import json
from typing import Any, Dict, Optional, Tuple
from urllib.parse import quote

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
import serve_helpers  # noqa: E402
from fastapi.routing import APIRoute  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402
from serve_helpers import TOKEN, defect_png, good_png, serving  # noqa: E402

from anomaly_hooks.serve.routes import ROUTERS  # noqa: E402
from anomaly_hooks.serve.schemas import ErrorBody  # noqa: E402

models = serve_helpers.models
pytestmark = pytest.mark.slow

HOSTILE = ["99999999999999999999999", "-99999999999999999999999", str(2**63), str(2**63 - 1),
           "0", "-1", "1.5", "1e999", "-1e999", "nan", "NaN", "inf", "-inf", "", " ", "%00",
           "\x00", "../../../etc/passwd", "/dev/zero", "/dev/stdin", "true", "null", "[]",
           "{}", "0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "2026-02-30",
           "x" * 5000, "\u202e\U0001f600", "a/b", "%2e%2e", "1_000"]
BASE = "http://testserver"
BODIES = [None, b"", b"junk", b"{}", b'{"path": 3}', b"[" * 2000 + b"]" * 2000]


@pytest.fixture(scope="module")
def app(models, tmp_path_factory):
    """A served model with a results log holding a few records (pictures kept)."""
    with serving(models["good"], tmp_path_factory.mktemp("serve_fuzz"), token=TOKEN,
                 keep_images="all") as (client, service):
        for png in (good_png(1), defect_png(2), good_png(3)):
            assert client.post("/v1/predict", content=png).status_code == 200
        yield client, client.get("/openapi.json").json()


def _routes() -> Dict[Tuple[str, str], APIRoute]:
    return {(m.lower(), r.path): r for router in ROUTERS for r in router.routes
            if isinstance(r, APIRoute) and r.include_in_schema for m in r.methods}


def _fitting(schema: Dict[str, Any]) -> st.SearchStrategy[str]:
    """Values of a parameter that its schema allows, as query text."""
    options = [schema, *schema.get("anyOf", [])]
    for s in options:
        if "enum" in s:
            return st.sampled_from([str(v) for v in s["enum"]])
        if s.get("type") == "integer":
            return st.integers(s.get("minimum", -(2**70)), s.get("maximum", 2**70)).map(str)
        if s.get("type") == "boolean":
            return st.sampled_from(["true", "false", "1", "0", "yes", "off"])
    longest = next((s["maxLength"] for s in options if "maxLength" in s), 300)
    return st.text(max_size=min(longest + 2, 300))


def _value(schema: Dict[str, Any]) -> st.SearchStrategy[str]:
    return st.one_of(_fitting(schema), st.sampled_from(HOSTILE), st.text(max_size=40),
                     st.integers(-(2**80), 2**80).map(str))


@st.composite
def requests(draw, doc: Dict[str, Any], method: str, path: str):
    """(url, query, body) of one request to the operation ``method path`` of the document."""
    op = doc["paths"][path][method]
    url = path
    query: Dict[str, str] = {}
    for param in op.get("parameters", []):
        if param["in"] == "path":
            value = draw(_value(param["schema"]))
            url = url.replace("{" + param["name"] + "}", quote(value, safe="") or "%20")
        elif draw(st.booleans()):
            query[param["name"]] = draw(_value(param["schema"]))
    body: Optional[bytes] = None
    if method == "post":
        body = draw(st.sampled_from([*BODIES, good_png(4)]))
    return url, query, body


def _check(doc: Dict[str, Any], method: str, path: str, response) -> None:
    """The response keeps the document's promise for its operation."""
    status = response.status_code
    assert status < 500, response.text
    declared = doc["paths"][path][method]["responses"]
    assert str(status) in declared, (status, sorted(declared))
    content = declared[str(status)].get("content", {})
    ctype = response.headers.get("content-type", "").split(";")[0]
    assert ctype in content or any(ctype.startswith(c.rstrip("*")) for c in content), (
        ctype, list(content))
    if ctype != "application/json":
        return
    body = json.loads(response.content)  # a body that is not JSON fails here
    route = _routes()[(method, path)]
    model = route.response_model if status == 200 else ErrorBody
    TypeAdapter(model).validate_python(body)


@pytest.mark.parametrize("method, path", sorted(_routes()))
def test_fuzz_every_route(app, method, path):
    client, doc = app
    assert path in doc["paths"] and method in doc["paths"][path]

    @settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests(doc, method, path), st.integers(0, 9))
    def run(request, dice):
        url, query, body = request
        headers = {"Content-Type": "application/json" if "admin" in path else "image/png"}
        if dice == 0:  # now and then without the token
            headers["Authorization"] = ""
        response = client.request(method.upper(), url, params=query, content=body,
                                  headers=headers)
        _check(doc, method, path, response)

    run()


def test_schemathesis_conformance(app):
    """The same promise, checked by schemathesis against the published document (its own
    strategies; its checks of status codes, content types and response schemas) where it is
    installed."""
    schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed")
    requests = pytest.importorskip("requests", reason="requests is not installed")
    from schemathesis import checks

    client, doc = app
    schema = schemathesis.openapi.from_dict(doc)
    # (not "positive data acceptance": an image field that fits the schema is any bytes, and
    # the server rightly refuses bytes that are not an image)
    promise = [checks.not_a_server_error, checks.status_code_conformance,
               checks.content_type_conformance, checks.response_schema_conformance]
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=20, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(operation.as_strategy())
        def run(case):
            # the bytes schemathesis would send (its kwargs are for requests, not httpx)
            sent = requests.Request(**case.as_transport_kwargs(base_url=BASE)).prepare()
            response = client.request(sent.method, sent.path_url, content=sent.body,
                                      headers={k: v for k, v in sent.headers.items()
                                               if k.lower() != "content-length"})
            _check(doc, case.method.lower(), case.path, response)
            case.validate_response(response, checks=promise)

        try:
            run()
        except AssertionError as exc:  # every operation's failure, then one report
            failures.append(f"{operation.method} {operation.path}: {exc}")
    assert not failures, "\n".join(failures)
