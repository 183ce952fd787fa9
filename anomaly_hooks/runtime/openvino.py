"""Run an exported model with OpenVINO instead of ONNX Runtime (optional extra ``[openvino]``).

:class:`OpenVinoSession` reads the same ``.onnx`` file (OpenVINO parses ONNX directly and keeps
its ``metadata_props`` under ``rt_info["framework"]``) and offers the small part of
``onnxruntime.InferenceSession`` that :class:`~anomaly_hooks.runtime.OnnxDetector` uses, so
``OnnxDetector.load(path, engine="openvino")`` works with numpy, Pillow and openvino only.
Thread-safe: one infer request per thread.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import numpy as np


class OpenVinoSession:
    """The part of ``onnxruntime.InferenceSession`` that the runtime uses, on OpenVINO."""

    def __init__(self, path: str, device: str = "CPU", threads: Optional[int] = None,
                 hint: str = "LATENCY") -> None:
        import openvino as ov

        core = ov.Core()
        model = core.read_model(path)
        info = model.get_rt_info()
        self._meta: Dict[str, str] = {}
        if "framework" in info:
            fw = model.get_rt_info()["framework"]
            for key in fw:
                self._meta[key] = model.get_rt_info(["framework", key]).astype(str)
        # f32: the CPU plugin would otherwise pick bf16 where the CPU has it
        config: Dict[str, Any] = {"PERFORMANCE_HINT": hint, "INFERENCE_PRECISION_HINT": "f32"}
        if threads is not None:
            config["INFERENCE_NUM_THREADS"] = int(threads)
        self.compiled = core.compile_model(model, device, config)
        self._inputs = [SimpleNamespace(name=i.get_any_name()) for i in self.compiled.inputs]
        self._outputs = [SimpleNamespace(name=o.get_any_name()) for o in self.compiled.outputs]
        self._local = threading.local()

    def get_inputs(self) -> List[Any]:
        """Input descriptions (``.name``)."""
        return self._inputs

    def get_outputs(self) -> List[Any]:
        """Output descriptions (``.name``)."""
        return self._outputs

    def get_modelmeta(self) -> Any:
        """The ONNX ``metadata_props`` as ``.custom_metadata_map``."""
        return SimpleNamespace(custom_metadata_map=dict(self._meta))

    def run(self, output_names: Optional[List[str]], feed: Dict[str, np.ndarray]
            ) -> List[np.ndarray]:
        """Outputs by name (all when None) for ``feed``; one infer request per thread."""
        req = getattr(self._local, "request", None)
        if req is None:
            req = self._local.request = self.compiled.create_infer_request()
        res = req.infer({k: np.ascontiguousarray(v) for k, v in feed.items()})
        names = output_names or [o.name for o in self._outputs]
        by_name = {o.get_any_name(): res[o] for o in self.compiled.outputs}
        return [np.array(by_name[n], copy=True) for n in names]
