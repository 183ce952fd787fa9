"""Prometheus metrics of the service (one registry per app, text format at ``GET /metrics``).

What belongs to one model (predictions, scores, batches, reloads, the model's identity and
threshold, its drift monitor) carries a ``model`` label: the model's name (``default`` for a
server of one ``--model PATH``)."""
from __future__ import annotations

import collections
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from anomaly_hooks.serve.connections import CLOSE_REASONS
from anomaly_hooks.serve.monitoring import numeric_leaves

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                   80.0, 160.0)
SCORE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
RATE_WINDOW = 100


class _CallbackCollector:
    """Gauges computed at scrape time (model info, drift statistics)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn

    def collect(self):
        yield from self._fn()

    def describe(self):
        return []


class ServiceMetrics:
    """``engines()``: (model name, its engine or None) of each model; ``drift_statuses()``:
    (model name, its drift monitor's status or None) of each model."""

    def __init__(self, *, queue_depth: Callable[[], float], in_flight: Callable[[], float],
                 engines: Callable[[], Iterable[Tuple[str, Any]]],
                 drift_statuses: Callable[[], Iterable[Tuple[str, Optional[dict]]]],
                 connections: Optional[Callable[[], Dict[str, int]]] = None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("anomaly_hooks_http_requests_total",
                                "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("anomaly_hooks_http_request_duration_seconds",
                                 "HTTP request latency by endpoint", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.predictions = Counter("anomaly_hooks_predictions_total",
                                   "images scored, by model and verdict", ["model", "verdict"],
                                   registry=r)
        self.rejected = Counter("anomaly_hooks_rejected_images_total",
                                "uploads refused, by error code", ["code"], registry=r)
        self.scores = Histogram("anomaly_hooks_normalized_score",
                                "normalized scores (0.5 = at the threshold)", ["model"],
                                buckets=SCORE_BUCKETS, registry=r)
        self.anomalous_rate = Gauge("anomaly_hooks_anomalous_rate",
                                    f"fraction anomalous among the model's last {RATE_WINDOW} "
                                    "images", ["model"], registry=r)
        self.batch_size = Histogram("anomaly_hooks_batch_size", "images per inference batch",
                                    ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.batch_seconds = Histogram("anomaly_hooks_batch_duration_seconds",
                                       "inference time per batch", ["model"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("anomaly_hooks_queue_depth",
                                 "images waiting for an inference batch", registry=r)
        self.queue_depth.set_function(queue_depth)
        self.in_flight = Gauge("anomaly_hooks_images_in_progress",
                               "images anywhere in the request path (admission count)",
                               registry=r)
        self.in_flight.set_function(in_flight)
        self.reloads = Counter("anomaly_hooks_model_reloads_total",
                               "model reloads by model and result", ["model", "result"],
                               registry=r)
        self.log_errors = Counter("anomaly_hooks_results_log_errors_total",
                                  "results-log writes that failed", registry=r)
        self.drift_dropped = Counter("anomaly_hooks_drift_batches_dropped_total",
                                     "batches the drift monitor was too busy to observe",
                                     registry=r)
        self._recent: Dict[str, Any] = collections.defaultdict(
            lambda: collections.deque(maxlen=RATE_WINDOW))
        self._engines = engines
        self._drift = drift_statuses
        r.register(_CallbackCollector(self._collect_model))
        r.register(_CallbackCollector(self._collect_drift))
        self._connections = connections
        r.register(_CallbackCollector(self._collect_connections))

    def observe_prediction(self, model: str, normalized_score: float, is_anomalous: bool
                           ) -> None:
        self.predictions.labels(model, "anomalous" if is_anomalous else "normal").inc()
        self.scores.labels(model).observe(normalized_score)
        recent = self._recent[model]
        recent.append(1.0 if is_anomalous else 0.0)
        self.anomalous_rate.labels(model).set(sum(recent) / len(recent))

    def _collect_connections(self):
        """Open and waiting connections; those the server closed, by reason (a real server
        only: the in-process app has no connections)."""
        stats = self._connections() if self._connections is not None else None
        if stats is None:
            return
        for key, text in (("open", "open HTTP connections"),
                          ("waiting", "connections waiting for a request head")):
            gauge = GaugeMetricFamily(f"anomaly_hooks_connections_{key}", text)
            gauge.add_metric([], float(stats[key]))
            yield gauge
        closed = CounterMetricFamily("anomaly_hooks_connections_closed",
                                     "connections the server closed or refused, by reason "
                                     "(header_timeout, idle_timeout, evicted, refused)",
                                     labels=["reason"])
        for reason in CLOSE_REASONS:
            closed.add_metric([reason], float(stats[reason]))
        yield closed

    def _collect_model(self):
        engines = list(self._engines())
        ready = GaugeMetricFamily("anomaly_hooks_model_ready", "1 when the model is loaded and "
                                  "warm", labels=["model"])
        info = GaugeMetricFamily("anomaly_hooks_model_info", "the model being served",
                                 labels=["model", "model_id", "method", "backbone", "sha256",
                                         "engine"])
        thr = GaugeMetricFamily("anomaly_hooks_model_threshold", "raw score threshold",
                                labels=["model"])
        for name, engine in engines:
            ready.add_metric([name], 1.0 if engine is not None else 0.0)
            if engine is not None:
                info.add_metric([name, engine.model_id, engine.method, engine.backbone_name,
                                 engine.sha256, engine.kind], 1.0)
                thr.add_metric([name], engine.threshold)
        yield ready
        yield info
        yield thr

    def _collect_drift(self):
        statuses = list(self._drift())
        enabled = GaugeMetricFamily("anomaly_hooks_drift_enabled", "1 when a drift monitor runs",
                                    labels=["model"])
        values = GaugeMetricFamily("anomaly_hooks_drift",
                                   "numeric fields of the drift monitor's status()",
                                   labels=["model", "key"])
        state = GaugeMetricFamily("anomaly_hooks_drift_state", "drift monitor state",
                                  labels=["model", "state"])
        for name, status in statuses:
            enabled.add_metric([name], 1.0 if status is not None else 0.0)
            if status is None:
                continue
            for key, value in numeric_leaves({k: v for k, v in status.items()
                                              if k != "enabled"}):
                values.add_metric([name, key], value)
            if isinstance(status.get("state"), str):
                state.add_metric([name, status["state"]], 1.0)
        yield enabled
        yield values
        yield state
