"""The running service's lifecycle and helpers (service.py)."""
from __future__ import annotations

import pytest

from anomaly_hooks import heap
from anomaly_hooks.errors import ModelFileError
from anomaly_hooks.serve.service import error_text


def test_error_text_names_the_type_of_unexpected_errors():
    assert error_text(ModelFileError("m: checksum mismatch")) == "m: checksum mismatch"
    assert error_text(FileNotFoundError("gone")) == "gone"
    assert error_text(KeyError("x")) == "KeyError: 'x'"
    assert error_text(RuntimeError()) == "RuntimeError"


@pytest.mark.skipif(heap.glibc() is None, reason="glibc's malloc only")
@pytest.mark.parametrize("keep_heap, switch, kept", [
    (True, None, True), (False, None, False), (True, "0", False)])
def test_keep_heap_keeps_freed_memory_while_the_service_runs(monkeypatch, tmp_path, fitted,
                                                              keep_heap, switch, kept):
    """``keep_heap``: every batch on the model thread runs inside the service's job (its
    freed activations reused by the next batch), and after the service stops nothing keeps
    memory any more; by default, or with the environment switch off, no batch does."""
    pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
    pytest.importorskip("httpx", reason="httpx (TestClient) is not installed")
    from serve_helpers import good_png, serving

    monkeypatch.delenv(heap.ENV, raising=False)
    if switch is not None:
        monkeypatch.setenv(heap.ENV, switch)
    model = fitted.save(tmp_path / "m.safetensors")
    seen = []
    with serving(model, tmp_path, keep_heap=keep_heap) as (client, service):
        infer = service.engine.infer

        def recording(tensors, **kw):
            seen.append(heap.active())
            return infer(tensors, **kw)

        service.engine.infer = recording
        for seed in range(3):
            assert client.post("/v1/predict", content=good_png(seed)).status_code == 200
    assert seen == [kept] * 3
    assert not heap.active()
