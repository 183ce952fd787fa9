"""The benchmark script runs end to end (a smoke test: figures are printed, never asserted),
and what makes its GPU figures mean what they say (the bare backbone's precision and memory
format, the device named, the GPU peak counted from the start, synchronised timings)."""
from __future__ import annotations

import json
import shutil

import pytest
from conftest import SAMPLE

from anomaly_hooks.evaluation import benchmark as bench


@pytest.mark.slow
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


@pytest.mark.parametrize("precision, channels_last", [("float32", False), ("bfloat16", True)])
def test_bare_backbone_runs_as_the_extractor_does(precision, channels_last, monkeypatch):
    """The bare backbone uses the config's precision (autocast, or IEEE float32) and memory
    format, so that a ratio to it compares like with like; its input is already on the
    device (the host-to-device copy is not backbone time)."""
    import contextlib

    import torch

    from anomaly_hooks.config import load_config

    scopes = []

    @contextlib.contextmanager
    def recording_scope():
        scopes.append("in")
        yield

    monkeypatch.setattr(bench, "ieee_float32", recording_scope)
    cfg = load_config(None, backbone__name="resnet18", backbone__weights=None,
                      backbone__precision=precision, backbone__channels_last=channels_last)
    run = bench.bare_backbone(cfg, ["layer1", "layer2"], torch.device("cpu"))
    out = next(iter(run(torch.rand(2, 3, 64, 64)).values()))
    assert out.dtype == getattr(torch, precision) and scopes == ["in"]
    assert out.is_contiguous(memory_format=torch.channels_last) == channels_last


def test_gpu_figures_name_the_device_used_and_count_from_the_start(monkeypatch):
    """The report names the GPU the run used (not GPU 0), and the GPU peak is counted above
    what was allocated when the measurement began (as the RSS peak is)."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: f"GPU {torch.device(d).index}")
    assert bench.machine(torch.device("cuda", 1))["gpu"] == "GPU 1"
    assert "gpu" not in bench.machine(torch.device("cpu"))
    allocated = {"now": 3 * 2**30, "peak": 3 * 2**30}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda d=None: allocated.update(peak=allocated["now"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: allocated["peak"])
    with bench.PeakMemory(torch.device("cuda", 1)) as mem:
        allocated["peak"] += 2 * 2**30
    assert mem.gpu_peak_mb == 2048


def test_patchcore_timing_split_waits_for_the_device(monkeypatch):
    """The coreset / search-index split of a fit reads the clock after the device finished
    each part (queued GPU work would otherwise be counted in the next part)."""
    import torch

    import anomaly_hooks.scorers.patchcore.scorer as pc
    from anomaly_hooks.config import load_config
    from anomaly_hooks.extractor import LayerInfo

    events = []
    monkeypatch.setattr(pc, "synchronize", lambda device: events.append(("sync", device.type)))
    real = pc.PatchCoreScorer.set_bank
    monkeypatch.setattr(pc.PatchCoreScorer, "set_bank",
                        lambda self, bank: events.append(("index",)) or real(self, bank))
    scorer = pc.PatchCoreScorer.create(load_config({"method": "patchcore"}).patchcore,
                                       [LayerInfo("a", 8, 8)], "custom", seed=0)
    scorer.partial_fit(torch.rand(2, 8, 4, 4))
    scorer.finalize()
    assert events == [("sync", "cpu"), ("index",), ("sync", "cpu")]
