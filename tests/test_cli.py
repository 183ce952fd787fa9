"""The CLIs end to end on the committed sample data, and the sample-data AUROC."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, SAMPLE
from PIL import Image
from sklearn.metrics import roc_auc_score

from anomaly_hooks.cli import main

FAST = ["backbone.name=resnet18", "preprocess.resize=128", "preprocess.crop=112",
        "padim.n_features=60", "data.num_workers=0"]


def _labels_scores(results_json: Path) -> tuple[list[int], list[float]]:
    rows = json.loads(results_json.read_text())["results"]
    labels = [0 if Path(r["path"]).parent.name == "good" else 1 for r in rows]
    return labels, [r["score"] for r in rows]


@pytest.mark.slow
def test_fit_and_score_scripts_end_to_end(tmp_path):
    model = tmp_path / "m.safetensors"
    fit = subprocess.run([sys.executable, "scripts/fit.py", "--config", "configs/padim.yaml",
                          f"output={model}", *FAST], cwd=ROOT, capture_output=True, text=True)
    assert fit.returncode == 0, fit.stderr
    assert fit.stdout.strip().splitlines()[-1] == str(model) and model.is_file()
    assert "img/s" in fit.stdout
    out = tmp_path / "out"
    score = subprocess.run([sys.executable, "scripts/score.py", "--model", str(model),
                            str(SAMPLE / "test"), "--out", str(out)], cwd=ROOT,
                           capture_output=True, text=True)
    assert score.returncode == 0, score.stderr
    rows = list(csv.DictReader(open(out / "results.csv")))
    n_test = len([p for p in (SAMPLE / "test").rglob("*.png")])
    assert len(rows) == n_test
    first = rows[0]
    with Image.open(first["path"]) as img:
        size = img.size
    for key in ("heatmap", "overlay", "mask"):
        with Image.open(first[key]) as png:
            assert png.size == size
    labels, scores = _labels_scores(out / "results.json")
    assert roc_auc_score(labels, scores) > 0.8


def test_score_reports_unreadable_files_and_goes_on(tmp_path, fitted):
    model = fitted.save(tmp_path / "m.safetensors")
    good = tmp_path / "ok.png"
    Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(good)
    bad = tmp_path / "bad.png"
    bad.write_text("not a png")
    code = main(["score", "--model", str(model), str(good), str(bad), "--out",
                 str(tmp_path / "o"), "--no-images"])
    assert code == 1
    data = json.loads((tmp_path / "o" / "results.json").read_text())
    assert [r["path"] for r in data["results"]] == [str(good)]
    assert len(data["failures"]) == 1 and "bad.png" in data["failures"][0]


def test_bugs_keep_their_traceback_user_errors_do_not(monkeypatch, capsys, tmp_path):
    """Any AnomalyHooksError or OSError is one 'error:' line and exit 2; anything else (an
    internal bug, even a plain ValueError) propagates with its traceback."""
    from anomaly_hooks import cli
    from anomaly_hooks.errors import DataError

    def fails_with(exc):
        def command(args):
            raise exc
        return command

    for exc in (DataError("no images in x"), PermissionError(13, "Permission denied", "/m")):
        monkeypatch.setitem(cli.COMMANDS, "layers", fails_with(exc))
        assert main(["layers", "resnet18"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and err.count("\n") == 1, err
    for exc in (ValueError("bug: shapes do not match"), KeyError("oops"), RuntimeError("bug")):
        monkeypatch.setitem(cli.COMMANDS, "layers", fails_with(exc))
        with pytest.raises(type(exc)):
            main(["layers", "resnet18"])


def test_user_errors_are_one_line(tmp_path, capsys):
    assert main(["fit", "--config", "configs/padim.yaml", "padim.bogus=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "padim.bogus" in err and "Traceback" not in err
    assert main(["score", "--model", str(tmp_path / "none.safetensors"), "x.png"]) == 2
    assert "model file not found" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("method", ["padim", "patchcore"])
def test_sample_data_auroc_with_random_wrn50(method, tmp_path, capsys):
    """Seeded random-init WRN50 (the README command's setting): defects score above good."""
    from anomaly_hooks import Detector

    det = Detector.from_config(ROOT / "configs" / f"{method}.yaml", data__num_workers=0)
    det.fit(SAMPLE, progress=False)
    tests = sorted((SAMPLE / "test").rglob("*.png"))
    preds = det.predict(tests)
    labels = [0 if p.parent.name == "good" else 1 for p in tests]
    auroc = roc_auc_score(labels, [p.score for p in preds])
    with capsys.disabled():
        print(f"\n[sample data] {method} random-init WRN50 image AUROC = {auroc:.3f}")
    assert auroc > 0.9
