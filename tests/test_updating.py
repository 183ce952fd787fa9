"""Model updates from new good images (anomaly_hooks/updating.py): PaDiM's update equals a fit
on all the images, PatchCore's bank is the merge-reduce of bank and new patches within the
configured size, the threshold, drift reference and lineage follow, refusals say what to do,
the CLI. A small seeded ResNet18 at 64 px on data/sample (first half fits, second half
updates)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SAMPLE, backbone_rtol, f32_tol, f64_tol, textured_images

from anomaly_hooks import modelfile
from anomaly_hooks.cli import main
from anomaly_hooks.config import load_config
from anomaly_hooks.detector import DESCRIPTORS_TENSOR, Detector
from anomaly_hooks.errors import FitError, NotFittedError
from anomaly_hooks.grouping import POOL
from anomaly_hooks.modelfile import (
    file_checksum,
    load_model,
    read_header,
    read_meta,
    save_model,
)
from anomaly_hooks.modelmeta import MetadataError, check_lineage
from anomaly_hooks.scorers.patchcore.coreset import coreset_size, coverage_radius

SMALL = {"backbone": {"name": "resnet18", "weights": None, "layers": None},
         "preprocess": {"resize": 72, "crop": 64},
         "data": {"batch_size": 4, "num_workers": 0}, "device": "cpu"}
N_OLD, N_NEW = 12, 12
REL_TOL = 1e-4  # float32: the brief's bound for an exact update


@pytest.fixture(scope="module")
def halves(tmp_path_factory) -> tuple[Path, Path, Path]:
    """Folders of the sample's first N_OLD good images, the next N_NEW, and all of them."""
    root = tmp_path_factory.mktemp("updating")
    goods = sorted((SAMPLE / "train" / "good").glob("*.png"))[:N_OLD + N_NEW]
    out = []
    for name, files in (("old", goods[:N_OLD]), ("new", goods[N_OLD:]), ("all", goods)):
        folder = root / name
        folder.mkdir()
        for p in files:
            shutil.copy(p, folder / p.name)
        out.append(folder)
    return tuple(out)


@pytest.fixture(scope="module")
def test_images() -> list[str]:
    """Good and defective test images, and training images (seen and unseen by either)."""
    tests = sorted(map(str, (SAMPLE / "test").rglob("*.png")))
    return tests[::3]


def cfg_for(method: str, **section):
    return load_config(None, method=method, **SMALL, **({method: section} if section else {}))


def max_relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.abs(b)))


# -- PaDiM: exact ------------------------------------------------------------------------------
@pytest.mark.parametrize("n_features, covariance, form, keep", [
    (40, "dense", "dense", True), (40, "dense", "dense", False),
    (40, "lowrank", "lowrank", True),
    # auto: 12 old images are low-rank (<= 0.4 * 50 = 20), all 24 dense: the update crosses
    (50, "auto", "dense", True)], ids=["dense", "dense-sums-only", "lowrank", "auto-crossing"])
def test_padim_update_equals_a_fit_on_all_the_images(halves, test_images, n_features,
                                                     covariance, form, keep):
    old, new, both = halves
    cfg = cfg_for("padim", n_features=n_features, covariance=covariance, keep_embeddings=keep)
    det = Detector(cfg).fit(old, progress=False)
    before = det.threshold_.value
    assert det.update(new) is det  # scikit-learn style: in place, returns self
    full = Detector(cfg).fit(both, progress=False)
    assert det.scorer_.gaussians.kind == full.scorer_.gaussians.kind == form
    assert det.scorer_.n_train == full.scorer_.n_train == N_OLD + N_NEW
    images = [*test_images, *map(str, sorted(both.glob("*.png")))]
    diff = max_relative(det.decision_function(images), full.decision_function(images))
    assert diff <= REL_TOL, diff
    thr = det.threshold_
    assert thr.n_images == N_OLD + N_NEW and thr.provenance["set_by"] == "update"
    assert thr.value != before
    if keep:
        # the model keeps its samples (low-rank: Y; dense: padim.keep_embeddings): every image
        # grouped and scored out of sample afresh, as the fit on all of them does: the same
        # scores, the same threshold
        assert thr.provenance["good"]["stored"] == 0
        np.testing.assert_allclose(thr.scores, full.threshold_.scores, rtol=REL_TOL)
        assert thr.value == pytest.approx(full.threshold_.value, rel=REL_TOL)
    else:  # the model's images keep their stored scores, the new ones leave-one-out
        assert det.scorer_.gaussians.samples is None
        assert thr.provenance["good"]["stored"] == N_OLD
        np.testing.assert_allclose(thr.scores[N_OLD:], full.threshold_.scores[N_OLD:],
                                   rtol=REL_TOL)


def test_padim_dense_update_after_save_and_load(halves, tmp_path):
    """The dense model's kept embeddings come back from the file: the update is the fit on
    every image, threshold included."""
    old, new, both = halves
    cfg = cfg_for("padim", n_features=40, covariance="dense")
    in_memory = Detector(cfg).fit(old, progress=False)
    path = in_memory.save(tmp_path / "m.safetensors")
    det = Detector.load(path)
    assert det.scorer_.gaussians.stored_samples is not None  # left in the file until needed
    det.update(new)
    full = Detector(cfg).fit(both, progress=False)
    images = sorted(map(str, both.glob("*.png")))
    scores = det.decision_function(images)
    assert max_relative(scores, full.decision_function(images)) <= REL_TOL
    np.testing.assert_allclose(det.threshold_.scores, full.threshold_.scores, rtol=REL_TOL)
    # the embeddings read from the file are the in-memory model's: the same update, bit for bit
    in_memory.update(new)
    np.testing.assert_array_equal(scores, in_memory.decision_function(images))
    assert det.threshold_.scores == in_memory.threshold_.scores
    torch.testing.assert_close(det.scorer_.gaussians.samples, full.scorer_.gaussians.samples,
                               rtol=0, atol=0)  # the images' own embeddings, in fit order
    # the grouping descriptors the file kept, joined by the new images': the fit's own
    np.testing.assert_array_equal(det.training_descriptors_, full.training_descriptors_)
    assert det.training_descriptors_.shape[0] == N_OLD + N_NEW
    # a second update on top: still the fit on every image
    det.update(textured_images(4, size=(72, 72)))
    assert det.scorer_.n_train == N_OLD + N_NEW + 4 and len(det.lineage_) == 2


def test_model_loaded_for_update_leaves_its_factors_in_the_file(halves, tmp_path,
                                                                monkeypatch):
    """``Detector.load(for_update=True)``: a dense model's factors stay in the file, never
    read by the update, which gives the model a plain load's update gives, bit for bit; a
    model so loaded that scores first reads them then (verified), scoring as loaded."""
    old, new, both = halves
    cfg = cfg_for("padim", n_features=40, covariance="dense")
    path = Detector(cfg).fit(old, progress=False).save(tmp_path / "m.safetensors")
    images = sorted(map(str, both.glob("*.png")))
    plain = Detector.load(path)
    scores_v1 = plain.decision_function(images)
    plain.update(new)
    read: list = []
    real = modelfile.StoredTensor.read
    monkeypatch.setattr(modelfile.StoredTensor, "read",
                        lambda self, out=None: read.append(self.name) or real(self, out))
    det = Detector.load(path, for_update=True)
    assert isinstance(det.scorer_.gaussians._chol, modelfile.StoredTensor)
    det.update(new)
    assert read == ["padim.dense_samples"]  # the factors were never read
    np.testing.assert_array_equal(det.decision_function(images), plain.decision_function(images))
    assert det.threshold_.value == plain.threshold_.value
    a = load_model(det.save(tmp_path / "a.safetensors"))[0]
    b = load_model(plain.save(tmp_path / "b.safetensors"))[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    scoring = Detector.load(path, for_update=True)
    np.testing.assert_array_equal(scoring.decision_function(images), scores_v1)
    assert "padim.chol" in read and isinstance(scoring.scorer_.gaussians.chol, torch.Tensor)
    # without kept embeddings the update starts from the factors: read then, the same model
    sums = Detector(cfg_for("padim", n_features=40, covariance="dense", keep_embeddings=False))
    path = sums.fit(old, progress=False).save(tmp_path / "sums.safetensors")
    plain, det = Detector.load(path), Detector.load(path, for_update=True)
    read.clear()
    plain.update(new)
    det.update(new)
    assert read == ["padim.chol"]
    np.testing.assert_array_equal(det.decision_function(images), plain.decision_function(images))


@pytest.mark.parametrize("covariance", ["dense", "lowrank"])
def test_padim_update_joins_the_model_images_as_the_merge_does(halves, tmp_path, covariance,
                                                                monkeypatch):
    """The new scorer takes a loaded model's kept embeddings in place (read from the file into
    the sample store the new images join, beside the first batch's decoding): the same model,
    threshold and descriptors, bit for bit, as the merge of the model's state with the new
    images' (the path of models that keep no embeddings), without the merge step."""
    from anomaly_hooks.scorers.padim.scorer import PadimScorer

    old, new, _ = halves
    cfg = cfg_for("padim", n_features=40, covariance=covariance)
    path = Detector(cfg).fit(old, progress=False).save(tmp_path / "m.safetensors")
    joined = Detector.load(path).update(new)
    assert "merge" not in joined.update_timings_
    monkeypatch.setattr(PadimScorer, "joins", lambda self, model: False)
    merged = Detector.load(path).update(new)
    assert "merge" in merged.update_timings_
    images = sorted(map(str, new.glob("*.png")))
    np.testing.assert_array_equal(joined.decision_function(images),
                                  merged.decision_function(images))
    assert joined.threshold_.scores == merged.threshold_.scores
    np.testing.assert_array_equal(joined.training_descriptors_, merged.training_descriptors_)
    for name, tensor in joined.scorer_.method_state()[0].items():
        torch.testing.assert_close(tensor, merged.scorer_.method_state()[0][name], rtol=0,
                                   atol=0, msg=name)


def test_padim_update_of_a_file_without_descriptors_pools_them_again(halves, tmp_path):
    """A model file without the training images' grouping descriptors (written before they
    were kept): the update pools them from the kept embeddings, with the same outcome."""
    old, new, _ = halves
    cfg = cfg_for("padim", n_features=40, covariance="dense")
    path = Detector(cfg).fit(old, progress=False).save(tmp_path / "m.safetensors")
    tensors, meta = load_model(path)
    assert tensors.pop(DESCRIPTORS_TENSOR).shape[0] == N_OLD
    older = save_model(tmp_path / "older.safetensors", tensors, meta, version=2)
    det, ref = Detector.load(older), Detector.load(path)
    assert det.training_descriptors_ is None
    det.update(new)
    ref.update(new)
    # pooled again: a mean over a cell of h w / POOL^2 positions in another summation order
    _, _, h, w = ref.scorer_.training_embeddings().shape
    cell = -(-h // POOL) * -(-w // POOL)
    scale = float(np.abs(ref.scorer_.training_embeddings().numpy()).max())
    np.testing.assert_allclose(det.training_descriptors_, ref.training_descriptors_, rtol=0,
                               atol=f32_tol(cell + 1, scale))
    assert det.threshold_.provenance["good"]["out_of_sample"] == \
        ref.threshold_.provenance["good"]["out_of_sample"]  # the same groups
    np.testing.assert_array_equal(det.threshold_.scores, ref.threshold_.scores)


# -- PatchCore: merge-reduce -------------------------------------------------------------------
def test_patchcore_update_reselects_the_bank_within_the_configured_size(halves):
    """The new bank is the greedy coreset of the current bank and the new patches.

    Tolerance of the added images' scores against a full refit's. The greedy k-center rule
    (farthest-first) covers its candidates within twice the optimal k-center radius. The
    update's candidates U (old bank and new patches) are a subset of all the patches X; the
    refit's k points cover X within r_full, so k points of U (one next to each) cover U
    within 2 r_full: the optimum on U is at most 2 r_full and the update's radius r_u at most
    4 r_full (projection_dim null: the greedy runs in the space the scores are measured in).
    An added image's patches are candidates, so its score (a convex combination of patch
    distances: bilinear upsampling, normalised Gaussian blur, then the max) is at most r_u,
    while the refit scores every training patch within r_full. Hence: every added image scores
    at most 4 x the refit's radius, and at most the update's own radius."""
    old, new, both = halves
    cfg = cfg_for("patchcore", coreset_ratio=0.1, projection_dim=None)
    det = Detector(cfg).fit(old, progress=False)
    before = det.decision_function(sorted(map(str, new.glob("*.png"))))
    old_bank = det.scorer_.bank.clone()
    det.update(new)
    full = Detector(cfg).fit(both, progress=False)
    sc = det.scorer_
    per_image = sc.grid[0] * sc.grid[1]
    assert sc.n_patches == (N_OLD + N_NEW) * per_image
    assert sc.bank.shape[0] == coreset_size(sc.n_patches, 0.1, None) == full.scorer_.bank.shape[0]
    assert sc.bank_image is not None and int(sc.bank_image.max()) < N_OLD + N_NEW
    # every bank point is an old bank point or a new patch
    new_images = sorted(map(str, new.glob("*.png")))
    emb = torch.cat([det.embed(det.prepare(new_images[i:i + 4])[0])
                     for i in range(0, N_NEW, 4)])
    new_patches = emb.permute(0, 2, 3, 1).reshape(-1, emb.shape[1])
    candidates = torch.cat([old_bank, new_patches])
    exact = "donot_use_mm_for_euclid_dist"
    assert torch.cdist(sc.bank, candidates, compute_mode=exact).amin(dim=1).max() < 1e-5
    all_emb = torch.cat([full.embed(full.prepare(sorted(map(str, both.glob("*.png")))[i:i + 4])[0])
                         for i in range(0, N_OLD + N_NEW, 4)])
    all_patches = all_emb.permute(0, 2, 3, 1).reshape(-1, all_emb.shape[1])
    r_u = coverage_radius(candidates, sc.bank)
    r_full = coverage_radius(all_patches, full.scorer_.bank)
    assert r_u <= 4 * r_full
    after = det.decision_function(new_images)
    refit = full.decision_function(new_images)
    assert after.max() <= r_u * (1 + 1e-5) and refit.max() <= r_full * (1 + 1e-5)
    assert after.max() <= 4 * r_full
    assert after.mean() < before.mean()  # they joined the bank: their scores dropped
    thr = det.threshold_
    assert thr.n_images == N_OLD + N_NEW and thr.provenance["good"]["stored"] == N_OLD
    assert thr.provenance["good"]["out_of_sample"]["scheme"].endswith("(cross-fit)")


def test_patchcore_update_scores_the_new_images_from_their_kept_patches(halves, monkeypatch):
    """The new images' out-of-sample scores come from the patches the update holds (every
    patch of each new image is a candidate), not from a second pass over the images: equal to
    the second pass's scores from the same embeddings with the same fold banks, and no image
    is read twice.

    Tolerance: each evaluation of a squared distance ``|q - b|^2`` in float32 (the search's
    dot-product form, or the exact re-ranking's differences) errs by at most
    ``(D + 2) eps (|q|^2 + |b|^2)``, so two evaluations differ by at most twice that; a
    distance by at most the square root of the squared distances' difference; the mean of
    the ``k`` smallest moves by at most the largest move of any one (sorting is 1-Lipschitz),
    plus the rounding of the ``k`` additions and the square root."""
    from anomaly_hooks import updating

    old, new, _ = halves
    det = Detector(cfg_for("patchcore", coreset_ratio=0.1)).fit(old, progress=False)
    run = updating.UpdateRun(det, new)
    with torch.inference_mode():
        scorer = run.finalize(run.accumulate())
    assert scorer.out_of_sample_made_from == N_OLD and scorer.oos_groups is not None
    fast = scorer.take_out_of_sample_scores(N_OLD)
    new_images = sorted(map(str, new.glob("*.png")))
    emb = torch.cat([det.embed(det.prepare(new_images[i:i + 4])[0])
                     for i in range(0, N_NEW, 4)])
    with torch.inference_mode():
        slow = scorer.out_of_sample_scores(emb, range(N_OLD, N_OLD + N_NEW))
    assert fast.shape == slow.shape == (N_NEW, *scorer.grid)
    patches = emb.permute(0, 2, 3, 1).reshape(-1, emb.shape[1])
    d = patches.shape[1]
    sq = float(patches.square().sum(1).max() + scorer.bank.square().sum(1).max())
    atol = (f32_tol(2 * (d + 2), sq) ** 0.5
            + f32_tol(scorer.cfg.k + 2, float(slow.max())))
    torch.testing.assert_close(fast, slow, rtol=0, atol=atol)
    assert float(fast.min()) > 0  # out of sample: no patch finds itself in its fold's bank
    assert scorer.take_out_of_sample_scores(N_OLD) is None  # handed over once

    def second_pass(*args, **kwargs):
        raise AssertionError("the update read the new images a second time")

    monkeypatch.setattr(updating, "out_of_sample_scores", second_pass)
    det.update(new)
    assert det.threshold_.n_images == N_OLD + N_NEW


def test_patchcore_count_keeps_the_bank_at_the_configured_count(halves):
    old, new, _ = halves
    det = Detector(cfg_for("patchcore", coreset_count=50)).fit(old, progress=False)
    det.update(new)
    assert det.scorer_.bank.shape[0] == 50


# -- threshold modes, drift, lineage -----------------------------------------------------------
def test_holdout_model_update_splits_the_new_images(small_cfg):
    det = Detector.from_config(small_cfg).fit(textured_images(12), progress=False)
    n_held = det.threshold_.n_images
    det.update(textured_images(8, seed=1))
    assert det.threshold_.source == "holdout"
    assert det.threshold_.n_images == n_held + 2  # 25 % of the 8 new images held out
    assert det.scorer_.n_train == 9 + 6
    assert det.lineage_[-1]["images_added"] == 6


def test_drift_reference_pools_the_new_images(halves):
    old, new, both = halves
    cfg = cfg_for("padim", n_features=40)
    det = Detector(cfg).fit(old, progress=False).update(new)
    full = Detector(cfg).fit(both, progress=False)
    ref, want = det.drift_reference_, full.drift_reference_
    assert ref.info["n_images"] == want.info["n_images"] == N_OLD + N_NEW
    assert ref.info["updates"] == 1
    for name, block in want.blocks.items():  # mean and spread of all the images: pooled exactly
        if name == "score":
            continue
        # the same images' statistics from features computed in other batches: a feature's
        # rounding is relative to the magnitudes its layer sums (conftest.backbone_rtol, r):
        # within r S, S the block's largest |mean| + spread; a mean then within r S, a spread
        # from pooled sums of squares within r S (1 + |mean| / spread); plus the float64
        # pooling's own roundings (4 a pooled image)
        r, n = backbone_rtol(), N_OLD + N_NEW
        got = ref.blocks[name]
        size = np.abs(block.mean) + block.scale
        big = float(size.max())
        pooling = f64_tol(4 * n) * size * np.maximum(1.0, size / np.maximum(block.scale, 1e-300))
        assert np.all(np.abs(got.mean - block.mean) <= r * big + pooling)
        ratio = np.divide(np.abs(block.mean), block.scale, out=np.zeros_like(block.mean),
                          where=block.scale > 0)
        bound = r * big * (1 + ratio) + pooling
        # near-constant channels are floored at 1e-3 of the median spread (each fit its own
        # floor, the pooled one mixing the old floor in): there they agree within a floor
        floor = 1e-3 * max(np.median(block.scale), np.median(got.scale)) + 1e-12
        bound = np.where(block.scale <= 2 * floor, np.maximum(bound, 2 * floor), bound)
        assert np.all(np.abs(got.scale - block.scale) <= bound)
    assert ref.blocks["score"].mean.shape == (1,) and "score:shift" in ref.thresholds
    det.drift_monitor()  # the updated reference works


def test_lineage_round_trips_and_records_the_parent(halves, tmp_path):
    old, new, _ = halves
    cfg = cfg_for("padim", n_features=40)
    parent = Detector(cfg).fit(old, progress=False).save(tmp_path / "parent.safetensors")
    assert "lineage" not in read_meta(parent)  # a fitted model's file is as before
    det = Detector.load(parent)
    assert det.lineage_ == []
    assert det.checksum() == file_checksum(parent)  # the content's checksum is the file's
    det.update(new)
    child = det.save(tmp_path / "child.safetensors")
    loaded = Detector.load(child)
    (entry,) = loaded.lineage_
    assert entry["parent_checksum"] == file_checksum(parent)
    assert entry["images_added"] == N_NEW and entry["labels_used"] == 0
    assert entry["time"].endswith("+00:00")
    assert read_meta(child)["lineage"] == loaded.lineage_
    loaded.update(textured_images(3, size=(72, 72)))
    assert [e["parent_checksum"] for e in loaded.lineage_] == [file_checksum(parent),
                                                              file_checksum(child)]
    loaded.fit(old, progress=False)  # a fit starts a new lineage
    assert loaded.lineage_ == []


@pytest.mark.parametrize("edit, field", [
    (lambda e: e.update(parent_checksum="abc"), "parent_checksum"),
    (lambda e: e.update(images_added=0), "images_added"),
    (lambda e: e.update(labels_used=-1), "labels_used"),
    (lambda e: e.update(time="yesterday"), "time"),
    (lambda e: e.update(time="2025-01-01T00:00:00"), "time"),  # no offset
    (lambda e: e.update(extra=1), "lineage[0]"),
])
def test_lineage_rules_name_the_field(edit, field):
    entry = {"parent_checksum": "0" * 64, "images_added": 3, "labels_used": 0,
             "time": "2025-01-01T00:00:00+00:00"}
    assert check_lineage([dict(entry)]) == [entry]
    edit(entry)
    with pytest.raises(MetadataError) as err:
        check_lineage([entry])
    assert field in err.value.field
    with pytest.raises(MetadataError):
        check_lineage("not a list")


# -- refusals ----------------------------------------------------------------------------------
def test_refusals_say_what_to_do(small_cfg, fitted):
    with pytest.raises(NotFittedError):
        Detector.from_config(small_cfg).update(textured_images(4))
    half = Detector.from_config(small_cfg, padim__factor_dtype="float16",
                                padim__covariance="dense").fit(textured_images(8),
                                                               progress=False)
    with pytest.raises(FitError, match="float16.*refit"):
        half.update(textured_images(4, seed=1))
    fitted.tiling = object()  # what a tiled model carries (its pipeline); refused before use
    try:
        with pytest.raises(FitError, match="tiled.*refit"):
            fitted.update(textured_images(4, seed=1))
    finally:
        fitted.tiling = None
    before = fitted.threshold_
    with pytest.raises(Exception):  # noqa: B017 (an unreadable image: the model is unchanged)
        fitted.update(["/nonexistent/image.png"])
    assert fitted.threshold_ is before and fitted.lineage_ == []


# -- CLI ---------------------------------------------------------------------------------------
@pytest.mark.slow  # ~14 s on 2 busy cores: a fit, three CLI runs, a refit
def test_cli_threshold_and_update_outputs_hold_the_embeddings(halves, tmp_path, capsys):
    """A dense model's files written by ``threshold --out`` and ``update --out`` (from models
    that left their embeddings in their files) hold every image's embeddings: an update of an
    update of the re-thresholded model is still the fit on every image."""
    old, new, both = halves
    cfg = cfg_for("padim", n_features=40, covariance="dense")
    fitted = Detector(cfg).fit(old, progress=False)
    model = fitted.save(tmp_path / "m.safetensors")
    parts = []
    for i, files in enumerate((sorted(new.glob("*.png"))[:6], sorted(new.glob("*.png"))[6:])):
        parts.append(tmp_path / f"new{i}")
        parts[-1].mkdir()
        for f in files:
            shutil.copy(f, parts[-1] / f.name)
    m2, m3, m4 = (tmp_path / f"m{i}.safetensors" for i in (2, 3, 4))
    assert main(["threshold", "--model", str(model), "--false-alarm-rate", "0.2",
                 "--out", str(m2)]) == 0
    assert torch.equal(load_model(m2)[0]["padim.dense_samples"],
                       fitted.scorer_.gaussians.samples)
    for src, part, out in ((m2, parts[0], m3), (m3, parts[1], m4)):
        assert main(["update", "--model", str(src), "--good", str(part), "--out", str(out),
                     "--quiet"]) == 0
    capsys.readouterr()
    assert tuple(load_model(m3)[0]["padim.dense_samples"].shape)[1] == N_OLD + 6
    det = Detector.load(m4)
    full = Detector(cfg).fit(both, progress=False)
    torch.testing.assert_close(det.scorer_.gaussians.samples, full.scorer_.gaussians.samples,
                               rtol=0, atol=0)  # every image's embeddings, in fit order
    images = sorted(map(str, both.glob("*.png")))
    assert max_relative(det.decision_function(images),
                        full.decision_function(images)) <= REL_TOL
    np.testing.assert_allclose(det.threshold_.scores, full.threshold_.scores, rtol=REL_TOL)


def test_cli_update(halves, tmp_path, capsys):
    old, new, _ = halves
    model = tmp_path / "m.safetensors"
    Detector(cfg_for("padim", n_features=40)).fit(old, progress=False).save(model)
    out = tmp_path / "m2.safetensors"
    assert main(["update", "--model", str(model), "--good", str(new), "--out", str(out),
                 "--quiet"]) == 0
    text = capsys.readouterr().out
    assert f"added {N_NEW} images" in text and "threshold" in text and "n_train 24" in text
    reference = Detector.load(out).drift_reference_
    assert reference.info["n_images"] == N_OLD + N_NEW
    assert (f"drift reference: updated with {N_NEW} images ({N_OLD + N_NEW} in all; the layer "
            "and input thresholds kept from the fit's calibration, the score statistic "
            f"recalibrated on {reference.info['n_scores']} out-of-sample scores)") in text
    assert text.strip().splitlines()[-1] == str(out)
    assert Detector.load(out).lineage_[0]["parent_checksum"] == file_checksum(model)
    # two folders at once
    out3 = tmp_path / "m3.safetensors"
    assert main(["update", "--model", str(out), "--good", str(new), str(old), "--out",
                 str(out3), "--quiet"]) == 0
    assert json.loads(json.dumps(read_meta(out3)["lineage"]))[-1]["images_added"] == 24
    # never over the model it reads
    assert main(["update", "--model", str(model), "--good", str(new), "--out",
                 str(model)]) == 2
    assert "--out is the --model file" in capsys.readouterr().err
    # in an older format for older services; one that cannot hold the model is refused first
    old_format = tmp_path / "m2-format2.safetensors"
    assert main(["update", "--model", str(model), "--good", str(new), "--out",
                 str(old_format), "--quiet", "--format-version", "2"]) == 0
    assert read_header(old_format)["__metadata__"]["format_version"] == "2"
    probe = sorted(map(str, new.glob("*.png")))[:2]
    np.testing.assert_array_equal(Detector.load(old_format).decision_function(probe),
                                  Detector.load(out).decision_function(probe))
    capsys.readouterr()
    assert main(["update", "--model", str(model), "--good", str(new), "--out",
                 str(tmp_path / "no.safetensors"), "--format-version", "1"]) == 2
    assert "formats 2..3" in capsys.readouterr().err
    assert not (tmp_path / "no.safetensors").exists()
    # a model without a drift reference says so
    bare = tmp_path / "bare.safetensors"
    cfg = load_config(None, method="padim", **SMALL, padim={"n_features": 40},
                      monitor={"enabled": False})
    Detector(cfg).fit(old, progress=False).save(bare)
    assert main(["update", "--model", str(bare), "--good", str(new), "--out",
                 str(tmp_path / "bare2.safetensors"), "--quiet"]) == 0
    assert ("drift reference: none in the model (refit with monitor.enabled=true to monitor "
            "drift)") in capsys.readouterr().out
