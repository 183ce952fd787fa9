"""Scale-out: mergeable fit states against the single-process fit (no Ray needed),
then a local Ray (``ray.init(num_cpus=2)``) and a two-node ``ray.cluster_utils.Cluster``: fit
and score equal the single-process results, a worker killed mid-run is retried and every image
is scored exactly once; failure paths. A small seeded ResNet18 at 64 px on data/sample."""
from __future__ import annotations

import csv
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SAMPLE, f32_tol
from gaussian_bounds import accumulation_tolerances, batches

from anomaly_hooks import distributed
from anomaly_hooks.config import load_config
from anomaly_hooks.detector import Detector
from anomaly_hooks.distributed import cluster
from anomaly_hooks.errors import ConfigError, FitError
from anomaly_hooks.scorers.padim import loo
from anomaly_hooks.scorers.patchcore.coreset import coverage_radius

try:
    import ray
except ImportError:  # the [ray] extra is not installed: only the Ray-free tests run
    ray = None
needs_ray = pytest.mark.skipif(ray is None, reason="ray is not installed (pip install -e '.[ray]')")

SMALL = {"backbone": {"name": "resnet18", "weights": None, "layers": None},
         "preprocess": {"resize": 72, "crop": 64},
         "data": {"batch_size": 4, "num_workers": 0}, "device": "cpu"}
N_TRAIN = 20


def small_cfg(root: Path, method: str = "padim", **section):
    """The sample's first ``N_TRAIN`` good images in ``root``; ``section``: the method's keys."""
    train = root / "train" / "train" / "good"
    if not train.exists():
        train.mkdir(parents=True)
        for p in sorted((SAMPLE / "train" / "good").glob("*.png"))[:N_TRAIN]:
            shutil.copy(p, train / p.name)
    keys = {**SMALL, "data": {**SMALL["data"], "train": str(root / "train")}}
    return load_config(None, method=method, **keys, **({method: section} if section else {}))


def shard_fit(det: Detector, n_shards: int):
    """The sharded fit's scorer without Ray: shards fitted in turn, merged, finalised."""
    from anomaly_hooks.distributed.fitting import shard_bounds
    from anomaly_hooks.fitting import FitPlan, fit_shard

    train = [str(p) for p in FitPlan.of(det.cfg, det.cfg.data.train).train]
    bounds = shard_bounds(len(train), n_shards, det.cfg.data.batch_size)
    states = [fit_shard(det, train[lo:hi], len(train))["state"] for lo, hi in bounds]
    scorer = det.new_scorer()
    scorer.finalize_merged(scorer.merge_states(states), det.device)
    return scorer, train


def float64_gaussians(det: Detector, scorer, train) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor]:
    """Reference mean ``[P, D]`` and covariance ``[P, D, D]`` in float64 from the embeddings,
    and the embeddings ``[P, n, D]``."""
    from anomaly_hooks.data import iter_batches

    embs = [det.embed(b.images, scorer=scorer) for b in iter_batches(
        train, det.preprocessor, batch_size=4, num_workers=0, max_pixels=det.cfg.data.max_pixels)]
    x = torch.cat(embs).flatten(2).permute(2, 0, 1).double()  # [P, n, D]
    mean = x.mean(dim=1)
    xc = x - mean.unsqueeze(1)
    return mean, xc.transpose(1, 2) @ xc / (x.shape[1] - 1), x


def covariance(g) -> torch.Tensor:
    """``Sigma`` (without epsilon) of fitted Gaussians, float64."""
    if g.kind == "dense":
        chol = g.chol.double()
        eye = torch.eye(chol.shape[-1], dtype=torch.float64)
        return chol @ chol.transpose(1, 2) - 0.01 * eye
    y = g.y.double()
    return y.transpose(1, 2) @ y


# -- mergeable states, no Ray ---------------------------------------------------------------
@pytest.mark.parametrize("form", ["dense", "lowrank"])
def test_padim_merged_shards_equal_the_single_fit(tmp_path, form):
    cfg = small_cfg(tmp_path, n_features=40, covariance=form)
    det = Detector(cfg)
    single = Detector(cfg).fit(cfg.data.train, progress=False).scorer_.gaussians
    scorer, train = shard_fit(det, 3)
    merged = scorer.gaussians
    assert merged.kind == single.kind == form and scorer.n_train == len(train)
    mean64, cov64, x64 = float64_gaussians(det, scorer, train)
    mean_tol, cov_tol = accumulation_tolerances(x64, batches(len(train), cfg.data.batch_size))
    for g in (single, merged):  # both within float32 rounding of the float64 reference
        torch.testing.assert_close(g.mean.double(), mean64, rtol=0, atol=mean_tol)
        assert bool(((covariance(g) - cov64).abs() <= cov_tol).all())
    if form == "lowrank":  # the same samples in the same order: bit-identical
        assert torch.equal(single.y, merged.y) and torch.equal(single.cinv, merged.cinv)


def test_dense_merge_reshifts_exactly():
    """Shards with far-apart shifts merge to the one-accumulator sums (float64 reference)."""
    from anomaly_hooks.scorers.padim import partial
    from anomaly_hooks.scorers.padim.gaussians import GaussianAccumulator

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 60, 10, generator=gen) * 2 + torch.linspace(-50, 50, 60)[None, :, None]
    states = []
    for lo, hi in ((0, 25), (25, 40), (40, 60)):  # shards with very different means
        acc = GaussianAccumulator()
        acc.update(x[:, lo:hi])
        states.append(partial.dense_state(acc, (6, 1)))
    merged = partial.merge(states)
    g = partial.gaussians(merged, 0.01)
    x64 = x.double()
    mean = x64.mean(dim=1)
    xc = x64 - mean.unsqueeze(1)
    cov = xc.transpose(1, 2) @ xc / 59
    mean_tol, cov_tol = accumulation_tolerances(x64, [(0, 25), (25, 40), (40, 60)])  # 1 batch
    torch.testing.assert_close(g.mean.double(), mean, rtol=0, atol=mean_tol)
    assert bool(((covariance(g) - cov).abs() <= cov_tol).all())


def test_dense_states_with_samples_give_the_same_factors_however_split():
    """States that carry every image's samples (a dense update of a model that keeps its
    embeddings) make their Gaussians from the samples alone: any split merges to the one-state
    factors bit for bit, and both are the float64 reference's within float32 rounding."""
    from anomaly_hooks.scorers.padim import partial
    from anomaly_hooks.scorers.padim.gaussians import GaussianAccumulator

    gen = torch.Generator().manual_seed(1)
    n, d, eps = 24, 40, 0.01  # n < D: singular but for eps I, where rounding is amplified
    x = torch.randn(5, n, d, generator=gen) @ torch.randn(d, d, generator=gen) + 3.0

    def state(lo: int, hi: int) -> dict:
        acc = GaussianAccumulator(buffer_samples=7)  # flushes at other places per split
        acc.update(x[:, lo:hi])
        return partial.dense_state(acc, (5, 1), x[:, lo:hi])

    whole = partial.gaussians(state(0, n), eps)
    for cuts in ((0, 9, n), (0, 5, 17, n)):
        split = partial.gaussians(partial.merge([state(a, b) for a, b in zip(cuts, cuts[1:])]),
                                  eps)
        assert torch.equal(split.mean, whole.mean) and torch.equal(split.chol, whole.chol)
    x64 = x.double()
    xc = x64 - x64.mean(dim=1, keepdim=True)
    cov = xc.transpose(1, 2) @ xc / (n - 1)
    # float32: centring (2 roundings), a dot product of n terms, the division; then L L^T of
    # the factor, whose backward error is (D + 1) roundings of |L| |L|^T <= the largest
    # diagonal: all bounded by the sums of |x - mean| products
    scale = (xc.abs().transpose(1, 2) @ xc.abs() / (n - 1)).max() + eps
    assert bool(((covariance(whole) - cov).abs() <= f32_tol(n + d + 4, float(scale))).all())


def test_patchcore_one_shard_is_the_single_fit_and_shards_follow_the_rule(tmp_path):
    cfg = small_cfg(tmp_path, "patchcore", coreset_ratio=0.1)
    det = Detector(cfg)
    single = Detector(cfg).fit(cfg.data.train, progress=False).scorer_
    one, _ = shard_fit(det, 1)
    assert torch.equal(one.bank, single.bank)  # one shard keeps every patch: the same bank
    three, train = shard_fit(det, 3)
    assert three.bank.shape == single.bank.shape and three.n_patches == single.n_patches
    from anomaly_hooks.data import iter_batches

    feats = torch.cat([det.embed(b.images, scorer=single) for b in iter_batches(
        train, det.preprocessor, batch_size=4, num_workers=0, max_pixels=cfg.data.max_pixels)])
    feats = feats.permute(0, 2, 3, 1).reshape(-1, feats.shape[1])
    ratio = coverage_radius(feats, three.bank) / coverage_radius(feats, single.bank)
    assert ratio <= 1.5, ratio  # the documented rule's bound on this tiny set (bottle: README)


def test_partial_states_are_plain_data(tmp_path):
    """What Ray ships: numpy arrays and plain values, no class of ours."""
    cfg = small_cfg(tmp_path, n_features=40)
    det = Detector(cfg)
    from anomaly_hooks.fitting import fit_shard

    state = fit_shard(det, sorted(map(str, (tmp_path / "train").rglob("*.png")))[:8], 16)["state"]
    assert all(isinstance(v, (np.ndarray, int, str, tuple)) for v in state.values()), state
    assert state["samples"].shape[1] == 8  # the low-rank form: the shard's raw embeddings


def test_unreadable_training_image_is_reported_by_its_shard(tmp_path):
    """A shard lists an unreadable image (never a retry); the driver raises or skips it as
    ``Detector.fit`` does (``data.on_error``)."""
    from anomaly_hooks.fitting import fit_shard, report_unreadable

    cfg = small_cfg(tmp_path, n_features=40)
    items = sorted(map(str, (tmp_path / "train").rglob("*.png")))[:6]
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    out = fit_shard(Detector(cfg), [*items, str(broken)], 7)
    assert out["n_used"] == 6 and len(out["errors"]) == 1 and "broken.png" in out["errors"][0]
    with pytest.raises(FitError, match="broken.png"):
        report_unreadable(cfg, {"training": out["errors"], "threshold": []})


def test_stale_picture_temporaries_of_the_run_are_removed(tmp_path):
    """What an actor killed mid-write leaves (``save_png``'s temporary names) goes; files of
    other images and the user's own files stay."""
    from anomaly_hooks.distributed.scoring import remove_stale_pictures
    from anomaly_hooks.outputs import PICTURE_FOLDERS

    for sub in PICTURE_FOLDERS:
        (tmp_path / sub).mkdir()
        (tmp_path / sub / ".a[1].png.x7k2.tmp").write_bytes(b"")  # glob characters in a name
        (tmp_path / sub / ".b.png.abcd.tmp").write_bytes(b"")
        (tmp_path / sub / ".other.png.zz.tmp").write_bytes(b"")
        (tmp_path / sub / "a[1].png").write_bytes(b"png")
    assert remove_stale_pictures(tmp_path, ["a[1]", "b"]) == 2 * len(PICTURE_FOLDERS)
    for sub in PICTURE_FOLDERS:
        assert sorted(p.name for p in (tmp_path / sub).iterdir()) == [
            ".other.png.zz.tmp", "a[1].png"]


def test_ray_missing_is_a_config_error_naming_the_extra(monkeypatch):
    from anomaly_hooks.distributed.cluster import require_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"anomaly_hooks\[ray\]"):
        require_ray()


def test_cli_without_ray_says_which_extra(monkeypatch, capsys, tmp_path):
    from anomaly_hooks.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(["score", "--model", str(tmp_path / "m.safetensors"), str(tmp_path),
                 "--out", str(tmp_path / "o"), "--ray", "local:1"]) == 2
    assert "anomaly_hooks[ray]" in capsys.readouterr().err


# -- local Ray ------------------------------------------------------------------------------
@needs_ray
def test_unreachable_address_fails_fast():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if ray.is_initialized():
        pytest.skip("a Ray session is already open in this process")
    with pytest.raises(ConfigError, match=f"cannot reach a Ray cluster at 127.0.0.1:{port}"):
        cluster.connect(f"127.0.0.1:{port}")
    with pytest.raises(ConfigError, match="HOST:PORT"):
        cluster.connect("nonsense")
    with pytest.raises(ConfigError, match="local:N"):
        cluster.connect("local:zero")


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """``ray.init(num_cpus=2)``; workers see the fault-hook variables (marker absent: no fault)."""
    if ray is None:
        pytest.skip("ray is not installed (pip install -e '.[ray]')")
    marker = tmp_path_factory.mktemp("faults") / "die.marker"
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {cluster.FAULT_MARKER_ENV: str(marker),
                                       cluster.FAULT_INDEX_ENV: "1"}})
    yield marker
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("form", ["lowrank", "dense"])
def test_ray_padim_fit_equals_single_even_if_a_worker_dies(local_ray, tmp_path, form):
    cfg = small_cfg(tmp_path, n_features=40, covariance=form)
    single = Detector(cfg).fit(cfg.data.train, progress=False)
    local_ray.write_text("die once")  # the worker fitting shard 1 dies after its first batch
    dist = distributed.fit(cfg, num_workers=2)
    assert not local_ray.exists()  # a worker did die, and its shard was re-run
    g1, g2 = single.scorer_.gaussians, dist.scorer_.gaussians
    assert g1.kind == g2.kind == form and dist.fit_info_["n_train"] == single.fit_info_["n_train"]
    assert dist.threshold_.source == single.threshold_.source == "all-images"
    assert dist.fit_info_["n_threshold"] == single.fit_info_["n_threshold"] == N_TRAIN
    assert dist.drift_reference_ is not None  # the shards' statistics, merged
    if form == "lowrank":  # the same samples in the same order: the same model and threshold
        assert torch.equal(g1.mean, g2.mean) and torch.equal(g1.y, g2.y)
        assert single.threshold_ == dist.threshold_
    else:
        # two float32 fits, each within accumulation_tolerances of the float64 statistics:
        # their means within twice that; their factors L (Sigma + eps I = L L^T) within the
        # first-order perturbation bound |dL| <= |L| kappa |dSigma| / |Sigma| (2-norms; the
        # entries' bound c sqrt(Q_ii Q_jj) has the 2-norm c trace(Q)); a Mahalanobis distance
        # d = |L^-1 (x - mu)| within d |dSigma| / (2 lambda_min) -- plus the series'
        # truncation (loo.DENSE_TOLERANCE) for the leave-one-out scores
        from anomaly_hooks.fitting import FitPlan

        train = [str(p) for p in FitPlan.of(cfg, cfg.data.train).train]
        _, cov64, x64 = float64_gaussians(single, single.scorer_, train)
        mean_tol, cov_tol = accumulation_tolerances(x64, batches(len(train),
                                                                 cfg.data.batch_size))
        lam = torch.linalg.eigvalsh(cov64 + 0.01 * torch.eye(cov64.shape[-1]))  # [P, D]
        d_sigma = 2 * cov_tol.diagonal(dim1=1, dim2=2).sum(1)  # [P]: two fits' 2-norm bound
        chol_tol = float((d_sigma * lam[:, -1].sqrt() / lam[:, 0]).max())
        torch.testing.assert_close(g2.mean, g1.mean, rtol=0, atol=2 * mean_tol)
        torch.testing.assert_close(g2.chol, g1.chol, rtol=0, atol=chol_tol)
        score_rtol = float((d_sigma / (2 * lam[:, 0])).max()) + loo.DENSE_TOLERANCE
        np.testing.assert_allclose(dist.threshold_.scores, single.threshold_.scores,
                                   rtol=score_rtol)
    test = sorted((SAMPLE / "test").rglob("*.png"))[::3]
    assert [p.is_anomalous for p in single.predict(test)] == \
        [p.is_anomalous for p in dist.predict(test)]


@pytest.mark.slow
def test_ray_patchcore_fit_scores_every_image_out_of_sample(local_ray, tmp_path):
    """The actors' second pass scores each fold's images with the fold bank the driver selected
    from the other folds' merged candidates, as the same steps run in one process do; the bank
    records each point's fit-wide source image."""
    from test_crossfit import sharded

    from anomaly_hooks.distributed.fitting import shard_bounds

    cfg = small_cfg(tmp_path, "patchcore", coreset_ratio=0.1)
    dist = distributed.fit(cfg, num_workers=2)
    single = Detector(cfg).fit(cfg.data.train, progress=False)
    assert dist.scorer_.bank.shape == single.scorer_.bank.shape
    assert dist.fit_info_["shards"] == 2 and dist.threshold_.source == "all-images"
    bank_image = dist.scorer_.bank_image
    assert bank_image.shape == (dist.scorer_.bank.shape[0],)
    assert int(bank_image.min()) >= 0 and int(bank_image.max()) < N_TRAIN
    assert len(set(bank_image.tolist())) > N_TRAIN // 2  # points from both shards' images
    here = sharded(cfg, cfg.data.train, shard_bounds(N_TRAIN, 2, cfg.data.batch_size))
    # the same steps in other processes (other thread counts: other float32 summation orders):
    # a squared distance |q|^2 + |b|^2 - 2 q.b over D dimensions errs by at most
    # f32_tol(D + 3, |q|^2 + |b|^2), its square root d by that over 2 d; the embeddings' squared
    # norms bounded by twice the bank's largest (the coreset keeps the far points)
    bank = dist.scorer_.bank.double()
    norms = 2 * float((bank ** 2).sum(1).max())
    scores = np.asarray(here.threshold_.scores)
    atol = f32_tol(bank.shape[1] + 3, 2 * norms) / (2 * scores)
    assert np.all(np.abs(np.asarray(dist.threshold_.scores) - scores) <= atol)
    assert dist.threshold_.provenance == here.threshold_.provenance
    assert dist.threshold_.provenance["good"]["out_of_sample"]["scheme"].startswith("5 blocked")


TILING = {"enabled": True, "scale": 0.5, "tile": 64, "overlap": 32, "tile_batch": 9}


@pytest.mark.slow
def test_ray_fit_and_score_of_a_tiled_model(local_ray, tmp_path):
    """The driver decides the working frame from the training images and the actors embed at
    it: PaDiM (low-rank: the same samples in the same order) equals the single-process tiled
    fit exactly, frame and threshold included; the sharded score of the tiled model equals the
    plain score, heatmaps at each image's size."""
    cfg = load_config(small_cfg(tmp_path, n_features=40, covariance="lowrank"), tiling=TILING)
    single = Detector(cfg).fit(cfg.data.train, progress=False)
    dist = distributed.fit(cfg, num_workers=2)
    assert dist.fit_info_["shards"] == 2
    assert dist.preprocessor == single.preprocessor and dist.preprocessor.frame is not None
    assert dist.fit_info_["framing"] == single.fit_info_["framing"]
    assert dist.fit_info_["framing"]["tiles"]["tiles"] == [3, 3]  # 128 px frame, 64 px tiles
    g1, g2 = single.scorer_.gaussians, dist.scorer_.gaussians
    assert torch.equal(g1.mean, g2.mean) and torch.equal(g1.y, g2.y)
    assert single.threshold_ == dist.threshold_
    model = str(dist.save(tmp_path / "tiled.safetensors"))
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for p in sorted((SAMPLE / "test").rglob("*.png"))[:6]:
        shutil.copy(p, inputs / f"{p.parent.name}_{p.name}")
    from PIL import Image

    Image.open(next(inputs.iterdir())).crop((0, 0, 256, 128)).save(inputs / "zz_wide.png")
    from anomaly_hooks.cli import main

    assert main(["score", "--model", model, str(inputs), "--out", str(tmp_path / "plain")]) == 0
    summary = distributed.score(model, [str(inputs)], str(tmp_path / "ray"), num_workers=2)
    assert summary["failed"] == 0 and summary["missing"] == []
    assert csv_rows(tmp_path / "ray") == csv_rows(tmp_path / "plain")
    wide = Image.open(tmp_path / "ray" / "heatmaps" / "zz_wide.png")
    assert wide.size == (256, 128)


@pytest.mark.slow
def test_ray_patchcore_fit_of_a_tiled_model(local_ray, tmp_path):
    """PatchCore tiled on Ray: one bank over every tile of every image, the single-process
    fit's size, from both shards' images; the frame the driver decided."""
    cfg = load_config(small_cfg(tmp_path, "patchcore", coreset_ratio=0.1), tiling=TILING)
    dist = distributed.fit(cfg, num_workers=2)
    single = Detector(cfg).fit(cfg.data.train, progress=False)
    assert dist.preprocessor == single.preprocessor
    assert dist.scorer_.bank.shape == single.scorer_.bank.shape
    assert len(set(dist.scorer_.bank_image.tolist())) > N_TRAIN // 2
    test = sorted((SAMPLE / "test").rglob("*.png"))[::4]
    assert [p.is_anomalous for p in single.predict(test)] == \
        [p.is_anomalous for p in dist.predict(test)]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model")
    cfg = small_cfg(tmp, n_features=40)
    det = Detector(cfg).fit(cfg.data.train, progress=False)
    return str(det.save(tmp / "m.safetensors"))


@pytest.fixture(scope="module")
def score_inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inputs")
    for p in sorted((SAMPLE / "test").rglob("*.png"))[:14]:
        shutil.copy(p, tmp / f"{p.parent.name}_{p.name}")
    (tmp / "zz_broken.png").write_bytes(b"not an image")
    return tmp


def plain_score(model: str, inputs: Path, out: Path) -> list:
    from anomaly_hooks.cli import main

    assert main(["score", "--model", model, str(inputs), "--out", str(out)]) == 1  # one broken
    return csv_rows(out)


def csv_rows(out: Path) -> list:
    with open(out / "results.csv") as fh:
        return [{k: v.replace(str(out), "OUT") for k, v in r.items()} for r in csv.DictReader(fh)]


@pytest.mark.slow
def test_ray_score_equals_plain_score_with_a_kill(local_ray, small_model, score_inputs,
                                                  tmp_path):
    want = plain_score(small_model, score_inputs, tmp_path / "plain")
    local_ray.write_text("die once")  # the actor scoring input 1 dies before scoring it
    summary = distributed.score(small_model, [str(score_inputs)], str(tmp_path / "ray"),
                                num_workers=2)
    assert not local_ray.exists()  # an actor did die
    assert summary["rows_from_retries"] > 0  # ... and its batch was re-run
    assert summary["duplicates_dropped"] == 0 and summary["missing"] == []
    assert csv_rows(tmp_path / "ray") == want  # every image once, same order, same scores
    assert summary["failed"] == 1 and "zz_broken" in summary["failures"][0]
    ray_json = json.loads((tmp_path / "ray" / "results.json").read_text())
    plain_json = json.loads((tmp_path / "plain" / "results.json").read_text())
    # the same failures (PIL's message holds a file descriptor number: compare the paths)
    assert [f.split(": ")[0] for f in ray_json["failures"]] == \
        [f.split(": ")[0] for f in plain_json["failures"]]
    assert len(ray_json["results"]) == len(plain_json["results"]) == 14
    assert not list((tmp_path / "ray").rglob("*.tmp"))  # nothing half-written is left
    for sub in ("heatmaps", "overlays", "masks"):
        names = sorted(os.listdir(tmp_path / "plain" / sub))
        assert sorted(os.listdir(tmp_path / "ray" / sub)) == names
        for n in names:
            assert (tmp_path / "plain" / sub / n).read_bytes() == \
                (tmp_path / "ray" / sub / n).read_bytes()


@pytest.mark.slow
def test_poison_image_is_reported_not_retried_forever(local_ray, small_model, score_inputs,
                                                       tmp_path):
    """Input 1 kills every process that scores it: its batch is tried whole twice, then image
    by image; input 1 is reported, every other image is scored once."""
    local_ray.write_text("always")
    try:
        summary = distributed.score(small_model, [str(score_inputs)], str(tmp_path),
                                    num_workers=2, write_pngs=False)
    finally:
        local_ray.unlink()
    rows = csv_rows(tmp_path)
    assert len(rows) == len({r["path"] for r in rows}) == summary["images"] - 2
    died = [f for f in summary["failures"] if "worker process died" in f]
    assert len(died) == 1 and sorted(score_inputs.iterdir())[1].name in died[0]
    assert summary["missing"] == [] and summary["failed"] == 2  # + the broken file


@pytest.mark.slow
def test_cli_fit_and_score_on_ray(local_ray, small_model, score_inputs, tmp_path, capsys):
    from anomaly_hooks.cli import main

    cfg = small_cfg(tmp_path, n_features=40, covariance="lowrank")
    cfg_path = tmp_path / "cfg.yaml"
    from omegaconf import OmegaConf

    OmegaConf.save(cfg, cfg_path)
    assert main(["fit", "--config", str(cfg_path), "--output", str(tmp_path / "m.safetensors"),
                 "--ray", "--workers", "2", "--quiet"]) == 0
    single = Detector(cfg).fit(cfg.data.train, progress=False)
    fitted = Detector.load(tmp_path / "m.safetensors")
    assert torch.equal(fitted.scorer_.gaussians.y, single.scorer_.gaussians.y)
    assert main(["score", "--model", small_model, str(score_inputs), "--out",
                 str(tmp_path / "out"), "--ray", "--workers", "2", "--no-images"]) == 1
    assert "scored 14 image(s) on 2 Ray worker(s)" in capsys.readouterr().out
    assert len(csv_rows(tmp_path / "out")) == 14


@pytest.mark.slow
@needs_ray
@pytest.mark.parametrize("config", ["configs/padim.yaml", "configs/patchcore.yaml"])
def test_readme_ray_commands_on_the_default_configs(config, tmp_path):
    """The README's commands, as a user types them, in fresh processes on the shipped configs
    (only the backbone made small): the sharded fit with the default
    ``threshold.mode: all-images``, then a Ray score of the test folder with the model."""
    import subprocess

    model = tmp_path / "m.safetensors"
    small = ["backbone.name=resnet18", "preprocess.resize=72", "preprocess.crop=64",
             "data.num_workers=0", f"output={model}",
             *(["padim.n_features=100"] if "padim" in config else [])]  # resnet18's paper d
    fit = subprocess.run([sys.executable, "-m", "anomaly_hooks.cli", "fit", "--config", config,
                          "--ray", "local:2", "--workers", "2", "--quiet", *small],
                         capture_output=True, text=True, timeout=600)
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "every good image in the model, scored out of sample" in fit.stdout + fit.stderr
    det = Detector.load(model)
    assert det.threshold_.source == "all-images" and det.drift_reference_ is not None
    assert det.fit_info_["n_threshold"] == det.fit_info_["n_train"] == 60
    out = tmp_path / "o"
    score = subprocess.run([sys.executable, "-m", "anomaly_hooks.cli", "score", "--model",
                            str(model), str(SAMPLE / "test"), "--ray", "local:2", "--no-images",
                            "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert score.returncode == 0, score.stderr[-3000:]
    assert "scored 44 image(s) on 2 Ray worker(s)" in score.stdout
    rows = csv_rows(out)
    # the single-process batches, in the same order: the same scores
    want = det.decision_function([r["path"] for r in rows])
    assert [float(r["score"]) for r in rows] == want.tolist()


@pytest.mark.slow
def test_ray_score_parquet(local_ray, small_model, score_inputs, tmp_path):
    import pyarrow.parquet as pq

    summary = distributed.score(small_model, [str(score_inputs)], str(tmp_path), num_workers=1,
                                fmt="parquet", write_pngs=False)
    table = pq.read_table(tmp_path / "results.parquet")
    assert table.column("idx").to_pylist() == list(range(summary["images"]))
    assert summary["scored"] == summary["images"] - 1
    assert "zz_broken" in json.loads((tmp_path / "failures.json").read_text())[0]


# -- two nodes ------------------------------------------------------------------------------
@pytest.mark.slow
@needs_ray
def test_two_node_cluster_fit_and_score(small_model, score_inputs, tmp_path):
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes.add_node(num_cpus=1)
    try:
        ray.init(address=nodes.address, log_to_driver=False)
        nodes.wait_for_nodes()
        cfg = small_cfg(tmp_path / "fit", n_features=40, covariance="lowrank")
        dist = distributed.fit(cfg, num_workers=2)
        single = Detector(cfg).fit(cfg.data.train, progress=False)
        assert torch.equal(dist.scorer_.gaussians.y, single.scorer_.gaussians.y)
        summary = distributed.score(small_model, [str(score_inputs)], str(tmp_path / "ray"),
                                    num_workers=2, write_pngs=False)
        assert summary["scored"] == summary["images"] - 1 and summary["missing"] == []
        assert len(summary["pids"]) == 2
    finally:
        ray.shutdown()
        nodes.shutdown()


def test_unmergeable_scorer_is_a_fit_error():
    from anomaly_hooks.scorers.base import Scorer

    class Plain(Scorer):  # a third-party scorer without partial states
        method = "plain"
        memory_parts = create = from_state = partial_fit = finalize = score = None
        method_state = None

    Plain.__abstractmethods__ = frozenset()
    with pytest.raises(FitError, match="plain has no mergeable fit state"):
        Plain(None).begin_shard(10, 5)


def test_patchcore_merge_marks_the_images_whose_every_patch_it_holds():
    """A shard state holding every patch of its images (in image order) is complete; the merge
    records the first image of the complete tail (an update's new images after the current
    bank), none where the last state was reduced to its share."""
    from types import SimpleNamespace

    from anomaly_hooks.scorers.patchcore import partial

    cfg = SimpleNamespace(coreset_ratio=0.1, coreset_count=None, projection_dim=None)
    grid, per = (2, 3), 6
    gen = torch.Generator().manual_seed(0)

    def shard(n: int, n_total: int) -> dict:
        return partial.shard_state(torch.randn(n * per, 4, generator=gen), cfg, 0, n, n_total,
                                   grid)

    whole, reduced = shard(5, 5), shard(2, 40)
    assert whole["complete_from"] == 0 and reduced["complete_from"] is None
    assert reduced["features"].shape[0] < 2 * per
    bank = {**reduced, "complete_from": None}  # a current bank: a subset of its images' patches
    assert partial.merge([bank, whole])["complete_from"] == 2
    assert partial.merge([whole, shard(3, 3)])["complete_from"] == 0
    assert partial.merge([whole, reduced])["complete_from"] is None
    merged = partial.merge([reduced, whole, shard(4, 4)])
    assert merged["complete_from"] == 2 and merged["n_train"] == 11
    # the tail's rows end the merged features, every patch of images 2..10 in image order
    assert np.array_equal(merged["features"][-9 * per:],
                          np.concatenate([whole["features"], merged["features"][-4 * per:]]))


def test_a_workers_shards_and_scores_run_as_jobs_that_keep_freed_memory(monkeypatch, small_cfg):
    """The actor's work, called directly (no Ray): each shard and out-of-sample pass inside
    :func:`anomaly_hooks.heap.keep_freed_memory`, as ``Detector.fit`` is."""
    from anomaly_hooks import heap
    from anomaly_hooks.distributed import fitting as dfit

    if not heap.enabled():
        pytest.skip("glibc's malloc only")
    seen = []
    monkeypatch.setattr(dfit, "fit_shard", lambda *a, **k: seen.append(heap.active()) or {})
    monkeypatch.setattr(dfit, "out_of_sample_scores",
                        lambda *a, **k: seen.append(heap.active()) or [])
    monkeypatch.setattr(dfit, "scorer_from_payload", lambda det, payload: None)
    threads = torch.get_num_threads()
    try:
        worker = dfit.FitWorker(small_cfg, "cpu", threads)  # sets the process's threads
        worker.fit_shard([], 0, 0)
        worker.out_of_sample(None, [], [])
    finally:
        torch.set_num_threads(threads)
    assert seen == [True, True]
    assert not heap.active()
