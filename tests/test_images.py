"""Image inputs: every form of the same picture gives the same tensor and the same score."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import textured_images, with_defect
from PIL import Image

from anomaly_hooks.images import ImageReadError, read_image
from anomaly_hooks.preprocess import Preprocessor


@pytest.fixture
def picture(tmp_path):
    arr = with_defect(textured_images(1, size=(90, 130), seed=5)[0])
    path = tmp_path / "pic.png"
    Image.fromarray(arr).save(path)
    return arr, path


def test_all_input_forms_agree(picture):
    arr, path = picture
    ref = read_image(path)
    assert ref.shape == (3, 90, 130) and ref.dtype == torch.float32
    chw = torch.from_numpy(arr).permute(2, 0, 1)
    forms = [str(path), path.read_bytes(), bytearray(path.read_bytes()), Image.open(path), arr,
             arr.astype(np.float64) / 255.0, chw, chw / 255.0]
    for form in forms:
        torch.testing.assert_close(read_image(form), ref, rtol=0, atol=1e-6)


def test_same_score_for_every_form(fitted, picture):
    arr, path = picture
    chw = torch.from_numpy(arr).permute(2, 0, 1)
    forms = (path, path.read_bytes(), Image.open(path), arr, arr / 255.0, chw)
    scores = [fitted.predict(x).score for x in forms]
    assert max(scores) - min(scores) <= 1e-4 * abs(scores[0])


def test_modes_become_rgb(tmp_path):
    gray = (np.arange(40 * 50).reshape(40, 50) % 256).astype(np.uint8)
    Image.fromarray(gray).save(tmp_path / "g.png")
    Image.fromarray(gray.astype(np.uint16) * 257).save(tmp_path / "g16.png")
    Image.fromarray(gray).convert("P").save(tmp_path / "p.png")
    rgba = np.dstack([gray, gray, gray, np.full_like(gray, 128)])
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    Image.fromarray(np.dstack([gray] * 3)).convert("CMYK").save(tmp_path / "c.jpg", quality=100)
    ref = read_image(tmp_path / "g.png")
    assert torch.equal(ref[0], ref[2]) and ref.shape == (3, 40, 50)
    torch.testing.assert_close(read_image(tmp_path / "g16.png"), ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(read_image(tmp_path / "p.png"), ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(read_image(tmp_path / "a.png"), ref, rtol=0, atol=1e-6)
    assert (read_image(tmp_path / "c.jpg") - ref).abs().mean() < 0.03


def test_exif_orientation_applied(tmp_path):
    arr = np.zeros((20, 40, 3), np.uint8)
    arr[:, :10] = 255  # white band on the left
    img = Image.fromarray(arr)
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    img.save(tmp_path / "rot.jpg", exif=exif, quality=100)
    out = read_image(tmp_path / "rot.jpg")
    assert out.shape == (3, 40, 20)  # displayed upright: portrait
    assert out[:, :10, :].mean() > 0.9 and out[:, 30:, :].mean() < 0.1


def test_bad_inputs_name_the_problem(tmp_path):
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "text.png").write_text("not an image")
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(ImageReadError, match="empty.png: empty file"):
        read_image(tmp_path / "empty.png")
    with pytest.raises(ImageReadError, match="text.png: not a readable image"):
        read_image(tmp_path / "text.png")
    with pytest.raises(ImageReadError, match="dir.png: is a folder"):
        read_image(tmp_path / "dir.png")
    with pytest.raises(ImageReadError, match="missing.png: file not found"):
        read_image(tmp_path / "missing.png")
    with pytest.raises(ImageReadError, match=r"in \[0, 1\]"):
        read_image(np.full((4, 4, 3), 2.0))
    with pytest.raises(ImageReadError, match="shape"):
        read_image(np.zeros((4, 4, 5), np.uint8))
    with pytest.raises(ImageReadError, match="unsupported image input"):
        read_image(12)
    with pytest.raises(ImageReadError, match="decompression-bomb"):
        read_image(np.zeros((100, 100, 3), np.uint8), max_pixels=5000)


def test_preprocess_geometry_and_inverse():
    pre = Preprocessor(resize=(64, 80), crop=(48, 60))
    assert pre.crop_box() == (8, 10, 48, 60)
    img = torch.rand(3, 130, 90)
    assert pre(img).shape == (3, 48, 60)
    # a heatmap that is 1 inside the crop maps back to the crop's region of the original
    back = pre.to_original(torch.ones(48, 60), (130, 90), fill=0.0)
    assert back.shape == (130, 90)
    rows = back[:, 45] > 0.5
    top, bottom = rows.nonzero().min().item(), rows.nonzero().max().item()
    assert abs(top - 8 * 130 / 64) <= 2 and abs(bottom + 1 - 56 * 130 / 64) <= 2


def test_more_bad_and_odd_files(tmp_path):
    rng = np.random.default_rng(0)
    arr = (rng.random((64, 64, 3)) * 255).astype(np.uint8)
    Image.fromarray(arr).save(tmp_path / "ok.png")
    Image.fromarray(arr).save(tmp_path / "ok.jpg", quality=90)
    for name in ("ok.png", "ok.jpg"):
        raw = (tmp_path / name).read_bytes()
        (tmp_path / f"trunc_{name}").write_bytes(raw[: len(raw) // 2])
        with pytest.raises(ImageReadError, match=f"trunc_{name}"):
            read_image(tmp_path / f"trunc_{name}")
    # a 20000 x 20000 image (1-bit, so the file is small): refused before decoding
    Image.new("1", (20000, 20000)).save(tmp_path / "bomb.png")
    with pytest.raises(ImageReadError, match="bomb.png.*decompression-bomb"):
        read_image(tmp_path / "bomb.png", max_pixels=100_000_000)
    # a 1x1 image is a valid picture
    Image.new("RGB", (1, 1), (10, 20, 30)).save(tmp_path / "one.png")
    assert read_image(tmp_path / "one.png").shape == (3, 1, 1)
    # palette with transparency, animated GIF (first frame)
    pal = Image.fromarray(arr).convert("P")
    pal.info["transparency"] = 0
    pal.save(tmp_path / "pal.png", transparency=0)
    assert read_image(tmp_path / "pal.png").shape == (3, 64, 64)
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])
    first = read_image(tmp_path / "anim.gif")
    assert first[0].mean() > 0.9 and first[2].mean() < 0.1


def test_fit_lists_every_bad_file_or_skips_them(tmp_path, small_cfg):
    from conftest import textured_images

    from anomaly_hooks import Detector
    from anomaly_hooks.detector import FitError

    for i, img in enumerate(textured_images(8)):
        Image.fromarray(img).save(tmp_path / f"{i}.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    (tmp_path / "zero.png").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("a non-image file in the training folder")
    with pytest.raises(FitError) as err:
        Detector.from_config(small_cfg).fit(tmp_path, progress=False)
    assert "broken.png" in str(err.value) and "zero.png" in str(err.value)
    det = Detector.from_config(small_cfg, data__on_error="skip").fit(tmp_path, progress=False)
    assert len(det.fit_info_["skipped"]) == 2 and det.is_fitted


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [2, 3])
def test_worker_batches_equal_serial_batches(tmp_path, workers):
    """Each worker decodes a share of a batch; the batches (size, order, unreadable items)
    are those of a serial pass."""
    from anomaly_hooks.data import iter_batches
    from anomaly_hooks.preprocess import Preprocessor

    items = []
    for i, img in enumerate(textured_images(13, size=(40, 48))):
        items.append(tmp_path / f"{i:02d}.png")
        Image.fromarray(img).save(items[-1])
    items.insert(5, tmp_path / "missing.png")
    kw = {"batch_size": 6, "max_pixels": 10**8}
    serial = list(iter_batches(items, Preprocessor(), num_workers=0, **kw))
    par = list(iter_batches(items, Preprocessor(), num_workers=workers, **kw))
    assert [len(b.indices) + len(b.errors) for b in par] == [6, 6, 2]
    assert [b.indices for b in par] == [b.indices for b in serial]
    assert [i for b in par for i, _ in b.errors] == [5]
    for a, b in zip(serial, par):
        assert torch.equal(a.images, b.images) and a.sizes == b.sizes


def test_bytes_are_checked_like_files(tmp_path):
    """The bytes of an upload go through the same checks as a file: the same error for the
    same damage, and the too-large refusal is its own class (a service's 413, not 400)."""
    from anomaly_hooks.errors import ImageTooLargeError

    good = tmp_path / "good.png"
    Image.fromarray(textured_images(1)[0]).save(good)
    raw = good.read_bytes()
    cut = tmp_path / "cut.png"
    cut.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ImageReadError) as from_file:
        read_image(cut)
    with pytest.raises(ImageReadError) as from_bytes:
        read_image(raw[:len(raw) // 2])
    assert str(from_bytes.value).split(": ", 1)[1] == str(from_file.value).split(": ", 1)[1]
    with pytest.raises(ImageReadError, match=r"image data: empty \(0 bytes\)"):
        read_image(b"")
    with pytest.raises(ImageReadError, match="not a readable image") as info:
        read_image(b"not an image at all")
    assert "BytesIO" not in str(info.value)
    with pytest.raises(ImageTooLargeError, match="exceeds the limit of 100"):
        read_image(raw, max_pixels=100)
    with pytest.raises(ImageTooLargeError):
        read_image(good, max_pixels=100)  # the same class for a file
