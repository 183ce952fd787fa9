"""Recalibration without refit: a new threshold for a fitted model from images it scores.

``anomaly-hooks threshold --model M --out M2 [--good DIR] [--defects DIR] [--objective ...]``
and :meth:`Detector.recalibrate` score the given images with the fitted model and choose the
threshold as a fit would (:func:`anomaly_hooks.threshold.calibrate_threshold`):

* ``good``: good images the model has *not* seen (new parts, recent production): their scores
  replace the stored out-of-sample scores (training images would score as seen: too low).
  Without them, the stored out-of-sample scores of the fit are used.
* ``defects``: labelled defective images; without them, the defect scores stored by an earlier
  choice (if any).

The new threshold records its provenance: which images, the objective, and the model it was
recalibrated from (path and checksum).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from anomaly_hooks.data import format_errors, resolve_items
from anomaly_hooks.errors import DataError
from anomaly_hooks.fitting import score_images
from anomaly_hooks.threshold import Threshold

if TYPE_CHECKING:
    from anomaly_hooks.detector import Detector


def _scores(det: "Detector", source: Any, what: str, on_error: str
            ) -> tuple[List[float], List[str]]:
    """Scores and names of the images of ``source``; unreadable ones are an error (or, with
    ``data.on_error=skip``, skipped), none readable always."""
    errors: List[str] = []
    scores, names = score_images(det, resolve_items(source), det.scorer_, errors)
    if errors and (on_error == "raise" or not scores):
        raise DataError(f"{len(errors)} {what} image(s) could not be read:\n"
                        f"{format_errors(errors)}\nFix or remove them"
                        + (", or set data.on_error=skip" if scores else ""))
    return scores, names


def recalibrate(det: "Detector", *, good: Any = None, defects: Any = None,
                parent: Optional[Dict[str, Any]] = None, **options: Any) -> Threshold:
    """The threshold of ``det`` chosen again (see the module docstring); ``options`` are
    :meth:`Threshold.recalibrate`'s (``objective``, ``false_alarm_rate``, ``target_recall``,
    ``prevalence``, ``tail``); ``parent`` describes the model file it came from."""
    old = det.threshold_
    on_error = str(det.cfg.data.on_error)
    prov: Dict[str, Any] = {"set_by": "recalibration", "parent": parent or {}}
    good_scores = defect_scores = None
    if good is not None:
        good_scores, names = _scores(det, good, "good", on_error)
        prov["good"] = {"source": str(good) if isinstance(good, (str, bytes)) or hasattr(
            good, "__fspath__") else "images given", "n": len(good_scores), "files": names}
    else:
        prov["good"] = {**((old.provenance or {}).get("good") or {"source": old.source}),
                        "n": old.n_images, "stored": True}
    if defects is not None:
        defect_scores, names = _scores(det, defects, "defective", on_error)
        prov["defects"] = {"source": str(defects) if isinstance(defects, (str, bytes)) or
                           hasattr(defects, "__fspath__") else "images given",
                           "n": len(defect_scores), "files": names}
    elif old.defect_scores:
        prov["defects"] = {**((old.provenance or {}).get("defects") or {}),
                           "n": len(old.defect_scores), "stored": True}
    thr = old.recalibrate(good_scores=good_scores, defect_scores=defect_scores,
                          provenance=prov, **options)
    return replace(thr, provenance={**prov, "objective": thr.objective})
