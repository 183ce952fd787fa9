"""Building blocks of config schemas, shared by the core config and each method's section:
:class:`Choice` enums (omegaconf rejects a value outside them and names the key) and
:func:`check` for the range rules a type cannot express. No dependency but ``errors``."""
from __future__ import annotations

import sys
from enum import Enum
from typing import Any, Sequence, Type

from anomaly_hooks.errors import ConfigError


class Choice(str, Enum):
    """A config value from a fixed set: compares equal to, and prints as, its string."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        return repr(str(self.value))


def choices(name: str, values: Sequence[str]) -> Type[Choice]:
    """A :class:`Choice` enum whose names are its values (omegaconf matches by name), owned by
    the calling module (so that pickle finds it there)."""
    module = sys._getframe(1).f_globals["__name__"]
    return Choice(name, [(v, v) for v in values], module=module)  # type: ignore[call-arg]


def check(cond: bool, key: str, allowed: str, value: Any) -> None:
    """Raise a :class:`ConfigError` naming ``key`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{key}={value!r} is not allowed: {allowed}")
