"""The results log: every prediction the service makes, for traceability.

* :class:`ResultStore` is the small interface the service uses (add, query, get, count, prune);
  :class:`SQLiteResultStore` implements it on an embedded SQLite database in WAL mode with
  ``synchronous=FULL``: a record is on disk when :meth:`ResultStore.add` returns, and the service
  answers a request only after that, so a ``kill -9`` (or a power cut) loses nothing that was
  acknowledged. :class:`~anomaly_hooks.serve.pgstore.PostgresResultStore` (the ``[postgres]``
  extra) keeps it on a PostgreSQL server that several replicas share; another database plugs in
  by implementing the same six methods.
* :class:`ImageFiles` keeps the overlay / mask / thumbnail PNGs and JPEGs, and the original
  uploads (``--keep-originals``: the images a model update learns from), under a folder; the
  records hold their paths relative to it.
* :class:`Recorder` is the group commit: request handlers hand their record to one writer
  thread, which commits whatever has accumulated in one transaction (one fsync for many records)
  and then wakes the handlers.

Scores: higher = more anomalous. Times are Unix seconds (UTC) in the store, ISO 8601 in JSON/CSV.
"""
from __future__ import annotations

import abc
import contextlib
import csv
import io
import logging
import math
import os
import queue
import sqlite3
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from anomaly_hooks.errors import AnomalyHooksError, ConfigError
from anomaly_hooks.outputs import csv_cell
from anomaly_hooks.prediction import VERDICT_FIELDS, Verdict

log = logging.getLogger("anomaly_hooks.serve")


@dataclass
class Record:
    """One prediction: its verdict and where, when and by which model it was made."""

    time: float
    request_id: str
    verdict: Verdict
    model_id: str
    model_checksum: str
    model_name: Optional[str] = None     # the server's name of the model (None: before names)
    part_id: Optional[str] = None
    source: Optional[str] = None
    width: Optional[int] = None
    height: Optional[int] = None
    overlay_path: Optional[str] = None
    mask_path: Optional[str] = None
    thumb_path: Optional[str] = None
    original_path: Optional[str] = None  # the uploaded image's own bytes (--keep-originals)
    latency_ms: Optional[float] = None
    label: Optional[str] = None          # the operator's label: good, defect, or None (none)
    label_note: Optional[str] = None
    label_by: Optional[str] = None       # who set it (a token's fingerprint)
    label_at: Optional[float] = None     # when (Unix seconds)
    id: Optional[int] = None

    def flat(self) -> Dict[str, Any]:
        """The record as one flat mapping: the verdict's fields beside the others (its JSON,
        CSV and SQL rows; every non-finite float as None)."""
        out = {f.name: _finite_or_none(getattr(self, f.name)) for f in fields(self)
               if f.name != "verdict"}
        return {**self.verdict.as_dict(), **out}

    def picture_urls(self) -> Dict[str, Optional[str]]:
        """``{overlay,mask,thumb}_url``: where each stored picture is served (None: none)."""
        return {f"{kind}_url": (f"/v1/results/{self.id}/{name}"
                                if getattr(self, f"{kind}_path") and self.id is not None
                                else None)
                for kind, name in PICTURES.items()}

    def as_json(self) -> Dict[str, Any]:
        """JSON form: ISO time, URLs of the stored pictures (no server paths)."""
        out = self.flat()
        for kind in PICTURES:
            del out[f"{kind}_path"]
        return {**out, "time_iso": iso_time_or_none(self.time),
                "label_at_iso": iso_time_or_none(self.label_at), **self.picture_urls()}


# the other fields, then the verdict's: the SQL columns (the table's names, in any order)
META_COLUMNS = [f.name for f in fields(Record) if f.name not in ("id", "verdict")]
COLUMNS = META_COLUMNS + VERDICT_FIELDS
# kind -> the name of its route (/v1/results/{id}/<name>); the original keeps its upload's
# format, its file its own extension (ORIGINAL_EXTENSIONS)
PICTURES = {"overlay": "overlay.png", "mask": "mask.png", "thumb": "thumb.jpg",
            "original": "original"}
# beside a kept original, its network input (--keep-inputs; anomaly_hooks.keptinputs): a file
# of the pictures folder that no record names, found from the original's name
INPUT_PICTURE, INPUT_EXTENSION = "input", "safetensors"
ORIGINAL_EXTENSIONS = {"PNG": "png", "JPEG": "jpg", "TIFF": "tif", "BMP": "bmp", "WEBP": "webp"}
CSV_COLUMNS = ["id", "time_iso", "time", "part_id", "source", "score", "normalized_score",
               "is_anomalous", "threshold", "anomalous_pixels", "width", "height", "model_id",
               "model_checksum", "overlay_path", "mask_path", "latency_ms", "request_id",
               "label", "label_note", "label_by", "label_at_iso", "model_name", "original_path"]
LABELS = ("good", "defect")             # what an operator may say of a result
LABEL_FILTERS = LABELS + ("none",)      # query(label=...): none = not labelled
NOTE_MAX = 500                          # characters of a label's note
# ids are SQLite INTEGERs / PostgreSQL BIGINTs (signed 64-bit): a larger id can name no record
MAX_ID = 2**63 - 1


def iso_time(ts: float) -> str:
    """Unix seconds as ISO 8601 UTC with milliseconds (``2026-11-23T10:00:00.000Z``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


def iso_time_or_none(ts: Any) -> Optional[str]:
    """:func:`iso_time`, or None for what is no time (NaN, infinite, out of range: a damaged
    row of the log must not break the route that lists it)."""
    try:
        return iso_time(float(ts))
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class StoreUnavailableError(AnomalyHooksError):
    """The results log cannot be reached now (its database server is down, restarting or
    unreachable, or the connection was lost during a write): a passing state, not a fault of
    the request. Nothing was recorded, or (a connection lost during the ``COMMIT``) whether it
    was is unknown (:attr:`outcome_unknown`); either way the write is not acknowledged. The
    service answers it with 503 ``results_unavailable`` and a Retry-After."""

    def __init__(self, message: str, outcome_unknown: bool = False) -> None:
        super().__init__(message)
        # True: the connection was lost during the COMMIT, the records may be stored
        self.outcome_unknown = outcome_unknown


class ResultStore(abc.ABC):
    """Where predictions are recorded. Implementations must be safe to call from several
    threads; :meth:`add` returns only once the records are durable. A store whose backend
    cannot be reached raises :class:`StoreUnavailableError` (and serves again by itself once
    the backend is back)."""

    @abc.abstractmethod
    def add(self, records: Sequence[Record]) -> List[int]:
        """Store records atomically; return their ids (in order). Durable on return."""

    @abc.abstractmethod
    def query(self, *, since: Optional[float] = None, until: Optional[float] = None,
              anomalous: Optional[bool] = None, part_id: Optional[str] = None,
              before_id: Optional[int] = None, limit: int = 100,
              label: Optional[str] = None, model: Optional[str] = None) -> List[Record]:
        """Newest first: records with ``since <= time < until``, id < before_id (paging);
        ``label``: good, defect, or none (not labelled); ValueError for another; ``model``:
        the records of the model of that name only (the caller passes it only when it
        filters by model: a store written before model names need not take it)."""

    @abc.abstractmethod
    def get(self, record_id: int) -> Optional[Record]:
        """One record, or None."""

    @abc.abstractmethod
    def count(self) -> int:
        """Number of records."""

    @abc.abstractmethod
    def prune(self, *, max_age_s: Optional[float] = None, max_count: Optional[int] = None,
              now: Optional[float] = None) -> List[Record]:
        """Delete records older than ``max_age_s`` and all but the newest ``max_count``;
        return the deleted records (so that their pictures can be removed)."""

    def set_label(self, record_id: int, label: str, note: Optional[str] = None,
                  by: Optional[str] = None, *, now: Optional[float] = None
                  ) -> Optional[Record]:
        """Set (or replace) a record's operator label (:data:`LABELS`), with an optional note
        of at most :data:`NOTE_MAX` characters, who set it and when (``now``, default the
        current time); the labelled record, or None where there is no such record.
        ValueError for another label or a longer note. A store that keeps no labels (a
        plug-in written before them) raises NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} keeps no labels")

    def check(self) -> None:
        """Raise :class:`StoreUnavailableError` when the store could not record a prediction
        now (what ``/readyz`` asks, so a load balancer stops sending to a replica that would
        refuse). By default a read of the newest record; a store whose writes can fail while
        reads succeed checks a write."""
        self.query(limit=1)

    def close(self) -> None:  # noqa: B027 (optional: nothing to release by default)
        """Release resources."""

    def iter_query(self, page: int = 1000, **filters: Any) -> Iterator[Record]:
        """All records matching ``filters`` (newest first), fetched a page at a time."""
        limit = filters.pop("limit", None)
        before = filters.pop("before_id", None)
        seen = 0
        while limit is None or seen < limit:
            n = page if limit is None else min(page, limit - seen)
            rows = self.query(before_id=before, limit=n, **filters)
            if not rows:
                return
            yield from rows
            seen += len(rows)
            before = rows[-1].id
            if len(rows) < n:
                return


def query_filters(*, since: Optional[float] = None, until: Optional[float] = None,
                  anomalous: Optional[bool] = None, part_id: Optional[str] = None,
                  before_id: Optional[int] = None, label: Optional[str] = None,
                  model: Optional[str] = None) -> Tuple[List[str], List[Any]]:
    """The SQL conditions of :meth:`ResultStore.query`'s filters (each with at most one ``?``
    placeholder) and their values, in order: every store applies the same filters.
    ValueError for a label filter other than :data:`LABEL_FILTERS`."""
    clauses: List[str] = []
    args: List[Any] = []
    if label is not None:
        if label not in LABEL_FILTERS:
            raise ValueError(f"label filter must be one of {', '.join(LABEL_FILTERS)}, not "
                             f"{label!r}")
        if label == "none":
            clauses.append("label IS NULL")
        else:
            clauses.append("label = ?")
            args.append(label)
    if since is not None:
        clauses.append("time >= ?")
        args.append(float(since))
    if until is not None:
        clauses.append("time < ?")
        args.append(float(until))
    if anomalous is not None:
        clauses.append("is_anomalous = ?")
        args.append(bool(anomalous))
    if part_id is not None:
        clauses.append("part_id = ?")
        args.append(part_id)
    if model is not None:
        clauses.append("model_name = ?")
        args.append(model)
    if before_id is not None and before_id <= MAX_ID:  # beyond: every id is smaller
        clauses.append("id < ?")
        args.append(int(before_id))
    return clauses, args


def check_label(label: Any, note: Any, by: Any) -> None:
    """ValueError unless ``label`` is one of :data:`LABELS`, ``note`` None or a text of at most
    :data:`NOTE_MAX` characters and ``by`` None or a text (what every store checks)."""
    if label not in LABELS:
        raise ValueError(f"label must be one of {', '.join(LABELS)}, not {label!r}")
    if note is not None and (not isinstance(note, str) or len(note) > NOTE_MAX):
        raise ValueError(f"a label's note must be a text of at most {NOTE_MAX} characters")
    if by is not None and not isinstance(by, str):
        raise ValueError(f"a label's author must be a text, not {type(by).__name__}")


SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    request_id TEXT NOT NULL,
    score REAL NOT NULL,
    normalized_score REAL NOT NULL,
    is_anomalous INTEGER NOT NULL,
    threshold REAL NOT NULL,
    model_id TEXT NOT NULL,
    model_checksum TEXT NOT NULL,
    model_name TEXT,
    part_id TEXT,
    source TEXT,
    anomalous_pixels INTEGER,
    width INTEGER,
    height INTEGER,
    overlay_path TEXT,
    mask_path TEXT,
    thumb_path TEXT,
    original_path TEXT,
    latency_ms REAL,
    label TEXT,
    label_note TEXT,
    label_by TEXT,
    label_at REAL
);
CREATE INDEX IF NOT EXISTS results_time ON results (time);
CREATE INDEX IF NOT EXISTS results_anomalous ON results (is_anomalous, id);
CREATE INDEX IF NOT EXISTS results_part ON results (part_id, id);
"""
# version 2: the operator's label; version 3: the model's name (several models in one
# service); version 4: the kept original upload. An older log gets the columns it lacks added
# when it is opened.
ADDED_COLUMNS = {"label": "TEXT", "label_note": "TEXT", "label_by": "TEXT", "label_at": "REAL",
                 "model_name": "TEXT", "original_path": "TEXT"}
ADDED_INDEXES = ("CREATE INDEX IF NOT EXISTS results_label ON results (label, id)",
                 "CREATE INDEX IF NOT EXISTS results_model ON results (model_name, id)")
SCHEMA_VERSION = 4


# seconds a statement waits for a lock another connection holds on the log before the store
# gives up (StoreUnavailableError: 503 results_unavailable). The service's own commits take
# milliseconds; a lock held longer is another program's long transaction (a hand edit, a
# VACUUM), and every request queued behind the writer waits for it: a few seconds, far below
# the request timeout, then the clients are told to retry.
BUSY_TIMEOUT_S = 5.0
# seconds the readiness check waits for the write lock (the service's own commits hold it
# for milliseconds; a longer hold is another program's)
CHECK_TIMEOUT_S = 0.5
# SQLite's primary result codes of a lock held elsewhere: SQLITE_BUSY, SQLITE_LOCKED
_BUSY_CODES = (5, 6)


class SQLiteResultStore(ResultStore):
    """The default store: one SQLite file in WAL mode (readers never block the writer). A
    lock another connection holds past ``busy_timeout_s`` is a
    :class:`StoreUnavailableError` (nothing recorded), as an unreachable database server is
    for :class:`~anomaly_hooks.serve.pgstore.PostgresResultStore`."""

    def __init__(self, path: os.PathLike | str, synchronous: str = "FULL",
                 busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        """Open (or create) the log at ``path``; a path that cannot hold one (its folder is a
        file, the file is not a SQLite database, ...) is a :class:`ConfigError` saying so.
        A log that another program keeps locked past the busy timeout while its tables are
        created or upgraded opens all the same: every use (:meth:`check` included) raises
        :class:`StoreUnavailableError` saying so until the lock is gone, and the first one
        after that creates them. ``busy_timeout_s``: how long a statement waits for another
        connection's lock (ValueError unless a finite number > 0)."""
        if not (isinstance(busy_timeout_s, (int, float)) and math.isfinite(busy_timeout_s)
                and busy_timeout_s > 0):
            raise ValueError(f"busy_timeout_s must be a finite number of seconds > 0, not "
                             f"{busy_timeout_s!r}")
        self.path = Path(path)
        self._synchronous = synchronous
        self.busy_timeout_s = float(busy_timeout_s)
        self._lock = threading.Lock()
        self._local = threading.local()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # FileExistsError: a file where the folder should be, ...
            raise ConfigError(f"results folder {self.path.parent}: "
                              f"{_os_reason(exc)}") from None
        # True once the log's tables are there and current (set once, under self._lock)
        self._ready = False
        try:
            self._write = self._connect()
        except sqlite3.DatabaseError as exc:  # a folder of that name, no permission, ...
            raise self._unusable(exc) from None
        try:
            self._open_schema(self._write, self.busy_timeout_s)
        except StoreUnavailableError:  # locked elsewhere: the first use after it tries again
            pass
        except (sqlite3.DatabaseError, ConfigError) as exc:  # "file is not a database", ...
            self._write.close()
            raise self._unusable(exc) from None

    def _unusable(self, exc: Exception) -> ConfigError:
        return ConfigError(f"results log {self.path}: {exc}; move it away or give another "
                           "--results-dir")

    def _open_schema(self, con: sqlite3.Connection, waited_s: float) -> None:
        """Create or upgrade the log's tables on ``con`` unless that is done. A lock held
        elsewhere past ``con``'s busy timeout (``waited_s``) is
        :class:`StoreUnavailableError` saying who may hold it and what to do; a file that
        cannot be a results log raises ``sqlite3.DatabaseError`` or :class:`ConfigError`."""
        with self._lock:
            if self._ready:
                return
            try:
                self._init_schema(con)
                # the writer's durability: a pragma that reads the schema, so it waits here
                self._write.execute(f"PRAGMA synchronous={self._synchronous}")
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                raise StoreUnavailableError(
                    f"the results log {self.path} is locked by another program (waited "
                    f"{waited_s:g} s to open it: {exc}): probably a second service on the "
                    "same log, or a tool holding a transaction open on it (the sqlite3 shell, "
                    "a backup, a script). Stop that program or wait for it to finish: the log "
                    "is used as soon as the lock is gone, without a restart; nothing is "
                    "recorded until then") from None
            self._ready = True

    def _require_schema(self, waited_s: Optional[float] = None,
                        con: Optional[sqlite3.Connection] = None) -> None:
        """Make sure the tables are there before a use (a no-op once they are): the open's
        lock may have gone since (``con``: the connection to create them on, default the
        writer's; ``waited_s``: its busy timeout). A file found unusable meanwhile is
        :class:`StoreUnavailableError` with the open's advice (it cannot turn usable by
        itself, but every use must refuse it the same way)."""
        if self._ready:
            return
        try:
            self._open_schema(self._write if con is None else con,
                              self.busy_timeout_s if waited_s is None else waited_s)
        except (sqlite3.DatabaseError, ConfigError) as exc:
            raise StoreUnavailableError(str(self._unusable(exc))) from None

    def _init_schema(self, con: sqlite3.Connection) -> None:
        mode = con.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise ConfigError(f"SQLite refused WAL mode (got {mode}); put the results log on "
                              "a local file system")
        version = con.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise ConfigError(f"a results log of a newer version ({version})")
        if version == SCHEMA_VERSION and set(COLUMNS) <= _columns(con):
            return  # current: nothing to write (no write lock needed, a reader's suffices)
        con.execute("BEGIN IMMEDIATE")  # one process migrates; another opening waits
        try:
            for statement in filter(str.strip, SCHEMA.split(";")):
                con.execute(statement)
            have = _columns(con)
            for name, kind in ADDED_COLUMNS.items():
                if name not in have:
                    con.execute(f"ALTER TABLE results ADD COLUMN {name} {kind}")
            for index in ADDED_INDEXES:
                con.execute(index)
            con.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise

    def _connect(self) -> sqlite3.Connection:
        """A new connection (transactions explicit). It does not touch the file yet: even a
        pragma reads the schema, which a lock held elsewhere may block."""
        # timeout: SQLite's busy handler, retrying a locked statement up to that long
        return sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                               check_same_thread=False)

    @contextlib.contextmanager
    def _unless_locked(self, during: str, waited_s: Optional[float] = None) -> Iterator[None]:
        """Turn a lock held elsewhere past the busy timeout (``database is locked``) met in
        the block into :class:`StoreUnavailableError`; other errors pass unchanged.
        ``waited_s``: how long the block waits for a lock (default: the busy timeout)."""
        try:
            yield
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc):
                raise
            waited = self.busy_timeout_s if waited_s is None else waited_s
            raise StoreUnavailableError(
                f"the results log {self.path} is locked by another connection (waited "
                f"{waited:g} s during {during}: {exc}); nothing was recorded") from None

    def check(self) -> None:
        """Take the write lock and give it back at once, on a connection of its own that waits
        :data:`CHECK_TIMEOUT_S` for it (readers never block in WAL mode: a read would pass
        while every write waits out a lock)."""
        with self._unless_locked("a readiness check", CHECK_TIMEOUT_S):
            con = sqlite3.connect(self.path, timeout=CHECK_TIMEOUT_S, isolation_level=None)
            try:
                self._require_schema(CHECK_TIMEOUT_S, con)
                con.execute("BEGIN IMMEDIATE")
                con.execute("ROLLBACK")
            finally:
                con.close()

    def _reader(self) -> sqlite3.Connection:
        con = getattr(self._local, "con", None)
        if con is None:
            con = self._connect()
            con.execute("PRAGMA query_only=1")
            self._local.con = con
        return con

    @contextlib.contextmanager
    def _transaction(self, during: str) -> Iterator[sqlite3.Connection]:
        """The writer connection inside one ``BEGIN IMMEDIATE`` transaction, committed when
        the block ends and rolled back when it raises; a lock held elsewhere past the busy
        timeout is :class:`StoreUnavailableError` (``during``: what was being done)."""
        self._require_schema()
        with self._lock, self._unless_locked(during):
            con = self._write
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
                con.execute("COMMIT")
            except BaseException:
                if con.in_transaction:  # a failed COMMIT may have ended it already
                    con.execute("ROLLBACK")
                raise

    def _read(self, sql: str, args: Sequence[Any]) -> List[Any]:
        """The rows of one query on this thread's read connection."""
        self._require_schema()
        with self._unless_locked("a read"):
            return self._reader().execute(sql, list(args)).fetchall()

    def add(self, records: Sequence[Record]) -> List[int]:
        if not records:
            return []
        sql = (f"INSERT INTO results ({', '.join(COLUMNS)}) "
               f"VALUES ({', '.join('?' for _ in COLUMNS)})")
        ids: List[int] = []
        with self._transaction("a write") as con:
            for rec in records:
                ids.append(int(con.execute(sql, _to_row(rec)).lastrowid))
        for rec, rid in zip(records, ids):
            rec.id = rid
        return ids

    def query(self, *, since=None, until=None, anomalous=None, part_id=None, before_id=None,
              limit: int = 100, label=None, model=None) -> List[Record]:
        clauses, args = query_filters(since=since, until=until, anomalous=anomalous,
                                      part_id=part_id, before_id=before_id, label=label,
                                      model=model)
        where = (" WHERE " + " AND ".join(clauses)) if clauses else ""
        rows = self._read(
            f"SELECT id, {', '.join(COLUMNS)} FROM results{where} ORDER BY id DESC LIMIT ?",
            [*args, min(int(limit), MAX_ID)])
        return [record_from_row(r) for r in rows]

    def get(self, record_id: int) -> Optional[Record]:
        if not 0 < record_id <= MAX_ID:  # no such row, and SQLite cannot even bind it
            return None
        rows = self._read(f"SELECT id, {', '.join(COLUMNS)} FROM results WHERE id = ?",
                          [int(record_id)])
        return record_from_row(rows[0]) if rows else None

    def count(self) -> int:
        return int(self._read("SELECT COUNT(*) FROM results", [])[0][0])

    def prune(self, *, max_age_s=None, max_count=None, now=None) -> List[Record]:
        cols = f"id, {', '.join(COLUMNS)}"
        removed: List[Record] = []
        with self._transaction("retention") as con:
            if max_age_s is not None:
                cutoff = (time.time() if now is None else now) - float(max_age_s)
                removed += [record_from_row(r) for r in con.execute(
                    f"SELECT {cols} FROM results WHERE time < ?", [cutoff]).fetchall()]
                con.execute("DELETE FROM results WHERE time < ?", [cutoff])
            if max_count is not None:
                row = con.execute("SELECT id FROM results ORDER BY id DESC LIMIT 1 OFFSET ?",
                                  [int(max_count)]).fetchone()
                if row is not None:
                    removed += [record_from_row(r) for r in con.execute(
                        f"SELECT {cols} FROM results WHERE id <= ?", [row[0]]).fetchall()]
                    con.execute("DELETE FROM results WHERE id <= ?", [row[0]])
        return removed

    def set_label(self, record_id: int, label: str, note: Optional[str] = None,
                  by: Optional[str] = None, *, now: Optional[float] = None
                  ) -> Optional[Record]:
        check_label(label, note, by)
        if not 0 < record_id <= MAX_ID:
            return None
        at = time.time() if now is None else float(now)
        with self._transaction("a label") as con:
            con.execute("UPDATE results SET label = ?, label_note = ?, label_by = ?, "
                        "label_at = ? WHERE id = ?", [label, note, by, at, int(record_id)])
            row = con.execute(f"SELECT id, {', '.join(COLUMNS)} FROM results WHERE id = ?",
                              [int(record_id)]).fetchone()
        return record_from_row(row) if row else None

    def close(self) -> None:
        with self._lock:
            try:
                self._write.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error:
                pass
            self._write.close()


def _columns(con: sqlite3.Connection) -> Set[str]:
    """The names of the results table's columns (empty: no table)."""
    return {row[1] for row in con.execute("PRAGMA table_info(results)")}


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    """Whether SQLite gave up waiting for a lock another connection holds."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    if code is not None:
        return code & 0xFF in _BUSY_CODES  # extended codes keep the primary in the low byte
    text = str(exc)
    return "is locked" in text or "database is busy" in text


def _os_reason(exc: OSError) -> str:
    """What an ``OSError`` of a path says, without the path (the message names it)."""
    if isinstance(exc, FileExistsError):
        return "a file of that name is in the way (it must be a folder)"
    return exc.strerror or str(exc)


def _to_row(record: Record) -> List[Any]:
    """The SQL values of :data:`COLUMNS` (a bool as 0/1)."""
    flat = record.flat()
    return [int(v) if isinstance(v, bool) else v for v in (flat[c] for c in COLUMNS)]


def record_from_row(row: Sequence[Any]) -> Record:
    """The record of a row ``(id, *COLUMNS)``, each value of its column's type or None (SQLite
    stores what it is given: a row written by hand may hold anything)."""
    data = {name: _ROW_TYPES.get(name, _text)(value)
            for name, value in zip(["id", *COLUMNS], row)}
    verdict = Verdict(**{k: data.pop(k) for k in VERDICT_FIELDS})
    return Record(verdict=verdict, **data)


def _real(value: Any) -> Optional[float]:
    """A finite float, or None."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _integer(value: Any) -> Optional[int]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if math.isfinite(value) else None


def _text(value: Any) -> Optional[str]:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _required_text(value: Any) -> str:
    return _text(value) or ""


_ROW_TYPES = {"id": _integer, "time": _real, "score": _real, "normalized_score": _real,
              "threshold": _real, "latency_ms": _real, "label_at": _real, "width": _integer,
              "height": _integer, "anomalous_pixels": _integer,
              "is_anomalous": lambda v: bool(_real(v)), "request_id": _required_text,
              "model_id": _required_text, "model_checksum": _required_text}


def csv_lines(records: Iterator[Record]) -> Iterator[str]:
    """The CSV export, a chunk of lines at a time (header first)."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(CSV_COLUMNS)
    n = 0
    for rec in records:
        row = rec.flat()
        row["time_iso"] = iso_time_or_none(rec.time)
        row["label_at_iso"] = iso_time_or_none(rec.label_at)
        row["is_anomalous"] = int(rec.verdict.is_anomalous)
        writer.writerow([csv_cell(row[c]) for c in CSV_COLUMNS])  # no formulas
        n += 1
        if n % 500 == 0:
            yield buf.getvalue()
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue()


def input_name(original_rel: str) -> str:
    """The relative path of the network input kept beside the original at ``original_rel``
    (``..._original.<ext>`` -> ``..._input.safetensors``)."""
    head, sep, _ = original_rel.rpartition("_original.")
    stem = head if sep else original_rel.rsplit(".", 1)[0]
    return f"{stem}_{INPUT_PICTURE}.{INPUT_EXTENSION}"


class ImageFiles:
    """Pictures of kept results: ``<root>/images/YYYY-MM-DD/<request id>_<kind>.<ext>`` (the
    original upload: ``<request id>_original.<its format's extension>``; its kept network
    input: ``<request id>_input.safetensors``)."""

    def __init__(self, root: os.PathLike | str) -> None:
        self.root = Path(root).resolve()

    def write(self, request_id: str, ts: float, pictures: Dict[str, Optional[bytes]],
              original_format: Optional[str] = None) -> Dict[str, Optional[str]]:
        """Write the given pictures (kind -> bytes or None); return kind -> relative path.
        ``original_format``: the format of the ``original`` picture (PNG, JPEG, ...: its
        extension)."""
        day = time.strftime("%Y-%m-%d", time.gmtime(ts))
        folder = self.root / "images" / day
        out: Dict[str, Optional[str]] = {}
        for kind, data in pictures.items():
            if data is None:
                out[kind] = None
                continue
            folder.mkdir(parents=True, exist_ok=True)
            ext = (ORIGINAL_EXTENSIONS.get(str(original_format).upper(), "img")
                   if kind == "original" else INPUT_EXTENSION if kind == INPUT_PICTURE
                   else PICTURES[kind].rsplit(".", 1)[1])
            path = folder / f"{request_id}_{kind}.{ext}"
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            out[kind] = str(path.relative_to(self.root))
        return out

    def resolve(self, rel: str) -> Optional[Path]:
        """Absolute path of a stored picture (None if outside the root or missing)."""
        try:
            path = (self.root / rel).resolve()
            if self.root not in path.parents or not path.is_file():
                return None
        except (OSError, ValueError):  # a NUL character, a link loop, a name too long...
            return None
        return path

    def kept_input(self, original_rel: str) -> Optional[Path]:
        """The kept network input beside the original at ``original_rel`` (None: none)."""
        return self.resolve(input_name(original_rel))

    def delete(self, records: Sequence[Record]) -> int:
        n = 0
        for rec in records:
            kept_input = input_name(rec.original_path) if rec.original_path else None
            for rel in (rec.overlay_path, rec.mask_path, rec.thumb_path, rec.original_path,
                        kept_input):
                if rel:
                    path = self.resolve(rel)
                    if path is not None:
                        try:
                            path.unlink()
                            n += 1
                        except OSError:
                            pass
        return n


class Recorder:
    """Group commit on one writer thread: :meth:`submit` returns a future that resolves to the
    record's id once it is durable; many concurrent records share one transaction."""

    _STOP = object()

    def __init__(self, store: ResultStore, max_group: int = 256) -> None:
        self.store = store
        self.max_group = max_group
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="results-writer", daemon=True)
        self.commits = 0
        # monotonic time of the first failure of an ongoing outage of the store (None: none)
        self.down_since: Optional[float] = None
        self._thread.start()

    def submit(self, record: Record) -> "Future[int]":
        fut: "Future[int]" = Future()
        self._queue.put((record, fut))
        return fut

    def call(self, fn, *args, **kwargs) -> "Future[Any]":
        """Run ``fn`` on the writer thread (for pruning: writes stay on one thread)."""
        fut: "Future[Any]" = Future()
        self._queue.put(((fn, args, kwargs), fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                return
            group = [item]
            while len(group) < self.max_group:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is self._STOP:
                    self._queue.put(self._STOP)
                    break
                group.append(nxt)
            records = [(r, f) for r, f in group if isinstance(r, Record)]
            calls = [(c, f) for c, f in group if not isinstance(c, Record)]
            if records:
                self._commit(records)
            for (fn, args, kwargs), fut in calls:
                try:
                    _resolve(fut, fn(*args, **kwargs))
                # broad: the writer thread must outlive any call; the error goes to the caller,
                # whose future raises it
                except BaseException as exc:  # noqa: BLE001
                    _resolve(fut, error=exc)

    def _commit(self, records: List[Any]) -> None:
        """Commit ``(record, future)`` pairs in one transaction. When it fails, each record is
        tried alone: one record the store refuses fails its own request only. An unreachable
        store fails them all at once (trying each alone would only wait on it again)."""
        try:
            ids = self.store.add([r for r, _ in records])
        except StoreUnavailableError as exc:
            self._unavailable(exc)
            for _, fut in records:
                _resolve(fut, error=exc)
            return
        # broad: disk full, locked, a store plug-in's own error: each waiter learns it
        except BaseException as exc:  # noqa: BLE001
            if len(records) > 1:  # the transaction was rolled back: nothing is committed
                for one in records:
                    self._commit([one])
                return
            log.exception("results log write failed")
            _resolve(records[0][1], error=exc)
            return
        if self.down_since is not None:
            log.warning("the results log is reachable again (it was not for %.1f s)",
                        time.monotonic() - self.down_since)
            self.down_since = None
        self.commits += 1
        for (_, fut), rid in zip(records, ids):
            _resolve(fut, rid)

    def _unavailable(self, exc: StoreUnavailableError) -> None:
        """Log the first failure of an outage (one line, no traceback: the requests answer
        503 meanwhile); the first commit after it logs the recovery."""
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.error("the results log is unavailable, predictions are refused (503) until it "
                      "is back: %s", exc)

    def close(self, timeout: float = 30.0) -> None:
        self._queue.put(self._STOP)
        self._thread.join(timeout)


def _resolve(fut: "Future[Any]", value: Any = None, error: Optional[BaseException] = None
             ) -> None:
    """Set a future's outcome unless its waiter gave up (cancelled) meanwhile."""
    if fut.done():
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    except InvalidStateError:  # cancelled between the check and the set
        pass
