"""One loaded model as the service uses it (engine.py): its three steps compute what
``Detector.predict`` computes, the drift taps change no score, pictures only when asked for, and
a path that is not a model file is refused before it is read."""
from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
from conftest import backbone_rtol, f32_tol, textured_images, with_defect
from PIL import Image
from serve_helpers import encode

from anomaly_hooks.errors import ModelFileError
from anomaly_hooks.prediction import Verdict
from anomaly_hooks.serve.engine_torch import TorchEngine as Engine


@pytest.fixture(scope="module")
def engine(fitted):
    return Engine(fitted, "in-memory", "0" * 64, 0, 0.0)


def test_engine_matches_detector_predict(engine, fitted):
    images = [textured_images(1, seed=3)[0], with_defect(textured_images(1, seed=4)[0]),
              textured_images(1, size=(150, 90), seed=5)[0]]
    expected = fitted.predict(images)
    items = [engine.prepare(encode(img), 10**8, 1024) for img in images]
    scores, maps = engine.infer([it.tensor for it in items])
    for item, score, heat, exp in zip(items, scores, maps, expected):
        out = engine.finish(float(score), heat, item, overlay=True, keep_anomalous=False,
                            thumb_side=64)
        verdict = out.verdict
        assert isinstance(verdict, Verdict)  # the library's one verdict record
        # the engine's batch against predict's: other kernels in the backbone
        assert verdict.score == pytest.approx(exp.score, rel=backbone_rtol())
        assert verdict.is_anomalous == exp.is_anomalous
        assert verdict.threshold == exp.threshold
        # normalize is a logistic of (score - value) / scale: its slope is at most 1 / 4
        slack = backbone_rtol() * exp.score / (4 * fitted.threshold_.scale)
        assert verdict.normalized_score == pytest.approx(exp.normalized_score, rel=0, abs=slack)
        assert abs(verdict.anomalous_pixels - int(exp.mask.sum())) <= max(2,
                                                                           exp.mask.size // 1000)
        assert (item.height, item.width) == exp.heatmap.shape
        overlay = Image.open(io.BytesIO(out.overlay_png))
        mask = Image.open(io.BytesIO(out.mask_png))
        assert overlay.size == mask.size == (item.width, item.height)
        assert max(Image.open(io.BytesIO(out.thumb_jpg)).size) == 64
    assert expected[1].is_anomalous and not expected[0].is_anomalous


def test_engine_taps_channel_means_without_changing_scores(engine, fitted):
    """The drift seam's features: each tapped layer's channel means from the scoring pass,
    equal to a separate forward pass's (brute force); the scores are the same with or
    without them."""
    tensors = [engine.prepare(encode(img), 10**8, 64).tensor
               for img in textured_images(3, seed=21)]
    features = {}
    scores, _ = engine.infer(tensors, features=features)
    plain, _ = engine.infer(tensors)
    np.testing.assert_array_equal(scores, plain)
    reference = fitted.extractor(torch.stack(tensors))
    assert list(features) == list(reference) == fitted.layers
    for name, feat in reference.items():
        assert features[name].dtype == np.float32 and features[name].shape == feat.shape[:2]
        # the same forward pass, then a float32 mean of h * w values: n * F32_EPS / 2 times the
        # mean of their magnitudes
        hw = feat.shape[2] * feat.shape[3]
        np.testing.assert_allclose(features[name], feat.double().mean(dim=(2, 3)).numpy(),
                                   rtol=0, atol=f32_tol(hw, float(feat.abs().mean((2, 3)).max())))


def test_engine_overlay_is_capped_and_rendered_only_when_asked(engine):
    item = engine.prepare(encode(textured_images(1, size=(300, 200))[0]), 10**8, 100)
    assert item.preview.shape == (100, 67, 3)
    scores, maps = engine.infer([item.tensor])
    out = engine.finish(float(scores[0]), maps[0], item, overlay=False, keep_anomalous=False,
                        thumb_side=0)
    assert out.overlay_png is None and out.mask_png is None and out.thumb_jpg is None
    out = engine.finish(float(scores[0]), maps[0], item, overlay=False, keep_anomalous=True,
                        thumb_side=0)
    assert (out.overlay_png is not None) == out.verdict.is_anomalous
    out = engine.finish(float(scores[0]), maps[0], item, overlay=True, keep_anomalous=False,
                        thumb_side=0)
    assert Image.open(io.BytesIO(out.overlay_png)).size == (67, 100)




def test_load_refuses_what_is_not_a_model_file_before_reading_it(tmp_path, monkeypatch):
    from anomaly_hooks.serve import engine as engine_module

    def never(*args, **kwargs):
        raise AssertionError("read or hashed")

    monkeypatch.setattr(engine_module, "file_sha256", never)
    for path, needle in [("/dev/zero", "not a regular file (a character device)"),
                         (tmp_path, "is a folder"),
                         (tmp_path / "none.safetensors", "model file not found")]:
        with pytest.raises(ModelFileError, match=re.escape(needle)):
            Engine.load(str(path))
