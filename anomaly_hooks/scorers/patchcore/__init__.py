"""PatchCore: a coreset memory bank (``coreset.py``) searched for nearest neighbours
(``knn.py``) by the scorer (``scorer.py``); its config section in ``config.py``."""
from anomaly_hooks.scorers.patchcore.scorer import PatchCoreScorer

__all__ = ["PatchCoreScorer"]
