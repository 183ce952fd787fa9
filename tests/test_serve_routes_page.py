"""The operator page (routes/page.py) and its static files: self-contained, nothing from
elsewhere (production lines are often air-gapped), no HTML parsing of client-given text."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
import serve_helpers  # noqa: E402
from serve_helpers import serving  # noqa: E402

models = serve_helpers.models
STATIC = Path(__file__).resolve().parents[1] / "anomaly_hooks" / "serve" / "static"


def test_page_and_static_files_are_self_contained(models, tmp_path):
    with serving(models["good"], tmp_path, wait=False) as (client, _):
        page = client.get("/")
        assert page.status_code == 200 and 'id="file"' in page.text
        assert "/static/app.js" in page.text
        assert page.headers["cache-control"] == "no-cache"
        for f in STATIC.iterdir():
            r = client.get(f"/static/{f.name}")
            assert r.status_code == 200
            assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", r.text, re.I), f.name
    assert "innerHTML" not in (STATIC / "app.js").read_text()
