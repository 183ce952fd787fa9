"""The memory guard of a fit: the estimate refused past resources.memory_limit_gb (naming the
keys to lower), and the estimates against the formulas and the tensors a fit keeps."""
from __future__ import annotations

import re

import pytest
from conftest import textured_images

from anomaly_hooks import Detector
from anomaly_hooks.config import load_config, to_container
from anomaly_hooks.extractor import LayerInfo
from anomaly_hooks.resources import GB, ResourceError, estimate_fit_memory
from anomaly_hooks.scorers.padim import PadimScorer
from anomaly_hooks.scorers.patchcore import PatchCoreScorer


@pytest.mark.parametrize("method, key", [("padim", "padim.n_features"),
                                         ("patchcore", "patchcore.max_bank_points")])
def test_resource_guard(method, key, small_cfg):
    imgs = textured_images(6)
    det = Detector.from_config(small_cfg, method=method, resources__memory_limit_gb=0.001)
    with pytest.raises(ResourceError) as err:
        det.fit(imgs, progress=False)
    msg = str(err.value)
    assert key in msg and "resources.memory_limit_gb" in msg
    n_held = max(1, round(0.25 * 6))
    scorer = {"padim": PadimScorer, "patchcore": PatchCoreScorer}[method]
    est = estimate_fit_memory(scorer, det.cfg, det.layer_info, det.preprocessor.input_size,
                              6 - n_held, n_held)
    assert est["threshold images (preprocessed)"] == n_held * 3 * 64 * 80 * 4
    m = re.search(r"needs about ([0-9.eE+-]+) GB", msg)
    assert m, msg
    # printed with 3 significant digits: within half a unit of the third, 0.5 % at most
    assert float(m.group(1)) == pytest.approx(est["total"] / GB, rel=5e-3), msg
    m = re.search(r"limit is ([0-9.eE+-]+) GB", msg)
    assert m and float(m.group(1)) == pytest.approx(0.001, rel=5e-3), msg
    assert not det.is_fitted
    ok = Detector.from_config(small_cfg, method=method, resources__memory_limit_gb=64.0,
                              patchcore__knn_backend="torch")
    ok.fit(imgs, progress=False)
    assert ok.is_fitted


def test_padim_estimate_matches_the_formula_and_the_model(fitted):
    cfg, layers = fitted.cfg, fitted.layer_info
    h, w = fitted.preprocessor.input_size
    stride = min(i.stride for i in layers)
    positions = -(-h // stride) * -(-w // stride)
    assert (h, w) == (64, 80) and stride == 4 and positions == 16 * 20
    d = cfg.padim.n_features
    n = fitted.fit_info_["n_train"]
    assert n == 12 and fitted.scorer_.gaussians.kind == "lowrank"  # 12 <= 0.4 * 40
    est = estimate_fit_memory(PadimScorer, cfg, layers, (h, w), n)
    assert est["model"] == positions * (n * d + n * n + d) * 4
    tensors, _ = fitted.scorer_.state()
    assert sum(t.nbytes for k, t in tensors.items() if k.startswith("padim.")) == est["model"]
    dense_cfg = load_config(to_container(cfg), padim__covariance="dense")
    est = estimate_fit_memory(PadimScorer, dense_cfg, layers, (h, w), n)
    assert est["model"] == positions * d * d * 4 + positions * d * 4


def test_wrn50_memory_estimates_match_the_tensor_sizes():
    """WRN50 at 224, d = 550 (3136 positions): dense keeps one float32 [P, D, D] tensor (sums,
    then covariances, then factors, in place) and, with n <= 2 D images and the all-images
    threshold, their float32 embeddings [P, n, D] (padim.keep_embeddings); float16 factors halve
    the factors; bottle's 167 training images keep the low-rank form, less than half the dense
    fit."""
    cfg = load_config(None, padim__n_features=550)
    layers = [LayerInfo("layer1", 256, 4), LayerInfo("layer2", 512, 8),
              LayerInfo("layer3", 1024, 16)]
    est = estimate_fit_memory(PadimScorer, cfg, layers, (224, 224), 250)  # > 220: dense
    assert est["model"] == 3136 * 550 * 550 * 4 + 3136 * 550 * 4 + 3136 * 250 * 550 * 4
    assert est["statistics (float32 sums, factorised in place)"] == 3136 * 550 * 550 * 4
    assert est["float16 factors"] == 0
    half = estimate_fit_memory(PadimScorer, load_config(None, padim__n_features=550,
                                           padim__factor_dtype="float16"),
                               layers, (224, 224), 200)  # float16: dense whatever n
    assert half["float16 factors"] == 3136 * 550 * 550 * 2
    assert half["model"] == 3136 * 550 * 550 * 2 + 3136 * 550 * 4 + 3136 * 200 * 550 * 4
    low = estimate_fit_memory(PadimScorer, cfg, layers, (224, 224), 167)
    assert low["model"] == 3136 * (167 * 550 + 167 * 167 + 550) * 4
    assert low["total"] < est["total"] / 2
