#!/usr/bin/env python
"""Thin wrapper: `python scripts/bench_export.py ...` runs anomaly_hooks.export.bench (see its
docstring): eager PyTorch vs ONNX Runtime float32 vs int8 (vs OpenVINO): speed, peak RSS, and
the accuracy drift of int8."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from anomaly_hooks.export.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
