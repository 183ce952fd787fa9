"""Pictures for people (anomaly_hooks.visualize): what the first colour map costs in memory."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT

# In a fresh interpreter with the cyclic garbage collector off: a caller's array must be freed
# when the caller returns, though matplotlib is first imported below it.
_CALLER_FREED = """
import gc, weakref
import numpy as np
gc.disable()
from anomaly_hooks.visualize import colorize

def caller():
    big = np.zeros(1000, dtype=np.float32)  # stands for a full-size heatmap
    colorize(np.zeros((4, 4), dtype=np.float32), 0.0, 1.0)
    return weakref.ref(big)

ref = caller()
print("freed" if ref() is None else "kept alive")
"""


def test_first_colour_map_keeps_no_caller_alive():
    """matplotlib's first import leaves reference cycles whose frames reach up the calling
    stack (pyparsing's caught exceptions): without collecting them at once, the caller's
    arrays live until the next garbage collection (scoring a 100 MP image peaked 400 MB higher
    or not, depending on when it came)."""
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, "-c", _CALLER_FREED], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "freed"
