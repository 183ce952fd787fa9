"""The metadata of an exported model, checked before the first image.

``anomaly-hooks export`` stores everything the runtime needs in the ONNX ``metadata_props``
(string entries, JSON where structured). :func:`read_exported` verifies a file the way
:func:`anomaly_hooks.modelfile.load_model` verifies a ``.safetensors`` one: the format and its
version, the checksum of the file's own content (:mod:`anomaly_hooks.runtime.onnxfile`), then
every entry by the rules both formats share (:mod:`anomaly_hooks.modelmeta`: types, ranges,
finite numbers, JSON size and depth limits); :func:`check_graph` then checks the metadata
against the inputs and outputs the graph declares. Each refusal is a
:class:`~anomaly_hooks.errors.ModelFileError` (a
:class:`~anomaly_hooks.modelmeta.MetadataError` naming the field where one is at fault).

Torch-free and ``onnx``-free: a service or an edge box can vet a file with the standard library
(ONNX Runtime only for :func:`check_graph`'s session).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from anomaly_hooks.errors import ModelFileError
from anomaly_hooks.modelmeta import (
    MAX_PIXELS,
    MetadataError,
    about,
    check_frame,
    check_keys,
    check_layers,
    check_preprocess,
    decimal,
    parse_json,
    refuse,
    size_pair,
    text,
)
from anomaly_hooks.monitor.portable import reference_from_json
from anomaly_hooks.monitor.reference import DriftReference
from anomaly_hooks.monitor.stats import RESERVED_BLOCKS
from anomaly_hooks.runtime.onnxfile import (
    CHECKSUM_KEY,
    EXTERNAL_KEY,
    OnnxContent,
    read_content,
    side_file,
)
from anomaly_hooks.threshold import Threshold

FORMAT = "anomaly_hooks-onnx"
FORMAT_VERSION = 3  # the exported-model format this version writes
# 1: the first format (no checksum of the file's content: no longer read); 2: adds the
# checksum and external_data entries (still read: served without a drift monitor); 3: adds the
# drift entry and the layer-mean outputs
READ_VERSIONS = (2, 3)
INPUT = "images"
BOXES = "boxes"  # a tiled model's second input: each image's part of the frame [B, 2] (h, w)
OUTPUTS = ("patch_scores", "heatmap", "image_score")
#: the graph's output of a tapped layer's per-image channel means ``[B, C]`` (format 3)
LAYER_MEANS_PREFIX = "layer_means/"
DRIFT_KEY = "drift"  # the drift reference and its layers ("" for a model without one)
KEYS_V2 = ("format", "format_version", "anomaly_hooks_version", "method", "scorer_form",
           "threshold", "preprocess", "layers", "backbone", "grid", "input", "outputs",
           "max_pixels", "source_checksum", "int8", EXTERNAL_KEY, CHECKSUM_KEY)
KEYS = KEYS_V2 + (DRIFT_KEY,)
OPTIONAL_KEYS = ("tiling",)  # a tiled (high-resolution) model's: the frame and its tiles
#: why a format-2 file feeds no drift monitor
NO_LAYER_MEANS = ("this model was exported by an earlier version of anomaly_hooks (exported-model "
                  "format 2), whose graph does not output the tapped layers' statistics and "
                  "whose file holds no drift reference: export it again (anomaly-hooks export "
                  "--model MODEL.safetensors --out m.onnx) to monitor drift on the edge")
#: why a file exported from a model without a drift reference feeds no drift monitor
NO_DRIFT_REFERENCE = ("this model was exported from a model file without a drift reference "
                      "(fitted with monitor.enabled=false, or with fewer than 4 good images): "
                      "refit it with monitor.enabled=true (the default) and export it again to "
                      "monitor drift on the edge")

#: why an int8 file feeds no drift monitor
NO_DRIFT_INT8 = ("this is an int8 model: its quantised backbone's layer statistics differ from "
                 "the float32 ones its drift reference was fitted on, so the quantisation "
                 "dropped them; serve the float32 export where drift must be watched")


def layer_means_output(layer: str) -> str:
    """The name of the graph output holding ``layer``'s per-image channel means."""
    return LAYER_MEANS_PREFIX + layer
_HEX64 = r"[0-9a-f]{64}"


@dataclass(frozen=True)
class ExportedModel:
    """A verified exported model's metadata, parsed (:func:`read_exported`)."""

    path: Path
    meta: Dict[str, str]  # the entries as stored
    method: str
    scorer_form: str
    threshold: Threshold
    preprocess: Dict[str, Any]  # modelmeta.check_preprocess's form
    layers: List[Dict[str, Any]]
    backbone: Dict[str, str]
    grid: Tuple[int, int]
    input_name: str
    input_size: Tuple[int, int]  # the network input (H, W): the crop, else the resize, or
    # a tiled model's frame
    max_pixels: int
    int8: Optional[Dict[str, Any]]
    checksum: str
    content: OnnxContent = field(repr=False, compare=False)
    tiling: Optional[Dict[str, Any]] = None  # a tiled model's frame and tiles (_tiling)
    format_version: int = FORMAT_VERSION
    #: the drift reference saved with the source model (None: none, or a format-2 file)
    drift: Optional[DriftReference] = field(default=None, repr=False, compare=False)
    #: the tapped layers whose channel means the graph outputs (``layer_means/<name>``)
    drift_layers: Tuple[str, ...] = ()

    @property
    def outputs(self) -> List[str]:
        """The graph's output names, in order."""
        return [*OUTPUTS, *(layer_means_output(name) for name in self.drift_layers)]

    @property
    def drift_unavailable(self) -> Optional[str]:
        """None when the file can feed a drift monitor, else why not."""
        if self.format_version < 3:
            return NO_LAYER_MEANS
        if self.drift is None:
            return NO_DRIFT_INT8 if self.int8 else NO_DRIFT_REFERENCE
        return None


def check_format(meta: Mapping[str, str], path: Path) -> int:
    """The format version of an anomaly_hooks export; a foreign, older or newer file is
    refused."""
    if meta.get("format") != FORMAT:
        raise ModelFileError(f"{path}: an ONNX file, but not one written by anomaly-hooks export "
                             "(no anomaly_hooks metadata)")
    try:
        version = decimal(meta.get("format_version"), "format_version", 0, 10**9)
    except MetadataError:
        raise ModelFileError(f"{path}: damaged metadata (format_version "
                             f"{meta.get('format_version')!r})") from None
    if version == 1:
        raise ModelFileError(f"{path} is in exported-model format 1, which has no checksum of "
                             "its content: export it again with this version of anomaly_hooks")
    if version not in READ_VERSIONS:
        raise ModelFileError(f"{path} is in exported-model format {version}; this version of "
                             f"anomaly_hooks reads formats "
                             f"{' and '.join(map(str, READ_VERSIONS))}: export it again "
                             "with this version, or upgrade anomaly_hooks")
    return version


def read_exported(path: Any) -> ExportedModel:
    """Verify an exported ``.onnx`` file (and its side file of weights) without running it:
    the public check for any loader (the runtime, ``score``, a service loading or reloading a
    model).

    Raises:
        ModelFileError: missing, damaged or truncated, not an anomaly_hooks export, another
            format version, duplicated entries, checksum mismatch, or an entry outside its
            rules (a :class:`~anomaly_hooks.modelmeta.MetadataError` naming it).
    """
    path = Path(path)
    content = read_content(path)
    repeated = sorted(k for k, n in Counter(k for k, _ in content.entries).items() if n > 1)
    if repeated:
        raise ModelFileError(f"{path}: metadata entries {repeated} appear more than once: the "
                             "file was modified after export")
    meta = content.metadata
    version = check_format(meta, path)
    if not content.checksum_records:
        raise ModelFileError(f"{path}: no checksum of its content (the file was truncated or "
                             "modified after export): export it again")
    if meta[CHECKSUM_KEY] != content.digest:
        side = f" or its weights file {meta.get(EXTERNAL_KEY)}" if meta.get(EXTERNAL_KEY) else ""
        raise ModelFileError(f"{path}: checksum mismatch: the file{side} was modified or "
                             "damaged after export; export it again or restore it from a "
                             "backup")
    with about(path):
        return ExportedModel(path=path, meta=meta, content=content,
                             **parse_metadata(meta, version))


def parse_metadata(meta: Mapping[str, str], version: int = FORMAT_VERSION) -> Dict[str, Any]:
    """Every entry of an export's metadata checked and parsed (the fields of
    :class:`ExportedModel` that come from the metadata) for the format ``version``; the
    checksum's value is only checked for its form here (:func:`read_exported` compares it with
    the content)."""
    _check_entries(meta, KEYS if version >= 3 else KEYS_V2)
    text(meta["anomaly_hooks_version"], "anomaly_hooks_version", r"[0-9A-Za-z.+_-]{1,64}",
         "a version string")
    if meta["source_checksum"]:
        text(meta["source_checksum"], "source_checksum", _HEX64, "empty or 64 hex digits")
    if meta[EXTERNAL_KEY]:
        side_file(Path("."), meta[EXTERNAL_KEY])
    preprocess = check_preprocess(parse_json(meta["preprocess"], "preprocess"))
    size = preprocess["crop"] or preprocess["resize"]
    layers = check_layers(parse_json(meta["layers"], "layers"))
    drift, drift_layers = (_drift(meta[DRIFT_KEY], layers) if version >= 3 and meta[DRIFT_KEY]
                           else (None, ()))
    tiling = None
    if "tiling" in meta:
        tiling = _tiling(parse_json(meta["tiling"], "tiling"), preprocess)
        size = tiling["frame"]["size"]
    return {
        "tiling": tiling,
        "format_version": version,
        "drift": drift,
        "drift_layers": drift_layers,
        "method": text(meta["method"], "method", r"[a-z][a-z0-9_]{0,63}", "a method name"),
        "scorer_form": text(meta["scorer_form"], "scorer_form", r"[a-z0-9_]{0,64}",
                            "a scorer form name"),
        "threshold": Threshold.from_dict(parse_json(meta["threshold"], "threshold")),
        "preprocess": preprocess,
        "layers": layers,
        "backbone": _backbone(parse_json(meta["backbone"], "backbone")),
        "grid": size_pair(parse_json(meta["grid"], "grid"), "grid"),
        "input_name": _input(parse_json(meta["input"], "input"), size),
        "input_size": size,
        "max_pixels": decimal(meta["max_pixels"], "max_pixels", 1, MAX_PIXELS),
        "int8": _int8(meta["int8"]),
        "checksum": text(meta[CHECKSUM_KEY], CHECKSUM_KEY, _HEX64, "64 hex digits"),
    }


def _check_entries(meta: Mapping[str, str], keys: Sequence[str]) -> None:
    """Exactly the entries an export of its format writes, and the output list the runtime
    relies on."""
    extra = sorted(set(meta) - set(keys) - set(OPTIONAL_KEYS))
    if extra:
        raise MetadataError("metadata", f"unexpected metadata entries {extra}: the file was "
                            "modified after export, or was not written by anomaly_hooks")
    for key in keys:
        if key not in meta:
            raise MetadataError(key, f"{key} is missing")
    if parse_json(meta["outputs"], "outputs") != list(OUTPUTS):
        raise refuse("outputs", meta["outputs"], f"{list(OUTPUTS)}")


def _drift(raw: str, layers: Sequence[Mapping[str, Any]]
           ) -> Tuple[DriftReference, Tuple[str, ...]]:
    """The drift entry: ``{"layers": [names], "reference": reference_to_json(...)}``; every
    layer block of the reference is a tapped layer the graph outputs the means of, with that
    layer's channel count."""
    data = check_keys(parse_json(raw, DRIFT_KEY), DRIFT_KEY, ("layers", "reference"),
                      ("layers", "reference"))
    channels = {layer["name"]: layer["channels"] for layer in layers}
    names = data["layers"]
    if not isinstance(names, list) or len(set(map(str, names))) != len(names) or \
            not all(isinstance(n, str) and n in channels for n in names):
        raise refuse("drift.layers", names, f"distinct tapped layers (of {sorted(channels)})")
    try:
        reference = reference_from_json(data["reference"])
    except ModelFileError as exc:
        raise MetadataError("drift.reference", str(exc)) from None
    blocks = {name: block.dim for name, block in reference.blocks.items()
              if name not in RESERVED_BLOCKS}
    if blocks != {n: channels[n] for n in names}:
        raise MetadataError("drift.layers", f"drift.layers = {names}: disagrees with the "
                            f"reference's layer blocks {blocks} (name: channels)")
    return reference, tuple(names)


def _backbone(data: Any) -> Dict[str, str]:
    keys = ("name", "class", "fingerprint")
    check_keys(data, "backbone", keys, keys)
    return {k: text(data[k], f"backbone.{k}", expected="a string") for k in keys}


def _input(data: Any, size: Tuple[int, int]) -> str:
    """The input's name; its size must be the preprocessing's output."""
    check_keys(data, "input", ("name", "size"), ("name", "size"))
    if size_pair(data["size"], "input.size") != tuple(size):
        raise MetadataError("input.size", f"input.size = {data['size']}: disagrees with "
                            f"preprocess, whose output (its crop, else its resize) is "
                            f"{list(size)}")
    return text(data["name"], "input.name", r"\S{1,256}", "a tensor name")


def _tiling(data: Any, preprocess: Mapping[str, Any]) -> Dict[str, Any]:
    """A tiled model's ``tiling`` entry: its frame must be the preprocessing's; the tile plan
    is kept as written (the graph holds it); ``tile_batch`` is what the runtime runs at once."""
    keys = ("frame", "tiles", "tile_units", "tile_batch", "boxes_input")
    check_keys(data, "tiling", keys, keys)
    frame = check_frame(data["frame"], "tiling.frame")
    if preprocess.get("frame") != frame:
        raise MetadataError("tiling.frame", f"tiling.frame = {data['frame']}: disagrees with "
                            "preprocess.frame")
    if not isinstance(data["tile_units"], bool):
        raise refuse("tiling.tile_units", data["tile_units"], "true or false")
    tiles = dict(check_keys(data["tiles"], "tiling.tiles"))
    count = tiles.get("tiles")
    if not isinstance(count, list) or len(count) != 2:
        raise refuse("tiling.tiles.tiles", count, "[rows, columns] of tiles")
    count = [_count(v, "tiling.tiles.tiles", 65_536) for v in count]
    return {"frame": frame, "tiles": tiles, "tile_units": data["tile_units"],
            "n_tiles": count[0] * count[1],
            "tile_batch": _count(data["tile_batch"], "tiling.tile_batch", 4096),
            "boxes_input": text(data["boxes_input"], "tiling.boxes_input", r"\S{1,256}",
                                "a tensor name")}


def _count(value: Any, field: str, high: int) -> int:
    """A JSON integer in ``1..high`` (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise refuse(field, value, f"an integer in 1..{high}")
    return value


def _int8(raw: str) -> Optional[Dict[str, Any]]:
    """The int8 report (empty for a float32 model)."""
    if not raw:
        return None
    return dict(check_keys(parse_json(raw, "int8"), "int8"))


# -- the graph ----------------------------------------------------------------------------
def check_graph(model: ExportedModel, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
    """The metadata against the graph's declared inputs and outputs (ONNX Runtime's
    ``session.get_inputs()`` / ``get_outputs()``: ``.name`` and ``.shape``, whose symbolic
    dimensions, strings or None, match anything): the input's name and size, the output names
    in order, the patch-score grid and the heatmap's size.

    Raises:
        MetadataError: naming the entry that disagrees with the graph.
    """
    names = [o.name for o in outputs]
    if names != model.outputs:
        raise refuse("outputs", model.outputs, f"the graph's outputs, which are {names}")
    want = [model.input_name] + ([model.tiling["boxes_input"]] if model.tiling else [])
    if [i.name for i in inputs] != want:
        raise refuse("input.name" if model.tiling is None else "tiling.boxes_input", want,
                     f"the graph's inputs, which are {[i.name for i in inputs]}")
    if model.tiling is not None:
        _shape(("tiling", "tiling.boxes_input: [batch, 2]"), inputs[1], [None, 2])
    h, w = model.input_size
    network = ("preprocess", f"preprocess: its output (crop, else resize) {[h, w]}")
    _shape(network, inputs[0], [None, 3, h, w])
    _shape(("grid", f"grid = {list(model.grid)}"), outputs[0], [None, *model.grid])
    _shape(network, outputs[1], [None, h, w])
    _shape(("outputs", f"outputs = {list(OUTPUTS)}"), outputs[2], [None])
    channels = {layer["name"]: layer["channels"] for layer in model.layers}
    for name, arg in zip(model.drift_layers, outputs[len(OUTPUTS):]):
        _shape(("layers", f"layers: {name} of {channels[name]} channels"), arg,
               [None, channels[name]])


def _shape(entry: Tuple[str, str], arg: Any, want: List[Optional[int]]) -> None:
    """``arg``'s declared shape against ``want`` (None: any size); ``entry``: the field and
    how the message shows it."""
    shape = getattr(arg, "shape", None)
    if not isinstance(shape, (list, tuple)):  # an engine that does not declare shapes
        return
    fits = len(shape) == len(want) and all(
        w is None or not isinstance(s, int) or s == w for s, w in zip(shape, want))
    if not fits:
        raise MetadataError(entry[0], f"{entry[1]}: disagrees with the graph's {arg.name!r} "
                            f"of shape {list(shape)}")


__all__ = ["BOXES", "DRIFT_KEY", "ExportedModel", "FORMAT", "FORMAT_VERSION", "INPUT", "KEYS",
           "LAYER_MEANS_PREFIX", "OPTIONAL_KEYS", "OUTPUTS", "READ_VERSIONS", "check_format",
           "check_graph", "layer_means_output", "parse_metadata", "read_exported"]
