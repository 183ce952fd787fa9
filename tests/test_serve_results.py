"""The results log (results.py, pgstore.py): the stores (each store test runs on SQLite and on
PostgreSQL, through the ``store_factory`` fixture), the picture files, the CSV export, the group
commit, and the record's one verdict (prediction.Verdict) in its columns."""
from __future__ import annotations

import csv
import io
import logging
import re
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_helpers import locked_by_another_process, write_locked

from anomaly_hooks.errors import ConfigError
from anomaly_hooks.prediction import VERDICT_FIELDS, Verdict
from anomaly_hooks.serve.results import (
    BUSY_TIMEOUT_S,
    CHECK_TIMEOUT_S,
    COLUMNS,
    MAX_ID,
    SCHEMA,
    SCHEMA_VERSION,
    ImageFiles,
    Record,
    Recorder,
    ResultStore,
    SQLiteResultStore,
    StoreUnavailableError,
    csv_lines,
)
from anomaly_hooks.serve.stores import open_store


def _record(i: int, t: float, anomalous: bool = False, **kw) -> Record:
    verdict = Verdict(score=float(i), normalized_score=0.5, is_anomalous=anomalous,
                      threshold=10.0, anomalous_pixels=kw.pop("anomalous_pixels", None))
    return Record(time=t, request_id=f"r{i}", verdict=verdict, model_id="m",
                  model_checksum="c" * 64, part_id=kw.pop("part_id", f"P{i}"), **kw)


def test_store_add_query_filters_and_paging(store_factory):
    store = store_factory()
    ids = store.add([_record(i, 1000.0 + i, anomalous=i % 3 == 0) for i in range(10)])
    assert ids == list(range(1, 11)) and store.count() == 10
    assert [r.id for r in store.query(limit=3)] == [10, 9, 8]
    assert [r.verdict.score for r in store.query(anomalous=True)] == [9.0, 6.0, 3.0, 0.0]
    assert [r.id for r in store.query(since=1005.0, until=1008.0)] == [8, 7, 6]
    assert [r.id for r in store.query(part_id="P4")] == [5]
    assert [r.id for r in store.query(before_id=4)] == [3, 2, 1]
    assert [r.id for r in store.iter_query(page=3)] == list(range(10, 0, -1))
    rec = store.get(4)
    assert rec.verdict.is_anomalous is True and rec.part_id == "P3" and store.get(99) is None
    store.close()
    again = open_store(store_factory.spec)   # reopened: all there
    assert again.count() == 10
    if store_factory.kind == "sqlite":
        assert again._write.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    again.close()


def test_store_retention_by_age_and_count(store_factory):
    store = store_factory()
    store.add([_record(i, 1000.0 + i) for i in range(10)])
    removed = store.prune(max_age_s=5, now=1010.0)          # older than t=1005
    assert sorted(r.id for r in removed) == [1, 2, 3, 4, 5]
    removed = store.prune(max_count=3)
    assert sorted(r.id for r in removed) == [6, 7] and store.count() == 3
    assert store.add([_record(99, 2000.0)]) == [11]          # ids never reused
    assert store.prune(max_count=100) == []


def test_image_files_write_resolve_delete(tmp_path):
    files = ImageFiles(tmp_path)
    paths = files.write("abc", 1000.0, {"overlay": b"png", "mask": None, "thumb": b"jpg"})
    assert paths["mask"] is None and paths["overlay"].startswith("images/1970-01-01/")
    assert files.resolve(paths["overlay"]).read_bytes() == b"png"
    assert files.resolve("../../etc/passwd") is None
    rec = _record(1, 1000.0, overlay_path=paths["overlay"], thumb_path=paths["thumb"])
    assert files.delete([rec]) == 2 and files.resolve(paths["overlay"]) is None


def test_csv_export_is_parseable_and_neutralises_formulas(store_factory):
    store = store_factory()
    store.add([_record(1, 1000.0, part_id="=HYPERLINK(\"http://x\")", source="a,b\"c")])
    text = "".join(csv_lines(store.iter_query()))
    rows = list(csv.DictReader(io.StringIO(text)))
    assert rows[0]["part_id"].startswith("'=") and rows[0]["source"] == 'a,b"c'
    assert rows[0]["time_iso"] == "1970-01-01T00:16:40.000Z" and rows[0]["is_anomalous"] == "0"


def test_recorder_group_commits_from_many_threads(store_factory):
    store = store_factory()
    rec = Recorder(store)
    with ThreadPoolExecutor(16) as pool:
        futures = list(pool.map(lambda i: rec.submit(_record(i, 1000.0 + i)), range(400)))
    ids = [f.result(30) for f in futures]
    assert sorted(ids) == list(range(1, 401))
    assert rec.commits < 400                  # grouped into fewer transactions
    assert rec.call(store.count).result(30) == 400
    rec.close()
    assert store_factory.sql("SELECT COUNT(DISTINCT request_id) FROM results") == [(400,)]


def test_store_refuses_unknown_schemes(tmp_path):
    with pytest.raises(ValueError, match="implement ResultStore"):
        open_store("mysql://db/results")




def test_store_columns_are_the_schemas_and_the_verdict_fields():
    """The SQL columns: the verdict's fields (prediction.VERDICT_FIELDS) and the record's own,
    the same names as the table an existing log has."""
    table = set(re.findall(r"^    (\w+) (?:INTEGER|REAL|TEXT)", SCHEMA, re.M))
    assert set(COLUMNS) | {"id"} == table and set(VERDICT_FIELDS) <= set(COLUMNS)


def test_store_keeps_the_verdict_and_refuses_no_id(store_factory):
    store = store_factory()
    [rid] = store.add([_record(7, 1000.0, anomalous=True, anomalous_pixels=42, width=3,
                               height=4)])
    rec = store.get(rid)
    assert rec.verdict == Verdict(7.0, 0.5, True, 10.0, 42)
    assert (rec.width, rec.height) == (3, 4)
    for huge in (MAX_ID, MAX_ID + 1, 10**30, 0, -1):  # beyond a 64-bit integer: no record
        assert store.get(huge) is None
    assert [r.id for r in store.query(before_id=10**30)] == [rid]
    assert [r.id for r in store.query(limit=10**30)] == [rid]


def test_existing_log_reads_and_grows(tmp_path):
    """A results log written by the schema (as an existing server left it) reads back as
    records with their verdict, and new records go in beside them."""
    con = sqlite3.connect(tmp_path / "r.sqlite")
    con.executescript(SCHEMA)
    con.execute("INSERT INTO results (time, request_id, score, normalized_score, is_anomalous, "
                "threshold, model_id, model_checksum, part_id, anomalous_pixels) "
                "VALUES (1000.0, 'old', 2.5, 0.7, 1, 2.0, 'm', 'c', 'P', 12)")
    con.commit()
    con.close()
    store = SQLiteResultStore(tmp_path / "r.sqlite")
    old = store.get(1)
    assert old.verdict == Verdict(2.5, 0.7, True, 2.0, 12) and old.request_id == "old"
    assert store.add([_record(1, 2000.0)]) == [2]
    assert [r.request_id for r in store.query()] == ["r1", "old"]


def test_record_json_flattens_the_verdict_and_hides_paths():
    rec = _record(3, 1000.0, anomalous=True, overlay_path="images/x_overlay.png")
    rec.id = 5
    rec.verdict.normalized_score = float("nan")  # a strict JSON encoder refuses NaN
    out = rec.as_json()
    assert {k: out[k] for k in VERDICT_FIELDS} == {**rec.verdict.as_dict()}
    assert out["normalized_score"] is None
    assert out["overlay_url"] == "/v1/results/5/overlay.png" and out["mask_url"] is None
    assert not any(k.endswith("_path") for k in out)
    assert out["time_iso"] == "1970-01-01T00:16:40.000Z"


def test_one_refused_record_does_not_fail_its_group(store_factory):
    """The store refuses one record of a group commit: that record's request fails, the
    others committed in the same group succeed."""
    import threading

    store = store_factory()
    add = store.add

    def picky(records):
        if any(r.part_id == "bad" for r in records):
            raise ValueError("refused")
        return add(records)

    store.add = picky
    recorder = Recorder(store)
    gate = threading.Event()
    try:
        recorder.call(gate.wait, 10)  # the writer waits: the three queue up as one group
        futures = [recorder.submit(_record(i, 1000.0 + i, part_id=p))
                   for i, p in enumerate(("a", "bad", "c"))]
        gate.set()
        with pytest.raises(ValueError, match="refused"):
            futures[1].result(10)
        assert futures[0].result(10) > 0 and futures[2].result(10) > 0
    finally:
        recorder.close()
    assert sorted(r.part_id for r in store.query()) == ["a", "c"]


def test_a_write_lock_held_elsewhere_is_unavailable_after_the_busy_timeout(tmp_path):
    """SQLite: a write meeting another connection's lock gives up after the busy timeout with
    StoreUnavailableError (nothing recorded), as an unreachable PostgreSQL server does; the
    store writes again once the lock is gone."""
    store = SQLiteResultStore(tmp_path / "results.sqlite", busy_timeout_s=0.3)
    store.add([_record(0, 1000.0)])
    with write_locked(store.path):
        writes = {"add": lambda: store.add([_record(1, 1001.0)]),
                  "label": lambda: store.set_label(1, "good"),
                  "prune": lambda: store.prune(max_count=0)}
        for name, write in writes.items():
            start = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="locked by another connection"
                               ) as info:
                write()
            assert 0.3 <= time.monotonic() - start < 5.0, name  # bounded by the timeout
            assert not info.value.outcome_unknown and str(store.path) in str(info.value)
        assert store.count() == 1  # reads go on (WAL: a writer blocks no reader)
    assert store.add([_record(1, 1001.0)]) == [2] and store.get(1).label is None
    assert store.count() == 2
    store.close()


def test_the_check_takes_the_write_lock_without_waiting_out_the_busy_timeout(tmp_path):
    """check() (what /readyz asks): passes on a free log; while another connection holds the
    write lock it fails within CHECK_TIMEOUT_S, however long the busy timeout (a read would
    pass: WAL readers never block)."""
    store = SQLiteResultStore(tmp_path / "results.sqlite", busy_timeout_s=30)
    store.check()
    with write_locked(store.path):
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="readiness check"):
            store.check()
        assert time.monotonic() - start < CHECK_TIMEOUT_S + 2.0
        assert store.query(limit=1) == []
    store.check()
    store.close()


def _version_3_wal_log(path) -> None:
    """A log as a service of schema version 3 left it (WAL mode, one record): opening it with
    the current store needs the write lock (it adds a column)."""
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.executescript(SCHEMA.replace("    original_path TEXT,\n", ""))
    con.execute("INSERT INTO results (time, request_id, score, normalized_score, is_anomalous, "
                "threshold, model_id, model_checksum) VALUES (1000.0, 'old', 2.5, 0.7, 1, 2.0, "
                "'m', 'c')")
    con.execute("PRAGMA user_version=3")
    con.close()


@pytest.mark.parametrize("log", ["new", "version 3"])
def test_a_log_another_process_holds_locked_at_open_opens_and_serves_once_released(
        tmp_path, log):
    """Another process holds the log locked while the store opens it, its tables still to be
    created or upgraded: the open waits the busy timeout, then opens all the same (nothing is
    wrong with the file: no ConfigError); every use, the readiness check included, is
    StoreUnavailableError naming the file, who probably holds it and what to do, never the
    advice to move it away. Once the lock is gone the first use creates the tables and the
    store records, reads and labels as if opened then."""
    path = tmp_path / "results.sqlite"
    old = 0
    if log == "version 3":
        _version_3_wal_log(path)
        old = 1
    with locked_by_another_process(path):
        start = time.monotonic()
        store = SQLiteResultStore(path, busy_timeout_s=0.3)
        assert 0.3 <= time.monotonic() - start < 5.0  # waited its busy timeout, no longer
        uses = {"check": store.check, "add": lambda: store.add([_record(1, 1001.0)]),
                "count": store.count, "query": store.query, "get": lambda: store.get(1),
                "label": lambda: store.set_label(1, "good"),
                "prune": lambda: store.prune(max_count=0)}
        for name, use in uses.items():
            with pytest.raises(StoreUnavailableError) as info:
                use()
            message = str(info.value)
            assert str(path) in message and "locked by another program" in message, name
            assert "second service" in message and "Stop that program or wait" in message
            assert "move it away" not in message and "without a restart" in message
    store.check()
    assert store.add([_record(1, 1001.0)]) == [old + 1] and store.count() == old + 1
    assert store.set_label(old + 1, "defect").label == "defect"
    assert [r.request_id for r in store.query()] == ["r1", "old"][:old + 1]
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()
    store.close()


def test_a_current_log_locked_at_open_opens_at_once_and_reads(tmp_path):
    """A current log (nothing to create) that another process holds locked opens without
    waiting and reads on (WAL readers need no lock); writes wait out the busy timeout as on
    a lock taken after the open; once the lock is gone it writes."""
    path = tmp_path / "results.sqlite"
    SQLiteResultStore(path).add([_record(0, 1000.0)])
    with locked_by_another_process(path):
        start = time.monotonic()
        store = SQLiteResultStore(path, busy_timeout_s=30)
        assert time.monotonic() - start < 5.0  # not the 30 s busy timeout
        assert store.count() == 1 and store.get(1).request_id == "r0"
        with pytest.raises(StoreUnavailableError, match="readiness check"):
            store.check()
    assert store.add([_record(1, 1001.0)]) == [2]
    store.close()


def test_a_log_of_a_newer_version_found_once_the_lock_is_gone_keeps_its_advice(tmp_path):
    """A log whose version shows only after the lock that hid it is gone (a rollback-journal
    file locked exclusively cannot even be read): each use refuses it with the open's advice,
    as the open would have (it cannot turn usable by itself)."""
    path = tmp_path / "results.sqlite"
    con = sqlite3.connect(path)
    con.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    con.close()
    with locked_by_another_process(path):
        store = SQLiteResultStore(path, busy_timeout_s=0.3)
    for use in (store.check, store.count):
        with pytest.raises(StoreUnavailableError, match=r"results\.sqlite: a results log of a "
                           r"newer version \(5\); move it away or give another --results-dir"):
            use()
    store.close()


def test_a_file_that_is_no_results_log_is_a_config_error_saying_move_it_away(tmp_path):
    """A file that is not a SQLite database, or a folder in the log's place: ConfigError
    naming it and saying to move it away (these do not pass by themselves)."""
    bad = tmp_path / "results.sqlite"
    bad.write_bytes(b"no SQLite database here\n" * 200)
    with pytest.raises(ConfigError, match=r"results\.sqlite: file is not a database; move it "
                       r"away or give another --results-dir"):
        SQLiteResultStore(bad)
    folder = tmp_path / "a_folder.sqlite"
    folder.mkdir()
    with pytest.raises(ConfigError, match="a_folder.sqlite: .*; move it away"):
        SQLiteResultStore(folder)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), "5"])
def test_a_busy_timeout_that_is_no_positive_number_is_refused(tmp_path, timeout):
    with pytest.raises(ValueError, match="busy_timeout_s"):
        SQLiteResultStore(tmp_path / "results.sqlite", busy_timeout_s=timeout)


def test_the_default_busy_timeout_is_bounded_below_the_request_timeout():
    """Every request queued behind the writer waits out a lock: the default gives up in
    seconds, well inside the service's request timeout."""
    from anomaly_hooks.serve.settings import ServeSettings

    assert 1.0 <= BUSY_TIMEOUT_S <= ServeSettings(model="m").request_timeout_s / 10


def test_a_locked_log_fails_a_group_at_once_and_logs_one_line(tmp_path, caplog):
    """The group commit on a locked log: every record of the group fails with
    StoreUnavailableError after one busy timeout (not one timeout per record), the outage is
    logged once, its end once."""
    store = SQLiteResultStore(tmp_path / "results.sqlite", busy_timeout_s=0.3)
    recorder = Recorder(store)
    gate = threading.Event()
    try:
        with write_locked(store.path), caplog.at_level(logging.WARNING, "anomaly_hooks.serve"):
            recorder.call(gate.wait, 10)  # the writer waits: the records queue up as one group
            futures = [recorder.submit(_record(i, 1000.0 + i)) for i in range(12)]
            start = time.monotonic()
            gate.set()
            for fut in futures:
                with pytest.raises(StoreUnavailableError):
                    fut.result(30)
            assert time.monotonic() - start < 3.0  # one wait of 0.3 s, not twelve
            again = recorder.submit(_record(20, 1020.0))
            with pytest.raises(StoreUnavailableError):
                again.result(30)
        assert recorder.submit(_record(21, 1021.0)).result(30) == 1
    finally:
        recorder.close()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("unavailable" in m for m in lines) == 1, lines
    assert not any(r.exc_info for r in caplog.records)  # one line, no traceback
    assert store.count() == 1


# ---- operator labels ------------------------------------------------------------------------
def test_labels_set_replace_and_filter(store_factory):
    store = store_factory()
    store.add([_record(i, 1000.0 + i, anomalous=i % 2 == 0) for i in range(6)])
    rec = store.set_label(2, "defect", "scratch near the edge", "token:ab12", now=1500.25)
    assert (rec.id, rec.label, rec.label_note, rec.label_by, rec.label_at) == (
        2, "defect", "scratch near the edge", "token:ab12", 1500.25)
    assert store.set_label(3, "good", now=1600.0).label_note is None
    assert store.set_label(5, "defect", "", "x").label_at > 1.7e9  # now by default
    assert store.set_label(5, "good", "on second look", "y", now=1700.0).label == "good"
    assert [r.id for r in store.query(label="good")] == [5, 3]
    assert [r.id for r in store.query(label="defect")] == [2]
    assert [r.id for r in store.query(label="none")] == [6, 4, 1]
    assert [r.id for r in store.query(label="none", anomalous=True)] == [1]
    assert [r.id for r in store.query(label="good", before_id=5)] == [3]
    assert [r.id for r in store.iter_query(page=1, label="none")] == [6, 4, 1]
    assert store.get(2).label == "defect" and store.get(1).label is None
    with pytest.raises(ValueError, match="label filter"):
        store.query(label="bad")
    store.close()
    again = store_factory()   # labels are durable like the records
    assert again.get(5).label_note == "on second look"


@pytest.mark.parametrize("label, note, by, message", [
    ("ok", None, None, "label must be"), ("Good", None, None, "label must be"),
    (None, None, None, "label must be"), ("good", "x" * 501, None, "500 characters"),
    ("good", 5, None, "note"), ("defect", None, 7, "author")])
def test_bad_labels_are_refused(store_factory, label, note, by, message):
    store = store_factory()
    store.add([_record(1, 1000.0)])
    with pytest.raises(ValueError, match=message):
        store.set_label(1, label, note, by)
    assert store.get(1).label is None
    assert store.set_label(1, "good", "x" * 500).label_note == "x" * 500  # the limit itself


def test_labelling_an_unknown_record_is_none(store_factory):
    store = store_factory()
    store.add([_record(1, 1000.0)])
    for rid in (2, 0, -1, MAX_ID, MAX_ID + 1, 10**30):
        assert store.set_label(rid, "good") is None
    assert store.query(label="good") == []


def test_labels_in_json_and_csv(store_factory):
    store = store_factory()
    store.add([_record(1, 1000.0), _record(2, 1001.0)])
    store.set_label(2, "defect", "=cmd|' /C calc'!A0", "token:ab12", now=1000.5)
    out = store.get(2).as_json()
    assert {k: out[k] for k in ("label", "label_note", "label_by", "label_at",
                                "label_at_iso")} == {
        "label": "defect", "label_note": "=cmd|' /C calc'!A0", "label_by": "token:ab12",
        "label_at": 1000.5, "label_at_iso": "1970-01-01T00:16:40.500Z"}
    assert store.get(1).as_json()["label_at_iso"] is None
    rows = list(csv.DictReader(io.StringIO("".join(csv_lines(store.iter_query())))))
    assert (rows[0]["label"], rows[0]["label_by"], rows[0]["label_at_iso"]) == (
        "defect", "token:ab12", "1970-01-01T00:16:40.500Z")
    assert rows[0]["label_note"].startswith("'=")  # no formula
    assert (rows[1]["label"], rows[1]["label_at_iso"]) == ("", "")


def test_a_version_1_sqlite_log_gains_the_label_columns(tmp_path):
    """A log written before labels (schema version 1): opened, it gets the label columns
    (version 2), its records read back unlabelled and can be labelled."""
    v1 = SCHEMA.replace(",\n    label TEXT,\n    label_note TEXT,\n    label_by TEXT,\n"
                        "    label_at REAL", "").replace("    model_name TEXT,\n", "").replace(
                            "    original_path TEXT,\n", "")
    assert "label" not in v1 and "model_name" not in v1
    con = sqlite3.connect(tmp_path / "r.sqlite")
    con.executescript(v1)
    con.execute("INSERT INTO results (time, request_id, score, normalized_score, is_anomalous, "
                "threshold, model_id, model_checksum) VALUES (1000.0, 'old', 2.5, 0.7, 1, 2.0, "
                "'m', 'c')")
    con.execute("PRAGMA user_version=1")
    con.commit()
    con.close()
    store = SQLiteResultStore(tmp_path / "r.sqlite")
    assert store.get(1).label is None and store.query(label="none")[0].request_id == "old"
    assert store.set_label(1, "good").label == "good"
    assert store._write.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    store.close()
    SQLiteResultStore(tmp_path / "r.sqlite").close()  # opened again: nothing left to do


def test_a_version_2_sqlite_log_gains_the_model_name_column(tmp_path):
    """A log written before model names (schema version 2): opened, it gets the nullable
    ``model_name`` column (version 3); its records read back without a name, new ones carry
    theirs, and the model filter finds them."""
    v2 = SCHEMA.replace("    model_name TEXT,\n", "").replace("    original_path TEXT,\n", "")
    assert "model_name" not in v2 and "label" in v2
    con = sqlite3.connect(tmp_path / "r.sqlite")
    con.executescript(v2)
    con.execute("INSERT INTO results (time, request_id, score, normalized_score, is_anomalous, "
                "threshold, model_id, model_checksum, label) VALUES (1000.0, 'old', 2.5, 0.7, "
                "1, 2.0, 'm', 'c', 'good')")
    con.execute("PRAGMA user_version=2")
    con.commit()
    con.close()
    store = SQLiteResultStore(tmp_path / "r.sqlite")
    assert store._write.execute("PRAGMA user_version").fetchone()[0] == 4
    old = store.get(1)
    assert old.model_name is None and old.label == "good"
    new = Record(time=2000.0, request_id="new", verdict=old.verdict, model_id="m",
                 model_checksum="c", model_name="line-2")
    store.add([new])
    assert [r.request_id for r in store.query(model="line-2")] == ["new"]
    assert [r.request_id for r in store.query()] == ["new", "old"]
    assert store.query(model="nothing") == []
    store.close()
    SQLiteResultStore(tmp_path / "r.sqlite").close()


def test_a_version_3_sqlite_log_gains_the_original_path_and_retention_removes_originals(
        tmp_path):
    """A log written before originals were kept (schema version 3): opened, it gets the
    nullable ``original_path`` column (version 4); a record with a kept original reads it
    back, and pruning the record returns it so that its original file goes too."""
    v3 = SCHEMA.replace("    original_path TEXT,\n", "")
    assert "original_path" not in v3 and "model_name" in v3
    con = sqlite3.connect(tmp_path / "r.sqlite")
    con.executescript(v3)
    con.execute("INSERT INTO results (time, request_id, score, normalized_score, is_anomalous, "
                "threshold, model_id, model_checksum) VALUES (1000.0, 'old', 2.5, 0.7, 1, 2.0, "
                "'m', 'c')")
    con.execute("PRAGMA user_version=3")
    con.commit()
    con.close()
    store = SQLiteResultStore(tmp_path / "r.sqlite")
    assert store._write.execute("PRAGMA user_version").fetchone()[0] == 4
    old = store.get(1)
    assert old.original_path is None
    files = ImageFiles(tmp_path)
    paths = files.write("new", 2000.0, {"original": b"\xff\xd8\xff jpeg bytes"}, "JPEG")
    assert paths["original"].endswith("new_original.jpg")
    new = Record(time=2000.0, request_id="new", verdict=old.verdict, model_id="m",
                 model_checksum="c", original_path=paths["original"])
    store.add([new])
    assert store.get(new.id).original_path == paths["original"]
    assert store.get(new.id).as_json()["original_url"] == f"/v1/results/{new.id}/original"
    removed = store.prune(max_count=0)
    assert files.delete(removed) == 1 and files.resolve(paths["original"]) is None
    store.close()


def test_a_store_without_labels_says_so():
    class Minimal(ResultStore):
        add = query = get = count = prune = None  # type: ignore[assignment]

    Minimal.__abstractmethods__ = frozenset()
    with pytest.raises(NotImplementedError, match="keeps no labels"):
        Minimal().set_label(1, "good")
