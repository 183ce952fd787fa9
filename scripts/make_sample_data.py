#!/usr/bin/env python
"""Generate a small, deterministic synthetic anomaly-detection dataset (MVTec AD layout).

The images show a brushed / woven metal surface: a sum of oriented sinusoids, streaky
"brushing" noise, low-frequency mottling, a random illumination gradient and mild sensor
noise. Every image gets its own random phases and shifts, so good images vary while
staying of one kind. Defective test images carry one of four defect types:

* ``scratch`` - thin dark or bright curved line(s), a few px wide, 40-120 px long;
* ``spot``    - small dark irregular blob(s), radius 6-15 px;
* ``missing`` - a polygonal chunk (20-40 px) where the surface is gone and a flat
  background colour shows through;
* ``stain``   - a soft, translucent, colour-shifted (brownish or bluish) blob, radius 15-30.

Layout written under ``--out`` (default ``data/sample``)::

    train/good/000.png ... 059.png
    test/good/000.png ... 011.png
    test/<defect>/000.png ... 007.png
    ground_truth/<defect>/000_mask.png ...   (L mode, 0 or 255)

The same ``--seed`` gives byte-identical files. Sizes in px are for ``--size 256`` and scale
with the image size.

Usage::

    python scripts/make_sample_data.py [--out data/sample] [--seed 0] [--size 256] [--force]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np
from PIL import Image, ImageDraw

N_TRAIN_GOOD = 60
N_TEST_GOOD = 12
N_PER_DEFECT = 8
DEFECTS: tuple[str, ...] = ("scratch", "spot", "missing", "stain")
REFERENCE_SIZE = 256  # defect sizes below are given in px at this image size

BASE_COLOUR = np.array([0.60, 0.62, 0.66])  # cool steel grey
SENSOR_NOISE = 0.004  # std of the per-pixel noise (about 1 grey level)

Array = np.ndarray


class Job(NamedTuple):
    """One image to generate: where it goes, its defect type (or None) and its sub-seed."""

    image_path: str
    mask_path: str | None
    defect: str | None
    seed: int


# --------------------------------------------------------------------------- surface


def _grid(size: int) -> tuple[Array, Array]:
    """Pixel-centre coordinate grids (y, x), float64, shape (size, size)."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    return yy, xx


def _upsample_noise(rng: np.random.Generator, cells: int, size: int) -> Array:
    """Smooth low-frequency noise: a small random grid resized bicubically, ~unit std."""
    small = rng.normal(0.0, 1.0, (cells, cells)).astype(np.float32)
    img = Image.fromarray(small, mode="F").resize((size, size), Image.Resampling.BICUBIC)
    return np.asarray(img, dtype=np.float64)


def _streaks(rng: np.random.Generator, size: int, length: int) -> Array:
    """Brushing streaks: white noise averaged along x over `length` px, ~unit std."""
    noise = rng.normal(0.0, 1.0, (size, size + length))
    csum = np.cumsum(noise, axis=1)
    avg = (csum[:, length:] - csum[:, :-length]) / np.sqrt(length)
    return avg[:, :size]


def _sinusoids(rng: np.random.Generator, size: int) -> Array:
    """Sum of oriented sinusoids with per-image phases, a small shift and orientation jitter."""
    yy, xx = _grid(size)
    scale = size / REFERENCE_SIZE
    shift_y, shift_x = rng.uniform(0, 64, 2)
    jitter = np.deg2rad(rng.uniform(-2.0, 2.0))
    # (period px, amplitude, angle deg): fine brushing lines plus a faint cross weave.
    components = ((7.0, 0.030, 0.0), (19.0, 0.022, 4.0), (4.5, 0.012, -3.0), (13.0, 0.016, 90.0))
    total = np.zeros((size, size))
    for period, amp, angle in components:
        theta = np.deg2rad(angle) + jitter
        # Lines run along `theta`; the wave varies across them.
        across = -(xx + shift_x) * np.sin(theta) + (yy + shift_y) * np.cos(theta)
        total += amp * np.sin(2 * np.pi * across / (period * scale) + rng.uniform(0, 2 * np.pi))
    return total


def _illumination(rng: np.random.Generator, size: int) -> Array:
    """A slight random linear illumination gradient plus a soft radial falloff."""
    yy, xx = _grid(size)
    u, v = xx / size - 0.5, yy / size - 0.5
    gx, gy = rng.uniform(-0.08, 0.08, 2)
    cx, cy = rng.uniform(-0.2, 0.2, 2)
    radial = -rng.uniform(0.0, 0.10) * ((u - cx) ** 2 + (v - cy) ** 2)
    return gx * u + gy * v + radial


def _polish_marks(rng: np.random.Generator, size: int) -> Array:
    """0-2 faint, long, near-horizontal lines: normal variation, not defects."""
    yy, xx = _grid(size)
    shade = np.zeros((size, size))
    for _ in range(int(rng.integers(0, 3))):
        y0 = rng.uniform(0, size)
        slope = np.tan(np.deg2rad(rng.uniform(-1.5, 1.5)))
        width = rng.uniform(0.8, 2.0) * size / REFERENCE_SIZE
        dist = np.abs(yy - (y0 + slope * (xx - size / 2)))
        shade += rng.choice([-1.0, 1.0]) * rng.uniform(0.02, 0.035) * np.exp(-(dist / width) ** 2)
    return shade


def make_surface(rng: np.random.Generator, size: int) -> Array:
    """A clean (noise-free) textured metal surface, float RGB in [0, 1], shape (size, size, 3)."""
    scale = size / REFERENCE_SIZE
    shade = _sinusoids(rng, size)
    shade += 0.022 * _streaks(rng, size, max(4, int(40 * scale)))
    shade += 0.018 * _upsample_noise(rng, 6, size)
    shade += _polish_marks(rng, size)
    shade += _illumination(rng, size)
    colour = BASE_COLOUR * (1.0 + rng.uniform(-0.03, 0.03)) + rng.uniform(-0.01, 0.01, 3)
    return colour[None, None, :] * (1.0 + shade[..., None])


def add_sensor_noise(rng: np.random.Generator, img: Array) -> Array:
    """Mild per-pixel sensor noise, the same on all channels (keeps the PNGs small)."""
    h, w, _ = img.shape
    return img + rng.normal(0.0, SENSOR_NOISE, (h, w, 1))


def to_uint8(img: Array) -> Array:
    """Float [0, 1] image to uint8 with rounding and clipping."""
    return np.clip(np.rint(img * 255.0), 0, 255).astype(np.uint8)


# --------------------------------------------------------------------------- shapes


def _blob_shape(rng: np.random.Generator, size: int, centre: tuple[float, float],
                radius: float, wobble: float, soft: float) -> Array:
    """Soft irregular blob: coverage in [0, 1], 0.5 on the (wobbly) boundary."""
    yy, xx = _grid(size)
    dy, dx = yy - centre[0], xx - centre[1]
    dist = np.hypot(dy, dx)
    angle = np.arctan2(dy, dx)
    r = np.full_like(dist, radius)
    for k in (2, 3, 5):
        r += radius * wobble / k * np.sin(k * angle + rng.uniform(0, 2 * np.pi))
    t = np.clip((r - dist) / soft + 0.5, 0.0, 1.0)
    return t * t * (3 - 2 * t)  # smoothstep keeps 0.5 at the boundary


def _curve_points(rng: np.random.Generator, size: int, length: float) -> Array:
    """A smooth random curve of about `length` px, as (n, 2) points (y, x) inside the image."""
    margin = 0.1 * size
    for _ in range(100):
        step = 0.5
        n = int(length / step)
        heading = rng.uniform(0, 2 * np.pi)
        total_turn = rng.uniform(-1.0, 1.0) * np.pi / 3  # bends by at most 60 degrees
        wiggle = np.cumsum(rng.normal(0.0, 0.012, n))  # small slow wander of the heading
        headings = heading + np.linspace(0.0, total_turn, n) + wiggle - wiggle[0]
        pts = np.cumsum(np.stack([np.sin(headings), np.cos(headings)], 1) * step, 0)
        start = rng.uniform(margin, size - margin, 2)
        pts = pts + start
        if pts.min() >= margin / 2 and pts.max() <= size - margin / 2:
            return pts
    raise RuntimeError("could not place a curve inside the image")


def _stroke_shape(size: int, pts: Array, width: float) -> Array:
    """Anti-aliased coverage of a polyline of `width` px; 0.5 at distance width/2."""
    cover = np.zeros((size, size))
    pad = int(np.ceil(width)) + 2
    y0, x0 = np.maximum(np.floor(pts.min(0)).astype(int) - pad, 0)
    y1, x1 = np.minimum(np.ceil(pts.max(0)).astype(int) + pad + 1, size)
    yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float64)
    dist = np.full(yy.shape, np.inf)
    for chunk in np.array_split(pts, max(1, len(pts) // 64)):
        d = np.hypot(yy[..., None] - chunk[:, 0], xx[..., None] - chunk[:, 1]).min(-1)
        dist = np.minimum(dist, d)
    cover[y0:y1, x0:x1] = np.clip(width / 2 - dist + 0.5, 0.0, 1.0)
    return cover


def _polygon_shape(rng: np.random.Generator, size: int, centre: tuple[float, float],
                   radius: float) -> Array:
    """Anti-aliased coverage (4x supersampled) of a random star-shaped polygon."""
    ss = 4
    n = int(rng.integers(5, 10))
    angles = (np.arange(n) + rng.uniform(-0.3, 0.3, n)) * 2 * np.pi / n + rng.uniform(0, 2 * np.pi)
    radii = radius * rng.uniform(0.65, 1.0, n)
    ys = (centre[0] + radii * np.sin(angles)) * ss
    xs = (centre[1] + radii * np.cos(angles)) * ss
    canvas = Image.new("L", (size * ss, size * ss), 0)
    ImageDraw.Draw(canvas).polygon(list(zip(xs.tolist(), ys.tolist())), fill=255)
    small = canvas.resize((size, size), Image.Resampling.BOX)
    return np.asarray(small, dtype=np.float64) / 255.0


def _centre(rng: np.random.Generator, size: int, radius: float) -> tuple[float, float]:
    """A random centre keeping a disc of `radius` (plus a margin) inside the image."""
    lo, hi = radius + 0.05 * size, size - radius - 0.05 * size
    y, x = rng.uniform(lo, hi, 2)
    return float(y), float(x)


# --------------------------------------------------------------------------- defects


def add_scratch(rng: np.random.Generator, img: Array) -> Array:
    """1-2 thin dark or bright curved lines; returns the coverage (alpha) map."""
    size, scale = img.shape[0], img.shape[0] / REFERENCE_SIZE
    alpha = np.zeros(img.shape[:2])
    for _ in range(int(rng.integers(1, 3))):
        pts = _curve_points(rng, size, rng.uniform(40, 120) * scale)
        cover = _stroke_shape(size, pts, rng.uniform(2.0, 4.0) * scale)
        if rng.random() < 0.5:  # dark groove
            target = img * rng.uniform(0.35, 0.5)
        else:  # bright, freshly exposed metal
            target = np.full_like(img, rng.uniform(0.92, 0.98))
        img[:] = img * (1 - cover[..., None]) + target * cover[..., None]
        alpha = np.maximum(alpha, cover)
    return alpha


def add_spot(rng: np.random.Generator, img: Array) -> Array:
    """1-2 small dark irregular blobs (radius 6-15 px); returns the coverage map."""
    size, scale = img.shape[0], img.shape[0] / REFERENCE_SIZE
    alpha = np.zeros(img.shape[:2])
    for _ in range(int(rng.integers(1, 3))):
        radius = rng.uniform(6, 15) * scale
        shape = _blob_shape(rng, size, _centre(rng, size, radius), radius, 0.25, 1.5 * scale)
        dark = np.array([0.10, 0.09, 0.08]) * rng.uniform(0.8, 1.5)
        strength = shape * rng.uniform(0.8, 0.95)
        img[:] = img * (1 - strength[..., None]) + dark * strength[..., None]
        alpha = np.maximum(alpha, shape)
    return alpha


def add_missing(rng: np.random.Generator, img: Array) -> Array:
    """A polygonal chunk (20-40 px) replaced by a flat background colour; returns coverage."""
    size, scale = img.shape[0], img.shape[0] / REFERENCE_SIZE
    radius = rng.uniform(10, 20) * scale
    shape = _polygon_shape(rng, size, _centre(rng, size, radius), radius)
    if rng.random() < 0.5:
        background = np.array([0.16, 0.17, 0.19]) * rng.uniform(0.8, 1.2)  # dark carrier
    else:
        background = np.array([0.86, 0.84, 0.78]) * rng.uniform(0.95, 1.05)  # light table
    img[:] = img * (1 - shape[..., None]) + background * shape[..., None]
    return shape


def add_stain(rng: np.random.Generator, img: Array) -> Array:
    """A soft translucent brownish or bluish blob (radius 15-30 px); returns coverage."""
    size, scale = img.shape[0], img.shape[0] / REFERENCE_SIZE
    radius = rng.uniform(15, 30) * scale
    shape = _blob_shape(rng, size, _centre(rng, size, radius), radius, 0.3, 6.0 * scale)
    if rng.random() < 0.5:
        tint = np.array([0.95, 0.70, 0.40])  # rust / oil brown
    else:
        tint = np.array([0.55, 0.72, 1.05])  # bluish residue
    opacity = rng.uniform(0.45, 0.7) * (0.8 + 0.2 * np.tanh(_upsample_noise(rng, 5, size)))
    strength = (opacity * shape)[..., None]
    img[:] = img * (1 - strength) + img * tint * strength
    return shape


DEFECT_FUNCS: dict[str, Callable[[np.random.Generator, Array], Array]] = {
    "scratch": add_scratch,
    "spot": add_spot,
    "missing": add_missing,
    "stain": add_stain,
}


# --------------------------------------------------------------------------- images & files


def render(seed: int, size: int, defect: str | None) -> tuple[Array, Array | None]:
    """One image (uint8 RGB) and, for a defect, its mask (uint8, 0 or 255)."""
    rng = np.random.default_rng(seed)
    img = make_surface(rng, size)
    mask = None
    if defect is not None:
        alpha = DEFECT_FUNCS[defect](rng, img)
        mask = np.where(alpha >= 0.5, 255, 0).astype(np.uint8)
    img = add_sensor_noise(rng, img)
    return to_uint8(img), mask


def plan(seed: int) -> list[Job]:
    """Every image to write, in a fixed order, each with its own sub-seed from `seed`."""
    groups: list[tuple[str, str | None, int]] = [("train/good", None, N_TRAIN_GOOD),
                                                 ("test/good", None, N_TEST_GOOD)]
    groups += [(f"test/{d}", d, N_PER_DEFECT) for d in DEFECTS]
    total = sum(n for _, _, n in groups)
    sub_seeds = np.random.default_rng(seed).integers(0, 2**63 - 1, total).tolist()
    jobs: list[Job] = []
    for folder, defect, n in groups:
        for i in range(n):
            mask_path = f"ground_truth/{defect}/{i:03d}_mask.png" if defect else None
            jobs.append(Job(f"{folder}/{i:03d}.png", mask_path, defect, sub_seeds[len(jobs)]))
    return jobs


def save_png(array: Array, path: Path) -> None:
    """Save uint8 array as PNG, no metadata, fixed compression (deterministic bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "RGB" if array.ndim == 3 else "L"
    Image.fromarray(array, mode=mode).save(path, format="PNG", compress_level=6)


def generate(out: Path, seed: int = 0, size: int = REFERENCE_SIZE) -> list[Job]:
    """Write the whole dataset into `out` (which should not exist yet)."""
    jobs = plan(seed)
    for job in jobs:
        image, mask = render(job.seed, size, job.defect)
        save_png(image, out / job.image_path)
        if job.mask_path is not None and mask is not None:
            save_png(mask, out / job.mask_path)
    return jobs


def _is_nonempty_dir(path: Path) -> bool:
    """True if `path` is a directory with at least one entry."""
    return path.is_dir() and any(path.iterdir())


def write_dataset(out: Path, seed: int, size: int, force: bool) -> None:
    """Generate into a temporary sibling folder, then move it into place atomically-ish."""
    out = out.resolve()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if _is_nonempty_dir(out) and not force:
        raise FileExistsError(f"{out} is not empty; use --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        generate(tmp, seed, size)
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def summary(out: Path) -> str:
    """Counts of PNG files per folder and the total size in MB."""
    lines = []
    total = 0
    for folder in sorted({p.parent for p in out.rglob("*.png")}):
        files = sorted(folder.glob("*.png"))
        total += sum(f.stat().st_size for f in files)
        lines.append(f"  {folder.relative_to(out).as_posix():<24} {len(files):4d} files")
    lines.append(f"  total: {total / 1e6:.2f} MB in {out}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/sample"),
                        help="output folder (default: data/sample)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--size", type=int, default=REFERENCE_SIZE,
                        help="image side in px (default: 256)")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing non-empty output folder")
    args = parser.parse_args(argv)
    if args.size < 64:
        parser.error("--size must be at least 64")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: generate the dataset and print a summary; 1 if the output exists."""
    args = parse_args(argv)
    try:
        write_dataset(args.out, args.seed, args.size, args.force)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote synthetic dataset (seed={args.seed}, size={args.size}):")
    print(summary(args.out.resolve()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
