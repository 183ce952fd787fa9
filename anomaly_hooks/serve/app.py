"""The inspection service: a FastAPI app around one loaded model.

Request path of ``POST /v1/predict`` (every stage bounded):

1. admission: at most ``max_queue`` images anywhere in the path, else 503 + Retry-After (before
   the body is read);
2. the body (raw or multipart), at most ``max_upload_bytes`` (413 otherwise);
3. decoding + preprocessing in the decode pool (``decode_workers`` threads; 400/413/415 for bad
   uploads): only these threads ever hold a full-size decoded image; what waits afterwards is the
   network input and a bounded preview;
4. the batcher gathers concurrent images into one backbone batch, run in the model thread;
5. verdict, pixel count and pictures in the decode pool;
6. the record is committed to the results log (group commit) *before* the response is sent.

The whole path runs under ``request_timeout_s`` (503 ``timeout``).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import functools
import logging
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from anomaly_hooks import __version__
from anomaly_hooks.serve.batcher import Admission, Batcher
from anomaly_hooks.serve.engine import Engine, PreparedImage
from anomaly_hooks.serve.errors import ServeError, code_for_status, not_ready
from anomaly_hooks.serve.metrics import ServiceMetrics
from anomaly_hooks.serve.middleware import (
    AuthMiddleware,
    BodyLimitMiddleware,
    RequestMetricsMiddleware,
)
from anomaly_hooks.serve.monitoring import MonitorRunner, observed_batch, optional_monitor
from anomaly_hooks.serve.results import (
    PICTURES,
    ImageFiles,
    Record,
    Recorder,
    ResultStore,
    SQLiteResultStore,
    csv_lines,
    iso_time,
)
from anomaly_hooks.serve.settings import ServeSettings

log = logging.getLogger("anomaly_hooks.serve")

STATIC = Path(__file__).resolve().parent / "static"
TRIM_INTERVAL_S = 5.0  # at most this often, the free C heap goes back to the system
_LIBC: Any = None  # libc, once loaded (False where there is none with malloc_trim)
MULTIPART_SLACK = 64 * 1024
Heatmap = Literal["none", "png", "url"]


def _parse_time(value: Optional[str], name: str) -> Optional[float]:
    """Unix seconds or ISO 8601 (``2026-11-23T10:00:00Z``; naive times are UTC)."""
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is not None:
        if number != number or number in (float("inf"), float("-inf")):
            raise ServeError(422, "invalid_parameter", f"{name}={value!r} is not a time")
        return number
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    if "T" in text and " " in text.split("T", 1)[1]:  # a '+' offset decoded as a space
        head, tail = text.split("T", 1)
        text = head + "T" + tail.replace(" ", "+")
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise ServeError(422, "invalid_parameter",
                         f"{name}={value!r} is neither Unix seconds nor an ISO 8601 time "
                         "(e.g. 2026-11-23T10:00:00Z)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


class Service:
    """State and logic of one running service (one model, one batcher, one results log)."""

    def __init__(self, settings: ServeSettings, *, monitor: Any = None,
                 store: Optional[ResultStore] = None,
                 on_fatal: Optional[Callable[[str], None]] = None) -> None:
        self.settings = settings
        self.engine: Optional[Engine] = None
        self.load_error: Optional[str] = None
        self.last_reload: Optional[Dict[str, Any]] = None
        self.started = time.time()
        self._monitor_object = monitor
        # (monitor, the engine whose file built it or None for a given monitor), swapped as one
        # so that the batch thread never pairs a new monitor with an old model's batch
        self._monitoring: Tuple[Optional[MonitorRunner], Optional[Engine]] = (None, None)
        self._store_given = store
        self.store: Optional[ResultStore] = None
        self.files: Optional[ImageFiles] = None
        self.recorder: Optional[Recorder] = None
        self.on_fatal = on_fatal
        self.admission = Admission(settings.max_queue)
        self.batcher: Optional[Batcher] = None
        self.metrics = ServiceMetrics(
            queue_depth=lambda: self.batcher.depth if self.batcher else 0,
            in_flight=lambda: self.admission.used,
            engine=lambda: self.engine,
            drift_status=lambda: self.monitor.status() if self.monitor else None)
        self._reloading = False
        self._last_trim = 0.0
        self._tasks: List[asyncio.Task] = []
        self._sighup = False

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        self.loop = asyncio.get_running_loop()
        _init_torch_threads()
        self.pool = ThreadPoolExecutor(s.decode_workers, thread_name_prefix="decode")
        self.model_thread = ThreadPoolExecutor(1, thread_name_prefix="model")
        self.aux = ThreadPoolExecutor(2, thread_name_prefix="aux")
        if self._store_given is not None or s.results_dir:
            root = Path(s.results_dir or ".")
            self.store = self._store_given or SQLiteResultStore(root / "results.sqlite")
            self.files = ImageFiles(root) if s.results_dir else None
            self.recorder = Recorder(self.store)
        wait_s = None if s.max_wait_ms is None else s.max_wait_ms / 1000.0
        self.batcher = Batcher(max_batch=s.max_batch, max_wait_s=wait_s,
                               max_queue=s.max_queue, executor=self.model_thread,
                               on_batch=self._on_batch)
        self.batcher.start()
        self._tasks.append(self.loop.create_task(self._initial_load(), name="model-load"))
        if self.store is not None and (s.retention_days or s.retention_count):
            self._tasks.append(self.loop.create_task(self._retention_loop(), name="retention"))
        if s.sighup_reload and threading.current_thread() is threading.main_thread():
            try:
                self.loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
                self._sighup = True
            except (NotImplementedError, RuntimeError, ValueError, AttributeError):
                log.info("SIGHUP reload not available here")

    async def stop(self) -> None:
        if self._sighup:
            with contextlib.suppress(Exception):
                self.loop.remove_signal_handler(signal.SIGHUP)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.batcher is not None:
            await self.batcher.stop()
        if self.recorder is not None:
            await self.loop.run_in_executor(None, self.recorder.close)
        if self.store is not None:
            self.store.close()
        if self.monitor is not None:
            self.monitor.close()
        for pool in (self.pool, self.model_thread, self.aux):
            pool.shutdown(wait=False, cancel_futures=True)

    async def _initial_load(self) -> None:
        s = self.settings
        try:
            engine = await self.loop.run_in_executor(
                self.aux, functools.partial(Engine.load, s.model, s.device))
        except Exception as exc:
            self.load_error = _message(exc)
            log.error("the model could not be loaded: %s", self.load_error)
            if self.on_fatal is not None:
                self.on_fatal(self.load_error)
            return
        try:
            if self._monitor_object is not None:
                monitor: Optional[MonitorRunner] = MonitorRunner(self._monitor_object)
            else:
                monitor = await self._build_monitor(engine)
        except Exception as exc:
            self.load_error = f"drift monitor: {_message(exc)}"
            log.error("%s", self.load_error)
            if self.on_fatal is not None:
                self.on_fatal(self.load_error)
            return
        if self.engine is None:  # a reload that finished first wins
            self._swap(engine, monitor)
            log.info("serving %s (%s, loaded and warm in %.1f s)", engine.model_id, engine.path,
                     engine.load_seconds)
        elif monitor is not None and monitor is not self.monitor:
            monitor.close()

    async def _retention_loop(self) -> None:
        s = self.settings
        while True:
            try:
                await self.prune()
            except Exception:
                log.exception("results-log retention failed")
            await asyncio.sleep(s.retention_interval_s)

    async def prune(self) -> int:
        """Apply the retention settings now; returns the number of records removed."""
        s = self.settings
        if self.recorder is None or self.store is None:
            return 0
        removed = await asyncio.wrap_future(self.recorder.call(
            self.store.prune,
            max_age_s=s.retention_days * 86400.0 if s.retention_days else None,
            max_count=s.retention_count))
        if removed and self.files is not None:
            await self.loop.run_in_executor(self.aux, self.files.delete, removed)
        if removed:
            log.info("retention: removed %d result(s)", len(removed))
        return len(removed)

    # -- model -----------------------------------------------------------------------------
    def require_engine(self) -> Engine:
        engine = self.engine
        if engine is None:
            if self.load_error:
                raise not_ready(f"no model loaded: {self.load_error}", 30)
            raise not_ready("the model is still loading", 5)
        return engine

    async def reload(self, path: Optional[str] = None) -> Dict[str, Any]:
        """Load ``path`` (default: the current model path) beside the serving model, warm it up,
        then swap. In-flight requests finish on the model that preprocessed them."""
        if self._reloading:
            raise ServeError(409, "reload_in_progress", "a model reload is already running")
        self._reloading = True
        target = path or self.settings.model
        old = self.engine
        try:
            try:
                new = await self.loop.run_in_executor(
                    self.aux, functools.partial(Engine.load, target, self.settings.device))
            except Exception as exc:
                raise self._refused(target, _message(exc), old) from None
            try:
                monitor = await self._monitor_for(old, new)
            except Exception as exc:
                raise self._refused(target, f"its drift monitor cannot be built: "
                                    f"{_message(exc)}", old) from None
            self._swap(new, monitor)
            self.settings.model = target
            self.load_error = None
            self.metrics.reloads.labels("ok").inc()
            result = {"reloaded": True, "model_id": new.model_id,
                      "previous_model_id": old.model_id if old else None, "path": target,
                      "unchanged": bool(old and old.sha256 == new.sha256),
                      "seconds": round(new.load_seconds, 3)}
            self.last_reload = {"ok": True, "at": iso_time(time.time()), **result}
            log.info("reloaded: now serving %s (was %s)", new.model_id, result["previous_model_id"])
            return result
        finally:
            self._reloading = False

    def _refused(self, target: str, msg: str, old: Optional[Engine]) -> ServeError:
        """Record and log a refused reload; the error to answer (the old model serves on)."""
        self.metrics.reloads.labels("failed").inc()
        serving = old.model_id if old else None
        self.last_reload = {"ok": False, "at": iso_time(time.time()), "path": target,
                            "error": msg, "serving": serving}
        log.error("reload of %s refused: %s", target, msg)
        keep = f"; still serving {serving}" if serving else "; no model is loaded"
        return ServeError(422, "reload_failed", f"the new model was refused: {msg}{keep}")

    @property
    def monitor(self) -> Optional[MonitorRunner]:
        """The drift monitor fed by the serving model's batches (None: no monitor)."""
        return self._monitoring[0]

    async def _build_monitor(self, engine: Engine) -> Optional[MonitorRunner]:
        """The configured monitor (``--monitor``) for ``engine``'s model file, or None."""
        return await self.loop.run_in_executor(self.aux, optional_monitor,
                                               self.settings.monitor, engine.detector)

    async def _monitor_for(self, old: Optional[Engine], new: Engine) -> Optional[MonitorRunner]:
        """The monitor to run with ``new``: the same one for a given monitor object or an
        unchanged file (its window carries on), else one built from the new file's reference
        -- a reloaded model has its own reference, and the old one's would see only drift."""
        if self._monitor_object is not None or (old is not None and old.sha256 == new.sha256):
            return self.monitor
        return await self._build_monitor(new)

    def _swap(self, engine: Engine, monitor: Optional[MonitorRunner]) -> None:
        """Serve ``engine`` with ``monitor`` from the next batch on (one step on the loop)."""
        previous = self.monitor
        self.engine = engine
        self._monitoring = (monitor, engine if self._monitor_object is None else None)
        if self.batcher is not None:  # the layers' channel means go to the monitor
            self.batcher.collect_features = monitor is not None
        if previous is not None and previous is not monitor:
            previous.close()

    def _on_sighup(self) -> None:
        async def run() -> None:
            try:
                await self.reload()
            except ServeError as exc:
                log.error("SIGHUP reload: %s", exc.message)
        self._tasks.append(self.loop.create_task(run(), name="sighup-reload"))

    # -- batches ---------------------------------------------------------------------------
    def _on_batch(self, engine: Engine, jobs: list, scores: Any, info: Any,
                  features: Optional[Dict[str, Any]] = None) -> None:
        self.metrics.batch_size.observe(info.size)
        self.metrics.batch_seconds.observe(info.seconds)
        now = time.monotonic()
        if now - self._last_trim >= TRIM_INTERVAL_S:
            self._last_trim = now
            self.aux.submit(_release_free_memory)
        monitor, built_for = self._monitoring
        # a batch still scored by the model before a reload stays out of the new one's window
        if monitor is not None and (built_for is None or built_for is engine):
            tensors = [j.tensor for j in jobs]
            now = time.time()
            if not monitor.offer(
                    lambda: observed_batch(engine, tensors, scores, now, features)):
                self.metrics.drift_dropped.inc()

    # -- predictions -----------------------------------------------------------------------
    async def predict_bytes(self, data: bytes, *, part_id: Optional[str], source: Optional[str],
                            heatmap: str, t_start: float, read_ms: float) -> Dict[str, Any]:
        """Score one uploaded image end to end; the record is durable when this returns."""
        s = self.settings
        engine = self.require_engine()
        t0 = time.perf_counter()
        try:
            item: PreparedImage = await self.loop.run_in_executor(
                self.pool, engine.prepare, data, s.max_pixels, s.overlay_max_side)
        except ServeError as exc:
            self.metrics.rejected.labels(exc.code).inc()
            raise
        del data
        t_decoded = time.perf_counter()
        assert self.batcher is not None
        future = self.batcher.submit(item.tensor, engine)
        score, heat, info = await future
        item.tensor = None
        t_inferred = time.perf_counter()
        keep = s.keep_images if self.files is not None else "none"
        outcome = await self.loop.run_in_executor(self.pool, functools.partial(
            engine.finish, score, heat, item, overlay=heatmap != "none" or keep == "all",
            keep_anomalous=keep == "anomalous",
            thumb_side=s.thumb_side if (s.thumbnails and self.files is not None) else 0))
        self.metrics.observe_prediction(outcome.normalized_score, outcome.is_anomalous)
        t_post = time.perf_counter()
        request_id = uuid.uuid4().hex
        now = time.time()
        record_id = None
        stored = {"overlay": None, "mask": None, "thumb": None}
        if self.recorder is not None:
            keep_pictures = (heatmap == "url" or keep == "all"
                             or (keep == "anomalous" and outcome.is_anomalous))
            pictures = {"overlay": outcome.overlay_png if keep_pictures else None,
                        "mask": outcome.mask_png if keep_pictures else None,
                        "thumb": outcome.thumb_jpg}
            record = Record(
                time=now, request_id=request_id, score=outcome.score,
                normalized_score=outcome.normalized_score, is_anomalous=outcome.is_anomalous,
                threshold=outcome.threshold, model_id=engine.model_id,
                model_checksum=engine.sha256, part_id=part_id, source=source,
                anomalous_pixels=outcome.anomalous_pixels, width=item.width, height=item.height,
                latency_ms=round((time.perf_counter() - t_start) * 1000, 3))
            record_id = await self._record(record, pictures)
            stored = {"overlay": record.overlay_path, "mask": record.mask_path,
                      "thumb": record.thumb_path}
        t_done = time.perf_counter()
        body: Dict[str, Any] = {
            "id": record_id, "request_id": request_id, "time": iso_time(now),
            "part_id": part_id, "source": source,
            "score": outcome.score, "normalized_score": outcome.normalized_score,
            "is_anomalous": outcome.is_anomalous, "threshold": outcome.threshold,
            "anomalous_pixels": outcome.anomalous_pixels,
            "image": {"width": item.width, "height": item.height, "format": item.format},
            "model": {"id": engine.model_id, "sha256": engine.sha256},
            "timing_ms": {
                "read": round(read_ms, 3),
                "decode": round((t_decoded - t0) * 1000, 3),
                "queue": round(max(0.0, info.started - t_decoded) * 1000, 3),
                "inference": round(info.seconds * 1000, 3),
                "batch_size": info.size,
                "postprocess": round((t_post - t_inferred) * 1000, 3),
                "log": round((t_done - t_post) * 1000, 3),
                "total": round((t_done - t_start) * 1000, 3)},
        }
        if heatmap == "png":
            body["overlay_png"] = base64.b64encode(outcome.overlay_png or b"").decode()
            body["mask_png"] = base64.b64encode(outcome.mask_png or b"").decode()
        if record_id is not None:
            for kind in ("overlay", "mask", "thumb"):
                if stored[kind]:
                    body[f"{kind}_url"] = f"/v1/results/{record_id}/{PICTURES[kind]}"
        return body

    async def _record(self, record: Record, pictures: Dict[str, Optional[bytes]]) -> int:
        """Write the pictures, then commit the record (durable on return)."""
        assert self.recorder is not None
        try:
            if self.files is not None and any(pictures.values()):
                paths = await self.loop.run_in_executor(
                    self.pool, self.files.write, record.request_id, record.time, pictures)
                record.overlay_path = paths.get("overlay")
                record.mask_path = paths.get("mask")
                record.thumb_path = paths.get("thumb")
            # shielded: a request that times out now still gets its record committed
            return await asyncio.shield(asyncio.wrap_future(self.recorder.submit(record)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.metrics.log_errors.inc()
            raise ServeError(500, "internal_error",
                             f"the prediction could not be written to the results log "
                             f"({type(exc).__name__}: {exc})") from None

    async def with_timeout(self, coro):
        try:
            return await asyncio.wait_for(coro, self.settings.request_timeout_s)
        except asyncio.TimeoutError:
            raise ServeError(503, "timeout", f"the request took longer than "
                             f"{self.settings.request_timeout_s:g} s (the server's "
                             "--request-timeout); the server is busy, retry later",
                             {"Retry-After": str(self.batcher.retry_after()
                                                 if self.batcher else 5)}) from None

    def admit(self, n: int) -> "contextlib.AbstractContextManager[None]":
        assert self.batcher is not None
        self.admission.acquire(n, self.batcher.retry_after)

        @contextlib.contextmanager
        def release():
            try:
                yield
            finally:
                self.admission.release(n)
        return release()


def _init_torch_threads() -> None:
    """Run one parallel torch op on this (the main) thread before any worker thread does.

    Measured here (torch 2.15, libgomp): when the first parallel CPU op of a process runs on a
    worker thread, every later op on *that* thread is 10-40x slower (a ResNet18 batch: 2-5 s
    instead of 0.05-0.2 s); one op on the main thread first avoids it. The service loads models
    on a worker thread, so it does this at start."""
    import torch

    torch.zeros(1 << 20).add_(1)


def _release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``).

    Measured in the 10-minute soak: batches of varying size, allocated on the model thread and
    freed from others, left the server's RSS one step (~200 MB, 11 %) higher after 5 minutes
    and there it stayed: freed memory kept in glibc's per-thread arenas, not a leak. Trimming
    every few seconds after a batch keeps RSS at what is in use. A no-op elsewhere."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def _message(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    from anomaly_hooks.errors import AnomalyHooksError

    known = (AnomalyHooksError, FileNotFoundError, ValueError)
    return text if isinstance(exc, known) else f"{type(exc).__name__}: {text}"


def _disconnected() -> ServeError:
    return ServeError(400, "malformed_request", "the client disconnected before the request "
                      "body was complete")


def _check_size(data: bytes, max_bytes: int) -> None:
    """413 for one image over the upload limit."""
    if len(data) > max_bytes:
        raise ServeError(413, "payload_too_large", f"image of {len(data):,} bytes exceeds the "
                         f"limit of {max_bytes:,} bytes (the server's --max-upload-mb)")


def _check_heatmap(service: Service, heatmap: str) -> None:
    """422 for ``heatmap=url`` on a server without a results log (the URL would not exist)."""
    if heatmap == "url" and service.files is None:
        raise ServeError(422, "invalid_parameter", "heatmap=url needs the results log (the "
                         "server runs with --no-results); use heatmap=png")


async def _read_upload(request: Request, max_bytes: int) -> tuple[bytes, Optional[str], dict]:
    """(bytes, file name, other form fields) of a raw-body or multipart single-image upload."""
    try:
        return await _read_upload_inner(request, max_bytes)
    except ClientDisconnect:
        raise _disconnected() from None


async def _read_upload_inner(request: Request, max_bytes: int
                             ) -> tuple[bytes, Optional[str], dict]:
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        form = await request.form(max_files=4, max_fields=16)
        try:
            upload = next((v for _, v in form.multi_items() if isinstance(v, UploadFile)), None)
            if upload is None:
                raise ServeError(400, "empty_body", "the multipart request has no file part: "
                                 "send the image as a file field (e.g. -F file=@part.png)")
            data = await upload.read()
            name = upload.filename
            fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
        finally:
            await form.close()
    else:
        data = await request.body()
        name = None
        fields = {}
    _check_size(data, max_bytes)
    return data, name, fields


def create_app(settings: ServeSettings, *, monitor: Any = None,
               store: Optional[ResultStore] = None,
               on_fatal: Optional[Callable[[str], None]] = None) -> FastAPI:
    """The ASGI app. ``monitor``: a drift-monitor object (see :mod:`.monitoring`); ``store``: a
    results store other than the default SQLite file; ``on_fatal(message)``: called when the
    model cannot be loaded at start (the CLI stops the server then)."""
    settings.validate()
    service = Service(settings, monitor=monitor, store=store, on_fatal=on_fatal)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="anomaly_hooks inspection service", version=__version__,
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service

    def body_limit(path: str) -> int:
        if path == "/v1/predict/batch":
            return settings.max_upload_bytes * settings.max_batch_files + MULTIPART_SLACK
        return settings.max_upload_bytes + MULTIPART_SLACK

    # last added = outermost
    app.add_middleware(BodyLimitMiddleware, limit_for=body_limit)
    app.add_middleware(AuthMiddleware, token=settings.token)
    app.add_middleware(RequestMetricsMiddleware, metrics_getter=lambda: service.metrics)

    # -- errors ----------------------------------------------------------------------------
    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, exc: ServeError):
        return JSONResponse(exc.as_dict(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x not in ("query", "body"))
            kind = err.get("loc", ("",))[0]
            parts.append(f"{kind} parameter {where!r}: {err.get('msg')}")
        return JSONResponse({"code": "invalid_parameter", "status": 422,
                             "message": "; ".join(parts) or "invalid parameters"},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse({"code": code_for_status(exc.status_code), "status": exc.status_code,
                             "message": str(exc.detail)}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    # -- probes ----------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "uptime_s": round(time.time() - service.started, 1)}

    @app.get("/readyz")
    async def readyz():
        engine = service.require_engine()
        return {"ready": True, "model_id": engine.model_id}

    # -- model -----------------------------------------------------------------------------
    @app.get("/v1/model")
    async def model_info():
        engine = service.require_engine()
        b = service.batcher
        return {**engine.info(), "serving": settings.public(),
                "batching": {"wait_ms": round(b.wait_s * 1000, 3), "batches": b.batches,
                             "seconds_per_image": round(b.seconds_per_image, 6)},
                "last_reload": service.last_reload,
                "drift_monitor": service.monitor is not None}

    @app.post("/v1/admin/reload")
    async def reload(request: Request, path: Optional[str] = Query(None, max_length=4096)):
        if path is None and request.headers.get("content-type", "").startswith(
                "application/json"):
            try:
                payload = await request.json()
            except ValueError:
                raise ServeError(422, "invalid_parameter", "the body is not valid JSON") from None
            if payload is not None and not isinstance(payload, dict):
                raise ServeError(422, "invalid_parameter", 'the body must be {"path": "..."}')
            path = (payload or {}).get("path")
            if path is not None and not isinstance(path, str):
                raise ServeError(422, "invalid_parameter", "path must be a string")
        return await service.reload(path)

    # -- predictions -----------------------------------------------------------------------
    @app.post("/v1/predict")
    async def predict(request: Request, heatmap: Heatmap = "none",
                      part_id: Optional[str] = Query(None, max_length=200),
                      source: Optional[str] = Query(None, max_length=500)):
        t_start = time.perf_counter()
        service.require_engine()
        _check_heatmap(service, heatmap)
        with service.admit(1):
            async def run():
                data, name, fields = await _read_upload(request, settings.max_upload_bytes)
                read_ms = (time.perf_counter() - t_start) * 1000
                pid = part_id if part_id is not None else _field(fields, "part_id", 200)
                src = source if source is not None else (_field(fields, "source", 500) or name)
                return await service.predict_bytes(data, part_id=pid, source=src,
                                                   heatmap=heatmap, t_start=t_start,
                                                   read_ms=read_ms)
            return await service.with_timeout(run())

    @app.post("/v1/predict/batch")
    async def predict_batch(request: Request, heatmap: Heatmap = "none"):
        t_start = time.perf_counter()
        service.require_engine()
        _check_heatmap(service, heatmap)
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ServeError(415, "unsupported_media_type",
                             "the batch endpoint takes multipart/form-data with one file part "
                             "per image (e.g. -F files=@a.png -F files=@b.png)")
        try:
            form = await request.form(max_files=settings.max_batch_files + 1,
                                      max_fields=2 * settings.max_batch_files + 16)
        except ClientDisconnect:
            raise _disconnected() from None
        try:
            uploads = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
            if not uploads:
                raise ServeError(400, "empty_body", "the batch request has no file parts")
            if len(uploads) > settings.max_batch_files:
                raise ServeError(413, "too_many_images",
                                 f"{len(uploads)} images in one request; at most "
                                 f"{settings.max_batch_files} (the server's --max-batch-files)")
            part_ids = [v for k, v in form.multi_items() if k == "part_id" and isinstance(v, str)]
            read_ms = (time.perf_counter() - t_start) * 1000
            with service.admit(len(uploads)):
                async def one(i: int, upload: UploadFile) -> Dict[str, Any]:
                    try:
                        data = await upload.read()
                        _check_size(data, settings.max_upload_bytes)
                        pid = part_ids[i][:200] if i < len(part_ids) else None
                        res = await service.predict_bytes(
                            data, part_id=pid, source=upload.filename, heatmap=heatmap,
                            t_start=t_start, read_ms=read_ms)
                        return {"index": i, "filename": upload.filename, **res}
                    except ServeError as exc:
                        if exc.code in ("internal_error",):
                            raise
                        return {"index": i, "filename": upload.filename, "error": exc.as_dict()}

                async def run():
                    return await asyncio.gather(*(one(i, u) for i, u in enumerate(uploads)))
                results = await service.with_timeout(run())
        finally:
            await form.close()
        failed = sum(1 for r in results if "error" in r)
        return {"count": len(results), "failed": failed, "results": results}

    # -- results log -----------------------------------------------------------------------
    def require_store() -> ResultStore:
        if service.store is None:
            raise ServeError(404, "not_found", "the results log is disabled on this server "
                             "(--no-results)")
        return service.store

    def filters(since, until, anomalous, part_id) -> dict:
        return {"since": _parse_time(since, "since"), "until": _parse_time(until, "until"),
                "anomalous": anomalous, "part_id": part_id}

    @app.get("/v1/results")
    async def results(since: Optional[str] = None, until: Optional[str] = None,
                      anomalous: Optional[bool] = None, part_id: Optional[str] = None,
                      before_id: Optional[int] = Query(None, ge=1),
                      limit: int = Query(100, ge=1, le=1000)):
        store = require_store()
        f = filters(since, until, anomalous, part_id)
        rows = await service.loop.run_in_executor(
            service.aux, functools.partial(store.query, before_id=before_id, limit=limit, **f))
        return {"count": len(rows), "results": [r.as_json() for r in rows],
                "next_before_id": rows[-1].id if len(rows) == limit else None}

    @app.get("/v1/results.csv")
    async def results_csv(since: Optional[str] = None, until: Optional[str] = None,
                          anomalous: Optional[bool] = None, part_id: Optional[str] = None,
                          limit: Optional[int] = Query(None, ge=1)):
        store = require_store()
        f = filters(since, until, anomalous, part_id)
        rows = store.iter_query(limit=limit, **f)
        return StreamingResponse(csv_lines(rows), media_type="text/csv; charset=utf-8",
                                 headers={"Content-Disposition":
                                          'attachment; filename="results.csv"'})

    @app.get("/v1/results/{record_id}")
    async def result(record_id: int):
        store = require_store()
        rec = await service.loop.run_in_executor(service.aux, store.get, record_id)
        if rec is None:
            raise ServeError(404, "not_found", f"no result with id {record_id}")
        return rec.as_json()

    @app.get("/v1/results/{record_id}/{picture}")
    async def result_picture(record_id: int, picture: str):
        store = require_store()
        kinds = {v: k for k, v in PICTURES.items()}
        if picture not in kinds:
            raise ServeError(404, "not_found", f"no picture {picture!r}: use one of "
                             f"{', '.join(PICTURES.values())}")
        rec = await service.loop.run_in_executor(service.aux, store.get, record_id)
        rel = getattr(rec, f"{kinds[picture]}_path", None) if rec else None
        path = service.files.resolve(rel) if (rel and service.files is not None) else None
        if path is None:
            raise ServeError(404, "not_found", f"result {record_id} has no stored {picture} "
                             "(not kept, or removed by retention)")
        return FileResponse(path, headers={"Cache-Control": "private, max-age=86400"})

    # -- drift, metrics, page --------------------------------------------------------------
    @app.get("/v1/drift")
    async def drift():
        if service.monitor is None:
            return {"enabled": False}
        return await service.loop.run_in_executor(service.aux, service.monitor.status)

    @app.get("/metrics")
    async def metrics():
        data = await service.loop.run_in_executor(service.aux, generate_latest,
                                                  service.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def page():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _field(fields: dict, name: str, max_len: int) -> Optional[str]:
    value = fields.get(name)
    if value is None or value == "":
        return None
    if len(value) > max_len:
        raise ServeError(422, "invalid_parameter", f"form field {name!r} is longer than "
                         f"{max_len} characters")
    return value
