"""``anomaly-hooks serve`` / ``python -m anomaly_hooks.serve``: options and the uvicorn runner.

The options are defined here (imports nothing heavy), so that ``anomaly-hooks --help`` works
without the ``[serve]`` extra; FastAPI and uvicorn are imported when the command runs.
"""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields
from pathlib import Path
from typing import Optional, Sequence

from anomaly_hooks.errors import AnomalyHooksError, ConfigError
from anomaly_hooks.serve.settings import (
    KEEP_CHOICES,
    RESULTS_FILE,
    TOKEN_ENV,
    ServeSettings,
    parse_models,
)

DEFAULTS = {f.name: f.default for f in fields(ServeSettings)}
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--model", required=True, action="append", metavar="[NAME=]PATH",
                   help="model file written by fit, or an .onnx file written by export "
                   "(served by ONNX Runtime, without PyTorch); repeat as --model NAME=PATH to "
                   "serve several models (/v1/models/NAME/predict; the first is the default "
                   "model of the routes without a name)")
    p.add_argument("--host", default=d["host"],
                   help=f"address to bind (default {d['host']}: this machine only)")
    p.add_argument("--port", type=int, default=d["port"], help=f"default {d['port']}")
    p.add_argument("--device", help="cpu, cuda, auto (default: as saved in the model)")
    p.add_argument("--token", help=f"bearer token required on everything but /healthz and "
                   f"/readyz (default: the {TOKEN_ENV} environment variable; none = no auth, "
                   "and the admin routes are disabled)")
    p.add_argument("--models-dir", help="the folder POST /v1/admin/reload may load model files "
                   "from (default: the folder of --model); given, its model files are versions "
                   "(GET /v1/models/versions, POST /v1/admin/promote and /v1/admin/rollback)")
    g = p.add_argument_group("batching and limits")
    g.add_argument("--max-batch", type=int, default=d["max_batch"],
                   help=f"images per backbone batch (default {d['max_batch']})")
    g.add_argument("--max-wait-ms", type=_wait, default="auto",
                   help="how long a batch waits for more images after its first, in ms, or "
                   "auto: 5 %% of a full batch's measured time, 5-1000 ms (default auto)")
    g.add_argument("--max-queue", type=int, default=d["max_queue"],
                   help="images in progress at most; beyond it requests get 503 + Retry-After "
                   f"(default {d['max_queue']})")
    g.add_argument("--decode-workers", type=int, default=d["decode_workers"],
                   help=f"threads decoding uploads (default {d['decode_workers']})")
    g.add_argument("--max-upload-mb", type=float,
                   default=d["max_upload_bytes"] / 2**20,
                   help=f"upload size limit per image (default {d['max_upload_bytes'] >> 20})")
    g.add_argument("--max-batch-files", type=int, default=d["max_batch_files"],
                   help=f"images per batch request (default {d['max_batch_files']})")
    g.add_argument("--max-pixels", type=int, default=d["max_pixels"],
                   help=f"pixel limit per image (default {d['max_pixels']:,})")
    g.add_argument("--request-timeout", type=float, default=d["request_timeout_s"],
                   help="seconds a request may take once its head is read, its body included "
                   f"(default {d['request_timeout_s']:g})")
    c = p.add_argument_group("connections")
    c.add_argument("--header-timeout", type=float, default=d["header_timeout_s"],
                   help="seconds a connection has to send a complete request head, counted "
                   "from when it starts waiting for one; slow bytes do not extend it (default "
                   f"{d['header_timeout_s']:g})")
    c.add_argument("--idle-timeout", type=float, default=d["idle_timeout_s"],
                   help="seconds a connection waiting for a request may send nothing, a new "
                   f"one or a kept-alive one (default {d['idle_timeout_s']:g})")
    c.add_argument("--max-connections", type=int, default=d["max_connections"],
                   help="open connections at most; when reached, the one that has waited "
                   "longest for its request is closed to make room (0: no cap; default "
                   f"{d['max_connections']})")
    c.add_argument("--max-connections-per-client", type=int,
                   default=d["max_connections_per_client"],
                   help="open connections per client address (an IPv6 /64 counts as one), "
                   "same rule; behind a reverse proxy every client has the proxy's address: "
                   f"raise it or give 0 (no cap) (default {d['max_connections_per_client']})")
    r = p.add_argument_group("results log")
    r.add_argument("--results-dir", default=d["results_dir"],
                   help="folder of the results log (results.sqlite, unless --results-db) and "
                   f"kept pictures (default {d['results_dir']})")
    r.add_argument("--results-db", metavar="URL",
                   help="keep the results log in this database instead of results.sqlite in "
                   "--results-dir: postgresql://user@host:5432/dbname (the [postgres] extra; "
                   "several replicas may share one; give the password in PGPASSWORD or "
                   "~/.pgpass rather than in the URL) or sqlite:///path; kept pictures still go "
                   "under --results-dir")
    r.add_argument("--no-results", action="store_true", help="keep no results log")
    r.add_argument("--keep-images", choices=KEEP_CHOICES, default=d["keep_images"],
                   help=f"overlay and mask PNGs kept (default {d['keep_images']})")
    r.add_argument("--keep-originals", choices=KEEP_CHOICES, default=d["keep_originals"],
                   help="the uploaded images themselves, as sent, kept under --results-dir "
                   "(what `anomaly-hooks update --from-results` learns from: anomalous keeps "
                   "the images an operator may label as false alarms; all, every image); "
                   "removed with their result by the retention (default "
                   f"{d['keep_originals']})")
    r.add_argument("--keep-inputs", action="store_true",
                   help="beside each kept original, the network input the model computed "
                   "from it (4 x 3 x H x W bytes: 588 KiB at 224 x 224): an update from the "
                   "results reads it instead of decoding the image again")
    r.add_argument("--no-thumbnails", action="store_true",
                   help="no thumbnail per result (the page's list then shows none)")
    r.add_argument("--overlay-max-side", type=int, default=d["overlay_max_side"],
                   help=f"long side of overlays and masks (default {d['overlay_max_side']})")
    r.add_argument("--retention-days", type=float, help="delete results older than this")
    r.add_argument("--retention-count", type=int, help="keep only the newest N results")
    p.add_argument("--monitor", default="auto",
                   help="drift monitor factory, module:callable (called with the loaded "
                   "Detector); auto (default): anomaly_hooks.monitor when the model file has a "
                   "drift reference; none: no monitor (an .onnx model runs without one: "
                   "GET /v1/drift says why)")
    p.add_argument("--no-sighup", action="store_true", help="do not reload the model on SIGHUP")
    p.add_argument("--keep-heap", action="store_true",
                   help="keep freed memory in the C heap while serving (glibc): full batches "
                        "of a large backbone about 9 %% faster, the resident memory 10-15 %% "
                        "higher; ANOMALY_HOOKS_KEEP_HEAP=0 overrides it")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def _wait(text: str) -> Optional[float]:
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give milliseconds or auto") from None


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``serve`` on the main CLI's sub-parsers."""
    p = sub.add_parser("serve", help="run the HTTP inspection service (extra [serve])",
                       description="Serve a fitted model over HTTP: prediction API, results "
                       "log, operator page at /, Prometheus metrics at /metrics.")
    add_arguments(p)
    return p


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    values = args.model if isinstance(args.model, list) else [args.model]
    models = parse_models(values)
    return ServeSettings(
        model=next(iter(models.values())), models=models, host=args.host, port=args.port,
        device=args.device,
        token=args.token, models_dir=args.models_dir, max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms, max_queue=args.max_queue, decode_workers=args.decode_workers,
        max_upload_bytes=int(args.max_upload_mb * 2**20), max_batch_files=args.max_batch_files,
        max_pixels=args.max_pixels, request_timeout_s=args.request_timeout,
        header_timeout_s=args.header_timeout, idle_timeout_s=args.idle_timeout,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        results_dir=None if args.no_results else args.results_dir,
        results_db=_results_db(args),
        keep_images=args.keep_images, keep_originals=args.keep_originals,
        keep_inputs=args.keep_inputs, thumbnails=not args.no_thumbnails,
        overlay_max_side=args.overlay_max_side, retention_days=args.retention_days,
        retention_count=args.retention_count, monitor=args.monitor,
        sighup_reload=not args.no_sighup, keep_heap=args.keep_heap).validate()


def _results_db(args: argparse.Namespace) -> Optional[str]:
    """``--results-db``; a ConfigError beside ``--no-results`` (they contradict)."""
    if args.results_db is not None and args.no_results:
        raise ConfigError("--results-db and --no-results contradict each other: give one")
    return args.results_db


def run(args: argparse.Namespace) -> int:
    """Start the server; returns the exit code (2 when the model cannot be served)."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401

        _import_multipart()
    except ImportError as exc:
        print(f"error: the serve command needs the [serve] extra (missing {exc.name}): "
              "pip install 'anomaly_hooks[serve]'", file=sys.stderr)
        return 2
    settings = settings_from_args(args)
    preflight(settings)
    log = _logging(settings, args.log_level)

    from anomaly_hooks.serve.app import create_app
    from anomaly_hooks.serve.server import build_server, fit_open_files

    fatal: list = []
    server_box: list = []

    def on_fatal(message: str) -> None:
        fatal.append(message)
        if server_box:
            server_box[0].should_exit = True

    fit_open_files(settings)
    app = create_app(settings, on_fatal=on_fatal)
    server = build_server(app, settings, args.log_level)
    server_box.append(server)
    log.info("loading %s; the page will be at http://%s:%d/",
             ", ".join(f"{n}={p}" for n, p in (settings.models or {}).items())
             if len(settings.models or {}) > 1 else settings.model,
             settings.host if ":" not in settings.host else f"[{settings.host}]", settings.port)
    server.run()
    if fatal:
        print(f"error: {fatal[0]}", file=sys.stderr)
        return 2
    if not server.started:
        return 1
    return 0


def _import_multipart() -> None:
    """python-multipart, by its name since 0.0.13 (the old one warns) or the old one."""
    try:
        import python_multipart  # noqa: F401
    except ImportError:
        import multipart  # noqa: F401


def preflight(settings: ServeSettings) -> None:
    """Refuse now, before the server starts, what would stop it later: the model path, the
    drift-monitor factory, the results log (its folder a file, its file not a database, its
    database server unreachable...).
    Raises the library's errors (the CLI prints one ``error:`` line and exits 2)."""
    from anomaly_hooks.serve.modelpaths import check_model_file
    from anomaly_hooks.serve.monitoring import load_factory, monitor_enabled
    from anomaly_hooks.serve.results import CHECK_TIMEOUT_S, SQLiteResultStore
    from anomaly_hooks.serve.stores import open_store

    for path in (settings.models or {}).values():
        check_model_file(path)
    if monitor_enabled(settings.monitor):
        load_factory(settings.monitor)
    if settings.results_db:
        open_store(settings.results_db).close()  # reachable, schema created or upgraded
    elif settings.results_dir:
        # a log locked by another program is no reason to refuse (the service starts not
        # ready); the service's own open waits the busy timeout, so this one waits briefly
        SQLiteResultStore(Path(settings.results_dir) / RESULTS_FILE,
                          busy_timeout_s=CHECK_TIMEOUT_S).close()


def _logging(settings: ServeSettings, level: str) -> logging.Logger:
    """The service's logger at ``level``; warns about a public address without a token."""
    log = logging.getLogger("anomaly_hooks.serve")
    log.setLevel(getattr(logging, level.upper()))
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    if settings.host not in LOOPBACK and not settings.token:
        log.warning("binding to %s WITHOUT a token: anyone who can reach this address can use "
                    "the service; set --token or %s", settings.host, TOKEN_ENV)
    return log


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m anomaly_hooks.serve",
                                     description="the anomaly_hooks inspection service")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (AnomalyHooksError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
