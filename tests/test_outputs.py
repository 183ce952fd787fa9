"""Output names and cells of ``score``'s results: picture names stay inside --out (relative,
clean, unique, short, apart under case-folding) and CSV cells never run as spreadsheet formulas."""
from __future__ import annotations

from pathlib import Path

import pytest

from anomaly_hooks.outputs import csv_cell, out_name


@pytest.mark.parametrize("path, root, expected", [
    ("/x.png", "/", "x"),                       # one level below /: was the absolute "/x"
    ("/data/part.png", "/", "data_part"),
    ("/data/part.png", "/data", "part"),
    ("in/good/000.png", "in", "good_000"),
    ("../../etc/passwd.png", "../..", "etc_passwd"),
    ("a/..hidden.png", "a", "hidden"),
    ("a/b c\nd\te.png", "a", "b_c_d_e"),
    ("a/caf\u00e9 \u6f22\u5b57.png", "a", "caf\u00e9_\u6f22\u5b57"),
    ("a/\udcff\udcfe.png", "a", "__"),            # undecodable bytes in a name
    ("a/....png", "a", "_"),
    ("/elsewhere/x.png", "/not/its/root", "x"),  # not under the root: its own name
])
def test_out_name_is_relative_and_clean(path, root, expected):
    assert out_name(Path(path), Path(root), set()) == expected


def test_out_names_unique_short_and_case_insensitive():
    used: set = set()
    names = [out_name(Path(p), Path("r"), used) for p in
             ("r/a.png", "r/a.jpg", "r/A.png", "r/a_2.png", "r/sub/x.png", "r/sub_x.png")]
    assert names == ["a", "a_2", "A_3", "a_2_2", "sub_x", "sub_x_2"]
    assert len({n.casefold() for n in names}) == len(names)
    long = out_name(Path("r/" + "\u00e9" * 300 + ".png"), Path("r"), used)
    assert len(long.encode("utf-8")) <= 150 and "/" not in long
    other = out_name(Path("r/" + "\u00e9" * 299 + "x.png"), Path("r"), used)
    assert other != long  # a hash of the whole name keeps long names apart


@pytest.mark.parametrize("value, cell", [
    ("=HYPERLINK(\"x\")", "'=HYPERLINK(\"x\")"), ("+1", "'+1"), ("-2+3", "'-2+3"),
    ("@SUM(A1)", "'@SUM(A1)"), ("\t=1", "'\t=1"), ("\r=1", "'\r=1"), ("plain.png", "plain.png"),
    (" =1+1", "' =1+1"), ("\n=1", "'\n=1"), ("  \n @x", "'  \n @x"),
    ("\uff1dSUM(A1)", "'\uff1dSUM(A1)"),
    ("\uff0b1", "'\uff0b1"), ("a\x00b", "a\ufffdb"), ("\x00=1", "\ufffd=1"), ("a = b", "a = b"),
    (-0.5, -0.5), (3, 3),
])
def test_csv_cells_cannot_run_as_formulas(value, cell):
    assert csv_cell(value) == cell
