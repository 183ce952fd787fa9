"""High-resolution framing and tiling: the tile grid, stitching against a whole-frame pass, the
working frame and its exact inverse, the config's checks."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import f32_tol, resample_tolerance
from PIL import Image
from torch import nn

from anomaly_hooks.config import load_config
from anomaly_hooks.errors import ConfigError, DataError
from anomaly_hooks.extractor import HookFeatureExtractor, LayerInfo
from anomaly_hooks.framing import Frame
from anomaly_hooks.modelmeta import MetadataError, check_frame
from anomaly_hooks.preprocess import Preprocessor
from anomaly_hooks.tiling.frame import image_size, median_size, working_frame
from anomaly_hooks.tiling.grid import TileGrid, axis_plan
from anomaly_hooks.tiling.pipeline import Tiling


# -- the tile grid ---------------------------------------------------------------------------
@pytest.mark.parametrize("length, tile, overlap, stride", [
    (1232, 256, 64, 16), (816, 256, 64, 16), (256, 256, 64, 16), (160, 256, 64, 16),
    (4096, 512, 128, 32), (272, 256, 32, 16), (1000, 200, 40, 20)])
def test_axis_plan_covers_the_frame_with_the_overlap(length, tile, overlap, stride):
    origins, cuts, t = axis_plan(length, tile, overlap, stride)
    assert t <= tile and t % stride == 0
    if len(origins) > 1:  # the fewest tiles, each as short as covering allows
        n = len(origins)
        assert n == math.ceil((length - overlap) / (tile - overlap))
        assert n * (t - stride) - (n - 1) * overlap < length
    else:
        assert t == length
    assert origins[0] == 0 and origins[-1] + t == length
    assert all(o % stride == 0 for o in origins) and all(c % stride == 0 for c in cuts)
    assert cuts[0] == 0 and cuts[-1] == length and list(cuts) == sorted(cuts)
    for j, o in enumerate(origins):
        # a tile keeps only what it holds, at least overlap / 2 from its inner edges
        assert o <= cuts[j] < cuts[j + 1] <= o + t
        if j > 0:
            assert cuts[j] - o >= overlap // 2
            assert origins[j - 1] + t - o >= overlap  # neighbours overlap by >= overlap
        if j < len(origins) - 1:
            assert o + t - cuts[j + 1] >= overlap // 2


def test_tile_grid_refuses_sizes_off_the_stride():
    with pytest.raises(ConfigError, match=r"tiling\.tile=\[250, 256\].*multiple of .* 16"):
        TileGrid.plan((512, 512), (250, 256), 64, 16)
    with pytest.raises(ConfigError, match=r"tiling\.overlap=48.*multiple of .* 32"):
        TileGrid.plan((512, 512), (256, 256), 48, 16)


def test_stitch_of_recut_windows_gives_the_grid_back():
    grid = TileGrid.plan((160, 272), (64, 96), 32, 16)
    x = torch.randn(3, 5, 160 // 8, 272 // 8)
    windows = grid.recut(x, 8)
    assert windows.shape == (3 * grid.n_tiles, 5, 8, 12)
    torch.testing.assert_close(grid.stitch(windows, 8), x, rtol=0, atol=0)
    scores = x[:, 0]
    torch.testing.assert_close(grid.stitch(grid.recut(scores, 8), 8), scores, rtol=0, atol=0)
    with pytest.raises(ValueError, match="whole frames"):
        grid.stitch(windows[:-1], 8)


class _LocalNet(nn.Module):
    """A CNN whose outputs see a bounded neighbourhood: stride 4 and 8 taps, receptive field
    radius 3 + 2*3 + 4*3 = 21 px (3x3 convs, zero padding)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.block1 = nn.Sequential(nn.ReLU(), nn.Conv2d(8, 12, 3, stride=2, padding=1))
        self.block2 = nn.Sequential(nn.ReLU(), nn.Conv2d(12, 16, 3, stride=2, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block2(self.block1(self.stem(x)))


def _magnitude_bounds(net: _LocalNet, x: torch.Tensor) -> dict:
    """The largest output of each block of ``net`` run with its weights' and biases' absolute
    values, without the ReLUs, on ``x >= 0``: a bound on the magnitudes float32 sums over."""
    out = {}
    for name in ("stem", "block1", "block2"):
        conv = getattr(net, name)
        conv = conv if isinstance(conv, nn.Conv2d) else conv[1]
        weight, bias = conv.weight.detach().abs().cpu(), conv.bias.detach().abs().cpu()
        x = F.conv2d(x, weight, bias, conv.stride, conv.padding)  # on x's device, the CPU
        out[name] = float(x.max())
    return out


def test_stitched_features_equal_a_whole_frame_pass_beyond_the_receptive_field(device):
    """With a margin (overlap / 2 = 32 px) beyond the receptive field (21 px), every kept
    feature saw exactly what a pass over the whole frame sees: the stitched maps equal the
    whole-frame maps, up to float32 summation order."""
    net = _LocalNet().eval()
    ext = HookFeatureExtractor(net, ["block1", "block2"], device, probe_size=(64, 64))
    frame = Frame((192, 288), (192, 288))
    section = load_config({"tiling": {"enabled": True, "tile": 96, "overlap": 64,
                                      "tile_batch": 5}}).tiling
    tiling = Tiling(section, frame, ext.info)
    assert tiling.grid.n_tiles > 4 and tiling.grid.min_margin() >= 32
    frames = torch.randn(2, 3, 192, 288, generator=torch.Generator().manual_seed(1)).to(device)
    stitched = tiling.features(ext, frames)
    whole = ext(frames)
    # each 3x3 convolution sums 9 * C_in products and a bias per output: float32 rounds each
    # term and each partial sum, relative to the sum of the terms' magnitudes. Those are
    # bounded by the network run with |weights| and |biases| on |frames| (a ReLU only shrinks
    # magnitudes), and an earlier layer's error reaches the next through the same |weights|.
    magnitudes = _magnitude_bounds(net, frames.abs().cpu())
    roundings = {"block1": 2 * (27 + 1) + 2 * (72 + 1)}
    roundings["block2"] = roundings["block1"] + 2 * (108 + 1)
    for name in ("block1", "block2"):
        assert stitched[name].shape == whole[name].shape
        torch.testing.assert_close(stitched[name].cpu(), whole[name].cpu(), rtol=0,
                                   atol=f32_tol(roundings[name], magnitudes[name]))


def test_tiling_refuses_layers_whose_strides_do_not_divide():
    layers = [LayerInfo("a", 4, 8), LayerInfo("b", 4, 12)]
    section = load_config({"tiling": {"enabled": True}}).tiling
    with pytest.raises(ConfigError, match="divide the coarsest"):
        Tiling(section, Frame((96, 96), (96, 96)), layers)


# -- the working frame ------------------------------------------------------------------------
def test_frame_placement_keeps_the_aspect_and_snaps_the_models_own():
    frame = Frame((408, 612), (416, 624))
    assert frame.placement((1000, 1500)) == (408, 612)  # the model's aspect: the whole box
    assert frame.placement((1001, 1500)) == (408, 612)  # within a pixel of it: snapped
    assert frame.placement((500, 1500)) == (204, 612)   # wider: letterboxed (bars below)
    assert frame.placement((1500, 1000)) == (408, 272)  # portrait: bars to the right
    assert frame.uninspected_fraction == 0.0
    with pytest.raises(ValueError, match="must fit"):
        Frame((420, 612), (416, 624))
    with pytest.raises(ValueError, match="crop fractions"):
        Frame((96, 96), (96, 96), (0.0, 1.0))


def test_a_stretching_frame_fills_its_box_whatever_the_aspect():
    frame = Frame((408, 612), (416, 624), aspect="stretch")
    for size in ((1000, 1500), (500, 1500), (1500, 1000), (89, 400)):
        assert frame.placement(size) == (408, 612)
    assert Frame.from_dict(frame.as_dict()) == frame
    assert Frame.from_dict({"content": [8, 8], "size": [8, 8]}).aspect == "keep"  # older files
    assert check_frame(frame.as_dict())["aspect"] == "stretch"
    with pytest.raises(MetadataError, match="aspect"):
        check_frame({**frame.as_dict(), "aspect": "squash"})
    with pytest.raises(ValueError, match="aspect"):
        Frame((8, 8), (8, 8), aspect="squash")
    with pytest.raises(ConfigError, match=r"tiling\.aspect"):
        load_config({"tiling": {"enabled": True, "aspect": "squash"}})


def test_framed_preprocessing_stretches_an_image_of_another_aspect_to_the_box():
    from torchvision.transforms import v2

    pre = Preprocessor.framed(Frame((120, 180), (128, 192), aspect="stretch"), (0.5,) * 3,
                              (0.25,) * 3)
    image = torch.rand(3, 150, 450, generator=torch.Generator().manual_seed(3))
    out = pre(image)
    ref = v2.Normalize(list(pre.mean), list(pre.std))(v2.Resize([120, 180], antialias=True)(image))
    atol = resample_tolerance((150, 450), 1 / min(pre.std), float(ref.abs().max()))
    torch.testing.assert_close(out[:, :120, :180], ref, rtol=0, atol=atol)
    maps = torch.zeros(128, 192)
    maps[:120, :180] = 1.0  # the box, all of it the image's
    back = pre.to_original(maps, (150, 450), 0.0)
    assert tuple(back.shape) == (150, 450) and bool((back == 1.0).all())


def test_frame_crop_box_and_uninspected_fraction():
    frame = Frame((100, 100), (112, 112), crop=(0.8, 0.5))
    assert frame.source_box((1000, 600)) == (100, 150, 800, 300)
    assert frame.uninspected_fraction == pytest.approx(0.6)
    assert Frame.from_dict(frame.as_dict()) == frame


def _section(**tiling):
    return load_config({"tiling": {"enabled": True, **tiling}}).tiling


@pytest.mark.parametrize("tiling, size, content", [
    ({"max_pixels": 600_000}, (1000, 1500), (632, 949)),  # auto: the budget, aspect kept
    ({"max_pixels": 600_000}, (256, 400), (256, 400)),    # auto never upsamples
    ({"scale": 0.5}, (1000, 1500), (500, 750)),
    ({"scale": "2"}, (100, 150), (200, 300)),
    ({"long_side": 600}, (1000, 1500), (400, 600)),
    ({"short_side": 600}, (1000, 1500), (600, 900)),
    ({"scale": 0.5, "crop": [0.5, 1.0]}, (1000, 1500), (250, 750)),
])
def test_working_frame_from_the_training_images_size(tiling, size, content):
    frame = working_frame(_section(**tiling), size, 16)
    assert frame.content == content
    assert all(s % 16 == 0 and 0 <= s - c < 16 for s, c in zip(frame.size, frame.content))
    if "scale" not in tiling and "long_side" not in tiling and "short_side" not in tiling:
        assert frame.content[0] * frame.content[1] <= tiling["max_pixels"] or \
            frame.content == size


def test_image_size_reads_headers_with_exif_orientation(tmp_path):
    img = Image.new("RGB", (300, 200))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: the decoder gives 300 x 200 (H x W)
    path = tmp_path / "rotated.jpg"
    img.save(path, exif=exif)
    assert image_size(path) == (300, 200)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    assert image_size(buf.getvalue()) == (200, 300)
    assert image_size(np.zeros((20, 30, 3), np.uint8)) == (20, 30)
    assert image_size(torch.zeros(3, 20, 30)) == (20, 30)
    assert image_size(tmp_path / "missing.png") is None
    assert median_size([np.zeros((h, 40)) for h in (10, 30, 20)]) == (20, 40)
    with pytest.raises(DataError, match="training images could be read"):
        median_size([tmp_path / "missing.png"])


@pytest.mark.parametrize("bad, key", [
    ({"scale": "big"}, "tiling.scale"), ({"scale": 0}, "tiling.scale"),
    ({"scale": 0.5, "long_side": 800}, "tiling.scale"),
    ({"overlap": 256, "tile": 256}, "tiling.overlap"), ({"tile": [16, 256]}, "tiling.tile"),
    ({"crop": [0.5, 1.5]}, "tiling.crop"), ({"tile_batch": 0}, "tiling.tile_batch"),
    ({"max_pixels": 10}, "tiling.max_pixels")])
def test_tiling_config_errors_name_the_key(bad, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config({"tiling": {"enabled": True, **bad}})


def test_tile_positions_need_tiling():
    with pytest.raises(ConfigError, match=r"padim\.positions.*tiling\.enabled"):
        load_config({"method": "padim", "padim": {"positions": "tile"}})
    cfg = load_config({"method": "padim", "padim": {"positions": "tile"},
                       "tiling": {"enabled": True, "tile": 128}})
    assert cfg.tiling.tile == [128, 128]  # an int is a square


# -- the working frame's preprocessing and its inverse ------------------------------------------
def test_framed_preprocessing_is_an_aspect_keeping_resize_then_padding():
    from torchvision.transforms import v2

    pre = Preprocessor.framed(Frame((120, 180), (128, 192)), (0.4, 0.5, 0.6), (0.2, 0.25, 0.3))
    for size, placed in (((300, 450), (120, 180)), ((150, 450), (60, 180))):
        image = torch.rand(3, *size, generator=torch.Generator().manual_seed(size[0]))
        out = pre(image)
        assert out.shape == (3, 128, 192) and pre.input_size == (128, 192)
        ref = v2.Normalize(list(pre.mean), list(pre.std))(
            v2.Resize(list(placed), antialias=True)(image))
        # two float32 antialiased resizes of values in [0, 1], normalised: a range of 1 / std
        atol = resample_tolerance(size, 1 / min(pre.std), float(ref.abs().max()))
        torch.testing.assert_close(out[:, :placed[0], :placed[1]], ref, rtol=0, atol=atol)
        pad = torch.ones(128, 192, dtype=torch.bool)
        pad[:placed[0], :placed[1]] = False
        assert bool((out[:, pad] == 0).all())  # padding: zeros, the mean colour


def test_framed_preprocessing_of_a_reduced_decode_uses_the_original_size():
    pre = Preprocessor.framed(Frame((100, 150), (112, 160), crop=(0.5, 0.5)), (0.5,) * 3,
                              (0.25,) * 3)
    yy, xx = torch.meshgrid(torch.arange(800.0), torch.arange(1200.0), indexing="ij")
    smooth = 0.5 + 0.4 * torch.sin(yy / 37.0) * torch.cos(xx / 53.0)  # no detail to alias
    full = torch.stack([smooth, smooth.flip(0), smooth.flip(1)])
    reduced = F.avg_pool2d(full[None], 2)[0]  # what decode_reduced gives (k = 2)
    a, b = pre(full), pre(reduced, (800, 1200))
    assert a.shape == b.shape
    # the same part at the same place: the two resamplings differ by a fraction of a level
    torch.testing.assert_close(a, b, rtol=0, atol=0.01 / 0.25)


@pytest.mark.parametrize("size", [(1000, 1500), (997, 1503), (500, 1500), (1500, 1000)])
@pytest.mark.parametrize("crop", [None, (0.9, 0.6)])
def test_framed_heatmap_comes_back_exactly_in_the_callers_frame(size, crop):
    """A heatmap linear in the frame's coordinates comes back as the same linear function of
    the image's pixel coordinates (bilinear interpolation reproduces linear functions; exact
    up to float32 rounding), never reads the padding, and the crop's cut gets the fill."""
    frame = Frame((408, 612), (416, 624), crop)
    pre = Preprocessor.framed(frame, (0.5,) * 3, (0.25,) * 3)
    h, w = frame.placement(size)
    top, left, bh, bw = frame.source_box(size)
    yy, xx = torch.meshgrid(torch.arange(416, dtype=torch.float64),
                            torch.arange(624, dtype=torch.float64), indexing="ij")
    a, b = 0.37, -0.21
    heat = (a * yy + b * xx).float()
    heat[h:, :] = 1e6  # padding and letterbox bars must never come back
    heat[:, w:] = 1e6
    back = pre.to_original(heat, size, fill=-5.0).double()
    assert back.shape == size
    Y = torch.arange(size[0], dtype=torch.float64)[:, None] - top
    X = torch.arange(size[1], dtype=torch.float64)[None, :] - left
    # the frame coordinate each image pixel centre maps to (align_corners=False)
    fy, fx = (Y + 0.5) * h / bh - 0.5, (X + 0.5) * w / bw - 0.5
    expect = a * fy + b * fx
    inside = (fy >= 0) & (fy <= h - 1) & (fx >= 0) & (fx <= w - 1)  # not clamped at an edge
    inside &= (Y >= 0) & (Y < bh) & (X >= 0) & (X < bw)
    # float32 roundings: the heatmap's values (1), the bilinear blend (2 multiplies and an add
    # per axis: 6), all relative to its largest value; and each source coordinate (i + 0.5) *
    # scale - 0.5 (3 roundings of a coordinate up to the frame's size, times the slope)
    tol = (f32_tol(1 + 6, float(heat[:h, :w].abs().max()))
           + f32_tol(3, abs(a) * h + abs(b) * w))
    assert float((back - expect)[inside].abs().max()) <= tol
    assert float(back.max()) < 1e3  # no padding leaked
    cut = torch.ones(size, dtype=torch.bool)
    cut[top:top + bh, left:left + bw] = False
    assert bool((back[cut] == -5.0).all())
    assert int(cut.sum()) == size[0] * size[1] - bh * bw


# -- the configs users start from ------------------------------------------------------------------
def test_published_protocol_configs_keep_resize_256_crop_224():
    from conftest import ROOT

    for name in ("padim_wrn50.yaml", "patchcore_wrn50_1.yaml", "patchcore_wrn50_10.yaml"):
        cfg = load_config(ROOT / "configs" / name)
        assert not cfg.tiling.enabled
        assert list(cfg.preprocess.resize) == [256, 256] and list(cfg.preprocess.crop) == [224, 224]


def test_highres_configs_are_general_tiled_and_inspect_the_whole_image():
    from conftest import ROOT

    names = ["patchcore_effnet_lite0_highres.yaml", "padim_effnet_lite0_highres.yaml",
             "patchcore_wrn50_highres.yaml", "padim_wrn50_highres.yaml"]
    for name in names:
        cfg = load_config(ROOT / "configs" / name)
        t = cfg.tiling
        assert t.enabled and t.scale == "auto" and t.crop is None  # from the images, whole
        assert t.long_side is None and t.short_side is None
