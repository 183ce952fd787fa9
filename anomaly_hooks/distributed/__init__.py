"""Scale-out on Ray (optional extra ``[ray]``): a fit sharded over actors whose mergeable partial
states (``Scorer.partial_state`` / ``merge_states`` / ``finalize_merged``) the driver merges, and
batch scoring on Ray Data with a pool of model-holding actors, exactly once per image.

    from anomaly_hooks import distributed
    det = distributed.fit("configs/padim.yaml", "data/sample", address="auto", num_workers=4)
    summary = distributed.score("model.safetensors", ["images/"], "results", num_workers=4)

Only this sub-package imports ray (and only when a function runs); nothing here branches on a
method: the scorers own their partial states.
"""
from __future__ import annotations

from typing import Any


def fit(*args: Any, **kwargs: Any) -> Any:
    """See :func:`anomaly_hooks.distributed.fitting.fit`."""
    from anomaly_hooks.distributed.fitting import fit as _fit

    return _fit(*args, **kwargs)


def score(*args: Any, **kwargs: Any) -> Any:
    """See :func:`anomaly_hooks.distributed.scoring.score`."""
    from anomaly_hooks.distributed.scoring import score as _score

    return _score(*args, **kwargs)


__all__ = ["fit", "score"]
