"""The torch-free runtime: its preprocessing against the torch Preprocessor, the
Detector contract (input forms, iter_predict, threads), running where torch cannot be imported,
the CLI (export, score of an .onnx model), int8 and OpenVINO."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from conftest import (  # noqa: E402
    ROOT,
    backbone_rtol,
    f32_tol,
    resample_tolerance,
    textured_images,
    with_defect,
)

from anomaly_hooks import Detector  # noqa: E402
from anomaly_hooks.errors import ImageReadError, ModelFileError, NotFittedError  # noqa: E402
from anomaly_hooks.export import export_onnx  # noqa: E402

# the score parity export enforces (docs/edge-onnx.md): a specification, not a rounding bound
from anomaly_hooks.export.onnx import SCORE_RTOL  # noqa: E402
from anomaly_hooks.preprocess import Preprocessor  # noqa: E402
from anomaly_hooks.runtime import NumpyPreprocessor, OnnxDetector, read_exported  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(fitted PatchCore detector, its .safetensors file, its ONNX export, image folder)."""
    root = tmp_path_factory.mktemp("runtime")
    cfg = {"method": "patchcore", "seed": 0, "device": "cpu",
           "backbone": {"name": "resnet18", "weights": None},
           "preprocess": {"resize": [80, 96], "crop": [64, 80]},
           "threshold": {"holdout_fraction": 0.25}, "data": {"batch_size": 4, "num_workers": 0}}
    det = Detector.from_config(cfg).fit(textured_images(16), progress=False)
    saved = det.save(root / "m.safetensors")
    folder = root / "images"
    folder.mkdir()
    images = textured_images(5, seed=9) + [with_defect(textured_images(1, seed=10)[0])]
    for i, img in enumerate(images):
        Image.fromarray(img).save(folder / f"{i:02d}.png")
    return det, saved, export_onnx(det, root / "m.onnx"), folder


@pytest.mark.parametrize("method", ["numpy", "pillow"])
def test_preprocessing_equals_the_torch_preprocessor(method):
    """The numpy twin (float32, torch's formulas) and Pillow's filter (double precision) give
    the torch Preprocessor's network input and heatmap frame up to float32 rounding."""
    from anomaly_hooks.images import decode, read_image

    rng = np.random.default_rng(0)
    for pre in (Preprocessor(), Preprocessor((80, 96), (64, 80)), Preprocessor((90, 70), None)):
        twin = NumpyPreprocessor.from_dict(pre.as_dict(), method)
        assert twin.input_size == tuple(pre.input_size)
        assert twin.min_source_size == pre.min_source_size
        for shape in ((300, 451, 3), (97, 130, 3), (256, 256, 3), (640, 480), (40, 50, 3)):
            arr = (rng.random(shape) * 255).astype(np.uint8)
            ref = pre(read_image(arr)).numpy()
            # values in [0, 1] scaled by 1 / std: the range and size of the normalised input
            spread = 1.0 / min(pre.std)
            tol = resample_tolerance(shape[:2], spread, float(np.abs(ref).max()))
            assert np.abs(twin(decode(arr)) - ref).max() <= tol
            heat = torch.rand(*pre.input_size, generator=torch.Generator().manual_seed(1))
            want = pre.to_original(heat, shape[:2], float(heat.min())).numpy()
            got = twin.to_original(heat.numpy(), shape[:2], float(heat.min()))
            tol = resample_tolerance(pre.resize, float(heat.max() - heat.min()),
                                     float(heat.abs().max()))
            np.testing.assert_allclose(got, want, rtol=0, atol=tol)


def test_every_input_form_and_iter_predict(model, tmp_path):
    det, _, path, folder = model
    odet = OnnxDetector.load(path)
    files = sorted(folder.iterdir())
    ref = det.decision_function(files)
    forms = [[str(p) for p in files], files, [Image.open(p) for p in files],
             [np.asarray(Image.open(p)) for p in files], [p.read_bytes() for p in files]]
    for items in forms:
        np.testing.assert_allclose(odet.decision_function(items), ref, rtol=SCORE_RTOL)
    one = odet.predict(files[0])
    assert one.heatmap.shape == np.asarray(Image.open(files[0])).shape[:2]
    assert abs(one.score - ref[0]) <= SCORE_RTOL * ref[0]
    one_bytes = odet.predict(files[0].read_bytes())  # encoded bytes are one image, as in eager
    assert one_bytes.score == one.score  # the same decoded pixels through the same graph
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    out = list(odet.iter_predict([files[0], bad, files[1]], batch_size=2))
    assert [i for i, _ in out] == [0, 1, 2]
    assert isinstance(out[1][1], ImageReadError) and str(bad) in str(out[1][1])
    assert abs(out[2][1].score - ref[1]) <= SCORE_RTOL * ref[1]
    with pytest.raises(ImageReadError):
        odet.predict(bad)


def test_thread_safe(model):
    _, _, path, folder = model
    odet = OnnxDetector.load(path, batch_size=2)
    files = sorted(folder.iterdir())
    ref = odet.decision_function(files)
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda _: odet.decision_function(files), range(8)))
    for scores in runs:
        np.testing.assert_array_equal(scores, ref)


def test_decode_threads_give_the_one_thread_batch(model):
    """A batch decoded on several threads is the batch of one thread, in input order."""
    _, _, path, folder = model
    files = sorted(folder.iterdir())
    one = OnnxDetector.load(path, decode_threads=1)
    many = OnnxDetector.load(path, decode_threads=3)
    assert (one.decode_threads, many.decode_threads) == (1, 3)
    (a, sizes_a), (b, sizes_b) = one.prepare(files), many.prepare(files)
    np.testing.assert_array_equal(a, b)
    assert sizes_a == sizes_b
    np.testing.assert_array_equal(many.decision_function(files), one.decision_function(files))


@pytest.mark.slow
def test_runs_where_torch_cannot_be_imported(model):
    """A subprocess in which ``import torch`` fails: the runtime still predicts."""
    det, _, path, folder = model
    files = [str(p) for p in sorted(folder.iterdir())]
    code = ("import sys, json\n"
            "sys.modules['torch'] = None  # any import of torch now raises ImportError\n"
            "from anomaly_hooks.runtime import OnnxDetector\n"
            f"preds = OnnxDetector.load({str(path)!r}).predict({files!r})\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'torch'"
            " and sys.modules[m] is not None]\n"
            "print(json.dumps([[p.score, p.is_anomalous, list(p.heatmap.shape)] "
            "for p in preds]))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**env, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    ref = det.predict(files)
    for (score, anomalous, shape), r in zip(got, ref):
        assert abs(score - r.score) <= SCORE_RTOL * r.score
        assert anomalous == r.is_anomalous and shape == list(r.heatmap.shape)


def test_cli_export_and_score_an_onnx_model(model, tmp_path, capsys):
    from anomaly_hooks.cli import main

    det, saved, _, folder = model
    out = tmp_path / "cli.onnx"
    assert main(["export", "--model", str(saved), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    meta = OnnxDetector.load(out).meta
    from anomaly_hooks.export import source_checksum

    assert meta["source_checksum"] == source_checksum(saved) != ""
    assert main(["score", "--model", str(out), str(folder), "--out", str(tmp_path / "r"),
                 "--no-images"]) == 0
    rows = json.loads((tmp_path / "r" / "results.json").read_text())
    rows = rows["results"] if isinstance(rows, dict) else rows
    files = sorted(folder.iterdir())
    ref = dict(zip([f.name for f in files], det.decision_function(files)))
    assert len(rows) == len(files)
    for row in rows:
        assert abs(row["score"] - ref[Path(row["path"]).name]) <= SCORE_RTOL * row["score"]


def test_attached_drift_monitor_sees_what_the_eager_one_sees(model):
    """``OnnxDetector.drift_monitor()`` is fed by every predict, as ``Detector``'s: over the
    same images the same images counted, blocks observed and alarm; the layer statistics it
    is fed equal the eager taps within the float32 error of the two backbones
    (:func:`backbone_rtol` of their magnitude) plus the rounding of a mean over the largest
    tapped layer's positions (``f32_tol``). A file without a reference raises its reason."""
    det, saved, path, folder = model
    files = sorted(folder.iterdir())
    eager = Detector.load(saved, device="cpu")
    onnx_det = OnnxDetector.load(path)
    monitors = [eager.drift_monitor(), onnx_det.drift_monitor()]
    eager.predict(files, batch_size=3)
    onnx_det.predict(files, batch_size=3)
    a, b = (m.status() for m in monitors)
    for key in ("images_seen", "blocks_observed", "alarm", "window_filled"):
        assert a[key] == b[key], key
    assert a["images_seen"] == len(files)
    assert set(a["blocks_observed"]) == {"input", "score", *det.layers}
    features: dict = {}
    batch = onnx_det.prepare(files)[0]
    onnx_det.monitor = None  # not counted again
    onnx_det.run(batch, features=features)
    taps: dict = {}
    eager.monitor = None
    eager.infer(torch.from_numpy(batch), taps=taps)
    hw = 64 * 80 // 16  # layer1 (stride 4): the most positions of a tapped layer
    for name in det.layers:
        scale = float(np.abs(taps[name]).max())
        np.testing.assert_allclose(features[name], taps[name], rtol=0,
                                   atol=backbone_rtol() * scale + f32_tol(hw, scale))
    no_ref = OnnxDetector.load(path)
    no_ref.drift_reference_, no_ref.drift_unavailable = None, "why not"
    with pytest.raises(NotFittedError, match="^why not$"):
        no_ref.drift_monitor()


def test_cli_export_errors_are_one_line(model, tmp_path, capsys):
    from anomaly_hooks.cli import main

    _, saved, _, _ = model
    assert main(["export", "--model", str(tmp_path / "none.safetensors")]) == 2
    assert capsys.readouterr().err.strip() == \
        f"error: {tmp_path / 'none.safetensors'}: model file not found"
    assert main(["export", "--model", str(saved), "--out", str(tmp_path / "q.onnx"),
                 "--int8", "--calib", str(tmp_path)]) == 2
    assert "error: " in capsys.readouterr().err
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"junk")
    assert main(["score", "--model", str(bad), str(tmp_path), "--out",
                 str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}: not a loadable ONNX model (")


@pytest.mark.slow
def test_int8_is_checked_and_refused_beyond_the_tolerance(model, tmp_path):
    from anomaly_hooks.export.quantize import QuantizationRefused, quantize_backbone

    _, _, path, folder = model
    good = textured_images(12, seed=21)
    report = quantize_backbone(path, tmp_path / "q.onnx", good[:8], check_images=good[8:],
                               tolerance=10.0)
    assert report["accepted"] and report["nodes_quantized"] > 10
    q = OnnxDetector.load(tmp_path / "q.onnx")
    assert json.loads(q.meta["int8"])["max_drift"] == report["max_drift"]
    # no drift monitor on int8 (its layer means are not the reference's float32 ones)
    assert OnnxDetector.load(path).drift_layers and q.drift_layers == ()
    assert [o.name for o in q.session.get_outputs()] == ["patch_scores", "heatmap",
                                                         "image_score"]
    assert q.drift_reference_ is None and "int8 model" in q.drift_unavailable
    # the int8 copy carries the checksum of its own bytes, and a damaged copy is refused
    assert q.model.checksum != read_exported(path).checksum
    raw = bytearray((tmp_path / "q.onnx").read_bytes())
    raw[len(raw) // 2] ^= 0x10
    (tmp_path / "damaged.onnx").write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match=r"checksum mismatch"):
        OnnxDetector.load(tmp_path / "damaged.onnx")
    files = sorted(folder.iterdir())
    s32 = OnnxDetector.load(path).decision_function(files)
    assert np.corrcoef(q.decision_function(files), s32)[0, 1] > 0.9
    with pytest.raises(QuantizationRefused, match=r"^int8 scores of 4 good images drift up to "
                       r"\S+ threshold scales from float32 \(tolerance 0\), \d+ verdict "
                       r"change\(s\): not written\."):
        quantize_backbone(path, tmp_path / "refused.onnx", good[:8], check_images=good[8:],
                          tolerance=0.0)
    assert not (tmp_path / "refused.onnx").exists()


@pytest.mark.slow
def test_int8_copy_of_an_external_data_export(model, tmp_path):
    """Weights in a side file: the int8 copy writes its own side file, names it, and its
    checksum covers it."""
    from anomaly_hooks.export.quantize import quantize_backbone

    det, _, _, folder = model
    fp32 = export_onnx(det, tmp_path / "x.onnx", external_data=True)
    good = textured_images(12, seed=21)
    quantize_backbone(fp32, tmp_path / "xq.onnx", good[:8], check_images=good[8:],
                      tolerance=10.0)
    q = OnnxDetector.load(tmp_path / "xq.onnx")
    assert q.meta["external_data"] == "xq.onnx.data"
    files = sorted(folder.iterdir())
    assert np.corrcoef(q.decision_function(files), det.decision_function(files))[0, 1] > 0.9
    side = tmp_path / "xq.onnx.data"
    raw = bytearray(side.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    side.write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match=r"checksum mismatch: the file or its weights file "
                       r"xq\.onnx\.data was modified"):
        OnnxDetector.load(tmp_path / "xq.onnx")


@pytest.mark.slow
def test_openvino_runs_the_same_file(model):
    pytest.importorskip("openvino")
    det, _, path, folder = model
    files = sorted(folder.iterdir())
    got = OnnxDetector.load(path, engine="openvino").decision_function(files)
    np.testing.assert_allclose(got, det.decision_function(files), rtol=SCORE_RTOL)


def test_jet_colours_without_matplotlib(monkeypatch):
    """The edge box has no matplotlib: the heatmap PNGs use the same "jet" within 1 level."""
    import builtins

    from anomaly_hooks.visualize import colorize, matplotlib_colormaps

    heat = np.random.default_rng(0).random((50, 60)).astype(np.float32)
    ref = colorize(heat, 0.0, 1.0)
    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    matplotlib_colormaps.cache_clear()  # imported by the first call
    try:
        assert np.abs(colorize(heat, 0.0, 1.0).astype(int) - ref).max() <= 1
    finally:
        matplotlib_colormaps.cache_clear()


@pytest.mark.slow
def test_cli_scores_an_onnx_model_where_torch_cannot_be_imported(model, tmp_path):
    """``anomaly-hooks score`` of an .onnx file (with PNGs) on a box without torch; ``export``
    there says what it needs in one line."""
    _, saved, path, folder = model
    code = ("import sys\n"
            "sys.modules['torch'] = None\n"
            "from anomaly_hooks.cli import main\n"
            f"assert main(['score', '--model', {str(path)!r}, {str(folder)!r}, '--out', "
            f"{str(tmp_path / 'r')!r}]) == 0\n"
            f"sys.exit(main(['export', '--model', {str(saved)!r}]))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**env, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "drift:" in out.stdout and "not monitored" not in out.stdout, out.stdout
    assert out.stderr.strip().splitlines()[-1].startswith(
        "error: export needs PyTorch and onnx (import of torch halted; None in sys.modules): "
        "run it where the model was fitted, with pip install 'anomaly_hooks[export]'")
    assert len(list((tmp_path / "r" / "heatmaps").iterdir())) == len(list(folder.iterdir()))


# -- a tiled (high-resolution) model ------------------------------------------------------------
@pytest.mark.parametrize("method", ["numpy", "pillow"])
def test_framed_preprocessing_equals_the_torch_preprocessor(method):
    """A tiled model's working frame in numpy: the crop, the aspect-keeping resize to the
    image's placement, the zeros padding, a reduced decode placed by its original size, and
    the heatmap's way back from the image's own part of the frame."""
    from anomaly_hooks.framing import Frame
    from anomaly_hooks.images import decode, read_image

    rng = np.random.default_rng(0)
    for frame in (Frame((96, 144), (96, 144)), Frame((90, 140), (96, 144), crop=(0.9, 0.8))):
        pre = Preprocessor.framed(frame, (0.4, 0.5, 0.6), (0.2, 0.25, 0.3))
        twin = NumpyPreprocessor.from_dict(pre.as_dict(), method)
        assert twin.input_size == pre.input_size and twin.min_source_size == pre.min_source_size
        for shape in ((96, 144, 3), (300, 451, 3), (60, 200, 3), (150, 90, 3)):
            arr = (rng.random(shape) * 255).astype(np.uint8)
            ref = pre(read_image(arr)).numpy()
            tol = resample_tolerance(shape[:2], 1.0 / min(pre.std), float(np.abs(ref).max()))
            assert np.abs(twin(decode(arr)) - ref).max() <= tol
            half = decode(arr)[::2, ::2]  # a reduced decode of the same image
            ref_half = pre(read_image((half * 255).round().astype(np.uint8)), shape[:2])
            got_half = twin(half, shape[:2])
            assert got_half.shape == ref.shape and np.abs(got_half - ref_half.numpy()).max() \
                <= resample_tolerance(half.shape[:2], 1.0 / min(pre.std), float(np.abs(ref).max()))
            assert twin.placement(shape[:2]) == frame.placement(shape[:2])
            heat = torch.rand(*pre.input_size, generator=torch.Generator().manual_seed(1))
            want = pre.to_original(heat, shape[:2], float(heat.min())).numpy()
            got = twin.to_original(heat.numpy(), shape[:2], float(heat.min()))
            tol = resample_tolerance(frame.content, float(heat.max() - heat.min()),
                                     float(heat.abs().max()))
            np.testing.assert_allclose(got, want, rtol=0, atol=tol)


@pytest.fixture(scope="module")
def tiled_model(tmp_path_factory):
    """(a fitted tiled PatchCore detector, its .safetensors file, its ONNX export, a folder of
    images of several sizes and aspects, one with a defect)."""
    from conftest import TILED_SIZE, tiled_cfg

    root = tmp_path_factory.mktemp("tiled_runtime")
    det = Detector.from_config(tiled_cfg()).fit(textured_images(8, size=TILED_SIZE),
                                                progress=False)
    folder = root / "images"
    folder.mkdir()
    images = [*textured_images(2, size=TILED_SIZE, seed=9),
              with_defect(textured_images(1, size=TILED_SIZE, seed=10)[0]),
              textured_images(1, size=(60, 200), seed=11)[0],
              textured_images(1, size=(300, 450), seed=12)[0]]
    for i, img in enumerate(images):
        Image.fromarray(img).save(folder / f"{i:02d}.png")
    return det, det.save(root / "t.safetensors"), export_onnx(det, root / "t.onnx"), folder


def test_cli_exports_and_scores_a_tiled_model_where_torch_cannot_be_imported(tiled_model,
                                                                             tmp_path):
    """``anomaly-hooks export`` of a tiled model, then ``anomaly-hooks score`` of the .onnx in
    a process where ``import torch`` fails: the eager tiled Detector's scores, heatmaps at
    each image's own size."""
    from anomaly_hooks.cli import main

    det, saved, _, folder = tiled_model
    out = tmp_path / "cli.onnx"
    assert main(["export", "--model", str(saved), "--out", str(out)]) == 0
    assert read_exported(out).tiling is not None
    code = ("import sys\n"
            "sys.modules['torch'] = None\n"
            "from anomaly_hooks.cli import main\n"
            f"sys.exit(main(['score', '--model', {str(out)!r}, {str(folder)!r}, '--out', "
            f"{str(tmp_path / 'r')!r}]))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**env, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads((tmp_path / "r" / "results.json").read_text())["results"]
    files = sorted(folder.iterdir())
    ref = dict(zip([f.name for f in files], det.decision_function(files)))
    assert len(rows) == len(files)
    for row in rows:
        assert abs(row["score"] - ref[Path(row["path"]).name]) <= SCORE_RTOL * row["score"]
    for f in files:
        heat = Image.open(tmp_path / "r" / "heatmaps" / f"{f.stem}.png")
        assert heat.size == Image.open(f).size


def test_a_tiled_export_is_not_quantised(tiled_model, tmp_path):
    from anomaly_hooks.errors import ExportError
    from anomaly_hooks.export.quantize import quantize_backbone

    _, _, path, folder = tiled_model
    with pytest.raises(ExportError, match="tiled .* int8 quantisation is not available"):
        quantize_backbone(path, tmp_path / "q.onnx", sorted(folder.iterdir())[:2])


def test_a_tiled_exports_drift_monitor_sees_what_the_eager_one_sees(tiled_model):
    """A tiled export feeds its drift monitor as the eager tiled Detector does: the same images
    counted and blocks observed over images of several aspects, and layer statistics (the
    means of the stitched frame maps over each image's box) equal to the eager taps within the
    float32 error of the two backbones plus the rounding of a mean over the largest stitched
    map's positions."""
    det, saved, path, folder = tiled_model
    files = sorted(folder.iterdir())
    eager = Detector.load(saved, device="cpu")
    onnx_det = OnnxDetector.load(path)
    assert onnx_det.drift_unavailable is None and onnx_det.drift_layers == tuple(det.layers)
    monitors = [eager.drift_monitor(), onnx_det.drift_monitor()]
    eager.predict(files, batch_size=2)
    onnx_det.predict(files, batch_size=2)
    a, b = (m.status() for m in monitors)
    for key in ("images_seen", "blocks_observed", "alarm", "window_filled"):
        assert a[key] == b[key], key
    assert a["images_seen"] == len(files)
    batch, sizes = onnx_det.prepare(files)
    onnx_det.monitor = eager.monitor = None  # not counted again
    features: dict = {}
    onnx_det.run(batch, sizes, features=features)
    taps: dict = {}
    eager.infer(torch.from_numpy(batch), sizes=sizes, taps=taps)
    frame = det.tiling.grid.frame
    hw = frame[0] * frame[1] // 16  # layer1 (stride 4): the most positions of a tapped layer
    for name in det.layers:
        scale = float(np.abs(taps[name]).max())
        np.testing.assert_allclose(features[name], taps[name], rtol=0,
                                   atol=backbone_rtol() * scale + f32_tol(hw, scale))
