"""What ``score`` writes, shared by the CLI and the distributed score: the input expansion
(folders walked, odd entries reported), safe output names, the PNGs, and the results files
(CSV cells a spreadsheet cannot run, atomic writes)."""
from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import stat
import tempfile
import unicodedata
from pathlib import Path
from typing import Any, List, Optional, Sequence

from anomaly_hooks.images import display, is_folder, is_image_file
from anomaly_hooks.prediction import VERDICT_FIELDS, Prediction

RESULT_FIELDS = ["path", *VERDICT_FIELDS, "heatmap", "overlay", "mask"]
# the pictures score writes, each in its own folder of --out: the picture -> its folder
PICTURES = {"heatmap": "heatmaps", "overlay": "overlays", "mask": "masks"}
PICTURE_FOLDERS = tuple(PICTURES.values())


def result_row(pred: Prediction, path) -> dict:
    """One scored image's row of the result files: its path and verdict (the pictures' paths
    are added apart)."""
    return {"path": display(path), **pred.verdict.as_dict()}


def walk_images(folder: Path) -> tuple[List[Path], List[str]]:
    """Image files under ``folder`` (sorted, symbolic links to folders not followed), and a
    failure for each entry with an image suffix that is not a regular file (a FIFO, device or
    socket is reported, never opened)."""
    found: List[Path] = []
    odd: List[str] = []

    def unreadable(exc: OSError) -> None:
        odd.append(f"{display(exc.filename or folder)}: cannot be read "
                   f"({exc.strerror or exc}); skipped")

    for root, dirs, files in os.walk(folder, onerror=unreadable):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            if not is_image_file(path):
                continue
            try:
                mode = path.stat().st_mode
            except OSError as exc:
                odd.append(f"{display(path)}: cannot be read ({exc.strerror})")
                continue
            if stat.S_ISREG(mode):
                found.append(path)
            else:
                odd.append(f"{display(path)}: not a regular file; skipped")
    return found, odd


def expand_inputs(inputs: Sequence[str]) -> tuple[List[Path], List[Path], List[str]]:
    """(image paths, the input each came from, failures) of the command-line inputs."""
    paths: List[Path] = []
    roots: List[Path] = []
    errors: List[str] = []
    for raw in inputs:
        p = Path(raw)
        if is_folder(p):
            found, odd = walk_images(p)
            errors.extend(odd)
            if not found and not odd:
                errors.append(f"{display(p)}: no image files in this folder")
            paths.extend(found)
            roots.extend([p] * len(found))
        else:
            paths.append(p)
            roots.append(p.parent)
    return paths, roots, errors


_NAME_BYTES = 150  # an output name's length in bytes (file systems allow 255)


def _clean_part(part: str) -> str:
    """One path component as a safe file-name piece: letters, digits, ``.-_`` (any script),
    everything else (separators, spaces, control characters, undecodable bytes) ``_``; no
    leading dot (no hidden file, no ``..``)."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in part)
    cleaned = cleaned.lstrip(".")
    return cleaned or "_"


def out_name(path: Path, root: Path, used: set) -> str:
    """The output name of ``path``: its path relative to the input ``root`` it was found under
    (a file given directly: its own name), suffix dropped, components cleaned and joined by
    ``_``; never absolute, never ``..``, never empty; at most :data:`_NAME_BYTES` bytes (a long
    name keeps a hash of the whole); unique within ``used`` (compared case-insensitively, as
    some file systems do), which it updates."""
    try:
        rel = path.relative_to(root)
    except ValueError:
        rel = Path(path.name)
    parts = [*rel.parent.parts, rel.stem if rel.suffix else rel.name]
    stem = "_".join(_clean_part(p) for p in parts if p not in ("", ".", "..", os.sep)) or "_"
    if len(stem.encode("utf-8")) > _NAME_BYTES:
        digest = hashlib.sha256(os.fsencode(rel)).hexdigest()[:12]
        stem = stem.encode("utf-8")[:_NAME_BYTES - 13].decode("utf-8", "ignore") + "-" + digest
    name, i = stem, 1
    while name.casefold() in used:
        i += 1
        name = f"{stem}_{i}"
    used.add(name.casefold())
    return name


def write_images(pred, path: Path, out: Path, name: str, max_pixels: int) -> dict:
    from anomaly_hooks.images import canonical_rows, load_oriented
    from anomaly_hooks.visualize import write_pictures

    files = {kind: out / folder / f"{name}.png" for kind, folder in PICTURES.items()}
    write_pictures(pred.heatmap, pred.mask, pred.threshold,
                   lambda: load_oriented(path, max_pixels), canonical_rows, files)
    return {k: str(v) for k, v in files.items()}


_FORMULA_START = ("=", "+", "-", "@")


def csv_cell(value):
    """A CSV cell that a spreadsheet shows as text. A string whose first character other than
    white space (spaces, tabs, line breaks: spreadsheets skip them) is one of ``= + - @`` or a
    look-alike that compatibility normalisation turns into one (the full-width ``＝``) would
    run as a formula: it gets a leading ``'``; so does one starting with white space before
    such a character. NUL characters, which cut a cell short in some readers, become U+FFFD.
    Numbers are written as they are."""
    if not isinstance(value, str):
        return value
    value = value.replace("\x00", "\ufffd")
    head = unicodedata.normalize("NFKC", value.lstrip()[:1])
    if head.startswith(_FORMULA_START) or value[:1] in ("\t", "\r"):
        return "'" + value
    return value


def atomic_text(path: Path, write) -> None:
    """Write a text file atomically: a temporary file in the same folder, flushed to disk,
    renamed over ``path``; a full disk leaves the previous file (or none), never half a file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_results(out: Path, rows: List[dict], failures: List[str], model: str,
                  drift: Optional[dict] = None) -> None:
    """``results.csv`` and ``results.json`` in ``out``, each written atomically; ``drift``
    (the drift monitor's status over the scored images) goes into the JSON when given. A
    non-finite number is written as an empty CSV cell and a JSON ``null``."""
    def write_csv(fh) -> None:
        writer = csv.DictWriter(fh, fieldnames=RESULT_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: csv_cell(v) for k, v in finite_json(row).items()} for row in rows)

    atomic_text(out / "results.csv", write_csv)
    doc = {"model": display(model), "results": rows, "failures": failures}
    if drift is not None:
        doc["drift"] = drift
    # strict JSON: NaN and Infinity are not JSON, and most readers refuse them
    atomic_text(out / "results.json",
                lambda fh: json.dump(finite_json(doc), fh, indent=2, allow_nan=False))


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, infinities) in it replaced by ``None``
    (JSON ``null``), through dicts, lists and tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value
