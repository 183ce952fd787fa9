"""Detector behaviour: fit/predict contract, threshold from good images, save/load, threads."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from anomaly_hooks import Detector, FitError, ModelFileError, NotFittedError
from anomaly_hooks.config import ConfigError

from conftest import ROOT, textured_images, with_defect


def test_predict_before_fit_is_a_clear_error(small_cfg):
    det = Detector.from_config(small_cfg)
    with pytest.raises(NotFittedError, match="call fit"):
        det.predict(textured_images(1)[0])
    with pytest.raises(NotFittedError):
        det.save("never.safetensors")


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
    from PIL import Image

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
    for field in ("value", "good_min", "good_median", "good_max"):
        assert getattr(got, field) == pytest.approx(getattr(ref, field), rel=1e-5), field


def test_list_predict_equals_single(fitted):
    imgs = textured_images(3, seed=4)
    batch = fitted.predict(imgs, batch_size=3)
    for img, p in zip(imgs, batch):
        assert p.score == pytest.approx(fitted.predict(img).score, rel=1e-5)


def test_threads_match_serial(fitted, tmp_path):
    from PIL import Image

    imgs = textured_images(6, seed=11) + [with_defect(textured_images(1, seed=12)[0])]
    Image.fromarray(imgs[0]).save(tmp_path / "a.png")
    inputs = [tmp_path / "a.png", *imgs[1:], torch.from_numpy(imgs[2]).permute(2, 0, 1)]
    serial = [fitted.predict(x) for x in inputs]
    results: dict = {}

    def work(t):
        for i in range(t % 3, len(inputs), 2):
            results[(t, i)] = fitted.predict(inputs[i])

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert results
    for (t, i), pred in results.items():
        assert pred.score == serial[i].score
        assert np.array_equal(pred.heatmap, serial[i].heatmap)


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
    from PIL import Image

    for i, img in enumerate(textured_images(6)):
        Image.fromarray(img).save(tmp_path / f"{i}.png")
    (tmp_path / "broken.png").write_text("nope")
    det = Detector.from_config(small_cfg)
    with pytest.raises(FitError, match=r"(?s)1 (training|threshold) image\(s\) could not be read:.*broken.png"):
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
    from PIL import Image

    for i, img in enumerate(textured_images(3, seed=50)):
        Image.fromarray(img).save(tmp_path / f"{i}.png")
    det = Detector.from_config(small_cfg, threshold__folder=str(tmp_path))
    det.fit(textured_images(6), progress=False)
    assert det.fit_info_["n_train"] == 6 and det.threshold_.n_images == 3
    t = det.fit_timings_  # the accumulate phase is split into its parts, which it contains
    parts = [t[f"accumulate: {k}"] for k in ("waiting for images", "features", "statistics")]
    assert all(p > 0 for p in parts[1:]) and sum(parts) <= t["accumulate"] + 1e-6
    assert t["total"] == pytest.approx(t["accumulate"] + t["finalize"] + t["threshold"])


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
