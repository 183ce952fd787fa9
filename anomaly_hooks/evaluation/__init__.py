"""Evaluation: datasets with labels and masks (``datasets``), metrics (``metrics``), the runner
that fits, scores and measures (``runner``), its HTML report (``report``), and the speed and
memory benchmark (``benchmark``). Nothing in the core pipeline imports this package."""
