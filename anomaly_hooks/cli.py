"""Command-line interface: ``anomaly-hooks fit|threshold|update|score|evaluate|layers|serve|export``
(also ``scripts/fit.py`` etc.).

Errors about the input (any :class:`AnomalyHooksError`, and ``OSError`` such as a missing or
unwritable path) print one ``error:`` line and exit with 2; anything else is a bug and shows its
traceback. torch is imported only inside the commands, after ``main`` has set up the process.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from anomaly_hooks.errors import AnomalyHooksError, ConfigError, DataError, ImageReadError
from anomaly_hooks.images import display
from anomaly_hooks.outputs import (
    expand_inputs,
    out_name,
    result_row,
    write_images,
    write_results,
)

log = logging.getLogger("anomaly_hooks")

USER_ERRORS = (AnomalyHooksError, OSError)


def _fit_parser(sub) -> None:
    p = sub.add_parser("fit", help="fit a model on a folder of good images")
    p.add_argument("--config", help="YAML config (configs/padim.yaml, configs/patchcore.yaml)")
    p.add_argument("--data", help="training folder (overrides data.train)")
    p.add_argument("--output", help="model path (overrides output)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--defects", help="folder of labelled defective images for the operating "
                                     "point (overrides threshold.defects)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    _format_option(p, "the model file")
    _ray_options(p)


def _threshold_parser(sub) -> None:
    p = sub.add_parser("threshold", help="choose a fitted model's threshold again, without "
                                         "refitting; print the trade-off table")
    p.add_argument("--model", required=True, help="model file written by fit")
    p.add_argument("--out", help="write the model with the new threshold here (without it: "
                                 "print the table only)")
    p.add_argument("--good", help="good images the model has not seen (new parts): their "
                                  "scores replace the fit's out-of-sample scores")
    p.add_argument("--defects", help="labelled defective images (default: those of an earlier "
                                     "choice, if any)")
    p.add_argument("--objective", choices=["far", "f1", "recall"],
                   help="far: a false-alarm rate from good images; f1: F1-max; recall: the "
                        "lowest false-alarm rate reaching --target-recall (default: as stored)")
    p.add_argument("--false-alarm-rate", type=float, help="objective far (default: as stored)")
    p.add_argument("--target-recall", type=float, help="objective recall (e.g. 0.9)")
    p.add_argument("--prevalence", type=float,
                   help="objective f1: the share of defective parts (default: the labelled "
                        "images as given)")
    p.add_argument("--tail", choices=["auto", "gumbel_upper", "gumbel", "empirical",
                                      "conformal"], help="objective far's rule (default auto)")
    p.add_argument("--device", help="cpu, cuda, auto (default: as saved)")
    _format_option(p)


def _format_option(p, what: str = "--out") -> None:
    p.add_argument("--format-version", type=int, choices=[1, 2, 3],
                   help=f"the model-file format {what} is written in (default 3, the newest); "
                        "1 or 2 for services of an anomaly_hooks before format 3 (a low-rank "
                        "PaDiM or kept embeddings need 2)")


def _update_parser(sub) -> None:
    p = sub.add_parser("update", help="update a fitted model with new good images (no refit "
                                      "on the old ones); write it to --out")
    p.add_argument("--model", required=True, help="model file written by fit (or update)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--good", nargs="+", metavar="DIR",
                     help="folders (or MVTec roots) of new good images")
    src.add_argument("--from-results", metavar="RESULTS",
                     help="the service's results log: its --results-dir, a results .sqlite "
                     "file or its postgresql:// URL; the kept original images of the results "
                     "labelled good are the new good images, those labelled defect the "
                     "threshold's labelled defects (the service keeps originals with "
                     "--keep-originals)")
    p.add_argument("--since", metavar="T", help="with --from-results: results recorded from "
                   "this time on (Unix seconds or ISO 8601, e.g. 2026-11-26T08:00:00Z)")
    p.add_argument("--until", metavar="T", help="with --from-results: results recorded before "
                   "this time")
    p.add_argument("--results-dir", metavar="DIR", help="with a postgresql:// --from-results: "
                   "the service's --results-dir, where it keeps the original images")
    p.add_argument("--out", required=True, help="the updated model's path (not --model's)")
    p.add_argument("--device", help="cpu, cuda, auto (default: as saved)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _format_option(p)


def _score_parser(sub) -> None:
    p = sub.add_parser("score", help="score images with a fitted model")
    p.add_argument("--model", required=True, help="model file written by fit, or an .onnx file "
                   "written by export (then scored without PyTorch)")
    p.add_argument("inputs", nargs="+", help="image files and/or folders")
    p.add_argument("--out", default="results", help="output folder (default: results)")
    p.add_argument("--device", help="cpu, cuda, auto (default: as saved)")
    p.add_argument("--no-images", action="store_true", help="only the CSV and JSON")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--no-drift", action="store_true",
                   help="do not run the drift monitor over the scored images")
    _ray_options(p)
    p.add_argument("--format", choices=["csv", "parquet"], default="csv",
                   help="with --ray: results.csv + results.json (default) or results.parquet")


def _ray_options(p) -> None:
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run on Ray (extra [ray]): a cluster's HOST:PORT or ray://HOST:PORT, "
                        "auto (started with `ray start`), local:N (N CPUs here); no ADDRESS: "
                        "$RAY_ADDRESS or a local cluster")
    p.add_argument("--workers", type=int, default=2, help="with --ray: actors (default 2)")
    p.add_argument("--gpus-per-worker", type=float, default=0,
                   help="with --ray: GPUs per actor (0 or 1; default 0)")


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
    kind = max(18, *(len(d.type) for d in rows))  # custom module classes have long names
    print(f"{'layer':<{width}}  {'type':<{kind}} {'output shape':<20} {'channels':>8} "
          f"{'stride':>6}  default for")
    for d in rows:
        print(f"{d.name:<{width}}  {d.type:<{kind}} {str(list(d.shape)):<20} "
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
    if args.defects:
        overrides.append(f"threshold.defects={args.defects}")
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
    if args.format_version is not None:  # before the fit: the config and the images decide
        det.check_format_version(args.format_version, train=cfg.data.train)
    _check_model_space(det, output)
    start = time.perf_counter()
    if args.ray is not None:
        from anomaly_hooks import distributed

        det = distributed.fit(cfg, cfg.data.train, address=args.ray or None,
                              num_workers=args.workers, gpus_per_worker=args.gpus_per_worker,
                              progress=not args.quiet)
    else:
        det.fit(cfg.data.train, progress=not args.quiet)
    seconds = time.perf_counter() - start
    path = det.save(cfg.output, format_version=args.format_version)
    info, thr = det.fit_info_, det.threshold_
    print(f"fitted {cfg.method} on {info['n_train']} images in {seconds:.1f} s "
          f"({info['n_train'] / max(seconds, 1e-9):.1f} img/s); threshold {thr.value:.4g} from "
          f"{thr.n_images} good images ({thr.describe()})")
    _print_threshold_details(thr)
    if info["skipped"]:
        print(f"skipped {len(info['skipped'])} unreadable image(s)")
    print(path)
    return 0


def _print_threshold_details(thr: Any) -> None:
    """How the good images were scored and the trade-off table of the stored threshold."""
    oos = ((thr.provenance or {}).get("good") or {}).get("out_of_sample")
    if oos:
        grouped = oos.get("grouped_images", 0)
        print(f"out-of-sample scores: {oos['scheme']}"
              + (f"; {grouped} images share a group ({oos.get('near_duplicate_pairs', 0)} "
                 "near-duplicate pairs)" if grouped else ""))
    if thr.scores and len(thr.scores) >= 3:
        from anomaly_hooks.operating import format_table

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            print(format_table(thr.trade_off()))


def cmd_threshold(args: argparse.Namespace) -> int:
    """Recalibrate a fitted model's threshold; print the table; write the new model file."""
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.modelfile import read_header

    for name in ("false_alarm_rate", "target_recall", "prevalence"):
        value = getattr(args, name)
        if value is not None and not 0.0 < value < (0.5 if name == "false_alarm_rate" else 1.0):
            raise ConfigError(f"--{name.replace('_', '-')}={value}: give a number in (0, "
                              f"{0.5 if name == 'false_alarm_rate' else 1})")
    if args.objective == "recall" and args.target_recall is None:
        raise ConfigError("--objective recall needs --target-recall (e.g. 0.9)")
    if args.format_version is not None and not args.out:
        raise ConfigError("--format-version goes with --out (the file it writes)")
    if args.out:
        out = Path(args.out)
        if out.is_dir():
            raise ConfigError(f"--out {display(out)} is a folder: give the model file's path")
        _writable_folder(out.parent, "--out folder")
    det = Detector.load(args.model, device=args.device)
    if args.format_version is not None:
        det.check_format_version(args.format_version)  # before the images are scored
    header = read_header(Path(args.model))["__metadata__"]
    parent = {"path": str(args.model), "checksum": header.get("checksum")}
    options = {k: getattr(args, k) for k in ("objective", "false_alarm_rate", "target_recall",
                                              "prevalence", "tail")
               if getattr(args, k) is not None}
    det.recalibrate(good=args.good, defects=args.defects, parent=parent, **options)
    thr = det.threshold_
    print(f"threshold {thr.value:.5g} from {thr.n_images} good images ({thr.describe()})")
    _print_threshold_details(thr)
    if args.out:
        print(det.save(args.out, format_version=args.format_version))
    else:
        print("nothing written: give --out M2 to write the model with this threshold")
    return 0


def cmd_update(args: argparse.Namespace) -> int:
    """Update a model with new good images; print what changed; write the new model file."""
    from anomaly_hooks.data import resolve_items
    from anomaly_hooks.detector import Detector
    from anomaly_hooks.modelfile import check_model_path, file_checksum
    from anomaly_hooks.monitor.fitting import describe_update

    check_model_path(args.model)
    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"--out {display(out)} is a folder: give the model file's path")
    if out.resolve() == Path(args.model).resolve() or (out.exists() and
                                                      os.path.samefile(out, args.model)):
        raise ConfigError(f"--out is the --model file ({display(out)}): write the updated "
                          "model to a new path (the parent stays as it was, for its lineage)")
    _writable_folder(out.parent, "--out folder")
    found = None
    if args.from_results is not None:
        from anomaly_hooks.learning import labelled_results

        found = labelled_results(args.from_results, since=args.since, until=args.until,
                                 pictures=args.results_dir)
        print(found.summary())
    else:
        if args.since or args.until or args.results_dir:
            raise ConfigError("--since, --until and --results-dir go with --from-results")
        items = [item for folder in args.good for item in resolve_items(folder, training=True)]
    det = Detector.load(args.model, device=args.device, for_update=True)
    if args.format_version is not None:
        det.check_format_version(args.format_version)  # before the update's work
    parent = file_checksum(args.model)
    old, old_reference = det.threshold_, det.drift_reference_
    start = time.perf_counter()
    if found is not None:
        items, defects = found.items(det.preprocessor)
        kept = found.kept_inputs
        if kept["read"] or kept["decoded"]:
            print(f"network inputs kept by the service: {kept['read']} read instead of "
                  f"decoding the image"
                  + (f", {kept['decoded']} made otherwise (another preprocessing or "
                     "library version: decoded)" if kept["decoded"] else ""))
        det.update(items, defects=defects or None, source=found.lineage_source(),
                   progress=not args.quiet)
    else:
        det.update(items, progress=not args.quiet)
    seconds = time.perf_counter() - start
    entry, thr = det.lineage_[-1], det.threshold_
    size = det.scorer_.summary()
    model = ", ".join(f"{k} {v}" for k, v in {"n_train": det.scorer_.n_train, **size}.items()
                      if k != "patches")
    print(f"added {entry['images_added']} images in {seconds:.1f} s: {model}")
    print(f"threshold {thr.value:.5g} (was {old.value:.5g}) from {thr.n_images} good images "
          f"({thr.describe()})")
    print(describe_update(old_reference, det.drift_reference_))
    if entry["labels_used"]:
        print(f"labelled defects used: {entry['labels_used']}")
    print(f"parent {parent}; updates in the lineage: {len(det.lineage_)}")
    print(det.save(out, format_version=args.format_version))
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
    if args.ray is not None:
        return _score_on_ray(args, out)
    det, max_pixels = _load_for_scoring(args.model, args.device)
    paths, roots, failures = expand_inputs(args.inputs)
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    rows, used = [], set()
    monitor = _score_monitor(det, args.no_drift)
    start = time.perf_counter()
    for i, pred in det.iter_predict(paths, batch_size=args.batch_size):
        path = paths[i]
        if isinstance(pred, ImageReadError):
            failures.append(str(pred))
            print(f"FAILED {pred}", file=sys.stderr)
            continue
        row = result_row(pred, path)
        if not args.no_images:
            row.update(write_images(pred, path, out, out_name(path, roots[i], used),
                                     max_pixels))
        rows.append(row)
        del pred
    write_results(out, rows, failures, args.model,
                  None if monitor is None else monitor.status())
    seconds = time.perf_counter() - start
    n_anom = sum(r["is_anomalous"] for r in rows)
    print(f"scored {len(rows)} image(s) in {seconds:.1f} s "
          f"({1000 * seconds / max(len(rows), 1):.0f} ms/image incl. writing PNGs): {n_anom} "
          f"anomalous, {len(rows) - n_anom} normal; {len(failures)} failed. Results in "
          f"{display(out)}/results.csv and {display(out)}/results.json")
    if monitor is not None:  # over the images in the order scored (folders sorted by name)
        print(monitor.summary())
    return 1 if failures else 0


def _score_on_ray(args: argparse.Namespace, out: Path) -> int:
    """``score --ray``: the same outputs, written by a pool of Ray actors."""
    from anomaly_hooks import distributed

    if args.device is not None:
        raise ConfigError("--device is not used with --ray: actors run on the CPU, or on a GPU "
                          "each with --gpus-per-worker 1")
    summary = distributed.score(args.model, args.inputs, str(out), address=args.ray or None,
                                num_workers=args.workers, gpus_per_worker=args.gpus_per_worker,
                                batch_size=args.batch_size, write_pngs=not args.no_images,
                                fmt=args.format)
    n, seconds = summary["scored"], summary["seconds"]
    print(f"scored {n} image(s) on {args.workers} Ray worker(s) in {seconds:.1f} s "
          f"({n / max(seconds, 1e-9):.1f} img/s): {summary['anomalous']} anomalous, "
          f"{n - summary['anomalous']} normal; {summary['failed']} failed. Results in "
          f"{display(out)}")
    return 1 if summary["failed"] else 0


def _score_monitor(det: Any, disabled: bool) -> Any:
    """The drift monitor ``score`` attaches (None with ``--no-drift``, or, with a note, for
    a model file that has no drift reference)."""
    if disabled:
        return None
    if getattr(det, "drift_unavailable", None):  # an exported model that cannot feed one
        print(f"drift: not monitored ({det.drift_unavailable})")
        return None
    if det.drift_reference_ is None:
        print("drift: not monitored (the model file has no drift reference; refit it to "
              "monitor drift)")
        return None
    return det.drift_monitor()


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
    p.add_argument("--threshold-defects", type=int, default=0, metavar="N",
                   help="a seeded draw of N defective test images per dataset sets the "
                        "operating point (threshold.objective); they are left out of every "
                        "metric")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")


def _eval_datasets(args: argparse.Namespace) -> list:
    from anomaly_hooks.evaluation.datasets import folders, open_dataset

    found = [open_dataset(d) for d in args.data]
    if args.good:
        found.append(folders(args.good, args.defect, args.masks))
    elif args.defect or args.masks:
        raise DataError("--defect/--masks need --good (the generic folder layout)")
    if not found:
        raise DataError("no dataset: give --data MVTEC_ROOT (repeatable) or "
                        "--good DIR --defect DIR")
    names = [d.name for d in found]
    if len(set(names)) != len(names):
        raise DataError(f"two datasets share a name {names}: rename a folder")
    return found


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Evaluate each dataset; print a table; write results.json/csv and the HTML reports."""
    from anomaly_hooks.config import load_config
    from anomaly_hooks.evaluation.runner import evaluate, format_table, write_results

    datasets = _eval_datasets(args)
    cfg = load_config(args.config, list(args.overrides))  # fail fast on a bad config
    if args.threshold_defects < 0:
        raise ConfigError(f"--threshold-defects {args.threshold_defects}: give a count >= 0")
    if (not args.threshold_defects and str(cfg.threshold.objective) != "far"
            and not cfg.threshold.defects):
        raise ConfigError(f"threshold.objective={cfg.threshold.objective} needs labelled "
                          "defects: --threshold-defects N or threshold.defects=DIR")
    out = Path(args.out)
    results = []
    for ds in datasets:
        report = None if args.no_report else out / ds.name / "report"
        res = evaluate(args.config, ds, args.overrides, report_dir=report,
                       progress=not args.quiet, threshold_defects=args.threshold_defects)
        results.append(res)
        if report is not None:
            print(f"{ds.name}: report {report / 'index.html'}")
    write_results(results, out)
    print(format_table(results))
    print(f"results in {out}/results.json and {out}/results.csv")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """The HTTP inspection service (anomaly_hooks.serve, extra [serve])."""
    from anomaly_hooks.serve.cli import run

    return run(args)


def cmd_export(args: argparse.Namespace) -> int:
    """Export a fitted model to ONNX (:mod:`anomaly_hooks.export.cli`)."""
    from anomaly_hooks.export.cli import cmd_export as run

    return run(args)


COMMANDS = {"fit": cmd_fit, "score": cmd_score, "evaluate": cmd_evaluate, "layers": cmd_layers,
            "serve": cmd_serve, "export": cmd_export, "threshold": cmd_threshold,
            "update": cmd_update}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="anomaly-hooks", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _fit_parser(sub)
    _threshold_parser(sub)
    _update_parser(sub)
    _score_parser(sub)
    _evaluate_parser(sub)
    _layers_parser(sub)
    from anomaly_hooks.serve.cli import add_parser as _serve_parser  # argparse only: light

    _serve_parser(sub)
    from anomaly_hooks.export.cli import add_parser as _export_parser  # torch-free: argparse only

    _export_parser(sub)
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
