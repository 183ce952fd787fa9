"""The PostgreSQL results store (pgstore.py) against the SQLite one: the same answers to the
same calls, its migrations, its connections, and what it refuses. Runs on a throw-away server
(the ``postgres_server`` fixture); skipped where PostgreSQL or psycopg is absent."""
from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from anomaly_hooks.errors import ConfigError
from anomaly_hooks.prediction import Verdict
from anomaly_hooks.serve.results import (
    MAX_ID,
    Record,
    Recorder,
    SQLiteResultStore,
    StoreUnavailableError,
    csv_lines,
)

psycopg = pytest.importorskip("psycopg", reason="psycopg (the [postgres] extra) is not installed")
from anomaly_hooks.serve.pgstore import (  # noqa: E402
    SCHEMA_VERSION,
    ConnectionPool,
    PostgresResultStore,
    redact_url,
)

INF = float("inf")
NAN = float("nan")


def _record(i: int, **kw) -> Record:
    verdict = Verdict(score=kw.pop("score", float(i)), normalized_score=0.5,
                      is_anomalous=kw.pop("anomalous", i % 3 == 0), threshold=10.0,
                      anomalous_pixels=kw.pop("anomalous_pixels", i * 7 if i % 2 else None))
    return Record(time=kw.pop("time", 1000.0 + i), request_id=f"r{i}", verdict=verdict,
                  model_id="m", model_checksum="c" * 64,
                  part_id=kw.pop("part_id", f"P{i % 4}"), **kw)


def _records():
    """Records of every shape: missing fields, non-finite optional numbers (stored as NULL),
    unicode, formula-like text, big integers."""
    out = [_record(i, width=640, height=480, latency_ms=1.5 * i) for i in range(12)]
    out += [_record(12, latency_ms=INF, source="éà ☃ =SUM(A1)", part_id=None),
            _record(13, latency_ms=NAN, width=2**62, anomalous_pixels=2**40),
            _record(14, time=-5.0, score=-1.0, overlay_path="images/a.png")]
    return out


@pytest.fixture
def both(postgres_url, tmp_path):
    """(SQLite store, PostgreSQL store), holding the same records."""
    lite = SQLiteResultStore(tmp_path / "r.sqlite")
    pg = PostgresResultStore(postgres_url)
    for store in (lite, pg):
        store.add(_records()[:5])
        store.add(_records()[5:])
        store.set_label(3, "good", now=1100.0)
        store.set_label(4, "defect", "a dent", "token:ab", now=1101.5)
        store.set_label(9, "defect", None, None, now=NAN)  # a NaN time: NULL, as in SQLite
    yield lite, pg
    lite.close()
    pg.close()


def _same(a, b) -> None:
    assert [r.as_json() for r in a] == [r.as_json() for r in b]


FILTERS = [
    {}, {"limit": 3}, {"limit": 0}, {"limit": -1}, {"limit": 10**30}, {"anomalous": True},
    {"anomalous": False}, {"part_id": "P1"}, {"part_id": "none"}, {"since": 1005.0},
    {"until": 1003.0}, {"since": 1002.0, "until": 1009.5, "anomalous": False},
    {"since": NAN}, {"until": NAN}, {"since": -INF}, {"until": INF}, {"since": INF},
    {"before_id": 7}, {"before_id": 0}, {"before_id": -5}, {"before_id": MAX_ID},
    {"before_id": MAX_ID + 1}, {"before_id": 10**30}, {"part_id": "P2", "before_id": 10},
    {"label": "good"}, {"label": "defect"}, {"label": "none"},
    {"label": "none", "anomalous": True, "before_id": 12},
]


@pytest.mark.parametrize("filters", FILTERS, ids=[repr(f) for f in FILTERS])
def test_queries_answer_as_sqlite_does(both, filters):
    lite, pg = both
    _same(lite.query(**filters), pg.query(**filters))


def test_get_count_pages_and_csv_as_sqlite(both):
    lite, pg = both
    assert lite.count() == pg.count() == 15
    for rid in (1, 7, 13, 15, 16, 0, -1, MAX_ID, MAX_ID + 1, 10**30):
        a, b = lite.get(rid), pg.get(rid)
        assert (a is None and b is None) or a.as_json() == b.as_json(), rid
        a, b = lite.set_label(rid, "good", "n", "w", now=5.0), pg.set_label(rid, "good", "n",
                                                                            "w", now=5.0)
        assert (a is None and b is None) or a.as_json() == b.as_json(), rid
    for page in (1, 4, 1000):
        _same(list(lite.iter_query(page=page)), list(pg.iter_query(page=page)))
        _same(list(lite.iter_query(page=page, anomalous=False, limit=5)),
              list(pg.iter_query(page=page, anomalous=False, limit=5)))
    assert "".join(csv_lines(lite.iter_query())) == "".join(csv_lines(pg.iter_query()))
    rec = pg.get(14)
    assert rec.latency_ms is None and rec.width == 2**62 and rec.verdict.anomalous_pixels == 2**40


@pytest.mark.parametrize("steps", [
    [{"max_age_s": 5, "now": 1010.0}, {"max_count": 3}],
    [{"max_age_s": NAN}, {"max_age_s": INF}, {"max_age_s": -INF}],
    [{"max_count": 0}], [{"max_count": -3}], [{"max_count": 100}],
    [{"max_age_s": 3, "max_count": 4, "now": 1010.0}]])
def test_prune_removes_what_sqlite_removes(both, steps):
    lite, pg = both
    for step in steps:  # the removed records, in any order
        _same(sorted(lite.prune(**step), key=lambda r: r.id), pg.prune(**step))
        _same(lite.query(limit=-1), pg.query(limit=-1))


def test_records_sqlite_refuses_are_refused_whole(both):
    """A required number that is not finite is stored as NULL, which the NOT NULL columns
    refuse: in both stores an IntegrityError, and nothing of the group is committed."""
    lite, pg = both
    for store, error in ((lite, sqlite3.IntegrityError),
                         (pg, psycopg.IntegrityError)):
        for bad in (_record(50, time=NAN), _record(51, score=INF)):
            with pytest.raises(error):
                store.add([_record(52), bad])
        assert store.count() == 15
    # ids go on growing in both; PostgreSQL's sequence skips those of the rolled-back rows
    [a], [b] = lite.add([_record(60)]), pg.add([_record(60)])
    assert a == 16 and b > 16


def test_text_with_a_nul_is_kept_with_a_replacement_character(postgres_url, tmp_path):
    """PostgreSQL text cannot hold NUL (SQLite's can): U+FFFD is stored in its place, in a
    record, a label and a filter alike, so the record is kept and found again; the CSV export
    (which writes U+FFFD for a NUL) is the same from both stores."""
    pg = PostgresResultStore(postgres_url)
    lite = SQLiteResultStore(tmp_path / "r.sqlite")
    for store in (pg, lite):
        store.add([_record(1, part_id="a\x00b", source="\x00=1")])
        store.set_label(1, "good", "n\x00te", "by\x00", now=5.0)
    [rec] = pg.query(part_id="a\x00b")
    assert (rec.part_id, rec.source, rec.label_note, rec.label_by) == (
        "a\ufffdb", "\ufffd=1", "n\ufffdte", "by\ufffd")
    assert [r.part_id for r in lite.query(part_id="a\x00b")] == ["a\x00b"]
    assert "".join(csv_lines(pg.iter_query())) == "".join(csv_lines(lite.iter_query()))
    pg.close()
    lite.close()


# ---- schema and migrations ------------------------------------------------------------------
def test_schema_version_recorded_once_when_replicas_start_together(postgres_url):
    stores, errors = [], []

    def start() -> None:
        try:
            stores.append(PostgresResultStore(postgres_url, pool_size=1))
        except Exception as exc:  # noqa: BLE001  (collected for the assertion)
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(stores) == 6
    with psycopg.connect(postgres_url) as con:
        versions = [r[0] for r in con.execute("SELECT version FROM schema_version ORDER BY 1")]
    assert versions == list(range(1, SCHEMA_VERSION + 1))
    assert stores[0].schema_version() == SCHEMA_VERSION
    stores[0].add([_record(1)])
    assert all(s.count() == 1 for s in stores)
    for s in stores:
        s.close()


def test_a_version_1_database_gains_the_label_columns(postgres_url):
    """A database written before labels (schema version 1, as the first release of this store
    left it): opened, it is migrated to version 2 and its records read back unlabelled."""
    from anomaly_hooks.serve.pgstore import MIGRATIONS, SCHEMA_VERSION_TABLE

    version, description, statements = MIGRATIONS[0]
    assert version == 1
    with psycopg.connect(postgres_url, autocommit=True) as con:
        con.execute(SCHEMA_VERSION_TABLE)
        for statement in statements:
            con.execute(statement)
        con.execute("INSERT INTO schema_version (version, description) VALUES (1, %s)",
                    [description])
        con.execute("INSERT INTO results (time, request_id, score, normalized_score, "
                    "is_anomalous, threshold, model_id, model_checksum) VALUES "
                    "(1000.0, 'old', 2.5, 0.7, true, 2.0, 'm', 'c')")
    store = PostgresResultStore(postgres_url)
    assert store.schema_version() == 3 == SCHEMA_VERSION
    old = store.get(1)
    assert old.request_id == "old" and old.label is None and old.verdict.is_anomalous
    assert old.model_name is None
    assert store.set_label(1, "defect", "seen", "token:ab").label_by == "token:ab"
    assert [r.request_id for r in store.query(label="defect")] == ["old"]
    store.close()


def test_a_version_2_database_gains_the_model_name_column(postgres_url):
    """A database written before model names (schema version 2): opened, it is migrated to
    version 3 (a nullable ``model_name``); old records have none, new ones carry theirs, and
    the model filter finds them."""
    from anomaly_hooks.serve.pgstore import MIGRATIONS, SCHEMA_VERSION_TABLE

    with psycopg.connect(postgres_url, autocommit=True) as con:
        con.execute(SCHEMA_VERSION_TABLE)
        for version, description, statements in MIGRATIONS[:2]:
            for statement in statements:
                con.execute(statement)
            con.execute("INSERT INTO schema_version (version, description) VALUES (%s, %s)",
                        [version, description])
        con.execute("INSERT INTO results (time, request_id, score, normalized_score, "
                    "is_anomalous, threshold, model_id, model_checksum, label) VALUES "
                    "(1000.0, 'old', 2.5, 0.7, true, 2.0, 'm', 'c', 'good')")
    store = PostgresResultStore(postgres_url)
    assert store.schema_version() == 3
    old = store.get(1)
    assert old.model_name is None and old.label == "good"
    store.add([_record(2, model_name="line-2")])
    assert [r.model_name for r in store.query(model="line-2")] == ["line-2"]
    assert len(store.query()) == 2 and store.query(model="nothing") == []
    store.close()


def test_a_newer_schema_is_refused(postgres_url):
    PostgresResultStore(postgres_url).close()
    with psycopg.connect(postgres_url) as con:
        con.execute("INSERT INTO schema_version (version, description) VALUES (99, 'future')")
    with pytest.raises(ConfigError, match=r"newer version \(99"):
        PostgresResultStore(postgres_url)


def test_unreachable_or_missing_database_is_a_config_error(postgres_server):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConfigError) as info:
        PostgresResultStore(f"postgresql://u:hunter2@127.0.0.1:{port}/db?password=again")
    message = str(info.value)
    assert "hunter2" not in message and "again" not in message, message
    assert f"postgresql://u:***@127.0.0.1:{port}/db?password=***" in message
    assert "--results-db" in message
    with pytest.raises(ConfigError, match="does not exist"):
        PostgresResultStore(postgres_server.url("no_such_database"))


def test_redact_url():
    assert redact_url("postgresql://a:b@h/d") == "postgresql://a:***@h/d"
    assert redact_url("postgres://a@h:5/d?sslmode=require") == "postgres://a@h:5/d?sslmode=require"
    assert redact_url("postgresql:///d?host=/tmp&password=x") == (
        "postgresql:///d?host=%2Ftmp&password=***")


# ---- connections ----------------------------------------------------------------------------
def test_connections_dropped_by_the_server_are_replaced(postgres_url, postgres_server):
    """The server ends every connection of the store (a restart, a failover, an idle
    timeout): the next read and the next write still succeed (nothing had been sent of
    them, so they are retried on a new connection)."""
    store = PostgresResultStore(postgres_url, pool_size=2)
    store.add([_record(1)])
    dbname = postgres_url.rsplit("/", 1)[1]
    for work in (store.count, lambda: store.add([_record(2)])):
        killed = postgres_server.admin().execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
            "AND pid <> pg_backend_pid()", [dbname]).fetchall()
        assert killed
        work()
    assert store.count() == 2
    store.close()


@pytest.mark.slow
def test_a_killed_and_restarted_server_is_unavailable_then_serves_again(own_postgres_server):
    """kill -9 of the whole server: every call fails at once (no hang) with
    StoreUnavailableError saying so, the Recorder fails a group together; once the server is
    started again on the same data, the same store (and Recorder) serve again, with every
    committed record there once."""
    server = own_postgres_server
    url = server.url(server.new_database())
    store = PostgresResultStore(url, pool_size=3)
    recorder = Recorder(store)
    committed = [recorder.submit(_record(i)).result(30) for i in range(5)]
    store.query(limit=2)  # an idle pooled connection or two, that the crash leaves dead
    server.kill9()
    for call in (lambda: store.add([_record(10)]), store.count, lambda: store.query(limit=5),
                 lambda: store.set_label(1, "good")):
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError) as info:
            call()
        assert time.monotonic() - start < 5  # a refused connection does not wait
        assert f"results database {url}" in str(info.value)  # which one, and why
        assert "refused" in str(info.value) or "lost" in str(info.value)
    futures = [recorder.submit(_record(20 + i)) for i in range(4)]
    for fut in futures:
        with pytest.raises(StoreUnavailableError):
            fut.result(30)
    assert recorder.down_since is not None
    server.restart()
    committed += [recorder.submit(_record(30 + i)).result(30) for i in range(3)]
    assert recorder.down_since is None
    assert store.count() == 8 and len(set(committed)) == 8
    rows = [r.request_id for r in store.query(limit=-1)]
    assert sorted(rows) == sorted({f"r{i}" for i in [*range(5), 30, 31, 32]})
    recorder.close()
    store.close()


def test_the_throwaway_server_says_what_is_missing(monkeypatch):
    """pgtesting: without the programs, PostgresUnavailableError naming them (the fixtures
    skip with it); a server not started cannot be killed."""
    from anomaly_hooks.serve import pgtesting

    monkeypatch.setattr(pgtesting, "find_program", lambda name: None)
    assert pgtesting.missing_programs() == ["initdb", "pg_ctl"]
    with pytest.raises(pgtesting.PostgresUnavailableError, match="initdb, pg_ctl"):
        pgtesting.PostgresServer()
    monkeypatch.undo()
    server = pgtesting.PostgresServer()
    try:
        assert server.postmaster_pid() is None
        with pytest.raises(RuntimeError, match="not running"):
            server.kill9()
    finally:
        server.stop()


def test_commits_wait_for_the_wal_flush_whatever_the_server_default(postgres_url):
    with psycopg.connect(postgres_url, autocommit=True) as con:
        dbname = postgres_url.rsplit("/", 1)[1]
        con.execute(f"ALTER DATABASE {dbname} SET synchronous_commit = off")
    store = PostgresResultStore(postgres_url)
    assert store._read(lambda c: c.execute("SHOW synchronous_commit").fetchone()[0]) == "on"
    assert store._read(lambda c: c.execute("SHOW statement_timeout").fetchone()[0]) == "30s"
    store.close()


def test_a_lock_held_elsewhere_fails_a_write_after_the_statement_timeout(postgres_url):
    """A write waiting on a lock another program holds gives up after the statement timeout
    (as SQLite's busy timeout does) instead of holding the writer thread for ever; it
    succeeds once the lock is gone."""
    store = PostgresResultStore(postgres_url, statement_timeout_s=0.5)
    store.add([_record(1)])
    with psycopg.connect(postgres_url) as other:
        other.execute("LOCK TABLE results IN EXCLUSIVE MODE")
        with pytest.raises(psycopg.errors.QueryCanceled):
            store.add([_record(2)])
    assert store.add([_record(3)]) and store.count() == 2
    store.close()
    with pytest.raises(ValueError, match="statement_timeout_s"):
        PostgresResultStore(postgres_url, statement_timeout_s=float("nan"))


class _FakeConnection:
    closed = broken = False

    class info:  # noqa: N801  (psycopg's attribute)
        transaction_status = psycopg.pq.TransactionStatus.IDLE

    def close(self) -> None:
        self.closed = True


def test_pool_reuses_and_bounds_connections():
    made = []
    pool = ConnectionPool(lambda: made.append(_FakeConnection()) or made[-1], size=1,
                          timeout_s=0.05)
    with pool.connection() as first:
        with pytest.raises(TimeoutError, match="no free database connection"):
            with pool.connection():
                pass
    with pool.connection() as again:
        assert again is first
    with pool.connection(fresh=True) as other:
        assert other is not first
    first.broken = True
    pool.close()
    assert all(c.closed for c in made)
    with pytest.raises(RuntimeError, match="closed"):
        with pool.connection():
            pass
    with pytest.raises(ValueError, match="pool size"):
        ConnectionPool(lambda: None, size=0)


def test_the_core_does_not_import_psycopg():
    code = ("import sys\n"
            "import anomaly_hooks.serve.results, anomaly_hooks.serve.settings, "
            "anomaly_hooks.serve.cli\n"
            "assert 'psycopg' not in sys.modules, 'psycopg imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
