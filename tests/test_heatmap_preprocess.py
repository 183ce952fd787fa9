"""The heatmap blur against scipy, the heatmap pipeline's matrix form against the reference
operations, and the preprocessing against torchvision.transforms.v2."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import f32_tol, f64_tol, resample_tolerance
from scipy import ndimage

from anomaly_hooks.heatmap import (
    PRODUCTS_MAX_WORK,
    anomaly_maps,
    apply_operators,
    axis_operator,
    gaussian_blur,
    heatmap_operators,
    products_work_ratio,
    reference_maps,
)
from anomaly_hooks.preprocess import Preprocessor


@pytest.mark.parametrize("sigma", [1.0, 2.5, 4.0])
@pytest.mark.parametrize("shape", [(40, 40), (70, 45)])
def test_blur_equals_scipy_gaussian_filter(sigma, shape, device):
    """Same kernel (radius ``int(4 sigma + 0.5)``) and border rule: torch's "reflect" padding is
    scipy's "mirror" (the edge pixel is not repeated)."""
    maps = torch.rand(3, *shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = gaussian_blur(maps.to(device), sigma).cpu()
    ref = np.stack([ndimage.gaussian_filter(m, sigma, mode="mirror", truncate=4.0)
                    for m in maps.numpy()])
    # two separable passes, each a sum of `taps` products (a multiply and an add per tap), on
    # values in [0, 1) with weights summing to 1: 4 * taps roundings of magnitudes <= 1
    taps = 2 * int(4 * sigma + 0.5) + 1
    np.testing.assert_allclose(got.numpy(), ref, rtol=0, atol=f64_tol(4 * taps))
    f32 = gaussian_blur(maps.float().to(device), sigma).cpu()
    # the same in float32, plus the rounding of the input to float32
    np.testing.assert_allclose(f32.numpy(), ref, rtol=0, atol=f32_tol(4 * taps + 1))


def test_blur_keeps_small_maps_and_sigma_zero():
    tiny = torch.rand(2, 5, 7)
    out = gaussian_blur(tiny, 4.0)  # kernel clipped to the map, renormalised
    assert out.shape == tiny.shape
    # roughly conserved: the clipped kernel, renormalised at each pixel, moves some of the mass
    # between pixels (a property of the border rule, not a rounding error)
    torch.testing.assert_close(out.sum(), tiny.sum(), rtol=0.3, atol=0)
    assert torch.equal(gaussian_blur(tiny, 0.0), tiny)


def test_anomaly_maps_upsample_bilinear_then_blur(device):
    patch = torch.rand(2, 7, 9, generator=torch.Generator().manual_seed(1)).to(device)
    got = anomaly_maps(patch, (56, 72), sigma=4.0).cpu()
    up = torch.nn.functional.interpolate(patch.cpu()[:, None], size=(56, 72), mode="bilinear",
                                         align_corners=False)[:, 0].double().numpy()
    ref = np.stack([ndimage.gaussian_filter(m, 4.0, mode="mirror") for m in up])
    # against float32 upsampling then a float64 blur, on values in [0, 1): the reference's
    # bilinear blend (2 multiplies and an add per axis: 6 roundings), and the maps' two
    # products (convex combinations: sums of 9 and 7 terms) with float32 operators (one
    # rounding per axis)
    np.testing.assert_allclose(got.numpy(), ref, rtol=0, atol=f32_tol(6 + 9 + 7 + 2))


def conv_pipeline64(patch: torch.Tensor, size, sigma: float) -> torch.Tensor:
    """The reference operations in float64: bilinear upsampling, then the conv blur."""
    up = torch.nn.functional.interpolate(patch.double().cpu()[:, None], size=tuple(size),
                                         mode="bilinear", align_corners=False)[:, 0]
    return gaussian_blur(up, sigma)


# (grid, size, sigma): the model's case, non-square, a tiny map (the kernel clipped to the
# map and renormalised on both axes), no upsampling (clipped too), sigma 0 (bilinear only),
# a 1 x 1 grid, a map smaller than its grid
MATRIX_CASES = [((56, 56), (224, 224), 4.0), ((7, 9), (56, 72), 2.5), ((3, 5), (6, 10), 4.0),
                ((12, 16), (12, 16), 2.0), ((7, 9), (28, 45), 0.0), ((1, 1), (5, 7), 4.0),
                ((6, 4), (3, 2), 1.0)]


@pytest.mark.parametrize("grid, size, sigma", MATRIX_CASES)
def test_matrix_form_equals_the_conv_pipeline_in_float64(grid, size, sigma, device):
    """``A_v @ S @ A_h^T`` in float32 against upsampling + conv blur in float64. Every row of
    an operator is a convex combination (nonnegative bilinear and blur weights, each summing to
    1), so each output is a sum of h terms of a sum of w terms, magnitudes bounded by max|S|:
    h + w roundings in the products, whichever order, and one per axis for the operators'
    float32 entries."""
    patch = 80 * torch.rand(3, *grid, generator=torch.Generator().manual_seed(sum(size)))
    got = anomaly_maps(patch.to(device), size, sigma)
    assert got.dtype == torch.float32 and got.device.type == device.type
    assert got.shape == (3, *size)
    ref = conv_pipeline64(patch, size, sigma)
    top = float(patch.abs().max())
    torch.testing.assert_close(got.cpu().double(), ref, rtol=0,
                               atol=f32_tol(grid[0] + grid[1] + 2, top))


@pytest.mark.parametrize("grid, size, sigma", MATRIX_CASES[:3])
def test_the_traceable_form_equals_the_conv_pipeline_in_float64(grid, size, sigma):
    """:func:`apply_operators` (broadcasting products, what the export traces) within the same
    bound as :func:`anomaly_maps` (two whole-batch products): the same sums in another order."""
    patch = 80 * torch.rand(3, *grid, generator=torch.Generator().manual_seed(7))
    got = apply_operators(patch, *heatmap_operators(grid, size, sigma))
    torch.testing.assert_close(got.double(), conv_pipeline64(patch, size, sigma), rtol=0,
                               atol=f32_tol(grid[0] + grid[1] + 2, float(patch.max())))


def test_past_the_work_limit_the_maps_are_the_reference_operations():
    """The products' multiply-adds over the convolutions' (``H w (h + W)`` against
    ``H W (2 taps + 4)``); where that passes the limit (a 512-wide map with a 3-tap kernel:
    the dense product does 51x the banded blur's work) the reference operations run as such."""
    assert products_work_ratio((56, 56), (224, 224), 4.0) == 1.0  # 224 * 56 * 280 / 224**2 / 70
    assert products_work_ratio((1, 512), (1, 512), 0.3) == 512 * 513 / (512 * (2 * 3 + 4))
    assert products_work_ratio((1, 512), (1, 512), 0.3) > PRODUCTS_MAX_WORK
    patch = torch.rand(2, 1, 512, generator=torch.Generator().manual_seed(9))
    assert torch.equal(anomaly_maps(patch, (1, 512), 0.3), reference_maps(patch, (1, 512), 0.3))


def test_any_batch_layout_gives_the_same_maps():
    """A strided batch (the fit's out-of-sample scores are a transposed ``[P, n]`` buffer) and
    an empty one: the products read a copy in one layout, so the maps are bit for bit those of
    the contiguous batch."""
    buffer = torch.rand(9 * 11, 5, generator=torch.Generator().manual_seed(8))
    strided = buffer.t().reshape(5, 9, 11)
    assert not strided.is_contiguous()
    assert torch.equal(anomaly_maps(strided, (40, 44)),
                       anomaly_maps(strided.contiguous(), (40, 44)))
    assert anomaly_maps(strided[:0], (40, 44)).shape == (0, 40, 44)


@pytest.mark.parametrize("grid, size, sigma", MATRIX_CASES[1:])  # h * w impulse maps each
def test_axis_operators_are_the_reference_on_impulses(grid, size, sigma):
    """The float64 operators reproduce the float64 reference on each unit impulse map (the
    whole linear map, column by column). The reference rounds 6 + 4 * taps times (bilinear
    blend, two blur passes: the blur test's count); each operator entry is the same 1-d
    operations on a 1-d impulse (half that), and an impulse's map is one product of two
    entries: the two differ by at most twice the reference's count, plus one."""
    h, w = grid
    taps = 2 * int(4 * sigma + 0.5) + 1 if sigma > 0 else 0
    a_v = axis_operator(h, size[0], sigma, vertical=True)
    a_h = axis_operator(w, size[1], sigma, vertical=False)
    assert a_v.shape == (size[0], h) and a_h.shape == (size[1], w)
    assert a_v.dtype == torch.float64 and bool((a_v >= 0).all()) and bool((a_h >= 0).all())
    impulses = torch.eye(h * w, dtype=torch.float64).view(h * w, h, w)
    ref = conv_pipeline64(impulses, size, sigma)
    got = torch.einsum("Yy,nyx,Xx->nYX", a_v, impulses, a_h)
    torch.testing.assert_close(got, ref, rtol=0, atol=f64_tol(2 * (6 + 4 * taps) + 1))
    # convex rows: upsampling and blurring keep a constant map constant (a sum of h entries)
    torch.testing.assert_close(a_v.sum(1), torch.ones(size[0], dtype=torch.float64),
                               rtol=0, atol=f64_tol(h + 6 + 4 * taps))


def test_a_width_one_axis_is_left_as_it_is():
    """What the operators' construction relies on: a blur of a map of width (height) 1 is the
    other axis' 1-d blur alone, and upsampling from 1 to 1 point is the identity."""
    col = torch.rand(4, 40, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    along = np.stack([ndimage.gaussian_filter1d(m[:, 0], 4.0, mode="mirror", truncate=4.0)
                      for m in col.numpy()])
    np.testing.assert_allclose(gaussian_blur(col)[..., 0].numpy(), along, rtol=0,
                               atol=f64_tol(4 * 33))
    row = col.transpose(1, 2)  # [4, 1, 40]: the same blur along the width
    assert torch.equal(gaussian_blur(row), gaussian_blur(col).transpose(1, 2))
    one = torch.nn.functional.interpolate(col[:, None], size=(40, 1), mode="bilinear",
                                          align_corners=False)[:, 0]
    assert torch.equal(one, col)


def test_sigma_zero_at_the_grid_size_is_the_identity():
    """No upsampling, no blur: both operators are identities, so the maps come back exactly."""
    patch = torch.rand(2, 6, 9, generator=torch.Generator().manual_seed(4))
    a_v, a_h_t = heatmap_operators((6, 9), (6, 9), 0.0)
    assert torch.equal(a_v, torch.eye(6)) and torch.equal(a_h_t, torch.eye(9))
    assert torch.equal(anomaly_maps(patch, (6, 9), 0.0), patch)


def test_operators_built_in_inference_mode_serve_autograd_later():
    """The cached operators are normal tensors: a first call inside ``inference_mode`` (the
    predict path) does not leave inference tensors that a later call with gradients would
    have to save for backward."""
    patch = torch.rand(2, 5, 6, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        first = anomaly_maps(patch, (37, 41))  # sizes no other test uses: built here
    leaf = patch.clone().requires_grad_()
    again = anomaly_maps(leaf, (37, 41))
    again.sum().backward()
    assert torch.equal(again.detach(), first) and leaf.grad is not None


@pytest.mark.parametrize("shape", [(5, 6), (1, 2, 5, 6)])
def test_anomaly_maps_refuses_maps_that_are_not_a_batch_of_grids(shape):
    with pytest.raises(ValueError, match=r"\[B, h, w\]"):
        anomaly_maps(torch.zeros(shape), (10, 12))


def test_axis_operator_refuses_an_empty_axis():
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        axis_operator(0, 10)


@pytest.mark.parametrize("resize, crop", [((256, 256), (224, 224)), ((96, 128), (80, 112)),
                                          ((64, 80), None), ((257, 255), (224, 223))])
@pytest.mark.parametrize("size", [(300, 410), (50, 61), (256, 256)])
def test_preprocessing_equals_torchvision_transforms_v2(resize, crop, size):
    from torchvision.transforms import v2

    pre = Preprocessor(resize, crop)
    steps = [v2.Resize(list(resize), interpolation=v2.InterpolationMode.BILINEAR, antialias=True)]
    if crop is not None:
        steps.append(v2.CenterCrop(list(crop)))
    steps.append(v2.Normalize(list(pre.mean), list(pre.std)))
    image = torch.rand(3, *size, generator=torch.Generator().manual_seed(sum(size)))
    got = pre(image)
    ref = v2.Compose(steps)(image)
    assert got.shape == ref.shape == (3, *pre.input_size)
    # two float32 antialiased resizes of values in [0, 1], normalised: a range of 1 / std
    atol = resample_tolerance(size, 1 / min(pre.std), float(ref.abs().max()))
    torch.testing.assert_close(got, ref, rtol=0, atol=atol)


def test_heatmap_goes_back_to_the_original_frame():
    pre = Preprocessor((64, 64), (48, 48))
    heat = torch.zeros(48, 48)
    heat[20:28, 20:28] = 1.0
    back = pre.to_original(heat, (128, 96), fill=-1.0)
    assert back.shape == (128, 96)
    assert float(back[0, 0]) == -1.0  # cut off by the crop: not inspected
    ys, xs = np.nonzero(back.numpy() > 0.5)
    assert abs(ys.mean() - 63.5) < 1 and abs(xs.mean() - 47.5) < 1  # still at the centre
