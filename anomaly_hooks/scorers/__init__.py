"""Scorers by method name. Importing this package registers the built-in methods."""
from anomaly_hooks.scorers.base import (NotFittedError, Scorer, available_methods, get_scorer,
                                        register)
from anomaly_hooks.scorers import padim as _padim  # noqa: F401  (registers "padim")
from anomaly_hooks.scorers import patchcore as _patchcore  # noqa: F401  (registers "patchcore")

__all__ = ["NotFittedError", "Scorer", "available_methods", "get_scorer", "register"]
