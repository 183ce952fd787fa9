"""A drift reference as one JSON value, for files that hold only strings (numpy only).

A model file (``.safetensors``) keeps the reference's arrays as tensors beside its JSON
(:meth:`DriftReference.state`); an exported ONNX file has string metadata entries only, so
:func:`reference_to_json` puts the same state into one JSON object -- the JSON part as is, each
float32 array as its shape and its little-endian bytes in base64 -- and
:func:`reference_from_json` reads it back into an equal reference (the arrays are stored as
float32 either way, so both files give the monitor the same numbers).

Shape of the value::

    {"version": 1, "reference": <DriftReference.state()'s dict>,
     "arrays": {"drift.<block>.<name>": {"shape": [...], "float32_base64": "..."}}}
"""
from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Dict, Mapping

import numpy as np

from anomaly_hooks.errors import ModelFileError
from anomaly_hooks.monitor.reference import STATE_PREFIX, DriftReference

PORTABLE_VERSION = 1
MAX_ARRAY_ELEMENTS = 1 << 28  # one array of the reference (a [d, k] basis at most)
MAX_WINDOW = 1 << 20  # images in the monitor's window


def reference_to_json(reference: DriftReference) -> Dict[str, Any]:
    """The JSON-able form of ``reference`` (see the module)."""
    tensors, meta = reference.state()
    arrays = {name: {"shape": [int(s) for s in a.shape],
                     "float32_base64": base64.b64encode(
                         np.ascontiguousarray(a, dtype="<f4").tobytes()).decode("ascii")}
              for name, a in tensors.items()}
    return {"version": PORTABLE_VERSION, "reference": meta, "arrays": arrays}


def _array(name: str, entry: Any) -> np.ndarray:
    """One stored array, its shape checked against its byte count."""
    if not isinstance(entry, Mapping) or set(entry) != {"shape", "float32_base64"}:
        raise ModelFileError(f"drift array {name!r}: expected an object with 'shape' and "
                             "'float32_base64'")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(type(s) is int and 0 <= s <= MAX_ARRAY_ELEMENTS
                                              for s in shape):
        raise ModelFileError(f"drift array {name!r}: shape {shape!r} is not a list of sizes")
    if math.prod(shape) > MAX_ARRAY_ELEMENTS:
        raise ModelFileError(f"drift array {name!r}: {shape} is too large")
    try:
        raw = base64.b64decode(str(entry["float32_base64"]), validate=True)
    except (binascii.Error, ValueError):
        raise ModelFileError(f"drift array {name!r}: not valid base64") from None
    if len(raw) != 4 * math.prod(shape):
        raise ModelFileError(f"drift array {name!r}: {len(raw)} bytes for shape {shape} "
                             f"({4 * math.prod(shape)} expected)")
    values = np.frombuffer(raw, dtype="<f4").reshape(shape)
    if not np.isfinite(values).all():
        raise ModelFileError(f"drift array {name!r}: holds a non-finite number")
    return values.astype(np.float32)


def reference_from_json(data: Any) -> DriftReference:
    """The :class:`DriftReference` of :func:`reference_to_json`'s value.

    Raises:
        ModelFileError: another version, a missing or malformed part (named)."""
    if not isinstance(data, Mapping) or set(data) != {"version", "reference", "arrays"}:
        raise ModelFileError("drift reference: expected an object with 'version', "
                             "'reference' and 'arrays'")
    if data["version"] != PORTABLE_VERSION:
        raise ModelFileError(f"drift reference: version {data['version']!r} is not supported "
                             f"(this version reads {PORTABLE_VERSION})")
    arrays = data["arrays"]
    if not isinstance(arrays, Mapping) or not all(
            isinstance(k, str) and k.startswith(STATE_PREFIX) for k in arrays):
        raise ModelFileError(f"drift reference: 'arrays' must map {STATE_PREFIX}* names to "
                             "arrays")
    tensors = {name: _array(name, entry) for name, entry in arrays.items()}
    try:
        reference = DriftReference.from_state(tensors, data["reference"])
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ModelFileError(f"drift reference: malformed ({type(exc).__name__}: {exc})"
                             ) from None
    _check_numbers(reference)
    return reference


def _check_numbers(reference: DriftReference) -> None:
    """The scalars the monitor computes with: a window of 1 to :data:`MAX_WINDOW` images, a
    false-alarm probability in (0, 1), finite non-negative thresholds, positive spreads."""
    if not 1 <= reference.window <= MAX_WINDOW:
        raise ModelFileError(f"drift reference: window {reference.window} is not in "
                             f"1..{MAX_WINDOW}")
    if not 0.0 < reference.alpha < 1.0:
        raise ModelFileError(f"drift reference: alpha {reference.alpha} is not in (0, 1)")
    bad = sorted(k for k, v in reference.thresholds.items() if not (math.isfinite(v) and v >= 0))
    if bad:
        raise ModelFileError(f"drift reference: thresholds of {bad} are not finite and >= 0")
    if any((b.scale <= 0).any() or (b.eigvals <= 0).any() for b in reference.blocks.values()):
        raise ModelFileError("drift reference: a block has a spread or variance <= 0")
