"""One running inspection service: the model, its reload, the batcher, the results log and the
path of one image through them (the HTTP routes in :mod:`.routes` are thin handlers over it).

Request path of ``POST /v1/predict`` (every stage bounded):

1. admission: at most ``max_queue`` images anywhere in the path, else 503 + Retry-After (before
   the body is read; a batch request holds one slot while its body is read, then one per
   image);
2. the body (raw or multipart), at most ``max_upload_bytes`` (413 otherwise; multipart parts
   bounded by :mod:`.forms`);
3. decoding + preprocessing in the decode pool (``decode_workers`` threads; 400/413/415 for bad
   uploads): only these threads ever hold a full-size decoded image; what waits afterwards is the
   network input and a bounded preview;
4. the batcher gathers concurrent images into one backbone batch, run in the model thread;
5. verdict, pixel count and pictures in the decode pool; a verdict with a non-finite number is
   a fault of the model (500), and nothing of it is recorded;
6. the record is committed to the results log (group commit) *before* the response is sent.

The whole path runs under ``request_timeout_s`` (503 ``timeout``), up to the commit: a record
handed to the writer is answered, so a failed request never leaves a row. Before any of this,
the server's HTTP protocol (:mod:`.connections`) bounds how long a connection may take to send
its request head, and how many connections a client holds.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
import math
import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from anomaly_hooks.errors import AnomalyHooksError, ModelFileError
from anomaly_hooks.heap import keep_freed_memory, release_free_memory
from anomaly_hooks.prediction import Verdict
from anomaly_hooks.serve.batcher import Admission, Batcher, BatchInfo, Job
from anomaly_hooks.serve.connections import ConnectionGuard
from anomaly_hooks.serve.engine import (
    ModelEngine,
    Outcome,
    PreparedImage,
)
from anomaly_hooks.serve.engines import engine_class, load_engine
from anomaly_hooks.serve.errors import (
    ServeError,
    not_ready,
    results_not_ready,
    results_unavailable,
)
from anomaly_hooks.serve.metrics import ServiceMetrics
from anomaly_hooks.serve.modelpaths import inside_folder, load_cancelled
from anomaly_hooks.serve.monitoring import (
    MonitorRunner,
    monitor_enabled,
    observed_batch,
    optional_monitor,
)
from anomaly_hooks.serve.results import (
    INPUT_PICTURE,
    ImageFiles,
    Record,
    Recorder,
    ResultStore,
    SQLiteResultStore,
    StoreUnavailableError,
    iso_time,
)
from anomaly_hooks.serve.settings import RESULTS_FILE, ServeSettings
from anomaly_hooks.serve.slots import ModelSlot
from anomaly_hooks.serve.stores import open_store
from anomaly_hooks.serve.versions import Version, VersionShelf, VersionTrack

log = logging.getLogger("anomaly_hooks.serve")
# seconds /readyz waits for the results log's check (a database that vanished without closing
# its connections takes the connect timeout, 10 s, to fail: the probe says "not ready" sooner)
STORE_CHECK_TIMEOUT_S = 2.0

TRIM_INTERVAL_S = 5.0  # at most this often, the free C heap goes back to the system


class Service:
    """State and logic of one running service: its models (one :class:`.slots.ModelSlot`
    each: engine, batcher, drift monitor; the first the default model), one results log."""

    def __init__(self, settings: ServeSettings, *, monitor: Any = None,
                 store: Optional[ResultStore] = None,
                 on_fatal: Optional[Callable[[str], None]] = None) -> None:
        self.settings = settings
        # the models, by name (the first is the default one); a given monitor is the default's
        self.slots: Dict[str, ModelSlot] = {
            name: ModelSlot(name, path, default=i == 0, monitor_object=monitor if i == 0 else None)
            for i, (name, path) in enumerate((settings.models or {"default": settings.model})
                                             .items())}
        self.default = next(iter(self.slots.values()))
        self.started = time.time()
        # where POST /v1/admin/reload may load from (fixed at start, symbolic links resolved)
        self.models_dir = os.path.realpath(
            settings.models_dir or os.path.dirname(os.path.abspath(settings.model)))
        # the model files of --models-dir as versions, and the record of which one serves
        # (None without --models-dir)
        self.versions: Optional[VersionShelf] = (
            VersionShelf(self.models_dir).load() if settings.models_dir else None)
        # each model's --model path as started (the versions record's track follows it)
        self.model_options = {name: os.path.realpath(sl.path) for name, sl in self.slots.items()}
        self._store_given = store
        self.store: Optional[ResultStore] = None
        self.files: Optional[ImageFiles] = None
        self.recorder: Optional[Recorder] = None
        # the readiness check of the results log in flight (one at a time, however many probes)
        self._store_check: Optional["asyncio.Future[None]"] = None
        self.on_fatal = on_fatal
        self.admission = Admission(settings.max_queue)
        # consulted by the server's HTTP protocol (serve/server.py); unused in process
        self.connections = ConnectionGuard(
            header_timeout_s=settings.header_timeout_s, idle_timeout_s=settings.idle_timeout_s,
            max_connections=settings.max_connections,
            max_per_client=settings.max_connections_per_client)
        self.metrics = ServiceMetrics(
            queue_depth=lambda: sum(sl.batcher.depth for sl in self.slots.values()
                                    if sl.batcher is not None),
            in_flight=lambda: self.admission.used,
            engines=lambda: [(sl.name, sl.engine) for sl in self.slots.values()],
            drift_statuses=lambda: [(sl.name, sl.monitor.status() if sl.monitor else None)
                                    for sl in self.slots.values()],
            connections=self.connections.stats)
        # set when the server begins to stop: model loads (hashing a big file) stop at once
        self._stopping = threading.Event()
        self._last_trim = 0.0
        self._load_lock = asyncio.Lock()  # model loads, one at a time (see _load)
        self._tasks: List[asyncio.Task] = []
        self._sighup = False
        self._heap = contextlib.ExitStack()  # --keep-heap: freed memory kept (start to stop)

    # -- the default model (the routes without a model name) -------------------------------
    @property
    def engine(self) -> Optional[ModelEngine]:
        """The default model's engine (None while none is loaded)."""
        return self.default.engine

    @property
    def load_error(self) -> Optional[str]:
        return self.default.load_error

    @property
    def last_reload(self) -> Optional[Dict[str, Any]]:
        return self.default.last_reload

    @property
    def batcher(self) -> Optional[Batcher]:
        return self.default.batcher

    def slot(self, name: Optional[str] = None) -> ModelSlot:
        """The model ``name`` (None: the default one); 404 ``not_found`` for another name."""
        if name is None:
            return self.default
        found = self.slots.get(name)
        if found is None:
            raise ServeError(404, "not_found", f"no model {name[:100]!r} on this server: it "
                             f"serves {', '.join(self.slots)} (GET /v1/models)")
        return found

    # -- lifecycle -------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """The ASGI lifespan: started with the server, stopped with it."""
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def start(self) -> None:
        """Thread pools, results log and batcher; the model loads in the background."""
        self.loop = asyncio.get_running_loop()
        # --keep-heap: a job as long as the service, so that a batch's freed activations stay
        # in the heap for the next batch instead of being unmapped and faulted in again (the
        # free memory still goes back every TRIM_INTERVAL_S after a batch, and at stop)
        self._heap.enter_context(keep_freed_memory(self.settings.keep_heap))
        try:
            await self._start_parts()
        except BaseException:
            self._heap.close()
            raise

    async def _start_parts(self) -> None:
        """:meth:`start`'s pools, results log, batchers and tasks."""
        s = self.settings
        prepared = set()
        for sl in self.slots.values():
            with contextlib.suppress(ModelFileError):  # its load says it again, as fatal
                kind = engine_class(sl.path)
                if kind not in prepared:
                    kind.prepare_process()
                    prepared.add(kind)
        self.pool = ThreadPoolExecutor(s.decode_workers, thread_name_prefix="decode")
        self.model_thread = ThreadPoolExecutor(1, thread_name_prefix="model")
        self.aux = ThreadPoolExecutor(2, thread_name_prefix="aux")
        if self._store_given is not None or s.keeps_results:
            self.store = self._store_given or self._open_store()
            self.files = ImageFiles(s.results_dir) if s.results_dir else None
            self.recorder = Recorder(self.store)
            await self._warn_if_store_unavailable()
        wait_s = None if s.max_wait_ms is None else s.max_wait_ms / 1000.0
        for sl in self.slots.values():  # one batcher per model, one model thread for all
            sl.batcher = Batcher(max_batch=s.max_batch, max_wait_s=wait_s,
                                 max_queue=s.max_queue, executor=self.model_thread,
                                 on_batch=functools.partial(self._on_batch, sl))
            sl.batcher.start()
            self._tasks.append(self.loop.create_task(self._initial_load(sl),
                                                     name=f"model-load-{sl.name}"))
        if self.store is not None and (s.retention_days or s.retention_count):
            self._tasks.append(self.loop.create_task(self._retention_loop(), name="retention"))
        if s.sighup_reload and threading.current_thread() is threading.main_thread():
            try:
                self.loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
                self._sighup = True
            except (NotImplementedError, RuntimeError, ValueError, AttributeError):
                log.info("SIGHUP reload not available here")

    def _open_store(self) -> ResultStore:
        """The results log of the settings: ``results_db``, else results.sqlite in
        ``results_dir``."""
        s = self.settings
        if s.results_db:
            return open_store(s.results_db)
        return SQLiteResultStore(Path(s.results_dir or ".") / RESULTS_FILE)

    def begin_shutdown(self) -> None:
        """The server is stopping: model loads in progress stop now (a reload answers 503
        ``shutting_down``), so that neither the server's graceful wait for running requests
        nor the process's exit waits for one. Called first thing by the server's shutdown."""
        self._stopping.set()

    async def stop(self) -> None:
        """Stop the background tasks and the batcher, flush the results log, free the pools."""
        self.begin_shutdown()
        if self._sighup:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                self.loop.remove_signal_handler(signal.SIGHUP)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            # each task logged its own failure; shutting down goes on whatever it was
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for sl in self.slots.values():
            if sl.batcher is not None:
                await sl.batcher.stop()
        if self.recorder is not None:
            await self.loop.run_in_executor(None, self.recorder.close)
        if self.store is not None:
            self.store.close()
        for sl in self.slots.values():
            if sl.monitor is not None:
                sl.monitor.close()
        for pool in (self.pool, self.model_thread, self.aux):
            pool.shutdown(wait=False, cancel_futures=True)
        self._heap.close()

    async def _initial_load(self, slot: ModelSlot) -> None:
        engine = await self._load_promoted(slot)
        # broad catches: whatever stops the model (or its monitor) from loading must reach
        # /readyz and on_fatal; a narrower catch would leave the server "loading" for ever
        try:
            if engine is None:
                engine = await self._load(slot.path)
        except Exception as exc:  # noqa: BLE001
            if self._stopping.is_set():
                return None
            return self._fatal(error_text(exc), slot)
        try:
            monitor = (MonitorRunner(slot.monitor_object) if slot.monitor_object is not None
                       else await self._build_monitor(engine))
        except Exception as exc:  # noqa: BLE001
            return self._fatal(f"drift monitor: {error_text(exc)}", slot)
        if slot.engine is None:  # a reload that finished first wins
            self._swap(slot, engine, monitor)
            log.info("serving %s%s (%s, loaded and warm in %.1f s)", engine.model_id,
                     self._as(slot), engine.path, engine.load_seconds)
            await self._record_start(engine, slot)
        elif monitor is not None and monitor is not slot.monitor:
            monitor.close()

    def _as(self, slot: ModelSlot) -> str:
        """`` as NAME`` in a log line, on a server of several models."""
        return f" as {slot.name}" if len(self.slots) > 1 else ""

    async def _load_promoted(self, slot: ModelSlot) -> Optional[ModelEngine]:
        """The version of ``slot``'s model promoted last, loaded, when the versions record
        names one for its ``--model`` path (a promote outlives a restart; a new ``--model`` on
        the command line wins); None to load that path (also when the promoted file cannot be
        served any more: said in the log)."""
        shelf = self.versions
        track = self._track(slot) if shelf is not None else None
        entry = track.serving if track is not None else None
        option = self.model_options[slot.name]
        if (shelf is None or track is None or entry is None or track.model_option != option
                or "/" in entry["name"]):
            return None
        path = os.path.join(shelf.folder, entry["name"])
        if os.path.realpath(path) == option:
            return None
        try:
            engine = await self._load(path)
        # broad: whatever refuses the promoted file, --model is served instead
        except Exception as exc:  # noqa: BLE001
            if not self._stopping.is_set():
                log.warning("the promoted version %s%s cannot be served (%s): serving --model "
                            "%s", entry["name"], self._as(slot), error_text(exc), slot.path)
            return None
        if engine.sha256 != entry["checksum"]:
            log.warning("the promoted version %s%s has changed since it was promoted (checksum "
                        "%s, not %s): serving --model %s", entry["name"], self._as(slot),
                        engine.sha256[:12], entry["checksum"][:12], slot.path)
            return None
        log.info("serving the promoted version %s%s (the versions record %s) rather than "
                 "--model %s", entry["name"], self._as(slot), shelf.state_path, slot.path)
        slot.path = engine.path
        if slot.default:
            self.settings.model = engine.path
        return engine

    async def _record_start(self, engine: ModelEngine, slot: ModelSlot) -> None:
        """The versions record names the model ``slot`` serves at start (written only where a
        record exists already: a server that never switched models leaves the folder as it
        is)."""
        shelf = self.versions
        if shelf is None:
            return
        track = self._track(slot)
        entry = self._version_entry(engine)
        option = self.model_options[slot.name]
        serving = track.serving or {}
        if (serving.get("name"), serving.get("checksum"), track.model_option) == (
                entry["name"], entry["checksum"], option):
            return
        track.serving = {**entry, "since": iso_time(time.time())}
        track.model_option = option
        if shelf.recorded:
            await self._save_versions()

    def _fatal(self, message: str, slot: ModelSlot) -> None:
        """A model cannot be served: say why on /readyz and to ``on_fatal``."""
        if len(self.slots) > 1:
            message = f"model {slot.name}: {message}"
        slot.load_error = message
        log.error("the model could not be loaded: %s", message)
        if self.on_fatal is not None:
            self.on_fatal(message)

    async def _retention_loop(self) -> None:
        while True:
            try:
                await self.prune()
            except StoreUnavailableError as exc:  # a passing state: tried again next time
                log.warning("results-log retention skipped: %s", exc)
            # broad: retention keeps running whatever one pass met (a locked database, a
            # full disk, a store plug-in's own error); each failure is logged
            except Exception:
                log.exception("results-log retention failed")
            await asyncio.sleep(self.settings.retention_interval_s)

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

    async def _warn_if_store_unavailable(self) -> None:
        """Log one warning when the results log could not record at start (another program
        holding the SQLite file locked, say): the service starts all the same, and ``/readyz``
        answers 503 with the reason until the log is back."""
        try:
            await self.require_store()
        except ServeError as exc:
            log.warning("at start, %s (/readyz answers 503 until the log is back, then the "
                        "service turns ready by itself)", exc.message)

    async def require_store(self) -> None:
        """503 ``results_unavailable`` (why, in its message) unless the results log could
        record a prediction now (:meth:`ResultStore.check`, at most
        :data:`STORE_CHECK_TIMEOUT_S`); nothing without a log. Concurrent callers share one
        check, so probes of a hung database do not pile up threads."""
        if self.store is None:
            return
        if self._store_check is None or self._store_check.done():
            self._store_check = self.loop.run_in_executor(self.aux, self.store.check)
        try:
            await asyncio.wait_for(asyncio.shield(self._store_check), STORE_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise results_not_ready(f"it did not answer a check within "
                                    f"{STORE_CHECK_TIMEOUT_S:g} s") from None
        except StoreUnavailableError as exc:
            raise results_not_ready(exc) from None
        # broad: whatever else fails the check (a disk error, a store plug-in's own error)
        # would fail every prediction's record too
        except Exception as exc:  # noqa: BLE001
            raise results_not_ready(f"{type(exc).__name__}: {exc}") from None

    # -- model -----------------------------------------------------------------------------
    def require_engine(self, slot: Optional[ModelSlot] = None) -> ModelEngine:
        """The serving model of ``slot`` (default: the default model), or 503 ``not_ready``
        (loading, or refused: why)."""
        slot = slot or self.default
        engine = slot.engine
        if engine is None:
            if slot.load_error:
                raise not_ready(f"no model loaded: {slot.load_error}", 30)
            what = f"the model {slot.name}" if len(self.slots) > 1 else "the model"
            raise not_ready(f"{what} is still loading", 5)
        return engine

    def reload_target(self, path: str) -> str:
        """The real path of a reload asked for over HTTP; 403 outside :attr:`models_dir`."""
        return inside_folder(path, self.models_dir)

    async def reload(self, path: Optional[str] = None, *, expect_sha256: Optional[str] = None,
                     rollback_of: Optional[Dict[str, Any]] = None,
                     slot: Optional[ModelSlot] = None) -> Dict[str, Any]:
        """Load ``path`` (default: the current model path) beside the serving model, warm it up,
        then swap. In-flight requests finish on the model that preprocessed them.

        With ``--models-dir``, the switch is recorded (:attr:`versions`): the model before goes
        on the rollback stack, or ``rollback_of`` (the stack's top) comes off it.
        ``expect_sha256``: refuse a file whose checksum is another (it changed since it was
        listed). ``slot``: the model to reload (default: the default model); each model has
        its own serving version and rollback stack in the record."""
        slot = slot or self.default
        if self._stopping.is_set():
            raise load_cancelled()
        if slot.reloading:
            raise ServeError(409, "reload_in_progress", "a model reload is already running")
        slot.reloading = True
        target = path or slot.path
        old = slot.engine
        try:
            new, monitor = await self._load_beside(slot, target, old, expect_sha256)
            self._swap(slot, new, monitor)
            slot.path = target
            if slot.default:
                self.settings.model = target
            slot.load_error = None
            self.metrics.reloads.labels(slot.name, "ok").inc()
            result = {"reloaded": True, "model": slot.name, "model_id": new.model_id,
                      "previous_model_id": old.model_id if old else None, "path": target,
                      "unchanged": bool(old and old.sha256 == new.sha256),
                      "seconds": round(new.load_seconds, 3)}
            slot.last_reload = {"ok": True, "at": iso_time(time.time()), **result}
            log.info("reloaded%s: now serving %s (was %s)", self._as(slot), new.model_id,
                     result["previous_model_id"])
            await self._record_switch(old, new, rollback_of, slot)
            return result
        finally:
            slot.reloading = False

    async def _load_beside(self, slot: ModelSlot, target: str, old: Optional[ModelEngine],
                           expect_sha256: Optional[str] = None
                           ) -> Tuple[ModelEngine, Optional[MonitorRunner]]:
        """The new engine and its monitor, or the refusal (422) to answer."""
        try:
            new = await self._load(target)
        # broad: a refused file must never take the serving model down; whatever a file
        # makes the loader raise, the answer is "refused" and the old model serves on
        except Exception as exc:  # noqa: BLE001
            if self._stopping.is_set():
                raise load_cancelled() from None
            raise self._refused(slot, target, error_text(exc), old) from None
        if expect_sha256 is not None and new.sha256 != expect_sha256:
            raise self._refused(slot, target, f"its checksum is now {new.sha256[:12]}…, not the "
                                f"{expect_sha256[:12]}… it was asked for by (the file changed "
                                "since; list the versions again)", old)
        try:
            return new, await self._monitor_for(slot, old, new)
        except Exception as exc:  # noqa: BLE001  (a monitor factory is the user's code)
            raise self._refused(slot, target, f"its drift monitor cannot be built: "
                                f"{error_text(exc)}", old) from None

    async def _load(self, path: str) -> ModelEngine:
        """:func:`~.engines.load_engine` (the engine by the file's suffix) in the aux pool,
        stopped by :meth:`begin_shutdown`; one load at a time, whatever the model.

        One at a time: building a model touches process-wide state (a backbone initialised
        from a seed draws from torch's global random generator; two loads at once drew each
        other's numbers, and the second model was refused for weights that differ from its
        fit's), and it leaves the other aux thread to the routes meanwhile."""
        async with self._load_lock:
            return await self.loop.run_in_executor(self.aux, functools.partial(
                load_engine, path, self.settings.device, cancel=self._stopping))

    def _refused(self, slot: ModelSlot, target: str, msg: str, old: Optional[ModelEngine]
                 ) -> ServeError:
        """Record and log a refused reload; the error to answer (the old model serves on)."""
        self.metrics.reloads.labels(slot.name, "failed").inc()
        serving = old.model_id if old else None
        slot.last_reload = {"ok": False, "at": iso_time(time.time()), "path": target,
                            "error": msg, "serving": serving}
        log.error("reload of %s refused: %s", target, msg)
        keep = f"; still serving {serving}" if serving else "; no model is loaded"
        return ServeError(422, "reload_failed", f"the new model was refused: {msg}{keep}")

    # -- versions (--models-dir) -----------------------------------------------------------
    def require_versions(self) -> VersionShelf:
        """The versions of ``--models-dir``; 404 on a server started without it."""
        if self.versions is None:
            raise ServeError(404, "not_found", "model versions are the files of a models "
                             "folder: start the server with --models-dir to list, promote and "
                             "roll back versions")
        return self.versions

    def _track(self, slot: ModelSlot) -> VersionTrack:
        """The versions record's track of ``slot``'s model (the default model's at the top)."""
        assert self.versions is not None
        return self.versions.track(None if slot.default else slot.name)

    def _version_entry(self, engine: ModelEngine) -> Dict[str, Any]:
        assert self.versions is not None
        return {"name": self.versions.name_of(engine.path), "checksum": engine.sha256}

    async def _record_switch(self, old: Optional[ModelEngine], new: ModelEngine,
                             rollback_of: Optional[Dict[str, Any]], slot: ModelSlot) -> None:
        """Record a reload of ``slot``'s model in the versions record (see :meth:`reload`)."""
        if self.versions is None:
            return
        track = self._track(slot)
        entry = self._version_entry(new)
        serving = track.serving or {}
        if (rollback_of is None and old is not None and old.sha256 == new.sha256
                and (serving.get("name"), serving.get("checksum")) == (entry["name"],
                                                                        entry["checksum"])):
            return  # the same file again: nothing to record
        track.switched(self._version_entry(old) if old is not None else None, entry,
                       rollback_of=rollback_of)
        track.model_option = self.model_options[slot.name]
        await self._save_versions()

    async def _save_versions(self) -> None:
        """Write the versions record (atomically); a failure is logged, the switch stands."""
        shelf = self.versions
        assert shelf is not None
        try:
            await self.loop.run_in_executor(self.aux, shelf.save, shelf.snapshot())
        except OSError as exc:
            log.error("the versions record %s could not be written (%s): the rollback stack "
                      "will not outlive a restart", shelf.state_path, exc)

    def serving_version(self, slot: Optional[ModelSlot] = None) -> Optional[Dict[str, Any]]:
        """The serving version of ``slot``'s model (default: the default model) for
        ``GET /v1/model``: its name and checksum, since when, and what a rollback returns to
        (None without ``--models-dir`` or a model)."""
        slot = slot or self.default
        engine = slot.engine
        if self.versions is None or engine is None:
            return None
        track = self._track(slot)
        entry = self._version_entry(engine)
        serving = track.serving or {}
        same = (serving.get("name"), serving.get("checksum")) == (entry["name"],
                                                                   entry["checksum"])
        return {**entry, "since": serving.get("since") if same else None,
                "previous": dict(track.history[-1]) if track.history else None,
                "rollbacks": len(track.history)}

    async def list_versions(self, slot: Optional[ModelSlot] = None) -> Dict[str, Any]:
        """``GET /v1/models/versions``: the folder's versions, newest first, which one
        serves ``slot``'s model (default: the default model), and its rollback stack (newest
        first: ``history[0]`` is what a rollback returns to)."""
        slot = slot or self.default
        shelf = self.require_versions()
        found = await self.loop.run_in_executor(self.aux, shelf.scan, self._stopping)
        engine = slot.engine
        by_content = {}
        for v in found:
            for key in (v.content_checksum, v.checksum):
                if key:
                    by_content.setdefault(key, v.name)
        rows = []
        for v in found:
            row = v.as_dict()
            row["serving"] = bool(engine is not None and v.checksum == engine.sha256
                                  and v.path == os.path.realpath(engine.path))
            if row["lineage"] is not None:
                row["lineage"] = {**row["lineage"], "parent_version": by_content.get(
                    row["lineage"]["parent_checksum"])}
            rows.append(row)
        history = self._track(slot).history
        return {"folder": shelf.folder, "model": slot.name,
                "serving": self.serving_version(slot), "count": len(rows), "versions": rows,
                "history": [dict(e) for e in reversed(history)]}

    async def promote(self, ref: str, slot: Optional[ModelSlot] = None) -> Dict[str, Any]:
        """Serve the version ``ref`` (a file name of the folder or a checksum prefix) as
        ``slot``'s model (default: the default model): a :meth:`reload` of its file, recorded
        (the serving one goes on that model's rollback stack)."""
        slot = slot or self.default
        shelf = self.require_versions()
        if slot.reloading:
            raise ServeError(409, "reload_in_progress", "a model reload is already running")
        version: Version = await self.loop.run_in_executor(self.aux, shelf.resolve, ref,
                                                           self._stopping)
        # by checksum: exactly that content, or nothing
        expect = version.checksum if ref != version.name else None
        result = await self.reload(version.path, expect_sha256=expect, slot=slot)
        return {**result, "version": version.name,
                "rollbacks": len(self._track(slot).history)}

    async def rollback(self, slot: Optional[ModelSlot] = None) -> Dict[str, Any]:
        """Serve the version before the serving one of ``slot``'s model (default: the default
        model) again (its rollback stack's top): 409 ``no_previous_version`` when there is
        none, or when its file is no longer there."""
        slot = slot or self.default
        shelf = self.require_versions()
        if slot.reloading:
            raise ServeError(409, "reload_in_progress", "a model reload is already running")
        track = self._track(slot)
        if not track.history:
            raise ServeError(409, "no_previous_version", f"there is no earlier version to roll "
                             f"back to{self._as(slot)}: nothing was promoted before the serving "
                             "version (the rollback stack is empty)")
        top = track.history[-1]
        version = await self.loop.run_in_executor(
            self.aux, functools.partial(shelf.by_checksum, top["checksum"], top["name"],
                                        self._stopping))
        if version is None:
            raise ServeError(409, "no_previous_version", f"the previous version {top['name']} "
                             f"(checksum {top['checksum'][:12]}…) is no longer in the models "
                             "folder: restore its file, or promote another version")
        result = await self.reload(version.path, expect_sha256=top["checksum"], rollback_of=top,
                                   slot=slot)
        return {**result, "version": version.name, "rollbacks": len(track.history)}

    @property
    def monitor(self) -> Optional[MonitorRunner]:
        """The drift monitor fed by the default model's batches (None: no monitor)."""
        return self.default.monitor

    @property
    def drift_unavailable(self) -> Optional[str]:
        """:meth:`drift_unavailable_for` the default model."""
        return self.drift_unavailable_for(self.default)

    def drift_unavailable_for(self, slot: ModelSlot) -> Optional[str]:
        """Why the model of ``slot`` runs without the drift monitor it was asked for (an engine
        that cannot feed one: ``GET /v1/drift`` answers 409 with it), else None."""
        engine = slot.engine
        if (engine is None or slot.monitor is not None
                or not monitor_enabled(self.settings.monitor)):
            return None
        return engine.drift_unavailable

    async def _build_monitor(self, engine: ModelEngine) -> Optional[MonitorRunner]:
        """The configured monitor (``--monitor``) for ``engine``'s model file, or None (also
        for an engine that cannot feed one: :attr:`drift_unavailable`)."""
        if engine.drift_unavailable is not None:
            if monitor_enabled(self.settings.monitor):
                log.warning("no drift monitor for %s: %s", engine.model_id,
                            engine.drift_unavailable)
            return None
        return await self.loop.run_in_executor(self.aux, optional_monitor,
                                               self.settings.monitor, engine.detector)

    async def _monitor_for(self, slot: ModelSlot, old: Optional[ModelEngine], new: ModelEngine
                           ) -> Optional[MonitorRunner]:
        """The monitor to run with ``new``: the same one for a given monitor object or an
        unchanged file (its window carries on), else one built from the new file's reference
        -- a reloaded model has its own reference, and the old one's would see only drift."""
        if slot.monitor_object is not None or (old is not None and old.sha256 == new.sha256):
            return slot.monitor
        return await self._build_monitor(new)

    def _swap(self, slot: ModelSlot, engine: ModelEngine, monitor: Optional[MonitorRunner]
              ) -> None:
        """Serve ``engine`` with ``monitor`` as the model of ``slot`` from the next batch on
        (one step on the loop)."""
        previous = slot.monitor
        slot.engine = engine
        if self.settings.keep_inputs and engine.kind != "torch":
            log.warning("--keep-inputs: %s is a %s model, which keeps no network inputs (the "
                        "updates run the library's torch preprocessing: they decode its kept "
                        "originals)", engine.path, engine.kind)
        slot.monitoring = (monitor, engine if slot.monitor_object is None else None)
        if slot.batcher is not None:  # the layers' channel means go to the monitor
            slot.batcher.collect_features = monitor is not None
        if previous is not None and previous is not monitor:
            previous.close()

    def _on_sighup(self) -> None:
        async def run() -> None:
            for slot in list(self.slots.values()):  # each model's file again, in turn
                try:
                    await self.reload(slot=slot)
                except ServeError as exc:
                    log.error("SIGHUP reload%s: %s", self._as(slot), exc.message)
        # finished ones go: a SIGHUP storm must not grow the list for ever
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(self.loop.create_task(run(), name="sighup-reload"))

    # -- batches ---------------------------------------------------------------------------
    def _on_batch(self, slot: ModelSlot, engine: ModelEngine, jobs: List[Job], scores: Any,
                  info: BatchInfo, features: Optional[Dict[str, Any]] = None) -> None:
        self.metrics.batch_size.labels(slot.name).observe(info.size)
        self.metrics.batch_seconds.labels(slot.name).observe(info.seconds)
        now = time.monotonic()
        if now - self._last_trim >= TRIM_INTERVAL_S:
            self._last_trim = now
            self.aux.submit(release_free_memory)
        monitor, built_for = slot.monitoring
        # a batch still scored by the model before a reload stays out of the new one's window
        if monitor is None or (built_for is not None and built_for is not engine):
            return
        # an image without a finite score got no verdict (500): it stays out of the window,
        # where one NaN would spoil every statistic until it leaves
        keep = np.isfinite(np.asarray(scores, dtype=np.float64))
        if not keep.any():
            return
        tensors = [j.tensor for j, k in zip(jobs, keep) if k]
        sizes = [j.size for j, k in zip(jobs, keep) if k]
        scores = np.asarray(scores)[keep]
        if features is not None and not keep.all():
            features = {name: values[keep] for name, values in features.items()}
        stamp = time.time()
        if not monitor.offer(lambda: observed_batch(engine, tensors, scores, stamp, features,
                                                    sizes)):
            self.metrics.drift_dropped.inc()

    # -- predictions -----------------------------------------------------------------------
    async def predict_bytes(self, data: bytes, *, part_id: Optional[str], source: Optional[str],
                            heatmap: str, t_start: float, read_ms: float,
                            slot: Optional[ModelSlot] = None) -> Dict[str, Any]:
        """Score one uploaded image end to end with the model of ``slot`` (default: the
        default model) (the JSON of :class:`.schemas.Prediction`); the record is durable when
        this returns."""
        slot = slot or self.default
        engine = self.require_engine(slot)
        marks = {"start": t_start, "decode": time.perf_counter()}
        item = await self._prepare(engine, data)
        # the upload as sent, while the results log may keep it (--keep-originals)
        original: Optional[bytes] = data if self._keeps_originals() else None
        del data
        # ... and the network input beside it (--keep-inputs)
        tensor = item.tensor if original is not None and self.settings.keep_inputs else None
        marks["decoded"] = time.perf_counter()
        assert slot.batcher is not None
        score, heat, info = await slot.batcher.submit(item.tensor, engine,
                                                      (item.height, item.width))
        item.tensor = None
        marks["inferred"] = time.perf_counter()
        outcome = await self._finish(engine, score, heat, item, heatmap)
        verdict = outcome.verdict
        check_finite(verdict, engine)
        self.metrics.observe_prediction(slot.name, verdict.normalized_score, verdict.is_anomalous)
        marks["post"] = time.perf_counter()
        record = Record(time=time.time(), request_id=uuid.uuid4().hex, verdict=verdict,
                        model_id=engine.model_id, model_checksum=engine.sha256,
                        model_name=slot.name, part_id=part_id, source=source,
                        width=item.width, height=item.height)
        if self.recorder is not None:
            record.latency_ms = round((time.perf_counter() - t_start) * 1000, 3)
            kept = self._kept_pictures(outcome, heatmap)
            kept["original"] = original if self._keep_original(verdict) else None
            if tensor is not None and kept["original"] is not None:
                kept[INPUT_PICTURE] = await self._input_file(engine, tensor, item)
            del tensor
            await self._record(record, kept, item.format)
        marks["done"] = time.perf_counter()
        body: Dict[str, Any] = {
            "id": record.id, "request_id": record.request_id, "time": iso_time(record.time),
            "part_id": part_id, "source": source, **verdict.as_dict(),
            "image": {"width": item.width, "height": item.height, "format": item.format},
            "model": {"id": engine.model_id, "sha256": engine.sha256, "name": slot.name},
            "timing_ms": _timing(marks, read_ms, info)}
        if heatmap == "png":
            body["overlay_png"] = base64.b64encode(outcome.overlay_png or b"").decode()
            body["mask_png"] = base64.b64encode(outcome.mask_png or b"").decode()
        if record.id is not None:
            body.update((k, url) for k, url in record.picture_urls().items() if url)
        return body

    async def _prepare(self, engine: ModelEngine, data: bytes) -> PreparedImage:
        """Decode and preprocess in the decode pool (a refused upload is counted)."""
        s = self.settings
        try:
            return await self.loop.run_in_executor(
                self.pool, engine.prepare, data, s.max_pixels, s.overlay_max_side)
        except ServeError as exc:
            self.metrics.rejected.labels(exc.code).inc()
            raise
        # broad: the reader refuses bad uploads with a ServeError; anything else is a fault
        # of the model's preprocessing, answered as such (a batch's other images go on)
        except Exception as exc:  # noqa: BLE001
            raise model_fault("preprocessing", exc, engine) from None

    async def _input_file(self, engine: ModelEngine, tensor: Any, item: PreparedImage
                          ) -> Optional[bytes]:
        """The kept-input file of ``tensor`` (decode pool); None where the engine keeps none
        or it fails (logged: the original is kept all the same, an update decodes it)."""
        try:
            return await self.loop.run_in_executor(
                self.pool, engine.input_file, tensor, (item.height, item.width))
        except Exception as exc:  # noqa: BLE001 (the prediction and its original stand)
            log.warning("the network input of an upload could not be kept (%s: %s)",
                        type(exc).__name__, exc)
            return None

    def _keep(self) -> str:
        """Which pictures the results log keeps (none without a folder for them)."""
        return self.settings.keep_images if self.files is not None else "none"

    def _keeps_originals(self) -> bool:
        """Whether the results log keeps original uploads (none without a folder for them)."""
        return self.settings.keep_originals != "none" and self.files is not None

    def _keep_original(self, verdict: Verdict) -> bool:
        """Whether the original upload of the image judged ``verdict`` is kept."""
        keep = self.settings.keep_originals if self.files is not None else "none"
        return keep == "all" or (keep == "anomalous" and bool(verdict.is_anomalous))

    async def _finish(self, engine: ModelEngine, score: float, heat: Any, item: PreparedImage,
                      heatmap: str) -> Outcome:
        """Verdict and the pictures the response or the results log needs (decode pool)."""
        s = self.settings
        keep = self._keep()
        try:
            return await self.loop.run_in_executor(self.pool, functools.partial(
                engine.finish, score, heat, item, overlay=heatmap != "none" or keep == "all",
                keep_anomalous=keep == "anomalous",
                thumb_side=s.thumb_side if (s.thumbnails and self.files is not None) else 0))
        # broad: the verdict and pictures come from the model's threshold and heatmap; what
        # they make fail (a zero scale divides by zero) is the model's fault
        except Exception as exc:  # noqa: BLE001
            raise model_fault("the verdict", exc, engine) from None

    def _kept_pictures(self, outcome: Outcome, heatmap: str) -> Dict[str, Optional[bytes]]:
        """The pictures to keep with the record (kind -> bytes, or None)."""
        keep = self._keep()
        keep_overlay = (heatmap == "url" or keep == "all"
                        or (keep == "anomalous" and outcome.verdict.is_anomalous))
        return {"overlay": outcome.overlay_png if keep_overlay else None,
                "mask": outcome.mask_png if keep_overlay else None,
                "thumb": outcome.thumb_jpg}

    async def _record(self, record: Record, pictures: Dict[str, Optional[bytes]],
                      original_format: Optional[str] = None) -> None:
        """Write the pictures (``original_format``: the format of the ``original`` upload),
        then commit the record (durable on return; sets its id)."""
        assert self.recorder is not None
        try:
            if self.files is not None and any(pictures.values()):
                paths = await self.loop.run_in_executor(
                    self.pool, self.files.write, record.request_id, record.time, pictures,
                    original_format)
                record.overlay_path = paths.get("overlay")
                record.mask_path = paths.get("mask")
                record.thumb_path = paths.get("thumb")
                record.original_path = paths.get("original")
            # the point of no return: a record handed to the writer will be committed, so the
            # request answers with it, whatever its timeout says meanwhile
            record.id = await until_done(asyncio.wrap_future(self.recorder.submit(record)))
        except asyncio.CancelledError:
            raise
        except StoreUnavailableError as exc:
            self.metrics.log_errors.inc()
            if self.files is not None and not exc.outcome_unknown:
                # no row will name them: the pictures go too (a commit of unknown outcome
                # keeps them, in case its row was stored)
                await self.loop.run_in_executor(self.pool, self.files.delete, [record])
            raise results_unavailable(exc) from None
        # broad: a store plug-in may raise anything; the client must learn that its
        # prediction was not recorded (500), never get an answer for a record that is not
        except Exception as exc:  # noqa: BLE001
            self.metrics.log_errors.inc()
            raise ServeError(500, "internal_error",
                             f"the prediction could not be written to the results log "
                             f"({type(exc).__name__}: {exc})") from None

    async def with_timeout(self, coro: Awaitable[Any]) -> Any:
        """``coro`` under the request timeout (503 ``timeout`` + Retry-After past it)."""
        try:
            return await asyncio.wait_for(coro, self.settings.request_timeout_s)
        except asyncio.TimeoutError:
            raise self.timeout_error() from None

    def timeout_error(self) -> ServeError:
        """503 ``timeout``: the request took longer than the request timeout."""
        return ServeError(503, "timeout", f"the request took longer than "
                          f"{self.settings.request_timeout_s:g} s (the server's "
                          "--request-timeout); the server is busy, retry later",
                          # closed: the rest of a slow body is not waited for
                          {"Retry-After": str(self.batcher.retry_after()
                                              if self.batcher else 5),
                           "Connection": "close"})

    async def each_within(self, coros: List[Awaitable[Any]], timeout: float) -> List[Any]:
        """Run ``coros`` together for at most ``timeout`` seconds. Each one's outcome, in
        order: its result, or its :class:`ServeError` (another exception: a 500 one, logged),
        or :meth:`timeout_error` if it was not done in time -- one already committing its
        record finishes with it (:func:`until_done`): a failed image leaves no row, a recorded
        one is answered."""
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, timeout))
        finally:  # also when the request itself is cancelled
            for task in tasks:
                task.cancel()
        if pending:
            await asyncio.wait(pending)
        return [self._outcome(task) for task in tasks]

    def _outcome(self, task: "asyncio.Future[Any]") -> Any:
        if task.cancelled():
            return self.timeout_error()
        exc = task.exception()
        if exc is None:
            return task.result()
        if isinstance(exc, ServeError):
            return exc
        log.error("an image of a batch failed", exc_info=exc)
        return ServeError(500, "internal_error", f"the image could not be scored "
                          f"({error_text(exc)}); nothing recorded")

    @contextlib.contextmanager
    def admit(self, n: int) -> Iterator[None]:
        """Hold ``n`` images of the admission count (503 ``overloaded`` when full)."""
        assert self.batcher is not None
        self.admission.acquire(n, self.batcher.retry_after)
        try:
            yield
        finally:
            self.admission.release(n)


async def until_done(fut: "asyncio.Future[Any]") -> Any:
    """``fut``'s result, awaited to the end even when the awaiting task is cancelled meanwhile
    (the cancellation is then dropped: the task goes on with the result)."""
    while True:
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if fut.cancelled():
                raise
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):  # Python 3.11+
                task.uncancel()


def check_finite(verdict: Any, engine: ModelEngine) -> None:
    """A verdict with a non-finite score, normalised score or threshold is no verdict (a NaN
    score would read as "not anomalous"): 500 ``internal_error``, and nothing is recorded."""
    bad = [f"{name}={value}" for name in ("score", "normalized_score", "threshold")
           if not math.isfinite(value := getattr(verdict, name))]
    if bad:
        raise ServeError(500, "internal_error",
                         f"the model {engine.model_id} gave {', '.join(bad)} for this image: "
                         "no verdict, nothing recorded; check the model file (refit or restore "
                         "it)")


def model_fault(stage: str, exc: BaseException, engine: ModelEngine) -> ServeError:
    """500 ``internal_error`` for an unexpected failure of the model's ``stage``."""
    log.error("%s failed on model %s: %s", stage, engine.model_id, error_text(exc))
    return ServeError(500, "internal_error", f"{stage} failed on the model {engine.model_id} "
                      f"({type(exc).__name__}: {exc}); nothing recorded")


def _timing(marks: Dict[str, float], read_ms: float, info: BatchInfo) -> Dict[str, Any]:
    """The response's ``timing_ms`` from the request's time marks (perf_counter seconds)."""
    def ms(a: str, b: str) -> float:
        return round((marks[b] - marks[a]) * 1000, 3)

    return {"read": round(read_ms, 3), "decode": ms("decode", "decoded"),
            "queue": round(max(0.0, info.started - marks["decoded"]) * 1000, 3),
            "inference": round(info.seconds * 1000, 3), "batch_size": info.size,
            "postprocess": ms("inferred", "post"), "log": ms("post", "done"),
            "total": ms("start", "done")}


def error_text(exc: BaseException) -> str:
    """An error's message for a client: the library's own errors as they are, anything else
    with its type (it is likely a bug, and the type helps to find it)."""
    text = str(exc)
    if not text:
        return type(exc).__name__
    known = (AnomalyHooksError, FileNotFoundError, ValueError)
    return text if isinstance(exc, known) else f"{type(exc).__name__}: {text}"
