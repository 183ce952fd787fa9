"""A static HTML report of an evaluation: per test image the image, its ground truth, the
heatmap overlay and the predicted mask side by side; ROC, PRO and operating curves as PNGs.

The operating curve is what an operator chooses a threshold from: false-alarm rate (on a
symmetric-log axis: linear below 1 %, so that zero shows) against recall, measured on the
evaluated test images and, where labelled defects set the threshold, as expected from the good
images' out-of-sample scores and those defects; the stored threshold is a dot where it lands
on the test images and a cross at its expected rates, with their 90 % intervals as error bars.
"""
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
    test images, and its expected false-alarm rate as a dotted line with its 90 % interval
    shaded."""
    if interval is not None:
        ax.axvspan(interval[0], interval[1], color="tab:orange", alpha=0.15, lw=0)
    if target is not None:
        ax.axvline(target, color="tab:orange", ls=":", lw=1,
                   label=f"expected false-alarm rate {100 * target:.3g} %")
    ax.plot([far], [recall], "o", color="tab:red", ms=6,
            label=f"stored threshold: FAR {100 * far:.1f} %, recall {100 * recall:.1f} %")
    ax.legend(loc="lower right", fontsize=7)


def plot_operating_curve(ax: Any, op: Dict[str, Any]) -> None:
    """The operating curve ``op`` (``curves["operating"]`` of the runner) on ``ax``."""
    x, y = op["test"]
    ax.step(x, y, where="post", lw=1.5, label=f"test images ({op['n_good']} good)")
    if op.get("calibration") is not None:
        cx, cy = op["calibration"]
        ax.step(cx, cy, where="post", lw=1, ls="--", color="tab:green",
                label=f"expected: good out-of-sample vs {op['n_defects_calibration']} labelled")
    far, recall = op["measured"]
    ax.plot([far], [recall], "o", color="tab:red", ms=6,
            label=f"stored ({op['objective']}) on test: FAR {100 * far:.1f} %, "
                  f"recall {100 * recall:.1f} %")
    e_far, e_rec = op["expected"]
    if e_far is not None and op.get("far_interval"):
        lo, hi = op["far_interval"]
        yv = e_rec if e_rec is not None else recall
        yerr = None
        if e_rec is not None and op.get("recall_interval"):
            rlo, rhi = op["recall_interval"]
            yerr = [[max(e_rec - rlo, 0)], [max(rhi - e_rec, 0)]]
        ax.errorbar([e_far], [yv], xerr=[[max(e_far - lo, 0)], [max(hi - e_far, 0)]], yerr=yerr,
                    fmt="x", color="tab:orange", capsize=3, ms=7,
                    label=f"expected: FAR {100 * e_far:.2g} % (90 %: {100 * lo:.2g}-"
                          f"{100 * hi:.2g} %)")
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("symlog", linthresh=0.01, linscale=0.5)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{100 * v:g} %"))
    ax.set(xlabel="false-alarm rate (good images flagged)", ylabel="recall (defects caught)",
           title="operating curve", xlim=(0, 1), ylim=(0, 1.02))
    ax.legend(loc="lower right", fontsize=6)


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

    def add(self, sample: "Sample", pred: "Prediction", gt: Optional[np.ndarray],
            used_for_threshold: bool = False, copy_of_training: bool = False
            ) -> Dict[str, str]:
        """Write the four pictures of one test image; returns their paths (relative).
        ``used_for_threshold``: one of the labelled defects that set the threshold;
        ``copy_of_training``: a byte copy of a training image."""
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
        self.rows.append({"sample": sample, "score": pred.score, "files": files,
                          "used": used_for_threshold, "copy": copy_of_training})
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
        if "operating" in curves:
            fig, ax = plt.subplots(figsize=(5, 4.5), dpi=100)
            plot_operating_curve(ax, curves["operating"])
            fig.tight_layout()
            fig.savefig(self.out / "operating.png")
            plt.close(fig)
            written.append("operating.png")
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
            if name == "roc" and "operating" in curves:
                op = curves["operating"]
                _mark_operating_point(ax, *op["measured"], op["expected"][0], op["far_interval"])
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
            if k not in ("config", "threshold_scores", "threshold_provenance",
                         "fit_timings", "framing"))
        imgs = "".join(f'<img src="{c}" alt="{c}">' for c in curves)
        body = []
        for row in sorted(self.rows, key=lambda r: -r["score"]):
            s, files = row["sample"], row["files"]
            cells = []
            for kind in ("image", "ground_truth", "overlay", "predicted_mask"):
                cells.append(f'<td><img src="{files[kind]}" loading="lazy"></td>' if kind in files
                             else "<td>no mask</td>")
            # the verdict at the stored threshold (it may have been set after the scoring)
            verdict = "anomalous" if row["score"] > summary["threshold"] else "normal"
            used = "<br><i>used for the threshold</i>" if row["used"] else ""
            used += "<br><i>a copy of a training image</i>" if row["copy"] else ""
            body.append(f"<tr><td>{esc(s.path.name)}<br>{esc(s.defect)}<br>score "
                        f"{row['score']:.4g}<br><b>{verdict}</b>{used}</td>"
                        f"{''.join(cells)}</tr>")
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
