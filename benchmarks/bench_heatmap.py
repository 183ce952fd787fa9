"""The heatmap pipeline: ``heatmap.anomaly_maps`` (two matrix products with the cached axis
operators) against the reference operations it is built from (float32 bilinear upsampling,
then ``gaussian_blur``'s two 1-d convolutions) and against the same products as broadcasting
``[H, h] @ [B, h, w]`` (``heatmap.apply_operators``, the exported graph's form), in one run:
the time of each on a batch of maps, their largest difference; ``--beside-busy N`` runs the
same beside N other torch processes doing matrix products without end (another service
replica or a fit on the same cores); with
``--fit``, a fit's ``threshold`` step (the out-of-sample image scores go through the heatmap
pipeline) with each form, alternated.

    python benchmarks/bench_heatmap.py                                   # 32 maps 56x56 -> 224x224
    python benchmarks/bench_heatmap.py --beside-busy 2
    python benchmarks/bench_heatmap.py --fit ../shared/data/visa_macaroni1/train/good \\
        --config configs/padim_effnet_lite0.yaml device=cpu

The ``--fit`` comparison swaps the detector's ``anomaly_maps`` for the convolution form for
the fits labelled ``conv`` (the only way to time the old step in the same run); everything else
in the fit is the same code.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.measure import machine, timed_repeats, write_json  # noqa: E402


def conv_maps(patch_scores: torch.Tensor, size: Sequence[int], sigma: float = 4.0
              ) -> torch.Tensor:
    """The reference operations in float32 (``heatmap.reference_maps``): bilinear upsampling,
    then the convolution blur."""
    from anomaly_hooks.heatmap import reference_maps

    return reference_maps(patch_scores, size, sigma)


def time_maps(batch: int, grid: Sequence[int], size: Sequence[int], repeats: int
              ) -> Dict[str, Any]:
    """Median and mean ms of each form on ``batch`` random maps (values up to 85, a PaDiM score's
    range), given contiguous and as a strided view (the layout of the fit's out-of-sample
    scores, a transposed ``[h * w, n]`` buffer); the largest absolute difference."""
    from anomaly_hooks.heatmap import anomaly_maps, apply_operators, heatmap_operators

    buffer = 85 * torch.rand(grid[0] * grid[1], batch, generator=torch.Generator().manual_seed(0))
    layouts = {"strided": buffer.t().reshape(batch, *grid)}
    layouts["contiguous"] = layouts["strided"].contiguous()
    ops = heatmap_operators(grid, size)
    forms = {"conv": lambda p: conv_maps(p, size), "anomaly_maps": lambda p: anomaly_maps(p, size),
             "broadcast, no copy": lambda p: apply_operators(p, *ops)}
    out: Dict[str, Any] = {"maps": batch, "grid": list(grid), "size": list(size)}
    with torch.inference_mode():
        for layout, patch in layouts.items():
            for name, fn in forms.items():
                walls = timed_repeats(functools.partial(fn, patch), repeats).walls
                out[f"{name} ms ({layout})"] = 1e3 * statistics.median(walls)
                out[f"{name} mean ms ({layout})"] = 1e3 * statistics.mean(walls)
        patch = layouts["contiguous"]
        ref = conv_maps(patch, size)
        out["max_abs_diff"] = float((anomaly_maps(patch, size) - ref).abs().max())
        out["max_value"] = float(ref.abs().max())
    out["speedup"] = out["conv ms (contiguous)"] / out["anomaly_maps ms (contiguous)"]
    return out


# another torch process at work on the same cores (a second service replica, a fit): matrix
# products on torch's default intra-op threads, without end
BUSY = "import torch\na = torch.rand(512, 512)\nwhile True:\n    a @ a"


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` processes running :data:`BUSY` inside the block, stopped after it."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
    try:
        if procs:
            time.sleep(5)  # past their torch import: busy before the first timing
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def conv_form() -> Iterator[None]:
    """The detector's heatmap pipeline in the convolution form inside the block."""
    import anomaly_hooks.detector as detector_module

    saved = detector_module.anomaly_maps
    detector_module.anomaly_maps = conv_maps
    try:
        yield
    finally:
        detector_module.anomaly_maps = saved


def time_fits(config: str, data: str, overrides: List[str], fits: int) -> List[Dict[str, Any]]:
    """``fits`` rounds of a fit with each form (conv first), each fit's step timings and
    threshold."""
    from anomaly_hooks.config import load_config
    from anomaly_hooks.detector import Detector

    cfg = load_config(config, [*overrides, f"data.train={data}"])
    runs = []
    for _ in range(fits):
        for form in ("conv", "matmul"):
            with conv_form() if form == "conv" else contextlib.nullcontext():
                det = Detector(cfg).fit(cfg.data.train, progress=False)
            t = det.fit_timings_
            runs.append({"form": form, "threshold_s": t["threshold"], "total_s": t["total"],
                         "threshold": det.threshold_.value})
            print(json.dumps(runs[-1]), flush=True)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--maps", type=int, default=32, help="maps per call (default 32)")
    p.add_argument("--grid", type=int, nargs=2, default=(56, 56), help="h w (default 56 56)")
    p.add_argument("--size", type=int, nargs=2, default=(224, 224), help="H W (default 224 224)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--beside-busy", type=int, default=0, metavar="N",
                   help="time the maps beside N torch processes busy with matrix products")
    p.add_argument("--fit", metavar="FOLDER", help="also time fits on these good images")
    p.add_argument("--config", default="configs/padim_effnet_lite0.yaml")
    p.add_argument("--fits", type=int, default=2, help="rounds of (conv, matmul) fits")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for --fit")
    args = p.parse_args(argv)
    out: Dict[str, Any] = {"machine": machine()}
    with busy_processes(args.beside_busy):
        out["maps"] = time_maps(args.maps, args.grid, args.size, args.repeats)
    out["maps"]["beside_busy"] = args.beside_busy
    print(json.dumps(out["maps"]), flush=True)
    if args.fit:
        out["fits"] = time_fits(args.config, args.fit, args.overrides, args.fits)
    out["machine_after"] = machine()
    if args.json:
        write_json(args.json, out)
    print(json.dumps({"load_before": out["machine"]["load_avg"],
                      "load_after": out["machine_after"]["load_avg"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
