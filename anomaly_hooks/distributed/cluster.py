"""Connecting to Ray: the only place ray is imported from (optional extra ``[ray]``), and the
test hook that kills a worker at a chosen point."""
from __future__ import annotations

import logging
import os
import socket
from types import ModuleType
from typing import Iterable, Optional

from anomaly_hooks.errors import ConfigError

EXTRA_HINT = 'pip install "anomaly_hooks[ray]"'
PROBE_SECONDS = 5.0  # a cluster address that does not answer a TCP connect in this time is down
FAULT_MARKER_ENV = "ANOMALY_HOOKS_FAULT_MARKER"  # tests: a file; the worker that finds it dies
FAULT_INDEX_ENV = "ANOMALY_HOOKS_FAULT_INDEX"  # ... when its work item (shard / image) has it


def require_ray() -> ModuleType:
    """The ``ray`` module, or a :class:`ConfigError` naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"distributed runs need Ray, which is not installed: {EXTRA_HINT}") \
            from None
    return ray


def connect(address: Optional[str] = None) -> ModuleType:
    """Join (or start) a Ray cluster unless this process already has; returns ``ray``.

    ``address``: None (Ray's own default: ``RAY_ADDRESS``, else a local cluster), ``auto``
    (a cluster started on this machine with ``ray start``), ``local:N`` (a new local cluster of
    N CPUs), ``HOST:PORT`` or ``ray://HOST:PORT``. A HOST:PORT that does not answer is a
    :class:`ConfigError` at once (Ray itself would retry for a minute).
    """
    ray = require_ray()
    if ray.is_initialized():
        return ray
    # Ray's INFO lines (start-up, Ray Data's execution plan) would drown the command's output
    kwargs = {"log_to_driver": False, "include_dashboard": False,
              "logging_level": logging.WARNING}
    if address is not None and address.startswith("local:"):
        try:
            cpus = int(address.split(":", 1)[1])
        except ValueError:
            cpus = 0
        if cpus < 1:
            raise ConfigError(f"--ray {address}: local:N needs a number of CPUs N >= 1")
        ray.init(num_cpus=cpus, **kwargs)
        return ray
    if address not in (None, "auto"):
        _probe(address)
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError) as exc:
        raise ConfigError(f"cannot reach a Ray cluster at {address or 'the default address'} "
                          f"({exc}); start one with `ray start --head`, or use --ray local:N") \
            from None
    return ray


def _probe(address: str) -> None:
    """Raise ConfigError unless ``HOST:PORT`` (optionally ``ray://``) accepts a TCP connection."""
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray {address}: give HOST:PORT, ray://HOST:PORT, auto or local:N")
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_SECONDS):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot reach a Ray cluster at {address} ({exc.strerror or exc}): "
                          "check the address, or start one with `ray start --head`") from None


def maybe_die(indices: Iterable[int]) -> None:
    """Test hook: end this process abruptly (as a crash or an OOM kill would) when the marker
    file in ``$ANOMALY_HOOKS_FAULT_MARKER`` exists and ``indices`` holds
    ``$ANOMALY_HOOKS_FAULT_INDEX``; the first process to get here removes the marker, so a
    retry goes through, unless the marker says ``always`` (a poison item: it kills every
    process that tries it). Unset in normal runs (two environment lookups)."""
    marker = os.environ.get(FAULT_MARKER_ENV)
    want = os.environ.get(FAULT_INDEX_ENV)
    if not marker or want is None or int(want) not in set(indices):
        return
    try:
        with open(marker) as fh:
            if fh.read().strip() != "always":
                os.remove(marker)
    except FileNotFoundError:
        return
    os._exit(1)
