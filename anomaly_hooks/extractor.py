"""Intermediate features of any ``nn.Module`` through forward hooks.

The extractor registers ``register_forward_hook`` on the requested (dotted) module names, owns the
hook handles and removes them on :meth:`HookFeatureExtractor.close` or on leaving a ``with`` block.
The forward pass stops right after the last requested layer *in execution order* (found by a dry
run), so later stages (layer4, pooling, classifier) never run. Captured outputs live in
thread-local storage, so one extractor can serve many threads at once.

:func:`describe_layers` answers the first question about a new backbone: which module names can
be tapped, and what each gives (output shape, channels, stride), from one dry run.
"""
from __future__ import annotations

import contextlib
import copy
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from anomaly_hooks import fusion
from anomaly_hooks.devices import ieee_float32
from anomaly_hooks.errors import BackboneError, ConfigError


@dataclass(frozen=True)
class LayerInfo:
    """What one tapped layer gives: channels and stride relative to the input."""

    name: str
    channels: int
    stride: int


class _StopForward(Exception):
    """Raised by the last hook to cut the forward pass short."""


def layer_names(model: nn.Module) -> List[str]:
    """All dotted module names that can be tapped (``layer1``, ``layer3.5``, ``_blocks.4``)."""
    return [name for name, _ in model.named_modules() if name]


def _describe_valid(model: nn.Module) -> str:
    names = layer_names(model)
    top = [n for n in names if "." not in n]
    return f"top-level: {top}; all {len(names)} valid names: {names}"


def resolve_layers(model: nn.Module, layers: Sequence[str]) -> Dict[str, nn.Module]:
    """Map each requested name to its submodule.

    Raises:
        ConfigError: an unknown name (the message lists the valid names), or an empty/duplicate
            list.
    """
    if not layers:
        raise ConfigError("no layers requested: give at least one module name, e.g. ['layer2']")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"duplicate layer names in {list(layers)}")
    modules = dict(model.named_modules())
    unknown = [name for name in layers if name not in modules or not name]
    if unknown:
        raise ConfigError(
            f"unknown layer name(s) {unknown} for {type(model).__name__}. Valid names: "
            f"{_describe_valid(model)}"
        )
    return {name: modules[name] for name in layers}


def first_tensor(output: Any) -> torch.Tensor:
    """A tapped module's output as one tensor ``[B, C, H, W]``: the tensor itself, or the first
    of a tuple or list (modules returning several); a clear error for anything else."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ConfigError(f"layer output of type {type(output).__name__} is not a tensor: pick a "
                      "module whose output is a [B, C, H, W] tensor")


def _copy_module(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` (parameters, buffers, submodules), for the extractor to own."""
    try:
        return copy.deepcopy(model)
    except Exception as exc:  # noqa: BLE001 (a module holding something that cannot be copied)
        raise BackboneError(f"cannot copy the backbone module {type(model).__name__} "
                            f"({type(exc).__name__}: {exc}); the detector works on its own "
                            "copy so that yours is left as it is: make the module copyable "
                            "(copy.deepcopy), e.g. by removing hooks or attributes that hold "
                            "locks, files or sessions") from None


# Optional mixed precision of the backbone forward (features are used in float32 afterwards).
PRECISIONS = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HookFeatureExtractor:
    """Capture the outputs of named layers of ``model``.

    Args:
        model: any ``nn.Module`` taking a ``[B, 3, H, W]`` tensor.
        layers: dotted module names, in any order; outputs come back in this order.
        device: where the model runs.
        probe_size: ``(H, W)`` of the dry run that finds execution order, channels and strides.
        precision: ``float32`` (IEEE float32: no TF32, see :func:`devices.ieee_float32`),
            ``bfloat16`` or ``float16`` (autocast of the forward).
        channels_last: run the model in channels-last memory format.
        fold_batchnorm: fold each eval-mode BatchNorm into the convolution that feeds it
            alone (:func:`~anomaly_hooks.fusion.fold_batchnorm`; the hooked layers keep their
            outputs, to float32 rounding): one pass over the activations fewer per pair. It
            changes the module the extractor runs, so with ``copy_module=False`` the caller's
            (its BatchNorms become ``nn.Identity``).
        fold_padding: fold each convolution's symmetric ``nn.ZeroPad2d`` child into its own
            padding (:func:`~anomaly_hooks.fusion.fold_padding`): one copy of each padded
            activation fewer.
        inplace_activations: run each activation module whose input nothing else reads in
            place (:func:`~anomaly_hooks.fusion.inplace_activations`; the same values): no new
            tensor per activation. Both change the module the extractor runs, as the folding
            does.
        copy_module: False (the default): ``model`` itself is put in eval mode, moved to
            ``device`` and hooked, in place (a module shared with other code changes for it
            too). True: the extractor works on a deep copy, so the caller's module keeps its
            mode, device, memory format and hooks, and extractors on different devices can
            share one module (what :class:`~anomaly_hooks.detector.Detector` does with a
            module it is given).

    Example:
        >>> with HookFeatureExtractor(model, ["layer1", "layer2"]) as ext:
        ...     feats = ext(images)  # {"layer1": [B, C1, H/4, W/4], "layer2": [B, C2, H/8, W/8]}
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[str],
        device: torch.device | str = "cpu",
        probe_size: Tuple[int, int] = (224, 224),
        precision: str = "float32",
        channels_last: bool = False,
        copy_module: bool = False,
        fold_batchnorm: bool = False,
        fold_padding: bool = False,
        inplace_activations: bool = False,
    ) -> None:
        if precision not in PRECISIONS:
            raise ConfigError(f"precision={precision!r}: one of {sorted(PRECISIONS)}")
        self.precision = PRECISIONS[precision]
        self.channels_last = channels_last
        self.layers = list(layers)
        resolve_layers(model, self.layers)  # a bad name fails before any copy is made
        self.model = (_copy_module(model) if copy_module else model).eval().to(device)
        # the BatchNorms folded away (their names; before the memory format: new weights)
        probe = torch.zeros(1, 3, *probe_size, device=device)
        self.folded: List[str] = (fusion.fold_batchnorm(self.model, probe, keep=self.layers)
                                  if fold_batchnorm else [])
        # the convolutions that took their padding layer; the activations run in place
        self.folded_padding: List[str] = (
            fusion.fold_padding(self.model, probe, keep=self.layers) if fold_padding else [])
        self.in_place: List[str] = (
            fusion.inplace_activations(self.model, probe, keep=self.layers)
            if inplace_activations else [])
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.device = torch.device(device)
        self._modules = resolve_layers(self.model, self.layers)
        self._local = threading.local()
        self._last: str | None = None  # set by the dry run
        self._handles = [
            module.register_forward_hook(partial(self._hook, name))
            for name, module in self._modules.items()
        ]
        self.info = self._dry_run(probe_size)

    # -- hooks ---------------------------------------------------------------------------
    def _hook(self, name: str, _module: nn.Module, _inputs: Any, output: Any) -> None:
        store = getattr(self._local, "outputs", None)
        if store is None:  # the model is being used outside the extractor: stay passive
            return
        if name not in store:
            store[name] = first_tensor(output)
            store.setdefault("__order__", []).append(name)
        if name == self._last and len(store) - 1 == len(self.layers):
            raise _StopForward

    def _run(self, images: torch.Tensor) -> Dict[str, torch.Tensor]:
        self._local.outputs = {}
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        autocast = (torch.autocast(images.device.type, dtype=self.precision)
                    if self.precision is not None else contextlib.nullcontext())
        try:
            with torch.inference_mode(), ieee_float32(), autocast:
                self.model(images)
        except _StopForward:
            pass
        finally:
            outputs, self._local.outputs = self._local.outputs, None
        return outputs

    def _dry_run(self, size: Tuple[int, int]) -> List[LayerInfo]:
        probe = torch.zeros(1, 3, *size, device=self.device)
        outputs = self._run(probe)
        missing = [n for n in self.layers if n not in outputs]
        if missing:
            raise ConfigError(f"layers {missing} did not run in a forward pass of "
                              f"{type(self.model).__name__}: pick modules on the forward path")
        self.order: List[str] = list(outputs["__order__"])  # requested layers, execution order
        self._last = self.order[-1]
        info = []
        for name in self.layers:
            feat = outputs[name]
            if feat.dim() != 4:
                raise ConfigError(f"layer {name!r} gives a {feat.dim()}-d output "
                                  f"{tuple(feat.shape)}; pick a convolutional layer with a "
                                  "[B, C, H, W] output")
            info.append(LayerInfo(name, int(feat.shape[1]), max(1, round(size[0] / feat.shape[2]))))
        return info

    # -- public ---------------------------------------------------------------------------
    def __call__(self, images: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Features of ``images`` ``[B, 3, H, W]``: ``{name: [B, C_l, H/s_l, W/s_l]}``."""
        if not self._handles:
            raise RuntimeError("the extractor is closed; create a new one")
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"expected images [B, 3, H, W], got {tuple(images.shape)}")
        outputs = self._run(images.to(self.device, non_blocking=True))
        missing = [name for name in self.layers if name not in outputs]
        if missing:  # close() removed the hooks while this forward pass ran
            raise RuntimeError("the extractor is closed; create a new one")
        return {name: outputs[name] for name in self.layers}

    def close(self) -> None:
        """Remove every hook this extractor placed; the backbone is left as it was."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "HookFeatureExtractor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the contract
        try:
            self.close()
        except Exception:  # noqa: BLE001 (a destructor must not raise)
            pass


@dataclass(frozen=True)
class LayerDescription:
    """One module seen in a dry run: its output ``shape`` (first call, batch of 1), and for a
    ``[1, C, H, W]`` output its ``channels`` and ``stride``; ``calls`` per forward pass (a
    tapped module gives its first call's output); ``default_for``: the methods whose default
    layers include it."""

    name: str
    type: str
    shape: Tuple[int, ...]
    channels: Optional[int]
    stride: Optional[int]
    calls: int
    default_for: Tuple[str, ...] = ()

    @property
    def tappable(self) -> bool:
        """True when the output is a ``[B, C, H, W]`` map (what the embedders need)."""
        return len(self.shape) == 4


def describe_layers(model: nn.Module, input_size: Sequence[int] = (224, 224),
                    defaults: Optional[Mapping[str, Sequence[str]]] = None
                    ) -> List[LayerDescription]:
    """Every named module of ``model`` that runs in a forward pass, in execution order, with
    its output shape, channels and stride: one dry run of a ``[1, 3, H, W]`` zero image with a
    forward hook on every module (all removed afterwards; the model is put in eval mode).

    Args:
        input_size: ``(H, W)`` (or one int) of the dry run; strides are relative to it.
        defaults: method -> its default layer names, to mark in ``default_for``.
    """
    size = (int(input_size), int(input_size)) if isinstance(input_size, int) else \
        tuple(int(v) for v in input_size)
    seen: Dict[str, List[Any]] = {}

    def record(name: str, module: nn.Module, _inputs: Any, output: Any) -> None:
        if name in seen:
            seen[name][1] += 1
            return
        try:
            shape = tuple(first_tensor(output).shape)
        except ConfigError:
            shape = ()
        seen[name] = [type(module).__name__, 1, shape]

    handles = [module.register_forward_hook(partial(record, name))
               for name, module in model.named_modules() if name]
    try:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        with torch.inference_mode():
            model.eval()(torch.zeros(1, 3, *size, device=device))
    finally:
        for handle in handles:
            handle.remove()
    marks = {name: tuple(m for m, names in (defaults or {}).items() if name in names)
             for name in seen}
    out = []
    for name, (kind, calls, shape) in seen.items():
        four_d = len(shape) == 4
        out.append(LayerDescription(
            name, kind, shape, int(shape[1]) if four_d else None,
            max(1, round(size[0] / shape[2])) if four_d and shape[2] else None, calls,
            marks[name]))
    return out
