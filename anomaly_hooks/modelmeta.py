"""What a model file's metadata may hold: one set of rules for both model formats.

The ``.safetensors`` reader (:func:`anomaly_hooks.modelfile.load_model`) and the torch-free
reader of exported ``.onnx`` files (:mod:`anomaly_hooks.runtime.metadata`) check the threshold,
the preprocessing, the layer list and the decompression-bomb limit with the functions here,
and parse JSON metadata with the same size and depth limits. Every refusal is a
:class:`MetadataError` (a :class:`~anomaly_hooks.errors.ModelFileError`) that names the field.

A checksum proves that a file is unchanged since it was written, not who wrote it (it is an
unkeyed SHA-256 that anyone can recompute): these rules keep a forged or mis-written value from
reaching the predict path, where it would fail silently (a NaN threshold calls every image
normal, a zero ``std`` makes every score NaN) or late (a zero scale divides by zero in the
first ``predict``).

Torch-free (the edge runtime uses it): the standard library and this package's torch-free
modules only.
"""
from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from anomaly_hooks.calibration import TAILS
from anomaly_hooks.errors import ModelFileError
from anomaly_hooks.framing import MAX_SIDE
from anomaly_hooks.operating import OBJECTIVES

MAX_DEPTH = 32  # nesting of one JSON value (the config reader's limit; the schema is 3 deep)
MAX_JSON_CHARS = 100_000_000  # one JSON value (the .safetensors header's own limit)
MAX_PIXELS = 1 << 40  # data.max_pixels: the config's upper limit
MAX_LAYERS = 256  # tapped layers
MAX_CHANNELS = 1 << 20  # channels of one tapped layer
MAX_TEXT = 1024  # a name or version string
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
THRESHOLD_REQUIRED = ("value", "scale", "quantile", "margin", "n_images", "good_min",
                      "good_median", "good_max")
PREPROCESS_KEYS = ("resize", "crop", "mean", "std")
LAYER_KEYS = ("name", "channels", "stride")
LINEAGE_KEYS = ("parent_checksum", "images_added", "labels_used", "time")
# an update's optional ``source``: where its images came from (anomaly_hooks.learning)
LINEAGE_SOURCE_KEYS = ("kind", "store", "since", "until", "good_results", "defect_results",
                       "skipped")
MAX_SOURCE_IDS = 1_000_000  # result ids recorded per list
MAX_LINEAGE = 100_000  # updates recorded in one model file


class MetadataError(ModelFileError):
    """A metadata value outside its rules; :attr:`field` names it (``threshold.value``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def refuse(field: str, value: Any, expected: str) -> MetadataError:
    """The error for ``field`` holding ``value`` where ``expected`` was required."""
    return MetadataError(field, f"{field} = {_shown(value)}: expected {expected}")


def _shown(value: Any, limit: int = 80) -> str:
    """``repr`` of a value, cut short (a forged value may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + "...)"


@contextmanager
def about(source: Any) -> Iterator[None]:
    """Prefix the message of a :class:`MetadataError` raised inside with ``source`` (the
    file), keeping its field."""
    try:
        yield
    except MetadataError as exc:
        raise MetadataError(exc.field, f"{source}: {exc}") from None


# -- JSON ---------------------------------------------------------------------------------
def parse_json(text: Any, field: str, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of a metadata string, within :data:`MAX_JSON_CHARS` characters and
    ``max_depth`` levels of nesting. ``NaN`` and ``Infinity`` tokens parse (as floats) so that
    the field's own rule refuses them by name."""
    if not isinstance(text, str):
        raise refuse(field, text, "a JSON text")
    if len(text) > MAX_JSON_CHARS:
        raise MetadataError(field, f"{field} is {len(text):,} characters long; the limit is "
                                   f"{MAX_JSON_CHARS:,}")
    try:
        value = json.loads(text)
    except RecursionError:  # the parser's own guard against deep nesting
        raise _too_deep(field, max_depth) from None
    except ValueError as exc:
        raise MetadataError(field, f"{field} is not valid JSON ({exc})") from None
    check_depth(value, field, max_depth)
    return value


def _too_deep(field: str, max_depth: int) -> MetadataError:
    return MetadataError(field, f"{field} is nested more than {max_depth} levels deep")


def check_depth(value: Any, field: str, max_depth: int = MAX_DEPTH) -> None:
    """Refuse lists and objects nested deeper than ``max_depth`` (walked without recursion)."""
    stack: List[Tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise _too_deep(field, max_depth)
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


# -- scalars ------------------------------------------------------------------------------
def real(value: Any, field: str, expected: str = "a finite number",
         test: Callable[[float], bool] = lambda v: True) -> float:
    """A JSON number (not a boolean, not a string) that is finite and passes ``test``."""
    if type(value) not in (int, float):
        raise refuse(field, value, expected)
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float range
        raise refuse(field, value, expected) from None
    if not math.isfinite(number) or not test(number):
        raise refuse(field, value, expected)
    return number


def integer(value: Any, field: str, low: int, high: int) -> int:
    """A JSON integer (not a float or boolean) in ``[low, high]``."""
    if type(value) is not int or not low <= value <= high:
        raise refuse(field, value, f"an integer in {low}..{high}")
    return value


_DECIMAL = re.compile(r"[0-9]{1,20}\Z")


def decimal(text: Any, field: str, low: int, high: int) -> int:
    """An integer written as plain decimal digits (a metadata string) in ``[low, high]``."""
    if not isinstance(text, str) or _DECIMAL.match(text) is None or \
            not low <= int(text) <= high:
        raise refuse(field, text, f"an integer in {low}..{high}")
    return int(text)


def text(value: Any, field: str, pattern: Optional[str] = None, expected: str = "a name",
         max_len: int = MAX_TEXT) -> str:
    """A string of at most ``max_len`` characters, matching ``pattern`` when given."""
    if not isinstance(value, str) or len(value) > max_len or \
            (pattern is not None and re.fullmatch(pattern, value) is None):
        raise refuse(field, value, expected)
    return value


def size_pair(value: Any, field: str) -> Tuple[int, int]:
    """``[height, width]``: two integers in ``1..MAX_SIDE``."""
    if not isinstance(value, list) or len(value) != 2 or \
            not all(type(v) is int and 1 <= v <= MAX_SIDE for v in value):
        raise refuse(field, value, f"[height, width], integers in 1..{MAX_SIDE}")
    return value[0], value[1]


def check_keys(data: Any, field: str, allowed: Optional[Tuple[str, ...]] = None,
               required: Tuple[str, ...] = ()) -> Mapping[str, Any]:
    """``data`` is an object with every ``required`` key and, unless ``allowed`` is None,
    no key outside ``allowed``."""
    if not isinstance(data, dict):
        raise refuse(field, data, "an object")
    extra = [] if allowed is None else sorted(str(k) for k in data if k not in allowed)
    if extra:
        raise MetadataError(field, f"{field} has unexpected keys {_shown(extra)}")
    for key in required:
        if key not in data:
            raise MetadataError(f"{field}.{key}", f"{field}.{key} is missing")
    return data


# -- the fields both formats hold ---------------------------------------------------------
def check_threshold(data: Any, field: str = "threshold") -> Dict[str, Any]:
    """The fields of a :class:`~anomaly_hooks.threshold.Threshold` (``as_dict``) checked and
    converted; keys written by a newer version (unknown here) are dropped, fields added after
    a file was written take their defaults.

    What a plausible threshold is:

    * ``value``: finite and > 0. Image scores are distances, never negative: PaDiM's is the
      square root of a Mahalanobis quadratic form, PatchCore's the mean L2 distance to the
      ``k`` nearest bank rows (times eq. 7's weight in [0, 1]); both pass through a bilinear
      upsampling and a Gaussian blur, whose weights are positive, and the image score is the
      maximum of that map. A threshold <= 0 therefore calls every image that is not an exact
      copy of training patches anomalous, and a NaN or infinite one decides nothing. A tiny
      positive threshold is kept: it is what a fit on near-copies of the training images
      gives (with the fit's warning). A fit writes a threshold <= 0 only from good scores
      that are all 0 (copies of training patches), or from a quantile below their median
      with a margin large enough to cross 0: either model flags every part, and is refused.
    * ``scale``: finite and > 0 (the normalised score divides by it; a fit floors it at
      ``1e-12``).
    * ``quantile`` in (0, 1]; ``margin`` >= 0; ``n_images`` >= 1; ``good_min`` <=
      ``good_median`` <= ``good_max``, all finite; ``false_alarm_rate`` null or in (0, 0.5)
      (the config's rules); ``tail`` null or a known tail model; ``tail_params`` finite
      numbers; ``far_interval`` null or ``[lo, hi]`` in [0, 1]; ``tail_gap`` null or >= 0;
      ``scores`` null or finite numbers.
    """
    check_keys(data, field, None, THRESHOLD_REQUIRED)
    out: Dict[str, Any] = {
        "value": real(data["value"], f"{field}.value", "a finite number > 0 (image scores are "
                      "distances >= 0)", lambda v: v > 0),
        "scale": real(data["scale"], f"{field}.scale", "a finite number > 0",
                      lambda v: v > 0),
        "quantile": real(data["quantile"], f"{field}.quantile", "a number in (0, 1]",
                         lambda v: 0 < v <= 1),
        "margin": real(data["margin"], f"{field}.margin", "a finite number >= 0",
                       lambda v: v >= 0),
        "n_images": integer(data["n_images"], f"{field}.n_images", 1, (1 << 63) - 1),
    }
    lo = real(data["good_min"], f"{field}.good_min")
    med = real(data["good_median"], f"{field}.good_median",
               f"a finite number >= good_min ({lo!r})", lambda v: v >= lo)
    out.update(good_min=lo, good_median=med,
               good_max=real(data["good_max"], f"{field}.good_max",
                             f"a finite number >= good_median ({med!r})", lambda v: v >= med))
    out.update(_threshold_extras(data, field))
    return out


def _threshold_extras(data: Mapping[str, Any], field: str) -> Dict[str, Any]:
    """The optional threshold fields present in ``data``, checked."""
    out: Dict[str, Any] = {}
    if "source" in data:
        out["source"] = text(data["source"], f"{field}.source", r"[a-z-]{1,32}",
                             "a source name (all-images, holdout, folder)")
    if data.get("false_alarm_rate") is not None:
        out["false_alarm_rate"] = real(data["false_alarm_rate"], f"{field}.false_alarm_rate",
                                       "null or a number in (0, 0.5)", lambda v: 0 < v < 0.5)
    if data.get("tail") is not None:
        if data["tail"] not in TAILS:
            raise refuse(f"{field}.tail", data["tail"], f"null or one of {', '.join(TAILS)}")
        out["tail"] = data["tail"]
    if "tail_params" in data:
        params = check_keys(data["tail_params"], f"{field}.tail_params")
        out["tail_params"] = {k: real(v, f"{field}.tail_params.{k}") for k, v in params.items()}
    if data.get("far_interval") is not None:
        out["far_interval"] = _interval(data["far_interval"], f"{field}.far_interval")
    if data.get("tail_gap") is not None:
        out["tail_gap"] = real(data["tail_gap"], f"{field}.tail_gap", "null or a number >= 0",
                               lambda v: v >= 0)
    for key in ("scores", "defect_scores"):
        if data.get(key) is not None:
            out[key] = _numbers(data[key], f"{field}.{key}")
    out.update(_operating_point(data, field))
    return out


def _numbers(value: Any, field: str) -> List[float]:
    if not isinstance(value, list):
        raise refuse(field, value, "null or a list of finite numbers")
    return [real(v, f"{field}[{i}]") for i, v in enumerate(value)]


def _fraction(value: Any, field: str, low_open: bool = False) -> float:
    expected = "null or a number in (0, 1]" if low_open else "null or a number in [0, 1]"
    return real(value, field, expected, (lambda v: 0 < v <= 1) if low_open
                else (lambda v: 0 <= v <= 1))


def _operating_point(data: Mapping[str, Any], field: str) -> Dict[str, Any]:
    """The operating point's optional fields (``operating.py``): the objective and what it
    chose, checked; absent in files written before them."""
    out: Dict[str, Any] = {}
    if "objective" in data:
        if data["objective"] not in OBJECTIVES:
            raise refuse(f"{field}.objective", data["objective"],
                         f"one of {', '.join(OBJECTIVES)}")
        out["objective"] = data["objective"]
    for key in ("expected_far", "recall"):
        if data.get(key) is not None:
            out[key] = _fraction(data[key], f"{field}.{key}")
    for key in ("supported_rate", "target_recall", "prevalence"):
        if data.get(key) is not None:
            out[key] = _fraction(data[key], f"{field}.{key}", low_open=True)
    if data.get("prevalence_given") is not None:
        if not isinstance(data["prevalence_given"], bool):
            raise refuse(f"{field}.prevalence_given", data["prevalence_given"],
                         "null, true or false")
        out["prevalence_given"] = data["prevalence_given"]
    for key in ("tail_far_interval", "recall_interval"):
        if data.get(key) is not None:
            out[key] = _interval(data[key], f"{field}.{key}")
    if data.get("far_interval_method") is not None:
        out["far_interval_method"] = text(data["far_interval_method"],
                                          f"{field}.far_interval_method", r"[a-z-]{1,32}")
    if data.get("n_defects") is not None:
        out["n_defects"] = integer(data["n_defects"], f"{field}.n_defects", 0, (1 << 63) - 1)
    if data.get("provenance") is not None:
        out["provenance"] = dict(check_keys(data["provenance"], f"{field}.provenance"))
    return out


def _interval(value: Any, field: str) -> List[float]:
    if not isinstance(value, list) or len(value) != 2:
        raise refuse(field, value, "[lo, hi] in [0, 1]")
    lo = real(value[0], f"{field}[0]", "a number in [0, 1]", lambda v: 0 <= v <= 1)
    hi = real(value[1], f"{field}[1]", f"a number in [{lo!r}, 1]", lambda v: lo <= v <= 1)
    return [lo, hi]


def check_preprocess(data: Any, field: str = "preprocess") -> Dict[str, Any]:
    """``Preprocessor.as_dict()`` checked: ``resize`` ``[h, w]`` in ``1..MAX_SIDE``;
    ``crop`` null or ``[h, w]`` at most the resize; ``mean`` three finite numbers; ``std``
    three numbers > 0, large enough that every normalised pixel ``(x - mean) / std``, ``x`` in
    [0, 1], is a finite float32 (the network's input type). The normalisation divides by
    ``std``: a zero or NaN one makes every score NaN, and a NaN score is below any threshold.
    Returns ``{"resize": (h, w), "crop": (h, w) | None, "mean": (3 floats), "std": (3 floats)}``
    plus, for a tiled (high-resolution) model, ``frame`` (:func:`check_frame`).
    """
    check_keys(data, field, (*PREPROCESS_KEYS, "frame"), PREPROCESS_KEYS)
    resize = size_pair(data["resize"], f"{field}.resize")
    crop = None
    if data["crop"] is not None:
        crop = size_pair(data["crop"], f"{field}.crop")
        if crop[0] > resize[0] or crop[1] > resize[1]:
            raise refuse(f"{field}.crop", data["crop"],
                         f"at most the resize {list(resize)} in each dimension")
    mean = _three(data["mean"], f"{field}.mean", "three finite float32 numbers",
                  lambda v: abs(v) <= FLOAT32_MAX)
    std = _three(data["std"], f"{field}.std",
                 f"three finite numbers >= {FLOAT32_TINY:.3g} (the smallest normal float32)",
                 lambda v: v >= FLOAT32_TINY)
    for m, s in zip(mean, std):
        if max(abs(m), abs(1.0 - m)) / s > FLOAT32_MAX:
            raise refuse(f"{field}.std", data["std"], f"numbers large enough that the "
                         f"normalised pixels, (x - mean) / std for x in [0, 1], are finite "
                         f"float32 (mean {list(mean)})")
    out = {"resize": resize, "crop": crop, "mean": mean, "std": std}
    if data.get("frame") is not None:
        out["frame"] = check_frame(data["frame"], f"{field}.frame")
    return out


def check_frame(data: Any, field: str = "preprocess.frame") -> Dict[str, Any]:
    """A tiled model's working frame (``framing.Frame.as_dict``): ``content`` and ``size``
    ``[h, w]`` in ``1..MAX_SIDE`` with the content inside the size; ``crop`` null or two
    fractions in (0, 1]; ``aspect`` ``keep`` (the default) or ``stretch``."""
    check_keys(data, field, ("content", "size", "crop", "aspect"), ("content", "size"))
    content = size_pair(data["content"], f"{field}.content")
    size = size_pair(data["size"], f"{field}.size")
    if content[0] > size[0] or content[1] > size[1]:
        raise refuse(f"{field}.content", data["content"], f"at most the size {list(size)}")
    crop = data.get("crop")
    if crop is not None:
        if not isinstance(crop, list) or len(crop) != 2:
            raise refuse(f"{field}.crop", crop, "null or two fractions in (0, 1]")
        crop = [real(v, f"{field}.crop[{i}]", "a fraction in (0, 1]", lambda v: 0 < v <= 1)
                for i, v in enumerate(crop)]
    aspect = data.get("aspect", "keep")
    if aspect not in ("keep", "stretch"):
        raise refuse(f"{field}.aspect", aspect, "keep or stretch")
    return {"content": list(content), "size": list(size), "crop": crop, "aspect": aspect}


def _three(value: Any, field: str, expected: str,
           test: Callable[[float], bool]) -> Tuple[float, float, float]:
    if not isinstance(value, list) or len(value) != 3:
        raise refuse(field, value, expected)
    a, b, c = (real(v, f"{field}[{i}]", expected, test) for i, v in enumerate(value))
    return a, b, c


def check_layers(data: Any, field: str = "layers") -> List[Dict[str, Any]]:
    """The tapped layers (``LayerInfo`` as dicts): 1 to :data:`MAX_LAYERS` objects with a
    ``name``, ``channels`` (1..2**20) and ``stride`` (1..MAX_SIDE), nothing else."""
    if not isinstance(data, list) or not 1 <= len(data) <= MAX_LAYERS:
        raise refuse(field, data, f"a list of 1 to {MAX_LAYERS} layers")
    out = []
    for i, layer in enumerate(data):
        where = f"{field}[{i}]"
        check_keys(layer, where, LAYER_KEYS, LAYER_KEYS)
        out.append({"name": text(layer["name"], f"{where}.name", r"\S.*", "a layer name"),
                    "channels": integer(layer["channels"], f"{where}.channels", 1,
                                        MAX_CHANNELS),
                    "stride": integer(layer["stride"], f"{where}.stride", 1, MAX_SIDE)})
    return out


def check_lineage(data: Any, field: str = "lineage") -> List[Dict[str, Any]]:
    """The updates a model went through (:mod:`anomaly_hooks.updating`), oldest first: a
    list of at most :data:`MAX_LINEAGE` objects, each with exactly ``parent_checksum`` (the
    parent model file's SHA-256, 64 lowercase hex digits), ``images_added`` (an integer >= 1),
    ``labels_used`` (labelled defective images the new threshold used, an integer >= 0) and
    ``time`` (ISO 8601 with its UTC offset, as ``datetime.isoformat`` writes it), and
    optionally ``source`` (:func:`check_lineage_source`)."""
    if not isinstance(data, list) or len(data) > MAX_LINEAGE:
        raise refuse(field, data, f"a list of at most {MAX_LINEAGE} updates")
    out = []
    for i, entry in enumerate(data):
        where = f"{field}[{i}]"
        check_keys(entry, where, (*LINEAGE_KEYS, "source"), LINEAGE_KEYS)
        when = text(entry["time"], f"{where}.time", None, "an ISO 8601 time with its offset",
                    max_len=64)
        try:
            stamp = datetime.fromisoformat(when)
        except ValueError:
            raise refuse(f"{where}.time", when, "an ISO 8601 time with its offset") from None
        if stamp.tzinfo is None:
            raise refuse(f"{where}.time", when, "an ISO 8601 time with its offset (e.g. "
                         "+00:00)")
        out.append({"parent_checksum": text(entry["parent_checksum"],
                                            f"{where}.parent_checksum", r"[0-9a-f]{64}",
                                            "a SHA-256 (64 lowercase hex digits)"),
                    "images_added": integer(entry["images_added"], f"{where}.images_added", 1,
                                            (1 << 63) - 1),
                    "labels_used": integer(entry["labels_used"], f"{where}.labels_used", 0,
                                           (1 << 63) - 1),
                    "time": when})
        if "source" in entry:
            out[-1]["source"] = check_lineage_source(entry["source"], f"{where}.source")
    return out


def check_lineage_source(data: Any, field: str = "source") -> Dict[str, Any]:
    """Where an update's images came from: an object with ``kind`` (a name, e.g.
    ``results``: an operator's labelled results) and optionally ``store`` (the results log,
    without a password), ``since`` / ``until`` (ISO 8601 or null), ``good_results`` /
    ``defect_results`` (the result ids used, at most :data:`MAX_SOURCE_IDS` each) and
    ``skipped`` (results left out, an integer >= 0)."""
    check_keys(data, field, LINEAGE_SOURCE_KEYS, ("kind",))
    out: Dict[str, Any] = {"kind": text(data["kind"], f"{field}.kind", r"[a-z][a-z_-]{0,31}",
                                        "a lowercase name")}
    for key in ("store", "since", "until"):
        if key in data:
            value = data[key]
            out[key] = None if value is None else text(value, f"{field}.{key}", None, "a text",
                                                       max_len=2000)
    for key in ("good_results", "defect_results"):
        if key in data:
            ids = data[key]
            if not isinstance(ids, list) or len(ids) > MAX_SOURCE_IDS:
                raise refuse(f"{field}.{key}", ids, f"a list of at most {MAX_SOURCE_IDS} ids")
            out[key] = [integer(v, f"{field}.{key}", 1, (1 << 63) - 1) for v in ids]
    if "skipped" in data:
        out["skipped"] = integer(data["skipped"], f"{field}.skipped", 0, (1 << 63) - 1)
    return out


def check_max_pixels(value: Any, field: str = "max_pixels") -> int:
    """The decompression-bomb limit: an integer in ``1..2**40`` (the config's range): the
    guard against huge images must not be switched off by the file."""
    return integer(value, field, 1, MAX_PIXELS)


def _shared_keys(pre: Mapping[str, Any]) -> Tuple[str, ...]:
    """What the stored preprocessing ``pre`` and the config's must share: the normalisation,
    and the resize and crop unless the model is tiled (its working frame, decided at fit from
    the training images, replaces the config's resize and crop)."""
    return ("mean", "std") if "frame" in pre else ("resize", "crop", "mean", "std")


def check_model_meta(meta: Mapping[str, Any]) -> None:
    """The shared fields of a ``.safetensors`` model's metadata, where present (a loader that
    needs a missing one refuses the file itself): the threshold, the preprocessing (also the
    config's, which the detector is built from, and the two must agree), the layers and the
    config's ``data.max_pixels``, and the lineage of an updated model."""
    pre = check_preprocess(meta["preprocess"]) if "preprocess" in meta else None
    if "threshold" in meta:
        check_threshold(meta["threshold"])
    if "layers" in meta:
        check_layers(meta["layers"])
    if "lineage" in meta:
        check_lineage(meta["lineage"])
    config = meta.get("config")
    if not isinstance(config, dict):
        return
    if isinstance(config.get("preprocess"), dict):
        cfg_pre = check_preprocess(config["preprocess"], "config.preprocess")
        if pre is not None and any(pre[k] != cfg_pre[k] for k in _shared_keys(pre)):
            raise MetadataError("preprocess", f"preprocess = {_shown(meta['preprocess'])}: "
                                "disagrees with config.preprocess "
                                f"{_shown(config['preprocess'])}")
    data = config.get("data")
    if isinstance(data, dict) and "max_pixels" in data:
        check_max_pixels(data["max_pixels"], "config.data.max_pixels")


__all__ = ["MAX_DEPTH", "MAX_JSON_CHARS", "MAX_PIXELS", "MetadataError", "about",
           "check_depth", "check_layers", "check_lineage", "check_max_pixels", "check_model_meta",
           "check_preprocess", "check_threshold", "parse_json"]
