"""The assembled app (app.py, middleware.py, schemas.py): the OpenAPI document against the routes,
the API docs served from this server only, bearer-token auth, the framework's errors in the
service's JSON body, and the stable error codes."""
from __future__ import annotations

import base64
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
import serve_helpers  # noqa: E402
from fastapi.routing import APIRoute  # noqa: E402
from serve_helpers import TOKEN, assert_error, good_png, serving  # noqa: E402

from anomaly_hooks.serve.errors import CODES  # noqa: E402
from anomaly_hooks.serve.routes import ROUTERS  # noqa: E402

models = serve_helpers.models
SERVE = Path(__file__).resolve().parents[1] / "anomaly_hooks" / "serve"
HTTP_METHODS = {"get", "post", "put", "patch", "delete"}


@pytest.fixture(scope="module")
def api(models, tmp_path_factory):
    with serving(models["good"], tmp_path_factory.mktemp("serve_app")) as (client, service):
        yield client, service


def api_routes():
    """(method, path) -> APIRoute of every route the OpenAPI document should describe."""
    return {(method.lower(), route.path): route
            for router in ROUTERS for route in router.routes
            if isinstance(route, APIRoute) and route.include_in_schema
            for method in route.methods}


# ---- the OpenAPI document -------------------------------------------------------------------
def test_openapi_lists_exactly_the_api_routes(api):
    client, _ = api
    doc = client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1") and doc["info"]["title"]
    listed = {(m, p) for p, ops in doc["paths"].items() for m in ops if m in HTTP_METHODS}
    assert listed == set(api_routes())
    assert {p for _, p in listed} >= {"/v1/predict", "/v1/predict/batch", "/v1/results",
                                      "/v1/results.csv", "/v1/results/{record_id}",
                                      "/v1/results/{record_id}/{picture}", "/v1/model",
                                      "/v1/admin/reload", "/v1/drift", "/healthz", "/readyz",
                                      "/metrics"}
    # the pages and the docs are not API routes
    assert not {"/", "/docs", "/openapi.json", "/static"} & {p for _, p in listed}
    assert client.get("/redoc").status_code == 404  # no ReDoc: it loads its logo from a CDN
    assert "HTTPValidationError" not in doc["components"]["schemas"]  # errors: one body


def test_openapi_declares_each_routes_response_model_and_errors(api):
    client, _ = api
    doc = client.get("/openapi.json").json()
    error_codes = {status: {c for s, c, _ in CODES if s == status} for status, _, _ in CODES}
    for (method, path), route in api_routes().items():
        op = doc["paths"][path][method]
        assert op.get("summary"), (method, path)
        ok = op["responses"]["200"]["content"]
        if route.response_model is not None:
            assert ok["application/json"]["schema"]["$ref"].endswith(
                "/" + route.response_model.__name__), (method, path)
        else:  # a file, a CSV or the metrics: its media type
            assert "application/json" not in ok and ok, (method, path)
        errors = {int(s): r for s, r in op["responses"].items() if s != "200"}
        assert 500 in errors, (method, path)
        for status, resp in errors.items():
            schema = resp["content"]["application/json"]["schema"]
            assert schema["$ref"].endswith("/ErrorBody"), (method, path, status)
            for code in error_codes[status]:
                assert f"`{code}`" in resp["description"], (method, path, status, code)
        protected = path not in ("/healthz", "/readyz")
        assert (401 in errors) == protected, (method, path)
        params = [p for p in op.get("parameters", []) if p["schema"].get("type") == "integer"
                  or any(s.get("type") == "integer" for s in p["schema"].get("anyOf", []))]
        for p in params:  # every integer is bounded to a 64-bit SQLite INTEGER
            schema = next((s for s in [p["schema"], *p["schema"].get("anyOf", [])]
                           if s.get("type") == "integer"))
            assert 1 <= schema["minimum"] and schema["maximum"] <= 2**63 - 1, (path, p)


def test_verdict_schema_is_the_librarys_verdict(api):
    """One definition: the Verdict schema has prediction.Verdict's fields, in order, with its
    docs, and the prediction and the results-log record extend it."""
    from anomaly_hooks.prediction import VERDICT_FIELDS

    client, _ = api
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("Prediction", "ResultRecord", "BatchPrediction"):
        props = schemas[name]["properties"]
        assert list(props)[:len(VERDICT_FIELDS)] == VERDICT_FIELDS, name
        for field in VERDICT_FIELDS:
            assert props[field]["description"], (name, field)
        assert set(VERDICT_FIELDS) <= set(schemas[name]["required"]), name


def test_every_error_code_raised_is_documented():
    raised = set()
    for path in SERVE.rglob("*.py"):
        text = path.read_text()
        raised |= {(int(s), c) for s, c in re.findall(r'ServeError\(\s*(\d+),\s*"(\w+)"', text)}
    documented = {(s, c) for s, c, _ in CODES}
    assert raised and raised <= documented, raised - documented
    assert len({c for _, c, _ in CODES}) == len(CODES)  # one status per code


# ---- the API docs, offline ------------------------------------------------------------------
class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list = []

    def handle_starttag(self, tag, attrs):
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]


def test_docs_load_their_assets_from_this_server(api):
    client, _ = api
    page = "/docs"
    r = client.get(page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    links = _Links()
    links.feed(r.text)
    assert len(links.urls) >= 2, links.urls
    scripts = re.findall(r"""url\s*:\s*['"]([^'"]+)['"]""", r.text)
    assert "/openapi.json" in scripts
    for url in links.urls + scripts:
        assert url.startswith("/") and not url.startswith("//"), url  # never another host
        got = client.get(url)
        assert got.status_code == 200, url
    assert not re.search(r"https?://(?!www\.w3\.org)", r.text), "an absolute URL in " + page
    assert '"validatorUrl": null' in r.text  # Swagger UI's validator is on its site


def test_swagger_ui_assets_are_the_bundle(api):
    client, _ = api
    js = client.get("/docs/assets/swagger-ui-bundle.js")
    css = client.get("/docs/assets/swagger-ui.css")
    assert "javascript" in js.headers["content-type"] and "SwaggerUIBundle" in js.text
    assert css.headers["content-type"].startswith("text/css") and len(css.content) > 10_000


# ---- auth -----------------------------------------------------------------------------------
def test_bearer_token_auth(models, tmp_path):
    with serving(models["good"], tmp_path, token=TOKEN) as (client, _):
        client.headers.pop("Authorization")
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200
        for method, url in [("post", "/v1/predict"), ("get", "/v1/model"), ("get", "/metrics"),
                            ("get", "/v1/results"), ("get", "/v1/results.csv"),
                            ("get", "/v1/drift"), ("post", "/v1/admin/reload"),
                            ("post", "/v1/predict/batch"), ("get", "/openapi.json")]:
            r = getattr(client, method)(url)
            assert_error(r, 401, "unauthorized")
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
        # what a browser opens asks for Basic credentials (the token as the password)
        for url in ("/", "/docs", "/static/app.js", "/docs/assets/swagger-ui.css"):
            r = client.get(url)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Basic"), url
        wrong = {"Authorization": "Bearer nope-nope-nope"}
        assert assert_error(client.get("/v1/model", headers=wrong), 401,
                            "unauthorized")["message"] == "wrong token"
        ok = {"Authorization": f"Bearer {TOKEN}"}
        assert client.post("/v1/predict", content=good_png(), headers=ok).status_code == 200
        basic = {"Authorization": "Basic " + base64.b64encode(f"operator:{TOKEN}".encode()
                                                              ).decode()}
        for url in ("/", "/docs", "/openapi.json", "/docs/assets/swagger-ui.css"):
            assert client.get(url, headers=basic).status_code == 200, url
        bad_basic = base64.b64encode(b"operator:guess").decode()
        assert client.get("/", headers={"Authorization": f"Basic {bad_basic}"}).status_code == 401


def test_a_request_head_over_16_kib_is_431(api):
    """Thousands of headers, or one huge, never reach the routes (a head that arrives in
    pieces is refused by the server's HTTP parser: tests/test_serve_attacks.py)."""
    client, _ = api
    r = client.get("/healthz", headers={f"X-{i}": "v" * 100 for i in range(200)})
    assert_error(r, 431, "headers_too_large")
    assert r.headers["connection"] == "close"
    assert client.get("/healthz", headers={"X-A": "v" * 8000}).status_code == 200


# ---- the framework's errors -----------------------------------------------------------------
def test_unknown_route_and_method(api):
    client, _ = api
    assert_error(client.get("/v2/nothing"), 404, "not_found")
    assert_error(client.get("/v1/predict"), 405, "method_not_allowed")
    assert_error(client.delete("/v1/results/1"), 405, "method_not_allowed")


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# (method, url, headers): none may see what the token guards
BYPASS_PROBES = [
    ("GET", "/v1/model", {}), ("GET", "/v1/model", {"Authorization": "Bearer"}),
    ("GET", "/v1/model", {"Authorization": "Bearer "}),
    ("GET", "/v1/model", {"Authorization": "Bearer    "}),
    ("GET", "/v1/model", {"Authorization": "Bearer wrong-token-123"}),
    ("GET", "/v1/model", {"Authorization": f"Bearer {TOKEN[:-1]}"}),
    ("GET", "/v1/model", {"Authorization": f"Bearer {TOKEN}x"}),
    ("GET", "/v1/model", {"Authorization": f"Bearer {TOKEN.upper()}"}),
    ("GET", "/v1/model", {"Authorization": f"Bearer\t{TOKEN}"}),
    ("GET", "/v1/model", {"Authorization": TOKEN}),
    ("GET", "/v1/model", {"Authorization": f"Token {TOKEN}"}),
    ("GET", "/v1/model", {"Authorization": f"Digest {TOKEN}"}),
    ("GET", "/v1/model", {"Authorization": f"Basic {_b64(TOKEN)}"}),
    ("GET", "/v1/model", {"Authorization": f"Basic {_b64(TOKEN + ':')}"}),
    ("GET", "/v1/model", {"Authorization": f"Basic {_b64(':wrong')}"}),
    ("GET", "/v1/model", {"Authorization": "Basic not-base64!!"}),
    ("GET", "/v1/model", {"Authorization": f"Basic {_b64('operator:' + TOKEN)[:-2]}"}),
    ("GET", "/v1/model", {"X-Api-Key": TOKEN}), ("GET", "/v1/model", {"Cookie": f"token={TOKEN}"}),
    ("GET", f"/v1/model?token={TOKEN}", {}), ("GET", f"/v1/model?access_token={TOKEN}", {}),
    ("GET", "/v1/model", {"X-Forwarded-For": "127.0.0.1", "Host": "localhost"}),
    ("GET", "/v1/model/", {}), ("GET", "//v1/model", {}), ("GET", "/V1/MODEL", {}),
    ("GET", "/healthz%2F..%2Fv1%2Fmodel", {}), ("GET", "/healthz;/v1/model", {}),
    ("GET", "/readyz/../v1/model", {}), ("GET", "/v1/model%00", {}), ("GET", "/%76%31/model", {}),
    ("GET", "/v1/model%20", {}), ("HEAD", "/v1/model", {}), ("OPTIONS", "/v1/model", {}),
    ("TRACE", "/v1/model", {}), ("OPTIONS", "/v1/admin/reload", {}),
    ("POST", "/v1/admin/reload", {"Authorization": "Bearer wrong-token-123"}),
    ("GET", "/v1/results.csv", {"Authorization": f"Basic {_b64('admin:admin')}"}),
]


@pytest.mark.parametrize("method, url, headers", BYPASS_PROBES)
def test_auth_bypass_probes_see_nothing(token_api, method, url, headers):
    """Wrong, truncated, differently cased or misplaced tokens, other schemes, path and
    method tricks: 401 (or the 404/405 of no such route), never what the token guards."""
    client, _ = token_api
    r = client.request(method, url, headers=headers)
    assert r.status_code in (401, 404, 405), (r.status_code, r.text)
    assert "model_id" not in r.text and "file_sha256" not in r.text


@pytest.fixture(scope="module")
def token_api(models, tmp_path_factory):
    with serving(models["good"], tmp_path_factory.mktemp("serve_token"),
                 token=TOKEN) as (client, service):
        client.headers.pop("Authorization")
        yield client, service
