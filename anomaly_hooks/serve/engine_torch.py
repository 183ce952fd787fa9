"""The PyTorch engine of the service: a :class:`~anomaly_hooks.detector.Detector` loaded from
a ``.safetensors`` model file (see :mod:`.engine` for the interface).

This is the one place of the service that uses the Detector's public stages
(``preprocessor``, ``infer``, ``threshold_``) and the one module of it that imports torch; when
the library changes, only this file needs to follow.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from anomaly_hooks.serve import pictures
from anomaly_hooks.serve.engine import ModelEngine
from anomaly_hooks.serve.modelpaths import check_model_extent


def canonical_tensor(canonical: np.ndarray) -> torch.Tensor:
    """``[H, W, 3]`` float32 -> the ``[3, H, W]`` view the Detector reads
    (:func:`anomaly_hooks.images.read_image`'s)."""
    return torch.from_numpy(np.ascontiguousarray(canonical)).permute(2, 0, 1)


def preview(image: torch.Tensor, max_side: int) -> np.ndarray:
    """``[H, W, 3]`` uint8 copy of a canonical ``[3, H, W]`` tensor, long side <= max_side
    (antialiased bilinear, as the Preprocessor resizes)."""
    h, w = pictures.fit_size(image.shape[1], image.shape[2], max_side)
    x = image
    if (h, w) != tuple(image.shape[1:]):
        x = F.interpolate(image[None], size=(h, w), mode="bilinear", align_corners=False,
                          antialias=True)[0]
    x = (x.clamp(0, 1) * 255 + 0.5).to(torch.uint8)
    return x.permute(1, 2, 0).contiguous().numpy()


def init_torch_threads() -> None:
    """Run one parallel torch op on this (the main) thread before any worker thread does.

    Measured here (torch 2.15, libgomp): when the first parallel CPU op of a process runs on a
    worker thread, every later op on *that* thread is 10-40x slower (a ResNet18 batch: 2-5 s
    instead of 0.05-0.2 s); one op on the main thread first avoids it. The service loads models
    on a worker thread, so it does this at start."""
    torch.zeros(1 << 20).add_(1)


class TorchEngine(ModelEngine):
    """A Detector (``.safetensors``): the full library, drift taps included."""

    kind = "torch"

    @classmethod
    def check_file(cls, path: Path) -> None:
        """The size the safetensors header declares, and the machine's memory."""
        check_model_extent(path)

    @classmethod
    def open_detector(cls, path: Path, device: Optional[str]) -> Any:
        from anomaly_hooks.detector import Detector

        return Detector.load(path, device=device)

    @classmethod
    def prepare_process(cls) -> None:
        init_torch_threads()

    @property
    def method(self) -> str:
        return str(self.detector.cfg.method)

    @property
    def backbone_name(self) -> str:
        return str(self.detector.backbone_name)

    def info(self) -> Dict[str, Any]:
        from anomaly_hooks.config import to_container

        det = self.detector
        cfg = to_container(det.cfg)
        return {
            **self._file_info(),
            "method": cfg["method"],
            "backbone": {"name": det.backbone_name,
                         "weights": cfg.get("backbone", {}).get("weights"),
                         "class": type(det.extractor.model).__name__},
            "layers": list(det.layers),
            "layer_info": [vars(i) for i in det.layer_info],
            "input_size": list(self.input_size),
            "preprocess": det.preprocessor.as_dict(),
            "threshold": det.threshold_.as_dict(),
            "fitted_on": int(det.fit_info_.get("n_train", 0)),
            "fit": {k: v for k, v in det.fit_info_.items() if k != "skipped"},
            "device": str(det.device),
            "config": cfg,
        }

    def network_input(self, canonical: np.ndarray, size: Optional[Tuple[int, int]] = None
                      ) -> torch.Tensor:
        return self.detector.preprocessor(canonical_tensor(canonical), size)

    def input_file(self, tensor: Any, size: Tuple[int, int]) -> Optional[bytes]:
        from anomaly_hooks.keptinputs import encode

        return encode(tensor, self.detector.preprocessor, size)

    def preview(self, canonical: np.ndarray, max_side: int) -> np.ndarray:
        return preview(canonical_tensor(canonical), max_side)

    def stack(self, tensors: List[Any]) -> torch.Tensor:
        return torch.stack(list(tensors))

    def heat_to_frame(self, heat: Any, size: Tuple[int, int], fill: float) -> np.ndarray:
        return self.detector.preprocessor.to_original(heat, size, fill=fill).numpy()

    def infer(self, tensors: List[Any], features: Optional[Dict[str, np.ndarray]] = None,
              sizes: Optional[Sequence[Tuple[int, int]]] = None) -> Tuple[np.ndarray, Any]:
        batch = self.stack(tensors)
        scores, maps = self.detector.infer(batch.to(self.detector.device), sizes=sizes,
                                           taps=features)
        return scores.numpy().astype(np.float64), maps.float().cpu()
