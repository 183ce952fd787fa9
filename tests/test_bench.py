"""The benchmark script runs end to end (a smoke test: figures are printed, never asserted)."""
from __future__ import annotations

import json
import shutil

from anomaly_hooks.evaluation import benchmark as bench
from conftest import SAMPLE


def test_bench_runs_and_reports_every_stage(tmp_path, capsys):
    data = tmp_path / "d"
    for folder, n in (("train/good", 8), ("test/good", 2), ("test/spot", 2)):
        (data / folder).mkdir(parents=True)
        for f in sorted((SAMPLE / folder).glob("*.png"))[:n]:
            shutil.copy(f, data / folder / f.name)
    overrides = ["backbone.name=resnet18", "backbone.weights=null", "preprocess.resize=64",
                 "preprocess.crop=null", "padim.n_features=32", "data.num_workers=0",
                 "patchcore.coreset_ratio=0.5"]
    out = tmp_path / "b.json"
    assert bench.main(["--config", "configs/padim.yaml", "--config", "configs/patchcore.yaml",
                       "--data", str(data), "--batch-size", "4", "--device", "cpu",
                       "--repeats", "2", "--passes", "2", "--json", str(out), *overrides]) == 0
    report = json.loads(out.read_text())
    assert [r["method"] for r in report["results"]] == ["padim", "patchcore"]
    for r in report["results"]:
        assert set(bench.STAGES) <= set(r["predict"]["ms_per_image"])
        assert r["predict"]["predict_path_ratio"] > 0 and r["fit"]["ratio_to_bare_backbone"] > 0
        assert r["predict"]["passes"] == 2 and len(r["predict"]["predict_path_ratio_per_pass"]) == 2
    assert report["results"][1]["fit"]["coreset_seconds"] >= 0
    assert "pred/bare" in capsys.readouterr().out
