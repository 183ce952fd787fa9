"""PaDiM: a Gaussian per patch position (``scorer.py``), kept in an exact dense or low-rank
form (``gaussians.py``); its config section in ``config.py``."""
from anomaly_hooks.scorers.padim.scorer import PadimScorer

__all__ = ["PadimScorer"]
