"""The heatmap blur against scipy and the preprocessing against torchvision.transforms.v2."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import f32_tol, f64_tol, resample_tolerance
from scipy import ndimage

from anomaly_hooks.heatmap import anomaly_maps, gaussian_blur
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
    # float32 against float32 upsampling then a float64 blur: the bilinear blend (2 multiplies
    # and an add per axis: 6 roundings) and the float32 blur's 4 * taps (33 taps at sigma 4),
    # on values in [0, 1)
    np.testing.assert_allclose(got.numpy(), ref, rtol=0, atol=f32_tol(6 + 4 * 33))


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
