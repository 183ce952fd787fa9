#!/usr/bin/env python
"""Thin wrapper: `python scripts/bench_distributed.py ...` runs anomaly_hooks.distributed.bench
(see its docstring): Ray score throughput with 1 and 2 workers against plain score, the
driver's peak memory, and the merge cost of PaDiM partial states."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from anomaly_hooks.distributed.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
