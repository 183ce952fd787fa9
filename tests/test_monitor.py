"""Drift monitor: statistics, reference, leave-window-out calibration, sliding window, the
detector's hook seam, the model file and the ``score`` summary."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import F32_EPS, f32_tol, f64_tol

from anomaly_hooks.errors import ConfigError, DataError, FitError, ModelFileError, NotFittedError
from anomaly_hooks.monitor import (
    DriftMonitor,
    DriftReference,
    StatisticsCollector,
    block_statistics,
    input_statistics,
    layer_statistics,
)
from anomaly_hooks.monitor.reference import _joint_thresholds, sample_windows

ROOT = Path(__file__).resolve().parents[1]


def correlated(n, d, rng, shift=None):
    """Good per-image vectors: a few latent factors plus channel noise."""
    mix = np.random.default_rng(123).normal(size=(4, d))
    x = rng.normal(size=(n, 4)) @ mix + 0.5 * rng.normal(size=(n, d)) + 3.0
    return x if shift is None else x + shift


def synthetic_reference(n=160, alpha=0.02, seed=0, with_scores=True, min_shift=0.0):
    rng = np.random.default_rng(seed)
    vecs = {"input": correlated(n, 7, rng), "layer": correlated(n, 40, rng)}
    scores = np.exp(rng.normal(1.0, 0.2, 40)) if with_scores else None
    return DriftReference.fit(vecs, scores, window=8, alpha=alpha, n_windows=4000, seed=seed,
                              min_shift=min_shift)


@pytest.mark.slow
def test_monitor_imports_without_torch():
    """numpy only: usable by the torch-free runtime and without the detector."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import anomaly_hooks.monitor as m\n"
        "import numpy as np\n"
        "x = np.random.default_rng(0).normal(size=(30, 5))\n"
        "ref = m.DriftReference.fit({'input': x}, None, window=4, alpha=0.05, n_windows=800)\n"
        "mon = m.DriftMonitor(ref); mon.update({'input': x[:6]})\n"
        "print(mon.status()['images_seen'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "6"


def test_false_alarm_rate_on_fresh_good_windows_is_about_alpha():
    """Leave-window-out calibration: windows of new good images from the same distribution
    alarm at about alpha (the reference's own sampling error included), not far more."""
    alpha = 0.02
    rates = []
    for seed in range(6):  # over several references (the rate is conditional on one)
        ref = synthetic_reference(alpha=alpha, seed=seed, with_scores=False)
        rng = np.random.default_rng(100 + seed)
        m = 2000
        fresh = {"input": correlated(m * ref.window, 7, rng),
                 "layer": correlated(m * ref.window, 40, rng)}
        hit = np.zeros(m, bool)
        for name, block in ref.blocks.items():
            xbar = fresh[name].reshape(m, ref.window, -1).mean(1)
            for s, v in block.stats_of_means(xbar, ref.window).items():
                hit |= v > ref.thresholds[s]
        rates.append(hit.mean())
    assert 0.25 * alpha < np.mean(rates) < 2.0 * alpha, rates


@pytest.mark.parametrize("n, m", [(20, 3000), (5000, 2000)])  # permutation / redraw paths
def test_sampled_windows_are_uniform_subsets_of_distinct_images(n, m):
    w = 6
    win = sample_windows(np.random.default_rng(0), n, w, m)
    assert win.shape == (m, w) and win.min() >= 0 and win.max() < n
    assert all(len(set(row)) == w for row in win.tolist())
    if n == 20:  # every image about equally often: m w / n = 900 each
        counts = np.bincount(win.ravel(), minlength=n)
        assert np.abs(counts - m * w / n).max() < 5 * math.sqrt(m * w / n), counts
    assert np.array_equal(win, sample_windows(np.random.default_rng(0), n, w, m))


def test_leave_window_out_equals_a_reference_rebuilt_without_the_window():
    """The calibration statistics (sums minus the window's) against a float64 brute force:
    the mean, spread and principal-direction variances re-estimated from the other images."""
    ref = synthetic_reference(n=40)
    block = ref.blocks["layer"]
    x = correlated(40, 40, np.random.default_rng(5))
    windows = sample_windows(np.random.default_rng(1), 40, ref.window, 7)
    got = block.leave_window_out(x, windows)
    # float64 on both sides, but the sums-minus-the-window's form cancels: sums of x and x**2
    # over the 40 images (4 roundings an image) lose the ratio mean(x**2) / var(x) in digits
    rel = f64_tol(4 * 40, float(((x ** 2).mean(0) / x.var(0)).max()))
    for i, win in enumerate(windows):
        rest = np.delete(x, win, axis=0)
        mu, sd = rest.mean(0), rest.std(0, ddof=1)
        z = (x[win].mean(0) - mu) / sd
        assert got["layer:shift"][i] == pytest.approx(ref.window * (z ** 2).mean(), rel=rel)
        p = ((x - block.mean) / block.scale) @ block.basis
        p_rest = np.delete(p, win, axis=0)
        diff = (p[win].mean(0) - p_rest.mean(0)) / p_rest.std(0, ddof=1)
        assert got["layer:pca"][i] == pytest.approx(ref.window * (diff ** 2).mean(), rel=rel)


def test_shifted_windows_alarm():
    ref = synthetic_reference(with_scores=False)
    rng = np.random.default_rng(7)
    mon = DriftMonitor(ref)
    mon.update({"input": correlated(ref.window, 7, rng), "layer": correlated(ref.window, 40, rng)})
    assert not mon.status()["alarm"]
    shift = np.zeros(40)
    shift[:10] = 0.8  # 10 of 40 channels move by about half their spread
    n = 0
    while not mon.alarm and n < ref.window:
        mon.update({"input": correlated(1, 7, rng), "layer": correlated(1, 40, rng, shift)})
        n += 1
    st = mon.status()
    assert st["alarm"] and n <= ref.window, st
    assert any(s.startswith("layer:") for s in st["alarming"])
    assert st["first_alarm_image"] == ref.window + n


def test_non_finite_rows_are_counted_never_folded_into_the_window():
    """One NaN image among shifted ones: the shift still raises the alarm (a NaN in the window
    sums would hide every later window), the NaN image is counted, and an infinite value
    leaves the status JSON-serialisable."""
    ref = synthetic_reference(with_scores=False)
    rng = np.random.default_rng(3)

    def feed(mon, n, shift=None, bad=None):
        rows = {"input": correlated(n, 7, rng), "layer": correlated(n, 40, rng, shift)}
        if bad is not None:
            rows["layer"][0, 0] = bad
        mon.update(rows)

    for bad in (np.nan, np.inf, -np.inf):
        mon = DriftMonitor(ref)
        feed(mon, 2 * ref.window)
        assert not mon.alarm
        feed(mon, 1, bad=bad)
        feed(mon, 2 * ref.window - 1, shift=1e4)
        st = mon.status()
        assert st["alarm"] and st["non_finite_images"] == 1, st
        assert st["images_seen"] == 4 * ref.window - 1
        json.dumps(st, allow_nan=False)  # no NaN or Infinity token anywhere


def test_min_shift_floor_silences_small_significant_shifts():
    """A consistent shift of 1 spread in every channel is significant for 8-image windows
    but below a 1.5-spread floor; 2.5 spreads is above it."""
    rng = np.random.default_rng(11)
    x = correlated(160, 40, rng)
    sd = x.std(0)
    for min_shift, shift, alarm in ((0.0, 1.0, True), (1.5, 1.0, False), (1.5, 2.5, True)):
        ref = DriftReference.fit({"layer": x}, None, window=8, alpha=0.02, n_windows=2000,
                                 min_shift=min_shift)
        mon = DriftMonitor(ref)
        mon.update({"layer": correlated(8, 40, rng, shift * sd)})
        st = mon.status()
        assert st["alarm"] is alarm, (min_shift, shift, st["statistics"])
        assert st["statistics"]["layer:shift"]["shift"] == pytest.approx(
            np.sqrt(st["statistics"]["layer:shift"]["value"] / 8))
    assert ref.thresholds["layer:shift"] >= 8 * 1.5 ** 2
    assert ref.info["calibrated_thresholds"]["layer:shift"] < ref.thresholds["layer:shift"]


def test_no_check_before_the_window_is_full():
    ref = synthetic_reference(with_scores=False)
    mon = DriftMonitor(ref)
    big = correlated(ref.window - 1, 40, np.random.default_rng(0), shift=100.0)
    mon.update({"layer": big})
    st = mon.status()
    assert not st["alarm"] and st["statistics"]["layer:shift"]["value"] is None
    mon.update({"layer": big[:1]})
    assert mon.status()["alarm"]


def test_score_statistic_is_one_sided():
    ref = synthetic_reference()
    rng = np.random.default_rng(3)
    low = np.exp(rng.normal(0.0, 0.2, ref.window))  # scores fell: not an alarm
    high = np.exp(rng.normal(2.0, 0.2, ref.window))
    mon = DriftMonitor(ref)
    mon.update({}, scores=low)
    assert not mon.alarm
    mon.update({}, scores=high)
    assert mon.status()["alarming"] == ["score:shift"]


def _float32_parameter_bound(block, xbar: np.ndarray, window: int) -> dict:
    """How far a block's statistics of the window means ``xbar`` move when its float64
    parameters are rounded to float32 (each by at most F32_EPS / 2, relative), to first order,
    doubled for the margin: z = (x - mean) / scale moves by dz <= e (|mean| / scale + |z|), a
    projection p = z @ basis / sqrt(eigvals) by dp <= (dz + e |z|) @ |basis| / sqrt(eigvals)
    + e / 2 |p|, and a statistic window * mean(z**2) by window * mean(2 |z| dz)."""
    e = F32_EPS  # twice the rounding of each parameter: the margin
    z = (xbar - block.mean) / block.scale
    dz = e * (np.abs(block.mean) / block.scale + np.abs(z))
    p = (z @ block.basis) / np.sqrt(block.eigvals)
    dp = (dz + e * np.abs(z)) @ np.abs(block.basis) / np.sqrt(block.eigvals) + e / 2 * np.abs(p)
    name = block.name
    return {f"{name}:shift": window * (2 * np.abs(z) * dz).mean(1),
            f"{name}:pca": window * (2 * np.abs(p) * dp).mean(1)}


def test_state_round_trip_is_float32_and_exact():
    ref = synthetic_reference()
    tensors, meta = ref.state()
    assert all(v.dtype == np.float32 for v in tensors.values())
    assert all(k.startswith("drift.") for k in tensors)
    meta = json.loads(json.dumps(meta))
    back = DriftReference.from_state(tensors, meta)
    assert back.thresholds == ref.thresholds and back.window == ref.window
    x = correlated(ref.window, 40, np.random.default_rng(1))[None].mean(1)
    a = ref.blocks["layer"].stats_of_means(x, ref.window)
    b = back.blocks["layer"].stats_of_means(x, ref.window)
    bound = _float32_parameter_bound(ref.blocks["layer"], x, ref.window)
    for k in a:
        assert np.all(np.abs(a[k] - b[k]) <= bound[k]), (k, a[k] - b[k], bound[k])
    bad = dict(tensors)
    bad["drift.layer.basis"] = bad["drift.layer.basis"][:, :1]
    with pytest.raises(ModelFileError, match="shapes"):
        DriftReference.from_state(bad, meta)
    with pytest.raises(ModelFileError, match="version 2 is not supported"):
        DriftReference.from_state(tensors, {**meta, "version": 2})
    with pytest.raises(ModelFileError, match="without thresholds"):
        DriftReference.from_state(tensors, {**meta, "thresholds": {}})


def test_portable_json_holds_the_same_reference():
    """``reference_to_json`` (the ONNX metadata's form) gives back the reference of the model
    file's state exactly: the same float32 arrays, JSON part and statistics; a damaged value is
    refused saying what is wrong."""
    from anomaly_hooks.monitor.portable import reference_from_json, reference_to_json

    ref = synthetic_reference()
    data = json.loads(json.dumps(reference_to_json(ref)))
    back = reference_from_json(data)
    tensors, meta = ref.state()
    tensors_back, meta_back = back.state()
    assert meta_back == json.loads(json.dumps(meta))
    assert tensors.keys() == tensors_back.keys()
    for name, arr in tensors.items():
        assert np.array_equal(arr, tensors_back[name]), name
    from_state = DriftReference.from_state(tensors, json.loads(json.dumps(meta)))
    x = correlated(ref.window, 40, np.random.default_rng(1))[None].mean(1)
    assert back.blocks["layer"].stats_of_means(x, ref.window).keys() == {"layer:shift",
                                                                         "layer:pca"}
    for k, v in from_state.blocks["layer"].stats_of_means(x, ref.window).items():
        assert np.array_equal(back.blocks["layer"].stats_of_means(x, ref.window)[k], v)

    def broken(change):
        bad = json.loads(json.dumps(data))
        change(bad)
        return bad

    name = "drift.layer.mean"
    cases = [
        (lambda d: d.update(version=2), "version 2 is not supported"),
        (lambda d: d.pop("arrays"), "expected an object with"),
        (lambda d: d["arrays"][name].update(shape=[3]), r"bytes for shape \[3\]"),
        (lambda d: d["arrays"][name].update(float32_base64="@@@"), "not valid base64"),
        (lambda d: d["arrays"].update(other=d["arrays"][name]), "must map drift"),
        (lambda d: d["reference"].update(window=0), r"window 0 is not in 1\.\."),
        (lambda d: d["reference"].update(alpha=1.5), r"alpha 1\.5 is not in \(0, 1\)"),
        (lambda d: d["reference"].pop("blocks"), "malformed"),
    ]
    for change, message in cases:
        with pytest.raises(ModelFileError, match=message):
            reference_from_json(broken(change))
    nan = np.full(ref.blocks["layer"].dim, np.nan, "<f4").tobytes()
    import base64

    with pytest.raises(ModelFileError, match="non-finite"):
        reference_from_json(broken(lambda d: d["arrays"][name].update(
            float32_base64=base64.b64encode(nan).decode())))


def test_small_reference_lowers_the_window():
    rng = np.random.default_rng(0)
    ref = DriftReference.fit({"input": correlated(20, 7, rng)}, None, window=16, alpha=0.05,
                             n_windows=1000)  # min_shift default
    assert ref.window == 10 and ref.info["window_requested"] == 16


def test_joint_thresholds_meet_alpha_with_correlated_statistics():
    rng = np.random.default_rng(0)
    base = rng.normal(size=20000)
    cal = {"a": base + 0.1 * rng.normal(size=20000), "b": base, "c": rng.normal(size=20000)}
    thr, q = _joint_thresholds(cal, 0.01)
    rate = np.mean(np.any([cal[s] > thr[s] for s in cal], 0))
    assert 0.008 <= rate <= 0.0101
    assert 1 - 0.01 < q < 1 - 0.01 / 3  # better than Bonferroni for correlated a, b


def test_threads_lose_no_image():
    ref = synthetic_reference(with_scores=False)
    mon = DriftMonitor(ref)
    x = correlated(5, 40, np.random.default_rng(0))

    def work():
        for _ in range(50):
            mon.update({"layer": x})

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mon.status()["images_seen"] == 8 * 50 * 5


def test_input_statistics_see_brightness_contrast_blur_noise():
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:64, 0:64]
    img = 0.5 + 0.2 * np.sin(xx / 3.0)[None].repeat(3, 0)
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)

    def stats(raw):
        return input_statistics(((raw - 0.5) / 0.25)[None], mean, std)[0]

    base = stats(img)
    assert stats(img * 1.2)[0] > base[0] * 1.15  # brightness
    assert stats(0.5 + (img - 0.5) * 0.7)[3] < base[3] * 0.75  # contrast
    fine = 0.5 + 0.2 * np.sin(xx * 1.3)[None].repeat(3, 0)  # a fine texture, then blurred
    blurred = (fine[:, :, :-2] + fine[:, :, 1:-1] + fine[:, :, 2:]) / 3
    assert stats(blurred)[4] < stats(fine[:, :, 1:-1])[4] - 1  # sharpness (log Lap. var.)
    assert stats(img + rng.normal(0, 0.05, img.shape))[5] > base[5] + 1  # noise


def test_collector_reservoir_is_bounded_and_seeded():
    torch = pytest.importorskip("torch")
    feats = {"l": torch.randn(10, 3, 4, 4)}
    imgs = torch.randn(10, 3, 8, 8)
    a = StatisticsCollector((0, 0, 0), (1, 1, 1), max_images=7, seed=1)
    b = StatisticsCollector((0, 0, 0), (1, 1, 1), max_images=7, seed=1)
    for _ in range(3):
        a(feats, imgs)
        b(feats, imgs)
    va, vb = a.vectors(), b.vectors()
    assert va["l"].shape == (7, 3) and va["input"].shape == (7, 7) and a.n_seen == 30
    assert np.array_equal(va["l"], vb["l"])


def test_sliding_window_false_alarm_rate_on_an_iid_stream():
    """Through the monitor itself: the share of checks (one per image once the window is full)
    in alarm over a long stream of fresh good images is about the stated alpha."""
    alpha = 0.05
    rates = []
    for seed in range(4):
        ref = synthetic_reference(alpha=alpha, seed=seed, with_scores=False)
        rng = np.random.default_rng(200 + seed)
        mon = DriftMonitor(ref)
        n = 3000
        mon.update({"input": correlated(n, 7, rng), "layer": correlated(n, 40, rng)})
        st = mon.status()
        rates.append(st["alarm_images"] / (n - ref.window + 1))
    assert 0.25 * alpha < np.mean(rates) < 2.0 * alpha, rates


def _grey(x):
    return 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]


def _assert_input_statistics_close(got, want, pixels: int) -> None:
    """Float32 input statistics against a reference: each is a float32 mean over the pixels of
    terms built with a few roundings each (the grey plane, second differences: 16 at most); a
    mean of n terms errs by at most n * F32_EPS / 2 times the mean of their magnitudes. That is
    a relative error for the channel means (of values in [0, 1]) and the contrast (a mean of
    squares), an absolute one for the logs of the sharpness, noise and gradient."""
    tol = f32_tol(pixels + 16)
    np.testing.assert_allclose(got[:4], want[:4], rtol=tol, atol=0)
    np.testing.assert_allclose(got[4:], want[4:], rtol=0, atol=tol)


def test_input_statistics_match_scipy_references():
    """Each input statistic against a float64 reference written another way (scipy's
    Laplacian and 2-D convolution, numpy's std and gradients)."""
    from scipy import ndimage, signal

    rng = np.random.default_rng(0)
    raw = rng.uniform(0, 1, (3, 3, 40, 52))  # [B, 3, h, w] in [0, 1]
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    norm = (raw - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
    got = input_statistics(norm.astype(np.float32), mean, std).astype(np.float64)
    g = _grey(raw)
    imm_kernel = np.outer([1, -2, 1], [1, -2, 1])
    for i in range(raw.shape[0]):
        lap = ndimage.laplace(g[i])[1:-1, 1:-1]
        imm = signal.convolve2d(g[i], imm_kernel, mode="valid")
        want = [*raw[i].mean((1, 2)), g[i].std(),
                math.log(lap.var() + 1e-10),
                math.log(math.sqrt(math.pi / 2) / 6 * np.abs(imm).mean() + 1e-6),
                math.log(np.abs(np.diff(g[i], axis=0)).mean()
                         + np.abs(np.diff(g[i], axis=1)).mean() + 1e-6)]
        _assert_input_statistics_close(got[i], want, pixels=40 * 52)


def test_statistics_of_tensors_match_numpy(device):
    """The detector hands torch tensors (on its device); the statistics are the same as of
    the numpy arrays (layer: the spatial channel mean)."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(4, 6, 7, 9, generator=gen)
    imgs = torch.randn(4, 3, 20, 24, generator=gen)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    # a float32 mean of 7 * 9 values: n * F32_EPS / 2 times the mean of their magnitudes
    np.testing.assert_allclose(layer_statistics(feats.to(device)),
                               feats.double().mean((2, 3)).numpy(), rtol=0,
                               atol=f32_tol(7 * 9, float(feats.abs().mean((2, 3)).max())))
    got = input_statistics(imgs.to(device), mean, std)
    want = input_statistics(imgs.numpy(), mean, std)
    for i in range(len(got)):
        _assert_input_statistics_close(got[i], want[i], pixels=20 * 24)


def _box_reference(feats: np.ndarray, cells) -> np.ndarray:
    """Brute force: each image's float64 channel means over its unpadded cells only."""
    return np.stack([feats[i, :, :h, :w].astype(np.float64).mean(axis=(1, 2))
                     for i, (h, w) in enumerate(cells)])


def test_statistics_over_boxes_read_only_the_images_part(device):
    """A tiled model's letterboxed images: with each image's box, the layer means are those of
    the cells whose top-left pixel is in the box (a brute-force mean over those cells; bright
    padding cells change nothing), the input statistics those of the box's pixels (the
    statistics of the cropped image)."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(1)
    frame = (32, 48)
    feats = torch.randn(3, 6, 8, 12, generator=gen)  # stride 4
    imgs = torch.randn(3, 3, *frame, generator=gen)
    boxes = [(32, 48), (32, 22), (13, 48)]  # the whole frame, right and lower padding
    cells = [(8, 12), (8, 6), (4, 12)]      # ceil(box / 4): cells starting inside the box
    for i, (h, w) in enumerate(cells):      # the padding: far from the image's features
        feats[i, :, h:, :] = 100.0
        feats[i, :, :, w:] = 100.0
    want = _box_reference(feats.numpy(), cells)
    tol = f32_tol(8 * 12, float(np.abs(want).max()))
    for given in (feats.to(device), feats.numpy()):
        got = layer_statistics(given, boxes, frame)
        np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    padded = layer_statistics(feats)  # without boxes: the padding's 100s are in the mean
    assert np.abs(padded[1:] - want[1:]).min() > 10.0
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    got = input_statistics(imgs.to(device), mean, std, boxes)
    for i, (h, w) in enumerate(boxes):
        crop = input_statistics(imgs[i:i + 1, :, :h, :w].numpy(), mean, std)[0]
        _assert_input_statistics_close(got[i], crop, pixels=h * w)
    sliver = input_statistics(imgs[:1].numpy(), mean, std, [(32, 1)])  # 3 columns read
    _assert_input_statistics_close(sliver[0], input_statistics(imgs[:1, :, :, :3].numpy(),
                                                                mean, std)[0], pixels=32 * 3)
    blocks = block_statistics({"layer": feats}, imgs, mean, std, boxes=np.array(boxes))
    np.testing.assert_allclose(blocks["layer"], want, rtol=0, atol=tol)
    with pytest.raises(ValueError, match=r"boxes must be \[B, 2\]"):
        layer_statistics(feats, boxes[:2], frame)
    with pytest.raises(ValueError, match="frame's size"):
        layer_statistics(feats, boxes)


@pytest.mark.slow
def test_a_tiled_fits_reference_reads_each_images_box():
    """A tiled fit on parts of two aspects: the drift reference's layer means are the mean,
    over the training images, of each image's channel means over its own cells (not the
    letterbox around the portrait ones), as the monitor then measures a predict."""
    from conftest import TILED_SIZE, backbone_rtol, textured_images, tiled_cfg

    from anomaly_hooks import Detector

    det = Detector.from_config({**tiled_cfg("padim"), "monitor": MONITOR_CFG})
    images = textured_images(16, size=TILED_SIZE) + textured_images(8, size=(150, 100), seed=7)
    det.fit(images, progress=False)
    batch, sizes = det.prepare(images)
    assert {det.preprocessor.frame.placement(s) for s in sizes} == {(96, 144), (96, 64)}
    taps, padded = {}, {}
    det.infer(batch, sizes=sizes, taps=taps, observe=lambda feats, images_, boxes: padded.update(
        {k: layer_statistics(v) for k, v in feats.items()}))
    for layer in det.layers:
        block = det.drift_reference_.blocks[layer]
        want = taps[layer].astype(np.float64).mean(axis=0)
        scale = float(np.abs(taps[layer]).max())
        np.testing.assert_allclose(block.mean, want, rtol=0, atol=backbone_rtol() * scale)
        assert np.abs(padded[layer].mean(axis=0) - want).max() > 10 * backbone_rtol() * scale


def test_bad_inputs_are_refused_with_a_message():
    ref = synthetic_reference(with_scores=False)
    mon = DriftMonitor(ref)
    with pytest.raises(DataError, match=r"drift block 'layer': expected \[B, 40\]"):
        mon.update({"layer": np.zeros((2, 39))})
    with pytest.raises(DataError, match="different numbers of images"):
        mon.update({"layer": np.zeros((2, 40)), "input": np.zeros((3, 7))})
    with pytest.raises(DataError, match=r"expected images \[B, 3, h, w\]"):
        input_statistics(np.zeros((2, 1, 8, 8)), (0, 0, 0), (1, 1, 1))
    with pytest.raises(DataError, match="too small"):
        input_statistics(np.zeros((2, 3, 2, 8)), (0, 0, 0), (1, 1, 1))
    with pytest.raises(FitError, match="too few"):
        DriftReference.fit({"input": np.zeros((3, 7))}, None, window=2, n_windows=2000)
    with pytest.raises(FitError, match="different numbers"):
        DriftReference.fit({"a": np.zeros((9, 2)), "b": np.zeros((8, 2))}, None)
    with pytest.raises(ConfigError, match="alpha"):
        DriftReference.fit({"a": np.ones((9, 2))}, None, alpha=0.7)
    assert mon.status()["images_seen"] == 0  # a refused update adds nothing


def test_monitor_config_is_checked(small_cfg):
    from anomaly_hooks.config import load_config

    with pytest.raises(ConfigError, match="monitor.alpha"):
        load_config({**small_cfg, "monitor": {"alpha": 0.0}})
    with pytest.raises(ConfigError, match="monitor.calibration_windows"):
        load_config({**small_cfg, "monitor": {"alpha": 0.001, "calibration_windows": 1000}})
    with pytest.raises(ConfigError, match="monitor.window"):
        load_config({**small_cfg, "monitor": {"window": 1}})


# -- through the detector -----------------------------------------------------------------
MONITOR_CFG = {"window": 4, "alpha": 0.05, "calibration_windows": 1000, "min_shift": 1.0}


@pytest.fixture(scope="module")
def monitored(small_cfg, tmp_path_factory):
    """A detector fitted with a drift reference, and its saved file."""
    from conftest import textured_images

    from anomaly_hooks import Detector

    det = Detector.from_config({**small_cfg, "monitor": MONITOR_CFG})
    det.fit(textured_images(24), progress=False)
    return det, det.save(tmp_path_factory.mktemp("drift") / "m.safetensors")


def test_fit_records_the_reference_through_the_hooks(monitored):
    """The reference is fitted from the fit's own forward passes: one backbone pass per
    image (training + threshold), and every block is there."""
    det, _ = monitored
    ref = det.drift_reference_
    assert set(ref.blocks) == {"input", *det.layers, "score"}
    assert ref.info["n_images"] == 24  # training and threshold images
    assert ref.info["n_scores"] == det.fit_info_["n_threshold"]
    from conftest import textured_images

    from anomaly_hooks import Detector

    calls = []
    fresh = Detector.from_config(det.cfg)
    fresh.extractor.model.register_forward_pre_hook(lambda m, args: calls.append(len(args[0])))
    fresh.fit(textured_images(24), progress=False)
    assert sum(calls) == 24  # no second pass for the drift statistics
    assert fresh.drift_reference_.thresholds == pytest.approx(ref.thresholds)  # seeded


def test_save_load_round_trip_and_alarm(monitored):
    from conftest import textured_images, with_defect

    from anomaly_hooks import Detector
    from anomaly_hooks.config import load_config
    from anomaly_hooks.modelfile import load_model

    det, path = monitored
    back = Detector.load(path)
    # float64 numbers through the file's JSON metadata: exactly
    assert back.drift_reference_.thresholds == det.drift_reference_.thresholds
    assert back.cfg.monitor.window == 4
    _, meta = load_model(path)  # the monitor settings beside the config: older readers load it
    assert "monitor" not in meta["config"] and meta["monitor"]["window"] == 4
    load_config(meta["config"])
    mon = back.drift_monitor()
    good = textured_images(8, seed=5)
    back.predict(good)
    st = mon.status()
    assert st["images_seen"] == 8 and st["window_filled"] == 4 and not st["alarm_episodes"]
    dark = [(g * 0.5).astype(np.uint8) for g in good]
    for _, _pred in back.iter_predict([with_defect(b) for b in dark], batch_size=2):
        pass
    st = mon.status()
    assert st["images_seen"] == 16 and st["alarm"]
    assert "anomaly_hooks_drift_alarm 1" in mon.prometheus()
    back.decision_function(good[:2])
    assert mon.status()["images_seen"] == 18  # every predict path feeds the monitor
    other = DriftMonitor.from_detector(back)  # not attached: sees nothing by itself
    back.predict(good[:2])
    assert other.status()["images_seen"] == 0


def _old_model_file(path: Path, dst: Path) -> Path:
    """The same model as a file written before the drift monitor (no ``drift`` tensors or
    metadata, no ``monitor`` section)."""
    from anomaly_hooks.modelfile import load_model, save_model

    tensors, meta = load_model(path)
    tensors = {k: v for k, v in tensors.items() if not k.startswith("drift.")}
    meta = {k: v for k, v in meta.items() if k not in ("drift", "monitor")}
    return save_model(dst, tensors, meta, version=1)


def test_old_model_file_loads_and_says_monitoring_is_off(monitored, tmp_path, capsys):
    from conftest import textured_images

    from anomaly_hooks import Detector
    from anomaly_hooks.cli import main

    _, path = monitored
    old = _old_model_file(path, tmp_path / "old.safetensors")
    det = Detector.load(old)
    assert det.drift_reference_ is None
    assert det.predict(textured_images(1)[0]).score > 0
    with pytest.raises(NotFittedError, match="no drift reference .* refit it"):
        det.drift_monitor()
    with pytest.raises(NotFittedError, match="no drift reference"):
        DriftMonitor.from_detector(det)
    from PIL import Image

    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(textured_images(1)[0]).save(folder / "a.png")
    assert main(["score", "--model", str(old), str(folder), "--out", str(tmp_path / "o"),
                 "--no-images"]) == 0
    assert "drift: not monitored (the model file has no drift reference" in capsys.readouterr().out
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    assert "drift" not in doc


def test_inconsistent_drift_reference_is_a_model_file_error(monitored, tmp_path):
    from anomaly_hooks import Detector
    from anomaly_hooks.modelfile import load_model, save_model

    _, path = monitored
    tensors, meta = load_model(path)
    meta["drift"]["blocks"][0]["dim"] += 1
    bad = save_model(tmp_path / "bad.safetensors", tensors, meta, version=1)
    with pytest.raises(ModelFileError, match="drift block .input.: tensor shapes do not match"):
        Detector.load(bad)
    del tensors["drift.layer1.mean"]
    meta["drift"]["blocks"][0]["dim"] -= 1
    bad = save_model(tmp_path / "bad2.safetensors", tensors, meta, version=1)
    with pytest.raises(ModelFileError, match="inconsistent model file.*drift.layer1.mean"):
        Detector.load(bad)


def test_fit_without_monitor(small_cfg, tmp_path):
    from conftest import textured_images

    from anomaly_hooks import Detector

    det = Detector.from_config({**small_cfg, "monitor": {"enabled": False}})
    det.fit(textured_images(12), progress=False)
    assert det.drift_reference_ is None and "drift reference" in det.fit_timings_
    with pytest.raises(NotFittedError, match="no drift reference"):
        det.drift_monitor()
    back = Detector.load(det.save(tmp_path / "m.safetensors"))
    assert back.drift_reference_ is None


def test_a_tiny_fit_still_works_without_a_reference(small_cfg, caplog):
    """Three good images fit a PaDiM model as before; the drift reference needs four, so the
    model has none (with a warning) instead of the fit failing."""
    from conftest import textured_images

    from anomaly_hooks import Detector

    det = Detector.from_config({**small_cfg, "threshold": {"holdout_fraction": 0.34}})
    with caplog.at_level("WARNING"):
        det.fit(textured_images(3), progress=False)
    assert det.is_fitted and det.drift_reference_ is None
    assert "no drift reference: 3 good image(s) are too few (4 at least)" in caplog.text


def test_score_prints_a_drift_summary(monitored, tmp_path, capsys):
    from conftest import textured_images
    from PIL import Image

    from anomaly_hooks.cli import main

    _, path = monitored
    folder = tmp_path / "imgs"
    folder.mkdir()
    good = textured_images(8, seed=5)
    dark = [(g * 0.5).astype(np.uint8) for g in good]
    for i, img in enumerate(good + dark):  # sorted by name: the good ones first
        Image.fromarray(img).save(folder / f"{i:02d}.png")
    out = tmp_path / "out"
    assert main(["score", "--model", str(path), str(folder), "--out", str(out),
                 "--no-images"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("drift (windows of 4 images, false-alarm probability 0.05 per "
                           "window") and ": ALARM " in line and "input:" in line, line
    doc = json.loads((out / "results.json").read_text())
    assert doc["drift"]["images_seen"] == 16 and doc["drift"]["alarm_episodes"] >= 1
    assert doc["drift"]["first_alarm_image"] > 8  # not while the good images were scored
    assert main(["score", "--model", str(path), str(folder), "--out", str(out),
                 "--no-images", "--no-drift"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("scored 16 image(s)")
    assert "drift" not in json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_injected_drift_on_the_sample_data_raises_the_alarm_within_a_window(device):
    """Fitted on data/sample/train/good; its 12 held-out test/good images raise no alarm,
    then the same images darkened by 20 %, brightened by 20 %, blurred (sigma 2 px at the
    256 px sensor), at 70 % contrast or with noise (sigma 12 grey levels) raise it within one
    window (8 images)."""
    from PIL import Image, ImageFilter

    from anomaly_hooks import Detector

    sample = ROOT / "data" / "sample"
    cfg = {"method": "padim", "seed": 0, "device": str(device),
           "backbone": {"name": "resnet18", "weights": None},
           "preprocess": {"resize": 80, "crop": 72}, "padim": {"n_features": 40},
           "threshold": {"holdout_fraction": 0.25}, "data": {"batch_size": 8, "num_workers": 0},
           "monitor": {"window": 8}}
    det = Detector.from_config(cfg).fit(sample / "train" / "good", progress=False)
    assert det.drift_reference_.window == 8
    good = [np.asarray(Image.open(p).convert("RGB"))
            for p in sorted((sample / "test" / "good").glob("*.png"))]
    rng = np.random.default_rng(0)
    drifts = {
        "darker": [np.clip(g * 0.8, 0, 255).astype(np.uint8) for g in good],
        "brighter": [np.clip(g * 1.2, 0, 255).astype(np.uint8) for g in good],
        "blur": [np.asarray(Image.fromarray(g).filter(ImageFilter.GaussianBlur(2)))
                 for g in good],
        "lower contrast": [(g.mean() + 0.7 * (g - g.mean())).astype(np.uint8) for g in good],
        "noise": [np.clip(g + rng.normal(0, 12, g.shape), 0, 255).astype(np.uint8)
                  for g in good],
    }
    for name, drifted in drifts.items():
        mon = det.drift_monitor()
        det.predict(good)
        assert mon.status()["alarm_episodes"] == 0, (name, mon.summary())
        det.predict(drifted)
        st = mon.status()
        assert st["alarm"] and len(good) < st["first_alarm_image"] <= len(good) + 8, \
            (name, mon.summary())


def test_alignment_reads_known_camera_shifts(tmp_path):
    """``bench_drift.py --alignment`` (the evidence for the geometric drifts the monitor cannot
    see): good images that are known shifts of one scene give those shifts as their pairwise
    phase-correlation offsets."""
    import sys

    from PIL import Image
    from scipy import ndimage

    sys.path.insert(0, str(ROOT))  # benchmarks/ is imported from the checkout
    from benchmarks import bench_drift
    scene = ndimage.gaussian_filter(np.random.default_rng(0).uniform(0, 255, (256, 256)), 3)
    scene = (scene - scene.min()) / np.ptp(scene) * 255
    folder = tmp_path / "shifted" / "train" / "good"
    folder.mkdir(parents=True)
    for i, dx in enumerate([0, 13, 26]):  # 0, 5 and 10 % of the width
        Image.fromarray(np.roll(scene, dx, axis=1).astype(np.uint8)).save(folder / f"{i}.png")
    got = bench_drift.alignment(tmp_path / "shifted")
    # pairs (0, 13), (13, 26) and (0, 26) px: 5.1, 5.1 and 10.2 % of the width
    # sub-pixel registration, not rounding: each estimate within a quarter pixel (0.1 % of
    # the 256 px width)
    assert got["images"] == 3 and got["median"] == pytest.approx(5.08, abs=0.1)
    # halfway between 5.1 and 10.2 (7.62): an interpolation of two such estimates
    assert got["q75"] == pytest.approx(7.6, abs=0.2)
    assert got["known_5pct_shift"] == pytest.approx(5.08, abs=0.1)


def test_a_tiled_model_is_monitored_as_it_predicts(tmp_path):
    """A tiled (high-resolution) model: its reference from the fit's stitched layer maps, saved
    and loaded with it; good images of its aspect fill the window without an alarm, darkened
    ones raise it."""
    from conftest import TILED_SIZE, textured_images, tiled_cfg, with_defect

    from anomaly_hooks import Detector

    det = Detector.from_config({**tiled_cfg("padim"), "monitor": MONITOR_CFG})
    images = textured_images(32, size=TILED_SIZE)  # 24 to fit, 8 unseen of the same stream
    det.fit(images[:24], progress=False)
    back = Detector.load(det.save(tmp_path / "tiled.safetensors"))
    assert back.tiling is not None
    assert back.drift_reference_.thresholds == det.drift_reference_.thresholds
    mon = back.drift_monitor()
    good = images[24:]
    back.predict(good)
    st = mon.status()
    assert st["images_seen"] == 8 and st["window_filled"] == 4 and not st["alarm_episodes"]
    back.predict([with_defect((g * 0.5).astype(np.uint8)) for g in good])
    assert mon.status()["alarm"]


def test_describe_update_says_what_an_update_did_to_the_reference():
    from anomaly_hooks.monitor.fitting import describe_update

    ref = synthetic_reference(n=40)
    rng = np.random.default_rng(9)
    new = {"input": correlated(10, 7, rng), "layer": correlated(10, 40, rng)}
    after = ref.updated(new, np.exp(rng.normal(1.0, 0.2, 50)), n_windows=800)
    assert describe_update(ref, after) == (
        "drift reference: updated with 10 images (50 in all; the layer and input thresholds "
        "kept from the fit's calibration, the score statistic recalibrated on 50 "
        "out-of-sample scores)")
    assert describe_update(ref, ref) == ("drift reference: unchanged (no statistics of the "
                                         "new images)")
    assert describe_update(None, None).startswith("drift reference: none in the model")
