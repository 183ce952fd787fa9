"""Export a fitted Detector's whole predict path to one ONNX file.

``export_onnx(detector, "m.onnx")`` writes a graph from a normalised image batch
``images [B, 3, H, W]`` (dynamic B) to ``patch_scores [B, h, w]``, ``heatmap [B, H, W]`` (at the
network input size), ``image_score [B]`` and, for a model with a drift reference, one
``layer_means/<layer> [B, C]`` per layer of the reference (the statistics the drift monitor
compares; a tiled model's graph takes each image's box in its frame too, ``boxes [B, 2]``, and
its layer means are over the cells of the stitched frame maps in each image's box:
:class:`~anomaly_hooks.export.graph.TiledPredictGraph`), with everything the torch-free runtime
(:mod:`anomaly_hooks.runtime`) needs to predict and to monitor drift in the ONNX metadata
(``metadata_props``): threshold, preprocessing, layer description, method and the scorer's
form, the source model file's checksum, the backbone fingerprint, a tiled model's frame and
tiles (``tiling``), the drift reference (``drift``: empty for a model fitted without one --
such an export predicts, and its service says why it has no drift monitor), and last the
checksum of the file's own content
(graph, weights, metadata; :mod:`anomaly_hooks.runtime.onnxfile`), which the runtime verifies
before it runs anything. The export is verified before it is published:
ONNX Runtime's outputs on probe images, one at a time and batched, must match the eager ones
(image scores within ``SCORE_RTOL`` relative, heatmaps within ``HEAT_TOL`` of the map's range,
layer means within ``SCORE_RTOL`` of each layer's largest mean), or
:class:`~anomaly_hooks.errors.ExportError` is raised and nothing is written.

Models whose initialisers exceed protobuf's 2 GB (dense PaDiM on WRN50: 3.8 GB) are written
with their weights in one side file ``<name>.data`` next to the ``.onnx`` (ONNX external data,
named by the ``external_data`` entry and covered by the checksum).
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from anomaly_hooks import __version__
from anomaly_hooks.errors import ExportError, NotFittedError
from anomaly_hooks.export.graph import PredictGraph, TiledPredictGraph
from anomaly_hooks.monitor.portable import reference_to_json
from anomaly_hooks.runtime.metadata import (  # the torch-free reader's constants
    BOXES,
    DRIFT_KEY,
    FORMAT,
    FORMAT_VERSION,
    INPUT,
    OUTPUTS,
)
from anomaly_hooks.runtime.onnxfile import CHECKSUM_KEY, EXTERNAL_KEY, seal

DEFAULT_OPSET = 17
EXPORTERS = ("torchscript", "dynamo")
PROTOBUF_LIMIT = 2_000_000_000 - 64 * 1024 * 1024  # weights beyond this go to a side file
SCORE_RTOL = 1e-4  # image scores, relative
HEAT_TOL = 1e-3  # heatmaps, of each map's range


def source_checksum(model_path: Union[str, os.PathLike]) -> str:
    """The SHA-256 checksum recorded in a model file's header (the file is verified when it is
    loaded, so the header's value is the content's)."""
    from anomaly_hooks.modelfile import read_header

    return str(read_header(Path(model_path))["__metadata__"].get("checksum", ""))


def drift_layers(detector: Any) -> List[str]:
    """The tapped layers whose channel means the export outputs: those of the detector's
    drift reference (none without a reference)."""
    reference = getattr(detector, "drift_reference_", None)
    if reference is None:
        return []
    return [name for name in detector.layers if name in reference.blocks]


def drift_entry(detector: Any, layers: Sequence[str]) -> str:
    """The ``drift`` metadata entry: the reference (:func:`reference_to_json`) and the layers
    the graph outputs the means of; empty for a model without a reference."""
    reference = getattr(detector, "drift_reference_", None)
    if reference is None:
        return ""
    return json.dumps({"layers": list(layers), "reference": reference_to_json(reference)})


def tiling_entry(detector: Any) -> Dict[str, Any]:
    """A tiled model's ``tiling`` entry: the working frame, the tile plan (as the model info
    gives it), whether the scorer's statistics are per tile position, the graph's box input
    and the tiles a session run should hold (``tile_batch``, the runtime's images per run)."""
    tiling = detector.tiling
    return {"frame": tiling.frame.as_dict(), "tiles": tiling.grid.as_dict(),
            "tile_units": bool(tiling.tile_units), "tile_batch": int(tiling.tile_batch),
            "boxes_input": BOXES}


def metadata(detector: Any, graph: PredictGraph, checksum: Optional[str]) -> Dict[str, str]:
    """The string key/value pairs stored in the ONNX file (all the runtime needs; the
    ``external_data`` entry is set when the file is written, the checksum appended last)."""
    cfg = detector.cfg
    extra = ({"tiling": json.dumps(tiling_entry(detector))}
             if getattr(detector, "tiling", None) is not None else {})
    return {**extra,
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "anomaly_hooks_version": __version__,
        "method": str(cfg.method),
        "scorer_form": graph.form,
        "threshold": json.dumps(detector.threshold_.as_dict()),
        "preprocess": json.dumps(detector.preprocessor.as_dict()),
        "layers": json.dumps([vars(i) for i in detector.layer_info]),
        "backbone": json.dumps({"name": detector.backbone_name,
                                "class": type(detector.extractor.model).__name__,
                                "fingerprint": detector.backbone_fingerprint}),
        "grid": json.dumps(list(graph.patch_grid)),
        "input": json.dumps({"name": INPUT, "size": list(graph.size)}),
        "outputs": json.dumps(list(OUTPUTS)),
        "max_pixels": str(int(cfg.data.max_pixels)),
        "source_checksum": checksum or "",
        "int8": "",
        EXTERNAL_KEY: "",
        DRIFT_KEY: drift_entry(detector, graph.drift_layers),
    }


# loggers whose handlers hold the terminal's stream from before any redirection: onnxscript's
# version converter logs a full traceback when it cannot lower the opset (the model is kept)
EXPORTER_LOGGERS = ("onnxscript", "torch.onnx")


@contextlib.contextmanager
def _quiet_loggers(names: Sequence[str]) -> Iterator[None]:
    """Within the block, the named loggers pass on nothing below CRITICAL."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _export_graph(graph: PredictGraph, probe: Sequence[torch.Tensor], path: Path,
                  exporter: str, opset: int) -> None:
    inputs = [INPUT, BOXES][:len(probe)]
    names = graph.output_names
    axes = {name: {0: "batch"} for name in [*inputs, *names]}
    chatter = io.StringIO()  # the exporters print graph dumps and progress lines
    with warnings.catch_warnings(), contextlib.redirect_stdout(chatter), \
            contextlib.redirect_stderr(chatter), _quiet_loggers(EXPORTER_LOGGERS):
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            torch.onnx.export(graph, tuple(probe), str(path), dynamo=False, opset_version=opset,
                              input_names=inputs, output_names=names, dynamic_axes=axes,
                              do_constant_folding=True)
        else:
            batch = torch.export.Dim("batch", min=1, max=4096)
            shapes = {"x": {0: batch}, "boxes": {0: batch}}
            torch.onnx.export(graph, tuple(probe), str(path), dynamo=True, opset_version=opset,
                              input_names=inputs, output_names=names,
                              dynamic_shapes={k: shapes[k] for k in list(shapes)[:len(probe)]},
                              external_data=True,
                              optimize=True, verbose=False)


_OP_PATTERNS = [r"operator '?(aten::[A-Za-z0-9_.]+)'?", r"(aten::[A-Za-z0-9_.]+)",
                r"(aten\.[A-Za-z0-9_]+)",
                r"op(?:erator)? '?([A-Za-z0-9_:.]+)'? (?:is )?not supported"]


def failing_op(message: str) -> Optional[str]:
    """The operator an exporter's error message names (``aten::fft_rfft2``), if any."""
    for pat in _OP_PATTERNS:
        m = re.search(pat, message)
        if m:
            return m.group(1).replace("aten.", "aten::").split(".")[0]
    return None


def locate_op(model: nn.Module, probe: torch.Tensor, op: str) -> Optional[str]:
    """``layer 'name' (Class)`` of the innermost module of ``model``'s backbone whose forward
    calls the operator ``op``, found by one eager forward under a torch-function mode (which
    sees ``torch.fft.rfft2`` before it decomposes) and a dispatch mode (which sees the aten ops
    it decomposes into); None when no module calls it."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    inner = getattr(getattr(model, "backbone", None), "model", None)  # the user's names
    names = {m: n for n, m in (inner or model).named_modules()}
    stack: List[nn.Module] = []
    found: List[str] = []
    want = op.split("::")[-1].split(".")[0].lstrip("_")

    def note(name: str) -> None:
        if not found and name.lstrip("_") == want:
            named = [m for m in stack if names.get(m)]
            found.append(f"layer '{names[named[-1]]}' ({type(named[-1]).__name__})" if named
                         else f"the top-level forward of {type(model).__name__}")

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            note(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            note(func._schema.name.split("::")[-1])
            return func(*args, **(kwargs or {}))

    def pop(mod: nn.Module, _inp: Any, _out: Any) -> None:
        if stack and stack[-1] is mod:
            stack.pop()

    handles = [nn.modules.module.register_module_forward_pre_hook(
                   lambda mod, _inp: stack.append(mod)),
               nn.modules.module.register_module_forward_hook(pop)]
    try:
        with torch.no_grad(), Functions(), Dispatch():
            model(probe)
    # the search is best effort: the error message stands without it
    except Exception:  # noqa: BLE001
        pass
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def explain(exc: Exception, graph: PredictGraph, probe: torch.Tensor, opset: int,
            what: str) -> ExportError:
    """An :class:`ExportError` naming the operator and the layer that calls it."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    op = failing_op(str(exc))
    if op is None:
        return ExportError(f"{what}: {type(exc).__name__}: {first}")
    where = locate_op(graph, probe, op)
    return ExportError(
        f"{what}: operator {op}{' in ' + where if where else ''} has no ONNX translation "
        f"(opset {opset}). Replace that layer with exportable ops, tap an earlier layer, try "
        f"the dynamo exporter (--exporter dynamo), or use the eager model. ({first})")


def gemm_transposed_initializers(model: Any) -> int:
    """Replace ``MatMul(A, W^T)`` where the constant ``W^T`` is the transpose of another
    initializer ``W`` (the exporter turns ``F.linear(q, bank)`` into a transposed *copy* of the
    bank) by ``Gemm(A, W, transB=1)`` when ``A`` is 2-d, and drop the copy: the bank is then
    stored, and held in memory, once. Returns how many initializers were dropped."""
    from onnx import helper, numpy_helper, shape_inference

    inits = {t.name: t for t in model.graph.initializer}
    by_shape: Dict[tuple, List[str]] = {}
    for t in model.graph.initializer:
        if len(t.dims) == 2:
            by_shape.setdefault(tuple(t.dims), []).append(t.name)
    try:
        ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in
                 shape_inference.infer_shapes(model).graph.value_info}
    except Exception:  # noqa: BLE001 (no shapes, no rewrite: the model stays correct, only larger)
        return 0
    ranks.update({i.name: len(i.type.tensor_type.shape.dim) for i in model.graph.input})
    users: Dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            users[name] = users.get(name, 0) + 1
    dropped = set()
    for i, node in enumerate(model.graph.node):
        if node.op_type != "MatMul" or node.input[1] not in inits or users[node.input[1]] != 1:
            continue
        wt = inits[node.input[1]]
        if len(wt.dims) != 2 or ranks.get(node.input[0]) != 2:
            continue
        arr_t = numpy_helper.to_array(wt)
        match = next((n for n in by_shape.get((wt.dims[1], wt.dims[0]), [])
                      if n not in dropped and np.array_equal(numpy_helper.to_array(inits[n]).T,
                                                             arr_t)), None)
        if match is None:
            continue
        gemm = helper.make_node("Gemm", [node.input[0], match], list(node.output),
                                name=(node.name or f"matmul_{i}") + "_gemm", transB=1)
        model.graph.node.remove(node)
        model.graph.node.insert(i, gemm)
        dropped.add(wt.name)
    keep = [t for t in model.graph.initializer if t.name not in dropped]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    return len(dropped)


def set_metadata(model: Any, meta: Dict[str, str]) -> None:
    """Replace the ONNX model's ``metadata_props`` by ``meta`` (without a checksum entry:
    :func:`~anomaly_hooks.runtime.onnxfile.seal` appends the one of the final bytes)."""
    del model.metadata_props[:]
    for key, value in meta.items():
        if key == CHECKSUM_KEY:
            continue
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value


def save_sealed(model: Any, out: Path, external: bool) -> Optional[Path]:
    """Write ``model`` to ``out`` (its weights in the side file ``out.data`` when
    ``external``), with the ``external_data`` entry naming that file, then append the
    checksum of the content. Returns the side file, if any."""
    import onnx

    data = out.with_name(out.name + ".data")
    meta = {p.key: p.value for p in model.metadata_props}
    set_metadata(model, {**meta, EXTERNAL_KEY: data.name if external else ""})
    if external:
        onnx.save_model(model, str(out), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data.name, size_threshold=1024)
    else:
        onnx.save_model(model, str(out))
    seal(out)
    return data if external else None


def _finish(raw: Path, out: Path, meta: Dict[str, str],
            external_data: Optional[bool] = None) -> Optional[Path]:
    """Add the metadata, store each big constant once, write and seal ``out`` (weights
    inline, or in ``out.data`` past 2 GB). Returns the side file, if any."""
    import onnx

    model = onnx.load(str(raw), load_external_data=True)
    gemm_transposed_initializers(model)
    set_metadata(model, meta)
    model.doc_string = (f"anomaly_hooks {meta['method']} ({meta['scorer_form']}) model: "
                        f"normalised images [B, 3, H, W] -> {', '.join(OUTPUTS)}"
                        f"{', layer_means/*' if meta.get(DRIFT_KEY) else ''}")
    size = sum(t.ByteSize() for t in model.graph.initializer)
    external = bool(external_data or (external_data is None and size > PROTOBUF_LIMIT))
    return save_sealed(model, out, external)


def _ordinary_mode(path: Path) -> None:
    """Permissions of an ordinary file (``0666`` less the umask): the writers make some files
    private, and an edge box often runs the model as another user."""
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def publish(tmp: Path, side: Optional[Path], path: Path) -> Path:
    """Move a finished file (and its side file first) into place, each by an atomic rename."""
    data = path.with_name(path.name + ".data")
    if side is not None:
        if side.name != data.name:  # the model's external_data entry names the side file
            raise ValueError(f"side file {side.name} published as {data.name}")
        _ordinary_mode(side)
        os.replace(side, data)
    else:
        data.unlink(missing_ok=True)
    _ordinary_mode(tmp)
    os.replace(tmp, path)
    return path


def export_onnx(detector: Any, path: Union[str, os.PathLike], *,
                exporter: str = "torchscript", opset: int = DEFAULT_OPSET,
                checksum: Optional[str] = None, verify: Union[bool, Sequence[Any]] = True,
                external_data: Optional[bool] = None, **options: Any) -> Path:
    """Write ``detector``'s predict path as one ONNX graph (see the module docstring).

    Args:
        exporter: ``torchscript`` (``torch.onnx.export(dynamo=False)``, the default) or
            ``dynamo`` (``torch.export``; needs onnxscript; translates more operators, e.g.
            FFTs). Both cut the backbone after the last tapped layer.
        checksum: the source model file's checksum (``source_checksum(path)``).
        verify: compare ONNX Runtime with eager on probe images (True: two noise images; or a
            list of images: any input ``predict`` accepts); False skips it.
        external_data: weights in a side file ``<path>.data`` (None: only past 2 GB).
        options: the method's export choices (PatchCore: ``search=auto|projected|brute``).

    Raises:
        NotFittedError: the detector is not fitted.
        ExportError: a layer cannot be exported (the message
            names the operator and layer), or the exported graph does not reproduce the eager
            outputs.
    """
    if not detector.is_fitted:
        raise NotFittedError("nothing to export: this Detector is not fitted; call fit() "
                             "first, or Detector.load() a saved model")
    if detector.device.type != "cpu":
        raise ExportError("export from a CPU detector: Detector.load(path, device='cpu')")
    if exporter not in EXPORTERS:
        raise ExportError(f"exporter={exporter!r}: one of {', '.join(EXPORTERS)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kind = TiledPredictGraph if getattr(detector, "tiling", None) is not None else PredictGraph
    graph = kind(detector, stop=exporter == "torchscript", drift_layers=drift_layers(detector),
                 **options).eval()
    h, w = detector.preprocessor.input_size
    probe = [torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(0))]
    if kind is TiledPredictGraph:  # a letterboxed image beside one that fills the frame
        probe.append(torch.tensor(boxes(detector, probe_sizes(detector)), dtype=torch.int64))
    what = f"cannot export the {type(detector.extractor.model).__name__} backbone to ONNX"
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-") as tmpdir:
        raw = Path(tmpdir) / "graph.onnx"
        try:
            _export_graph(graph, probe, raw, exporter, opset)
        except Exception as exc:  # noqa: BLE001 (the exporters raise many types)
            raise explain(exc, graph, probe[0], opset, what) from None
        check_opset(raw, opset, exporter)
        final = Path(tmpdir) / path.name
        side = _finish(raw, final, metadata(detector, graph, checksum), external_data)
        if verify is not False:
            verify_export(detector, final, None if verify is True else list(verify))
        return publish(final, side, path)


def check_opset(path: Path, asked: int, exporter: str) -> int:
    """The ONNX opset the exporter wrote to ``path``; a warning where it is not the one
    ``asked`` (the dynamo exporter keeps its own, 18, where it cannot convert every operator
    down: a runtime must then support that opset)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    written = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                   asked)
    if written != asked:
        warnings.warn(f"the {exporter} exporter wrote ONNX opset {written}, not the {asked} "
                      f"asked for (it could not convert every operator to opset {asked}): the "
                      f"runtime must support opset {written}; --exporter torchscript writes "
                      f"opset {asked}", UserWarning, stacklevel=3)
    return written


def probe_sizes(detector: Any) -> List[Tuple[int, int]]:
    """The two noise probes' image sizes: the frame's own aspect (a tiled model's content
    box), and for a tiled model one of half its width (letterboxed: its padding masked)."""
    frame = detector.preprocessor.frame
    if frame is None:
        return [tuple(detector.preprocessor.input_size)] * 2  # type: ignore[list-item]
    h, w = frame.content
    return [(h, w), (h, max(1, w // 2))]


def boxes(detector: Any, sizes: Sequence[Tuple[int, int]]) -> List[List[int]]:
    """A tiled model's graph input ``boxes``: each image's part of the frame (h, w)."""
    return [list(detector.preprocessor.frame.placement(tuple(s))) for s in sizes]


def probe_batch(detector: Any, images: Optional[Sequence[Any]] = None
                ) -> Tuple[torch.Tensor, List[Tuple[int, int]]]:
    """Normalised ``[B, 3, H, W]`` and each image's (H, W): the given images preprocessed,
    else two noise images (of :func:`probe_sizes`; a letterboxed one's padding is zeros)."""
    if images:
        from anomaly_hooks.data import load_preprocessed

        loaded = [load_preprocessed(i, detector.preprocessor, detector.cfg.data.max_pixels)
                  for i in images]
        return torch.stack([x for x, _ in loaded]), [tuple(s) for _, s in loaded]
    h, w = detector.preprocessor.input_size
    noise = torch.rand(2, 3, h, w, generator=torch.Generator().manual_seed(1))
    mean = torch.tensor(detector.preprocessor.mean).view(1, 3, 1, 1)
    std = torch.tensor(detector.preprocessor.std).view(1, 3, 1, 1)
    x = (noise - mean) / std
    sizes = probe_sizes(detector)
    if detector.preprocessor.frame is not None:
        for i, (bh, bw) in enumerate(boxes(detector, sizes)):
            keep = torch.zeros(h, w, dtype=torch.bool)
            keep[:bh, :bw] = True
            x[i] = torch.where(keep, x[i], torch.zeros_like(x[i]))
    return x, sizes


def compare(eager_scores: np.ndarray, eager_maps: np.ndarray, scores: np.ndarray,
            maps: np.ndarray) -> Dict[str, float]:
    """Largest relative score difference and largest heatmap difference / the map's range."""
    rel = np.abs(scores - eager_scores) / np.maximum(np.abs(eager_scores), 1e-12)
    flat = eager_maps.reshape(len(eager_maps), -1)
    span = np.maximum(flat.max(axis=1) - flat.min(axis=1), 1e-12)
    heat = np.abs(maps - eager_maps).reshape(len(maps), -1).max(axis=1) / span
    return {"score_rel": float(rel.max()), "heat_rel": float(heat.max())}


def verify_export(detector: Any, onnx_path: Union[str, os.PathLike],
                  images: Optional[Sequence[Any]] = None) -> Dict[str, float]:
    """Run the exported graph in ONNX Runtime (one image at a time and all probes batched)
    against eager; raise :class:`ExportError` beyond the tolerances. Returns the differences."""
    import onnxruntime as ort

    x, sizes = probe_batch(detector, images)
    taps: Dict[str, np.ndarray] = {}
    scores, maps = detector.infer(x, sizes=sizes, taps=taps)
    scores, maps = scores.numpy(), maps.float().cpu().numpy()
    feeds = [{INPUT: x[i:i + 1].numpy()} for i in range(x.shape[0])]
    full = {INPUT: x.numpy()}
    if getattr(detector, "tiling", None) is not None:
        box = np.asarray(boxes(detector, sizes), dtype=np.int64)
        feeds = [{**f, BOXES: box[i:i + 1]} for i, f in enumerate(feeds)]
        full[BOXES] = box
    try:
        sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 (ONNX Runtime raises its own types)
        raise ExportError(f"ONNX Runtime cannot load the exported graph: {exc}") from None
    single = [sess.run(None, feed) for feed in feeds]
    full = sess.run(None, full)
    diffs = {}
    for tag, (m, s) in {"batch1": (np.concatenate([o[1] for o in single]),
                                   np.concatenate([o[2] for o in single])),
                        "batched": (full[1], full[2])}.items():
        diffs.update({f"{tag}_{k}": v for k, v in compare(scores, maps, s, m).items()})
    layers = drift_layers(detector)
    for tag, outs in (("batch1", [np.concatenate(parts) for parts in
                                  zip(*(o[len(OUTPUTS):] for o in single))] if layers else []),
                      ("batched", full[len(OUTPUTS):])):
        diffs[f"{tag}_means_rel"] = max(
            (float(np.abs(got - taps[name]).max() / max(np.abs(taps[name]).max(), 1e-12))
             for name, got in zip(layers, outs)), default=0.0)
    if max(diffs["batch1_score_rel"], diffs["batched_score_rel"],
           diffs["batch1_means_rel"], diffs["batched_means_rel"]) > SCORE_RTOL or \
            max(diffs["batch1_heat_rel"], diffs["batched_heat_rel"]) > HEAT_TOL:
        raise ExportError(f"the exported graph does not reproduce the eager model "
                          f"({', '.join(f'{k}={v:.2g}' for k, v in diffs.items())}; tolerances "
                          f"{SCORE_RTOL:g} relative on scores and layer means, {HEAT_TOL:g} "
                          "of the heatmap range): the backbone may have data-dependent control "
                          "flow that tracing froze; nothing was written")
    return diffs


__all__ = ["ExportError", "export_onnx", "source_checksum", "verify_export"]
