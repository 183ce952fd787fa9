"""Detector behaviour: fit/predict contract, threshold from good images, save/load, threads,
unreadable training images, determinism, configuration and data errors."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, backbone_rtol, f64_tol, textured_images, with_defect
from image_files import make_bad_files, png_bytes, write_good
from PIL import Image

from anomaly_hooks import Detector, FitError, ModelFileError, NotFittedError
from anomaly_hooks.config import ConfigError


def test_predict_before_fit_is_a_clear_error(small_cfg):
    from anomaly_hooks import AnomalyHooksError

    det = Detector.from_config(small_cfg)
    for call in (lambda: det.predict(textured_images(1)[0]),
                 lambda: det.decision_function(textured_images(1)),
                 lambda: det.save("never.safetensors"),
                 lambda: det.threshold_, lambda: det.scorer_, lambda: det.fit_info_):
        with pytest.raises(NotFittedError, match="call fit"):
            call()
    # scikit-learn's conventions: a ValueError and an AttributeError; hasattr is False
    assert issubclass(NotFittedError, (ValueError, AttributeError, AnomalyHooksError))
    assert not hasattr(det, "threshold_") and det.scorer is None and not det.is_fitted
    assert det.__sklearn_is_fitted__() is False
    with pytest.raises(AttributeError, match="no attribute 'bogus'"):
        det.bogus  # noqa: B018
    with pytest.raises(FitError, match="y must be None"):
        det.fit(textured_images(4), [0, 0, 0, 1])


def test_sklearn_conventions_after_fit(fitted):
    assert fitted.__sklearn_is_fitted__() is True
    assert fitted.scorer is fitted.scorer_ and fitted.is_fitted
    assert {"scorer_", "threshold_", "fit_info_", "fit_timings_"} <= set(vars(fitted))


def test_predict_one_gives_a_prediction_a_sequence_gives_a_list(fitted):
    from anomaly_hooks import Prediction

    imgs = textured_images(3, seed=4)
    one = fitted.predict(imgs[0])
    assert isinstance(one, Prediction)
    for seq in (imgs, tuple(imgs), (im for im in imgs), [imgs[0]]):
        out = fitted.predict(seq)
        assert isinstance(out, list) and all(isinstance(p, Prediction) for p in out)
    assert fitted.predict([]) == []
    assert fitted.predict([imgs[0]])[0].score == one.score


def test_decision_function_equals_predict_scores(fitted, tmp_path):
    imgs = textured_images(5, seed=44) + [with_defect(textured_images(1, seed=45)[0])]
    Image.fromarray(imgs[0]).save(tmp_path / "a.png")
    inputs = [tmp_path / "a.png", *imgs[1:]]
    scores = fitted.decision_function(inputs, batch_size=4)
    assert scores.dtype == np.float64 and scores.shape == (6,)
    assert scores.tolist() == [p.score for p in fitted.predict(inputs, batch_size=4)]
    single = fitted.decision_function(imgs[-1])
    # another batch: other kernels in the backbone (conftest.backbone_rtol)
    assert single.shape == (1,) and single[0] == pytest.approx(scores[-1], rel=backbone_rtol())
    assert scores.argmax() == 5  # the defect


def test_prediction_fields_and_frames(fitted):
    img = with_defect(textured_images(1, size=(120, 70), seed=9)[0])
    pred = fitted.predict(img)
    assert isinstance(pred.score, float) and isinstance(pred.is_anomalous, bool)
    assert pred.heatmap.shape == (120, 70) and pred.heatmap.dtype == np.float32
    assert pred.mask.shape == (120, 70) and pred.mask.dtype == bool
    assert 0.0 < pred.normalized_score < 1.0 or pred.normalized_score in (0.0, 1.0)
    # the hot spot of the heatmap is where the defect is (image centre)
    y, x = np.unravel_index(pred.heatmap.argmax(), pred.heatmap.shape)
    assert abs(y - 60) < 25 and abs(x - 35) < 20


def test_threshold_from_good_images_only(fitted):
    thr = fitted.threshold_
    assert thr.n_images == 4  # 25 % of 16 held out
    assert thr.value >= thr.good_median
    assert fitted.threshold_.normalize(thr.value) == pytest.approx(0.5)
    goods = fitted.predict(textured_images(8, seed=77))
    bads = fitted.predict([with_defect(g) for g in textured_images(8, seed=78)])
    assert min(b.score for b in bads) > max(g.score for g in goods)
    assert all(b.is_anomalous for b in bads)
    assert sum(g.is_anomalous for g in goods) <= 1
    assert all(b.mask.any() for b in bads)


def test_threshold_is_computed_from_the_threshold_images_scores(small_cfg, tmp_path):
    """The threshold images are decoded in the training pass (6 training + 5 threshold items in
    batches of 4: one batch holds both kinds); the threshold equals one computed from predict()
    on those images afterwards."""
    from anomaly_hooks.threshold import Threshold

    folder = tmp_path / "good"
    folder.mkdir()
    paths = []
    for i, img in enumerate(textured_images(5, seed=31)):
        paths.append(folder / f"{i}.png")
        Image.fromarray(img).save(paths[-1])
    det = Detector.from_config(small_cfg, threshold__folder=str(folder))
    det.fit(textured_images(6, seed=30), progress=False)
    assert det.fit_info_["n_train"] == 6
    ref = Threshold.from_good_scores([p.score for p in det.predict(paths)],
                                     det.cfg.threshold.quantile, det.cfg.threshold.margin)
    got = det.threshold_
    assert got.n_images == ref.n_images == 5
    for field in ("value", "good_min", "good_median", "good_max"):  # scored in other batches
        assert getattr(got, field) == pytest.approx(getattr(ref, field),
                                                    rel=backbone_rtol()), field


def test_list_predict_equals_single(fitted):
    imgs = textured_images(3, seed=4)
    batch = fitted.predict(imgs, batch_size=3)
    for img, p in zip(imgs, batch):  # a batch of 3 and of 1: other kernels in the backbone
        assert p.score == pytest.approx(fitted.predict(img).score, rel=backbone_rtol())


@pytest.mark.slow
def test_save_load_in_fresh_process_identical(fitted, tmp_path):
    path = fitted.save(tmp_path / "m.safetensors")
    imgs = textured_images(2, seed=21) + [with_defect(textured_images(1, seed=22)[0])]
    np.save(tmp_path / "imgs.npy", np.stack(imgs))
    here = [p.score for p in fitted.predict(list(imgs), batch_size=1)]
    code = (
        "import json, sys, numpy as np\n"
        "from anomaly_hooks import Detector\n"
        f"det = Detector.load({str(path)!r})\n"
        f"imgs = np.load({str(tmp_path / 'imgs.npy')!r})\n"
        "preds = det.predict(list(imgs), batch_size=1)\n"
        "print(json.dumps([p.score for p in preds]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    there = json.loads(out.stdout.strip().splitlines()[-1])
    assert there == here
    loaded = Detector.load(path)
    assert loaded.threshold_ == fitted.threshold_
    assert loaded.preprocessor == fitted.preprocessor


def test_custom_backbone_recorded_and_required(small_cfg, resnet18, tmp_path):
    det = Detector.from_config(small_cfg, backbone=resnet18,
                               backbone__layers=["layer1", "layer2"])
    det.fit(textured_images(8), progress=False)
    path = det.save(tmp_path / "custom.safetensors")
    with pytest.raises(ModelFileError, match="custom backbone"):
        Detector.load(path)
    again = Detector.load(path, backbone=resnet18)
    img = textured_images(1, seed=3)[0]
    assert again.predict(img).score == det.predict(img).score
    other = __import__("torchvision").models.resnet18()  # same architecture, other weights
    with pytest.raises(ModelFileError, match="weights differ"):
        Detector.load(path, backbone=other)


def test_fit_sources_and_errors(small_cfg, tmp_path):
    for i, img in enumerate(textured_images(6)):
        Image.fromarray(img).save(tmp_path / f"{i}.png")
    (tmp_path / "broken.png").write_text("nope")
    det = Detector.from_config(small_cfg)
    unreadable = r"(?s)1 (training|threshold) image\(s\) could not be read:.*broken.png"
    with pytest.raises(FitError, match=unreadable):
        det.fit(tmp_path, progress=False)
    skip = Detector.from_config(small_cfg, data__on_error="skip")
    skip.fit(tmp_path, progress=False)
    assert skip.fit_info_["n_train"] + skip.threshold_.n_images == 6
    assert len(skip.fit_info_["skipped"]) == 1
    with pytest.raises(FitError, match="at least 2 training images"):
        Detector.from_config(small_cfg).fit(textured_images(2), progress=False)
    with pytest.raises(ValueError, match="nothing: no such file or folder"):
        Detector.from_config(small_cfg).fit(tmp_path / "nothing", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: no image files"):
        Detector.from_config(small_cfg).fit(tmp_path / "empty", progress=False)


def test_separate_threshold_folder(small_cfg, tmp_path):
    for i, img in enumerate(textured_images(3, seed=50)):
        Image.fromarray(img).save(tmp_path / f"{i}.png")
    det = Detector.from_config(small_cfg, threshold__folder=str(tmp_path))
    det.fit(textured_images(6), progress=False)
    assert det.fit_info_["n_train"] == 6 and det.threshold_.n_images == 3
    t = det.fit_timings_  # the accumulate phase is split into its parts, which it contains
    parts = [t[f"accumulate: {k}"] for k in ("waiting for images", "features", "statistics")]
    # each lap, a difference of two close perf_counter readings, is exact (Sterbenz); the
    # parts' laps lie inside the accumulate lap, so only summing them rounds: 3 batches of 3
    # laps, then the 3 parts added here
    assert all(p > 0 for p in parts[1:])
    assert sum(parts) <= t["accumulate"] * (1 + f64_tol(3 * 3 + 3))
    steps = ("plan", "begin", "accumulate", "finalize", "threshold", "drift reference")
    # the total telescopes the steps' exact laps: only the sums round
    assert t["total"] == pytest.approx(sum(t[k] for k in steps), rel=f64_tol(2 * len(steps)))


def test_config_errors_name_the_key(small_cfg):
    with pytest.raises(ConfigError, match="padim.n_feature"):
        Detector.from_config(small_cfg, overrides=["padim.n_feature=3"])
    with pytest.raises(ConfigError, match="preprocess.crop"):
        Detector.from_config(small_cfg, preprocess={"resize": 64, "crop": 100})
    with pytest.raises(ConfigError, match="data.batch_size"):
        Detector.from_config(small_cfg, overrides=["data.batch_size=many"])
    with pytest.raises(ValueError, match="n_features=999 is larger than the 448"):
        Detector.from_config(small_cfg, padim__n_features=999).fit(textured_images(6),
                                                                   progress=False)
    with pytest.raises(ValueError, match="unknown layer"):
        Detector.from_config(small_cfg, backbone__layers=["layer9"])
    with pytest.raises(ValueError, match="takes an nn.Module"):
        Detector.from_config(small_cfg, backbone={"layers": ["layer1"]})


def test_fit_save_load_round_trip_on_each_device(small_cfg, tmp_path, device):
    det = Detector.from_config(small_cfg, device=str(device)).fit(textured_images(8),
                                                                  progress=False)
    assert det.device.type == device.type
    imgs = textured_images(2, seed=61) + [with_defect(textured_images(1, seed=62)[0])]
    before = det.predict(imgs)
    loaded = Detector.load(det.save(tmp_path / "m.safetensors"), device=str(device))
    after = loaded.predict(imgs)
    assert [p.score for p in after] == [p.score for p in before]
    assert all(np.array_equal(a.heatmap, b.heatmap) for a, b in zip(after, before))
    assert after[2].score > max(after[0].score, after[1].score)  # the defect stands out


@pytest.mark.slow
def test_importing_the_package_is_light_and_changes_nothing():
    """``import anomaly_hooks`` loads no torch and leaves the environment as it was; names come
    on first use."""
    code = ("import os, sys\n"
            "before = dict(os.environ)\n"
            "import anomaly_hooks\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert dict(os.environ) == before, 'environment changed'\n"
            "from anomaly_hooks import AnomalyHooksError, Prediction, ImageReadError\n"
            "assert 'torch' not in sys.modules, 'torch imported by the torch-free names'\n"
            "from anomaly_hooks import Detector\n"
            "assert 'torch' in sys.modules\n"
            "print('ok')\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_every_deliberate_error_derives_from_one_base():
    from anomaly_hooks import errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.AnomalyHooksError)
        if cls is not errors.AnomalyHooksError:
            assert issubclass(cls, ValueError), name  # what they were before: still caught


# ---- unreadable training images ----------------------------------------------------------
def _bad_training_folder(tmp_path: Path) -> tuple[Path, list[Path]]:
    folder = tmp_path / "train"
    write_good(folder, 10)
    bad = make_bad_files(folder)
    (folder / "notes.txt").write_text("not an image, and not named like one: ignored")
    return folder, sorted(bad.values())


def test_fit_raise_lists_every_bad_file(tmp_path, small_cfg):
    """data.on_error=raise: one FitError naming every unreadable file and nothing else (not the
    good images, not the non-image file), with the way to skip them; nothing is fitted."""
    folder, bad = _bad_training_folder(tmp_path)
    det = Detector.from_config(small_cfg)
    with pytest.raises(FitError) as err:
        det.fit(folder, progress=False)
    msg = str(err.value)
    missing = [p.name for p in bad if p.name not in msg]
    assert not missing, f"bad files not named in the error: {missing}\n{msg}"
    assert "good_" not in msg and "notes.txt" not in msg  # only the bad ones are listed
    assert "data.on_error=skip" in msg
    assert not det.is_fitted


def test_fit_skip_reports_how_many(tmp_path, small_cfg):
    folder, bad = _bad_training_folder(tmp_path)
    det = Detector.from_config(small_cfg, data__on_error="skip")
    det.fit(folder, progress=False)
    skipped = det.fit_info_["skipped"]
    assert len(skipped) == len(bad)
    for p in bad:
        assert any(p.name in s for s in skipped), p
    assert det.fit_info_["n_train"] + det.fit_info_["n_threshold"] == 10
    assert det.is_fitted


# ---- threads -----------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_fit_decoders_threads_processes_or_none_give_the_same_model(small_cfg, tmp_path):
    """``data.num_workers`` threads (the default), worker processes
    (``data.worker_processes``) or the caller's thread alone: the same batches, so the same
    model to the bit."""
    paths = []
    for i, img in enumerate(textured_images(12)):
        paths.append(tmp_path / f"{i:02d}.png")
        Image.fromarray(img).save(paths[-1])
    probe = textured_images(2, seed=7)
    scores = {}
    for name, data in {"caller": {"num_workers": 0}, "threads": {"num_workers": 2},
                       "processes": {"num_workers": 2, "worker_processes": True}}.items():
        det = Detector.from_config(small_cfg, data={**small_cfg["data"], **data})
        scores[name] = det.fit(paths, progress=False).decision_function(probe)
        scores[name + " threshold"] = det.threshold_.value
    assert scores["threads"].tolist() == scores["caller"].tolist() == scores["processes"].tolist()
    assert scores["threads threshold"] == scores["caller threshold"] == \
        scores["processes threshold"]


def test_predict_from_8_threads_equals_serial(fitted, tmp_path):
    rgb = textured_images(3, seed=3)
    path = tmp_path / "in.png"
    path.write_bytes(png_bytes(with_defect(rgb[0])))
    odd = textured_images(1, size=(50, 70), seed=4)[0]
    inputs = [
        path, str(path),
        Image.fromarray(rgb[1]),
        Image.fromarray(odd).convert("L"),
        rgb[2],
        odd,
        odd[:, :, 0],
        rgb[1].astype(np.float32) / 255.0,
        odd.astype(np.float64) / 255.0,
        torch.from_numpy(rgb[2]).permute(2, 0, 1).contiguous(),
        torch.from_numpy(odd).permute(2, 0, 1).float() / 255.0,
        textured_images(1, size=(130, 90), seed=6)[0],
        np.array([[[1, 2, 3]]], dtype=np.uint8),
    ]
    serial = [fitted.predict(x) for x in inputs]
    batches = [inputs[:5], inputs[5:]]
    serial_batches = [fitted.predict(b) for b in batches]
    # a lazily opened PIL image (not yet decoded), shared by every thread
    lazy = Image.open(path)
    inputs.append(lazy)
    serial.append(fitted.predict(Image.open(path)))

    jobs = [(i, x) for _ in range(4) for i, x in enumerate(inputs)]
    jobs += [(-1 - j, b) for _ in range(2) for j, b in enumerate(batches)]
    random.Random(0).shuffle(jobs)
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda job: (job[0], fitted.predict(job[1])), jobs))
    lazy.close()
    assert len(results) == len(jobs)

    def same(pred, ref, what):
        assert pred.score == ref.score, what
        assert pred.is_anomalous == ref.is_anomalous, what
        assert pred.heatmap.shape == ref.heatmap.shape, what
        assert np.array_equal(pred.heatmap, ref.heatmap), what
        assert np.array_equal(pred.mask, ref.mask), what

    for i, pred in results:
        if i >= 0:
            same(pred, serial[i], f"input {i}")
        else:
            assert len(pred) == len(serial_batches[-1 - i])
            for k, (p, r) in enumerate(zip(pred, serial_batches[-1 - i])):
                same(p, r, f"batch {-1 - i} item {k}")


def test_close_while_threads_predict_only_gives_the_closed_error(small_cfg):
    det = Detector.from_config(small_cfg)
    det.fit(textured_images(8), progress=False)
    images = textured_images(2, seed=3)
    errors: list = []
    started = threading.Barrier(5)

    def work() -> None:
        started.wait()
        for _ in range(30):
            try:
                det.predict(images)
            except Exception as exc:  # noqa: BLE001 - every kind is recorded and checked
                errors.append(exc)
                return

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait()
    det.close()
    for t in threads:
        t.join()
    assert errors and all(isinstance(e, RuntimeError) and str(e) ==
                          "the extractor is closed; create a new one" for e in errors), errors


# ---- determinism -------------------------------------------------------------------------
DET_CFG = {"preprocess__resize": [64, 64], "preprocess__crop": None}


@pytest.mark.parametrize("method", ["padim", pytest.param("padim-dense", marks=pytest.mark.slow),
                                    "patchcore"])
def test_same_seed_same_bytes_other_seed_other_bytes(method, small_cfg, tmp_path):
    """...and a loaded model scores bit-identically to the fitted one."""
    imgs = textured_images(8, size=(64, 64), seed=11)
    extra = {"patchcore": {"patchcore__coreset_ratio": 0.25, "patchcore__knn_backend": "torch"},
             "padim-dense": {"padim__covariance": "dense"}}.get(method, {})
    files, dets = [], []
    for run, seed in enumerate((7, 7, 8)):
        det = Detector.from_config(small_cfg, method=method.split("-")[0], seed=seed, **DET_CFG,
                                   **extra)
        det.fit(imgs, progress=False)
        files.append(det.save(tmp_path / f"{method}_{run}.safetensors"))
        dets.append(det)
    assert files[0].read_bytes() == files[1].read_bytes()
    assert files[0].read_bytes() != files[2].read_bytes()
    probe = textured_images(2, size=(64, 64), seed=9)
    for got, want in zip(Detector.load(files[0]).predict(probe), dets[0].predict(probe)):
        assert got.score == want.score and np.array_equal(got.heatmap, want.heatmap)


# ---- configuration and data errors -------------------------------------------------------
def test_impossible_layer_lists_valid_names(small_cfg):
    with pytest.raises(ValueError) as err:
        Detector.from_config(small_cfg, backbone__layers=["layer9"])
    msg = str(err.value)
    assert "layer9" in msg and "\n" not in msg
    for name in ("layer1", "layer2", "layer3", "layer4"):
        assert name in msg


def test_n_features_larger_than_backbone(small_cfg):
    det = Detector.from_config(small_cfg, padim__n_features=5000)
    with pytest.raises(ValueError) as err:
        det.fit(textured_images(6), progress=False)
    msg = str(err.value)
    assert "padim.n_features=5000" in msg and "\n" not in msg
    total = sum(i.channels for i in det.layer_info)
    assert f"1..{total}" in msg


def test_too_few_training_images(small_cfg):
    imgs = textured_images(3)
    for n in (1, 2):
        det = Detector.from_config(small_cfg)
        with pytest.raises(ValueError) as err:
            det.fit(imgs[:n], progress=False)
        msg = str(err.value)
        assert "\n" not in msg
        assert "add" in msg and ("holdout_fraction" in msg or "good images" in msg), msg
    # 3 images: 1 held out for the threshold, 2 left -- the PaDiM minimum
    det = Detector.from_config(small_cfg).fit(imgs, progress=False)
    assert det.fit_info_["n_train"] == 2
