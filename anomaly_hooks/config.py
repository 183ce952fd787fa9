"""Typed configuration (omegaconf structured configs).

A config is built from the schema below, merged with a YAML file or mapping, then with
``key=value`` overrides. Unknown keys and wrong types are rejected with a one-line message that
names the key. The resolved config is saved with every model.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


class ConfigError(ValueError):
    """A configuration value is missing, unknown or not allowed."""


@dataclass
class BackboneConfig:
    """The CNN whose intermediate layers give the patch features."""

    name: str = "wide_resnet50_2"  # torchvision model name, or "custom" for a user nn.Module
    weights: Optional[str] = "DEFAULT"  # torchvision weights name, a local file, or null (random)
    layers: Optional[List[str]] = None  # dotted module names; null = the method's default
    precision: str = "float32"  # float32 | bfloat16 | float16 (autocast of the forward; GPU)
    channels_last: bool = False  # channels-last memory format (faster convolutions on GPU)


@dataclass
class PreprocessConfig:
    """Resize (H, W) then centre crop (H, W); normalise with mean/std."""

    resize: List[int] = field(default_factory=lambda: [256, 256])
    crop: Optional[List[int]] = field(default_factory=lambda: [224, 224])
    mean: List[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: List[float] = field(default_factory=lambda: list(IMAGENET_STD))


@dataclass
class PadimConfig:
    """PaDiM: a Gaussian per patch position."""

    n_features: Optional[int] = None  # random channel subset; null = 550 (WRN50) / 100 (ResNet18)
    epsilon: float = 0.01  # added to the covariance diagonal
    factor_dtype: str = "float32"  # float32 | float16 (dense factors only; half the memory)
    covariance: str = "auto"  # auto | dense | lowrank (auto: lowrank for <= 0.4 D train images)


@dataclass
class PatchCoreConfig:
    """PatchCore: coreset memory bank + nearest-neighbour distance."""

    local_pool: int = 3  # neighbourhood averaging (kernel size, stride 1)
    reduce_dim: Optional[int] = None  # target embedding dimension; null = keep all channels
    reduce_method: str = "pool"  # "pool" (adaptive average pooling) or "project" (random)
    coreset_ratio: Optional[float] = 0.1
    coreset_count: Optional[int] = None  # absolute size; overrides the ratio when set
    projection_dim: Optional[int] = 128  # for the selection only; null = no projection
    max_bank_points: Optional[int] = None  # bounded-memory fit: merge-reduce when set
    knn_backend: str = "auto"  # auto | projected | faiss-flat | faiss-ivf | faiss-hnsw | torch
    k: int = 1
    reweight: bool = False  # eq. 7 of the paper
    reweight_neighbors: int = 9  # b in eq. 7
    nlist: int = 1024  # faiss-ivf: number of lists (reduced for small banks)
    nprobe: int = 16  # faiss-ivf: lists searched
    hnsw_m: int = 32  # faiss-hnsw: graph degree
    ef_search: int = 128  # faiss-hnsw: search breadth
    bank_dtype: str = "float32"  # float32 | float16


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
    on_error: str = "raise"  # raise | skip: what fit does with unreadable images
    max_pixels: int = 100_000_000  # decompression-bomb guard


@dataclass
class ResourcesConfig:
    """Memory guard checked before fitting."""

    memory_limit_gb: Optional[float] = None  # null = memory_fraction of the available memory
    memory_fraction: float = 0.8  # of available RAM (or free GPU memory on CUDA)


@dataclass
class Config:
    """Everything that defines a model; saved with it."""

    method: str = "padim"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    output: str = "models/model.safetensors"
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    padim: PadimConfig = field(default_factory=PadimConfig)
    patchcore: PatchCoreConfig = field(default_factory=PatchCoreConfig)
    threshold: ThresholdConfig = field(default_factory=ThresholdConfig)
    data: DataConfig = field(default_factory=DataConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)


ConfigSource = Union[str, os.PathLike, Mapping[str, Any], DictConfig, None]


def _as_pair(value: Any) -> Any:
    """Accept ``256`` for a size and turn it into ``[256, 256]``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value, value]
    return value


def _normalise_raw(raw: Any) -> Any:
    """Friendly shorthands before the typed merge (an int size means a square)."""
    if isinstance(raw, DictConfig):
        raw = OmegaConf.to_container(raw, resolve=True)
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
    cfg = OmegaConf.structured(Config)
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


def _check(cond: bool, key: str, allowed: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{key}={value!r} is not allowed: {allowed}")


def _check_size(key: str, value: Optional[List[int]]) -> None:
    if value is None:
        return
    _check(len(value) == 2 and all(v >= 1 for v in value), key,
           "an int or [height, width] of positive ints", list(value))


def validate_config(cfg: DictConfig) -> None:
    """Cross-field checks that the schema's types cannot express."""
    from anomaly_hooks.scorers import available_methods

    _check(cfg.method in available_methods(), "method", f"one of {available_methods()}", cfg.method)
    _check(cfg.device == "auto" or cfg.device == "cpu" or cfg.device.startswith("cuda"),
           "device", "auto, cpu, cuda or cuda:N", cfg.device)
    pre = cfg.preprocess
    _check_size("preprocess.resize", pre.resize)
    _check_size("preprocess.crop", pre.crop)
    if pre.crop is not None:
        _check(pre.crop[0] <= pre.resize[0] and pre.crop[1] <= pre.resize[1], "preprocess.crop",
               f"at most the resize {list(pre.resize)} in each dimension", list(pre.crop))
    _check(len(pre.mean) == 3 and len(pre.std) == 3 and min(pre.std) > 0, "preprocess.mean/std",
           "three values each, std > 0", (list(pre.mean), list(pre.std)))
    _check(cfg.backbone.precision in ("float32", "bfloat16", "float16"), "backbone.precision",
           "float32, bfloat16 or float16", cfg.backbone.precision)
    if cfg.backbone.layers is not None:
        _check(len(cfg.backbone.layers) >= 1, "backbone.layers", "at least one layer name", [])
    pad = cfg.padim
    if pad.n_features is not None:
        _check(pad.n_features >= 1, "padim.n_features", "a positive int or null", pad.n_features)
    _check(pad.epsilon > 0, "padim.epsilon", "a positive float", pad.epsilon)
    _check(pad.factor_dtype in ("float32", "float16"), "padim.factor_dtype",
           "float32 or float16", pad.factor_dtype)
    _check(pad.covariance in ("auto", "dense", "lowrank"), "padim.covariance",
           "auto, dense or lowrank", pad.covariance)
    _check(not (pad.covariance == "lowrank" and pad.factor_dtype == "float16"),
           "padim.factor_dtype", "float32 with padim.covariance=lowrank (float16 applies to "
           "dense factors only: the low-rank form loses up to 15 % in float16); use "
           "padim.covariance=dense or auto", pad.factor_dtype)
    _validate_patchcore(cfg.patchcore)
    thr = cfg.threshold
    _check(0.0 <= thr.holdout_fraction < 1.0, "threshold.holdout_fraction", "0 <= f < 1",
           thr.holdout_fraction)
    _check(0.0 < thr.quantile <= 1.0, "threshold.quantile", "0 < q <= 1", thr.quantile)
    _check(thr.margin >= 0, "threshold.margin", ">= 0", thr.margin)
    data = cfg.data
    _check(data.batch_size >= 1, "data.batch_size", ">= 1", data.batch_size)
    _check(data.num_workers >= 0, "data.num_workers", ">= 0", data.num_workers)
    _check(data.on_error in ("raise", "skip"), "data.on_error", "raise or skip", data.on_error)
    _check(data.max_pixels >= 1, "data.max_pixels", ">= 1", data.max_pixels)
    res = cfg.resources
    if res.memory_limit_gb is not None:
        _check(res.memory_limit_gb > 0, "resources.memory_limit_gb", "> 0 or null",
               res.memory_limit_gb)
    _check(0.0 < res.memory_fraction <= 1.0, "resources.memory_fraction", "0 < f <= 1",
           res.memory_fraction)


def _validate_patchcore(pc: DictConfig) -> None:
    _check(pc.local_pool >= 1 and pc.local_pool % 2 == 1, "patchcore.local_pool",
           "an odd int >= 1", pc.local_pool)
    if pc.coreset_ratio is not None:
        _check(0.0 < pc.coreset_ratio <= 1.0, "patchcore.coreset_ratio", "0 < ratio <= 1",
               pc.coreset_ratio)
    if pc.coreset_count is not None:
        _check(pc.coreset_count >= 1, "patchcore.coreset_count", ">= 1", pc.coreset_count)
    _check(pc.coreset_ratio is not None or pc.coreset_count is not None,
           "patchcore.coreset_ratio", "a ratio or a coreset_count must be set", None)
    if pc.reduce_dim is not None:
        _check(pc.reduce_dim >= 1, "patchcore.reduce_dim", ">= 1 or null", pc.reduce_dim)
    _check(pc.reduce_method in ("pool", "project"), "patchcore.reduce_method", "pool or project",
           pc.reduce_method)
    if pc.projection_dim is not None:
        _check(pc.projection_dim >= 1, "patchcore.projection_dim", ">= 1 or null", pc.projection_dim)
    if pc.max_bank_points is not None:
        _check(pc.max_bank_points >= 1, "patchcore.max_bank_points", ">= 1 or null",
               pc.max_bank_points)
    _check(pc.knn_backend in ("auto", "projected", "faiss-flat", "faiss-ivf", "faiss-hnsw",
                              "torch"),
           "patchcore.knn_backend", "auto, projected, faiss-flat, faiss-ivf, faiss-hnsw or torch",
           pc.knn_backend)
    _check(pc.k >= 1, "patchcore.k", ">= 1", pc.k)
    _check(pc.reweight_neighbors >= 1, "patchcore.reweight_neighbors", ">= 1",
           pc.reweight_neighbors)
    _check(pc.bank_dtype in ("float32", "float16"), "patchcore.bank_dtype", "float32 or float16",
           pc.bank_dtype)


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML text."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def to_container(cfg: DictConfig) -> dict:
    """The resolved config as plain Python objects (JSON-serialisable)."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
