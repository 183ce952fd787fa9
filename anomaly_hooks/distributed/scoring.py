"""Distributed scoring on Ray Data: a pool of actors, each loading the model once, writes the
same outputs as ``anomaly-hooks score``.

    summary = score("models/padim.safetensors", ["data/sample/test"], "results_ray",
                    num_workers=2)

Pipeline::

    driver: expand inputs -> rows {batch, idx: [int], path: [str], name: [str]}
            (one row = one batch of ``data.batch_size`` consecutive images: the single-process
            ``score`` batches exactly, so every score is bit-identical to it)
    ray.data.from_items(rows)
      .map_batches(ScoreActor, batch_size=1, compute=ActorPoolStrategy(size=N))
      .iter_batches()                    # streamed back in input order
    driver: appends to results.csv + results.json (or results.parquet) as batches arrive

Exactly once: each output row carries its input index; the driver keeps a bit per input, drops a
row it has already written (a retried batch's output replaces a lost one, it is never added
twice) and reports every input never seen as a failure. The actors write the PNGs (atomically: a
killed writer leaves no torn file; a retry rewrites the same name). An unreadable image comes
back as a failure row (``iter_predict`` yields it), never retried. Only a process death is
retried: Ray Data rebuilds a dead actor and re-runs its batch; :class:`AttemptCounter` bounds
it: a batch that killed its process ``full_attempts`` times is then scored one image at a time,
and an image whose earlier start never finished is reported, not tried again.
"""
from __future__ import annotations

import csv
import glob
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from anomaly_hooks.distributed.cluster import connect, maybe_die, require_ray
from anomaly_hooks.errors import ConfigError
from anomaly_hooks.images import ImageReadError, display
from anomaly_hooks.modelfile import read_meta
from anomaly_hooks.outputs import (
    PICTURE_FOLDERS,
    RESULT_FIELDS,
    csv_cell,
    expand_inputs,
    out_name,
    result_row,
    write_images,
)

ROW_FIELDS = ["idx", *RESULT_FIELDS, "error", "pid", "attempt"]
FORMATS = ("csv", "parquet")


class AttemptCounter:
    """Ray actor (one per run): how often each batch was started, and which images were started
    but never finished. Ray Data's actor pool retries a dead actor's work without limit, so the
    limit lives here (a batch that kills its process every time, e.g. a native crash)."""

    def __init__(self) -> None:
        self.batches: Dict[int, int] = {}
        self.open: Dict[int, int] = {}

    def start_batch(self, batch: int) -> int:
        """This start's number (1 for the first)."""
        self.batches[batch] = self.batches.get(batch, 0) + 1
        return self.batches[batch]

    def start_image(self, idx: int) -> int:
        """Earlier starts of this image that never finished (> 0: it killed them)."""
        before = self.open.get(idx, 0)
        self.open[idx] = before + 1
        return before

    def finish_image(self, idx: int) -> None:
        self.open.pop(idx, None)


class ScoreActor:
    """Ray Data callable class: loads the model once, scores one pre-formed batch per call,
    writes the PNGs and returns one row per image (failures included)."""

    def __init__(self, model: str, out: str, write_pngs: bool, device: str, threads: int,
                 counter: Any, full_attempts: int) -> None:
        import torch

        from anomaly_hooks.detector import Detector

        torch.set_num_threads(max(1, threads))
        self.det = Detector.load(model, device=device)
        self.out, self.write_pngs = Path(out), write_pngs
        self.counter, self.full_attempts = counter, full_attempts

    def __call__(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        import ray

        idx = [int(i) for row in batch["idx"] for i in row]
        paths = [str(p) for row in batch["path"] for p in row]
        names = [str(n) for row in batch["name"] for n in row]
        attempt = ray.get(self.counter.start_batch.remote(int(batch["batch"][0])))
        if attempt <= self.full_attempts:
            maybe_die(idx)  # tests: an actor dies in the middle of the run
            results = self.det.iter_predict(paths, batch_size=len(paths), num_workers=0)
        else:
            results = self._one_by_one(idx, paths)
        cols: Dict[str, list] = {k: [] for k in ROW_FIELDS}
        for j, pred in results:
            row = self._row(pred, Path(paths[j]), names[j])
            row.update(idx=idx[j], pid=os.getpid(), attempt=attempt)
            for k in cols:
                cols[k].append(row.get(k, ""))
        return {k: np.asarray(v) for k, v in cols.items()}

    def _row(self, pred: Any, path: Path, name: str) -> Dict[str, Any]:
        if isinstance(pred, (str, ImageReadError)):
            return {"path": display(path), "error": str(pred), "score": np.nan,
                    "normalized_score": np.nan, "is_anomalous": False, "threshold": np.nan,
                    "anomalous_pixels": -1}
        row = {"path": display(path), "error": "", **result_row(pred, path)}
        if self.write_pngs:
            row.update(write_images(pred, path, self.out, name, self.det.cfg.data.max_pixels))
        return row

    def _one_by_one(self, idx: List[int], paths: List[str]) -> Iterator[Tuple[int, Any]]:
        """Score a batch that killed its process ``full_attempts`` times image by image; an
        image that was started before and never finished is reported, not tried again."""
        import ray

        for j, (i, path) in enumerate(zip(idx, paths)):
            died = ray.get(self.counter.start_image.remote(i))
            if died:
                yield j, (f"{path}: the worker process died while scoring this image "
                          f"({died} time(s)); not retried")
                continue
            maybe_die([i])
            for _, pred in self.det.iter_predict([path], batch_size=1, num_workers=0):
                yield j, pred
            ray.get(self.counter.finish_image.remote(i))


def plan(inputs: Sequence[str], batch_size: int) -> Tuple[List[dict], List[str], int]:
    """Rows of pre-formed batches, the input-level failures (empty folders...), and the number
    of images. Output names are given to every image up front (the plain ``score`` names only
    the readable ones: names differ only where an unreadable image's name collides)."""
    paths, roots, failures = expand_inputs(inputs)
    used: set = set()
    names = [out_name(p, r, used) for p, r in zip(paths, roots)]
    rows = [{"batch": b, "idx": list(range(lo, min(lo + batch_size, len(paths)))),
             "path": [str(p) for p in paths[lo:lo + batch_size]],
             "name": names[lo:lo + batch_size]}
            for b, lo in enumerate(range(0, len(paths), batch_size))]
    return rows, failures, len(paths)


class ResultWriter:
    """results.csv + results.json (or results.parquet + failures.json), appended batch by batch
    to temporary files that are renamed into place at the end (a run that dies leaves the
    previous results, never half a file)."""

    def __init__(self, out: Path, model: str, fmt: str) -> None:
        self.out, self.fmt, self.model = out, fmt, model
        self.n_rows = self.n_anomalous = 0
        self.failures: List[str] = []
        self._tmp: Dict[str, Path] = {}
        self._pq = None
        if fmt == "csv":
            self._csv_fh = self._open("results.csv")
            self._csv = csv.DictWriter(self._csv_fh, fieldnames=RESULT_FIELDS,
                                       extrasaction="ignore")
            self._csv.writeheader()
            self._json = self._open("results.json")
            self._json.write('{\n  "model": %s,\n  "results": [' % json.dumps(display(model)))
            self._first = True

    def _open(self, name: str) -> Any:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.out)
        self._tmp[name] = Path(tmp)
        return os.fdopen(fd, "w", encoding="utf-8", newline="")

    def add(self, batch: Dict[str, np.ndarray]) -> None:
        ok = batch["error"] == ""
        for e in batch["error"][~ok]:
            self.fail(str(e))
        if self.fmt == "parquet":
            self._add_parquet(batch)
        else:
            for i in np.flatnonzero(ok):
                row = {k: _py(batch[k][i]) for k in RESULT_FIELDS if batch[k][i] != ""}
                self._csv.writerow({k: csv_cell(v) for k, v in row.items()})
                self._json.write(("" if self._first else ",") + "\n    " + json.dumps(row))
                self._first = False
        self.n_rows += int(ok.sum())
        self.n_anomalous += int(batch["is_anomalous"][ok].sum())

    def _add_parquet(self, batch: Dict[str, np.ndarray]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({k: batch[k] for k in ["idx", *RESULT_FIELDS, "error"]})
        if self._pq is None:
            fd, tmp = tempfile.mkstemp(prefix=".results.parquet.", suffix=".tmp", dir=self.out)
            os.close(fd)
            self._tmp["results.parquet"] = Path(tmp)
            self._pq = pq.ParquetWriter(tmp, table.schema)
        self._pq.write_table(table)

    def fail(self, message: str) -> None:
        self.failures.append(message)
        print(f"FAILED {message}", file=sys.stderr)

    def close(self) -> None:
        if self.fmt == "parquet":
            if self._pq is not None:
                self._pq.close()
            fh = self._open("failures.json")
            json.dump(self.failures, fh, indent=2)
        else:
            self._csv_fh.close()
            fh = self._json
            fh.write('\n  ],\n  "failures": %s\n}\n' % json.dumps(self.failures))
        fh.close()
        for name, tmp in self._tmp.items():
            os.replace(tmp, self.out / name)


def _py(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


def score(model: str, inputs: Sequence[str], out: str, *, address: Optional[str] = None,
          num_workers: int = 2, gpus_per_worker: float = 0, cpus_per_worker: float = 1,
          batch_size: Optional[int] = None, write_pngs: bool = True, fmt: str = "csv",
          full_attempts: int = 2,
          progress: bool = False) -> Dict[str, Any]:
    """Score ``inputs`` (files and folders) into ``out`` on Ray; returns a summary: counts,
    ``failures``, ``duplicates_dropped``, ``rows_from_retries``, ``missing``, ``seconds`` and
    the actors' ``pids``."""
    if fmt not in FORMATS:
        raise ConfigError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if num_workers < 1:
        raise ConfigError("num_workers must be >= 1")
    require_ray()
    if batch_size is None:  # the model's own (read from the header alone)
        batch_size = int(read_meta(model)["config"]["data"]["batch_size"])
    if batch_size < 1:
        raise ConfigError(f"batch size {batch_size}: must be >= 1")
    ray = connect(address)
    start = time.perf_counter()
    rows, input_failures, n = plan(inputs, batch_size)
    outp = Path(out)
    for sub in PICTURE_FOLDERS:
        (outp / sub).mkdir(parents=True, exist_ok=True)
    writer = ResultWriter(outp, model, fmt)
    for failure in input_failures:
        writer.fail(failure)
    seen = np.zeros(n, dtype=bool)
    counts = {"duplicates_dropped": 0, "rows_from_retries": 0}
    pids: set = set()
    if rows:
        for batch in _dataset(ray, rows, model, outp, num_workers, gpus_per_worker,
                              cpus_per_worker, write_pngs, full_attempts, progress):
            batch = _once(batch, seen, counts)
            pids.update(int(p) for p in batch["pid"])
            counts["rows_from_retries"] += int((batch["attempt"] > 1).sum())
            writer.add(batch)
    missing = np.flatnonzero(~seen)
    for i in missing:  # only if Ray gave up on a batch: never silently lost
        r = rows[int(i) // batch_size]
        writer.fail(f"{r['path'][int(i) - r['idx'][0]]}: not scored (its worker died on every "
                    "retry)")
    writer.close()
    remove_stale_pictures(outp, [name for r in rows for name in r["name"]])
    return {"images": n, "scored": writer.n_rows, "anomalous": writer.n_anomalous,
            "failed": len(writer.failures), "failures": writer.failures,
            "missing": [int(i) for i in missing], "seconds": time.perf_counter() - start,
            "pids": sorted(pids), **counts}


def remove_stale_pictures(out: Path, names: Sequence[str]) -> int:
    """Remove the temporary picture files (``visualize.save_png``'s ``.NAME.png.*.tmp``) that
    an actor killed mid-write left in ``out``'s picture folders, for the images of this run
    only; returns how many. Its retry wrote the picture itself."""
    removed = 0
    for sub in PICTURE_FOLDERS:
        folder = out / sub
        for name in names:
            for tmp in folder.glob(f".{glob.escape(name)}.png.*.tmp"):
                tmp.unlink(missing_ok=True)
                removed += 1
    return removed


def _once(batch: Dict[str, np.ndarray], seen: np.ndarray, counts: Dict[str, int]
          ) -> Dict[str, np.ndarray]:
    """The rows of ``batch`` whose input was not written yet (marks them written)."""
    idx = batch["idx"].astype(np.int64)
    dup = seen[idx]
    if dup.any():
        counts["duplicates_dropped"] += int(dup.sum())
        batch = {k: v[~dup] for k, v in batch.items()}
        idx = idx[~dup]
    seen[idx] = True
    return batch


def _dataset(ray: Any, rows: List[dict], model: str, out: Path, num_workers: int,
             gpus_per_worker: float, cpus_per_worker: float, write_pngs: bool,
             full_attempts: int, progress: bool) -> Iterator[Dict[str, np.ndarray]]:
    """The scored rows, batch by batch, in input order."""
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # results in input order, as plain score
    ctx.enable_progress_bars = progress
    logging.getLogger("ray.data").setLevel(logging.INFO if progress else logging.WARNING)
    ctx.wait_for_min_actors_s = 600  # start once every actor holds its model: work is shared
    counter = ray.remote(num_cpus=0)(AttemptCounter).remote()
    ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        ScoreActor, batch_size=1, batch_format="numpy",
        fn_constructor_kwargs={"model": str(model), "out": str(out), "write_pngs": write_pngs,
                               "device": "cuda" if gpus_per_worker else "cpu",
                               "threads": max(1, int(cpus_per_worker)), "counter": counter,
                               "full_attempts": full_attempts},
        compute=ray.data.ActorPoolStrategy(size=min(num_workers, len(rows))),
        num_cpus=cpus_per_worker,
        num_gpus=gpus_per_worker)
    yield from ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=1)
