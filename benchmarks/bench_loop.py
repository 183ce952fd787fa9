#!/usr/bin/env python
"""The learning loop through the real service: serve, label, update from the results log,
promote; false alarms and recall before and after, against a full refit.

Usage::

    nice -n 5 python benchmarks/bench_loop.py --data ../shared/data/visa_macaroni1 \\
        --config configs/patchcore_effnet_lite0.yaml [--repeats N] [--keep-inputs] \\
        [key=value ...] [--json out.json]

On an MVTec-layout data set (``train/good``, ``test/<type>``), the training images in file
order are cut in two (``--split``, the first part):

1. **v1**: a fit on the first part, saved in a models folder;
2. ``anomaly-hooks serve --models-dir`` (a real server in a subprocess, ``--keep-originals
   all``; ``--keep-inputs`` with that option) serving v1; the test images are sent
   (**before**: false alarms on ``test/good``, recall on the defective ones);
3. the second part arrives on the line: sent to the server, then every one of them labelled
   ``good`` through ``POST /v1/results/{id}/label`` (the false alarms among them, and the
   parts confirmed good: ``--label alarms`` labels only the false alarms);
4. **v2**: v1 updated from the results log (:func:`anomaly_hooks.learning.update_from_results`,
   the results recorded since step 3), saved in the models folder and promoted (``POST
   /v1/admin/promote``); the test images are sent again (**after**), and the labelled images;
5. **refit**: a fresh fit on every training image, scored on the test images in process.

Printed: each model's threshold, false alarms on ``test/good``, recall on the defective test
images and (v1, v2) the alarms on the labelled images; the update's seconds and a full refit's
(both in this process, adjacent; ``--repeats N``: N such pairs, in turns, each update of v1
loaded afresh from its file), and the ratio of their medians; also that ratio with the update
counting the load of v1 (what ``anomaly-hooks update`` pays and ``fit`` does not; neither
counts writing its model file).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any, Dict, List, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from anomaly_hooks.config import load_config  # noqa: E402
from anomaly_hooks.detector import Detector  # noqa: E402
from anomaly_hooks.evaluation.datasets import mvtec  # noqa: E402
from anomaly_hooks.learning import update_from_results  # noqa: E402
from benchmarks.measure import (  # noqa: E402
    machine,
    split_training,
    stop_process,
    update_arguments,
    wait_ready,
    write_json,
)

TOKEN = "bench-loop-token"


class Server:
    """``anomaly-hooks serve`` in a subprocess on a free loopback port."""

    def __init__(self, model: Path, models_dir: Path, results: Path, log: Path,
                 keep_inputs: bool = False) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "anomaly_hooks.cli", "serve", "--model", str(model),
             "--models-dir", str(models_dir), "--port", str(self.port), "--token", TOKEN,
             "--results-dir", str(results), "--keep-originals", "all", "--keep-images", "none",
             "--no-thumbnails", "--monitor", "none", "--no-sighup",
             *(["--keep-inputs"] if keep_inputs else [])],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.client = httpx.Client(base_url=self.url, timeout=300,
                                   headers={"Authorization": f"Bearer {TOKEN}"})

    def wait_ready(self, timeout: float = 600) -> None:
        """Until ``/readyz`` answers 200."""
        wait_ready(self.proc, self.url, None, timeout)

    def predict(self, paths: Sequence[str]) -> List[Dict[str, Any]]:
        """Each image's prediction (in order), four requests at a time (the server batches)."""
        def one(path: str) -> Dict[str, Any]:
            r = self.client.post("/v1/predict", content=Path(path).read_bytes(),
                                 params={"source": Path(path).name},
                                 headers={"Content-Type": "application/octet-stream"})
            r.raise_for_status()
            return r.json()

        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(one, paths))

    def label(self, ids: Sequence[int], label: str, note: str) -> None:
        for rid in ids:
            self.client.post(f"/v1/results/{rid}/label",
                             json={"label": label, "note": note}).raise_for_status()

    def promote(self, version: str) -> Dict[str, Any]:
        r = self.client.post("/v1/admin/promote", json={"version": version})
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        self.client.close()
        stop_process(self.proc, 60, group=True)
        self.log.close()


def rates(flagged: np.ndarray, labels: np.ndarray) -> Dict[str, Any]:
    """False alarms on the good test images and recall on the defective ones."""
    good = labels == 0
    return {"false_alarms": int(flagged[good].sum()), "n_good": int(good.sum()),
            "recall": float(flagged[~good].mean()), "n_defective": int((~good).sum())}


def served(server: Server, tests: Sequence[str], labels: np.ndarray) -> Dict[str, Any]:
    preds = server.predict(tests)
    out = rates(np.array([p["is_anomalous"] for p in preds]), labels)
    return {**out, "threshold": float(preds[0]["threshold"]),
            "model": preds[0]["model"]["id"]}


def main(argv=None) -> int:
    parser = update_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--label", choices=["all", "alarms"], default="all",
                        help="label every new image good (default), or only its false alarms")
    parser.add_argument("--repeats", type=int, default=1,
                        help="time the update and the refit this many times, in turns (each "
                             "update of v1 loaded afresh); the ratio of their medians")
    parser.add_argument("--keep-inputs", action="store_true",
                        help="serve with --keep-inputs: the update reads the network inputs "
                             "the service kept instead of decoding the images again")
    args = parser.parse_args(argv)
    data = mvtec(args.data)
    cfg = load_config(args.config, args.overrides)
    train = [str(p) for p in data.train]
    first, second = split_training(train, args.split)
    tests = [str(s.path) for s in data.test]
    labels = np.asarray(data.labels)
    out: Dict[str, Any] = {"data": args.data, "config": args.config,
                           "overrides": args.overrides, "n_first": len(first),
                           "n_second": len(second), "keep_inputs": args.keep_inputs,
                           "machine": machine()}
    warnings.simplefilter("ignore")  # the few-images rate warnings of every fit
    with TemporaryDirectory(prefix="bench_loop_") as tmp:
        work = Path(tmp)
        models, results = work / "models", work / "results"
        models.mkdir()
        start = time.perf_counter()
        v1 = Detector(cfg).fit(first, progress=False)
        out["fit_first_s"] = time.perf_counter() - start
        v1_path = v1.save(models / "v1.safetensors")
        server = Server(v1_path, models, results, work / "server.log", args.keep_inputs)
        try:
            server.wait_ready()
            out["before"] = served(server, tests, labels)
            since = time.time()
            new = server.predict(second)
            alarms = [p["id"] for p in new if p["is_anomalous"]]
            chosen = [p["id"] for p in new] if args.label == "all" else alarms
            server.label(chosen, "good", "new material: a good part")
            out["new_alarms_before"] = len(alarms)
            out["labelled"] = len(chosen)
            start = time.perf_counter()
            det = Detector.load(v1_path, for_update=True)
            load_s = time.perf_counter() - start
            start = time.perf_counter()
            found = update_from_results(det, str(results), since=since)
            out["update_s"] = time.perf_counter() - start
            out["images_added"] = len(found.good)
            out["inputs_read"] = found.kept_inputs["read"]
            out["update_steps"] = det.update_timings_
            det.save(models / "v2.safetensors")
            start = time.perf_counter()
            refit = Detector(cfg).fit(train, progress=False)
            out["refit_s"] = time.perf_counter() - start
            out["refit_steps"] = refit.fit_timings_
            out["pairs"] = [[out["update_s"], out["refit_s"], load_s],
                            *more_pairs(v1_path, results, since, cfg, train,
                                        args.repeats - 1)]
            out["promote"] = server.promote("v2.safetensors")["version"]
            out["after"] = served(server, tests, labels)
            again = server.predict([second[i] for i, p in enumerate(new) if p["id"] in chosen])
            out["labelled_alarms_after"] = sum(p["is_anomalous"] for p in again)
        finally:
            server.stop()
    scores = np.asarray(refit.decision_function(tests))
    out["refit"] = {**rates(scores > refit.threshold_.value, labels),
                    "threshold": float(refit.threshold_.value)}
    pairs = np.asarray(out["pairs"])
    out["update_median_s"], out["refit_median_s"], out["load_median_s"] = (
        float(v) for v in np.median(pairs, 0))
    out["update_over_refit"] = out["update_median_s"] / out["refit_median_s"]
    out["update_with_load_over_refit"] = float(np.median(pairs[:, 0] + pairs[:, 2])
                                               / out["refit_median_s"])
    report(out)
    if args.json:
        write_json(args.json, out)
    return 0


def more_pairs(v1_path: Path, results: Path, since: float, cfg: Any, train: List[str],
               n: int) -> List[List[float]]:
    """``n`` more (update seconds, refit seconds, v1's load seconds) triples, in turns: v1
    loaded afresh and updated from the same results, then a fresh fit on every training
    image."""
    pairs = []
    for _ in range(n):
        start = time.perf_counter()
        det = Detector.load(v1_path, for_update=True)
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        update_from_results(det, str(results), since=since)
        update_s = time.perf_counter() - start
        del det
        start = time.perf_counter()
        Detector(cfg).fit(train, progress=False)
        pairs.append([update_s, time.perf_counter() - start, load_s])
    return pairs


def report(out: Dict[str, Any]) -> None:
    """The table rows (markdown) and the timings."""
    def row(name: str, r: Dict[str, Any], extra: str) -> str:
        return (f"| {name} | {r['threshold']:.4g} | {r['false_alarms']}/{r['n_good']} | "
                f"{100 * r['recall']:.1f} % | {extra} |")

    print(f"{out['config']} on {out['data']}: fit on {out['n_first']}, "
          f"{out['n_second']} new images sent, {out['labelled']} labelled good")
    print("| model | threshold | false alarms, test/good | recall | alarms on the labelled |")
    print("|---|---:|---:|---:|---:|")
    print(row("v1 (served)", out["before"], f"{out['new_alarms_before']}/{out['labelled']}"))
    print(row("v2 = v1 + update (served)", out["after"],
              f"{out['labelled_alarms_after']}/{out['labelled']}"))
    print(row("refit on all", out["refit"], ""))
    pairs = " ".join(f"{u:.1f}/{r:.1f}" for u, r, _ in out["pairs"])
    kept = (f", {out['inputs_read']} of them from the network inputs the service kept"
            if out["keep_inputs"] else ", decoding the kept originals")
    print(f"update {out['update_median_s']:.1f} s ({out['images_added']} images{kept}), refit "
          f"{out['refit_median_s']:.1f} s (medians of {len(out['pairs'])}: {pairs}): "
          f"ratio {out['update_over_refit']:.2f}; with loading v1 first "
          f"({out['load_median_s']:.2f} s): {out['update_with_load_over_refit']:.2f}")
    for name in ("update_steps", "refit_steps"):
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in out[name].items()))


if __name__ == "__main__":
    sys.exit(main())
