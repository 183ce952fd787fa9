"""The benchmarks: scripts run from the repository root (``python benchmarks/bench_x.py``),
sharing :mod:`benchmarks.measure`. Not part of the installed package, and nothing in
``anomaly_hooks`` imports them."""
