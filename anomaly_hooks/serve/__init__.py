"""The inspection service: ``anomaly-hooks serve --model m.safetensors`` (or ``m.onnx``: an
exported model on ONNX Runtime, where PyTorch need not be installed).

A FastAPI app on uvicorn (optional extra ``[serve]``) around one loaded model: single and batch
prediction with dynamic batching, a results log (SQLite), an operator web page, the API docs
(``/docs``, ``/openapi.json``), Prometheus metrics, bearer-token auth and atomic model reload.
Importing this package does not import FastAPI or torch; :func:`create_app` imports FastAPI,
and torch is imported only when a PyTorch model is loaded (:mod:`.engine_torch`).

Modules: :mod:`.app` (``create_app``), :mod:`.service` (the running service),
:mod:`.routes` (one router per area), :mod:`.schemas` (the JSON bodies), :mod:`.dependencies`,
:mod:`.middleware`, :mod:`.engine` (one loaded model: the interface; :mod:`.engine_torch`,
:mod:`.engine_onnx`), :mod:`.batcher`, :mod:`.results` (the
results log), :mod:`.uploads`, :mod:`.forms` (bounded multipart bodies), :mod:`.pictures`,
:mod:`.modelpaths`, :mod:`.monitoring`, :mod:`.metrics`, :mod:`.errors`, :mod:`.settings`,
:mod:`.connections` (connection limits), :mod:`.server` (the uvicorn server of the CLI),
:mod:`.cli`.
"""
from __future__ import annotations

from typing import Any

__all__ = ["create_app", "ServeSettings"]


def __getattr__(name: str) -> Any:  # PEP 562: FastAPI is imported only when the app is built
    if name == "create_app":
        from anomaly_hooks.serve.app import create_app
        return create_app
    if name == "ServeSettings":
        from anomaly_hooks.serve.settings import ServeSettings
        return ServeSettings
    raise AttributeError(f"module 'anomaly_hooks.serve' has no attribute {name!r}")
