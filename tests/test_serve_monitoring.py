"""The drift-monitor seam (monitoring.py): the runner observes off the batcher's thread and
survives a failing monitor; status leaves become metrics."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from serve_helpers import StandInMonitor

from anomaly_hooks.serve.engine_torch import TorchEngine as Engine
from anomaly_hooks.serve.monitoring import MonitorRunner, numeric_leaves, observed_batch


@pytest.fixture(scope="module")
def engine(fitted):
    return Engine(fitted, "in-memory", "0" * 64, 0, 0.0)


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
