"""The detector's seams to tiling: what :class:`~anomaly_hooks.detector.Detector` and
:class:`~anomaly_hooks.fitting.FitRun` call (a few lines each), kept here so that the pipeline
modules do not branch on tiling.

* :func:`attach` — a detector's ``tiling`` and ``preprocessor`` for its config (and frame).
* :func:`fit_frame` / :func:`frame_for_fit` — a fit decides the working frame from its training
  images and uses it; a failed fit puts the detector's previous frame back.
* :func:`framing_info` — what the model info says about the framing: the working frame and
  tiles, and the fraction of every image that is never inspected (a crop's cut).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, Sequence

from anomaly_hooks.framing import Frame, uninspected_fraction
from anomaly_hooks.preprocess import Preprocessor
from anomaly_hooks.scorers import get_scorer
from anomaly_hooks.tiling.pipeline import build

if TYPE_CHECKING:  # pragma: no cover
    from anomaly_hooks.detector import Detector


def attach(det: "Detector", frame: Optional[Frame] = None) -> None:
    """Set ``det.tiling`` (None for an untiled config) and ``det.preprocessor`` (the working
    frame's, on ``frame`` or the provisional one) from ``det.cfg``."""
    cfg = det.cfg
    tile_units = get_scorer(cfg.method).shares_tile_positions(cfg[cfg.method])
    tiling = build(cfg, det.layer_info, tile_units, frame)
    det.tiling = tiling
    if tiling is None:
        det.preprocessor = Preprocessor.from_config(cfg.preprocess)
    else:
        det.preprocessor = Preprocessor.framed(tiling.frame, tuple(cfg.preprocess.mean),
                                               tuple(cfg.preprocess.std))


def restore(det: "Detector", saved_preprocess: Dict[str, Any]) -> None:
    """A loaded model's working frame (from its stored preprocessing), if it has one."""
    if saved_preprocess.get("frame") is not None:
        attach(det, Frame.from_dict(saved_preprocess["frame"]))


def fit_frame(det: "Detector", items: Sequence[Any]) -> Optional[Frame]:
    """The working frame a fit on training ``items`` uses (None for an untiled model)."""
    if det.tiling is None:
        return None
    return det.tiling.decide(items)


@contextlib.contextmanager
def frame_for_fit(det: "Detector", frame: Optional[Frame]) -> Iterator[None]:
    """Put ``frame`` on ``det`` for the fit in the block; if the block fails, the detector
    gets its previous frame back (a failed fit leaves a detector as it was). Not for a
    detector that other threads predict with meanwhile."""
    if frame is None:
        yield
        return
    before = (det.tiling, det.preprocessor)
    attach(det, frame)
    try:
        yield
    except BaseException:
        det.tiling, det.preprocessor = before
        raise


def units_per_image(det: "Detector") -> int:
    """The scorer's samples per training image: its tile windows for statistics per tile
    position, else 1 (what ``Scorer.begin`` is told)."""
    return 1 if det.tiling is None else det.tiling.units_per_image


def framing_info(det: "Detector") -> Dict[str, Any]:
    """The model info's ``framing``: the working frame and tiles of a tiled model, or the
    resize and crop; with the fraction of every image's area that is never inspected."""
    if det.tiling is not None:
        return det.tiling.info()
    pre = det.preprocessor
    return {"mode": "resize-crop", "resize": list(pre.resize),
            "crop": list(pre.crop) if pre.crop is not None else None,
            "uninspected_fraction": uninspected_fraction(pre)}
