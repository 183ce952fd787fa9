"""The GPU paths, tested where they can be: device names and the saved device, the
IEEE float32 scope (no TF32), the memory guard on a GPU, the backbone module a detector is
given, the once-per-batch heatmap transfer, pinned batches, and end-to-end fits on each device
(mixed precision, channels-last, threaded predict, save on one device and load on another).

Compute tests take the ``device`` fixture (the CPU, plus CUDA where present); the CUDA-only
ones skip with the reason; CUDA-only branches' logic is exercised on the CPU through fakes.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import DEVICES, backbone_rtol, resample_tolerance, textured_images, with_defect

from anomaly_hooks import Detector, devices
from anomaly_hooks.config import load_config
from anomaly_hooks.errors import BackboneError, ConfigError, ResourceError
from anomaly_hooks.extractor import HookFeatureExtractor

GB = 1024 ** 3
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA (no GPU here)")
# Scores of one model on two devices differ by float32 rounding only (IEEE float32 on both:
# no TF32): other kernels, another summation order in the convolutions (conftest.backbone_rtol)
CROSS_DEVICE_RTOL = backbone_rtol()


def _fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


# -- device names ---------------------------------------------------------------------------
def test_device_names_are_checked_against_the_gpus_present(monkeypatch):
    _fake_gpus(monkeypatch, 2)
    assert devices.resolve_device("auto") == torch.device("cuda")
    assert devices.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"device='cuda:2' but this machine has 2 GPU\(s\) "
                                          r"\(cuda:0 to cuda:1\): use one of those"):
        devices.resolve_device("cuda:2")
    _fake_gpus(monkeypatch, 0)
    assert devices.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="device='cuda' but CUDA is not available here"):
        devices.resolve_device("cuda")
    for bad in ("tpu", "cuda:x", "cuda:-1"):
        with pytest.raises(ConfigError, match="one of auto, cpu, cuda, cuda:N"):
            devices.resolve_device(bad)


def test_a_saved_device_is_a_preference(monkeypatch):
    _fake_gpus(monkeypatch, 1)
    with pytest.warns(UserWarning, match=r"saved for device='cuda:3' but this machine has 1 "
                                         r"GPU\(s\) \(cuda:0 to cuda:0\); using cuda instead"):
        assert devices.resolve_saved_device("cuda:3") == torch.device("cuda")
    _fake_gpus(monkeypatch, 0)
    with pytest.warns(UserWarning, match="saved for device='cuda' but CUDA is not available "
                                         "here; using cpu instead"):
        assert devices.resolve_saved_device("cuda") == torch.device("cpu")


def test_a_model_saved_for_cuda_loads_on_a_cpu_only_host(small_cfg, tmp_path, monkeypatch):
    """The saved ``device: cuda`` is a preference: on a host without a GPU the model loads on
    the CPU with a warning (it was refused as an "inconsistent model file"); a device the
    caller asks for is a requirement, refused with a ConfigError naming it."""
    cfg = load_config(small_cfg, device="cuda")
    det = Detector(cfg, device="cpu").fit(textured_images(8), progress=False)
    path = det.save(tmp_path / "gpu.safetensors")
    _fake_gpus(monkeypatch, 0)
    with pytest.warns(UserWarning, match="saved for device='cuda' but CUDA is not available"):
        loaded = Detector.load(path)
    assert loaded.device == torch.device("cpu") and loaded.cfg.device == "cuda"
    imgs = textured_images(2, seed=5)
    assert [p.score for p in loaded.predict(imgs)] == [p.score for p in det.predict(imgs)]
    with pytest.raises(ConfigError, match="device='cuda' but CUDA is not available here"):
        Detector.load(path, device="cuda")
    _fake_gpus(monkeypatch, 1)
    with pytest.raises(ConfigError, match=r"device='cuda:1' but this machine has 1 GPU"):
        Detector.from_config(small_cfg, device="cuda:1")


# -- IEEE float32 scope ---------------------------------------------------------------------
_B = torch.backends
_LEGACY = {"cudnn.allow_tf32": lambda: _B.cudnn.allow_tf32,
           "cuda.matmul.allow_tf32": lambda: _B.cuda.matmul.allow_tf32,
           "float32_matmul_precision": torch.get_float32_matmul_precision}


def _flags() -> dict:
    """Every precision setting PyTorch shows, legacy and new API ("unreadable" where PyTorch
    refuses to read a legacy one that a mix of the APIs left inconsistent)."""
    out = {}
    for name, read in _LEGACY.items():
        try:
            out[name] = read()
        except RuntimeError:
            out[name] = "unreadable"
    for i, (ns, attr) in enumerate(devices._new_api_leaves()):
        out[f"fp32_precision {i}"] = getattr(ns, attr)
    return out


@pytest.fixture
def precision_flags():
    """Restores PyTorch's process-wide precision settings after a test that changes them."""
    parents = [ns for ns in (_B, _B.cudnn, _B.mkldnn) if hasattr(ns, "fp32_precision")]
    saved = [ns.fp32_precision for ns in parents]  # the new API's backend-wide defaults
    legacy, leaves = devices._legacy_flags(), [getattr(ns, a) for ns, a in
                                               devices._new_api_leaves()]
    before = _flags()
    yield
    for ns, value in zip(parents, saved):
        ns.fp32_precision = value
    devices._set_flags(legacy, leaves)
    assert _flags() == before


CALLER_STATES = {
    "defaults": lambda: None,
    "matmul high (TF32)": lambda: torch.set_float32_matmul_precision("high"),
    "matmul medium (bf16 on the CPU)": lambda: torch.set_float32_matmul_precision("medium"),
    "cudnn TF32 off": lambda: setattr(_B.cudnn, "allow_tf32", False),
    "new API: conv ieee": lambda: setattr(_B.cudnn.conv, "fp32_precision", "ieee"),
    "new API: matmul tf32": lambda: setattr(_B.cuda.matmul, "fp32_precision", "tf32"),
    "new API: global tf32": lambda: setattr(_B, "fp32_precision", "tf32"),
}


@pytest.mark.parametrize("state", list(CALLER_STATES))
def test_ieee_scope_turns_tf32_off_and_restores_the_callers_settings(state, precision_flags):
    if state.startswith("new API") and not devices._new_api_leaves():
        pytest.skip("this PyTorch has no fp32_precision API")
    CALLER_STATES[state]()
    before = _flags()
    with pytest.raises(KeyError):
        with devices.ieee_float32():
            inside = _flags()
            with devices.ieee_float32():  # nested: no change
                assert _flags() == inside
            assert _flags() == inside
            raise KeyError("a failure inside still restores")
    assert _flags() == before
    for name, value in inside.items():
        if name.startswith("fp32_precision"):
            assert value == "ieee", name
    expected = {"cudnn.allow_tf32": False, "cuda.matmul.allow_tf32": False,
                "float32_matmul_precision": "highest"}
    for name, value in expected.items():
        if before[name] != "unreadable":  # a legacy setting the caller left readable
            assert inside[name] == value, name


def test_ieee_scope_is_shared_by_threads(precision_flags):
    """The flags are process-wide: they stay IEEE until the last thread inside leaves."""
    torch.set_float32_matmul_precision("high")
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with devices.ieee_float32():
            first_in.set()
            second_in.wait()
        first_out.set()

    def second():
        first_in.wait()
        with devices.ieee_float32():
            second_in.set()
            first_out.wait()
            seen["after the first left"] = torch.get_float32_matmul_precision()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert seen["after the first left"] == "highest"
    assert torch.get_float32_matmul_precision() == "high"


def test_extractor_and_predict_compute_inside_the_ieee_scope(fitted, precision_flags,
                                                             monkeypatch):
    """The backbone forward, the scorer and the heatmap blur of ``predict`` run with TF32
    off, though the caller allowed it; the caller's setting is back afterwards."""
    torch.set_float32_matmul_precision("high")
    _B.cudnn.allow_tf32 = True
    seen = []

    def record(*_):
        seen.append((_B.cudnn.allow_tf32, torch.get_float32_matmul_precision()))

    handle = fitted.extractor.model.layer1.register_forward_hook(record)
    score = fitted.scorer_.score
    monkeypatch.setattr(fitted.scorer_, "score", lambda emb: record() or score(emb))
    import anomaly_hooks.detector as detector_module

    maps = detector_module.anomaly_maps
    monkeypatch.setattr(detector_module, "anomaly_maps",
                        lambda *a, **k: record() or maps(*a, **k))
    try:
        fitted.predict(textured_images(1, seed=9)[0])
    finally:
        handle.remove()
    assert seen == [(False, "highest")] * 3
    assert (_B.cudnn.allow_tf32, torch.get_float32_matmul_precision()) == (True, "high")


def test_float32_features_match_float64_with_tf32_allowed_by_the_caller(resnet18, device,
                                                                          precision_flags):
    """What TF32 would break: with TF32 allowed by the caller, float32 features still match
    a float64 forward to ~1e-6 (TF32 convolutions are off by ~1e-3 on Ampere/Hopper)."""
    torch.set_float32_matmul_precision("high")
    _B.cudnn.allow_tf32 = True
    x = torch.rand(2, 3, 96, 96, generator=torch.Generator().manual_seed(0))
    with HookFeatureExtractor(resnet18, ["layer3"], device, (96, 96), copy_module=True) as ext:
        got = ext(x)["layer3"].cpu().double()
    with HookFeatureExtractor(resnet18, ["layer3"], "cpu", (96, 96), copy_module=True) as ref:
        ref.model.double()
        expected = ref(x.double())["layer3"]
    err = float((got - expected).abs().max() / expected.abs().max())
    # float32 rounding through the convolutions to layer3 (conftest.backbone_rtol); TF32's
    # 10-bit mantissa would be off by ~1e-3
    assert err < backbone_rtol(), err


# -- memory guard ---------------------------------------------------------------------------
class FakeCudaMemory:
    """The numbers the caching allocator and the driver report, settable by a test."""

    def __init__(self, monkeypatch, free: int, reserved: int = 0, allocated: int = 0) -> None:
        self.free, self.reserved, self.allocated = free, reserved, allocated
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.free, 80 * GB))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        import psutil

        monkeypatch.setattr(psutil, "virtual_memory",
                            lambda: SimpleNamespace(available=16 * GB))


def _guard(monkeypatch, parts: dict, device: str = "cuda", **resources):
    """``check_fit_memory`` for an estimate made of ``parts`` (GB)."""
    from anomaly_hooks import resources as res
    from anomaly_hooks.scorers.patchcore.scorer import PatchCoreScorer

    est = {k: int(v * GB) for k, v in parts.items()}
    est.update(total=sum(est.values()), model=0)
    monkeypatch.setattr(res, "estimate_fit_memory", lambda *a, **k: dict(est))
    cfg = load_config({"method": "patchcore", "resources": resources})
    return res.check_fit_memory(PatchCoreScorer, cfg, [], (224, 224), 10,
                                torch.device(device))


def test_gpu_budget_counts_the_blocks_pytorch_keeps_cached(monkeypatch):
    """After a fit PyTorch keeps freed blocks reserved: the driver's free memory shrinks, but
    those blocks are there for the next fit. The budget counts them, so repeated fits in one
    process (evaluate over many datasets, the benchmark) see the same budget."""
    from anomaly_hooks.resources import available_memory

    mem = FakeCudaMemory(monkeypatch, free=10 * GB)
    parts = {"patch features before the coreset": 7.0}
    for _ in range(3):  # each fit frees its 6 GB into the cache
        assert available_memory(torch.device("cuda")) == 10 * GB
        _guard(monkeypatch, parts)
        mem.free, mem.reserved, mem.allocated = 4 * GB, 6 * GB, 0
    assert 0.8 * mem.free < 7 * GB  # the driver's figure alone would refuse the second fit
    mem.allocated = 5 * GB  # blocks in use are not available
    with pytest.raises(ResourceError, match=r"needs about 7 GB of GPU memory \(cuda\) "
                                            r"\(patch features before the coreset 7 GB\) but "
                                            r"the limit is 4 GB"):
        _guard(monkeypatch, parts)


def test_threshold_images_are_charged_to_host_ram_not_the_gpu(monkeypatch):
    FakeCudaMemory(monkeypatch, free=10 * GB)
    parts = {"patch features before the coreset": 7.0, "threshold images (preprocessed)": 12.0}
    _guard(monkeypatch, parts)  # 7 GB of 8 on the GPU, 12 GB of 12.8 in host RAM
    with pytest.raises(ResourceError, match=r"needs about 14 GB of host RAM \(threshold "
                                            r"images \(preprocessed\) 14 GB\)"):
        _guard(monkeypatch, {**parts, "threshold images (preprocessed)": 14.0})
    with pytest.raises(ResourceError, match=r"needs about 19 GB of memory"):  # one pool
        _guard(monkeypatch, parts, device="cpu")


@needs_cuda
def test_cuda_budget_is_the_same_across_repeated_fits(small_cfg):
    from anomaly_hooks.resources import available_memory

    cfg = {**small_cfg, "method": "patchcore", "patchcore": {"coreset_ratio": 0.5}}
    dev = torch.device("cuda")
    budgets = []
    for _ in range(3):
        budgets.append(available_memory(dev))
        det = Detector.from_config(cfg, device="cuda").fit(textured_images(12), progress=False)
        del det
    assert min(budgets) > 0.97 * budgets[0], budgets
    assert torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev) < 256 * 2**20


# -- the backbone module a detector is given -----------------------------------------------
def _module():
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None)  # in training mode, as built


def test_a_detector_leaves_the_given_module_as_it_was(small_cfg):
    """A module given to a detector is copied: the caller's stays in its mode, on its device,
    in its memory format, without hooks, and is never mutated by the detector."""
    module = _module()
    state = {k: v.clone() for k, v in module.state_dict().items()}
    det = Detector.from_config(small_cfg, backbone=module, backbone__channels_last=True,
                               backbone__layers=["layer1", "layer2"])
    det.fit(textured_images(6), progress=False)
    assert det.extractor.model is not module and not det.extractor.model.training
    assert module.training
    assert all(not m._forward_hooks for m in module.modules())
    assert module.conv1.weight.is_contiguous()  # not channels-last
    assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())


def test_two_extractors_on_different_devices_share_one_module():
    """The case that broke: a second user of the module on another device (the meta device
    here, standing in for a GPU) moved the first one's weights away. With the copy both work;
    without it (``copy_module=False``) the module itself is moved."""
    module = _module().eval()
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = module.layer1(module.maxpool(module.relu(module.bn1(module.conv1(x)))))
    on_cpu = HookFeatureExtractor(module, ["layer1"], "cpu", (64, 64), copy_module=True)
    on_meta = HookFeatureExtractor(module, ["layer1"], "meta", (64, 64), copy_module=True)
    assert on_meta.model.conv1.weight.device.type == "meta"
    assert module.conv1.weight.device.type == "cpu"
    torch.testing.assert_close(on_cpu(x)["layer1"], expected)
    HookFeatureExtractor(module, ["layer1"], "meta", (64, 64), copy_module=False)
    assert module.conv1.weight.device.type == "meta"  # what sharing did before


def test_a_module_that_cannot_be_copied_is_a_clear_error(small_cfg):
    module = _module()
    module.lock = threading.Lock()
    with pytest.raises(BackboneError, match="cannot copy the backbone module ResNet .*lock"):
        Detector.from_config(small_cfg, backbone=module)


# -- heatmaps and batches on the host -------------------------------------------------------
def test_heatmaps_come_back_in_one_transfer_per_batch(fitted, device, monkeypatch):
    """The heatmaps of a batch are mapped back to their frames on the device and copied to
    the host once per batch (it was a ``float(min)`` and a ``.cpu()`` per image: two waits for
    the GPU each). Same arrays as the per-image reference."""
    pre = fitted.preprocessor
    maps = torch.rand(3, *pre.input_size, generator=torch.Generator().manual_seed(2))
    sizes = [(90, 120), (64, 80), (100, 100)]
    expected = [pre.to_original(m, s, fill=float(m.min())).numpy() for m, s in zip(maps, sizes)]
    calls = {"cpu": 0, "float": 0, "item": 0}
    for name in calls:
        attr = "__float__" if name == "float" else name
        real = getattr(torch.Tensor, attr)

        def counting(self, *a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, attr, counting)
    got = list(fitted.heatmaps(maps.to(device), sizes))  # a generator: run it
    assert calls == {"cpu": 1, "float": 0, "item": 0}
    for g, e, m in zip(got, expected, maps):
        assert g.dtype == np.float32 and g.shape == e.shape
        # two float32 bilinear resizes of the map (conftest.resample_tolerance)
        tol = resample_tolerance(pre.input_size, float(m.max() - m.min()), float(m.abs().max()))
        np.testing.assert_allclose(g, e, rtol=0, atol=tol)


@needs_cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_batches_come_in_pinned_memory(tmp_path, workers, fitted):
    """For a GPU model the loader's batches (one part, or parts joined) and the in-memory
    predict batches are page-locked, so ``non_blocking`` copies do not block the host."""
    from PIL import Image

    from anomaly_hooks.data import iter_batches

    paths = []
    for i, img in enumerate(textured_images(8)):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(img).save(paths[-1])
    batches = list(iter_batches(paths, fitted.preprocessor, batch_size=4, num_workers=workers,
                                max_pixels=10**8, pin_memory=True))
    assert len(batches) == 2 and all(b.images.is_pinned() for b in batches)
    det = Detector.load(fitted.save(tmp_path / "m.safetensors"), device="cuda")
    assert det.prepare(paths[:3])[0].is_pinned()


# -- end to end on each device --------------------------------------------------------------
def _cfg(small_cfg, method: str, **extra) -> dict:
    cfg = {**small_cfg, "method": method, "patchcore": {"coreset_ratio": 0.5}}
    for key, value in extra.items():
        section, name = key.split("__")
        cfg[section] = {**cfg.get(section, {}), name: value}
    return cfg


def test_channels_last_by_default_on_cpus_and_as_given_otherwise(small_cfg, tmp_path):
    """``backbone.channels_last: null`` (the default) runs CPU backbones channels-last and GPU
    ones contiguous; ``true`` / ``false`` are kept on every device; a saved model keeps the
    setting it was fitted with (null resolves again on the device it is loaded on)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert devices.channels_last_for(None, cpu) and not devices.channels_last_for(None, cuda)
    assert devices.channels_last_for(True, cuda) and not devices.channels_last_for(False, cpu)
    det = Detector.from_config(small_cfg, device="cpu")
    assert det.cfg.backbone.channels_last is None and det.extractor.channels_last
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    assert all(f.is_contiguous(memory_format=torch.channels_last)
               for f in det.extractor(x).values())
    plain = Detector.from_config(small_cfg, device="cpu", backbone__channels_last=False)
    assert not plain.extractor.channels_last
    assert all(f.is_contiguous() for f in plain.extractor(x).values())
    plain.fit(textured_images(6), progress=False)
    loaded = Detector.load(plain.save(tmp_path / "m.safetensors"))
    assert loaded.cfg.backbone.channels_last is False and not loaded.extractor.channels_last


@pytest.mark.parametrize("method", ["padim", "patchcore"])
def test_save_on_one_device_load_on_another(small_cfg, tmp_path, device, method):
    """A model fitted on ``device`` scores the same loaded on that device, and within
    ``CROSS_DEVICE_RTOL`` (float32 rounding) with the same verdicts on every other device
    present (CPU <-> CUDA when a GPU is there)."""
    det = Detector.from_config(_cfg(small_cfg, method), device=str(device))
    det.fit(textured_images(10), progress=False)
    path = det.save(tmp_path / "m.safetensors")
    imgs = textured_images(3, seed=71) + [with_defect(textured_images(1, seed=72)[0])]
    before = det.predict(imgs)
    for target in DEVICES:
        loaded = Detector.load(path, device=target)
        assert loaded.device.type == target
        after = loaded.predict(imgs)
        got, ref = [p.score for p in after], [p.score for p in before]
        if target == device.type:
            assert got == ref
        else:
            np.testing.assert_allclose(got, ref, rtol=CROSS_DEVICE_RTOL)
            assert [p.is_anomalous for p in after] == [p.is_anomalous for p in before]
        assert after[3].score > max(p.score for p in after[:3])


@pytest.mark.parametrize("method, backend", [("padim", None), ("patchcore", "torch"),
                                             ("patchcore", "faiss-flat")])
def test_threaded_predict_equals_serial_on_the_device(small_cfg, device, method, backend):
    """Eight threads predicting at once on one detector (on CUDA with a GPU build of faiss,
    through its locked GPU index) give the serial results."""
    extra = {"patchcore__knn_backend": backend} if backend else {}
    det = Detector.from_config(_cfg(small_cfg, method, **extra), device=str(device))
    det.fit(textured_images(10), progress=False)
    imgs = textured_images(8, seed=81)
    serial = [det.predict(img).score for img in imgs]
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(2):
            got = list(pool.map(lambda img: det.predict(img).score, imgs))
            assert got == serial


_MIXED: dict = {}


def _mixed_scores(small_cfg, device, method, precision, channels_last) -> list:
    """Scores of 3 good and 1 defective image by a model fitted with these settings (each
    fitted once per test session)."""
    key = (device.type, method, precision, channels_last)
    if key not in _MIXED:
        det = Detector.from_config(_cfg(small_cfg, method, backbone__precision=precision,
                                        backbone__channels_last=channels_last),
                                   device=str(device)).fit(textured_images(10), progress=False)
        test = textured_images(3, seed=91) + [with_defect(textured_images(1, seed=92)[0])]
        _MIXED[key] = [p.score for p in det.predict(test)]
    return _MIXED[key]


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("method", ["padim", "patchcore"])
def test_mixed_precision_and_channels_last_fit_and_predict(small_cfg, device, precision,
                                                           method):
    """Autocast of the backbone and channels-last memory through a whole fit and predict:
    the defect stands out, and scores are within 5 % of the largest score of the float32
    model (half-precision feature noise is absolute: small good-image scores move most)."""
    if precision == "float16" and device.type == "cpu":
        pytest.skip("float16 autocast is a GPU feature (bfloat16 is the CPU's)")
    got = _mixed_scores(small_cfg, device, method, precision, True)
    ref = _mixed_scores(small_cfg, device, method, "float32", False)
    assert got[3] > max(got[:3])
    if precision == "float32":  # channels-last: other convolution kernels
        np.testing.assert_allclose(got, ref, rtol=backbone_rtol())
    else:  # 8 (bf16) or 11 (fp16) mantissa bits: noise on the scale of the defect's score
        np.testing.assert_allclose(got, ref, rtol=0, atol=0.05 * max(ref))
