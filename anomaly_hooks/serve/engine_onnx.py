"""The ONNX engine of the service: an exported model (``anomaly-hooks export``, ``.onnx``) on
:class:`~anomaly_hooks.runtime.OnnxDetector` -- ONNX Runtime, numpy and Pillow, no PyTorch
(the edge service: ``anomaly-hooks serve --model m.onnx``; see :mod:`.engine` for the
interface).

It uses the runtime's public steps only: :meth:`~anomaly_hooks.runtime.OnnxDetector.load`
(which verifies the file's checksum, metadata and graph before any image; with the Pillow
resize, :data:`PREPROCESS`),
:meth:`~anomaly_hooks.runtime.OnnxDetector.preprocess`,
:meth:`~anomaly_hooks.runtime.OnnxDetector.run` and
:meth:`~anomaly_hooks.runtime.OnnxDetector.heatmap`, so that a prediction of the service is the
runtime's ``predict`` of the same image.

Drift: an export of a model with a drift reference carries that reference in its metadata and
outputs each tapped layer's per-image channel means beside the scores, so :meth:`OnnxEngine.infer`
hands the service the same ``features`` as the PyTorch engine and the same numpy drift monitor
(``anomaly_hooks.monitor.service``) runs on them. An older export (format 2) or one of a model
fitted without a reference feeds no monitor: :attr:`OnnxEngine.drift_unavailable` says why and
what to do, and ``/v1/drift`` answers it with a 409.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from anomaly_hooks.errors import ConfigError, ModelFileError
from anomaly_hooks.serve.engine import ModelEngine
from anomaly_hooks.serve.modelpaths import physical_memory

# the service forms its batches itself (--max-batch): one session run per batch
SESSION_BATCH = 1 << 16
# the runtime's Pillow resize: ~10x less CPU than the numpy one on a 900 x 900 upload (12 against
# 116 ms, docs/benchmarks.md), equal to the torch Preprocessor within float32 rounding as well
PREPROCESS = "pillow"
# ONNX Runtime's threads wait without spinning: the decode pool needs those CPU cycles on a
# small box (1.2x images per CPU-second for the service, docs/benchmarks.md)
SPIN = False
CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


def providers_for(device: Optional[str]) -> List[Any]:
    """ONNX Runtime execution providers for the service's ``--device``: none or ``cpu`` -> the
    CPU; ``cuda`` / ``cuda:N`` -> CUDA (device N), then the CPU; ``auto`` -> CUDA where this
    ONNX Runtime has it, else the CPU.

    Raises:
        ConfigError: another device, or CUDA asked for where ONNX Runtime has no CUDA
            provider (the ``onnxruntime-gpu`` package).
    """
    if device in (None, "", "cpu"):
        return [CPU]
    match = re.fullmatch(r"cuda(?::(\d+))?", str(device))
    if device != "auto" and match is None:
        raise ConfigError(f"--device {device!r}: an ONNX model runs on cpu, cuda, cuda:N or "
                          "auto")
    try:
        import onnxruntime as ort

        available = list(ort.get_available_providers())
    except ImportError:  # OnnxDetector.load then says what to install
        available = [CPU]
    if CUDA not in available:
        if device == "auto":
            return [CPU]
        raise ConfigError(f"--device {device}: this ONNX Runtime has no CUDA provider "
                          f"(it has {', '.join(available)}); install onnxruntime-gpu, or "
                          "serve on the cpu")
    index = int(match.group(1)) if match is not None and match.group(1) else 0
    return [(CUDA, {"device_id": index}), CPU]


class OnnxEngine(ModelEngine):
    """An exported model on ONNX Runtime (``.onnx``), with the drift taps where its file has
    them."""

    kind = "onnx"

    @property  # type: ignore[override]
    def drift_unavailable(self) -> Optional[str]:
        """None when the file feeds a drift monitor, else why not (the runtime's reason)."""
        reason = self.detector.drift_unavailable
        return None if reason is None else f"{reason}; this service runs without a drift monitor"

    @classmethod
    def check_file(cls, path: Path) -> None:
        """A file larger than this machine's memory is refused before it is read (the
        runtime verifies the rest: its checksum covers every byte)."""
        size = path.stat().st_size
        memory = physical_memory()
        if memory is not None and size > memory:
            raise ModelFileError(f"{path}: {size:,} bytes, more than this machine's memory "
                                 f"({memory:,} bytes); a model is loaded into memory whole")

    @classmethod
    def open_detector(cls, path: Path, device: Optional[str]) -> Any:
        from anomaly_hooks.runtime import OnnxDetector

        return OnnxDetector.load(path, providers=providers_for(device),
                                 batch_size=SESSION_BATCH, preprocess_method=PREPROCESS,
                                 spin=SPIN)

    @property
    def method(self) -> str:
        return str(self.detector.method)

    @property
    def backbone_name(self) -> str:
        return str(self.detector.model.backbone["name"])

    def info(self) -> Dict[str, Any]:
        det = self.detector
        model = det.model
        meta = det.meta
        return {
            **self._file_info(),
            "method": det.method,
            "backbone": {"name": model.backbone["name"], "weights": None,
                         "class": model.backbone["class"]},
            "layers": [layer["name"] for layer in model.layers],
            "layer_info": [dict(layer) for layer in model.layers],
            "input_size": list(self.input_size),
            "preprocess": dict(model.preprocess),
            "threshold": det.threshold_.as_dict(),
            "fitted_on": None,  # not part of an export
            "fit": {},
            "device": ",".join(_provider_names(det.session.get_providers())),
            "config": {},
            "export": {"scorer_form": model.scorer_form, "grid": list(model.grid),
                       "int8": model.int8, "checksum": model.checksum,
                       "source_checksum": meta.get("source_checksum") or None,
                       "anomaly_hooks_version": meta.get("anomaly_hooks_version"),
                       "max_pixels": model.max_pixels},
        }

    def network_input(self, canonical: np.ndarray, size: Optional[Tuple[int, int]] = None
                      ) -> np.ndarray:
        return self.detector.preprocess(canonical, size)

    def stack(self, tensors: List[Any]) -> np.ndarray:
        return np.stack(list(tensors))

    def heat_to_frame(self, heat: Any, size: Tuple[int, int], fill: float) -> np.ndarray:
        # the runtime's own way back (its fill is the map's minimum, as the service's)
        return self.detector.heatmap(np.asarray(heat), size)

    def infer(self, tensors: List[Any], features: Optional[Dict[str, np.ndarray]] = None,
              sizes: Optional[Sequence[Tuple[int, int]]] = None) -> Tuple[np.ndarray, Any]:
        """As :meth:`ModelEngine.infer`: ``features`` receives the graph's layer-mean outputs
        (left empty for a file without them, :attr:`drift_unavailable`)."""
        scores, maps = self.detector.run(self.stack(tensors), sizes=sizes, features=features)
        return np.asarray(scores).astype(np.float64), maps


def _provider_names(providers: Sequence[Any]) -> List[str]:
    return [p if isinstance(p, str) else str(p[0]) for p in providers]
