"""Evaluation datasets: the MVTec AD layout and a generic layout of folders.

MVTec AD::

    root/train/good/*.png
    root/test/good/*.png                 (no masks: all-normal)
    root/test/<defect>/*.png
    root/ground_truth/<defect>/<name>_mask.png

Generic: a folder of good images (split, seeded, into training and test images), one or more
folders of defective images, and an optional folder of masks (``<name>_mask.<ext>`` or
``<name>.<ext>``, directly inside it or in a subfolder named like the defect folder).
"""
from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

import numpy as np
from PIL import Image

from anomaly_hooks.data import list_images
from anomaly_hooks.errors import DataError
from anomaly_hooks.files import file_sha256
from anomaly_hooks.images import is_image_file

GOOD = "good"


@dataclass(frozen=True)
class Sample:
    """One test image: its label (1 = defective), defect type and mask file (if any)."""

    path: Path
    label: int
    defect: str
    mask_path: Optional[Path] = None


@dataclass
class AnomalyDataset:
    """Training images (good only) and labelled test images."""

    name: str
    train: List[Path]
    test: List[Sample]
    has_masks: bool
    root: Optional[Path] = None

    @property
    def labels(self) -> np.ndarray:
        """``[N]`` int labels of the test images (1 = defective)."""
        return np.array([s.label for s in self.test], dtype=np.int64)

    def load_mask(self, sample: Sample, size: tuple[int, int]) -> np.ndarray:
        """Ground truth ``[H, W]`` bool for an image of ``size`` = (width, height): all False for
        a good image; the mask file (any non-zero pixel = defect) for a defective one."""
        w, h = size
        if sample.mask_path is None:
            if sample.label and self.has_masks:
                raise DataError(f"{sample.path}: defective image without a mask")
            return np.zeros((h, w), dtype=bool)
        with Image.open(sample.mask_path) as img:
            if img.size != (w, h):
                raise DataError(f"mask {sample.mask_path} is {img.size[0]}x{img.size[1]} but its "
                                f"image {sample.path} is {w}x{h}: masks must match their images")
            return np.asarray(img.convert("L")) > 0


def copies_of_training(dataset: AnomalyDataset) -> List[bool]:
    """``[len(dataset.test)]``: whether each test image's file holds the same bytes as a
    training image's (SHA-256; only files of a training file's size are read). The model has
    seen such an image: its score is in-sample, not that of an unseen part, and a false-alarm
    rate measured on it says nothing of new parts."""
    by_size: Dict[int, List[Path]] = defaultdict(list)
    for path in dataset.train:
        by_size[path.stat().st_size].append(path)
    digests: Dict[int, Set[str]] = {}

    def seen(path: Path) -> bool:
        size = path.stat().st_size
        if size not in by_size:
            return False
        if size not in digests:
            digests[size] = {file_sha256(p) for p in by_size[size]}
        return file_sha256(path) in digests[size]

    return [seen(sample.path) for sample in dataset.test]


def _find_mask(folder: Path, stem: str) -> Optional[Path]:
    for name in (f"{stem}_mask", stem):
        for path in sorted(folder.glob(f"{name}.*")):
            if is_image_file(path):
                return path
    return None


def is_mvtec(root: Path) -> bool:
    """True when ``root`` has ``train/good`` and ``test``."""
    return (root / "train" / GOOD).is_dir() and (root / "test").is_dir()


def mvtec(root: Path | str) -> AnomalyDataset:
    """Read an MVTec-AD-layout dataset (a category folder such as ``bottle``)."""
    root = Path(root)
    if not is_mvtec(root):
        raise DataError(f"{root}: not an MVTec AD layout (needs train/good and test/<type> "
                        "folders); for other layouts use the generic folders reader")
    train = list_images(root / "train" / GOOD)
    test: List[Sample] = []
    gt_root = root / "ground_truth"
    types = sorted(p for p in (root / "test").iterdir() if p.is_dir())
    if not types:
        raise DataError(f"{root / 'test'}: no test folders")
    missing: List[str] = []
    for folder in types:
        defect = folder.name
        for path in list_images(folder):
            if defect == GOOD:
                test.append(Sample(path, 0, GOOD))
                continue
            mask = _find_mask(gt_root / defect, path.stem) if gt_root.is_dir() else None
            if mask is None and gt_root.is_dir():
                missing.append(str(path))
            test.append(Sample(path, 1, defect, mask))
    if missing:
        raise DataError(f"{len(missing)} defective image(s) without a mask in {gt_root}, e.g. "
                        f"{missing[:3]}: add <name>_mask.png files, or remove ground_truth to "
                        "evaluate image-level metrics only")
    if not any(s.label for s in test) or all(s.label for s in test):
        raise DataError(f"{root / 'test'}: needs both good and defective test images")
    return AnomalyDataset(root.name, train, test, has_masks=gt_root.is_dir(), root=root)


def folders(good: Path | str, defective: Sequence[Path | str], masks: Optional[Path | str] = None,
            test_fraction: float = 0.3, seed: int = 0, name: Optional[str] = None
            ) -> AnomalyDataset:
    """A generic dataset: ``good`` images are split (seeded) into training and test images."""
    if not defective:
        raise DataError("give at least one folder of defective images")
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction={test_fraction}: must be between 0 and 1")
    good_images = list_images(Path(good))
    n_test = max(1, round(test_fraction * len(good_images)))
    if len(good_images) - n_test < 2:
        raise DataError(f"{good}: {len(good_images)} good image(s) are too few to split into "
                        "training and test images (need at least 3)")
    order = list(range(len(good_images)))
    random.Random(seed).shuffle(order)
    test_idx = set(order[:n_test])
    train = [p for i, p in enumerate(good_images) if i not in test_idx]
    test = [Sample(p, 0, GOOD) for i, p in enumerate(good_images) if i in test_idx]
    mask_root = Path(masks) if masks is not None else None
    if mask_root is not None and not mask_root.is_dir():
        raise DataError(f"{mask_root}: mask folder not found")
    for folder in map(Path, defective):
        for path in list_images(folder):
            mask = None
            if mask_root is not None:
                sub = mask_root / folder.name
                mask = _find_mask(sub if sub.is_dir() else mask_root, path.stem)
                if mask is None:
                    raise DataError(f"{path}: no mask named {path.stem}_mask.* or {path.stem}.* "
                                    f"in {sub if sub.is_dir() else mask_root}")
            test.append(Sample(path, 1, folder.name, mask))
    return AnomalyDataset(name or Path(good).name, train, test, has_masks=mask_root is not None)


def open_dataset(path: Path | str) -> AnomalyDataset:
    """An MVTec AD root (the only layout a single path can describe)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such dataset folder")
    return mvtec(path)
