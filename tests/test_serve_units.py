"""Units of the inspection service: upload decoding, the engine's parity with Detector.predict,
the dynamic batcher, admission, the results log, the drift-monitor seam, settings."""
from __future__ import annotations

import asyncio
import csv
import io
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import textured_images, with_defect
from serve_helpers import StandInMonitor, accepted_formats, encode, hostile_payloads

from anomaly_hooks.errors import AnomalyHooksError
from anomaly_hooks.serve.batcher import Admission, Batcher
from anomaly_hooks.serve.engine import Engine
from anomaly_hooks.serve.errors import ServeError
from anomaly_hooks.serve.monitoring import MonitorRunner, numeric_leaves, observed_batch
from anomaly_hooks.serve.results import (
    ImageFiles,
    Record,
    Recorder,
    SQLiteResultStore,
    csv_lines,
    open_store,
)
from anomaly_hooks.serve.settings import ServeSettings
from anomaly_hooks.serve.uploads import decode_upload

HOSTILE = hostile_payloads()


# ---- decoding uploads ------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_upload_gets_its_status_and_code(name):
    data, status, code = HOSTILE[name]
    with pytest.raises(ServeError) as info:
        decode_upload(data, (64, 64), 25_000_000)
    assert (info.value.status, info.value.code) == (status, code), info.value.message
    assert isinstance(info.value, AnomalyHooksError)  # the library's one error base
    assert info.value.message and "BytesIO" not in info.value.message


@pytest.mark.parametrize("name", sorted(accepted_formats()))
def test_accepted_formats_decode_like_the_library(name, tmp_path):
    from anomaly_hooks.images import read_image

    data = accepted_formats()[name]
    tensor, size, fmt = decode_upload(data, (64, 64), 25_000_000)
    path = tmp_path / f"img.{fmt.lower()}"
    path.write_bytes(data)
    assert torch.equal(tensor, read_image(path))
    assert size == tuple(tensor.shape[1:])


def test_pixel_limit_is_checked_before_decoding():
    data = encode(textured_images(1)[0])  # 112 x 96
    with pytest.raises(ServeError) as info:
        decode_upload(data, (64, 64), 112 * 96 - 1)
    assert info.value.status == 413 and "10,752 pixels" in info.value.message
    decode_upload(data, (64, 64), 112 * 96)


# ---- the engine: same results as Detector.predict --------------------------------------------
@pytest.fixture(scope="module")
def engine(fitted):
    return Engine(fitted, "in-memory", "0" * 64, 0, 0.0)


def test_engine_matches_detector_predict(engine, fitted):
    images = [textured_images(1, seed=3)[0], with_defect(textured_images(1, seed=4)[0]),
              textured_images(1, size=(150, 90), seed=5)[0]]
    expected = fitted.predict(images)
    items = [engine.prepare(encode(img), 10**8, 1024) for img in images]
    scores, maps = engine.infer([it.tensor for it in items])
    for item, score, heat, exp in zip(items, scores, maps, expected):
        out = engine.finish(float(score), heat, item, overlay=True, keep_anomalous=False,
                            thumb_side=64)
        assert out.score == pytest.approx(exp.score, rel=1e-5)
        assert out.is_anomalous == exp.is_anomalous
        assert out.normalized_score == pytest.approx(exp.normalized_score, rel=1e-4)
        assert abs(out.anomalous_pixels - int(exp.mask.sum())) <= max(2, exp.mask.size // 1000)
        assert (item.height, item.width) == exp.heatmap.shape
        from PIL import Image
        overlay = Image.open(io.BytesIO(out.overlay_png))
        mask = Image.open(io.BytesIO(out.mask_png))
        assert overlay.size == mask.size == (item.width, item.height)
        assert max(Image.open(io.BytesIO(out.thumb_jpg)).size) == 64
    assert expected[1].is_anomalous and not expected[0].is_anomalous


def test_engine_taps_channel_means_without_changing_scores(engine, fitted):
    """The drift seam's features: each tapped layer's channel means from the scoring pass,
    equal to a separate forward pass's (brute force); the scores are the same with or
    without them."""
    tensors = [engine.prepare(encode(img), 10**8, 64).tensor
               for img in textured_images(3, seed=21)]
    features = {}
    scores, _ = engine.infer(tensors, features=features)
    plain, _ = engine.infer(tensors)
    np.testing.assert_array_equal(scores, plain)
    reference = fitted.extractor(torch.stack(tensors))
    assert list(features) == list(reference) == fitted.layers
    for name, feat in reference.items():
        assert features[name].dtype == np.float32 and features[name].shape == feat.shape[:2]
        np.testing.assert_allclose(features[name], feat.double().mean(dim=(2, 3)).numpy(),
                                   rtol=1e-5, atol=1e-6)


def test_engine_overlay_is_capped_and_rendered_only_when_asked(engine):
    item = engine.prepare(encode(textured_images(1, size=(300, 200))[0]), 10**8, 100)
    assert item.preview.shape == (100, 67, 3)
    scores, maps = engine.infer([item.tensor])
    out = engine.finish(float(scores[0]), maps[0], item, overlay=False, keep_anomalous=False,
                        thumb_side=0)
    assert out.overlay_png is None and out.mask_png is None and out.thumb_jpg is None
    out = engine.finish(float(scores[0]), maps[0], item, overlay=False, keep_anomalous=True,
                        thumb_side=0)
    assert (out.overlay_png is not None) == out.is_anomalous
    out = engine.finish(float(scores[0]), maps[0], item, overlay=True, keep_anomalous=False,
                        thumb_side=0)
    from PIL import Image
    assert Image.open(io.BytesIO(out.overlay_png)).size == (67, 100)


# ---- the batcher ----------------------------------------------------------------------------
class FakeEngine:
    """infer() records batch sizes; the first call can be held until released."""

    def __init__(self, name="e1", hold_first=False, fail=False):
        self.name = name
        self.batches = []
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self.fail = fail

    def infer(self, tensors):
        self.batches.append(len(tensors))
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("model exploded")
        values = np.array([float(t) for t in tensors])
        return values, torch.zeros(len(tensors), 2, 2)


def _run(coro):
    return asyncio.run(coro)


def test_batcher_gathers_waiting_requests_up_to_max_batch():
    async def main():
        eng = FakeEngine(hold_first=True)
        pool = ThreadPoolExecutor(1)
        b = Batcher(max_batch=4, max_wait_s=0.05, max_queue=64, executor=pool)
        b.start()
        first = b.submit(torch.tensor(0.0), eng)
        await asyncio.sleep(0.2)            # the first batch (of 1) is running and held
        rest = [b.submit(torch.tensor(float(i)), eng) for i in range(1, 10)]
        assert b.depth == 9
        eng.release.set()
        results = await asyncio.gather(first, *rest)
        await b.stop()
        return eng.batches, results

    batches, results = _run(main())
    assert batches == [1, 4, 4, 1]
    assert [r[0] for r in results] == [float(i) for i in range(10)]  # each gets its own row
    assert [r[2].size for r in results] == [1, 4, 4, 4, 4, 4, 4, 4, 4, 1]


def test_batcher_waits_max_wait_for_more():
    async def main():
        eng = FakeEngine()
        b = Batcher(max_batch=8, max_wait_s=0.3, max_queue=64, executor=ThreadPoolExecutor(1))
        b.start()
        a = b.submit(torch.tensor(1.0), eng)
        await asyncio.sleep(0.05)
        c = b.submit(torch.tensor(2.0), eng)
        await asyncio.gather(a, c)
        d = b.submit(torch.tensor(3.0), eng)   # alone: runs after max_wait
        started = time.perf_counter()
        await d
        waited = time.perf_counter() - started
        await b.stop()
        return eng.batches, waited

    batches, waited = _run(main())
    assert batches == [2, 1]
    assert 0.25 < waited < 5


def test_batcher_never_mixes_engines_and_skips_cancelled():
    async def main():
        old, new = FakeEngine("old", hold_first=True), FakeEngine("new")
        b = Batcher(max_batch=8, max_wait_s=0.05, max_queue=64, executor=ThreadPoolExecutor(1))
        b.start()
        first = b.submit(torch.tensor(0.0), old)
        await asyncio.sleep(0.2)
        jobs = [b.submit(torch.tensor(1.0), old), b.submit(torch.tensor(2.0), old),
                b.submit(torch.tensor(3.0), new), b.submit(torch.tensor(4.0), old)]
        cancelled = b.submit(torch.tensor(5.0), new)
        cancelled.cancel()
        old.release.set()
        await asyncio.gather(first, *jobs)
        await b.stop()
        return old.batches, new.batches

    old_batches, new_batches = _run(main())
    assert old_batches == [1, 2, 1] and new_batches == [1]


def test_batcher_full_queue_and_failing_model():
    async def main():
        eng = FakeEngine(hold_first=True)
        b = Batcher(max_batch=2, max_wait_s=0.0, max_queue=3, executor=ThreadPoolExecutor(1))
        b.start()
        running = b.submit(torch.tensor(0.0), eng)
        await asyncio.sleep(0.2)
        queued = [b.submit(torch.tensor(1.0), eng) for _ in range(3)]
        with pytest.raises(ServeError) as info:
            b.submit(torch.tensor(1.0), eng)
        assert info.value.status == 503 and info.value.code == "overloaded"
        assert int(info.value.headers["Retry-After"]) >= 1
        eng.release.set()
        await asyncio.gather(running, *queued)
        bad = FakeEngine(fail=True)
        with pytest.raises(ServeError) as info:
            await b.submit(torch.tensor(1.0), bad)
        assert info.value.status == 500 and "model exploded" in info.value.message
        assert (await b.submit(torch.tensor(7.0), eng))[0] == 7.0  # still running
        await b.stop()

    _run(main())


def test_admission_bounds_images_in_progress():
    adm = Admission(4)
    adm.acquire(3, lambda: 2)
    with pytest.raises(ServeError) as info:
        adm.acquire(2, lambda: 2)
    assert info.value.code == "overloaded" and info.value.headers["Retry-After"] == "2"
    adm.release(3)
    adm.acquire(4, lambda: 2)


# ---- the results log ------------------------------------------------------------------------
def _record(i: int, t: float, anomalous: bool = False, **kw) -> Record:
    return Record(time=t, request_id=f"r{i}", score=float(i), normalized_score=0.5,
                  is_anomalous=anomalous, threshold=10.0, model_id="m", model_checksum="c" * 64,
                  part_id=kw.pop("part_id", f"P{i}"), **kw)


def test_store_add_query_filters_and_paging(tmp_path):
    store = SQLiteResultStore(tmp_path / "r.sqlite")
    ids = store.add([_record(i, 1000.0 + i, anomalous=i % 3 == 0) for i in range(10)])
    assert ids == list(range(1, 11)) and store.count() == 10
    assert [r.id for r in store.query(limit=3)] == [10, 9, 8]
    assert [r.score for r in store.query(anomalous=True)] == [9.0, 6.0, 3.0, 0.0]
    assert [r.id for r in store.query(since=1005.0, until=1008.0)] == [8, 7, 6]
    assert [r.id for r in store.query(part_id="P4")] == [5]
    assert [r.id for r in store.query(before_id=4)] == [3, 2, 1]
    assert [r.id for r in store.iter_query(page=3)] == list(range(10, 0, -1))
    rec = store.get(4)
    assert rec.is_anomalous is True and rec.part_id == "P3" and store.get(99) is None
    store.close()
    again = open_store(f"sqlite:///{tmp_path / 'r.sqlite'}")   # reopened: all there
    assert again.count() == 10
    assert again._write.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_store_retention_by_age_and_count(tmp_path):
    store = SQLiteResultStore(tmp_path / "r.sqlite")
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


def test_csv_export_is_parseable_and_neutralises_formulas(tmp_path):
    store = SQLiteResultStore(tmp_path / "r.sqlite")
    store.add([_record(1, 1000.0, part_id="=HYPERLINK(\"http://x\")", source="a,b\"c")])
    text = "".join(csv_lines(store.iter_query()))
    rows = list(csv.DictReader(io.StringIO(text)))
    assert rows[0]["part_id"].startswith("'=") and rows[0]["source"] == 'a,b"c'
    assert rows[0]["time_iso"] == "1970-01-01T00:16:40.000Z" and rows[0]["is_anomalous"] == "0"


def test_recorder_group_commits_from_many_threads(tmp_path):
    store = SQLiteResultStore(tmp_path / "r.sqlite")
    rec = Recorder(store)
    with ThreadPoolExecutor(16) as pool:
        futures = list(pool.map(lambda i: rec.submit(_record(i, 1000.0 + i)), range(400)))
    ids = [f.result(30) for f in futures]
    assert sorted(ids) == list(range(1, 401))
    assert rec.commits < 400                  # grouped into fewer transactions
    assert rec.call(store.count).result(30) == 400
    rec.close()
    con = sqlite3.connect(tmp_path / "r.sqlite")
    assert con.execute("SELECT COUNT(DISTINCT request_id) FROM results").fetchone()[0] == 400


def test_store_refuses_unknown_schemes(tmp_path):
    with pytest.raises(ValueError, match="implement ResultStore"):
        open_store("postgresql://db/results")


# ---- the drift-monitor seam -----------------------------------------------------------------
def test_monitor_runner_observes_off_thread_and_survives_failures(engine):
    mon = StandInMonitor()
    runner = MonitorRunner(mon)
    tensors = [torch.zeros(3, 64, 80), torch.ones(3, 64, 80)]
    assert runner.offer(lambda: observed_batch(engine, tensors, np.array([1.0, 99.0]), 5.0))
    for _ in range(100):
        if runner.observed:
            break
        time.sleep(0.02)
    batch = mon.batches[0]
    assert batch.inputs.shape == (2, 3, 64, 80) and batch.model_id == engine.model_id
    assert list(batch.is_anomalous) == [False, True] and batch.normalized_scores[1] > 0.5
    assert runner.status()["enabled"] is True

    class Broken:
        def observe(self, batch):
            raise RuntimeError("boom")

        def status(self):
            raise RuntimeError("no status")

    broken = MonitorRunner(Broken())
    broken.offer(lambda: observed_batch(engine, tensors, np.array([1.0, 2.0]), 5.0))
    time.sleep(0.2)
    assert broken.status()["state"] == "error"
    with pytest.raises(TypeError, match="observe"):
        MonitorRunner(object())


def test_numeric_leaves_flatten_status():
    status = {"state": "ok", "a": {"z": 1.5, "flag": True, "name": "x"}, "l": [1, float("nan")]}
    assert dict(numeric_leaves(status)) == {"a.z": 1.5, "a.flag": 1.0, "l.0": 1.0}


# ---- settings -------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    ({"max_batch": 0}, "max-batch"), ({"max_queue": 4, "max_batch": 8}, "max-queue"),
    ({"keep_images": "some"}, "keep-images"), ({"token": "short"}, "8 characters"),
    ({"retention_count": 0}, "retention-count")])
def test_settings_refuse_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        ServeSettings(model="m", **kw).validate()


def test_token_from_environment(monkeypatch):
    monkeypatch.setenv("ANOMALY_HOOKS_TOKEN", "from-the-env")
    assert ServeSettings(model="m").token == "from-the-env"
    assert ServeSettings(model="m", token="explicit-token").token == "explicit-token"
    assert ServeSettings(model="m").public()["token"] == "set"


def test_free_heap_is_given_back_without_error():
    """The soak's RSS fix: malloc_trim through ctypes where glibc has it, a no-op elsewhere."""
    import platform

    from anomaly_hooks.serve import app

    app._release_free_memory()
    app._release_free_memory()  # loaded once, then reused
    if platform.libc_ver()[0] == "glibc":
        assert app._LIBC, "glibc's malloc_trim was not found"
