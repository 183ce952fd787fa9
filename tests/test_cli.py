"""The CLIs end to end on the committed sample data, and the sample-data AUROC; arguments and
user errors (one error line, exit 2), score's handling of bad inputs and odd names, where its
results go, and the outputs' checks (writability, full disks, the old model kept)."""
from __future__ import annotations

import csv
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, SAMPLE, one_error_line, textured_images
from image_files import good_rgb, make_bad_files, png_bytes, rgb_png, write_good
from PIL import Image
from sklearn.metrics import roc_auc_score

from anomaly_hooks import Detector
from anomaly_hooks.cli import main
from anomaly_hooks.images import DEFAULT_MAX_PIXELS

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
    det = Detector.from_config(ROOT / "configs" / f"{method}.yaml", data__num_workers=0)
    det.fit(SAMPLE, progress=False)
    tests = sorted((SAMPLE / "test").rglob("*.png"))
    preds = det.predict(tests)
    labels = [0 if p.parent.name == "good" else 1 for p in tests]
    auroc = roc_auc_score(labels, [p.score for p in preds])
    with capsys.disabled():
        print(f"\n[sample data] {method} random-init WRN50 image AUROC = {auroc:.3f}")
    assert auroc > 0.9



def _run_cli(*argv: str, timeout: int = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "anomaly_hooks.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, **kw)


# ---- arguments and user errors -----------------------------------------------------------
def test_cli_overrides_on_both_sides_of_an_option(tmp_path, capsys):
    data = tmp_path / "data"
    write_good(data, 4, size=(32, 32))
    code = main(["fit", "--quiet", "backbone.name=resnet18", "backbone.weights=null",
                 "--data", str(data), "--output", str(tmp_path / "m.safetensors"),
                 "padim.bogus=1"])  # the last override is wrong on purpose: exits fast
    assert code == 2
    assert "padim.bogus" in one_error_line(capsys.readouterr().err)


def test_cli_stray_arguments_are_still_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--data", "x", "--bogus-flag", "a=1"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --bogus-flag" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing_model", "garbage_model", "bad_key", "bad_nested_key",
                                  "bad_type", "missing_data", "bad_layer", "too_few",
                                  "yaml_key", "yaml_syntax", "missing_config"])
def test_cli_user_errors_are_one_line_exit_2(case, tmp_path, capsys):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    img = tmp_path / "x.png"
    img.write_bytes(png_bytes(good_rgb(16, 16)))
    data = tmp_path / "data"
    write_good(data, 4, size=(32, 32))
    yaml_bad, yaml_broken = tmp_path / "bad.yaml", tmp_path / "broken.yaml"

    def fit(folder, *extra):
        return ["fit", "--quiet", "--output", str(tmp_path / "m.safetensors"), "--data",
                str(folder), "backbone.name=resnet18", "backbone.weights=null", "device=cpu",
                "preprocess.resize=64", "preprocess.crop=null", "data.num_workers=0", *extra]

    argv, expect = {
        "missing_model": (["score", "--model", str(tmp_path / "nope.safetensors"), str(img),
                           "--out", str(tmp_path / "o")], "nope.safetensors"),
        "garbage_model": (["score", "--model", str(garbage), str(img), "--out",
                           str(tmp_path / "o")], "garbage.safetensors"),
        "bad_key": (fit(data, "bogus=1"), "bogus"),
        "bad_nested_key": (fit(data, "padim.bogus=1"), "padim.bogus"),
        "bad_type": (fit(data, "seed=abc"), "seed"),
        "missing_data": (fit(tmp_path / "no_such_dir"), "no_such_dir"),
        "bad_layer": (fit(data, "backbone.layers=[layer9]"), "layer9"),
        "too_few": (fit(tmp_path / "two", "threshold.mode=holdout",
                            "threshold.holdout_fraction=0.25"), "at least 2"),
        "yaml_key": (["fit", "--config", str(yaml_bad), "--data", str(data)], "padim.bogus"),
        "yaml_syntax": (["fit", "--config", str(yaml_broken), "--data", str(data)],
                        "broken.yaml"),
        "missing_config": (["fit", "--config", str(tmp_path / "nope.yaml"), "--data", str(data)],
                           "nope.yaml"),
    }[case]
    write_good(tmp_path / "two", 2, size=(32, 32))
    yaml_bad.write_text("method: padim\npadim:\n  bogus: 1\n")
    yaml_broken.write_text("method: padim\npadim: [unclosed\n")
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2
    line = one_error_line(captured.err)
    assert expect in line
    assert not (tmp_path / "m.safetensors").exists()


def test_cli_yaml_list_is_one_error_line(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("- 1\n- 2\n")
    assert main(["fit", "--config", str(tmp_path / "c.yaml"), "--data", str(tmp_path)]) == 2
    assert "the top level must be a mapping" in one_error_line(capsys.readouterr().err)


# ---- score: bad inputs, odd names, where results go --------------------------------------
def test_cli_score_scores_the_rest_and_reports_failures(tmp_path, padim_file, capsys):
    """Unreadable and missing inputs are reported (results.json's failures, exit 1) and every
    readable one is scored, in the order given, under the path given."""
    good = write_good(tmp_path / "good", 3)
    one = tmp_path / "good" / "one_pixel.png"
    one.write_bytes(png_bytes(np.array([[[10, 20, 30]]], dtype=np.uint8)))
    bad = make_bad_files(tmp_path / "bad")
    out = tmp_path / "results"
    inputs = [str(p) for p in good + [one]] + [str(p) for p in bad.values()]
    inputs.append(str(tmp_path / "does_not_exist.png"))
    code = main(["score", "--model", str(padim_file), *inputs, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in captured.err + captured.out
    result = json.loads((out / "results.json").read_text())
    scored = {Path(r["path"]).name for r in result["results"]}
    assert scored == {p.name for p in good + [one]}
    assert [r["path"] for r in result["results"]] == inputs[:len(good) + 1]
    failures = "\n".join(result["failures"])
    for p in list(bad.values()) + [tmp_path / "does_not_exist.png"]:
        assert p.name in failures, p
    assert len(result["failures"]) == len(bad) + 1
    assert all(np.isfinite(r["score"]) for r in result["results"])
    assert (out / "results.csv").read_text().count("\n") == len(good) + 2


def test_score_writes_only_inside_out_even_through_a_planted_link(padim_file, tmp_path):
    """Two inputs with the same name and inputs given as absolute files: every picture inside
    --out, none overwriting another; a symbolic link planted in --out is replaced, not
    followed."""
    a, b = tmp_path / "cam1", tmp_path / "cam2"
    for i, folder in enumerate((a, b)):
        folder.mkdir()
        Image.fromarray(textured_images(1, seed=i)[0]).save(folder / "img.png")
    out = tmp_path / "out"
    (out / "heatmaps").mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.symlink(victim, out / "heatmaps" / "img.png")
    code = main(["score", "--model", str(padim_file), str((a / "img.png").resolve()),
                 str((b / "img.png").resolve()), "--out", str(out)])
    assert code == 0
    rows = list(csv.DictReader(open(out / "results.csv", encoding="utf-8")))
    written = [Path(r[k]) for r in rows for k in ("heatmap", "overlay", "mask")]
    assert len(set(written)) == 6
    assert all(p.resolve().is_relative_to(out.resolve()) and p.is_file() for p in written)
    assert victim.read_text() == "keep me" and not (out / "heatmaps" / "img.png").is_symlink()


@pytest.mark.slow
def test_score_reports_fifos_and_odd_names_in_a_folder(padim_file, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    Image.fromarray(textured_images(1)[0]).save(folder / "ok.png")
    Image.fromarray(textured_images(1, seed=1)[0]).save(folder / "new\nline.png")
    os.mkfifo(folder / "pipe.png")
    (folder / "sub").mkdir()
    os.symlink(folder, folder / "sub" / "loop")  # a link back: not followed
    run = _run_cli("score", "--model", str(padim_file), str(folder), "--out",
                   str(tmp_path / "o"), timeout=240)
    assert run.returncode == 1, run.stderr
    assert f"FAILED {folder / 'pipe.png'}: not a regular file; skipped" in run.stderr
    data = json.loads((tmp_path / "o" / "results.json").read_text())
    assert sorted(r["path"] for r in data["results"]) == [str(folder / "new\\x0aline.png"),
                                                         str(folder / "ok.png")]
    assert sorted(p.name for p in (tmp_path / "o" / "masks").iterdir()) == ["new_line.png",
                                                                          "ok.png"]


@pytest.mark.slow
def test_file_names_with_undecodable_bytes(padim_file, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    name = os.fsdecode(b"bad\xff.png")
    Image.fromarray(textured_images(1)[0]).save(folder / name)
    run = _run_cli("score", "--model", str(padim_file), str(folder), "--out",
                   str(tmp_path / "o"))
    assert run.returncode == 0, run.stderr
    rows = list(csv.DictReader(open(tmp_path / "o" / "results.csv", encoding="utf-8")))
    assert rows[0]["path"] == f"{folder}/bad\\udcff.png" and Path(rows[0]["mask"]).is_file()


def test_results_csv_escapes_formula_names(padim_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Image.fromarray(textured_images(1)[0]).save(tmp_path / "=1+2.png")
    assert main(["score", "--model", str(padim_file), "=1+2.png", "--out", "o",
                 "--no-images"]) == 0
    rows = list(csv.reader(open(tmp_path / "o" / "results.csv", encoding="utf-8")))
    assert rows[1][0] == "'=1+2.png"
    assert json.loads((tmp_path / "o" / "results.json").read_text())["results"][0]["path"] \
        == "=1+2.png"


# is not, so a child forked from a big pytest process would report the parent's size.
_HWM_MAIN = """import atexit, sys
def _hwm():
    with open("/proc/self/status") as fh:
        kb = next(line.split()[1] for line in fh if line.startswith("VmHWM"))
    print("VMHWM_KB", kb, file=sys.stderr)
atexit.register(_hwm)
from anomaly_hooks.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _peak_rss_mb(argv: list) -> float:
    """Peak resident memory (MB) of ``anomaly-hooks ARGV`` run as a child process (Linux)."""
    proc = subprocess.run([sys.executable, "-c", _HWM_MAIN, *argv], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    kb = [line.split()[1] for line in proc.stderr.splitlines() if line.startswith("VMHWM_KB")]
    return int(kb[-1]) / 1024


PER_IMAGE_BOUND_MB = 1200  # README: scoring one 100 MP image (the default limit), over the model


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jpg", "png"])
def test_memory_of_scoring_the_largest_image_the_default_guard_accepts(tmp_path, padim_file,
                                                                      kind, capsys):
    """A 10000 x 10000 image (exactly the default data.max_pixels) scored by the command line,
    heatmap, overlay and mask PNGs included: the extra peak memory over scoring a small image
    stays under the bound the README states (5.5 GB before)."""
    side = int(DEFAULT_MAX_PIXELS ** 0.5)
    big = tmp_path / f"big.{kind}"
    if kind == "png":
        big.write_bytes(rgb_png(side, side))
    else:
        Image.new("RGB", (side, side), (90, 120, 150)).save(big, quality=90)
    small = tmp_path / "small.png"
    Image.fromarray(textured_images(1)[0]).save(small)
    base = _peak_rss_mb(["score", "--model", str(padim_file), str(small), "--out",
                         str(tmp_path / "o1")])
    peak = _peak_rss_mb(["score", "--model", str(padim_file), str(big), "--out",
                         str(tmp_path / "o2")])
    with Image.open(tmp_path / "o2" / "masks" / "big.png") as mask:
        assert mask.size == (side, side)
    with capsys.disabled():
        print(f"\n[memory] scoring a {side}x{side} {kind}: peak {peak:.0f} MB, a small image "
              f"{base:.0f} MB: {peak - base:.0f} MB for the image")
    assert peak - base < PER_IMAGE_BOUND_MB


# ---- outputs: writability, full disks, keeping the old model -----------------------------
def test_score_out_that_is_a_file_is_one_error_line(padim_file, tmp_path, capsys):
    (tmp_path / "out").write_text("a file")
    img = tmp_path / "x.png"
    Image.fromarray(textured_images(1)[0]).save(img)
    assert main(["score", "--model", str(padim_file), str(img), "--out",
                 str(tmp_path / "out")]) == 2
    assert one_error_line(capsys.readouterr().err) == \
        f"error: --out {tmp_path / 'out'}: exists and is not a folder"


def test_unwritable_out_and_output_fail_before_any_work(padim_file, tmp_path, capsys,
                                                        monkeypatch):
    import tempfile

    from anomaly_hooks import cli

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    monkeypatch.setattr(cli.Detector if hasattr(cli, "Detector") else Detector, "fit",
                        lambda *a, **k: pytest.fail("fit started"))
    assert main(["score", "--model", str(padim_file), str(tmp_path), "--out",
                 str(tmp_path / "o")]) == 2
    assert one_error_line(capsys.readouterr().err) == \
        f"error: --out {tmp_path / 'o'}: cannot write there (Read-only file system)"
    assert main(["fit", "--quiet", "--data", str(tmp_path), "--output",
                 str(tmp_path / "m" / "x.safetensors"), "backbone.weights=null"]) == 2
    assert one_error_line(capsys.readouterr().err) == \
        f"error: output folder {tmp_path / 'm'}: cannot write there (Read-only file system)"


def test_fit_output_checks_before_fitting(tmp_path, capsys, monkeypatch):
    import shutil

    data = tmp_path / "data"
    data.mkdir()
    for i, img in enumerate(textured_images(6, size=(32, 32))):
        Image.fromarray(img).save(data / f"{i}.png")
    monkeypatch.setattr(Detector, "fit", lambda *a, **k: pytest.fail("fit started"))
    fast = ["--quiet", "--data", str(data), "backbone.name=resnet18", "backbone.weights=null",
            "device=cpu", "preprocess.resize=64", "preprocess.crop=null", "data.num_workers=0"]
    assert main(["fit", "--output", str(tmp_path), *fast]) == 2
    assert one_error_line(capsys.readouterr().err) == \
        f"error: output={tmp_path} is a folder: give the model file's path"
    Usage = type(shutil.disk_usage(tmp_path))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 ** 9, 10 ** 9, 1000))
    assert main(["fit", "--output", str(tmp_path / "m.safetensors"), *fast]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: output={tmp_path / 'm.safetensors'}: the model needs about ")
    assert line.endswith("GB are free there: free space or write elsewhere")


def test_failed_cli_fit_keeps_the_existing_model(padim_file, tmp_path, capsys):
    target = tmp_path / "keep.safetensors"
    target.write_bytes(padim_file.read_bytes())
    before = target.read_bytes()
    bad = tmp_path / "bad_train"
    make_bad_files(bad)
    base = ["fit", "--data", str(bad), "--output", str(target), "--quiet",
            "backbone.name=resnet18", "backbone.weights=null", "device=cpu",
            "preprocess.resize=64", "preprocess.crop=null", "data.num_workers=0"]
    for extra in ([], ["data.on_error=skip"]):
        code = main(base + extra)
        err = capsys.readouterr().err
        assert code != 0
        one_error_line(err)
        assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".safetensors"] == [target.name]


def _limit_file_size(limit: int):
    def apply() -> None:  # in the child: writes past `limit` bytes fail with EFBIG (full disk)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_full_disk_leaves_no_half_written_results(padim_file, tmp_path):
    """Writes beyond a file-size limit fail as on a full disk: one error line, exit 2, and the
    previous results.csv / results.json stay whole (they are written atomically)."""
    src = tmp_path / "in"
    src.mkdir()
    for i, img in enumerate(textured_images(3)):
        Image.fromarray(img).save(src / f"p{i:03d}_{'x' * 200}.png")
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.csv").write_text("previous,results\n")
    (out / "results.json").write_text('{"previous": true}')
    run = _run_cli("score", "--model", str(padim_file), str(src), "--out", str(out),
                   "--no-images", preexec_fn=_limit_file_size(300))
    assert run.returncode == 2, run.stderr
    assert "File too large" in one_error_line(run.stderr)
    assert (out / "results.csv").read_text() == "previous,results\n"
    assert (out / "results.json").read_text() == '{"previous": true}'
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_full_disk_during_fit_save_is_one_error_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i, img in enumerate(textured_images(6, size=(32, 32))):
        Image.fromarray(img).save(data / f"{i}.png")
    run = _run_cli("fit", "--quiet", "--data", str(data), "--output",
                   str(tmp_path / "m.safetensors"), "backbone.name=resnet18",
                   "backbone.weights=null", "device=cpu", "preprocess.resize=64",
                   "preprocess.crop=null", "data.num_workers=0", "padim.n_features=20",
                   preexec_fn=_limit_file_size(4096))
    assert run.returncode == 2, run.stderr
    assert "cannot write the model file" in one_error_line(run.stderr) or \
        "File too large" in one_error_line(run.stderr)
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob(".*.tmp"))
