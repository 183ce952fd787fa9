#!/usr/bin/env python
"""Thin wrapper: `python scripts/bench.py ...` runs anomaly_hooks.evaluation.benchmark (see its docstring)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from anomaly_hooks.evaluation.benchmark import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
