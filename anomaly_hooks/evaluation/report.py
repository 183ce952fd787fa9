"""A static HTML report of an evaluation: per test image the image, its ground truth, the
heatmap overlay and the predicted mask side by side; ROC and PRO curves as PNGs."""
from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import numpy as np
from PIL import Image

from anomaly_hooks.images import read_image
from anomaly_hooks.visualize import colorize, overlay, to_uint8_rgb

if TYPE_CHECKING:  # pragma: no cover
    from anomaly_hooks.evaluation.datasets import Sample
    from anomaly_hooks.prediction import Prediction

THUMB = 256  # longest side of the report pictures, in pixels


def _thumb(array: np.ndarray, path: Path) -> None:
    img = Image.fromarray(array)
    scale = THUMB / max(img.size)
    if scale < 1:
        size = (max(1, round(img.size[0] * scale)), max(1, round(img.size[1] * scale)))
        img = img.resize(size, Image.NEAREST if array.dtype == bool else Image.BILINEAR)
    img.save(path)


def _mark_operating_point(ax: Any, far: float, recall: float, target: Optional[float],
                          interval: Optional[List[float]]) -> None:
    """The stored threshold on the ROC: a dot at its measured (false-alarm rate, recall) on the
    test images, and (tail-model thresholds) the false-alarm rate asked for as a dotted line
    with its bootstrap interval shaded."""
    if interval is not None:
        ax.axvspan(interval[0], interval[1], color="tab:orange", alpha=0.15, lw=0)
    if target is not None:
        ax.axvline(target, color="tab:orange", ls=":", lw=1,
                   label=f"asked-for false-alarm rate {100 * target:.3g} %")
    ax.plot([far], [recall], "o", color="tab:red", ms=6,
            label=f"stored threshold: FAR {100 * far:.1f} %, recall {100 * recall:.1f} %")
    ax.legend(loc="lower right", fontsize=7)


def describe_framing(framing: Optional[Dict[str, Any]]) -> str:
    """One line on what the model looked at: the working frame and tiles of a tiled model, or
    the resize and crop; and the part of every image never inspected."""
    if not framing:
        return ""
    cut = f"{100 * framing.get('uninspected_fraction', 0.0):.1f} % of every image not inspected"
    if framing.get("mode") == "tiled":
        tiles = framing["tiles"]
        return (f"Framing: tiled, content {framing['content'][0]} x {framing['content'][1]} in a "
                f"{framing['size'][0]} x {framing['size'][1]} frame, "
                f"{tiles['tiles'][0]} x {tiles['tiles'][1]} tiles of {tiles['tile'][0]} x "
                f"{tiles['tile'][1]} (each feature with >= {tiles['min_margin']} px of context); "
                + cut)
    crop = framing.get("crop")
    return (f"Framing: resize {framing['resize'][0]} x {framing['resize'][1]}"
            + (f", centre crop {crop[0]} x {crop[1]}" if crop else "") + f"; {cut}")


class ReportWriter:
    """Collects pictures while the test set is scored, then writes ``index.html``."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        (self.out / "img").mkdir(parents=True, exist_ok=True)
        self.rows: List[Dict[str, Any]] = []

    def add(self, sample: "Sample", pred: "Prediction",
            gt: Optional[np.ndarray]) -> Dict[str, str]:
        """Write the four pictures of one test image; returns their paths (relative)."""
        n = len(self.rows)
        image = to_uint8_rgb(read_image(sample.path).numpy())
        heat = colorize(pred.heatmap, vmin=0.0, vmax=2.0 * pred.threshold)
        pics = {"image": image, "overlay": overlay(image, heat, mask=pred.mask),
                "predicted_mask": pred.mask.astype(np.uint8) * 255}
        if gt is not None:
            pics["ground_truth"] = gt.astype(np.uint8) * 255
        files: Dict[str, str] = {}
        for kind, array in pics.items():
            rel = f"img/{n:04d}_{kind}.png"
            _thumb(array, self.out / rel)
            files[kind] = rel
        self.rows.append({"sample": sample, "score": pred.score, "verdict": pred.is_anomalous,
                          "files": files})
        return {"report_" + k: str(self.out / v) for k, v in files.items()}

    def finish(self, summary: Dict[str, Any], curves: Dict[str, Any]) -> Path:
        """Plot ``curves`` (``roc``, ``pro``: ``(x, y)`` arrays) and write the HTML page with
        the ``summary`` metrics; returns the page's path."""
        pictures = self._plot_curves(curves)
        page = self.out / "index.html"
        page.write_text(self._html(summary, pictures), encoding="utf-8")
        return page

    def _plot_curves(self, curves: Dict[str, Any]) -> List[str]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        written = []
        specs = {"roc": ("false positive rate", "true positive rate", "image ROC", None),
                 "pro": ("false positive rate", "per-region overlap", "PRO curve", 0.3)}
        for name, (xlabel, ylabel, title, limit) in specs.items():
            if name not in curves:
                continue
            x, y = curves[name]
            fig, ax = plt.subplots(figsize=(4, 4), dpi=100)
            ax.plot(x, y, lw=1.5)
            if limit is not None:
                ax.axvline(limit, color="grey", ls="--", lw=1)
            if name == "roc" and "roc_point" in curves:
                _mark_operating_point(ax, *curves["roc_point"])
            ax.set(xlabel=xlabel, ylabel=ylabel, title=title, xlim=(0, 1), ylim=(0, 1.02))
            fig.tight_layout()
            fig.savefig(self.out / f"{name}.png")
            plt.close(fig)
            written.append(f"{name}.png")
        return written

    def _html(self, summary: Dict[str, Any], curves: List[str]) -> str:
        esc = html.escape
        metrics = "".join(
            f"<tr><th>{esc(k)}</th><td>{v:.4f}</td></tr>" if isinstance(v, float)
            else f"<tr><th>{esc(k)}</th><td>{esc(str(v))}</td></tr>"
            for k, v in summary.items()
            if k not in ("config", "threshold_scores", "fit_timings", "framing"))
        imgs = "".join(f'<img src="{c}" alt="{c}">' for c in curves)
        body = []
        for row in sorted(self.rows, key=lambda r: -r["score"]):
            s, files = row["sample"], row["files"]
            cells = []
            for kind in ("image", "ground_truth", "overlay", "predicted_mask"):
                cells.append(f'<td><img src="{files[kind]}" loading="lazy"></td>' if kind in files
                             else "<td>no mask</td>")
            verdict = "anomalous" if row["verdict"] else "normal"
            body.append(f"<tr><td>{esc(s.path.name)}<br>{esc(s.defect)}<br>score "
                        f"{row['score']:.4g}<br><b>{verdict}</b></td>{''.join(cells)}</tr>")
        return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{esc(str(summary.get('dataset')))} report</title>
<style>body{{font-family:sans-serif}} td,th{{padding:4px;vertical-align:top;text-align:left}}
img{{max-width:256px}} table.m td{{font-family:monospace}}</style></head>
<body><h1>{esc(str(summary.get('dataset')))}: {esc(str(summary.get('method')))}</h1>
<table class="m">{metrics}</table>
<p>{esc(describe_framing(summary.get("framing")))}</p>
<p>{imgs}</p>
<h2>Test images (highest score first)</h2>
<table><tr><th>image</th><th>input</th><th>ground truth</th><th>heatmap overlay</th>
<th>predicted mask</th></tr>
{''.join(body)}
</table></body></html>
"""
