"""A tiled (high-resolution) Detector end to end: fit, predict, heatmaps in the caller's frame,
save/load, the framing in the model info, the seam test, the memory guard counting tiles, and
the CLI's score / evaluate on a tiled config."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, backbone_rtol, textured_images, with_defect
from PIL import Image

from anomaly_hooks import Detector
from anomaly_hooks.errors import FitError, ResourceError
from anomaly_hooks.resources import estimate_fit_memory
from anomaly_hooks.scorers import get_scorer

SIZE = (150, 230)  # not a multiple of the stride, not the tile's aspect


def tiled_cfg(method: str = "patchcore", **section) -> dict:
    cfg = {"method": method, "seed": 0, "device": "cpu",
           "backbone": {"name": "resnet18", "weights": None},
           "tiling": {"enabled": True, "scale": 1.0, "tile": 96, "overlap": 32,
                      "tile_batch": 5},
           "threshold": {"mode": "all-images"},
           "data": {"batch_size": 4, "num_workers": 0}}
    cfg.update({"patchcore": {"coreset_ratio": 0.1, "prereduce": 4}, "padim": {"n_features": 40}})
    cfg[method] = {**cfg[method], **section}
    return cfg


@pytest.fixture(scope="module", params=[("patchcore", {}), ("padim", {}),
                                        ("padim", {"positions": "tile"})],
                ids=["patchcore", "padim-frame", "padim-tile"])
def tiled(request):
    method, section = request.param
    det = Detector.from_config(tiled_cfg(method, **section))
    det.fit(textured_images(10, size=SIZE), progress=False)
    return det


@pytest.mark.slow
def test_padim_tile_positions_second_pass_scores_equal_a_refit_without_the_image():
    """PaDiM ``positions: tile`` with more tile windows than it keeps samples for (5 images x
    8 tiles > 2 x 8 dimensions): the threshold's second pass scores each image's windows by
    the Gaussians fitted without them, as a fit without the image scores it."""
    cfg = tiled_cfg("padim", positions="tile", n_features=8)
    cfg["threshold"] = {"mode": "all-images", "near_duplicates": None}
    images = textured_images(5, size=SIZE)
    det = Detector.from_config(cfg).fit(images, progress=False)
    assert det.threshold_.n_images == 5
    refit = Detector.from_config(cfg).fit(images[:2] + images[3:], progress=False)
    want = float(refit.decision_function([images[2]])[0])
    # the same embeddings; the Gaussians' float32 sums in another order
    assert det.threshold_.scores[2] == pytest.approx(want, rel=2 * backbone_rtol())


def test_tiled_fit_decides_the_frame_and_reports_it(tiled):
    info = tiled.fit_info_["framing"]
    assert info["mode"] == "tiled" and info["uninspected_fraction"] == 0.0
    assert info["content"] == list(SIZE) and info["size"] == [160, 240]  # rounded up to 16
    assert info["tiles"]["tiles"] == [2, 4] and info["tiles"]["min_margin"] >= 16
    assert tiled.preprocessor.input_size == (160, 240)


def test_tiled_predictions_come_back_in_the_callers_frame(tiled):
    good = textured_images(2, size=SIZE, seed=5)
    bad = with_defect(textured_images(1, size=SIZE, seed=6)[0])
    preds = tiled.predict([*good, bad])
    assert all(p.heatmap.shape == SIZE for p in preds)
    assert preds[2].score > max(p.score for p in preds[:2])
    ys, xs = np.unravel_index(np.argmax(preds[2].heatmap), SIZE)
    assert abs(ys - SIZE[0] / 2) < 20 and abs(xs - SIZE[1] / 2) < 20  # the stain's place
    # an image of another size and aspect: letterboxed in, and its heatmap back at its size
    other = tiled.predict(textured_images(1, size=(100, 300), seed=7)[0])
    assert other.heatmap.shape == (100, 300)
    # the same images in the same batches through the same kernels: the same scores
    np.testing.assert_array_equal(tiled.decision_function([*good, bad]),
                                  [p.score for p in preds])


def test_tiled_model_saves_and_loads_the_same_predictions(tiled, tmp_path):
    path = tiled.save(tmp_path / "tiled.safetensors")
    loaded = Detector.load(path)
    assert loaded.tiling is not None and loaded.preprocessor == tiled.preprocessor
    assert loaded.fit_info_["framing"] == tiled.fit_info_["framing"]
    image = with_defect(textured_images(1, size=SIZE, seed=8)[0])
    a, b = tiled.predict(image), loaded.predict(image)
    assert a.score == b.score
    np.testing.assert_array_equal(a.heatmap, b.heatmap)


def test_padim_neighbourhood_scores_a_tiled_model_no_higher(tiled):
    """``padim.neighbourhood`` on the stitched grid (frame) or a tile window's (tile): the
    fit is the same, every patch score can only fall (its own Gaussian is one of the
    neighbourhood's), so the image scores (max of a positively weighted blur) fall or stay."""
    if tiled.cfg.method != "padim":
        pytest.skip("a PaDiM setting")
    images = [with_defect(img) for img in textured_images(3, size=SIZE, seed=9)]
    own = tiled.decision_function(images)
    tiled.scorer_.neighbourhood = 1
    try:
        near = tiled.decision_function(images)
    finally:
        tiled.scorer_.neighbourhood = 0
    assert np.all(near <= own) and np.any(near < own)


def test_a_failed_fit_keeps_the_previous_frame(tiled):
    before = (tiled.preprocessor, tiled.tiling.frame, tiled.threshold_)
    with pytest.raises(FitError):
        # larger images (another frame) of which one is unreadable: the fit fails late
        tiled.fit([*textured_images(4, size=(200, 300)), Path("/nonexistent.png")],
                  progress=False)
    assert (tiled.preprocessor, tiled.tiling.frame, tiled.threshold_) == before


def test_default_framing_reports_what_its_crop_never_inspects(fitted):
    info = fitted.fit_info_["framing"]
    assert info["mode"] == "resize-crop" and fitted.tiling is None
    assert info["uninspected_fraction"] == pytest.approx(1 - (64 * 80) / (80 * 96))


def test_a_configured_crop_is_reported_as_uninspected():
    det = Detector.from_config(tiled_cfg(), tiling={"crop": [0.8, 0.9]})
    det.fit(textured_images(6, size=SIZE), progress=False)
    assert det.fit_info_["framing"]["uninspected_fraction"] == pytest.approx(1 - 0.72)
    pred = det.predict(textured_images(1, size=SIZE, seed=3)[0])
    assert pred.heatmap.shape == SIZE
    assert pred.heatmap[0, 0] == pred.heatmap.min()  # the cut border: not inspected


def _flat_images(n: int, size, seed: int) -> list:
    """Good images without structure (grey, mild noise): a defect's context is the same
    wherever it is put."""
    rng = np.random.default_rng(seed)
    return [np.clip(0.5 + rng.normal(0, 0.03, (*size, 3)), 0, 1) for _ in range(n)]


def _stained(image: np.ndarray, cy: int, cx: int, half: int = 6) -> np.ndarray:
    out = image.copy()
    out[cy - half:cy + half, cx - half:cx + half] = [0.95, 0.15, 0.1]
    return out


@pytest.mark.parametrize("method", ["patchcore", "padim"])
def test_a_defect_on_a_tile_boundary_scores_as_one_at_a_tile_centre(method):
    """The seam test: a stain centred on the cut between two tiles scores within 10 % of the
    same stain at the centre of a tile's kept part (and of the same stain seen by one tile
    covering the whole frame)."""
    size = (192, 448)
    tiling = {"tile": 128, "overlap": 64}
    det = Detector.from_config(tiled_cfg(method), tiling=tiling)
    det.fit(_flat_images(8, size, 0), progress=False)
    grid = det.tiling.grid
    assert len(grid.origins_x) >= 3
    cy = size[0] // 2
    base = _flat_images(1, size, 99)[0]
    on_cut = grid.cuts_x[1]
    centre = (grid.cuts_x[1] + grid.cuts_x[2]) // 2
    s_cut, s_centre = det.decision_function([_stained(base, cy, on_cut),
                                             _stained(base, cy, centre)])
    assert abs(s_cut - s_centre) <= 0.1 * s_centre
    good = det.decision_function(_flat_images(2, size, 7))
    assert min(s_cut, s_centre) > 1.5 * max(good)  # and the stain is what the score sees
    whole = Detector.from_config(tiled_cfg(method), tiling={"tile": [192, 448], "overlap": 0})
    whole.fit(_flat_images(8, size, 0), progress=False)
    s_whole = whole.decision_function([_stained(base, cy, on_cut)])[0]
    assert abs(s_cut - s_whole) <= 0.1 * s_whole


def test_the_memory_guard_counts_tiles():
    det = Detector.from_config(tiled_cfg("padim", positions="tile"))
    det.fit(textured_images(4, size=SIZE), progress=False)
    cfg, layers, frame = det.cfg, det.layer_info, det.preprocessor.input_size
    padim = get_scorer("padim")
    est = estimate_fit_memory(padim, cfg, layers, frame, 100, tiling=det.tiling)
    assert est["tiles (one backbone pass)"] > 0 and est["stitched layer maps (one batch)"] > 0
    more = Detector.from_config(tiled_cfg("padim", positions="tile"),
                                tiling={"tile_batch": 50})
    more.fit(textured_images(4, size=SIZE), progress=False)
    est50 = estimate_fit_memory(padim, more.cfg, layers, frame, 100, tiling=more.tiling)
    assert est50["tiles (one backbone pass)"] == 10 * est["tiles (one backbone pass)"]
    # statistics per tile position: 8 tiles of every image are samples of a tile's grid
    per_tile = padim.estimate_memory(cfg, layers, det.tiling.grid.tile, 100 * 8)
    for part, value in per_tile.items():
        if part not in ("total", "model", "batch"):
            assert est[part] == value
    with pytest.raises(ResourceError, match="tiles"):
        tight = Detector.from_config(tiled_cfg("padim", positions="tile"),
                                     resources={"memory_limit_gb": 0.001})
        tight.fit(textured_images(4, size=SIZE), progress=False)


def _write_images(folder: Path, images) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, img in enumerate(images):
        arr = img if img.dtype == np.uint8 else (np.clip(img, 0, 1) * 255).astype(np.uint8)
        Image.fromarray(arr).save(folder / f"{i:03d}.png")


@pytest.fixture(scope="module")
def tiled_dataset(tmp_path_factory) -> Path:
    """An MVTec-layout data set of non-square images with masks."""
    root = tmp_path_factory.mktemp("tiled_data")
    _write_images(root / "train" / "good", textured_images(8, size=SIZE))
    _write_images(root / "test" / "good", textured_images(3, size=SIZE, seed=11))
    bad = [with_defect(img) for img in textured_images(3, size=SIZE, seed=12)]
    _write_images(root / "test" / "stain", bad)
    mask = np.zeros(SIZE, np.uint8)
    mask[SIZE[0] // 2 - 10:SIZE[0] // 2 + 10, SIZE[1] // 2 - 10:SIZE[1] // 2 + 10] = 255
    for i in range(3):
        folder = root / "ground_truth" / "stain"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(mask).save(folder / f"{i:03d}_mask.png")
    return root


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "anomaly_hooks.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def _write_config(path: Path) -> Path:
    import yaml

    cfg = tiled_cfg()
    cfg["data"]["num_workers"] = 0
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_cli_fit_score_and_evaluate_a_tiled_model(tiled_dataset, tmp_path):
    config = _write_config(tmp_path / "tiled.yaml")
    model = tmp_path / "tiled.safetensors"
    fit = _cli("fit", "--config", str(config), "--data", str(tiled_dataset),
               "--output", str(model), "--quiet", cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr
    out = tmp_path / "scored"
    score = _cli("score", "--model", str(model), "--out", str(out),
                 str(tiled_dataset / "test" / "stain"), cwd=tmp_path)
    assert score.returncode == 0, score.stderr
    heat = np.asarray(Image.open(next((out / "heatmaps").glob("*.png"))))
    assert heat.shape[:2] == SIZE
    ev = _cli("evaluate", "--config", str(config), "--data", str(tiled_dataset), "--out",
              str(tmp_path / "eval"), "--quiet", cwd=tmp_path)
    assert ev.returncode == 0, ev.stderr
    summary = json.loads((tmp_path / "eval" / "results.json").read_text())["datasets"][0]
    assert summary["framing"]["mode"] == "tiled"
    assert summary["image_auroc"] > 0.5 and summary["aupro"] is not None
    report = [p.read_text() for p in (tmp_path / "eval").rglob("index.html")]
    assert any("Framing: tiled" in page and "0.0 % of every image not inspected" in page
               for page in report)


def test_tiled_detector_predicts_on_its_device(device):
    det = Detector.from_config(tiled_cfg(), device=device.type)
    det.fit(textured_images(4, size=SIZE), progress=False)
    pred = det.predict(with_defect(textured_images(1, size=SIZE, seed=2)[0]))
    assert pred.heatmap.shape == SIZE and np.isfinite(pred.score)
    masked, inside = det.tiling.mask_padding(torch.zeros(1, 10, 15), [SIZE])
    assert masked.shape == (1, 10, 15) and int(inside.sum()) == SIZE[0] * SIZE[1]


def test_a_stretching_frame_scores_an_image_of_another_aspect_whole(tmp_path):
    """``tiling.aspect: stretch``: an image of another aspect fills the frame (no padding to
    mask), its heatmap comes back in its own frame, and a saved model keeps the rule."""
    cfg = tiled_cfg("padim", positions="tile")
    cfg["tiling"]["aspect"] = "stretch"
    det = Detector.from_config(cfg).fit(textured_images(6, size=SIZE), progress=False)
    assert det.fit_info_["framing"]["aspect"] == "stretch"
    wide = textured_images(1, size=(60, 230), seed=7)
    _, sizes = det.prepare(wide)
    content = tuple(det.fit_info_["framing"]["content"])
    assert det.tiling.boxes(sizes, 1) == [content]  # the whole box: nothing masked
    stain = wide[0].copy()
    stain[20:40, 100:130] = [250, 40, 30]
    pred = det.predict(stain)
    assert pred.heatmap.shape == (60, 230)
    ys, xs = np.unravel_index(np.argmax(pred.heatmap), pred.heatmap.shape)
    assert 10 <= ys < 50 and 90 <= xs < 140
    det.save(tmp_path / "m.safetensors")
    back = Detector.load(tmp_path / "m.safetensors")
    assert back.fit_info_["framing"]["aspect"] == "stretch"
    np.testing.assert_array_equal(back.decision_function([stain]), det.decision_function([stain]))


def test_the_letterbox_of_an_image_of_another_aspect_is_not_scored(tiled):
    """An image wider than the training images is placed with bars below it (the padding, the
    mean colour: nothing like a part). Scored as part of the image, the bars alarm on a good
    image; they get the image's least patch score and no part of its image score instead:
    the good image passes, a stain on it is still found where it is."""
    wide = textured_images(2, size=(60, 230), seed=7)
    images, sizes = tiled.prepare(wide)
    assert tiled.tiling.boxes(sizes, 2) == [(60, 230)] * 2  # 90 rows of bars below
    scored = tiled.infer(images, sizes=sizes).scores
    with_bars = tiled.infer(images).scores  # the content box: the bars scored as the part
    good = tiled.decision_function(textured_images(4, size=SIZE, seed=5))
    assert float(with_bars.min()) > 2 * float(scored.max())  # the bars would dominate
    assert float(scored.max()) <= 1.5 * max(good)  # a good image scores as the good ones
    np.testing.assert_array_equal(tiled.decision_function(wide), scored.numpy())
    stain = wide[0].copy()
    stain[20:40, 100:130] = [250, 40, 30]
    pred = tiled.predict(stain)
    assert pred.heatmap.shape == (60, 230) and pred.score > 1.5 * max(good)
    ys, xs = np.unravel_index(np.argmax(pred.heatmap), pred.heatmap.shape)
    assert 10 <= ys < 50 and 90 <= xs < 140
