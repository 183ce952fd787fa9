"""An exported .onnx model is verified like a .safetensors one: the checksum of its own content
(graph, weights, metadata, the side file of weights) and every metadata entry by the rules both
formats share (anomaly_hooks.modelmeta), before the first image, in the runtime, in ``score`` and
where torch cannot be imported. Forged files are made here from a small PaDiM export: metadata
rewritten and the checksum recomputed (a forger can: it is unkeyed), or bytes damaged."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from conftest import ROOT, SAMPLE  # noqa: E402

from anomaly_hooks.cli import main  # noqa: E402
from anomaly_hooks.errors import ModelFileError  # noqa: E402
from anomaly_hooks.export import export_onnx  # noqa: E402
from anomaly_hooks.export.onnx import SCORE_RTOL  # noqa: E402
from anomaly_hooks.modelmeta import FLOAT32_TINY, MetadataError, check_model_meta  # noqa: E402
from anomaly_hooks.runtime import OnnxDetector, check_graph, read_exported  # noqa: E402
from anomaly_hooks.runtime.metadata import ExportedModel, parse_metadata  # noqa: E402
from anomaly_hooks.runtime.onnxfile import OnnxContent, seal  # noqa: E402
from anomaly_hooks.runtime.preprocess import NumpyPreprocessor  # noqa: E402

GOOD = SAMPLE / "test" / "good"
DISTANCE = "expected a finite number > 0 (image scores are distances >= 0)"
SIZES = "expected [height, width], integers in 1..8192"
PIXELS = "expected an integer in 1..1099511627776"
STD = "expected three finite numbers >= 1.18e-38 (the smallest normal float32)"


@pytest.fixture(scope="module")
def exports(fitted, tmp_path_factory) -> Dict[str, Path]:
    """A small PaDiM model (conftest's ``fitted``) exported with its weights inline and with
    them in a side file, and its .safetensors file."""
    root = tmp_path_factory.mktemp("trust")
    return {"inline": export_onnx(fitted, root / "inline" / "m.onnx"),
            "external": export_onnx(fitted, root / "external" / "m.onnx", external_data=True),
            "safetensors": fitted.save(root / "m.safetensors")}


def forge(src: Path, dst: Path, edit: Callable[[Dict[str, str], Any], None]) -> Path:
    """Copy an export (and its side file) with ``edit(metadata, model)`` applied and the
    checksum of the new content appended."""
    import onnx

    dst.parent.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(src), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props if p.key != "checksum"}
    edit(props, model)
    del model.metadata_props[:]
    for key, value in props.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    side = src.with_name(src.name + ".data")
    if side.exists():
        shutil.copy(side, dst.with_name(dst.name + ".data"))
    onnx.save_model(model, str(dst))
    seal(dst)
    return dst


def entry(key: str, **changes: Any) -> Callable[[Dict[str, str], Any], None]:
    """An edit of the JSON entry ``key``: its fields updated with ``changes``."""
    def edit(props: Dict[str, str], _model: Any) -> None:
        value = json.loads(props[key])
        value.update(changes)
        props[key] = json.dumps(value)
    return edit


def put(**values: str) -> Callable[[Dict[str, str], Any], None]:
    """An edit setting entries to the given strings."""
    return lambda props, _model: props.update(values)


def both(*edits: Callable[[Dict[str, str], Any], None]) -> Callable[[Dict[str, str], Any], None]:
    """The edits one after the other."""
    def edit(props: Dict[str, str], model: Any) -> None:
        for one in edits:
            one(props, model)
    return edit


NAN, INF = float("nan"), float("inf")
# case: (edit, field named, the error after "<path>: ")
FORGED = {
    # the table
    "threshold_nan": (entry("threshold", value=NAN), "threshold.value",
                      f"threshold.value = nan: {DISTANCE}"),
    "resize_negative": (entry("preprocess", resize=[0, -5]), "preprocess.resize",
                        f"preprocess.resize = [0, -5]: {SIZES}"),
    "layers_100000_deep": (put(layers="[" * 100_000 + "]" * 100_000), "layers",
                           "layers is nested more than 32 levels deep"),
    "max_pixels_1e24": (put(max_pixels=str(10**24)), "max_pixels",
                        f"max_pixels = '{10**24}': {PIXELS}"),
    "grid_1000": (put(grid="[1000, 1000]"), "grid",
                  "grid = [1000, 1000]: disagrees with the graph's 'patch_scores' of shape "
                  "['batch', 16, 20]"),
    # forged numeric values
    "threshold_inf": (entry("threshold", value=INF), "threshold.value",
                      f"threshold.value = inf: {DISTANCE}"),
    "threshold_minus_inf": (entry("threshold", value=-INF), "threshold.value",
                            f"threshold.value = -inf: {DISTANCE}"),
    "threshold_minus_1e9": (entry("threshold", value=-1e9), "threshold.value",
                            f"threshold.value = -1000000000.0: {DISTANCE}"),
    "threshold_zero": (entry("threshold", value=0.0), "threshold.value",
                       f"threshold.value = 0.0: {DISTANCE}"),
    "threshold_string": (entry("threshold", value="0.5"), "threshold.value",
                         f"threshold.value = '0.5': {DISTANCE}"),
    "threshold_not_object": (put(threshold='"0.5"'), "threshold",
                             "threshold = '0.5': expected an object"),
    "scale_zero": (entry("threshold", scale=0), "threshold.scale",
                   "threshold.scale = 0: expected a finite number > 0"),
    "scale_nan": (entry("threshold", scale=NAN), "threshold.scale",
                  "threshold.scale = nan: expected a finite number > 0"),
    "std_zero": (entry("preprocess", std=[0, 0, 0]), "preprocess.std[0]",
                 f"preprocess.std[0] = 0: {STD}"),
    "std_nan": (entry("preprocess", std=[0.2, NAN, 0.2]), "preprocess.std[1]",
                f"preprocess.std[1] = nan: {STD}"),
    "mean_two_values": (entry("preprocess", mean=[0.5, 0.5]), "preprocess.mean",
                        "preprocess.mean = [0.5, 0.5]: expected three finite float32 numbers"),
    "resize_20000": (entry("preprocess", resize=[20000, 20000]), "preprocess.resize",
                     f"preprocess.resize = [20000, 20000]: {SIZES}"),
    "resize_not_the_input": (entry("preprocess", resize=[100, 100], crop=None), "input.size",
                             "input.size = [64, 80]: disagrees with preprocess, whose output "
                             "(its crop, else its resize) is [100, 100]"),
    "resize_not_the_graph": (
        both(entry("preprocess", resize=[100, 100], crop=None), entry("input", size=[100, 100])),
        "preprocess", "preprocess: its output (crop, else resize) [100, 100]: disagrees with "
        "the graph's 'images' of shape ['batch', 3, 64, 80]"),
    "max_pixels_zero": (put(max_pixels="0"), "max_pixels", f"max_pixels = '0': {PIXELS}"),
    "max_pixels_negative": (put(max_pixels="-5"), "max_pixels", f"max_pixels = '-5': {PIXELS}"),
    "unknown_entry": (put(extra="1"), "metadata",
                      "unexpected metadata entries ['extra']: the file was modified after "
                      "export, or was not written by anomaly_hooks"),
    "outputs_reordered": (put(outputs='["heatmap", "patch_scores", "image_score"]'), "outputs",
                          "outputs = '[\"heatmap\", \"patch_scores\", \"image_score\"]': "
                          "expected ['patch_scores', 'heatmap', 'image_score']"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_forged_metadata_is_refused_before_any_image(case, exports, tmp_path, capsys):
    """The runtime and ``score`` refuse the file with one error naming the field; ``score``
    exits 2 without writing results."""
    edit, field, message = FORGED[case]
    forged = forge(exports["inline"], tmp_path / f"{case}.onnx", edit)
    with pytest.raises(MetadataError) as err:
        OnnxDetector.load(forged)
    assert str(err.value) == f"{forged}: {message}"
    assert err.value.field == field
    out = tmp_path / "o"
    assert main(["score", "--model", str(forged), str(GOOD), "--out", str(out)]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert err_lines == [f"error: {forged}: {message}"]
    assert not (out / "results.json").exists()


def _flip_two_bytes(raw: bytearray, at: int) -> None:
    """Flip a low exponent bit and the sign bit of the little-endian float32 at ``at``."""
    raw[at + 2] ^= 0x01
    raw[at + 3] ^= 0x80


def _weights_offset(path: Path) -> int:
    """The offset of a float32 inside the largest initializer's bytes in the file."""
    import onnx

    model = onnx.load(str(path))
    big = max(model.graph.initializer, key=lambda t: len(t.raw_data)).raw_data
    start = path.read_bytes().find(big[:256])
    assert start > 0
    return start + 4 * 1000


def _patch_scores(path: Path) -> np.ndarray:
    import onnxruntime as ort

    x = np.random.default_rng(0).standard_normal((2, 3, 64, 80)).astype(np.float32)
    return ort.InferenceSession(str(path)).run(None, {"images": x})[0]


def test_flipped_weight_bytes_are_a_checksum_mismatch(exports, tmp_path, capsys):
    """Two flipped bits in the weights: ONNX Runtime would run the file (other scores); the
    checksum refuses it."""
    src = exports["inline"]
    raw = bytearray(src.read_bytes())
    _flip_two_bytes(raw, _weights_offset(src))
    bad = tmp_path / "flipped.onnx"
    bad.write_bytes(bytes(raw))
    assert not np.allclose(_patch_scores(bad), _patch_scores(src))  # damage ORT cannot see
    message = (f"{bad}: checksum mismatch: the file was modified or damaged after export; "
               "export it again or restore it from a backup")
    with pytest.raises(ModelFileError) as err:
        OnnxDetector.load(bad)
    assert str(err.value) == message
    assert main(["score", "--model", str(bad), str(GOOD), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


def test_the_checksum_covers_the_side_file_of_weights(exports, tmp_path):
    src = exports["external"]
    side = src.with_name("m.onnx.data")
    assert read_exported(src).meta["external_data"] == "m.onnx.data"
    model = tmp_path / "m.onnx"
    shutil.copy(src, model)
    raw = bytearray(side.read_bytes())
    _flip_two_bytes(raw, len(raw) // 2)
    (tmp_path / "m.onnx.data").write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match=rf"^{model}: checksum mismatch: the file or its "
                       r"weights file m\.onnx\.data was modified or damaged after export"):
        OnnxDetector.load(model)
    (tmp_path / "m.onnx.data").unlink()
    with pytest.raises(ModelFileError, match=rf"^{tmp_path}/m\.onnx\.data: weights file "
                       r"\(external data\) of the model not found$"):
        OnnxDetector.load(model)


def test_external_data_outside_the_model_folder_is_refused(exports, tmp_path):
    """A graph whose weights point at ``../../../../etc/passwd`` (checksum recomputed):
    ONNX Runtime refuses the path, as a ModelFileError."""
    def escape(_props: Dict[str, str], model: Any) -> None:
        for tensor in model.graph.initializer:
            for item in tensor.external_data:
                if item.key == "location":
                    item.value = "../../../../etc/passwd"

    forged = forge(exports["external"], tmp_path / "m.onnx", escape)
    with pytest.raises(ModelFileError) as err:
        OnnxDetector.load(forged)
    assert str(err.value).startswith(f"{forged}: not a loadable ONNX model (")
    assert "../../../../etc/passwd" in str(err.value)
    with pytest.raises(MetadataError, match=r"external_data = '\.\./m\.onnx\.data': expected "
                       r"the plain file name of the weights next to the model$"):
        OnnxDetector.load(forge(exports["external"], tmp_path / "n.onnx",
                                put(external_data="../m.onnx.data")))


def test_truncated_files_are_refused(exports, tmp_path):
    src = exports["inline"]
    raw = src.read_bytes()
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ModelFileError, match=rf"^{cut}: not a loadable ONNX model \(a record "
                       r"runs past the end of the file \(truncated\)\)$"):
        OnnxDetector.load(cut)
    # cut exactly before the checksum entry, the last record: 1 tag + 1 length + 76 bytes
    assert raw[-78] == 14 << 3 | 2
    unsealed = tmp_path / "unsealed.onnx"
    unsealed.write_bytes(raw[:-78])
    with pytest.raises(ModelFileError, match=rf"^{unsealed}: no checksum of its content \(the "
                       r"file was truncated or modified after export\): export it again$"):
        OnnxDetector.load(unsealed)


def test_duplicated_entries_are_refused(exports, tmp_path):
    """Two ``threshold`` entries: readers disagree on which one counts."""
    import onnx

    model = onnx.load(str(exports["inline"]))
    extra = model.metadata_props.add()
    extra.key, extra.value = "threshold", "{}"
    dup = tmp_path / "dup.onnx"
    onnx.save_model(model, str(dup))
    with pytest.raises(ModelFileError, match=r"metadata entries \['threshold'\] appear more "
                       r"than once: the file was modified after export$"):
        OnnxDetector.load(dup)


def test_a_file_replaced_while_loading_is_refused(exports, tmp_path, monkeypatch):
    """The engine opens the file again after the checksum: a file replaced in between is
    refused, not run unverified."""
    import anomaly_hooks.runtime.detector as runtime

    path = tmp_path / "m.onnx"
    shutil.copy(exports["inline"], path)
    real = runtime.open_session

    def replaced_first(p: Path, *args: Any) -> Any:
        tmp = tmp_path / "next.onnx"
        shutil.copy(exports["inline"], tmp)
        os.replace(tmp, p)
        return real(p, *args)

    monkeypatch.setattr(runtime, "open_session", replaced_first)
    with pytest.raises(ModelFileError, match=rf"^{path}: the file changed while it was being "
                       r"loaded; try again once it is complete$"):
        OnnxDetector.load(path)


def test_an_export_verifies_and_equals_its_source(exports, fitted):
    """The sealed files load; the metadata is the detector's; the checksum is the content's."""
    for kind in ("inline", "external"):
        model = read_exported(exports[kind])
        assert model.threshold == fitted.threshold_
        assert model.preprocess["std"] == tuple(fitted.preprocessor.std)
        assert model.grid == tuple(fitted.scorer_.grid) and model.input_size == (64, 80)
        assert len(model.checksum) == 64 and model.checksum == model.content.digest
    assert read_exported(exports["inline"]).checksum != read_exported(exports["external"]).checksum
    with pytest.raises(ValueError, match="already holds a checksum entry"):
        seal(exports["inline"])


def test_results_json_holds_no_nan_or_infinity(tmp_path):
    """Non-finite numbers become JSON null and empty CSV cells: strict JSON readers parse the
    results."""
    from anomaly_hooks.outputs import write_results

    rows = [{"path": "a.png", "score": NAN, "normalized_score": INF, "is_anomalous": False,
             "threshold": -INF, "anomalous_pixels": 3}]
    write_results(tmp_path, rows, [], "m.onnx", drift={"z": [1.0, NAN], "p": INF})

    def strict(token: str) -> None:
        raise AssertionError(f"{token} in results.json")

    doc = json.loads((tmp_path / "results.json").read_text(), parse_constant=strict)
    assert doc["results"][0] == {"path": "a.png", "score": None, "normalized_score": None,
                                 "is_anomalous": False, "threshold": None,
                                 "anomalous_pixels": 3}
    assert doc["drift"] == {"z": [1.0, None], "p": None}
    csv_row = (tmp_path / "results.csv").read_text().splitlines()[1]
    assert csv_row.startswith("a.png,,,False,,3")


# -- fuzzing: one rule set, both formats ------------------------------------------------
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

# where a value is put: (entry, path inside its JSON); the fields a refusal may name
TARGETS = {
    ("threshold", ("value",)): ("threshold",), ("threshold", ("scale",)): ("threshold",),
    ("threshold", ("quantile",)): ("threshold",), ("threshold", ("margin",)): ("threshold",),
    ("threshold", ("n_images",)): ("threshold",), ("threshold", ("good_max",)): ("threshold",),
    ("threshold", ("far_interval",)): ("threshold",),
    ("threshold", ("tail",)): ("threshold",),
    ("preprocess", ("std", 0)): ("preprocess",), ("preprocess", ("std", 2)): ("preprocess",),
    ("preprocess", ("mean", 1)): ("preprocess",), ("preprocess", ("std",)): ("preprocess",),
    ("preprocess", ("resize", 0)): ("preprocess", "input"),
    ("preprocess", ("crop",)): ("preprocess", "input"),
    # a layer's channels must agree with its drift block and the graph's layer-mean output
    ("layers", (0, "channels")): ("layers", "drift"), ("layers", (0,)): ("layers", "drift"),
    ("drift", ("layers",)): ("drift",), ("drift", ("layers", 0)): ("drift",),
    ("drift", ("reference", "version")): ("drift",),
    ("drift", ("reference", "reference", "window")): ("drift",),
    ("drift", ("reference", "arrays", "drift.layer1.mean", "shape")): ("drift",),
    ("grid", (1,)): ("grid",), ("input", ("size", 0)): ("input", "preprocess"),
    ("max_pixels", ()): ("max_pixels",), ("outputs", ()): ("outputs",),
}
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2 ** 70), 2 ** 70),
    st.floats(1e-6, 1e4), st.integers(1, 100),
    st.sampled_from([0, -0.0, 5e-324, 1e-39, FLOAT32_TINY, 1e-30, 0.5, 1, 64, 80, 8192, 8193,
                     1e308, 3.5e38, 2 ** 40, 2 ** 40 + 1]))
values = st.one_of(numbers, st.booleans(), st.none(), st.text(max_size=6),
                   st.lists(numbers, max_size=4),
                   st.dictionaries(st.text(max_size=3), numbers, max_size=2))


def _put(meta: Dict[str, str], key: str, path: tuple, value: Any) -> Dict[str, str]:
    """``meta`` with ``value`` at ``path`` inside the JSON entry ``key`` (``max_pixels``: the
    value's text)."""
    meta = dict(meta)
    if key == "max_pixels":
        meta[key] = value if isinstance(value, str) else json.dumps(value)
        return meta
    if not path:
        meta[key] = json.dumps(value)
        return meta
    doc = json.loads(meta[key])
    node = doc
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    meta[key] = json.dumps(doc)
    return meta


@pytest.fixture(scope="module")
def graph_io(exports):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(exports["inline"]))
    return sess.get_inputs(), sess.get_outputs()


def _accepted(meta: Dict[str, str], graph_io: Any) -> Dict[str, Any]:
    """The checks of a load short of the file: entries, then against the graph."""
    fields = parse_metadata(meta)
    check_graph(ExportedModel(path=Path("m.onnx"), meta=meta, content=OnnxContent(), **fields),
                *graph_io)
    return fields


@FUZZ
@given(target=st.sampled_from(sorted(TARGETS, key=repr)), value=values)
def test_fuzz_metadata_values_refused_by_name_or_usable(exports, graph_io, target, value):
    """Any value in any entry: refused naming that entry (or the one it must agree with), or
    accepted and then usable: a finite positive threshold and scale, finite normalised
    pixels, a normalised score in [0, 1]."""
    key, path = target
    meta = _put(read_exported(exports["inline"]).meta, key, path, value)
    try:
        fields = _accepted(meta, graph_io)
    except MetadataError as exc:
        assert exc.field.split(".")[0].split("[")[0] in TARGETS[target], (exc.field, str(exc))
        event("refused")
        return
    event("accepted")
    thr = fields["threshold"]
    assert math.isfinite(thr.value) and thr.value > 0
    assert math.isfinite(thr.scale) and thr.scale > 0
    for score in (0.0, thr.value, 10.0 * thr.value + 1.0):
        assert 0.0 <= thr.normalize(score) <= 1.0
    pre = fields["preprocess"]
    twin = NumpyPreprocessor(pre["resize"], pre["crop"], pre["mean"], pre["std"])
    if pre["resize"][0] * pre["resize"][1] <= 1 << 16:  # (a large resize is slow, not wrong)
        image = np.random.default_rng(0).random((20, 30, 3)).astype(np.float32)
        assert np.isfinite(twin(image)).all()
    assert 1 <= fields["max_pixels"] <= 1 << 40


SHARED = [t for t in TARGETS if t[0] == "threshold"] + [
    ("preprocess", ("std", 0)), ("preprocess", ("std", 2)), ("preprocess", ("mean", 1)),
    ("preprocess", ("std",))]


@pytest.fixture(scope="module")
def safetensors_meta(exports) -> Dict[str, Any]:
    from anomaly_hooks.modelfile import load_model

    return load_model(exports["safetensors"])[1]


@FUZZ
@given(target=st.sampled_from(sorted(SHARED, key=repr)), value=values)
def test_fuzz_both_formats_share_the_rules(exports, safetensors_meta, target, value):
    """A threshold or normalisation value is refused by the .onnx reader exactly when the
    .safetensors reader refuses it, naming the same field."""
    key, path = target
    onnx_meta = _put(read_exported(exports["inline"]).meta, key, path, value)
    st_meta = json.loads(json.dumps(safetensors_meta))
    st_meta[key] = json.loads(onnx_meta[key])
    if key == "preprocess":
        st_meta["config"]["preprocess"] = st_meta[key]
    fields = {}
    for name, check in (("onnx", lambda: parse_metadata(onnx_meta)),
                        ("safetensors", lambda: check_model_meta(st_meta))):
        try:
            check()
            fields[name] = None
        except MetadataError as exc:
            fields[name] = exc.field
    event("accepted" if fields["onnx"] is None else "refused")
    assert fields["onnx"] == fields["safetensors"]


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(target=st.sampled_from(sorted(TARGETS, key=repr)), value=values)
def test_fuzz_forged_files_load_or_are_refused(exports, tmp_path_factory, target, value):
    """Whole forged files through ``OnnxDetector.load``: a ModelFileError naming the file, or
    a model whose prediction has a finite score and a verdict."""
    key, path = target

    def edit(props: Dict[str, str], _model: Any) -> None:
        props.update(_put(props, key, path, value))

    forged = forge(exports["inline"], tmp_path_factory.mktemp("fuzz") / "m.onnx", edit)
    try:
        det = OnnxDetector.load(forged)
    except ModelFileError as exc:
        assert str(exc).startswith(f"{forged}: ")
        event("refused")
        return
    event("accepted")
    pred = det.predict(sorted(GOOD.iterdir())[0])
    assert math.isfinite(pred.score) and pred.is_anomalous == (pred.score > det.threshold_.value)


# -- where torch cannot be imported --------------------------------------------------------
TORCH_FREE = """
import json, sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
from anomaly_hooks.cli import main
from anomaly_hooks.errors import ModelFileError
from anomaly_hooks.runtime import OnnxDetector
from anomaly_hooks.runtime.onnxfile import seal
files, good, folder, out = json.loads(sys.argv[1])
found = {}
for name, path in files.items():
    try:
        OnnxDetector.load(path)
        found[name] = "loaded"
    except ModelFileError as exc:
        found[name] = str(exc)
found["score_exit"] = main(["score", "--model", files["threshold_nan"], folder, "--out", out])
pred = OnnxDetector.load(good).predict(folder + "/000.png")
found["good"] = [pred.score, pred.is_anomalous]
try:
    seal(good)
except ValueError as exc:
    found["seal"] = str(exc)
assert not [m for m in sys.modules if m.split(".")[0] == "torch" and sys.modules[m] is not None]
print(json.dumps(found))
"""


@pytest.mark.slow
def test_forged_files_are_refused_where_torch_cannot_be_imported(exports, fitted, tmp_path):
    """The same refusals, messages and exit code on an edge box without torch."""
    files = {case: str(forge(exports["inline"], tmp_path / f"{case}.onnx", edit))
             for case, (edit, _, _) in FORGED.items()}
    raw = bytearray(exports["inline"].read_bytes())
    _flip_two_bytes(raw, _weights_offset(exports["inline"]))
    (tmp_path / "flipped.onnx").write_bytes(bytes(raw))
    files["flipped"] = str(tmp_path / "flipped.onnx")
    args = json.dumps([files, str(exports["external"]), str(GOOD), str(tmp_path / "o")])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", TORCH_FREE, args], capture_output=True,
                         text=True, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    for case, (_, _, message) in FORGED.items():
        assert found[case] == f"{files[case]}: {message}"
    assert found["flipped"].startswith(f"{files['flipped']}: checksum mismatch: ")
    assert found["score_exit"] == 2
    assert f"error: {files['threshold_nan']}: threshold.value = nan" in out.stderr
    ref = fitted.predict(GOOD / "000.png")
    assert found["good"][0] == pytest.approx(ref.score, rel=SCORE_RTOL)  # export's parity
    assert found["good"][1] == ref.is_anomalous
    assert found["seal"].endswith("already holds a checksum entry")


def test_the_model_file_limits_are_the_configs():
    """What the config reader accepts, the model-file rules accept: the image-size limit's
    edges on both sides."""
    from anomaly_hooks import config, modelmeta

    for pixels, ok in ((1, True), (modelmeta.MAX_PIXELS, True), (0, False),
                       (modelmeta.MAX_PIXELS + 1, False)):
        overrides = [f"data.max_pixels={pixels}"]
        if ok:
            config.load_config(None, overrides)
            assert modelmeta.check_max_pixels(pixels) == pixels
        else:
            with pytest.raises(config.ConfigError):
                config.load_config(None, overrides)
            with pytest.raises(MetadataError):
                modelmeta.check_max_pixels(pixels)
