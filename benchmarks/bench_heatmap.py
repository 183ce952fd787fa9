"""The heatmap pipeline: ``heatmap.anomaly_maps`` (two matrix products with the cached axis
operators) against the reference operations it is built from (float32 bilinear upsampling,
then ``gaussian_blur``'s two 1-d convolutions), in one run: the time of each on a batch of
maps, their largest difference; with ``--fit``, a fit's ``threshold`` step (the out-of-sample
image scores go through the heatmap pipeline) with each form, alternated.

    python benchmarks/bench_heatmap.py                                   # 32 maps 56x56 -> 224x224
    python benchmarks/bench_heatmap.py --fit ../shared/data/visa_macaroni1/train/good \\
        --config configs/padim_effnet_lite0.yaml device=cpu

The ``--fit`` comparison swaps the detector's ``anomaly_maps`` for the convolution form for
the fits labelled ``conv`` (the only way to time the old step in the same run); everything else
in the fit is the same code.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.measure import machine, timed_repeats, write_json  # noqa: E402


def conv_maps(patch_scores: torch.Tensor, size: Sequence[int], sigma: float = 4.0
              ) -> torch.Tensor:
    """The reference operations in float32: bilinear upsampling, then the convolution blur."""
    from anomaly_hooks.heatmap import gaussian_blur

    up = F.interpolate(patch_scores.unsqueeze(1).float(), size=tuple(size), mode="bilinear",
                       align_corners=False).squeeze(1)
    return gaussian_blur(up, sigma)


def time_maps(batch: int, grid: Sequence[int], size: Sequence[int], repeats: int
              ) -> Dict[str, Any]:
    """Median ms of each form on ``batch`` random maps (values up to 85, a PaDiM score's
    range), the ratio and the largest absolute difference."""
    from anomaly_hooks.heatmap import anomaly_maps

    patch = 85 * torch.rand(batch, *grid, generator=torch.Generator().manual_seed(0))
    conv = timed_repeats(lambda: conv_maps(patch, size), repeats)
    mat = timed_repeats(lambda: anomaly_maps(patch, size), repeats)
    diff = float((anomaly_maps(patch, size) - conv_maps(patch, size)).abs().max())
    return {"maps": batch, "grid": list(grid), "size": list(size),
            "conv_ms": 1e3 * conv.median, "matmul_ms": 1e3 * mat.median,
            "speedup": conv.median / mat.median, "max_abs_diff": diff,
            "max_value": float(conv_maps(patch, size).abs().max())}


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
    p.add_argument("--fit", metavar="FOLDER", help="also time fits on these good images")
    p.add_argument("--config", default="configs/padim_effnet_lite0.yaml")
    p.add_argument("--fits", type=int, default=2, help="rounds of (conv, matmul) fits")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for --fit")
    args = p.parse_args(argv)
    out: Dict[str, Any] = {"machine": machine(),
                           "maps": time_maps(args.maps, args.grid, args.size, args.repeats)}
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
