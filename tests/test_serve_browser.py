"""The operator page in a real headless Chromium (Debian's ``chromium`` package driven by
Playwright) against a real server: upload an image, wait for the verdict, check that the overlay,
the recent list with thumbnails and the drift panel are shown, take a screenshot.

Skipped, with the reason, where Playwright or the browser is missing. Never downloads a browser
(no ``playwright install``). ``ANOMALY_HOOKS_DOCS_SCREENSHOT=1`` also writes
``docs/serve_page.png`` (the README's picture).
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional

import pytest

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
httpx = pytest.importorskip("httpx", reason="httpx is not installed")

from conftest import ROOT  # noqa: E402
from serve_helpers import (  # noqa: E402
    ServerProcess,
    defect_png,
    good_png,
    save_model_variant,
    with_lineage,
)

TOKEN = "browser-test-token"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-dev-shm-usage"]


def chromium_or_skip() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("browser test skipped: Playwright is not installed (pip install playwright)")
    exe = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which(
        "chromium-browser")
    if not exe or not Path(exe).exists():
        pytest.skip("browser test skipped: no Chromium browser here (Debian: apt-get install "
                    "chromium; or set CHROMIUM=/path/to/chromium)")
    return exe


VIEWPORT = {"width": 1280, "height": 900}  # the documentation's screenshots


@contextlib.contextmanager
def operator_page(chromium: str, problems: List[str], console: bool = True,
                  route: Optional[Callable[[Any], Any]] = None, **options: Any) -> Iterator[Any]:
    """A page of a headless Chromium signed in as the operator (the token as the Basic
    password); its page errors, and with ``console`` its console errors, go to ``problems``.
    ``route``: a handler every request of the page goes through; ``options``: the browser
    context's (``viewport``, ...)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(
                http_credentials={"username": "operator", "password": TOKEN}, **options)
            if route is not None:
                context.route("**/*", route)
            page = context.new_page()
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            if console:
                page.on("console", lambda msg: problems.append(msg.text)
                        if msg.type == "error" else None)
            yield page
        finally:
            browser.close()


@pytest.fixture(scope="session")  # session: set up before the session-scoped model fixture
def chromium() -> str:
    """The browser's path, or a skip with the reason (before the model fixture is built)."""
    return chromium_or_skip()


@pytest.mark.slow
def test_operator_page_upload_verdict_overlay_screenshot(chromium, fitted, tmp_path):
    shelf = tmp_path / "models"
    model = save_model_variant(fitted, shelf / "model.safetensors")
    with_lineage(model, shelf / "updated.safetensors", [
        {"parent_checksum": "a" * 64, "images_added": 12, "labels_used": 3,
         "time": "2026-01-02T03:04:05+00:00"}])
    upload = tmp_path / "scratched_part.png"
    upload.write_bytes(defect_png(77))
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)])}
    with ServerProcess(model, tmp_path, "--token", TOKEN, "--results-dir",
                       str(tmp_path / "results"), "--monitor", "serve_helpers:standin_factory",
                       "--models-dir", str(shelf), env=env) as server:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for i in range(6):  # some history for the list and the chart
            body = defect_png(i) if i in (1, 4) else good_png(i)
            r = httpx.post(server.url + f"/v1/predict?part_id=SN-{1000 + i}", content=body,
                           headers=auth, timeout=60)
            assert r.status_code == 200, r.text
        problems: list = []
        with operator_page(chromium, problems, viewport=VIEWPORT) as page:
            page.goto(server.url + "/", wait_until="load")
            page.wait_for_function("document.querySelectorAll('#recent tr').length >= 6")
            page.fill("#part-id", "SN-2024-0042")
            page.set_input_files("#file", str(upload))
            page.wait_for_selector("#verdict[data-state]", timeout=60000)
            assert page.inner_text("#verdict") == "ANOMALOUS"
            page.wait_for_function(
                "['overlay', 'mask', 'original'].every(id => "
                "document.getElementById(id).complete && "
                "document.getElementById(id).naturalWidth > 0)")
            assert page.eval_on_selector("#overlay", "e => e.naturalWidth") == 112
            assert "SN-2024-0042" in page.inner_text("#r-source")
            # the new inspection appears in the list, with its thumbnail
            page.wait_for_function("document.querySelectorAll('#recent tr').length >= 7")
            page.wait_for_function(
                "[...document.querySelectorAll('#recent img')].every("
                "i => i.complete && i.naturalWidth > 0)")
            assert "SN-2024-0042" in page.inner_text("#recent tr:first-child")
            page.wait_for_function(
                "document.getElementById('drift-state').textContent === 'ok'")
            assert "observed" in page.inner_text("#drift-table")
            # the operating point: the model's threshold and what it was chosen for
            page.wait_for_function(
                "document.querySelectorAll('#operating-table tr').length >= 3")
            operating = page.inner_text("#operating-table")
            assert "objective" in operating and "expected false alarms" in operating
            value = fitted.threshold_.value
            assert f"{value:.4g}"[:3] in page.inner_text("#operating-summary")
            # the model card: the serving version of the models folder, its lineage
            page.wait_for_function("document.getElementById('model-table').textContent"
                                   ".includes('model.safetensors')")
            card = page.inner_text("#model-table")
            assert "version" in card and "no updates" in card and "none" in card
            # the filter keeps anomalous inspections only
            page.check("#only-anomalous")
            page.wait_for_function("document.querySelectorAll('#recent tr').length === 3")
            tags = page.eval_on_selector_all("#recent .tag", "ts => ts.map(t => t.textContent)")
            assert tags == ["anomalous"] * 3
            # the operator overrules the newest anomalous verdict: a false alarm
            page.click("#recent tr:first-child button[data-label='good']")
            page.wait_for_selector("#recent tr:first-child .tag.labelled-good")
            assert page.inner_text("#recent tr:first-child .tag.labelled-good") == \
                "false alarm"
            page.wait_for_function("document.getElementById('false-alarms').textContent"
                                   ".endsWith(': 1')")
            page.uncheck("#only-anomalous")
            page.wait_for_function("document.querySelectorAll('#recent tr').length === 7")
            page.select_option("#label-filter", "good")
            page.wait_for_function("document.querySelectorAll('#recent tr').length === 1")
            page.select_option("#label-filter", "")
            page.wait_for_function("document.querySelectorAll('#recent tr').length === 7")
            shot = page.screenshot(path=str(tmp_path / "serve_page.png"), full_page=True)
            assert shot[:8] == b"\x89PNG\r\n\x1a\n"
            if os.environ.get("ANOMALY_HOOKS_DOCS_SCREENSHOT") == "1":
                (ROOT / "docs" / "serve_page.png").write_bytes(shot)
            # a promoted version shows on the card: its lineage, what to roll back to
            r = httpx.post(server.url + "/v1/admin/promote", headers=auth, timeout=60,
                           json={"version": "updated.safetensors"})
            assert r.status_code == 200, r.text
            page.wait_for_function("document.getElementById('model-table').textContent"
                                   ".includes('1 update(s), 12 image(s) added')")
            card = page.inner_text("#model-table")
            assert "updated.safetensors" in card and "aaaaaaaaaaaa" in card
            assert "model.safetensors (" in card  # rollback to
        assert not problems, problems


@pytest.mark.slow
def test_operator_page_model_selector(chromium, fitted, tmp_path):
    """A server of two models: the page offers both; the selected one scores the upload, and
    the Model card and the recent list are that model's."""
    a = save_model_variant(fitted, tmp_path / "a.safetensors")
    b = save_model_variant(fitted, tmp_path / "b.safetensors", threshold_factor=3.0)
    upload = tmp_path / "part.png"
    upload.write_bytes(defect_png(5))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with ServerProcess(f"line-a={a}", tmp_path, "--model", f"line-b={b}", "--token", TOKEN,
                       "--results-dir", str(tmp_path / "results")) as server:
        r = httpx.post(server.url + "/v1/models/line-a/predict?part_id=A-1",
                       content=good_png(1), headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        problems: list = []
        with operator_page(chromium, problems) as page:
            page.goto(server.url + "/", wait_until="load")
            page.wait_for_function("!document.getElementById('model-select').hidden && "
                                   "document.getElementById('model-select').options"
                                   ".length === 2")
            assert page.eval_on_selector("#model-select", "s => s.value") == "line-a"
            page.wait_for_function("document.querySelectorAll('#recent tr').length === 1")
            page.select_option("#model-select", "line-b")
            page.wait_for_function("document.getElementById('model-table').textContent"
                                   ".includes('(line-b)')")
            page.wait_for_function("document.querySelectorAll('#recent tr').length === 0")
            page.set_input_files("#file", str(upload))
            page.wait_for_selector("#verdict[data-state]", timeout=60000)
            shown = float(page.inner_text("#r-threshold"))
            # shown with 4 significant digits: within half a unit of the 4th
            assert shown == pytest.approx(3 * fitted.threshold_.value, rel=5e-4)
            page.wait_for_function("document.querySelectorAll('#recent tr').length === 1")
            assert "line-b" in page.inner_text("#model-id") or \
                page.inner_text("#model-id").startswith("padim-")
        rows = httpx.get(server.url + "/v1/results", headers=auth, timeout=30).json()["results"]
        assert [r["model_name"] for r in rows] == ["line-b", "line-a"]
        assert not problems, problems


@pytest.mark.slow
def test_api_docs_render_offline(chromium, fitted, tmp_path):
    """``/docs`` (Swagger UI) renders the served OpenAPI document in a real browser that may
    reach nothing but the server: every operation is listed."""
    model = save_model_variant(fitted, tmp_path / "model.safetensors")
    with ServerProcess(model, tmp_path, "--token", TOKEN, "--no-results") as server:
        spec = httpx.get(server.url + "/openapi.json",
                         headers={"Authorization": f"Bearer {TOKEN}"}).json()
        operations = sum(len(ops) for ops in spec["paths"].values())
        elsewhere: list = []
        problems: list = []
        def only_the_server(route):
            if route.request.url.startswith(server.url):
                return route.continue_()
            elsewhere.append(route.request.url)
            return route.abort()

        # the requests it aborts log console errors: only page errors count here
        with operator_page(chromium, problems, console=False,
                           route=only_the_server) as page:
            page.goto(server.url + "/docs", wait_until="load")
            page.wait_for_function(
                f"document.querySelectorAll('.opblock').length === {operations}",
                timeout=60000)
            assert "Unable to render" not in page.inner_text("body")
            assert "/v1/admin/reload" in page.inner_text("body")
            page.screenshot(path=str(tmp_path / "docs.png"), full_page=True)
        assert not elsewhere, elsewhere
        assert not problems, problems


@pytest.mark.slow
def test_operator_workflow_label_update_promote(chromium, tmp_path):
    """The operator's workflow on the page, against a real server and a real update: a new
    material raises false alarms; the operator marks one on the page ("false alarm") and a
    defect ("confirmed defect"), the label filter lists the labelled ones; ``anomaly-hooks
    update --from-results`` and a promote; the Model card shows the new version, what it
    learned from, and what to roll back to. ``ANOMALY_HOOKS_DOCS_SCREENSHOT=1`` writes the
    three pictures of docs/updating.md (docs/workflow_*.png)."""
    import numpy as np
    from conftest import textured_images, with_defect
    from serve_helpers import encode

    from anomaly_hooks.cli import main
    from anomaly_hooks.config import load_config
    from anomaly_hooks.detector import Detector

    def tint(img):  # the same texture on a new material: another colour
        return np.clip(img * np.array([0.6, 1.0, 1.4]), 0, 255).astype(np.uint8)

    shelf, results = tmp_path / "models", tmp_path / "results"
    shelf.mkdir()
    cfg = load_config(None, method="padim", seed=0, device="cpu",
                      backbone={"name": "resnet18", "weights": None},
                      preprocess={"resize": 72, "crop": 64},
                      padim={"n_features": 40, "covariance": "lowrank"},
                      data={"batch_size": 4, "num_workers": 0})
    Detector(cfg).fit(textured_images(12, seed=0), progress=False).save(
        shelf / "v1.safetensors")
    stream = ([("SN-1001", textured_images(1, seed=40)[0]),
               ("SN-1002", with_defect(textured_images(1, seed=41)[0]))]
              + [(f"SN-20{i:02d}", tint(img))
                 for i, img in enumerate(textured_images(5, seed=50), 1)])
    docs = os.environ.get("ANOMALY_HOOKS_DOCS_SCREENSHOT") == "1"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with ServerProcess(shelf / "v1.safetensors", tmp_path, "--token", TOKEN, "--models-dir",
                       str(shelf), "--results-dir", str(results), "--keep-originals",
                       "anomalous") as server:
        ids = []
        for part, img in stream:
            r = httpx.post(server.url + f"/v1/predict?part_id={part}", content=encode(img),
                           headers=auth, timeout=60)
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        problems: list = []
        with operator_page(chromium, problems, viewport=VIEWPORT) as page:
            page.goto(server.url + "/", wait_until="load")
            page.wait_for_function("document.querySelectorAll('#recent tr').length === 7")
            rows = page.locator("#recent tr")
            # the newest inspections: the new material, every one flagged
            assert page.eval_on_selector_all(
                "#recent .tag", "ts => ts.map(t => t.textContent)")[:5] == ["anomalous"] * 5
            rows.nth(0).locator("button[data-label='good']").click()
            page.wait_for_selector("#recent tr:first-child .tag.labelled-good")
            rows.nth(5).locator("button[data-label='defect']").click()  # SN-1002
            page.wait_for_selector("#recent tr:nth-child(6) .tag.labelled-defect")
            page.wait_for_function("document.getElementById('false-alarms').textContent"
                                   ".endsWith(': 1')")
            page.wait_for_function(
                "[...document.querySelectorAll('#recent img')].every("
                "i => i.complete && i.naturalWidth > 0)")
            shots = {"label": page.locator("#recent-card").screenshot()}
            for rid in ids[2:6]:  # the other false alarms, through the API
                r = httpx.post(server.url + f"/v1/results/{rid}/label", headers=auth,
                               json={"label": "good", "note": "new material"}, timeout=30)
                assert r.status_code == 200, r.text
            page.select_option("#label-filter", "good")
            page.wait_for_function("document.querySelectorAll('#recent tr').length === 5")
            page.wait_for_function(
                "[...document.querySelectorAll('#recent img')].every("
                "i => i.complete && i.naturalWidth > 0)")
            assert page.eval_on_selector_all(
                "#recent .tag.labelled-good", "ts => ts.length") == 5
            shots["filter"] = page.locator("#recent-card").screenshot()
            # the update from the results log, then the promote
            assert main(["update", "--model", str(shelf / "v1.safetensors"),
                         "--from-results", str(results), "--out",
                         str(shelf / "v2.safetensors"), "--quiet"]) == 0
            r = httpx.post(server.url + "/v1/admin/promote", headers=auth, timeout=60,
                           json={"version": "v2.safetensors"})
            assert r.status_code == 200, r.text
            page.reload(wait_until="load")  # the card refreshes itself every 10 s
            page.wait_for_function("document.getElementById('model-table').textContent"
                                   ".includes('learned from')", timeout=60000)
            card = page.inner_text("#model-table")
            assert "v2.safetensors" in card and "v1.safetensors (" in card
            assert "5 result(s) labelled good, 1 defect" in card
            shots["promoted"] = page.locator("#model-card").screenshot()
            # the new material passes now; the defect does not
            for part, img in stream[1:4]:
                r = httpx.post(server.url + f"/v1/predict?part_id={part}-again",
                               content=encode(img), headers=auth, timeout=60)
                assert r.json()["is_anomalous"] == (part == "SN-1002"), r.json()
        assert not problems, problems
        for name, shot in shots.items():
            assert shot[:8] == b"\x89PNG\r\n\x1a\n"
            if docs:
                (ROOT / "docs" / f"workflow_{name}.png").write_bytes(shot)
