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

import math
import os
import re
from dataclasses import dataclass, field, fields, make_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from anomaly_hooks.calibration import TAILS
from anomaly_hooks.choices import check, choices
from anomaly_hooks.errors import ConfigError
from anomaly_hooks.framing import IMAGENET_MEAN, IMAGENET_STD, MAX_SIDE
from anomaly_hooks.images import DEFAULT_MAX_PIXELS
from anomaly_hooks.modelmeta import MAX_DEPTH, MAX_PIXELS
from anomaly_hooks.monitor.config import MonitorConfig, validate_monitor_config
from anomaly_hooks.operating import OBJECTIVES
from anomaly_hooks.tiling.config import TilingConfig
from anomaly_hooks.tiling.config import validate as validate_tiling

Precision = choices("Precision", ["float32", "bfloat16", "float16"])
OnError = choices("OnError", ["raise", "skip"])
ThresholdMode = choices("ThresholdMode", ["all-images", "holdout"])
Tail = choices("Tail", list(TAILS))  # the tail models of calibration
Objective = choices("Objective", list(OBJECTIVES))  # operating.OBJECTIVES


@dataclass
class BackboneConfig:
    """The CNN whose intermediate layers give the patch features."""

    name: str = "wide_resnet50_2"  # torchvision model name, or "custom" for a user nn.Module
    weights: Optional[str] = "DEFAULT"  # torchvision weights name, a local file, or null (random)
    layers: Optional[List[str]] = None  # dotted module names; null = the method's default
    precision: Precision = Precision["float32"]  # autocast of the forward (GPU)
    # channels-last memory format; null: on CPUs (1.2-1.4 x faster convolutions there),
    # not on GPUs (devices.channels_last_for)
    channels_last: Optional[bool] = None
    # fold each BatchNorm into the convolution that feeds it alone (anomaly_hooks.fusion): the
    # same features to float32 rounding, 1.1-1.3 x faster forward passes on CPUs
    fold_batchnorm: bool = True
    # fold a convolution's symmetric zero-padding layer into its own padding (EfficientNet's
    # "same" padding), and run activations whose input nothing else reads in place: the same
    # features, EfficientNet-Lite0's backbone 1.45 x as fast on CPUs (anomaly_hooks.fusion)
    fold_padding: bool = True
    inplace_activations: bool = True


@dataclass
class PreprocessConfig:
    """Resize (H, W) then centre crop (H, W); normalise with mean/std. With ``tiling.enabled``
    the working frame replaces the resize and crop (the image's own aspect, the whole image
    unless ``tiling.crop``); mean and std still apply."""

    resize: List[int] = field(default_factory=lambda: [256, 256])
    crop: Optional[List[int]] = field(default_factory=lambda: [224, 224])
    mean: List[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: List[float] = field(default_factory=lambda: list(IMAGENET_STD))


@dataclass
class ThresholdConfig:
    """Decision threshold from good images only (docs/threshold.md)."""

    # all-images: fit on every good image, score each as if unseen (PaDiM: exact leave-one-out;
    # PatchCore: nearest bank point of another image); holdout: keep holdout_fraction of them
    # out of the model and score those
    mode: ThresholdMode = ThresholdMode["all-images"]
    holdout_fraction: float = 0.2  # of the training images (mode=holdout only)
    folder: Optional[str] = None  # a separate folder of good images instead (either mode)
    # all-images: which images are left out together when scored out of sample (grouping.py):
    # a regex on the file names (the same match = one physical part), and near-duplicates
    # closer than this fraction of the median distance between two training images (null: off)
    groups: Optional[str] = None
    near_duplicates: Optional[float] = 0.5
    folds: Optional[int] = None  # null: the method's own (PaDiM: none, PatchCore: 5 folds)
    # where the threshold goes: far (the false-alarm rate below, good images only), f1 or
    # recall (operating points from labelled defects, operating.py)
    objective: Objective = Objective["far"]
    defects: Optional[str] = None  # folder of labelled defective images (f1, recall; far: recall)
    target_recall: Optional[float] = None  # objective recall
    prevalence: Optional[float] = None  # objective f1: share of defective parts (null: as given)
    false_alarm_rate: Optional[float] = 0.01  # target rate; null = quantile + margin below
    # auto: the finite-sample (conformal) rule where the good images support the rate, else the
    # Gumbel tail (calibration.py)
    tail: Tail = Tail["auto"]
    quantile: float = 0.99  # with false_alarm_rate: null
    margin: float = 0.5


@dataclass
class DataConfig:
    """Where the training images are and how they are read."""

    train: Optional[str] = None  # folder of good images (an MVTec root uses train/good)
    batch_size: int = 16
    num_workers: int = 2  # decoding threads of fit, predict and score (0: the caller's thread)
    worker_processes: bool = False  # decode in DataLoader worker processes instead of threads
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
    tiling: TilingConfig = field(default_factory=TilingConfig)  # high-resolution inspection
    threshold: ThresholdConfig = field(default_factory=ThresholdConfig)
    data: DataConfig = field(default_factory=DataConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)  # drift reference


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


@lru_cache(maxsize=1)
def _defaults() -> DictConfig:
    """The schema's defaults as a structured DictConfig, built once (9 of a config's 13 ms)
    and never changed: ``OmegaConf.merge`` merges into a copy of its first argument."""
    return OmegaConf.structured(schema())


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
        raw = _resolved(raw, "config")
    if isinstance(raw, Mapping) and isinstance(raw.get("preprocess"), Mapping):
        pre = dict(raw["preprocess"])
        for key in ("resize", "crop"):
            if key in pre:
                pre[key] = _as_pair(pre[key])
        raw = {**raw, "preprocess": pre}
    if isinstance(raw, Mapping) and isinstance(raw.get("tiling"), Mapping) \
            and "tile" in raw["tiling"]:
        raw = {**raw, "tiling": {**raw["tiling"], "tile": _as_pair(raw["tiling"]["tile"])}}
    return raw


# Limits checked before any text reaches the YAML parser (libyaml recurses in C: a 200 KB file
# of "[" overflows the C stack and kills the process) and before a mapping reaches omegaconf.
MAX_CONFIG_BYTES = 1 << 20  # a config file
MAX_OVERRIDE_CHARS = 10_000  # one key=value override
MAX_OVERRIDES = 1_000
MAX_NODES = 100_000  # values in a config
INT64 = (-(1 << 63), (1 << 63) - 1)
DEVICE_RE = re.compile(r"(auto|cpu|cuda(:[0-9]{1,4})?)\Z")


def _text_depth(text: str) -> int:
    """An estimate (never much below the truth) of the nesting depth of YAML ``text``:
    open flow brackets plus block levels (indentation changes and leading ``- `` / ``? ``
    markers). Brackets inside quotes count too: the estimate errs on the deep side."""
    deepest = flow = 0
    indents = [-1]
    for line in text.splitlines():
        body = line.lstrip(" \t")
        if flow == 0 and body and not body.startswith("#"):
            column = len(line) - len(body)
            while indents[-1] >= column:
                indents.pop()
            indents.append(column)
            markers = len(body) - len(body.lstrip("-? \t").lstrip())
            block = len(indents) - 1 + body[:markers].count("-") + body[:markers].count("?")
        else:
            block = len(indents) - 1
        deepest = max(deepest, block)
        for ch in line:
            if ch in "[{":
                flow += 1
                deepest = max(deepest, block + flow)
            elif ch in "]}":
                flow = max(0, flow - 1)
    return deepest


def _check_text(text: str, what: str, limit: int) -> None:
    """Refuse YAML text too long or too deeply nested to parse safely."""
    if len(text) > limit:
        raise ConfigError(f"{what} is {len(text):,} characters long; the limit is {limit:,}: "
                          "a config is a few hundred lines at most")
    depth = _text_depth(text)
    if depth > MAX_DEPTH:
        raise ConfigError(f"{what} is nested {depth} levels deep; the limit is {MAX_DEPTH}")


def _check_structure(obj: Any, what: str) -> None:
    """Refuse a (parsed or given) config structure nested deeper than :data:`MAX_DEPTH` or with
    more than :data:`MAX_NODES` values (walked without recursion; shared or cyclic
    references count at each use, so they cannot hide)."""
    stack = [(obj, 0)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if depth > MAX_DEPTH or nodes > MAX_NODES:
            raise ConfigError(f"{what} is nested more than {MAX_DEPTH} levels deep or holds "
                              f"more than {MAX_NODES:,} values")
        if isinstance(node, DictConfig):
            node = OmegaConf.to_container(node, resolve=False)
        if isinstance(node, Mapping):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)


def _read_source(source: ConfigSource) -> Any:
    if source is None:
        return {}
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {path} is {size:,} bytes; the limit is "
                              f"{MAX_CONFIG_BYTES:,}: a config is a few hundred lines at most")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        _check_text(text, f"config file {path}", MAX_CONFIG_BYTES)
        try:
            top = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
            if top is not None and not isinstance(top, dict):
                raise ConfigError(f"config file {path}: the top level must be a mapping of "
                                  "sections (method:, backbone:, ...), not a "
                                  f"{type(top).__name__}")
            loaded = OmegaConf.create(text) if top is not None else OmegaConf.create({})
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 (yaml errors carry the line number)
            raise ConfigError(f"cannot parse config file {path}: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                              ) from None
        return _resolved(loaded, f"config file {path}")
    if isinstance(source, DictConfig):
        return source
    if not isinstance(source, Mapping):
        raise ConfigError(f"a config is a YAML path, a mapping or a DictConfig, not a "
                          f"{type(source).__name__}")
    _check_structure(source, "the config")
    return source


def _resolved(cfg: Any, what: str) -> Any:
    """Plain containers with interpolations resolved (an unresolvable one is a ConfigError)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True) or {}
    except (OmegaConfBaseException, ValueError, RecursionError) as exc:
        raise ConfigError(f"{what}: {str(exc).splitlines()[0]}") from None


def _parse_overrides(overrides: Iterable[str]) -> DictConfig:
    items = list(overrides)
    if len(items) > MAX_OVERRIDES:
        raise ConfigError(f"{len(items):,} overrides; the limit is {MAX_OVERRIDES:,}")
    for item in items:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (example: padim.n_features=100)")
        _check_text(item, f"override {item[:40]!r}...", MAX_OVERRIDE_CHARS)
    try:
        return OmegaConf.from_dotlist(items)
    except Exception as exc:  # noqa: BLE001 (omegaconf's and the YAML parser's errors)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"cannot parse overrides {items}: {first}") from None


_INTERPOLATION = re.compile(r"(\\*)\$\{")


def literal(container: Any) -> Any:
    """``container`` with every string escaped so that omegaconf reads it literally: a
    ``${...}`` in a value (a stored, already resolved config) stays text, never an
    interpolation that would read the environment or other keys on load.

    Raises:
        ConfigError: a structure too deep or too large to be a config.
    """
    _check_structure(container, "the stored config")
    return _escaped(container)


def _escaped(container: Any) -> Any:
    if isinstance(container, str):
        return _INTERPOLATION.sub(lambda m: m.group(1) * 2 + "\\${", container)
    if isinstance(container, Mapping):
        return {k: _escaped(v) for k, v in container.items()}
    if isinstance(container, (list, tuple)):
        return [_escaped(v) for v in container]
    return container


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
    cfg = _merge(_defaults(), _normalise_raw(_read_source(source)), "config")
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
        _check_structure(nested, "the overrides")
        cfg = _merge(cfg, _normalise_raw(nested), "override")
    _check_values(_resolved(cfg, "config"))
    try:
        validate_config(cfg)
    except (OmegaConfBaseException, RecursionError) as exc:  # an interpolation gone wrong
        raise ConfigError(f"config: {str(exc).splitlines()[0]}") from None
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _check_values(container: Any, prefix: str = "") -> None:
    """Every number of the config is usable: floats finite (``inf`` or ``nan`` would make a
    threshold or a regulariser meaningless without an error), integers within 64 bits (the
    seeds and sizes reach torch and numpy as int64)."""
    items = container.items() if isinstance(container, Mapping) else enumerate(container) \
        if isinstance(container, list) else ()
    for key, value in items:
        name = f"{prefix}{key}" if isinstance(key, str) else f"{prefix[:-1]}[{key}]"
        if isinstance(value, (Mapping, list)):
            _check_values(value, f"{name}.")
        elif isinstance(value, float):
            check(math.isfinite(value), name, "a finite number", value)
        elif isinstance(value, int) and not isinstance(value, bool):
            check(INT64[0] <= value <= INT64[1], name, "an integer within 64 bits", value)




def _check_size(key: str, value: Optional[List[int]]) -> None:
    if value is None:
        return
    check(len(value) == 2 and all(1 <= v <= MAX_SIDE for v in value), key,
          f"an int or [height, width] of ints in 1..{MAX_SIDE}", list(value))


def validate_config(cfg: DictConfig) -> None:
    """Range and cross-field checks that the schema's types cannot express; each method's
    section is checked by its scorer."""
    from anomaly_hooks.scorers import registered

    check(isinstance(cfg.device, str) and DEVICE_RE.match(cfg.device) is not None, "device",
          "auto, cpu, cuda or cuda:N (N a device number)", cfg.device)
    check(0 <= cfg.seed < (1 << 63), "seed", "an integer in [0, 2**63)", cfg.seed)
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
    check(thr.false_alarm_rate is None or 0.0 < thr.false_alarm_rate < 0.5,
          "threshold.false_alarm_rate", "null or 0 < rate < 0.5", thr.false_alarm_rate)
    check(thr.near_duplicates is None or 0.0 <= thr.near_duplicates < 1.0,
          "threshold.near_duplicates", "null or 0 <= fraction < 1", thr.near_duplicates)
    check(thr.folds is None or 2 <= thr.folds <= 1000, "threshold.folds", "null or 2 to 1000",
          thr.folds)
    check(thr.target_recall is None or 0.0 < thr.target_recall < 1.0,
          "threshold.target_recall", "null or 0 < recall < 1", thr.target_recall)
    check(thr.prevalence is None or 0.0 < thr.prevalence < 1.0, "threshold.prevalence",
          "null or 0 < share < 1", thr.prevalence)
    check(str(thr.objective) != "recall" or thr.target_recall is not None,
          "threshold.target_recall", "set with threshold.objective=recall (e.g. 0.9)",
          thr.target_recall)
    data = cfg.data
    check(1 <= data.batch_size <= 65_536, "data.batch_size", "1 to 65536", data.batch_size)
    check(0 <= data.num_workers <= 256, "data.num_workers", "0 to 256", data.num_workers)
    check(1 <= data.max_pixels <= MAX_PIXELS, "data.max_pixels", "1 to 2**40", data.max_pixels)
    res = cfg.resources
    if res.memory_limit_gb is not None:
        check(res.memory_limit_gb > 0, "resources.memory_limit_gb", "> 0 or null",
              res.memory_limit_gb)
    check(0.0 < res.memory_fraction <= 1.0, "resources.memory_fraction", "0 < f <= 1",
          res.memory_fraction)
    validate_monitor_config(cfg.monitor)
    validate_tiling(cfg.tiling)
    for name, scorer in registered().items():
        scorer.validate_config(cfg[name])
    method = registered()[str(cfg.method)]
    check(cfg.tiling.enabled or not method.shares_tile_positions(cfg[cfg.method]),
          f"{cfg.method}.positions", "frame unless tiling.enabled=true (statistics shared by "
          "tile position need tiles)", "tile")


def to_container(cfg: DictConfig) -> dict:
    """The resolved config as plain Python objects (JSON-serialisable)."""
    return OmegaConf.to_container(cfg, resolve=True,  # type: ignore[return-value]
                                  enum_to_str=True)
