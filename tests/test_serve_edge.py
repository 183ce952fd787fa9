"""The edge service: ``anomaly-hooks serve --model m.onnx`` serves an exported model on the ONNX
engine (ONNX Runtime, numpy, Pillow) -- the same API, page, results log, metrics and drift
monitor -- where ``import torch`` fails; an older export (without the layer statistics) is
served without a drift monitor and says to export it again.

Scores are compared with :class:`~anomaly_hooks.runtime.OnnxDetector`'s on the same image files.
The tolerance is the float32 rounding of the graph, derived as follows: the service and the
runtime run the same float32 graph on bit-identical inputs (the same decoder and the same
preprocessing, :meth:`OnnxDetector.preprocess` with the engine's method), and the JSON answer
carries the float32 score exactly (its float64 ``repr``). With one image per session run on both
sides nothing differs, so the scores are equal to the last bit. With several images in one run,
the batch size changes the order in which ONNX Runtime's convolution and matrix kernels add each
output's float32 terms; a reordered float32 sum moves by a few units in the last place (ulp) of
its terms, and the image score (the heatmap's maximum, not a sum) inherits that: measured 2 ulp
of the score on this model; :data:`BATCH_ULPS` allows 16.
"""
from __future__ import annotations

import base64
import io
import math
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
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
DARKER = 0.8  # the drifting images' brightness factor (some statistics alarm, some do not)
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


def runtime(path: Path, **kw) -> OnnxDetector:
    """The runtime as the service's engine loads it (its preprocessing method)."""
    from anomaly_hooks.serve.engine_onnx import PREPROCESS

    return OnnxDetector.load(path, preprocess_method=PREPROCESS, **kw)


def one_by_one(path: Path, files) -> list:
    """OnnxDetector's predictions of each file in a run of its own."""
    det = runtime(path)
    return [det.predict(str(f)) for f in files]


# ---- in process (fast) ----------------------------------------------------------------------
def test_the_engine_is_chosen_by_the_file_suffix():
    from anomaly_hooks.serve.engine_onnx import OnnxEngine
    from anomaly_hooks.serve.engine_torch import TorchEngine
    from anomaly_hooks.serve.engines import engine_class

    assert engine_class("a/m.onnx") is engine_class("M.ONNX") is OnnxEngine
    assert engine_class("m.safetensors") is engine_class("m.onnx.bak") is TorchEngine
    assert TorchEngine.drift_unavailable is None


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
    the page, /metrics, /v1/model, /v1/drift from the drift monitor the service built from the
    exported file (the CLI's default ``--monitor auto``)."""
    path, files = edge
    expected = one_by_one(path, files)
    with serving(path, tmp_path, monitor="auto", keep_images="all") as (client, service):
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
        wait_observed(service, len(files))
        metrics = client.get("/metrics").text
        assert 'engine="onnx"' in metrics
        assert 'anomaly_hooks_drift_enabled{model="default"} 1.0' in metrics
        assert 'anomaly_hooks_drift{key="images_seen",model="default"}' in metrics
        info = client.get("/v1/model").json()
        assert info["engine"] == "onnx" and info["fitted_on"] is None
        assert info["export"]["scorer_form"] and info["device"] == "CPUExecutionProvider"
        assert info["drift_monitor"] is True and info["drift_unavailable"] is None
        drift = client.get("/v1/drift").json()
        assert drift["enabled"] is True and drift["images_seen"] == len(files)
        assert drift["blocks_observed"] == sorted(["input", "score", *service.engine.detector
                                                   .drift_layers])


def wait_observed(service, n: int, timeout: float = 30.0) -> None:
    """Until the default model's drift monitor has seen ``n`` images (it observes each batch
    on its own thread, after the answer)."""
    import time

    deadline = time.monotonic() + timeout
    while service.monitor.status().get("images_seen", 0) < n:
        assert time.monotonic() < deadline, service.monitor.status()
        time.sleep(0.02)


def format2_copy(path: Path, out: Path) -> Path:
    """An export as the previous version wrote it (exported-model format 2): the three
    prediction outputs only, no drift entry, sealed again."""
    import onnx

    from anomaly_hooks.runtime.metadata import DRIFT_KEY, OUTPUTS
    from anomaly_hooks.runtime.onnxfile import seal

    model = onnx.load(str(path))
    kept = [o for o in model.graph.output if o.name in OUTPUTS]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    props = {p.key: p.value for p in model.metadata_props
             if p.key not in (DRIFT_KEY, "checksum")}
    props["format_version"] = "2"
    del model.metadata_props[:]
    for key, value in props.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save_model(model, str(out))
    seal(out)
    return out


def test_an_onnx_model_keeps_originals_but_no_network_inputs(edge, tmp_path, caplog):
    """``--keep-inputs`` with an ``.onnx`` model: its numpy preprocessing is not the one an
    update runs, so the originals are kept and no input beside them; the log says so."""
    import logging

    path, files = edge
    with caplog.at_level(logging.WARNING, logger="anomaly_hooks.serve"):
        with serving(path, tmp_path, keep_originals="all", keep_inputs=True,
                     keep_images="none", thumbnails=False) as (client, _):
            assert client.post("/v1/predict", content=files[0].read_bytes()).status_code == 200
    kept = [p.name for p in (tmp_path / "results" / "images").rglob("*.*")]
    assert len(kept) == 1 and kept[0].endswith("_original.png")
    assert "keeps no network inputs" in caplog.text


def test_an_older_export_is_served_without_drift_and_says_to_export_again(edge, tmp_path):
    """A format-2 export (no layer statistics, no reference) still loads and predicts as the
    runtime does; /v1/drift answers 409 saying to export the model again."""
    path, files = edge
    old = format2_copy(path, tmp_path / "old.onnx")
    expected = one_by_one(old, files[-1:])[0]
    assert OnnxDetector.load(old).drift_reference_ is None
    with serving(old, tmp_path, monitor="auto") as (client, service):
        body = client.post("/v1/predict", content=files[-1].read_bytes()).json()
        assert body["score"] == expected.score and body["is_anomalous"]
        assert client.get("/v1/model").json()["drift_monitor"] is False
        reason = assert_error(client.get("/v1/drift"), 409, "drift_unavailable")["message"]
        assert "format 2" in reason and "export it again" in reason
        assert "without a drift monitor" in reason
        assert 'anomaly_hooks_drift_enabled{model="default"} 0.0' in client.get("/metrics").text
        service.settings.monitor = "none"  # asked for none: nothing to explain
        assert client.get("/v1/drift").json() == {"enabled": False}


def _block_vectors(scores, inputs, layers, mean, std, reference) -> dict:
    """The per-image vectors ``{block: [N, d]}`` the monitor adds to its window, prepared by
    each block (log of the scores)."""
    from anomaly_hooks.monitor import input_statistics

    raw = {"input": input_statistics(inputs, mean, std), "score": np.asarray(scores)[:, None],
           **layers}
    return {name: reference.blocks[name].prepare(np.asarray(v, np.float64))
            for name, v in raw.items()}


def _statistic_bounds(reference, window: np.ndarray, delta: dict) -> dict:
    """How far each drift statistic of one window can move when each image's prepared
    statistic ``c`` of a block moves by at most ``delta[block][c]`` (so its window mean too):
    with ``zbar`` the window's standardised mean and ``e = delta / scale``,

    * ``shift`` = ``W mean_c zbar_c^2`` moves by at most ``W mean_c (2 |zbar_c| e_c + e_c^2)``;
    * ``pca`` = ``W / k sum_j (v_j . zbar)^2 / lambda_j`` by at most
      ``W / k sum_j (2 |v_j . zbar| |e| + |e|^2) / lambda_j`` (``|v_j . e| <= |e|``, unit v_j);
    * the score's ``sqrt(W) (mean - m) / sd`` by at most ``sqrt(W) e``.

    ``window``: ``{block: [W, d]}`` prepared vectors of one side."""
    w = reference.window
    out = {}
    for name, block in reference.blocks.items():
        zbar = (window[name].mean(axis=0) - block.mean) / block.scale
        e = delta[name] / block.scale
        if block.one_sided:
            out[f"{name}:shift"] = math.sqrt(w) * float(e.max())
            continue
        out[f"{name}:shift"] = w * float(np.mean(2 * np.abs(zbar) * e + e ** 2))
        if block.basis.shape[1]:
            norm = float(np.linalg.norm(e))
            proj = np.abs(zbar @ block.basis)
            out[f"{name}:pca"] = w / block.basis.shape[1] * float(
                np.sum((2 * proj * norm + norm ** 2) / block.eigvals))
    return out


def _fed_vectors(engine, images: list, reference) -> dict:
    """The prepared per-image vectors ``{block: [N, d]}`` a service's monitor is fed for
    ``images`` (encoded), each image a batch of its own, as one request at a time gives."""
    tensors = [engine.prepare(d, 10**8, 64).tensor for d in images]
    runs = []
    for t in tensors:
        layers: dict = {}
        runs.append((engine.infer([t], features=layers)[0], layers))
    scores = np.concatenate([r[0] for r in runs])
    layers = {k: np.concatenate([r[1][k] for r in runs]) for k in runs[0][1]}
    pre = engine.detector.preprocessor
    return _block_vectors(scores, engine.stack(tensors), layers, pre.mean, pre.std, reference)


@pytest.mark.slow
def test_drift_on_the_edge_equals_the_eager_service(drifting_pair, tmp_path):
    """The same images, one request at a time, to the eager service of a model file and to the
    ONNX service of its export: /v1/drift gives the same verdicts (alarm, the statistics in
    alarm, episodes, first alarm) and each statistic's value within the bound that the
    per-image differences of what the two monitors are fed imply (:func:`_statistic_bounds`;
    those differences are the float32 error of the two backbones and preprocessings,
    bounded by test_export's layer-means test)."""
    det, safetensors, onnx_path, images = drifting_pair
    statuses, fed = {}, {}
    for name, model in (("eager", safetensors), ("onnx", onnx_path)):
        with serving(model, tmp_path / name, monitor="auto", results_dir=None) as (client,
                                                                                 service):
            for i, data in enumerate(images):
                assert client.post("/v1/predict", content=data).status_code == 200
                wait_observed(service, i + 1)  # one batch at a time: none dropped
            statuses[name] = client.get("/v1/drift").json()
            # what the monitor was fed, image by image: the service's own engine, outside
            # its batches (all answered and observed above)
            fed[name] = _fed_vectors(service.engine, images, det.drift_reference_)
    eager, edge_ = statuses["eager"], statuses["onnx"]
    assert eager["alarm"] is True and eager["images_seen"] == len(images)
    for key in ("alarm", "alarming", "images_seen", "alarm_episodes", "first_alarm_image",
                "alarm_images", "window_filled", "blocks_observed"):
        assert edge_[key] == eager[key], key
    delta = {b: np.abs(fed["onnx"][b] - fed["eager"][b]).max(axis=0) for b in fed["eager"]}
    last = {b: v[-det.drift_reference_.window:] for b, v in fed["eager"].items()}
    bounds = _statistic_bounds(det.drift_reference_, last, delta)
    for stat, bound in bounds.items():
        got, want = edge_["statistics"][stat]["value"], eager["statistics"][stat]["value"]
        # + the float64 rounding of the statistic itself (a few hundred operations)
        assert abs(got - want) <= bound + 1e-12 * max(1.0, abs(want)), (stat, got, want, bound)


@pytest.fixture(scope="module")
def drifting_pair(small_cfg, tmp_path_factory):
    """(a detector fitted with a drift reference of window 4, its model file, its export,
    eight PNG payloads: four good images, then four darker ones that drift)."""
    from test_monitor import MONITOR_CFG

    from anomaly_hooks import Detector
    from anomaly_hooks.export import export_onnx

    root = tmp_path_factory.mktemp("edge_drift")
    det = Detector.from_config({**small_cfg, "monitor": MONITOR_CFG})
    det.fit(textured_images(12), progress=False)
    good = textured_images(4, seed=31)
    dark = [(img * DARKER).astype(np.uint8) for img in textured_images(4, seed=32)]
    payloads = []
    for img in good + dark:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "PNG")
        payloads.append(buf.getvalue())
    return (det, det.save(root / "m.safetensors"), export_onnx(det, root / "m.onnx"),
            payloads)


def test_a_pytorch_model_where_torch_is_missing_is_refused_with_what_to_do(monkeypatch):
    from anomaly_hooks.errors import ModelFileError
    from anomaly_hooks.serve.engines import engine_class

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
    expected = runtime(path).predict([str(f) for f in files])
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
    written, the page, /metrics and the API docs are served, the drift monitor watches every
    image (input, layer and score blocks) and /metrics exports it; an older export served the
    same way answers /v1/drift with 409."""
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
        drift = client.get("/v1/drift").json()
        for _ in range(300):  # the monitor observes each batch on its own thread
            if drift["images_seen"] == len(files):
                break
            time.sleep(0.05)
            drift = client.get("/v1/drift").json()
        assert drift["enabled"] is True and drift["images_seen"] == len(files), drift
        assert set(drift["blocks_observed"]) == {"input", "score", "layer1", "layer2", "layer3"}
        assert 'anomaly_hooks_drift{key="images_seen",model="default"} ' \
            f'{float(len(files))}' in client.get("/metrics").text
        assert client.get("/v1/model").json()["engine"] == "onnx"
        assert client.get("/v1/results").json()["count"] == len(files)
    assert "no drift monitor" not in server.log()
    old = format2_copy(path, tmp_path / "old.onnx")
    with ServerProcess(old, tmp_path, "--no-results", env=env,
                       launcher=[sys.executable, "-c", LAUNCHER]) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.post("/v1/predict", content=files[0].read_bytes()).status_code == 200
        reason = assert_error(client.get("/v1/drift"), 409, "drift_unavailable")["message"]
        assert "export it again" in reason
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
    verdict and overlay, and the drift card shows the monitor warming up."""
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
                page.on("console", lambda msg: problems.append(msg.text)
                        if msg.type == "error" else None)
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
                    "document.getElementById('drift-state').textContent === 'warming up'")
                assert "images_seen" in page.inner_text("#drift-table")
                page.screenshot(path=str(tmp_path / "edge_page.png"), full_page=True)
            finally:
                browser.close()
        assert not problems, problems
    assert not Path(env["EDGE_TORCH_LOG"]).exists()
