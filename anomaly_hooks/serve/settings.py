"""Settings of the inspection service (the ``anomaly-hooks serve`` options)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from typing import Dict, List, Optional, Sequence

from anomaly_hooks.errors import ConfigError

TOKEN_ENV = "ANOMALY_HOOKS_TOKEN"
KEEP_CHOICES = ("none", "anomalous", "all")
RESULTS_FILE = "results.sqlite"  # the results log, in --results-dir
DEFAULT_MODEL = "default"        # the name of the model of a plain --model PATH
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
RESERVED_NAMES = {"versions"}    # /v1/models/versions is the versions route


@dataclass
class ServeSettings:
    """Everything the service can be told. Defaults suit one CPU box on a production line."""

    model: str                             # the (first) model's file: the default model
    host: str = "127.0.0.1"
    port: int = 8000
    device: Optional[str] = None           # None = as saved in the model
    token: Optional[str] = None            # None = no auth (fine on loopback only), no admin
    models_dir: Optional[str] = None       # admin reloads load from here; None = --model's folder
    max_batch: int = 16                    # images per backbone batch
    max_wait_ms: Optional[float] = None    # wait after a batch's first image; None = auto
    max_queue: int = 64                    # images in the request path at most (then 503)
    decode_workers: int = 2                # threads decoding uploads and rendering overlays
    max_upload_bytes: int = 20 * 1024 * 1024
    max_batch_files: int = 32
    max_pixels: int = 25_000_000
    request_timeout_s: float = 120.0
    header_timeout_s: float = 10.0         # a connection's request head must be complete by then
    idle_timeout_s: float = 5.0            # a connection waiting for a request may be silent
    max_connections: int = 1024            # open connections at most (0: no cap)
    max_connections_per_client: int = 64   # per client address, an IPv6 /64 as one (0: no cap)
    results_dir: Optional[str] = "serve_results"   # None = no results log (unless results_db)
    # the results log in a database (postgresql://..., sqlite:///...) instead of results.sqlite
    # in results_dir; kept pictures still go under results_dir (None: no pictures kept)
    results_db: Optional[str] = None
    keep_images: str = "anomalous"         # pictures kept in the results log: none|anomalous|all
    # the uploaded images themselves, as sent (what `anomaly-hooks update --from-results` learns
    # from): none|anomalous|all; under results_dir, removed with their result by the retention
    keep_originals: str = "none"
    # beside each kept original, the network input the model computed from it
    # (anomaly_hooks.keptinputs: an update from the results reads it instead of decoding)
    keep_inputs: bool = False
    thumbnails: bool = True                # a small overlay JPEG per result (the page's list)
    thumb_side: int = 160
    overlay_max_side: int = 1024           # overlays/masks are at most this size (long side)
    retention_days: Optional[float] = None
    retention_count: Optional[int] = None
    retention_interval_s: float = 60.0
    monitor: Optional[str] = None          # module:callable building a drift monitor
    sighup_reload: bool = True
    # freed memory kept in the C heap while the service runs (anomaly_hooks.heap): full
    # batches of a large backbone faster, the resident memory higher (see docs/service.md)
    keep_heap: bool = False
    # several models in one service: name -> file, the first the default one (the routes
    # without a name serve it); None: the one model of ``model``, named "default"
    models: Optional[Dict[str, str]] = None

    def __post_init__(self) -> None:
        if self.token is None:
            self.token = os.environ.get(TOKEN_ENV) or None
        if not self.models:
            self.models = {DEFAULT_MODEL: self.model}
        else:
            self.models = dict(self.models)
            self.model = next(iter(self.models.values()))

    def validate(self) -> "ServeSettings":
        """Raise ConfigError naming the bad option."""
        positive = ("max_batch", "max_queue", "decode_workers", "max_upload_bytes",
                    "max_batch_files", "max_pixels", "overlay_max_side")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1, not "
                                 f"{getattr(self, name)}")
        if self.max_wait_ms is not None and self.max_wait_ms < 0:
            raise ConfigError("max-wait-ms must be >= 0")
        for name in ("request_timeout_s", "header_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):  # NaN fails the first test
                raise ConfigError(f"{name[:-2].replace('_', '-')} must be a number of seconds "
                                 f"> 0, not {value}")
        for name in ("max_connections", "max_connections_per_client"):
            if int(getattr(self, name)) < 0:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 0 (0: no cap), not "
                                 f"{getattr(self, name)}")
        if self.max_queue < self.max_batch:
            raise ConfigError(f"max-queue ({self.max_queue}) must be >= max-batch "
                             f"({self.max_batch})")
        self._check_keep()
        if self.retention_days is not None and self.retention_days <= 0:
            raise ConfigError("retention-days must be > 0")
        if self.retention_count is not None and self.retention_count < 1:
            raise ConfigError("retention-count must be >= 1")
        if self.token is not None and len(self.token) < 8:
            raise ConfigError("the token must have at least 8 characters")
        check_model_names(self.models or {})
        if self.models_dir is not None and not os.path.isdir(self.models_dir):
            raise ConfigError(f"models-dir {self.models_dir!r} is not a folder")
        if self.results_db is not None:
            from anomaly_hooks.serve.stores import check_store_spec

            check_store_spec(self.results_db)
        return self

    def _check_keep(self) -> None:
        """ConfigError for a ``keep_images`` / ``keep_originals`` outside KEEP_CHOICES."""
        for name in ("keep_images", "keep_originals"):
            if getattr(self, name) not in KEEP_CHOICES:
                raise ConfigError(f"{name.replace('_', '-')} must be one of "
                                  f"{', '.join(KEEP_CHOICES)}, not {getattr(self, name)!r}")
        if self.keep_inputs and self.keep_originals == "none":
            raise ConfigError("keep-inputs keeps the network input beside each kept original "
                              "image: give keep-originals anomalous or all as well")

    @property
    def keeps_results(self) -> bool:
        """Whether the service keeps a results log (in results_db or in results_dir)."""
        return bool(self.results_db or self.results_dir)

    def public(self) -> dict:
        """The settings without the token nor the database password (for GET /v1/model)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["token"] = "set" if self.token else None
        if self.results_db:
            from anomaly_hooks.serve.pgstore import redact_url

            out["results_db"] = redact_url(self.results_db)
        return out


def parse_models(values: Sequence[str]) -> Dict[str, str]:
    """``--model`` values -> {name: path}: one ``PATH`` (the model named "default"), or each
    ``NAME=PATH`` (the first is the default model). A path with ``=`` in its first part is
    given as ``./PATH``. Raises ConfigError for a mix, a repeated name, or an empty part."""
    named: List[tuple] = []
    for value in values:
        name, sep, path = value.partition("=")
        if sep and "/" not in name and "\\" not in name:
            if not name or not path:
                raise ConfigError(f"--model {value!r}: give NAME=PATH (both non-empty)")
            named.append((name, path))
        else:
            named.append((None, value))
    if len(named) == 1 and named[0][0] is None:
        return {DEFAULT_MODEL: named[0][1]}
    if any(name is None for name, _ in named):
        raise ConfigError("several --model options: name each one, --model NAME=PATH")
    out: Dict[str, str] = {}
    for name, path in named:
        if name in out:
            raise ConfigError(f"--model {name}=...: the name {name!r} is given twice")
        out[name] = path
    return out


def check_model_names(models: Dict[str, str]) -> None:
    """ConfigError for a model name that cannot be one (see :data:`MODEL_NAME`), or a
    reserved one."""
    for name in models:
        if not isinstance(name, str) or not MODEL_NAME.fullmatch(name) or name in RESERVED_NAMES:
            raise ConfigError(f"model name {name!r}: 1 to 64 letters, digits, '_', '.' or '-', "
                              "starting with a letter or digit"
                              + (f"; {name!r} is reserved" if name in RESERVED_NAMES else ""))
