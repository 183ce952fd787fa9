"""Scorers by method name: one wing per method (``padim/``, ``patchcore/``), each registering
its :class:`Scorer` subclass. Importing this package registers the built-in methods."""
from anomaly_hooks.scorers.base import (
    Scorer,
    available_methods,
    get_scorer,
    on_demand_tensors,
    register,
    registered,
)

DEFAULT_METHOD = "padim"

from anomaly_hooks.scorers import padim as _padim  # noqa: E402,F401  (registers "padim")
from anomaly_hooks.scorers import patchcore as _patchcore  # noqa: E402,F401  (registers "patchcore")

__all__ = ["DEFAULT_METHOD", "Scorer", "available_methods", "get_scorer", "on_demand_tensors",
           "register", "registered"]
