"""anomaly_hooks.heap: freed host memory kept for reuse during a job, given back after it."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
from typing import Optional

import numpy as np
import pytest
import torch
from conftest import ROOT, textured_images

from anomaly_hooks import Detector, heap

glibc_only = pytest.mark.skipif(heap.glibc() is None, reason="glibc's malloc only")


def test_free_heap_is_given_back_without_error():
    """malloc_trim through ctypes where glibc has it (the service's trim), a no-op
    elsewhere."""
    glibc = platform.libc_ver()[0] == "glibc"
    assert heap.release_free_memory() is glibc, "glibc's malloc_trim was not found"
    assert heap.release_free_memory() is glibc  # loaded once, then reused

# A fresh interpreter (the heap's state its own): a block filled and freed, then a smaller
# one filled (its minor page faults: none where the freed block was kept, one a page where it
# went back to the system); then the resident memory with a large block freed inside the
# job, and after the job.
PROBE = """
import json, resource, sys, torch
from anomaly_hooks import heap
MB = 1 << 20
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
def second_block():
    torch.empty(192 * MB, dtype=torch.uint8).fill_(1)
    before = faults()
    torch.empty(96 * MB, dtype=torch.uint8).fill_(1)
    return faults() - before
with heap.keep_freed_memory():
    inside = second_block()
    torch.empty(384 * MB, dtype=torch.uint8).fill_(1)
    kept = rss_mb()
print(json.dumps({"active": heap.active(), "enabled": heap.enabled(), "inside": inside,
                  "kept": kept, "after": rss_mb()}))
"""
PAGES = 96 * (1 << 20) // 4096


def probe(env_value: Optional[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != heap.ENV}
    if env_value is not None:
        env[heap.ENV] = env_value
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_a_job_reuses_freed_blocks_and_gives_them_back_at_its_end():
    kept, released = probe(None), probe("0")
    assert kept["enabled"] and not released["enabled"]
    assert kept["inside"] < PAGES // 20  # the freed block's pages, faulted in once, reused
    assert released["inside"] > PAGES * 9 // 10  # every page anew: what the job changes
    # the 384 MB freed inside the job stay resident until its end, then go back
    assert kept["kept"] - kept["after"] > 300
    assert released["kept"] - released["after"] < 100


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_the_environment_turns_it_off(monkeypatch, value):
    monkeypatch.setenv(heap.ENV, value)
    assert not heap.enabled()
    with heap.keep_freed_memory():
        assert not heap.active()


@glibc_only
def test_nested_jobs_keep_it_until_the_outermost_ends(monkeypatch):
    monkeypatch.delenv(heap.ENV, raising=False)
    with heap.keep_freed_memory():
        with heap.keep_freed_memory():
            assert heap.active()
        assert heap.active()
    assert not heap.active()


@glibc_only
def test_jobs_on_several_threads_keep_it_until_the_last_ends(monkeypatch):
    monkeypatch.delenv(heap.ENV, raising=False)
    entered, release = threading.Barrier(3), threading.Event()
    seen = []

    def job() -> None:
        with heap.keep_freed_memory():
            entered.wait()
            release.wait()
            seen.append(heap.active())

    threads = [threading.Thread(target=job) for _ in range(2)]
    for t in threads:
        t.start()
    entered.wait()
    assert heap.active()
    release.set()
    for t in threads:
        t.join()
    assert seen == [True, True]
    assert not heap.active()


class Recording(torch.nn.Module):
    """A small seeded backbone whose first layer records, at each call, whether a job keeps
    memory (the extractor runs the layers it hooks, not necessarily ``forward``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer1 = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.layer2 = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.seen: list[bool] = []
        self.layer1.register_forward_pre_hook(lambda *_: self.seen.append(heap.active()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(torch.relu(self.layer1(x)))


@glibc_only
def test_the_detectors_jobs_run_inside_and_give_the_same_scores(monkeypatch, small_cfg):
    monkeypatch.delenv(heap.ENV, raising=False)
    cfg = {**small_cfg, "backbone": {"name": "custom", "layers": ["layer1", "layer2"]},
           "padim": {"n_features": 24}}
    net = Recording()
    det = Detector.from_config(cfg, backbone=net)
    net.seen.clear()  # the layers' shapes, probed when the detector is made
    det.fit(textured_images(12), progress=False)
    test = textured_images(6, seed=1)
    kept = det.decision_function(test)
    det.predict(test)
    list(det.iter_predict(test))
    det.update(textured_images(4, seed=2))
    assert net.seen and all(net.seen)  # fit, the scoring calls, update: every forward
    assert not heap.active()
    det.infer(det.prepare(test)[0])  # one batch, the caller's own (the service's engine)
    assert net.seen[-1] is False
    det.decision_function(test[:4])  # one batch (data.batch_size 4): nothing to keep it for
    assert net.seen[-1] is False
    monkeypatch.setenv(heap.ENV, "0")
    again = Detector.from_config(cfg, backbone=net).fit(textured_images(12), progress=False)
    assert net.seen[-1] is False
    np.testing.assert_array_equal(again.decision_function(test), kept)  # the same arithmetic
