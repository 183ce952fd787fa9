"""The edge service: ``anomaly-hooks serve --model m.onnx`` serves an exported model on the ONNX
engine (ONNX Runtime, numpy, Pillow) -- the same API, page, results log and metrics -- where
``import torch`` fails; the drift monitor is off there and says why.

Scores are compared with :class:`~anomaly_hooks.runtime.OnnxDetector`'s on the same image files.
The tolerance is the float32 rounding of the graph, derived as follows: the service and the
runtime run the same float32 graph on bit-identical inputs (the same decoder and the same
numpy preprocessing, :meth:`OnnxDetector.preprocess`), and the JSON answer carries the float32
score exactly (its float64 ``repr``). With one image per session run on both sides nothing
differs, so the scores are equal to the last bit. With several images in one run, the batch
size changes the order in which ONNX Runtime's convolution and matrix kernels add each
output's float32 terms; a reordered float32 sum moves by a few units in the last place (ulp)
of its terms, and the image score (the heatmap's maximum, not a sum) inherits that: measured
2 ulp of the score on this model; :data:`BATCH_ULPS` allows 16.
"""
from __future__ import annotations

import base64
import io
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, textured_images, with_defect
from PIL import Image

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytest.importorskip("httpx", reason="httpx is not installed")
pytest.importorskip("onnx", reason="the [export] extra is not installed")
pytest.importorskip("onnxruntime", reason="the [runtime] extra is not installed")

from serve_helpers import ServerProcess, assert_error, serving  # noqa: E402

from anomaly_hooks.errors import ConfigError  # noqa: E402
from anomaly_hooks.runtime import OnnxDetector  # noqa: E402

BATCH_ULPS = 16  # several images per session run: see the module's docstring
EDGE_SCRIPT = ROOT / "deploy" / "install-edge.sh"

# ``import torch`` (and torchvision) fails in a process that runs this first, and every
# attempt is written to the file named by $EDGE_TORCH_LOG: the server below must make none.
NO_TORCH = textwrap.dedent("""\
    import os, sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "torchvision"):
                with open(os.environ["EDGE_TORCH_LOG"], "a") as fh:
                    fh.write(name + "\\n")
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, NoTorch())
    """)
# the documented command, run by a Python in which torch cannot be imported
LAUNCHER = NO_TORCH + "from anomaly_hooks.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def ulps(a: float, b: float) -> float:
    """|a - b| in float32 units in the last place of ``b``."""
    return abs(a - b) / float(np.spacing(np.float32(abs(b))))


@pytest.fixture(scope="module")
def edge(fitted, tmp_path_factory):
    """(an exported .onnx model of the fitted detector, its image files: five good, one
    with a defect)."""
    from anomaly_hooks.export import export_onnx

    root = tmp_path_factory.mktemp("edge")
    path = export_onnx(fitted, root / "m.onnx")
    images = textured_images(5, seed=9) + [with_defect(textured_images(1, seed=10)[0])]
    files = []
    for i, img in enumerate(images):
        Image.fromarray(img).save(root / f"{i:02d}.png")
        files.append(root / f"{i:02d}.png")
    return path, files


def one_by_one(path: Path, files) -> list:
    """OnnxDetector's predictions of each file in a run of its own."""
    det = OnnxDetector.load(path)
    return [det.predict(str(f)) for f in files]


# ---- in process (fast) ----------------------------------------------------------------------
def test_the_engine_is_chosen_by_the_file_suffix():
    from anomaly_hooks.serve.engine import engine_class
    from anomaly_hooks.serve.engine_onnx import OnnxEngine
    from anomaly_hooks.serve.engine_torch import TorchEngine

    assert engine_class("a/m.onnx") is engine_class("M.ONNX") is OnnxEngine
    assert engine_class("m.safetensors") is engine_class("m.onnx.bak") is TorchEngine
    assert OnnxEngine.drift_unavailable and TorchEngine.drift_unavailable is None


def test_onnx_device_choices():
    from anomaly_hooks.serve.engine_onnx import providers_for

    assert providers_for(None) == providers_for("cpu") == ["CPUExecutionProvider"]
    assert providers_for("auto")[-1] == "CPUExecutionProvider"
    with pytest.raises(ConfigError, match="cpu, cuda, cuda:N or auto"):
        providers_for("mps")
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        with pytest.raises(ConfigError, match="no CUDA provider"):
            providers_for("cuda:0")


def test_onnx_model_served_in_process(edge, tmp_path):
    """The ONNX engine behind the whole app: predictions equal the runtime's, the results log,
    the page, /metrics, /v1/model; /v1/drift says why there is no monitor."""
    path, files = edge
    expected = one_by_one(path, files)
    with serving(path, tmp_path, monitor=None, keep_images="all") as (client, service):
        service.settings.monitor = "auto"  # the CLI's default: a monitor where the model can
        assert service.engine.kind == "onnx"
        got = []
        for f in files:  # one at a time: one image per session run, as one_by_one
            r = client.post("/v1/predict", content=f.read_bytes(),
                            params={"source": f.name, "heatmap": "png"})
            assert r.status_code == 200, r.text
            got.append(r.json())
        for body, exp in zip(got, expected):
            assert body["score"] == exp.score  # bit-identical (module docstring)
            assert body["is_anomalous"] == exp.is_anomalous
            assert body["threshold"] == exp.threshold
            assert body["anomalous_pixels"] == int(exp.mask.sum())
            overlay = Image.open(io.BytesIO(base64.b64decode(body["overlay_png"])))
            assert overlay.size == exp.heatmap.shape[::-1]
        assert got[-1]["is_anomalous"] and not got[0]["is_anomalous"]
        page = client.get("/v1/results", params={"limit": 50}).json()
        assert page["count"] == len(files)
        assert {r["source"] for r in page["results"]} == {f.name for f in files}
        assert all(r["thumb_url"] for r in page["results"])
        row = page["results"][0]
        assert client.get(row["overlay_url"]).headers["content-type"] == "image/png"
        assert "drift-card" in client.get("/").text
        metrics = client.get("/metrics").text
        assert 'engine="onnx"' in metrics
        assert 'anomaly_hooks_drift_enabled{model="default"} 0.0' in metrics
        info = client.get("/v1/model").json()
        assert info["engine"] == "onnx" and info["fitted_on"] is None
        assert info["export"]["scorer_form"] and info["device"] == "CPUExecutionProvider"
        assert info["drift_monitor"] is False and "ONNX" in info["drift_unavailable"]
        reason = assert_error(client.get("/v1/drift"), 409, "drift_unavailable")["message"]
        assert "layers' statistics" in reason and "without a drift monitor" in reason
        service.settings.monitor = "none"  # asked for none: nothing to explain
        assert client.get("/v1/drift").json() == {"enabled": False}


def test_a_pytorch_model_where_torch_is_missing_is_refused_with_what_to_do(monkeypatch):
    from anomaly_hooks.errors import ModelFileError
    from anomaly_hooks.serve.engine import engine_class

    monkeypatch.setitem(sys.modules, "anomaly_hooks.serve.engine_torch", None)
    with pytest.raises(ModelFileError, match="PyTorch cannot be imported here .*serve the "
                       r"\.onnx file"):
        engine_class("m.safetensors")
    assert engine_class("m.onnx").kind == "onnx"


def test_reload_switches_between_the_engines(edge, fitted, tmp_path):
    """An admin reload loads a .safetensors model beside a serving .onnx one and back; each
    answers with its own engine and the results log keeps both models' rows."""
    import shutil

    from serve_helpers import TOKEN, good_png

    path, _ = edge
    folder = tmp_path / "models"
    folder.mkdir()
    onnx = Path(shutil.copy(path, folder / "m.onnx"))
    torch_model = fitted.save(folder / "m.safetensors")
    with serving(onnx, tmp_path, token=TOKEN) as (client, service):
        ids = [client.post("/v1/predict", content=good_png(1)).json()["model"]["id"]]
        for target, kind in ((torch_model, "torch"), (onnx, "onnx")):
            r = client.post("/v1/admin/reload", json={"path": str(target)})
            assert r.status_code == 200, r.text
            assert service.engine.kind == kind and client.get("/v1/model").json()["engine"] == kind
            body = client.post("/v1/predict", content=good_png(1)).json()
            ids.append(body["model"]["id"])
        assert ids[0] == ids[2] != ids[1]
        assert client.get("/v1/results").json()["count"] == 3


def test_onnx_batch_request_matches_the_runtime_batch(edge, tmp_path):
    """A batch request scores its images together: within :data:`BATCH_ULPS` of the
    runtime's batch prediction (module docstring)."""
    path, files = edge
    expected = OnnxDetector.load(path).predict([str(f) for f in files])
    with serving(path, tmp_path) as (client, _):
        r = client.post("/v1/predict/batch", files=[("files", (f.name, f.read_bytes(),
                                                              "image/png")) for f in files])
        assert r.status_code == 200, r.text
        results = r.json()["results"]
    assert [x["filename"] for x in results] == [f.name for f in files]
    for body, exp in zip(results, expected):
        assert ulps(body["score"], exp.score) <= BATCH_ULPS, (body["score"], exp.score)
        assert body["is_anomalous"] == exp.is_anomalous


# ---- a real server process where torch cannot be imported (slow) ----------------------------
def blocked_env(tmp_path: Path) -> dict:
    log = tmp_path / "torch_imports.log"
    return {"EDGE_TORCH_LOG": str(log)}


@pytest.mark.slow
def test_edge_service_process_without_torch(edge, tmp_path):
    """``anomaly-hooks serve --model m.onnx`` in a process where ``import torch`` fails (and
    is never attempted): predictions over HTTP equal the runtime's, results log rows are
    written, the page, /metrics and the API docs are served, /v1/drift answers 409."""
    import httpx

    path, files = edge
    env = blocked_env(tmp_path)
    log = Path(env["EDGE_TORCH_LOG"])
    # the blocker works: a plain import of torch fails under it (and is logged)
    probe = subprocess.run([sys.executable, "-c", NO_TORCH + "import torch\n"],
                           capture_output=True, text=True, env={**os.environ, **env})
    assert probe.returncode != 0 and "blocked" in probe.stderr
    assert log.read_text() == "torch\n"
    log.unlink()
    expected = one_by_one(path, files)
    results = tmp_path / "results"
    with ServerProcess(path, tmp_path, "--results-dir", str(results), "--keep-images", "all",
                       env=env, launcher=[sys.executable, "-c", LAUNCHER]) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        for f, exp in zip(files, expected):
            r = client.post("/v1/predict", content=f.read_bytes(), params={"part_id": f.stem})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["score"] == exp.score and body["is_anomalous"] == exp.is_anomalous
            assert body["anomalous_pixels"] == int(exp.mask.sum())
        page = client.get("/")
        assert page.status_code == 200 and "drift-card" in page.text
        assert client.get("/static/app.js").status_code == 200
        metrics = client.get("/metrics").text
        assert 'engine="onnx"' in metrics
        n_bad = sum(e.is_anomalous for e in expected)
        assert (f'anomaly_hooks_predictions_total{{model="default",verdict="anomalous"}} '
                f'{float(n_bad)}') in metrics
        assert (f'anomaly_hooks_predictions_total{{model="default",verdict="normal"}} '
                f'{float(len(files) - n_bad)}') in metrics
        assert client.get("/openapi.json").status_code == 200
        assert_error(client.get("/v1/drift"), 409, "drift_unavailable")
        assert client.get("/v1/model").json()["engine"] == "onnx"
        assert client.get("/v1/results").json()["count"] == len(files)
    assert "no drift monitor" in server.log()
    with sqlite3.connect(results / "results.sqlite") as db:
        rows = db.execute("SELECT part_id, score FROM results ORDER BY id").fetchall()
    assert [r[0] for r in rows] == [f.stem for f in files]
    assert [r[1] for r in rows] == [e.score for e in expected]
    assert not log.exists(), f"the server imported torch: {log.read_text()}"


# ---- the edge install: a venv without PyTorch (slow) ----------------------------------------
@pytest.mark.slow
def test_install_edge_script(edge, tmp_path):
    """deploy/install-edge.sh makes a venv without PyTorch; the service runs from it on an
    exported model and predicts."""
    import httpx

    path, files = edge
    venv = tmp_path / "edge-venv"
    out = subprocess.run(["bash", str(EDGE_SCRIPT), str(venv)], capture_output=True, text=True,
                         timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    python = venv / "bin" / "python"
    no_torch = subprocess.run([str(python), "-c", "import torch"], capture_output=True,
                              text=True)
    assert no_torch.returncode != 0 and "torch" in no_torch.stderr
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([str(python), "-c", "import anomaly_hooks; print(anomaly_hooks.__file__)"
                            ], capture_output=True, text=True, env=clean, cwd=tmp_path)
    assert str(venv) in where.stdout, where.stdout + where.stderr
    expected = one_by_one(path, files[-1:])[0]
    with ServerProcess(path, tmp_path, "--no-results", env={**clean, "PYTHONPATH": ""},
                       launcher=[str(venv / "bin" / "anomaly-hooks")]) as server:
        r = httpx.post(server.url + "/v1/predict", content=files[-1].read_bytes(), timeout=60)
        assert r.status_code == 200, r.text + server.log()
        assert r.json()["score"] == expected.score and r.json()["is_anomalous"]


# ---- the deployment examples (fast: read, not run) ------------------------------------------
def _deploy_commands():
    """(the unit's ExecStart, the Dockerfile's CMD, the Dockerfile's RUN lines) as words."""
    import json
    import shlex

    unit = (ROOT / "deploy" / "anomaly-hooks-edge.service").read_text()
    start = next(line.split("=", 1)[1] for line in unit.splitlines()
                 if line.startswith("ExecStart="))
    docker = (ROOT / "deploy" / "Dockerfile.edge").read_text().replace("\\\n", " ")
    lines = docker.splitlines()
    cmd = json.loads(next(line[len("CMD "):] for line in lines if line.startswith("CMD ")))
    runs = [line[len("RUN "):] for line in lines if line.startswith("RUN ")]
    return shlex.split(start), cmd, runs


def test_deploy_examples_use_the_install_script_and_the_same_command():
    """The systemd unit and the Dockerfile run the venv the install script makes, with one
    ``serve`` command line (the host aside) that the command's own parser accepts."""
    import argparse

    from anomaly_hooks.serve.cli import add_arguments

    start, cmd, runs = _deploy_commands()
    assert any("deploy/install-edge.sh /opt/anomaly-hooks" in run for run in runs)
    assert start[0] == cmd[0] == "/opt/anomaly-hooks/bin/anomaly-hooks" and start[1] == "serve"

    def parsed(words):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = vars(parser.parse_args(words[2:]))
        assert [m[-5:] for m in args["model"]] == [".onnx"]  # --model may be repeated
        return {k: v for k, v in args.items() if k != "host"}

    assert parsed(start) == parsed(cmd)
    assert "edge-requirements.txt" in EDGE_SCRIPT.read_text()


# ---- the operator page of the edge service in a real browser (slow) -------------------------
@pytest.mark.slow
def test_edge_page_in_a_browser(edge, tmp_path):
    """The page of an ONNX service (torch blocked) in headless Chromium: an upload gets its
    verdict and overlay, and the drift card says why there is no monitor."""
    import httpx
    from test_serve_browser import CHROMIUM_ARGS, chromium_or_skip

    exe = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    path, files = edge
    env = blocked_env(tmp_path)
    with ServerProcess(path, tmp_path, "--results-dir", str(tmp_path / "results"), env=env,
                       launcher=[sys.executable, "-c", LAUNCHER]) as server:
        for f in files[:3]:
            assert httpx.post(server.url + "/v1/predict", content=f.read_bytes(),
                              timeout=60).status_code == 200
        problems: list = []
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
                # the browser logs each non-2xx fetch; /v1/drift's 409 is the expected answer
                page.on("console", lambda msg: problems.append(msg.text)
                        if msg.type == "error" and "409" not in msg.text else None)
                page.goto(server.url + "/", wait_until="load")
                page.wait_for_function("document.querySelectorAll('#recent tr').length >= 3")
                page.set_input_files("#file", str(files[-1]))
                page.wait_for_selector("#verdict[data-state]", timeout=60000)
                assert page.inner_text("#verdict") == "ANOMALOUS"
                page.wait_for_function("document.getElementById('overlay').naturalWidth > 0")
                page.wait_for_function("document.querySelectorAll('#recent tr').length >= 4")
                page.wait_for_function(  # every thumbnail, the new one's too, is shown
                    "[...document.querySelectorAll('#recent img')].every("
                    "i => i.complete && i.naturalWidth > 0)")
                page.wait_for_function(
                    "document.getElementById('drift-state').textContent === 'not available'")
                assert "without a drift monitor" in page.inner_text("#drift-message")
                page.screenshot(path=str(tmp_path / "edge_page.png"), full_page=True)
            finally:
                browser.close()
        assert not problems, problems
    assert not Path(env["EDGE_TORCH_LOG"]).exists()
