"""The line learns: a model updated from the results an operator labelled in the service.

The service (``anomaly-hooks serve --keep-originals anomalous``) keeps each uploaded image as
sent beside its result; an operator labels results on the page or with ``POST
/v1/results/{id}/label`` (``good``: a false alarm, or a good part confirmed; ``defect``: a
confirmed defect). :func:`labelled_results` reads them back from the results log:

    from anomaly_hooks import Detector
    from anomaly_hooks.learning import labelled_results, update_from_results

    found = labelled_results("serve_results", since="2026-11-26T08:00:00Z")
    found.good, found.defects         # the kept original images (paths), oldest first
    det = Detector.load("models/v1.safetensors", for_update=True)
    update_from_results(det, "serve_results", since="2026-11-26T08:00:00Z")
    det.save("models/v2.safetensors")

``anomaly-hooks update --model M --from-results RESULTS [--since T] --out M2`` does the same
from the shell. ``RESULTS`` is the service's ``--results-dir`` (its ``results.sqlite`` and
kept pictures), a SQLite file (``path`` or ``sqlite:///path``: its pictures in its folder), or
the ``postgresql://`` URL of ``--results-db`` (then ``pictures`` names the service's
``--results-dir``, where the originals are).

* **good**: the results labelled ``good`` recorded at or after ``since`` (and before
  ``until``) whose original image is kept: the new good images of the update.
* **defects**: the results labelled ``defect`` in the same window whose original is kept:
  the labelled defects the threshold is chosen with (``threshold.objective`` ``f1`` or
  ``recall``; with ``far`` their recall is recorded).
* A labelled result whose original file is gone (removed by hand, a restored database) is
  skipped with a warning and counted (:attr:`LabelledResults.missing`); one the service kept
  no original of (started without ``--keep-originals``, or ``anomalous`` and the result was
  not) is counted in :attr:`LabelledResults.not_kept`.

* Where the service kept each image's network input beside its original (``--keep-inputs``),
  the update reads that instead of decoding the image again, when the updating model's
  preprocessing made it (:mod:`anomaly_hooks.keptinputs`; :meth:`LabelledResults.items`).

The window is on the time each result was **recorded** (as ``GET /v1/results?since=``): give
the time the model was put into service to learn from what it saw. The lineage entry of the
update records the source: the store (without a password), the window, the result ids used
and the count skipped.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

from anomaly_hooks.errors import ConfigError, FitError
from anomaly_hooks.keptinputs import KeptImage, mismatch
from anomaly_hooks.serve.pgstore import is_postgres_url, redact_url
from anomaly_hooks.serve.results import ImageFiles, ResultStore, iso_time
from anomaly_hooks.serve.settings import RESULTS_FILE
from anomaly_hooks.serve.stores import open_store

if TYPE_CHECKING:
    from anomaly_hooks.detector import Detector

log = logging.getLogger(__name__)

TimeLike = Union[None, float, int, str, datetime]
START_HINT = ("start the service with --keep-originals anomalous (the images it flags, which an "
              "operator may label as false alarms) or --keep-originals all, then label results "
              "again")


@dataclass
class LabelledResults:
    """The labelled results of a results log with their kept original images (oldest first)."""

    store: str                                      # the results log (no password)
    since: Optional[float]                          # the window, Unix seconds (None: open)
    until: Optional[float]
    # originals of the results labelled good (a KeptImage where its network input is kept)
    good: List[Union[Path, KeptImage]] = field(default_factory=list)
    good_ids: List[int] = field(default_factory=list)
    defects: List[Union[Path, KeptImage]] = field(default_factory=list)  # ... labelled defect
    defect_ids: List[int] = field(default_factory=list)
    missing: List[int] = field(default_factory=list)   # ids whose original file is gone
    not_kept: List[int] = field(default_factory=list)  # ids the service kept no original of
    # of the kept network inputs, as items() last sorted them: read, or decoded (made otherwise)
    kept_inputs: Dict[str, int] = field(default_factory=lambda: {"read": 0, "decoded": 0})

    @property
    def skipped(self) -> int:
        """Labelled results left out: original not kept, or its file gone."""
        return len(self.missing) + len(self.not_kept)

    def window(self) -> str:
        """The time window in words (for messages)."""
        parts = [f"since {iso_time(self.since)}" if self.since is not None else "",
                 f"before {iso_time(self.until)}" if self.until is not None else ""]
        return " ".join(p for p in parts if p) or "at any time"

    def lineage_source(self) -> Dict[str, Any]:
        """What an update's lineage entry records as its ``source``."""
        return {"kind": "results", "store": self.store,
                "since": None if self.since is None else iso_time(self.since),
                "until": None if self.until is None else iso_time(self.until),
                "good_results": list(self.good_ids), "defect_results": list(self.defect_ids),
                "skipped": self.skipped}

    def items(self, pre: Any) -> Tuple[List[Any], List[Any]]:
        """The good and the defect images for an update of a model with the preprocessing
        ``pre``: a :class:`~anomaly_hooks.keptinputs.KeptImage` where ``pre`` made its kept
        network input (read from its header), else the original's path. Counts the kept
        inputs in :attr:`kept_inputs` (``decoded``: kept but made otherwise)."""
        counts = self.kept_inputs = {"read": 0, "decoded": 0}

        def usable(item: Union[Path, KeptImage]) -> Any:
            if not isinstance(item, KeptImage):
                return item
            why = mismatch(item.input, pre)
            counts["decoded" if why else "read"] += 1
            return item.original if why else item

        return [usable(p) for p in self.good], [usable(p) for p in self.defects]

    def summary(self) -> str:
        """One line: what was found and what was skipped."""
        text = (f"{len(self.good)} results labelled good and {len(self.defects)} labelled "
                f"defect with their original image, {self.window()}, in {self.store}")
        if self.not_kept:
            text += f"; {len(self.not_kept)} labelled without a kept original"
        if self.missing:
            text += f"; {len(self.missing)} whose original file is gone (skipped)"
        return text


def parse_time(value: TimeLike, name: str = "since") -> Optional[float]:
    """Unix seconds, an ISO 8601 text (``2026-11-26T08:00:00Z``; a time without zone is UTC)
    or a ``datetime`` -> Unix seconds; None stays None. ConfigError for anything else."""
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        dt = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
        return dt.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        try:
            number = float(str(value))
        except ValueError:
            text = str(value).strip()
            text = text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text
            try:
                dt = datetime.fromisoformat(text)
            except ValueError:
                raise ConfigError(f"{name}={value!r}: give Unix seconds or an ISO 8601 time "
                                  "(e.g. 2026-11-26T08:00:00Z)") from None
            return parse_time(dt, name)
    if not math.isfinite(number):
        raise ConfigError(f"{name}={value!r} is not a time")
    return number


def open_results(results: str, pictures: Optional[os.PathLike | str] = None
                 ) -> Tuple[ResultStore, ImageFiles, str]:
    """The store, the kept pictures' folder and the store's display name of ``results`` (see
    the module docstring). ConfigError, saying what to give, for a folder or file without a
    results log, a database URL without ``pictures``, or a store that cannot be read."""
    spec = str(results)
    if is_postgres_url(spec):
        if pictures is None:
            raise ConfigError(f"{redact_url(spec)}: a database results log keeps its original "
                              "images in the service's --results-dir: give that folder too "
                              "(--results-dir DIR; pictures= in Python)")
        return open_store(spec), ImageFiles(pictures), redact_url(spec)
    path = Path(spec[len("sqlite:///"):] if spec.startswith("sqlite:///") else spec)
    if path.is_dir():
        folder, path = path, path / RESULTS_FILE
        if not path.is_file():
            raise ConfigError(f"{folder}: no results log ({RESULTS_FILE}) in this folder: give "
                              "the service's --results-dir, a results .sqlite file or its "
                              "postgresql:// URL")
    elif not path.is_file():
        raise ConfigError(f"{spec}: no such results folder or file: give the service's "
                          "--results-dir, a results .sqlite file or its postgresql:// URL")
    store = open_store(str(path))  # ConfigError for a file that is not a results log
    return store, ImageFiles(pictures if pictures is not None else path.parent), str(path)


def labelled_results(results: str, *, since: TimeLike = None, until: TimeLike = None,
                     model: Optional[str] = None,
                     pictures: Optional[os.PathLike | str] = None) -> LabelledResults:
    """The results labelled ``good`` and ``defect`` in ``results`` (the service's results
    folder, a SQLite file or a ``postgresql://`` URL with ``pictures``, the service's
    ``--results-dir``), recorded in ``[since, until)``, of the served model named ``model``
    (None: every model), with their kept original images, oldest first.

    Raises ConfigError for a store that cannot be read, FitError (saying what to do) when no
    result in the window is labelled good, or none labelled good has a kept original (the
    option to start the service with). Results whose original file is gone are skipped with a
    warning and counted."""
    t0, t1 = parse_time(since, "since"), parse_time(until, "until")
    store, files, name = open_results(results, pictures)
    found = LabelledResults(store=name, since=t0, until=t1)
    skipped_good = (0, 0)
    try:
        for label in ("good", "defect"):
            filters: Dict[str, Any] = {"label": label, "since": t0, "until": t1}
            if model is not None:
                filters["model"] = model
            for rec in reversed(list(store.iter_query(**filters))):  # oldest first
                _sort(found, label, rec.id, rec.original_path, files)
            if label == "good":  # the good ones among the skipped
                skipped_good = (len(found.missing), len(found.not_kept))
    finally:
        store.close()
    _check_found(found, *skipped_good)
    return found


def _sort(found: LabelledResults, label: str, rid: Optional[int], rel: Optional[str],
          files: ImageFiles) -> None:
    """File the labelled result ``rid`` (its original at ``rel``) where it belongs."""
    if rid is None:
        return
    if not rel:
        found.not_kept.append(rid)
        return
    path: Any = files.resolve(rel)
    kept_input = files.kept_input(rel) if path is not None else None
    if kept_input is not None:
        path = KeptImage(path, kept_input)
    if path is None:
        log.warning("result %d is labelled %s but its original image %s is gone (removed by "
                    "hand, or a restored log): skipped", rid, label, files.root / rel)
        found.missing.append(rid)
    elif label == "good":
        found.good.append(path)
        found.good_ids.append(rid)
    else:
        found.defects.append(path)
        found.defect_ids.append(rid)


def _check_found(found: LabelledResults, missing: int, not_kept: int) -> None:
    """FitError, saying what to do, when ``found`` holds no good image to learn from
    (``missing`` / ``not_kept``: how many of the results labelled good were skipped)."""
    if found.good:
        return
    where = f"{found.window()} in {found.store}"
    if not (missing or not_kept):
        defects = len(found.defect_ids) + len(found.missing) + len(found.not_kept)
        others = f" ({defects} labelled defect)" if defects else ""
        raise FitError(f"no result is labelled good {where}{others}: label the false alarms "
                       "(the page's 'false alarm' button, or POST /v1/results/{id}/label "
                       "{\"label\": \"good\"}), or give an earlier --since")
    if not missing:
        raise FitError(f"{not_kept} result(s) labelled good {where}, but the service kept "
                       f"none of their original images: {START_HINT}")
    raise FitError(f"no result labelled good {where} has its original image: "
                   f"{missing} are gone from the pictures folder, "
                   f"{not_kept} were never kept ({START_HINT})")


def update_from_results(det: "Detector", results: str, *, since: TimeLike = None,
                        until: TimeLike = None, model: Optional[str] = None,
                        pictures: Optional[os.PathLike | str] = None,
                        progress: bool = False) -> LabelledResults:
    """Update the fitted ``det`` in place (:meth:`Detector.update`) with the original images
    of the results labelled ``good`` (:func:`labelled_results`; their kept network inputs
    where ``det``'s preprocessing made them: :meth:`LabelledResults.items`), the threshold
    choosing with those labelled ``defect`` where there are any (else as the model's config
    says), and the lineage entry recording the source. Returns what was read."""
    found = labelled_results(results, since=since, until=until, model=model,
                             pictures=pictures)
    good, defects = found.items(det.preprocessor)
    det.update(good, defects=defects or None, source=found.lineage_source(),
               progress=progress)
    return found
