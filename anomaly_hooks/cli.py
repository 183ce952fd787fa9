"""Command-line interface: ``anomaly-hooks fit|score|evaluate|layers|export ...`` (also
``scripts/fit.py`` etc.).

Errors about the input (any :class:`AnomalyHooksError`, and ``OSError`` such as a missing or
unwritable path) print one ``error:`` line and exit with 2; anything else is a bug and shows its
traceback. torch is imported only inside the commands, after ``main`` has set up the process.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import List, Optional, Sequence

from anomaly_hooks.errors import AnomalyHooksError, ConfigError, DataError, ImageReadError
from anomaly_hooks.images import display, is_folder, is_image_file

log = logging.getLogger("anomaly_hooks")

USER_ERRORS = (AnomalyHooksError, OSError)


def _fit_parser(sub) -> None:
    p = sub.add_parser("fit", help="fit a model on a folder of good images")
    p.add_argument("--config", help="YAML config (configs/padim.yaml, configs/patchcore.yaml)")
    p.add_argument("--data", help="training folder (overrides data.train)")
    p.add_argument("--output", help="model path (overrides output)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")


def _score_parser(sub) -> None:
    p = sub.add_parser("score", help="score images with a fitted model")
    p.add_argument("--model", required=True, help="model file written by fit, or an .onnx file "
                   "written by export (then scored without PyTorch)")
    p.add_argument("inputs", nargs="+", help="image files and/or folders")
    p.add_argument("--out", default="results", help="output folder (default: results)")
    p.add_argument("--device", help="cpu, cuda, auto (default: as saved)")
    p.add_argument("--no-images", action="store_true", help="only the CSV and JSON")
    p.add_argument("--batch-size", type=int, default=None)


def _layers_parser(sub) -> None:
    p = sub.add_parser("layers", help="list the layers of a backbone that can be tapped")
    p.add_argument("backbone", help="a torchvision model name (resnet18, wide_resnet50_2, ...) "
                                    "or efficientnet_lite0")
    p.add_argument("--input", type=int, nargs="+", default=[224], metavar="SIZE",
                   help="input size of the dry run: one int or HEIGHT WIDTH (default 224)")
    p.add_argument("--all", action="store_true",
                   help="also modules whose output is not a [B, C, H, W] map")


def cmd_layers(args: argparse.Namespace) -> int:
    """Print every tappable module of a backbone with its output shape, channels and stride."""
    import warnings

    from anomaly_hooks.backbones import build_backbone
    from anomaly_hooks.extractor import describe_layers
    from anomaly_hooks.scorers import registered

    if len(args.input) not in (1, 2) or min(args.input) < 8:
        raise ConfigError(f"--input {args.input}: give one size or HEIGHT WIDTH, each >= 8")
    size = (args.input[0], args.input[-1])
    with warnings.catch_warnings():  # random weights are fine for shapes
        warnings.simplefilter("ignore")
        model = build_backbone(args.backbone, None)
    defaults = {name: cls.layers_for(args.backbone) for name, cls in registered().items()}
    rows = [d for d in describe_layers(model, size, defaults) if args.all or d.tappable]
    width = max(len(d.name) for d in rows)
    print(f"{'layer':<{width}}  {'type':<18} {'output shape':<20} {'channels':>8} {'stride':>6}"
          "  default for")
    for d in rows:
        print(f"{d.name:<{width}}  {d.type:<18} {str(list(d.shape)):<20} "
              f"{'' if d.channels is None else d.channels:>8} "
              f"{'' if d.stride is None else d.stride:>6}  {', '.join(d.default_for)}")
    print(f"{len(rows)} modules at input {size[0]}x{size[1]}; tap them with "
          "backbone.layers=[name, ...] (names as listed)")
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    """Fit and save; print the model path."""
    from anomaly_hooks.config import load_config
    from anomaly_hooks.detector import Detector

    overrides = list(args.overrides)
    if args.data:
        overrides.append(f"data.train={args.data}")
    if args.output:
        overrides.append(f"output={args.output}")
    cfg = load_config(args.config, overrides)
    if not cfg.data.train:
        raise ConfigError("no training data: set data.train in the config or pass --data DIR")
    output = Path(cfg.output)
    if output.is_dir():
        raise ConfigError(f"output={display(output)} is a folder: give the model file's path")
    _writable_folder(output.parent, "output folder")
    det = Detector(cfg)
    _check_model_space(det, output)
    start = time.perf_counter()
    det.fit(cfg.data.train, progress=not args.quiet)
    seconds = time.perf_counter() - start
    path = det.save(cfg.output)
    info, thr = det.fit_info_, det.threshold_
    print(f"fitted {cfg.method} on {info['n_train']} images in {seconds:.1f} s "
          f"({info['n_train'] / max(seconds, 1e-9):.1f} img/s); threshold {thr.value:.4g} from "
          f"{thr.n_images} good images")
    if info["skipped"]:
        print(f"skipped {len(info['skipped'])} unreadable image(s)")
    print(path)
    return 0


def _check_model_space(det, output: Path) -> None:
    """Refuse before fitting when the output's file system has less free space than the model
    is estimated to need (the same estimate as the memory guard's)."""
    from anomaly_hooks.data import resolve_items
    from anomaly_hooks.resources import GB, estimate_fit_memory
    from anomaly_hooks.scorers import get_scorer

    cfg = det.cfg
    n_train = len(resolve_items(cfg.data.train, training=True))
    need = estimate_fit_memory(get_scorer(cfg.method), cfg, det.layer_info,
                               det.preprocessor.input_size, n_train)["model"]
    free = shutil.disk_usage(output.parent).free
    if need > free:
        raise DataError(f"output={display(output)}: the model needs about {need / GB:.3g} GB but "
                        f"only {free / GB:.3g} GB are free there: free space or write elsewhere")


def _walk_images(folder: Path) -> tuple[List[Path], List[str]]:
    """Image files under ``folder`` (sorted, symbolic links to folders not followed), and a
    failure for each entry with an image suffix that is not a regular file (a FIFO, device or
    socket is reported, never opened)."""
    found: List[Path] = []
    odd: List[str] = []

    def unreadable(exc: OSError) -> None:
        odd.append(f"{display(exc.filename or folder)}: cannot be read "
                   f"({exc.strerror or exc}); skipped")

    for root, dirs, files in os.walk(folder, onerror=unreadable):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            if not is_image_file(path):
                continue
            try:
                mode = path.stat().st_mode
            except OSError as exc:
                odd.append(f"{display(path)}: cannot be read ({exc.strerror})")
                continue
            if stat.S_ISREG(mode):
                found.append(path)
            else:
                odd.append(f"{display(path)}: not a regular file; skipped")
    return found, odd


def _expand_inputs(inputs: Sequence[str]) -> tuple[List[Path], List[Path], List[str]]:
    """(image paths, the input each came from, failures) of the command-line inputs."""
    paths: List[Path] = []
    roots: List[Path] = []
    errors: List[str] = []
    for raw in inputs:
        p = Path(raw)
        if is_folder(p):
            found, odd = _walk_images(p)
            errors.extend(odd)
            if not found and not odd:
                errors.append(f"{display(p)}: no image files in this folder")
            paths.extend(found)
            roots.extend([p] * len(found))
        else:
            paths.append(p)
            roots.append(p.parent)
    return paths, roots, errors


_NAME_BYTES = 150  # an output name's length in bytes (file systems allow 255)


def _clean_part(part: str) -> str:
    """One path component as a safe file-name piece: letters, digits, ``.-_`` (any script),
    everything else (separators, spaces, control characters, undecodable bytes) ``_``; no
    leading dot (no hidden file, no ``..``)."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in part)
    cleaned = cleaned.lstrip(".")
    return cleaned or "_"


def out_name(path: Path, root: Path, used: set) -> str:
    """The output name of ``path``: its path relative to the input ``root`` it was found under
    (a file given directly: its own name), suffix dropped, components cleaned and joined by
    ``_``; never absolute, never ``..``, never empty; at most :data:`_NAME_BYTES` bytes (a long
    name keeps a hash of the whole); unique within ``used`` (compared case-insensitively, as
    some file systems do), which it updates."""
    try:
        rel = path.relative_to(root)
    except ValueError:
        rel = Path(path.name)
    parts = [*rel.parent.parts, rel.stem if rel.suffix else rel.name]
    stem = "_".join(_clean_part(p) for p in parts if p not in ("", ".", "..", os.sep)) or "_"
    if len(stem.encode("utf-8")) > _NAME_BYTES:
        digest = hashlib.sha256(os.fsencode(rel)).hexdigest()[:12]
        stem = stem.encode("utf-8")[:_NAME_BYTES - 13].decode("utf-8", "ignore") + "-" + digest
    name, i = stem, 1
    while name.casefold() in used:
        i += 1
        name = f"{stem}_{i}"
    used.add(name.casefold())
    return name


def _write_images(pred, path: Path, out: Path, name: str, max_pixels: int) -> dict:
    from anomaly_hooks.images import canonical_rows, load_oriented
    from anomaly_hooks.visualize import write_pictures

    files = {"heatmap": out / "heatmaps" / f"{name}.png",
             "overlay": out / "overlays" / f"{name}.png",
             "mask": out / "masks" / f"{name}.png"}
    write_pictures(pred.heatmap, pred.mask, pred.threshold,
                   lambda: load_oriented(path, max_pixels), canonical_rows, files)
    return {k: str(v) for k, v in files.items()}


def _writable_folder(folder: Path, what: str) -> None:
    """Make ``folder`` (and its parents) and prove a file can be created in it, before any
    work: a path that is a file, a read-only place or a missing permission is one clear error
    now rather than after the work."""
    if folder.exists() and not folder.is_dir():
        raise DataError(f"{what} {display(folder)}: exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".write-test.", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise DataError(f"{what} {display(folder)}: cannot write there "
                        f"({exc.strerror or exc})") from None


def _load_for_scoring(model: str, device: Optional[str]):
    """(detector, max_pixels): an ``.onnx`` file runs in the torch-free runtime."""
    if Path(model).suffix.lower() == ".onnx":
        from anomaly_hooks.runtime import OnnxDetector

        det = OnnxDetector.load(model)
        return det, det.max_pixels
    from anomaly_hooks.detector import Detector

    det = Detector.load(model, device=device)
    return det, det.cfg.data.max_pixels


def cmd_score(args: argparse.Namespace) -> int:
    """Score images; write results.csv, results.json and PNGs; non-zero exit if any failed."""
    out = Path(args.out)
    for sub in ("", "heatmaps", "overlays", "masks"):
        _writable_folder(out / sub, "--out")
    det, max_pixels = _load_for_scoring(args.model, args.device)
    paths, roots, failures = _expand_inputs(args.inputs)
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    rows, used = [], set()
    start = time.perf_counter()
    for i, pred in det.iter_predict(paths, batch_size=args.batch_size):
        path = paths[i]
        if isinstance(pred, ImageReadError):
            failures.append(str(pred))
            print(f"FAILED {pred}", file=sys.stderr)
            continue
        row = {"path": display(path), "score": pred.score,
               "normalized_score": pred.normalized_score, "is_anomalous": pred.is_anomalous,
               "threshold": pred.threshold, "anomalous_pixels": int(pred.mask.sum())}
        if not args.no_images:
            row.update(_write_images(pred, path, out, out_name(path, roots[i], used),
                                     max_pixels))
        rows.append(row)
        del pred
    _write_results(out, rows, failures, args.model)
    seconds = time.perf_counter() - start
    n_anom = sum(r["is_anomalous"] for r in rows)
    print(f"scored {len(rows)} image(s) in {seconds:.1f} s "
          f"({1000 * seconds / max(len(rows), 1):.0f} ms/image incl. writing PNGs): {n_anom} "
          f"anomalous, {len(rows) - n_anom} normal; {len(failures)} failed. Results in "
          f"{display(out)}/results.csv and {display(out)}/results.json")
    return 1 if failures else 0


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value):
    """A CSV cell that a spreadsheet shows as text: a string starting with ``= + - @`` (or a
    tab / carriage return) would run as a formula, so it gets a leading ``'``. Numbers are
    written as they are."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def _atomic_text(path: Path, write) -> None:
    """Write a text file atomically: a temporary file in the same folder, flushed to disk,
    renamed over ``path``; a full disk leaves the previous file (or none), never half a file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_results(out: Path, rows: List[dict], failures: List[str], model: str) -> None:
    fields = ["path", "score", "normalized_score", "is_anomalous", "threshold",
              "anomalous_pixels", "heatmap", "overlay", "mask"]

    def write_csv(fh) -> None:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: csv_cell(v) for k, v in row.items()} for row in rows)

    _atomic_text(out / "results.csv", write_csv)
    _atomic_text(out / "results.json", lambda fh: json.dump(
        {"model": display(model), "results": rows, "failures": failures}, fh, indent=2))


def _evaluate_parser(sub) -> None:
    p = sub.add_parser("evaluate", help="fit on train/good, score the test set, print metrics")
    p.add_argument("--config", help="YAML config")
    p.add_argument("--data", action="append", default=[],
                   help="an MVTec AD layout root (repeat for several datasets)")
    p.add_argument("--good", help="generic layout: folder of good images (split into train/test)")
    p.add_argument("--defect", action="append", default=[],
                   help="generic layout: folder of defective images (repeatable)")
    p.add_argument("--masks", help="generic layout: folder of masks (optional)")
    p.add_argument("--out", default="eval_results", help="output folder (default: eval_results)")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report pictures")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")


def _eval_datasets(args: argparse.Namespace) -> list:
    from anomaly_hooks.evaluation.datasets import folders, open_dataset

    found = [open_dataset(d) for d in args.data]
    if args.good:
        found.append(folders(args.good, args.defect, args.masks))
    elif args.defect or args.masks:
        raise DataError("--defect/--masks need --good (the generic folder layout)")
    if not found:
        raise DataError("no dataset: give --data MVTEC_ROOT (repeatable) or --good DIR --defect DIR")
    names = [d.name for d in found]
    if len(set(names)) != len(names):
        raise DataError(f"two datasets share a name {names}: rename a folder")
    return found


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Evaluate each dataset; print a table; write results.json/csv and the HTML reports."""
    from anomaly_hooks.config import load_config
    from anomaly_hooks.evaluation.runner import evaluate, format_table, write_results

    datasets = _eval_datasets(args)
    load_config(args.config, list(args.overrides))  # fail fast on a bad config
    out = Path(args.out)
    results = []
    for ds in datasets:
        report = None if args.no_report else out / ds.name / "report"
        res = evaluate(args.config, ds, args.overrides, report_dir=report,
                       progress=not args.quiet)
        results.append(res)
        if report is not None:
            print(f"{ds.name}: report {report / 'index.html'}")
    write_results(results, out)
    print(format_table(results))
    print(f"results in {out}/results.json and {out}/results.csv")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Export a fitted model to ONNX (:mod:`anomaly_hooks.export.cli`)."""
    from anomaly_hooks.export.cli import cmd_export as run

    return run(args)


COMMANDS = {"fit": cmd_fit, "score": cmd_score, "evaluate": cmd_evaluate, "layers": cmd_layers,
            "export": cmd_export}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="anomaly-hooks", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _fit_parser(sub)
    _score_parser(sub)
    _evaluate_parser(sub)
    _layers_parser(sub)
    from anomaly_hooks.export.cli import add_parser  # torch-free: argparse only

    add_parser(sub)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """``parse_args``, except that ``key=value`` overrides may also follow options
    (``fit a=1 --data D b=2``): argparse stops the positional list at the first option, so the
    later ones come back as unknown and are appended here, in order."""
    args, unknown = parser.parse_known_args(argv)
    late = [tok for tok in unknown if "=" in tok and not tok.startswith("-")]
    rest = [tok for tok in unknown if tok not in late]
    if rest or (late and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(rest or late)}")
    if late:
        args.overrides = [*args.overrides, *late]
    return args


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one ``warning:`` line (not Python's file:line and source line)."""
    print(f"warning: {message}", file=sys.stderr if file is None else file)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; user errors print one line (no traceback) and exit 2."""
    # Transparent huge pages for large CPU tensors: PyTorch reads this once, at its first
    # allocation, so it is set before any command imports torch. Multi-GB tensors (PaDiM sums
    # and factors, per-batch work buffers) are page-faulted 2 MB at a time instead of 4 kB.
    # THP_MEM_ALLOC_ENABLE=0 opts out.
    if "torch" not in sys.modules:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    args = _parse(build_parser(), argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return COMMANDS[args.command](args)
    except USER_ERRORS as exc:
        if args.verbose:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
