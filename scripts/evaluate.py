#!/usr/bin/env python
"""Thin wrapper: `python scripts/evaluate.py ...` == `anomaly-hooks evaluate ...`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from anomaly_hooks.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["evaluate", *sys.argv[1:]]))
