"""The committed synthetic dataset data/sample and its generator scripts/make_sample_data.py."""
from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data" / "sample"
SCRIPT = ROOT / "scripts" / "make_sample_data.py"
DEFECTS = ("scratch", "spot", "missing", "stain")
SIZE = 256


def _load_script() -> ModuleType:
    """Import scripts/make_sample_data.py as a module (it is not part of the package)."""
    name = "make_sample_data"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    return _load_script()


@pytest.fixture(scope="module")
def sample() -> Path:
    if not SAMPLE.is_dir():
        pytest.fail(f"{SAMPLE} missing: run `python scripts/make_sample_data.py`")
    return SAMPLE


def _pngs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.png"))


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_layout_and_counts(sample: Path) -> None:
    assert sorted(p.name for p in sample.iterdir()) == ["ground_truth", "test", "train"]
    assert sorted(p.name for p in (sample / "train").iterdir()) == ["good"]
    assert _pngs(sample / "train" / "good") == [f"{i:03d}.png" for i in range(60)]
    assert sorted(p.name for p in (sample / "test").iterdir()) == sorted(("good",) + DEFECTS)
    assert _pngs(sample / "test" / "good") == [f"{i:03d}.png" for i in range(12)]
    assert sorted(p.name for p in (sample / "ground_truth").iterdir()) == sorted(DEFECTS)
    for defect in DEFECTS:
        assert _pngs(sample / "test" / defect) == [f"{i:03d}.png" for i in range(8)]
        assert _pngs(sample / "ground_truth" / defect) == [f"{i:03d}_mask.png" for i in range(8)]
    assert len(_files(sample)) == 60 + 12 + 2 * 8 * len(DEFECTS)  # nothing else in there


def test_images_are_rgb_and_of_one_size(sample: Path) -> None:
    for path in sorted(sample.glob("t*/*/*.png")):
        with Image.open(path) as im:
            assert im.format == "PNG" and im.mode == "RGB" and im.size == (SIZE, SIZE), path


def test_good_images_vary(sample: Path) -> None:
    a = np.asarray(Image.open(sample / "train" / "good" / "000.png"), dtype=np.float64)
    b = np.asarray(Image.open(sample / "train" / "good" / "001.png"), dtype=np.float64)
    assert np.abs(a - b).mean() > 2.0
    assert a.std() > 3.0  # textured, not flat


@pytest.mark.parametrize("defect", DEFECTS)
def test_masks_are_binary_and_cover_a_defect(sample: Path, defect: str) -> None:
    for image_path in sorted((sample / "test" / defect).glob("*.png")):
        mask_path = sample / "ground_truth" / defect / f"{image_path.stem}_mask.png"
        with Image.open(image_path) as im, Image.open(mask_path) as mk:
            assert mk.mode == "L" and mk.size == im.size, mask_path
            image = np.asarray(im, dtype=np.float64)
            mask = np.asarray(mk)
        assert set(np.unique(mask).tolist()) == {0, 255}, mask_path
        inside = mask == 255
        assert 20 <= inside.sum() <= 0.05 * mask.size, mask_path
        # Visible: defect pixels stray much further from the typical surface colour.
        deviation = np.abs(image - np.median(image[~inside], axis=0)).max(-1)
        contrast = deviation[inside].mean() - deviation[~inside].mean()
        assert contrast > 10, (mask_path, contrast)


def test_no_masks_for_good_images(sample: Path) -> None:
    assert not (sample / "ground_truth" / "good").exists()
    assert not list(sample.rglob("good/*_mask.png"))


@pytest.mark.slow
def test_regenerating_gives_identical_files(gen: ModuleType, sample: Path,
                                            tmp_path: Path) -> None:
    out = tmp_path / "sample"
    assert gen.main(["--out", str(out)]) == 0
    assert _files(out) == _files(sample)
    differing = [f for f in _files(out) if (out / f).read_bytes() != (sample / f).read_bytes()]
    if not differing:
        return
    # Bytes differ: say whether the pixels (what matters) or only the PNG encoding differ.
    pixels_differ = [f for f in differing
                     if not np.array_equal(np.asarray(Image.open(out / f)),
                                           np.asarray(Image.open(sample / f)))]
    assert not pixels_differ, f"data/sample is stale, regenerate it: {pixels_differ[:5]}"
    # The pixels are what the script determines; PNG bytes also depend on the zlib build.
    warnings.warn(f"same pixels but different PNG bytes (zlib build?): {differing[:5]}",
                  stacklevel=1)


def test_refuses_to_overwrite_without_force(gen: ModuleType, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "data"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert gen.main(["--out", str(out), "--size", "64"]) == 1
    assert "--force" in capsys.readouterr().err
    assert _files(out) == ["keep.txt"]
    assert gen.main(["--out", str(out), "--size", "64", "--force"]) == 0
    assert not (out / "keep.txt").exists()
    assert len(_files(out)) == 136
    assert [p.name for p in tmp_path.iterdir()] == ["data"]  # no temporary folders left


def test_empty_output_folder_is_fine(gen: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert gen.main(["--out", str(out), "--size", "64"]) == 0
    assert len(_files(out)) == 136


def test_seed_changes_images(gen: ModuleType) -> None:
    seeds = {job.image_path: job.seed for job in gen.plan(0)}
    other = {job.image_path: job.seed for job in gen.plan(1)}
    path = "test/scratch/000.png"
    img0, mask0 = gen.render(seeds[path], 96, "scratch")
    img1, mask1 = gen.render(other[path], 96, "scratch")
    again, mask_again = gen.render(seeds[path], 96, "scratch")
    assert np.array_equal(img0, again) and np.array_equal(mask0, mask_again)
    assert not np.array_equal(img0, img1)
    assert not np.array_equal(mask0, mask1)
    assert len(set(seeds.values())) == len(seeds)  # every image has its own sub-seed


def test_interrupted_run_leaves_old_data_and_no_temp(gen: ModuleType, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "data"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    calls: list[Path] = []
    real_save = gen.save_png

    def failing_save(array: np.ndarray, path: Path) -> None:
        calls.append(path)
        if len(calls) > 3:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-run
        real_save(array, path)

    monkeypatch.setattr(gen, "save_png", failing_save)
    with pytest.raises(KeyboardInterrupt):
        gen.main(["--out", str(out), "--size", "64", "--force"])
    assert _files(out) == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["data"]
