"""Typed configuration (omegaconf structured configs).

A config is built from the schema below, merged with a YAML file or mapping, then with
``key=value`` overrides. Unknown keys, wrong types and values outside a choice (the
:class:`Choice` enums) are rejected by omegaconf with a one-line message that names the key;
:func:`validate_config` adds the range checks a type cannot express. The resolved config is
saved with every model.

The schema is the core sections below plus one section per registered method, each owned by
its scorer (``Scorer.config_class``, e.g. ``padim:`` from ``scorers/padim/config.py``): a new
method adds its section by registering, without touching this module.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, make_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Type, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from anomaly_hooks.choices import Choice, check, choices
from anomaly_hooks.errors import ConfigError
from anomaly_hooks.images import DEFAULT_MAX_PIXELS

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


Precision = choices("Precision", ["float32", "bfloat16", "float16"])
OnError = choices("OnError", ["raise", "skip"])


@dataclass
class BackboneConfig:
    """The CNN whose intermediate layers give the patch features."""

    name: str = "wide_resnet50_2"  # torchvision model name, or "custom" for a user nn.Module
    weights: Optional[str] = "DEFAULT"  # torchvision weights name, a local file, or null (random)
    layers: Optional[List[str]] = None  # dotted module names; null = the method's default
    precision: Precision = Precision["float32"]  # autocast of the forward (GPU)
    channels_last: bool = False  # channels-last memory format (faster convolutions on GPU)


@dataclass
class PreprocessConfig:
    """Resize (H, W) then centre crop (H, W); normalise with mean/std."""

    resize: List[int] = field(default_factory=lambda: [256, 256])
    crop: Optional[List[int]] = field(default_factory=lambda: [224, 224])
    mean: List[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: List[float] = field(default_factory=lambda: list(IMAGENET_STD))


@dataclass
class ThresholdConfig:
    """Decision threshold from good images only: quantile + margin * (quantile - median)."""

    holdout_fraction: float = 0.2  # of the training images, used only to set the threshold
    folder: Optional[str] = None  # a separate folder of good images instead of a hold-out
    quantile: float = 0.99
    margin: float = 0.5


@dataclass
class DataConfig:
    """Where the training images are and how they are read."""

    train: Optional[str] = None  # folder of good images (an MVTec root uses train/good)
    batch_size: int = 16
    num_workers: int = 2
    on_error: OnError = OnError["raise"]  # what fit does with unreadable images
    max_pixels: int = DEFAULT_MAX_PIXELS


@dataclass
class ResourcesConfig:
    """Memory guard checked before fitting."""

    memory_limit_gb: Optional[float] = None  # null = memory_fraction of the available memory
    memory_fraction: float = 0.8  # of available RAM (or free GPU memory on CUDA)


@dataclass
class CoreConfig:
    """The sections every method shares; :func:`schema` adds ``method`` and one section per
    registered method."""

    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    output: str = "models/model.safetensors"
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    threshold: ThresholdConfig = field(default_factory=ThresholdConfig)
    data: DataConfig = field(default_factory=DataConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)


@lru_cache(maxsize=1)
def schema() -> type:
    """The full config dataclass: :class:`CoreConfig`, ``method`` (a :class:`Choice` of the
    registered methods) and each method's section."""
    from anomaly_hooks.scorers import DEFAULT_METHOD, registered

    scorers = registered()
    method = choices("Method", list(scorers))
    sections = [(name, cls.config_class, field(default_factory=cls.config_class))
                for name, cls in scorers.items()]
    core = [(f.name, f.type, field(default=f.default, default_factory=f.default_factory))
            for f in fields(CoreConfig)]
    cls = make_dataclass("Config", [("method", method, field(default=method[DEFAULT_METHOD])),
                                    *core, *sections])
    cls.__module__ = __name__
    return cls


def __getattr__(name: str) -> Any:
    """``Method`` and ``Config`` exist once the scorers are registered (also lets pickle find
    them)."""
    if name == "Config":
        return schema()
    if name == "Method":
        return schema().__dataclass_fields__["method"].type
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ConfigSource = Union[str, os.PathLike, Mapping[str, Any], DictConfig, None]


def _as_pair(value: Any) -> Any:
    """Accept ``256`` for a size and turn it into ``[256, 256]``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value, value]
    return value


def _normalise_raw(raw: Any) -> Any:
    """Friendly shorthands before the typed merge (an int size means a square)."""
    if isinstance(raw, DictConfig):
        raw = to_container(raw)
    if isinstance(raw, Mapping) and isinstance(raw.get("preprocess"), Mapping):
        pre = dict(raw["preprocess"])
        for key in ("resize", "crop"):
            if key in pre:
                pre[key] = _as_pair(pre[key])
        raw = {**raw, "preprocess": pre}
    return raw


def _read_source(source: ConfigSource) -> Any:
    if source is None:
        return {}
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = OmegaConf.load(path)
        except Exception as exc:  # yaml errors carry the line number
            raise ConfigError(f"cannot parse config file {path}: {exc}") from None
        return OmegaConf.to_container(loaded, resolve=True) or {}
    return source


def _parse_overrides(overrides: Iterable[str]) -> DictConfig:
    items = list(overrides)
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (example: padim.n_features=100)")
    try:
        return OmegaConf.from_dotlist(items)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides {items}: {exc}") from None


def _merge(base: DictConfig, other: Any, what: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        msg = str(exc).splitlines()[0]
        parent = getattr(exc, "parent_node", None)
        if isinstance(exc, ConfigKeyError) and isinstance(parent, DictConfig):
            msg += f"; valid keys: {', '.join(parent.keys())}"
        elif key == "?" and isinstance(other, Mapping):  # a section given as a scalar
            for name, value in other.items():
                if isinstance(base.get(name), DictConfig) and not isinstance(value, Mapping):
                    key = name
                    msg = (f"{name} is a section: give a mapping of its keys "
                           f"({', '.join(base[name].keys())}), not {value!r}")
                    break
        raise ConfigError(f"{what}: bad key {key!r}: {msg}") from None


def load_config(
    source: ConfigSource = None,
    overrides: Sequence[str] = (),
    **kw_overrides: Any,
) -> DictConfig:
    """Build a validated config.

    Args:
        source: a YAML path, a mapping, a DictConfig or None (defaults).
        overrides: ``"key=value"`` strings (dotted keys), as on the command line.
        kw_overrides: Python overrides; nested keys use ``__`` (``padim__n_features=100``)
            or a mapping value (``padim={"n_features": 100}``).

    Returns:
        A read-only structured DictConfig.

    Raises:
        ConfigError: unknown key, wrong type, or a value outside what is allowed.
    """
    cfg = OmegaConf.structured(schema())
    cfg = _merge(cfg, _normalise_raw(_read_source(source)), "config")
    if overrides:
        cfg = _merge(cfg, _normalise_raw(_parse_overrides(overrides)), "override")
    if kw_overrides:
        nested: dict[str, Any] = {}
        for key, value in kw_overrides.items():
            parts = key.split("__")
            node = nested
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
        cfg = _merge(cfg, _normalise_raw(nested), "override")
    validate_config(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _check_size(key: str, value: Optional[List[int]]) -> None:
    if value is None:
        return
    check(len(value) == 2 and all(v >= 1 for v in value), key,
          "an int or [height, width] of positive ints", list(value))


def validate_config(cfg: DictConfig) -> None:
    """Range and cross-field checks that the schema's types cannot express; each method's
    section is checked by its scorer."""
    from anomaly_hooks.scorers import registered

    check(cfg.device == "auto" or cfg.device == "cpu" or cfg.device.startswith("cuda"),
          "device", "auto, cpu, cuda or cuda:N", cfg.device)
    pre = cfg.preprocess
    _check_size("preprocess.resize", pre.resize)
    _check_size("preprocess.crop", pre.crop)
    if pre.crop is not None:
        check(pre.crop[0] <= pre.resize[0] and pre.crop[1] <= pre.resize[1], "preprocess.crop",
              f"at most the resize {list(pre.resize)} in each dimension", list(pre.crop))
    check(len(pre.mean) == 3 and len(pre.std) == 3 and min(pre.std) > 0, "preprocess.mean/std",
          "three values each, std > 0", (list(pre.mean), list(pre.std)))
    if cfg.backbone.layers is not None:
        check(len(cfg.backbone.layers) >= 1, "backbone.layers", "at least one layer name", [])
    thr = cfg.threshold
    check(0.0 <= thr.holdout_fraction < 1.0, "threshold.holdout_fraction", "0 <= f < 1",
          thr.holdout_fraction)
    check(0.0 < thr.quantile <= 1.0, "threshold.quantile", "0 < q <= 1", thr.quantile)
    check(thr.margin >= 0, "threshold.margin", ">= 0", thr.margin)
    data = cfg.data
    check(data.batch_size >= 1, "data.batch_size", ">= 1", data.batch_size)
    check(data.num_workers >= 0, "data.num_workers", ">= 0", data.num_workers)
    check(data.max_pixels >= 1, "data.max_pixels", ">= 1", data.max_pixels)
    res = cfg.resources
    if res.memory_limit_gb is not None:
        check(res.memory_limit_gb > 0, "resources.memory_limit_gb", "> 0 or null",
              res.memory_limit_gb)
    check(0.0 < res.memory_fraction <= 1.0, "resources.memory_fraction", "0 < f <= 1",
          res.memory_fraction)
    for name, scorer in registered().items():
        scorer.validate_config(cfg[name])


def to_container(cfg: DictConfig) -> dict:
    """The resolved config as plain Python objects (JSON-serialisable)."""
    return OmegaConf.to_container(cfg, resolve=True,  # type: ignore[return-value]
                                  enum_to_str=True)
