"""Configuration: errors name the key and what is allowed; edge values; YAML files (top level,
syntax, size and nesting guards, the shipped configs); fuzzing of YAML text and overrides."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import ROOT
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from anomaly_hooks.config import ConfigError, load_config


# ---- keys and values ---------------------------------------------------------------------
@pytest.mark.parametrize("source, overrides, kw, key, allowed", [
    ({"bogus": 1}, (), {}, "bogus", r"valid keys: method, seed"),
    (None, ["nonsense=1"], {}, "nonsense", r"valid keys: .*padim, patchcore"),
    ({"padim": {"nfeatures": 3}}, (), {}, "padim.nfeatures", r"valid keys: n_features"),
    (None, ["padim.bogus=1"], {}, "padim.bogus", r"valid keys: n_features, epsilon"),
    (None, (), {"patchcore__bogus": 1}, "patchcore.bogus", r"valid keys: local_pool"),
    ({"padim": 3}, (), {}, "padim", r"mapping of its keys \(n_features"),
    (None, ["seed=abc"], {}, "seed", r"Integer|int"),
    (None, (), {"data__batch_size": "many"}, "data.batch_size", r"Integer|int"),
    (None, ["patchcore.coreset_ratio=0"], {}, "patchcore.coreset_ratio", r"0 < ratio <= 1"),
    (None, ["patchcore.coreset_ratio=1.5"], {}, "patchcore.coreset_ratio", r"0 < ratio <= 1"),
    (None, ["preprocess.resize=100", "preprocess.crop=200"], {}, "preprocess.crop",
     r"at most the resize"),
    (None, (), {"preprocess__resize": [64, 80], "preprocess__crop": [64, 96]}, "preprocess.crop",
     r"at most the resize"),
    (None, ["data.on_error=ignore"], {}, "data.on_error", r"one of \[raise, skip\]"),
    (None, ["patchcore.knn_backend=flat"], {}, "patchcore.knn_backend", r"faiss-flat"),
    (None, ["backbone.precision=fp8"], {}, "backbone.precision", r"bfloat16"),
    (None, ["method=svm"], {}, "method", r"padim"),
])
def test_config_errors_name_key_and_allowed(source, overrides, kw, key, allowed):
    with pytest.raises(ConfigError) as err:
        load_config(source, overrides, **kw)
    msg = str(err.value)
    assert "\n" not in msg
    assert key in msg, msg
    assert re.search(allowed, msg), msg


@pytest.mark.parametrize("override, message", [
    ("threshold.margin=.inf", "threshold.margin=inf is not allowed: a finite number"),
    ("padim.epsilon=inf", "padim.epsilon=inf is not allowed: a finite number"),
    ("threshold.quantile=nan", "threshold.quantile=nan is not allowed: a finite number"),
    ("resources.memory_limit_gb=-.inf", "resources.memory_limit_gb=-inf is not allowed: a "
                                        "finite number"),
    (f"seed={2 ** 64}", f"seed={2 ** 64} is not allowed: an integer within 64 bits"),
    ("seed=-1", "seed=-1 is not allowed: an integer in [0, 2**63)"),
    (f"patchcore.k={10 ** 30}", f"patchcore.k={10 ** 30} is not allowed: an integer within 64 "
                                "bits"),
    ("device=cuda:abc", "device='cuda:abc' is not allowed: auto, cpu, cuda or cuda:N (N a "
                        "device number)"),
    ("device=cudax", "device='cudax' is not allowed"),
    ("device=cuda:-1", "device='cuda:-1' is not allowed"),
    ("data.num_workers=100000", "data.num_workers=100000 is not allowed: 0 to 256"),
    ("preprocess.resize=100000", "preprocess.resize=[100000, 100000] is not allowed: an int or "
                                 "[height, width] of ints in 1..8192"),
    ("seed=[1,", "cannot parse overrides ['seed=[1,']: "),
    ("output=${nope}", "config: "),
])
def test_config_edge_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_valid_devices_and_seeds_pass():
    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        assert load_config(None, [f"device={device}"]).device == device
    assert load_config(None, [f"seed={2 ** 63 - 1}"]).seed == 2 ** 63 - 1


# ---- config files ------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("- a\n- b\n", "the top level must be a mapping of sections (method:, backbone:, ...), not "
                   "a list"),
    ("method: padim\npadim: [unclosed\n", "cannot parse config file"),
    ("just a string\n", "the top level must be a mapping of sections (method:, backbone:, "
                         "...), not a str"),
    ("a: &x [1]\nb: *x\n", "bad key"),
])
def test_yaml_top_level_and_syntax_errors(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        load_config(path)


def test_big_config_file_and_deep_mapping_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 200_000)
    with pytest.raises(ConfigError, match=r"big.yaml is 2,000,000 bytes; the limit is 1,048,576"):
        load_config(big)
    deep: dict = {}
    node = deep
    for _ in range(100):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(ConfigError, match="the config is nested more than 32 levels deep"):
        load_config({"padim": deep})
    shared = [0] * 10
    for _ in range(8):
        shared = [shared] * 10  # 10**8 values by reference
    with pytest.raises(ConfigError, match="more than 100,000 values"):
        load_config({"backbone": {"layers": shared}})


@pytest.mark.slow
def test_deep_config_file_and_override_refused_in_a_fresh_process(tmp_path):
    """200 KB of '[' killed the interpreter (SIGSEGV in the C YAML parser): now a ConfigError,
    checked in a child process so a crash would show as a signal, not end this run."""
    (tmp_path / "deep.yaml").write_text("[" * 200_000)
    (tmp_path / "deep_block.yaml").write_text("".join(" " * i + "- a:\n" for i in range(200)))
    code = (
        "import sys\nfrom anomaly_hooks.config import load_config, ConfigError\n"
        "for src, ov in ((sys.argv[1], []), (sys.argv[2], []), (None, ['seed=' + '[' * 60000]),"
        " (None, ['padim.n_features=' + '{a: ' * 100 + '1' + '}' * 100])):\n"
        "    try:\n        load_config(src, ov)\n    except ConfigError as exc:\n"
        "        print(str(exc)[:200])\n")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "deep.yaml"),
                          str(tmp_path / "deep_block.yaml")], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr)
    lines = run.stdout.splitlines()
    assert len(lines) == 4
    assert re.fullmatch(rf"config file {re.escape(str(tmp_path / 'deep.yaml'))} is nested "
                        r"2000\d\d levels deep; the limit is 32", lines[0])
    assert re.fullmatch(rf"config file {re.escape(str(tmp_path / 'deep_block.yaml'))} is "
                        r"nested \d+ levels deep; the limit is 32", lines[1])
    assert lines[2] == (f"override {('seed=' + '[' * 35)!r}... is 60,005 characters long; the "
                        "limit is 10,000: a config is a few hundred lines at most")
    head = ("padim.n_features=" + "{a: " * 100)[:40]
    assert re.fullmatch(rf"override {re.escape(repr(head))}\.\.\. is nested 10\d levels deep; "
                        r"the limit is 32", lines[3])


def test_the_shipped_configs_pass_the_guards():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)


# ---- fuzzing -----------------------------------------------------------------------------
yaml_chars = st.sampled_from(list("[]{}:-,?&*!|>#%@`'\" \n\t.=$") + ["method", "padim", "seed",
                             "${", "}", "inf", "nan", "1e999", "0x", "~", "null", "- ", ": ",
                             "backbone", "layers", "\u00e9", "\x00"])


@fuzz_settings(80)
@given(text=st.lists(yaml_chars, max_size=60).map("".join))
@pytest.mark.slow
def test_fuzz_config_yaml_text(tmp_path, text):
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        load_config(path)
    except ConfigError as exc:
        assert str(exc)


@fuzz_settings(80)
@given(key=st.sampled_from(["seed", "device", "threshold.margin", "padim.epsilon",
                            "preprocess.resize", "backbone.layers", "data.batch_size", "bogus",
                            "padim", "a.b.c", ""]),
       value=st.lists(yaml_chars, max_size=40).map("".join))
@pytest.mark.slow
def test_fuzz_config_overrides(key, value):
    try:
        load_config(None, [f"{key}={value}"])
    except ConfigError as exc:
        assert str(exc)
