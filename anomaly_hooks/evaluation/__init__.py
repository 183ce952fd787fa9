"""Evaluation: datasets with labels and masks (``datasets``), metrics (``metrics``), the runner
that fits, scores and measures (``runner``) and its HTML report (``report``). Nothing in the
core pipeline imports this package; the speed and memory benchmarks live outside the package,
in the repository's ``benchmarks/`` folder."""
