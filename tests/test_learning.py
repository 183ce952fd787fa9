"""Model updates from the service's labelled results (anomaly_hooks.learning): reading the
labelled results of both stores, the update against ``Detector.update`` on the same images, the
CLI's ``--from-results``, the refusals; and the loop end to end through a real server."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SAMPLE

from anomaly_hooks.cli import main
from anomaly_hooks.config import load_config
from anomaly_hooks.detector import Detector
from anomaly_hooks.errors import ConfigError, FitError
from anomaly_hooks.learning import labelled_results, parse_time, update_from_results
from anomaly_hooks.modelfile import read_meta
from anomaly_hooks.modelmeta import MetadataError, check_lineage
from anomaly_hooks.prediction import Verdict
from anomaly_hooks.serve.pgstore import redact_url
from anomaly_hooks.serve.results import ImageFiles, Record, SQLiteResultStore

SMALL = {"backbone": {"name": "resnet18", "weights": None, "layers": None},
         "preprocess": {"resize": 72, "crop": 64},
         "padim": {"n_features": 40, "covariance": "lowrank"},  # low-rank: a cheap update
         "data": {"batch_size": 4, "num_workers": 0}, "device": "cpu"}
T0 = 1_800_000_000.0  # the results' times: T0 + i


def _goods() -> list[Path]:
    return sorted((SAMPLE / "train" / "good").glob("*.png"))


def _defects() -> list[Path]:
    return sorted(p for p in (SAMPLE / "test").rglob("*.png") if p.parent.name != "good")


def _record(i: int, original: str | None) -> Record:
    verdict = Verdict(score=2.0, normalized_score=1.2, is_anomalous=True, threshold=1.5,
                      anomalous_pixels=10)
    return Record(time=T0 + i, request_id=f"req{i}", verdict=verdict, model_id="m",
                  model_checksum="c" * 64, model_name="default", original_path=original)


def _log(store, pictures: Path, items: list[tuple[Path | None, str | None]]) -> list[int]:
    """Record one result per ``(image, label)`` (image None: no original kept), its original
    written as the service writes it; the ids."""
    files = ImageFiles(pictures)
    ids = []
    for i, (image, label) in enumerate(items):
        rel = None
        if image is not None:
            rel = files.write(f"req{i}", T0 + i, {"original": image.read_bytes()}, "PNG")
            rel = rel["original"]
        (rid,) = store.add([_record(i, rel)])
        if label:
            store.set_label(rid, label, by="token:test")
        ids.append(rid)
    return ids


def test_labelled_results_of_both_stores(store_factory, tmp_path):
    """good / defect originals oldest first, the window on the results' times, a gone file
    skipped and counted, one never kept counted, the unlabelled left out; the lineage
    source says which results."""
    store = store_factory()
    pictures = tmp_path / "pictures"
    g, d = _goods(), _defects()
    ids = _log(store, pictures, [(g[0], "good"), (g[1], None), (d[0], "defect"),
                                 (None, "good"), (g[2], "good"), (g[3], "good"),
                                 (d[1], "defect")])
    gone = store.get(ids[5]).original_path
    (pictures / gone).unlink()
    found = labelled_results(store_factory.spec, pictures=pictures)
    assert found.good_ids == [ids[0], ids[4]] and found.defect_ids == [ids[2], ids[6]]
    assert [p.read_bytes() for p in found.good] == [g[0].read_bytes(), g[2].read_bytes()]
    assert found.missing == [ids[5]] and found.not_kept == [ids[3]] and found.skipped == 2
    source = found.lineage_source()
    assert source["kind"] == "results" and source["skipped"] == 2
    assert source["good_results"] == found.good_ids and source["since"] is None
    assert check_lineage([{"parent_checksum": "0" * 64, "images_added": 2, "labels_used": 2,
                           "time": "2026-01-01T00:00:00+00:00", "source": source}])
    if store_factory.kind == "postgres":
        assert found.store == redact_url(store_factory.spec)  # never a password
    # the window: the results recorded from T0 + 4 on
    later = labelled_results(store_factory.spec, since=T0 + 4, pictures=pictures)
    assert later.good_ids == [ids[4]] and later.defect_ids == [ids[6]]
    assert later.lineage_source()["since"].startswith("2027-01-15T08:")
    iso = labelled_results(store_factory.spec, since="2027-01-15T08:00:04Z",
                           until=T0 + 5, pictures=pictures)
    assert iso.good_ids == [ids[4]] and iso.defect_ids == []
    with pytest.raises(FitError, match="no result is labelled good since.*--since"):
        labelled_results(store_factory.spec, since=T0 + 100, pictures=pictures)


def test_refusals_say_what_to_do(store_factory, tmp_path):
    store = store_factory()
    pictures = tmp_path / "pictures"
    _log(store, pictures, [(None, "good"), (None, "defect")])
    with pytest.raises(FitError, match="1 result.s. labelled good .*kept none of their "
                       "original.*--keep-originals"):
        labelled_results(store_factory.spec, pictures=pictures)
    # from T0 + 1 on: two results labelled defect (one kept), none labelled good
    _log(store, pictures, [(_defects()[0], "defect"), (_defects()[1], "defect")])
    with pytest.raises(FitError, match=r"no result is labelled good since .* \(2 labelled "
                       r"defect\): label the false alarms"):
        labelled_results(store_factory.spec, since=T0 + 1, pictures=pictures)
    if store_factory.kind == "postgres":
        with pytest.raises(ConfigError, match="--results-dir"):
            labelled_results(store_factory.spec)


def test_unreadable_stores_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no results log"):
        labelled_results(str(tmp_path))
    with pytest.raises(ConfigError, match="no such results folder"):
        labelled_results(str(tmp_path / "nothing"))
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all, just bytes" * 100)
    with pytest.raises(ConfigError, match="junk.sqlite"):
        labelled_results(str(tmp_path / "junk.sqlite"))
    with pytest.raises(ConfigError, match="ISO 8601"):
        parse_time("yesterday")
    assert parse_time("1800000000") == parse_time("2027-01-15T08:00:00Z") == T0
    with pytest.raises(MetadataError, match="good_results"):
        check_lineage([{"parent_checksum": "0" * 64, "images_added": 2, "labels_used": 0,
                        "time": "2026-01-01T00:00:00+00:00",
                        "source": {"kind": "results", "good_results": [0]}}])


@pytest.fixture(scope="module")
def parent(tmp_path_factory) -> Path:
    """A PaDiM model of the sample's first 12 good images, saved."""
    root = tmp_path_factory.mktemp("learning")
    cfg = load_config(None, method="padim", **SMALL)
    det = Detector(cfg).fit([str(p) for p in _goods()[:12]], progress=False)
    return det.save(root / "parent.safetensors")


def test_update_from_results_is_the_update_on_those_images(parent, tmp_path):
    """The images read from the log give the model ``Detector.update`` gives with them
    (same scores), the labelled defects count as labels used, the source is in the lineage
    and round-trips through the model file (the CLI's ``--from-results``: the end-to-end
    test)."""
    results = tmp_path / "results"  # the service's layout: results.sqlite beside images/
    log_ = SQLiteResultStore(results / "results.sqlite")
    g, d = _goods(), _defects()
    _log(log_, results, [(p, "good") for p in g[12:20]] + [(d[0], "defect"), (d[1], "defect")])
    log_.close()
    det = Detector.load(parent)
    found = update_from_results(det, str(results))
    assert len(found.good) == 8 and len(found.defects) == 2
    (entry,) = det.lineage_
    assert entry["images_added"] == 8 and entry["labels_used"] == 2
    assert entry["source"]["good_results"] == found.good_ids
    reference = Detector.load(parent).update([str(p) for p in g[12:20]],
                                             defects=[str(p) for p in d[:2]])
    probe = [str(p) for p in g[20:24] + d[2:4]]
    a, b = det.decision_function(probe), reference.decision_function(probe)
    np.testing.assert_allclose(a, b, rtol=1e-6)
    assert det.threshold_.value == pytest.approx(reference.threshold_.value, rel=1e-6)
    out = det.save(tmp_path / "child.safetensors")
    assert read_meta(out)["lineage"][0]["source"] == found.lineage_source()
    assert Detector.load(out).lineage_ == det.lineage_


def test_kept_inputs_are_read_instead_of_the_originals(parent, tmp_path, capsys,
                                                       monkeypatch):
    """Results kept with their network inputs (as ``serve --keep-inputs`` writes them): the
    update reads the inputs its preprocessing made instead of decoding those originals, and
    decodes the others (an input of another preprocessing); the model is the one the
    originals give, to the bit. The CLI says how many it read."""
    import anomaly_hooks.data as data_module
    from anomaly_hooks.keptinputs import KeptImage, encode
    from anomaly_hooks.preprocess import Preprocessor

    det = Detector.load(parent)
    pre = det.preprocessor
    other = Preprocessor((80, 80), (64, 64), pre.mean, pre.std)
    results = tmp_path / "results"
    log_ = SQLiteResultStore(results / "results.sqlite")
    files = ImageFiles(results)
    g, d = _goods()[12:20], _defects()[:2]
    for i, (image, label) in enumerate([(p, "good") for p in g] + [(p, "defect") for p in d]):
        x, size = data_module.load_preprocessed(image, other if i == 1 else pre, 10 ** 8)
        rel = files.write(f"req{i}", T0 + i, {"original": image.read_bytes(),
                                              "input": encode(x, other if i == 1 else pre,
                                                              size)}, "PNG")
        (rid,) = log_.add([_record(i, rel["original"])])
        log_.set_label(rid, label, by="token:test")
    log_.close()
    found = labelled_results(str(results))
    assert all(isinstance(p, KeptImage) for p in found.good + found.defects)
    good, defects = found.items(pre)
    counts = found.kept_inputs
    assert counts == {"read": 9, "decoded": 1}
    assert not isinstance(good[1], KeptImage) and isinstance(good[0], KeptImage)
    decoded = []
    real = data_module.read_image_reduced
    monkeypatch.setattr(data_module, "read_image_reduced",
                        lambda item, *a: decoded.append(Path(item).name) or real(item, *a))
    assert update_from_results(det, str(results)).kept_inputs == counts
    assert decoded == [Path(found.good[1]).name]  # only the one made otherwise
    monkeypatch.setattr(data_module, "read_image_reduced", real)
    reference = Detector.load(parent).update([str(p) for p in g], defects=[str(p) for p in d])
    probe = [str(p) for p in _goods()[20:24] + _defects()[2:4]]
    np.testing.assert_array_equal(det.decision_function(probe),
                                  reference.decision_function(probe))
    assert det.threshold_.value == reference.threshold_.value
    out = tmp_path / "m2.safetensors"
    assert main(["update", "--model", str(parent), "--from-results", str(results),
                 "--out", str(out), "--quiet"]) == 0
    assert ("network inputs kept by the service: 9 read instead of decoding the image, 1 "
            "made otherwise") in capsys.readouterr().out


def test_cli_from_results_errors(parent, tmp_path, capsys):
    results = tmp_path / "results"
    SQLiteResultStore(results / "results.sqlite").close()
    out = str(tmp_path / "m2.safetensors")
    assert main(["update", "--model", str(parent), "--from-results", str(results),
                 "--out", out]) == 2
    assert "no result is labelled good" in capsys.readouterr().err
    assert main(["update", "--model", str(parent), "--good", str(results), "--since", "0",
                 "--out", out]) == 2
    assert "go with --from-results" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # both sources: argparse refuses
        main(["update", "--model", str(parent), "--good", "x", "--from-results", "y",
              "--out", out])
    assert not Path(out).exists()


# -- the loop, end to end through a real server ----------------------------------------------
def _tint(img: np.ndarray) -> np.ndarray:
    """The same texture on a new material: another colour (v1 flags it)."""
    return np.clip(img.astype(np.float32) * np.array([0.6, 1.0, 1.4]), 0, 255).astype(np.uint8)


def _write_pngs(folder: Path, images: list[np.ndarray], stem: str) -> list[Path]:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, img in enumerate(images):
        paths.append(folder / f"{stem}_{i:02d}.png")
        Image.fromarray(img).save(paths[-1])
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_the_line_learns_end_to_end(kind, request, tmp_path, capsys):
    """Serve v1 (fitted on one material) with --models-dir and --keep-originals (SQLite: and
    --keep-inputs); a new material's good parts raise false alarms; label them good and the
    defects defect through the HTTP API; ``anomaly-hooks update --from-results`` (reading the
    kept inputs where there are); promote v2: the labelled images and new ones like them no
    longer alarm, the defects still do; a rollback brings v1 back."""
    import httpx
    from conftest import textured_images, with_defect
    from serve_helpers import TOKEN, ServerProcess

    old = textured_images(12, size=(72, 72), seed=0)
    new = [_tint(img) for img in textured_images(12, size=(72, 72), seed=5)]
    labelled = _write_pngs(tmp_path / "line", new[:8], "new")
    alike = _write_pngs(tmp_path / "line", new[8:], "alike")
    defects = _write_pngs(tmp_path / "line", [with_defect(i) for i in
                                              textured_images(3, size=(72, 72), seed=9)]
                          + [with_defect(i) for i in new[8:10]], "defect")
    models, results = tmp_path / "models", tmp_path / "results"
    models.mkdir()
    cfg = load_config(None, method="padim", **SMALL)
    Detector(cfg).fit(old, progress=False).save(models / "v1.safetensors")
    store = ["--results-dir", str(results)] + (["--keep-inputs"] if kind == "sqlite" else [])
    spec = str(results)
    if kind == "postgres":
        spec = request.getfixturevalue("postgres_url")
        store += ["--results-db", spec]
    with ServerProcess(models / "v1.safetensors", tmp_path, "--models-dir", str(models),
                       "--token", TOKEN, "--keep-originals", "anomalous", *store) as server:
        client = httpx.Client(base_url=server.url, timeout=60,
                              headers={"Authorization": f"Bearer {TOKEN}"})

        def send(paths: list[Path]) -> list[dict]:
            out = []
            for p in paths:
                r = client.post("/v1/predict", content=p.read_bytes(),
                                headers={"Content-Type": "image/png"})
                assert r.status_code == 200, r.text
                out.append(r.json())
            return out

        since = time.time()
        first = send(labelled + defects)
        assert all(p["is_anomalous"] for p in first)  # the new material: false alarms
        for p, label in zip(first, ["good"] * len(labelled) + ["defect"] * len(defects)):
            r = client.post(f"/v1/results/{p['id']}/label", json={"label": label})
            assert r.status_code == 200 and r.json()["original_url"], r.text
        assert client.get(first[0]["original_url"]).content == labelled[0].read_bytes()
        v2 = models / "v2.safetensors"
        extra = ["--results-dir", str(results)] if kind == "postgres" else []
        assert main(["update", "--model", str(models / "v1.safetensors"), "--from-results",
                     spec, *extra, "--since", str(since), "--out", str(v2), "--quiet"]) == 0
        printed = capsys.readouterr().out
        assert (f"{len(labelled) + len(defects)} read instead of decoding" in printed) == \
            (kind == "sqlite"), printed
        r = client.post("/v1/admin/promote", json={"version": "v2.safetensors"})
        assert r.status_code == 200, r.text
        lineage = client.get("/v1/model").json()["lineage"]
        assert lineage["images_added"] == len(labelled)
        assert lineage["labels_used"] == len(defects)
        assert lineage["source"]["good"] == len(labelled) and lineage["source"]["kind"] == \
            "results" and lineage["source"]["defect"] == len(defects)
        after = send(labelled + alike + defects)
        flags = [p["is_anomalous"] for p in after]
        assert not any(flags[:len(labelled) + len(alike)]), after
        assert all(flags[len(labelled) + len(alike):]), after
        assert {p["model"]["id"] for p in after} == {r.json()["model_id"]}
        assert client.post("/v1/admin/rollback").status_code == 200
        assert send(labelled[:1])[0]["is_anomalous"]  # v1 again
        client.close()
