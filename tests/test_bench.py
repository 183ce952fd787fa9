"""The benchmarks run end to end (smoke tests: figures are printed, never asserted), and what
makes their GPU figures mean what they say (the bare backbone's precision and memory format,
the device named, the GPU peak counted from the start, synchronised timings)."""
from __future__ import annotations

import contextlib
import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from conftest import ROOT, SAMPLE, backbone_rtol, f32_tol

sys.path.insert(0, str(ROOT))  # benchmarks/ is no installed package: import it from the checkout

from anomaly_hooks.config import load_config
from anomaly_hooks.timing import PeakMemory
from benchmarks import (
    bench_cli,
    bench_coreset,
    bench_coreset_banks,
    bench_export,
    bench_heap,
    bench_heatmap,
    bench_loop,
    bench_model_load,
    bench_padding,
    bench_pipeline,
    bench_threshold,
    measure,
)

# tiny random-init models: the smoke runs check the plumbing, not the speed
TINY = ["backbone.name=resnet18", "backbone.weights=null", "preprocess.resize=64",
        "preprocess.crop=null", "padim.n_features=32", "data.num_workers=0",
        "patchcore.coreset_ratio=0.5"]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))


def small_dataset(root: Path, train: int = 8, test: int = 2) -> Path:
    """A copy of a few sample images: ``train`` good ones, ``test`` good and ``test`` spots."""
    for folder, n in (("train/good", train), ("test/good", test), ("test/spot", test)):
        (root / folder).mkdir(parents=True)
        for f in sorted((SAMPLE / folder).glob("*.png"))[:n]:
            shutil.copy(f, root / folder / f.name)
    return root


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_answers_help(script, monkeypatch, capsys):
    """Each script runs as ``__main__`` and its ``--help`` works."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script adds the repository root
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(ROOT / "benchmarks" / script), run_name="__main__")
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out


def test_a_benchmark_runs_as_a_script_from_the_repository_root():
    """``python benchmarks/<script>`` finds ``benchmarks.measure`` and the package without an
    install or PYTHONPATH (the script puts the repository root on its path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "benchmarks/bench_pipeline.py", "--help"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_the_package_imports_no_benchmark():
    """The dependency goes one way: benchmarks use the package, never the reverse."""
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "anomaly_hooks").rglob("*.py")
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if line.lstrip().startswith(("import benchmarks", "from benchmarks"))]
    assert not offenders, offenders


@pytest.mark.slow
def test_pipeline_bench_runs_and_reports_every_stage(tmp_path, capsys):
    data = small_dataset(tmp_path / "d")
    out = tmp_path / "b.json"
    assert bench_pipeline.main(
        ["--config", "configs/padim.yaml", "--config", "configs/patchcore.yaml",
         "--data", str(data), "--batch-size", "4", "--device", "cpu", "--repeats", "2",
         "--passes", "2", "--json", str(out), *TINY]) == 0
    report = json.loads(out.read_text())
    assert [r["method"] for r in report["results"]] == ["padim", "patchcore"]
    for r in report["results"]:
        assert set(bench_pipeline.STAGES) <= set(r["predict"]["ms_per_image"])
        assert r["predict"]["predict_path_ratio"] > 0 and r["fit"]["ratio_to_bare_backbone"] > 0
        assert r["predict"]["passes"] == 2 and len(r["predict"]["predict_path_ratio_per_pass"]) == 2
        assert r["predict"]["batch1"]["p90_ms"] >= r["predict"]["batch1"]["median_ms"] > 0
    assert report["results"][1]["fit"]["coreset_seconds"] >= 0
    assert {"cpu", "cores", "ram_gb", "torch", "numpy"} <= set(report["machine"])
    assert "pred/bare" in capsys.readouterr().out


def test_heap_bench_runs_every_mode_in_fresh_processes(tmp_path, capsys):
    data = small_dataset(tmp_path / "d")
    out = tmp_path / "h.json"
    assert bench_heap.main(["--data", str(data), "--config", "configs/padim.yaml", "--train",
                            "6", "--test", "4", "--repeats", "1", "--json", str(out),
                            "device=cpu", *TINY]) == 0
    report = json.loads(out.read_text())
    for mode in bench_heap.MODES:
        assert report[mode]["fit"]["s"] > 0 and report[mode]["score"]["faults"] >= 0
        # MB of a process that holds torch and a model (units: neither kB nor bytes)
        assert 100 < report[mode]["rss_after_mb"] <= report[mode]["peak_rss_mb"] < 20_000
    assert report["max_score_difference"] == 0  # only where memory comes from changes
    assert "keep / release" in capsys.readouterr().out


def test_cli_bench_runs_each_code_version_in_fresh_processes(tmp_path, capsys):
    """Two versions (a folder, a git revision) of a quick command, each in its own process:
    wall and CPU seconds per run, the largest imports; a failing command and an unknown
    version stop it with what went wrong."""
    out = tmp_path / "c.json"
    command = ["layers", "resnet18", "--input", "32"]
    versions = [str(ROOT), *(["HEAD"] if (ROOT / ".git").exists() else [])]  # a git checkout
    assert bench_cli.main(["--repeats", "1", *(a for v in versions for a in ("--code", v)),
                           "--json", str(out), "--", *command]) == 0
    report = json.loads(out.read_text())
    assert report["command"] == command
    for version in versions:
        got = report[version]
        assert len(got["wall_s"]) == len(got["cpu_s"]) == 1 and got["wall_s"][0] > 0
        assert got["imports_s"]["total"] > 0 and "anomaly_hooks.cli" in got["imports_s"]
    assert f"| {versions[-1]} |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="the command failed"):
        bench_cli.main(["--repeats", "1", "--", "layers", "no_such_backbone"])
    with pytest.raises(SystemExit, match="neither a folder with anomaly_hooks/ nor a git"):
        bench_cli.main(["--repeats", "1", "--code", "no-such-revision", "--", *command])


def test_padding_bench_compares_each_asymmetric_padding_and_the_features(tmp_path, capsys):
    """EfficientNet-Lite0 (random weights): its five asymmetric paddings (and the two dense
    references) each timed padded and widened in both memory formats, the outputs equal
    within float32 rounding; a backbone without any says so."""
    pytest.importorskip("efficientnet_lite_pytorch")
    out = tmp_path / "p.json"
    assert bench_padding.main(["--weights", "none", "--batch", "2", "--size", "64",
                               "--repeats", "1", "--dense", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    convs = report["convolutions"]
    assert len(convs) == 2 * 5 and {c["format"] for c in convs} == {"contiguous",
                                                                     "channels-last"}
    assert sum(c["depthwise"] for c in convs) == 2 * 4  # the stem is a dense convolution
    assert all(c["pad_alone_ms"] > 0 and c["padded_ms"] > 0 for c in convs)
    assert all(c["relative_difference"] <= f32_tol(3 * 3 * 3) for c in convs)  # <= 27 terms
    assert [c["depthwise"] for c in report["dense"]] == [False] * 4
    assert all(c["relative_difference"] <= f32_tol(3 * 3 * 256) for c in report["dense"])
    assert len(report["extractor"]["folded"]) == 16
    assert report["extractor"]["relative_difference"] <= backbone_rtol(30, 1152)
    assert bench_padding.main(["--backbone", "resnet18", "--weights", "none"]) == 0
    assert "no convolution pads asymmetrically" in capsys.readouterr().out


@pytest.mark.slow
def test_model_load_bench_measures_each_format_as_for_an_update(tmp_path, capsys):
    """One kept-embeddings model in formats 3 and 2, loaded as for an update in fresh
    processes: a result per file naming its format, the embeddings read back from each."""
    from anomaly_hooks import Detector
    from anomaly_hooks.modelfile import load_model, save_model

    cfg = load_config(None, ["device=cpu", *TINY, "padim.covariance=dense",
                             "threshold.mode=all-images"])
    new = Detector(cfg).fit(small_dataset(tmp_path / "d") / "train" / "good", progress=False) \
        .save(tmp_path / "v3.safetensors")
    old = save_model(tmp_path / "v2.safetensors", *load_model(new), version=2)
    out = tmp_path / "l.json"
    assert bench_model_load.main(["--model", str(new), str(old), "--for-update", "--json",
                                  str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["for_update"] is True and set(report["models"]) == {str(new), str(old)}
    assert [(r["model"], r["format_version"]) for r in report["results"]] == [
        (str(new), "3"), (str(old), "2")]
    assert all(r["load_s"] > 0 and r["embeddings_in_file"] and r["read_embeddings_s"] > 0
               for r in report["results"])
    assert "v2.safetensors (format 2)" in capsys.readouterr().out


def test_heatmap_bench_times_each_form_and_restores_the_detectors(tmp_path, capsys):
    """Small maps and one fit of each form on a few sample images: the figures are there, the
    forms agree, and the detector's heatmap pipeline is its own again afterwards."""
    import anomaly_hooks.detector as detector_module

    own = detector_module.anomaly_maps
    data = small_dataset(tmp_path / "d", train=6)
    out = tmp_path / "h.json"
    assert bench_heatmap.main(["--maps", "4", "--grid", "7", "9", "--size", "28", "36",
                               "--repeats", "2", "--fit", str(data / "train" / "good"),
                               "--config", "configs/padim.yaml", "--fits", "1",
                               "--json", str(out), *TINY, "data.batch_size=4",
                               "device=cpu", "threshold.mode=all-images"]) == 0
    report = json.loads(out.read_text())
    maps = report["maps"]
    assert maps["anomaly_maps ms (strided)"] > 0 and maps["conv ms (contiguous)"] > 0
    # float32 conv form (bilinear 6 roundings, two 33-tap passes 4 * 33) against the products
    # (sums of 7 and 9 terms, the operators' rounding 2): the matrix form's own tests bound it
    assert maps["max_abs_diff"] <= f32_tol(6 + 4 * 33 + 7 + 9 + 2, maps["max_value"])
    fits = report["fits"]
    assert [f["form"] for f in fits] == ["conv", "matmul"]
    assert all(f["threshold_s"] > 0 and np.isfinite(f["threshold"]) for f in fits)
    assert detector_module.anomaly_maps is own
    assert "load_before" in capsys.readouterr().out


@pytest.mark.slow
def test_coreset_bench_runs(tmp_path, capsys):
    data = small_dataset(tmp_path / "d")
    out = tmp_path / "coreset.json"
    assert bench_coreset.main(["--data", str(data), "--max-bank-points", "200", "--queries",
                               "100", "--skip-fits", "--json", str(out), *TINY,
                               "data.batch_size=4", "device=cpu"]) == 0
    report = json.loads(out.read_text())
    assert report["bounded"]["k"] <= 100 and report["coreset_0.01"]["k"] >= 1
    assert set(report["recall"]) == set(bench_coreset.APPROXIMATE)
    assert "recall@1" in capsys.readouterr().out


@pytest.mark.slow
def test_coreset_banks_use_the_fits_embedding_and_seed(tmp_path, monkeypatch):
    from anomaly_hooks.fitting import SEED_SCORER
    from anomaly_hooks.scorers.patchcore.coreset import first_index
    from anomaly_hooks.scorers.patchcore.scorer import SEED_CORESET

    config = tmp_path / "tiny.yaml"
    config.write_text("method: patchcore\n")
    monkeypatch.setitem(bench_coreset_banks.BANKS, "tiny", (
        [str(config), *TINY, "device=cpu"], lambda: bench_coreset_banks.images(
            SAMPLE / "train" / "good", 2)[:6]))
    meta = bench_coreset_banks.build("tiny", tmp_path / "banks", 4)
    bank = np.load(tmp_path / "banks" / "tiny.npy")
    assert bank.shape == (meta["n"], meta["dim"]) == (6 * meta["patches_per_image"], 128)
    seed = load_config(str(config), TINY).seed
    assert meta["seed"] == seed + SEED_SCORER + SEED_CORESET  # the fit's coreset seed
    assert meta["first_index"] == first_index(meta["n"], meta["seed"])
    assert json.loads((tmp_path / "banks" / "tiny.json").read_text()) == meta


@pytest.mark.slow
def test_export_bench_runs_every_engine_in_its_own_process(tmp_path, capsys):
    data = small_dataset(tmp_path / "d")
    out = tmp_path / "export"
    assert bench_export.main(["--config", "configs/patchcore.yaml", "--data", str(data),
                              "--out", str(out), "--threads", "1", "--repeats", "1",
                              "--rounds", "1", "--calib", "4", *TINY,
                              "threshold.mode=all-images"]) == 0
    result = json.loads((out / "bench_export.json").read_text())
    engines = [r["engine"] for r in result["speed"]]
    assert engines[:3] == ["eager", "onnxruntime", "int8"]
    assert set(result["accuracy"]) == set(engines)
    assert "| eager |" in capsys.readouterr().out


def test_stage_laps_are_the_detectors_own(tmp_path):
    """One pass charges the five stages and the bare backbone, and nothing else: the laps
    come from ``Detector.infer``'s Stopwatch, not from a copy of the predict path."""
    from anomaly_hooks.detector import Detector, resolve_layer_names

    data = small_dataset(tmp_path / "d", train=4, test=1)
    det = Detector.from_config("configs/padim.yaml", overrides=[*TINY, "device=cpu"])
    det.fit(data, progress=False)
    bare = measure.bare_backbone(det.cfg, resolve_layer_names(det.cfg), det.device)
    items = bench_pipeline.predict_items(data)
    laps = bench_pipeline.one_pass(det, items, 2, bare)
    assert set(laps) == {*bench_pipeline.STAGES, "bare_backbone"}
    assert all(v >= 0 for v in laps.values())


@pytest.mark.parametrize("precision, channels_last", [("float32", False), ("bfloat16", True)])
def test_bare_backbone_runs_as_the_extractor_does(precision, channels_last, monkeypatch):
    """The bare backbone uses the config's precision (autocast, or IEEE float32) and memory
    format, so that a ratio to it compares like with like; its input is already on the
    device (the host-to-device copy is not backbone time)."""
    import anomaly_hooks.devices as devices

    scopes = []

    @contextlib.contextmanager
    def recording_scope() -> Iterator[None]:
        scopes.append("in")
        yield

    monkeypatch.setattr(devices, "ieee_float32", recording_scope)
    cfg = load_config(None, backbone__name="resnet18", backbone__weights=None,
                      backbone__precision=precision, backbone__channels_last=channels_last)
    run = measure.bare_backbone(cfg, ["layer1", "layer2"], torch.device("cpu"))
    out = next(iter(run(torch.rand(2, 3, 64, 64)).values()))
    assert out.dtype == getattr(torch, precision) and scopes == ["in"]
    assert out.is_contiguous(memory_format=torch.channels_last) == channels_last


def test_gpu_figures_name_the_device_used_and_count_from_the_start(monkeypatch):
    """The report names the GPU the run used (not GPU 0), and the GPU peak is counted above
    what was allocated when the measurement began (as the RSS peak is)."""
    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda d=None: f"GPU {torch.device(d).index}")
    assert measure.machine(torch.device("cuda", 1))["gpu"] == "GPU 1"
    assert "gpu" not in measure.machine(torch.device("cpu"))
    allocated = {"now": 3 * 2**30, "peak": 3 * 2**30}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda d=None: allocated.update(peak=allocated["now"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: allocated["peak"])
    with PeakMemory(torch.device("cuda", 1)) as mem:
        allocated["peak"] += 2 * 2**30
    assert mem.gpu_peak_mb == 2048


def test_patchcore_timing_split_waits_for_the_device(monkeypatch):
    """The coreset / search-index split of a fit reads the clock after the device finished
    each part (queued GPU work would otherwise be counted in the next part)."""
    import anomaly_hooks.scorers.patchcore.scorer as pc
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


# -- the shared helper ------------------------------------------------------------------------
def test_percentile_is_the_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert measure.percentile(values, 0) == 1.0 and measure.percentile(values, 100) == 5.0
    assert measure.percentile(values, 50) == 3.0
    assert measure.percentile([], 50) != measure.percentile([], 50)  # NaN


def test_timed_repeats_warms_up_then_times_each_call():
    calls = []
    timed = measure.timed_repeats(lambda: calls.append(1), 3, warmup=2)
    assert len(calls) == 5 and len(timed.walls) == 3
    assert timed.median >= 0 and timed.p90 >= timed.median and timed.cpu >= 0


def test_a_child_hands_back_its_last_result_line_or_its_error(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import sys\nsys.path.insert(0, sys.argv[1])\n"
                      "from benchmarks.measure import report_result\n"
                      "print('noise')\nreport_result({'n': 1})\nreport_result({'n': 2})\n")
    assert measure.child_result([script, ROOT]) == {"n": 2}
    failed = measure.child_result(["-c", "import sys; sys.exit('broken')"])
    assert "broken" in failed["error"]


def test_stop_process_terminates_then_kills():
    """measure.stop_process: SIGTERM ends a process (with its group when asked); one that
    ignores it is killed after the timeout."""
    import signal

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    proc = subprocess.Popen(sleeper, start_new_session=True)
    measure.stop_process(proc, 10, group=True)
    assert proc.returncode == -signal.SIGTERM
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                 "print('ready', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline().strip() == "ready"  # its handler is set
    measure.stop_process(stubborn, 0.5)
    assert stubborn.returncode == -signal.SIGKILL
    measure.stop_process(stubborn)  # an ended process: nothing to do


def test_update_benchmarks_share_their_arguments_and_split():
    parser = measure.update_arguments("d")
    args = parser.parse_args(["--data", "d", "--config", "c.yaml", "padim.n_features=10"])
    assert (args.split, args.json, args.overrides) == (0.5, None, ["padim.n_features=10"])
    assert measure.split_training(list(range(5)), 0.5) == ([0, 1, 2], [3, 4])
    assert measure.split_training(["a"], 0.0) == (["a"], [])  # one image first at least


@pytest.mark.slow
def test_loop_bench_updates_from_the_kept_inputs(tmp_path, capsys):
    """The loop through a real server with --keep-inputs: every labelled image's kept input
    is read, and the update is the refit (PaDiM: the same threshold)."""
    data = small_dataset(tmp_path / "d", train=12, test=2)
    out = tmp_path / "loop.json"
    assert bench_loop.main(["--data", str(data), "--config", "configs/padim.yaml",
                            "--keep-inputs", "--json", str(out), *TINY]) == 0
    report = json.loads(out.read_text())
    assert report["inputs_read"] == report["images_added"] == report["labelled"] == 6
    assert report["after"]["threshold"] == pytest.approx(report["refit"]["threshold"],
                                                         rel=1e-4)
    assert "6 of them from the network inputs the service kept" in capsys.readouterr().out


def test_threshold_bench_refuses_a_single_draw(monkeypatch, capsys):
    """One draw of defects has no spread to show: an argument error, before any fit."""
    monkeypatch.setattr(sys, "argv", ["bench_threshold.py", "--draws", "1"])
    with pytest.raises(SystemExit) as exc:
        bench_threshold.main()
    assert exc.value.code == 2
    assert "--draws 1: give 0 (off) or at least 2" in capsys.readouterr().err


def test_measure_imports_no_torch():
    """The ONNX engines are timed in processes whose peak memory must not include torch."""
    code = ("import sys; sys.path.insert(0, '.'); import benchmarks.measure, "
            "anomaly_hooks.timing; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_tree_cpu_seconds_counts_this_process():
    sum(i * i for i in range(200_000))
    assert measure.tree_cpu_seconds() > 0


@pytest.mark.slow
def test_serve_bench_compares_engines_and_measures_rss_per_model(tmp_path, capsys):
    """bench_serve load-tests an eager and an ONNX model in one run (the second's images per
    server CPU-second as a ratio to the first's), and ``--rss`` reads the RSS of a service of
    one, then two models."""
    pytest.importorskip("fastapi")
    pytest.importorskip("onnxruntime")
    from anomaly_hooks import Detector
    from anomaly_hooks.export import export_onnx
    from benchmarks import bench_serve

    cfg = load_config(str(ROOT / "configs" / "padim.yaml"), TINY)
    data = small_dataset(tmp_path / "data", train=6, test=1)
    det = Detector.from_config(cfg).fit(sorted((data / "train" / "good").glob("*.png")),
                                        progress=False)
    st = det.save(tmp_path / "m.safetensors")
    onnx = export_onnx(det, tmp_path / "m.onnx")
    images = data / "test"  # two images: the references and the warm-up stay short
    out = tmp_path / "load.json"
    bench_serve.main(["--model", str(st), "--model", str(onnx), "--images", str(images),
                      "--clients", "2", "--duration", "1", "--max-requests", "12",
                      "--cycles", "1", "--max-batch", "2", "--reference-passes", "1",
                      "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["engine"] for r in result["runs"]] == ["torch", "onnx"]
    assert all(r["errors"] == 0 and r["lost_results"] == 0 for r in result["runs"])
    ratios = [m["per_cpu_ratio"] for m in result["comparison"]["models"]]
    assert ratios[0] == 1.0 and ratios[1] > 0
    assert "per server CPU-second" in capsys.readouterr().out
    out = tmp_path / "rss.json"
    bench_serve.main(["--rss", "--model", f"a={onnx}", "--model", f"b={onnx}", "--images",
                      str(images), "--rss-requests", "1", "--rss-settle", "0.5",
                      "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [len(r["models"]) for r in rows] == [1, 2]
    assert rows[0]["added_mib"] is None and rows[1]["added_mib"] is not None
    assert all(r["rss_mib"] > 0 for r in rows)


def test_loo_bench_times_chunk_budgets_and_restores_the_fits_own(capsys):
    """bench_loo's chunk budgets: a row per sample count and budget, the results the same for
    every budget, and the fit's own budget back afterwards."""
    from anomaly_hooks.scorers.padim import loo
    from benchmarks import bench_loo

    kept = loo.CHUNK_CACHE_BYTES
    x = torch.randn(40, 12, 6, generator=torch.Generator().manual_seed(0))
    bench_loo.chunk_budgets(x, [8, 12], [16, 0.001], 0.01, repeats=2)
    assert loo.CHUNK_CACHE_BYTES == kept
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    rows = [r.split("|")[1:-1] for r in rows[1:]]  # after the header
    assert [(int(r[0]), float(r[1])) for r in rows] == [(8, 16), (8, 0.001), (12, 16),
                                                        (12, 0.001)]
    assert [int(r[2]) for r in rows][1::2] == [1, 1]  # the smallest budget: a position a chunk
    assert all(r[4].strip() == "yes" for r in rows)
