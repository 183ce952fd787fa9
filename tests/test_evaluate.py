"""Evaluation runner: dataset readers, metrics wiring, results files and the HTML report."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import SAMPLE, f64_tol
from sklearn.metrics import roc_auc_score

from anomaly_hooks.cli import main
from anomaly_hooks.data import DataError
from anomaly_hooks.evaluation.datasets import copies_of_training, folders, mvtec, open_dataset
from anomaly_hooks.evaluation.runner import evaluate, format_table, write_results


def _small_overrides() -> list[str]:
    return ["backbone.name=resnet18", "backbone.weights=null", "preprocess.resize=96",
            "preprocess.crop=null", "padim.n_features=60", "data.num_workers=0", "device=cpu"]


def _sample_subset(tmp_path: Path, n_train: int = 12) -> Path:
    """A copy of the sample data with fewer images (fast)."""
    root = tmp_path / "sample"
    for folder in ("train/good", "test/good", "test/scratch", "test/stain"):
        files = sorted((SAMPLE / folder).glob("*.png"))
        files = files[:n_train] if folder == "train/good" else files[:4]
        (root / folder).mkdir(parents=True)
        for f in files:
            shutil.copy(f, root / folder / f.name)
            defect = folder.split("/")[1]
            mask = SAMPLE / "ground_truth" / defect / f"{f.stem}_mask.png"
            if defect != "good":
                (root / "ground_truth" / defect).mkdir(parents=True, exist_ok=True)
                shutil.copy(mask, root / "ground_truth" / defect / mask.name)
    return root


def test_mvtec_reader_labels_and_masks():
    ds = open_dataset(SAMPLE)
    assert len(ds.train) == 60 and len(ds.test) == 12 + 4 * 8
    assert int(ds.labels.sum()) == 32 and ds.has_masks
    bad = next(s for s in ds.test if s.label)
    mask = ds.load_mask(bad, (256, 256))
    assert mask.dtype == bool and mask.any()
    good = next(s for s in ds.test if not s.label)
    assert not ds.load_mask(good, (256, 256)).any()
    with pytest.raises(DataError, match="masks must match their images"):
        ds.load_mask(bad, (300, 256))


def test_reader_errors(tmp_path):
    root = _sample_subset(tmp_path)
    victim = next((root / "ground_truth" / "scratch").glob("*.png"))
    victim.unlink()
    with pytest.raises(DataError, match="without a mask"):
        mvtec(root)
    with pytest.raises(DataError, match="not an MVTec AD layout"):
        mvtec(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no image files"):
        folders(tmp_path / "empty", [root / "test" / "stain"])
    with pytest.raises(DataError, match="no mask named"):
        folders(root / "train" / "good", [root / "test" / "scratch"], masks=root / "ground_truth")


def test_copies_of_training_images_are_found_by_their_bytes(tmp_path):
    """A test image whose file equals a training image's is a copy; a file of the same size
    with other bytes, and the same picture written again (other bytes), are not."""
    root = _sample_subset(tmp_path)
    train = sorted((root / "train" / "good").glob("*.png"))
    good = root / "test" / "good"
    shutil.copy(train[0], good / "copy.png")
    same_size = bytearray(train[1].read_bytes())
    same_size[-20] ^= 0xFF
    (good / "same_size.png").write_bytes(bytes(same_size))
    from PIL import Image

    with Image.open(train[2]) as img:
        img.save(good / "rewritten.png", compress_level=1)
    assert (good / "rewritten.png").read_bytes() != train[2].read_bytes()
    ds = mvtec(root)
    flags = copies_of_training(ds)
    assert len(flags) == len(ds.test)
    assert [s.path.name for s, c in zip(ds.test, flags) if c] == ["copy.png"]


def test_generic_folders_split_and_masks(tmp_path):
    root = _sample_subset(tmp_path)
    ds = folders(root / "train" / "good", [root / "test" / "stain"], masks=root / "ground_truth",
                 test_fraction=0.25, seed=3)
    assert len(ds.train) == 9 and sum(1 for s in ds.test if not s.label) == 3
    assert all(s.mask_path is not None for s in ds.test if s.label)
    again = folders(root / "train" / "good", [root / "test" / "stain"], test_fraction=0.25, seed=3)
    assert again.train == ds.train and not again.has_masks


@pytest.mark.slow
def test_evaluate_metrics_agree_with_sklearn_and_report(tmp_path):
    ds = mvtec(_sample_subset(tmp_path))
    res = evaluate(None, ds, _small_overrides(), report_dir=tmp_path / "report", progress=False)
    labels = [r["label"] for r in res.images]
    scores = [r["score"] for r in res.images]
    # float64 on both sides: at most n trapezoids of rates in [0, 1]
    assert res.summary["image_auroc"] == pytest.approx(roc_auc_score(labels, scores),
                                                       abs=f64_tol(len(scores)))
    for key in ("pixel_auroc", "aupro", "image_f1_max", "pixel_f1_max", "ms_per_image"):
        assert res.summary[key] is not None
    assert 0.0 <= res.summary["aupro"] <= 1.0
    page = (tmp_path / "report" / "index.html").read_text()
    assert page.count("<tr><td>") == len(ds.test)
    assert (tmp_path / "report" / "roc.png").is_file()
    assert (tmp_path / "report" / "pro.png").is_file()
    write_results([res], tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(saved["datasets"][0]["images"]) == len(ds.test)
    assert "mean" in format_table([res, res])


@pytest.mark.slow
def test_report_without_masks(tmp_path):
    root = _sample_subset(tmp_path)
    ds = folders(root / "train" / "good", [root / "test" / "scratch"], seed=0)
    res = evaluate(None, ds, _small_overrides(), report_dir=tmp_path / "r", progress=False)
    assert "pixel_auroc" not in res.summary and "aupro" not in res.summary
    assert "no mask" in (tmp_path / "r" / "index.html").read_text()


@pytest.mark.slow
def test_evaluate_cli(tmp_path, capsys):
    root = _sample_subset(tmp_path)
    code = main(["evaluate", "--data", str(root), "--out", str(tmp_path / "ev"), "--quiet",
                 *_small_overrides()])
    out = capsys.readouterr().out
    assert code == 0 and "img AUROC" in out
    assert (tmp_path / "ev" / "results.csv").read_text().count("\n") == 3  # header, row, mean
    assert (tmp_path / "ev" / "sample" / "report" / "index.html").is_file()
    assert main(["evaluate", "--out", str(tmp_path / "x")]) == 2
    assert "no dataset" in capsys.readouterr().err


# -- the operating point from a few labelled defects ---------------------------------------------
@pytest.mark.slow
def test_threshold_defects_set_the_operating_point_and_leave_the_metrics(tmp_path):
    """A seeded draw of defective test images sets the F1 operating point: marked in the rows,
    left out of every metric; the summary gives the false alarms on test/good, the recorded
    interval, the recall and F1 at the stored threshold."""
    from sklearn.metrics import f1_score

    from anomaly_hooks.calibration import clopper_pearson
    from anomaly_hooks.fitting import SEED_THRESHOLD_DEFECTS

    ds = mvtec(_sample_subset(tmp_path))
    overrides = [*_small_overrides(), "threshold.objective=f1"]
    res = evaluate(None, ds, overrides, report_dir=tmp_path / "r", progress=False,
                   threshold_defects=3)
    s = res.summary
    used = [r for r in res.images if r["used_for_threshold"]]
    rest = [r for r in res.images if not r["used_for_threshold"]]
    assert len(used) == 3 and all(r["label"] == 1 for r in used)
    rng = np.random.default_rng(SEED_THRESHOLD_DEFECTS)  # config seed 0
    bad = [i for i, t in enumerate(ds.test) if t.label == 1]
    assert sorted(r["path"] for r in used) == sorted(
        str(ds.test[i].path) for i in rng.choice(bad, 3, replace=False))
    labels = np.array([r["label"] for r in rest])
    scores = np.array([r["score"] for r in rest])
    flagged = scores > s["threshold"]
    assert [r["is_anomalous"] for r in rest] == flagged.tolist()
    assert s["n_test"] == len(rest) and s["image_auroc"] == pytest.approx(
        roc_auc_score(labels, scores), abs=f64_tol(len(scores)))  # n trapezoids, float64
    assert s["threshold_objective"] == "f1"
    assert s["threshold_far"] == flagged[labels == 0].mean()
    assert s["threshold_recall"] == flagged[labels == 1].mean()
    # counts divided, then a few float64 operations; a mean of n labels
    assert s["threshold_f1"] == pytest.approx(f1_score(labels, flagged), abs=f64_tol(8))
    assert s["threshold_prevalence"] == pytest.approx(labels.mean(),  # of the evaluated images
                                                      abs=f64_tol(len(labels)))
    k = sum(v > s["threshold"] for v in s["threshold_scores"])
    assert s["threshold_far_interval"] == list(clopper_pearson(k, len(s["threshold_scores"])))
    assert s["threshold_provenance"]["defects"]["n"] == 3
    assert (tmp_path / "r" / "operating.png").is_file()
    assert (tmp_path / "r" / "index.html").read_text().count("used for the threshold") == 3
    write_results([res], tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "results.json").read_text())["datasets"][0]
    assert {"threshold_far", "threshold_far_interval", "threshold_recall",
            "threshold_objective"} <= set(saved)
    row = saved["images"][0]
    assert {"score", "label", "is_anomalous", "used_for_threshold"} <= set(row)


def test_threshold_defects_errors(tmp_path, capsys):
    """Too many defects to draw, a negative count, and an objective without defects: one error
    line before any fit."""
    root = _sample_subset(tmp_path)
    out = str(tmp_path / "ev")
    assert main(["evaluate", "--data", str(root), "--out", out, "--threshold-defects", "8",
                 *_small_overrides()]) == 2
    assert "has 8 defective test images; leave at least one" in capsys.readouterr().err
    assert main(["evaluate", "--data", str(root), "--out", out, "--threshold-defects", "-1",
                 *_small_overrides()]) == 2
    assert "give a count >= 0" in capsys.readouterr().err
    assert main(["evaluate", "--data", str(root), "--out", out, *_small_overrides(),
                 "threshold.objective=f1"]) == 2
    assert "needs labelled defects: --threshold-defects N" in capsys.readouterr().err


@pytest.mark.slow
def test_evaluation_reports_the_stored_thresholds_false_alarms(tmp_path, monkeypatch):
    """FAR on test/good, precision and recall at the stored threshold (recomputed here from the
    per-image records), the ROC operating point drawn on the report's ROC."""
    from anomaly_hooks.evaluation import report
    from anomaly_hooks.evaluation.runner import format_markdown

    marked = []
    real = report._mark_operating_point
    monkeypatch.setattr(report, "_mark_operating_point",
                        lambda ax, *point: (marked.append(point), real(ax, *point)))
    root = _sample_subset(tmp_path)
    train = sorted((root / "train" / "good").glob("*.png"))
    shutil.copy(train[0], root / "test" / "good" / "seen.png")  # a copy of a training image
    ds = mvtec(root)
    with pytest.warns(UserWarning, match=r"1 test image\(s\) are byte copies of training "
                      r"images \(e.g. \['seen.png'\]\)"):
        res = evaluate(None, ds, _small_overrides(), report_dir=tmp_path / "r", progress=False)
    s = res.summary
    labels = np.array([r["label"] for r in res.images])
    flagged = np.array([r["score"] > s["threshold"] for r in res.images])
    copy = np.array([r["copy_of_training"] for r in res.images])
    assert [Path(r["path"]).name for r in res.images if r["copy_of_training"]] == ["seen.png"]
    assert s["threshold_far"] == flagged[labels == 0].mean()
    unseen = (labels == 0) & ~copy
    assert s["test_copies_of_training"] == 1 and s["threshold_n_good_unseen"] == 4
    assert s["threshold_false_alarms_unseen"] == flagged[unseen].sum()
    assert s["threshold_far_unseen"] == flagged[unseen].mean()
    assert (tmp_path / "r" / "index.html").read_text().count("a copy of a training image") == 1
    assert s["threshold_recall"] == flagged[labels == 1].mean()
    assert s["threshold_source"] == "all-images" and s["threshold_target_far"] == 0.01
    assert s["threshold_n_images"] == len(s["threshold_scores"]) == 12
    assert marked == [(s["threshold_far"], s["threshold_recall"], 0.01,
                       s["threshold_far_interval"])]
    assert (tmp_path / "r" / "roc.png").is_file()
    assert "thr. FAR (test good)" in format_markdown([res])
