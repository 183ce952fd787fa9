"""Fold inference-mode BatchNorm layers into the convolutions that feed them.

In eval mode ``BatchNorm2d`` is a per-channel affine map ``y = a x + b`` of its input, so a
convolution whose output goes *only* to it can take it on: ``W' = a W``, ``b' = a b_conv + b``
(``torch.nn.utils.fusion.fuse_conv_bn_weights``), and the BatchNorm becomes ``nn.Identity``.
One pass over every activation fewer per pair: the backbone's forward runs 1.1-1.3 times as
fast on a CPU (``benchmarks/bench_memory_format.py --setting backbone.fold_batchnorm``).

Which pairs are safe is read from the model's data flow in one probe forward pass, not from its
attribute order: forward hooks on the model's own modules see each convolution's output and
each BatchNorm's input, and a :class:`~torch.overrides.TorchFunctionMode` (thread-local: other
threads running models meanwhile are not touched, unlike ``torch.fx``'s tracer, which patches
``nn.Module.__call__`` for the whole process) counts every other torch call that takes that
output. A pair is folded where the BatchNorm's input *is* the convolution's output, no other
call reads it (an in-place op, a residual sum, a view, a second BatchNorm), no module but the
convolution and the non-hooked containers between it and the BatchNorm returns it (not the
model itself: its caller is out of sight), and each of the two runs once. Everything else is
left alone: a convolution that is a hooked layer keeps its own output; modules that carry hooks
or parametrisations, or BatchNorms without running statistics, are not touched. A hooked
BatchNorm layer becomes ``nn.Identity`` under the same name and its output (the folded
convolution's) is the one it had. The module names stay as they were.

Two more rewrites of the same kind (``backbone.fold_padding``, ``backbone.inplace_activations``):

* :func:`fold_padding`: a convolution that zero-pads its input with a ``nn.ZeroPad2d`` child
  (TensorFlow-style "same" padding, as in EfficientNet-Lite) takes a symmetric padding into its
  own ``padding``, the child becoming ``nn.Identity``: one copy of every padded activation
  fewer. An asymmetric one (``(0, 1)``, ``(1, 2)``: "same" padding at stride 2) is taken by a
  depthwise convolution on the CPU with its kernel widened by zero taps on the less padded
  side, the padding then symmetric (the larger side's): the same windows, the same sums. There
  the copy costs more than the few extra taps (EfficientNet-Lite0's ``_blocks.1`` at 25 x 96 x
  112 x 112, channels-last: the pad alone 35 ms, padded and convolved 40 ms, widened 4.4 ms),
  while a dense convolution's extra taps cost more than the copy (1.01-1.46 times the time),
  so those keep their padding layer (``benchmarks/bench_padding.py --dense``). Each rewrite
  is checked on a seeded random input of the size the convolution saw in a probe pass (its
  output within the float32 rounding of the sums) and undone otherwise.
* :func:`inplace_activations`: an activation module (ReLU6, SiLU, ... not already in place)
  whose every input is a tensor a torch call made in the forward pass, in memory of its own (not
  the model's input, a parameter or a view), read by no other torch call, and returned by no
  hooked or kept module nor the model itself, overwrites that input: no new tensor per
  activation. The values are the same to the bit (the same kernels).

Both keep every hooked layer's output and the module names; on EfficientNet-Lite0 they make the
backbone 1.45 times as fast on a CPU again (``benchmarks/bench_memory_format.py --setting
backbone.inplace_activations``).
"""
from __future__ import annotations

import logging
import weakref
from collections import Counter, defaultdict
from functools import partial
from typing import Any, Collection, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.fusion import fuse_conv_bn_weights
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``obj`` and in the tuples, lists and dicts within it."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _has_hooks(module: nn.Module) -> bool:
    """Whether someone hooked ``module`` (its hook tables: nn.Module has no public query)."""
    return bool(module._forward_hooks or module._forward_pre_hooks
                or getattr(module, "_forward_hooks_with_kwargs", None)
                or getattr(module, "_backward_hooks", None))


def _foldable(conv: nn.Module, bn: nn.Module) -> bool:
    """Plain modules whose folded form is exact in eval mode."""
    return (isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d)
            and not bn.training and bn.running_mean is not None
            and bn.running_var is not None and bn.num_features == conv.out_channels
            and not parametrize.is_parametrized(conv)
            and isinstance(conv.weight, nn.Parameter)
            and not (_has_hooks(conv) or _has_hooks(bn)))


class _Probe(TorchFunctionMode):
    """The data flow of one forward pass (see the module docstring): which tensor each
    convolution returned, which each BatchNorm took, which modules returned each tensor, how
    often each module ran, and how many torch calls outside the BatchNorms read each
    convolution's output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_out: Dict[int, str] = {}  # id(output) -> convolution name
        # BatchNorm name -> (the convolution whose output it took, id of that output),
        # resolved when it runs (while that output is alive: ids are not yet reused)
        self.bn_in: Dict[str, Tuple[str, int]] = {}
        self.bn_reads: Counter = Counter()  # convolution name -> BatchNorms reading its output
        # id(tensor) -> (module, weak reference): ids of freed tensors are reused
        self.returned_by: Dict[int, List[Tuple[str, weakref.ref]]] = defaultdict(list)
        self.calls: Counter = Counter()  # module name -> forward calls
        self.reads: Counter = Counter()  # convolution name -> torch calls reading its output
        # id(output) -> each convolution's output, held so that its id stays its own
        self.outputs: Dict[int, torch.Tensor] = {}
        self.in_bn = 0  # inside a BatchNorm's forward (its own reads of its input)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.in_bn and self.conv_out:
            for tensor in _tensors((args, kwargs)):
                name = self.conv_out.get(id(tensor))
                if name is not None:
                    self.reads[name] += 1
        return func(*args, **kwargs)

    def returned(self, tensor_id: int) -> List[str]:
        """The modules that returned the live watched tensor ``tensor_id``."""
        tensor = self.outputs[tensor_id]
        return [name for name, ref in self.returned_by[tensor_id] if ref() is tensor]

    def attach(self, model: nn.Module, handles: List[Any]) -> None:
        """Forward (pre-)hooks on every module of ``model``, their handles appended to
        ``handles`` as they are placed (all of them removable should one fail)."""
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(partial(self._pre, name)))
            handles.append(module.register_forward_hook(partial(self._post, name)))

    def _pre(self, name: str, module: nn.Module, args: tuple) -> None:
        self.calls[name] += 1
        if isinstance(module, nn.BatchNorm2d):
            self.in_bn += 1
            conv = self.conv_out.get(id(args[0])) if args else None
            if conv is not None:
                self.bn_in[name] = (conv, id(args[0]))
                self.bn_reads[conv] += 1

    def _post(self, name: str, module: nn.Module, _args: tuple, output: Any) -> None:
        if isinstance(module, nn.BatchNorm2d):
            self.in_bn -= 1
        for tensor in _tensors(output):
            self.returned_by[id(tensor)].append((name, weakref.ref(tensor)))
        if isinstance(module, nn.Conv2d) and isinstance(output, torch.Tensor):
            self.conv_out[id(output)] = name
            self.outputs[id(output)] = output


def probe_pass(model: nn.Module, probe: torch.Tensor, flow: TorchFunctionMode,
               what: str) -> bool:
    """One forward pass of ``model`` on ``probe`` ``[B, 3, H, W]`` in inference mode, with the
    hooks ``flow.attach(model, handles)`` places and ``flow`` as the torch-function mode; the
    hooks removed afterwards, whatever happens. False (logged, ``what`` skipped) where the model
    cannot be hooked or the forward fails: the extractor's own dry run reports that."""
    handles: List[Any] = []
    try:
        flow.attach(model, handles)
        with torch.inference_mode(), flow:
            model(probe)
    except Exception as exc:  # noqa: BLE001 (reported by the extractor's dry run)
        log.debug("%s skipped: the probe forward failed (%s: %s)", what,
                  type(exc).__name__, exc)
        return False
    finally:
        for handle in handles:
            handle.remove()
    return True


def _inner_ancestor(name: str, of: str) -> bool:
    """Whether module ``name`` contains module ``of`` and is not the model itself (whose
    output goes to the caller, out of sight)."""
    return name != "" and of.startswith(name + ".")


def conv_bn_pairs(model: nn.Module, probe: torch.Tensor,
                  keep: Collection[str] = ()) -> List[Tuple[str, str]]:
    """The ``(convolution, BatchNorm)`` name pairs of ``model`` (in eval mode) that
    :func:`fold_batchnorm` folds, read from a forward pass on ``probe`` ``[B, 3, H, W]`` (see
    the module docstring; none where the model cannot be hooked or the forward fails).
    ``keep``: module names whose output must stay as it is (a convolution named here, or a
    container that returns its output)."""
    modules = dict(model.named_modules())
    hooked = {name for name, m in modules.items() if _has_hooks(m)}
    flow = _Probe()
    if not probe_pass(model, probe, flow, "BatchNorm folding"):
        return []
    pairs = []
    for bn_name, (conv_name, tensor_id) in flow.bn_in.items():
        if (conv_name in keep or {conv_name, bn_name} & hooked
                or flow.calls[conv_name] != 1 or flow.calls[bn_name] != 1
                or flow.reads[conv_name] or flow.bn_reads[conv_name] != 1):
            continue
        others = [n for n in flow.returned(tensor_id) if n != conv_name]
        if any(n in keep or not _inner_ancestor(n, conv_name) for n in others):
            continue
        if _foldable(modules[conv_name], modules[bn_name]):
            pairs.append((conv_name, bn_name))
    return pairs


@torch.no_grad()
def fold_batchnorm(model: nn.Module, probe: torch.Tensor,
                   keep: Collection[str] = ()) -> List[str]:
    """Fold every eval-mode BatchNorm of ``model`` into the convolution that feeds it alone
    (in place; see the module docstring) and return the BatchNorms' names. ``model`` must be
    in eval mode already (a BatchNorm in training mode is left alone); ``probe``: an input
    ``[B, 3, H, W]`` on the model's device for the data-flow pass; ``keep``: module names
    whose output must stay as it is (hooked layers)."""
    folded = []
    for conv_name, bn_name in conv_bn_pairs(model, probe, keep):
        conv, bn = model.get_submodule(conv_name), model.get_submodule(bn_name)
        weight, bias = fuse_conv_bn_weights(conv.weight, conv.bias, bn.running_mean,
                                            bn.running_var, bn.eps, bn.weight, bn.bias)
        conv.weight, conv.bias = weight, bias
        parent, _, name = bn_name.rpartition(".")
        setattr(model.get_submodule(parent), name, nn.Identity())
        folded.append(bn_name)
    return folded


# -- zero padding into the convolution ------------------------------------------------------
PADDING_CHECK_SEED = 0  # the random input each padding rewrite is checked on


def _widenable(conv: nn.Conv2d) -> bool:
    """Whether ``conv`` takes an asymmetric zero padding by a kernel widened with zero taps:
    a depthwise convolution (one input channel a group: memory-bound, the padded copy costs
    more than the extra taps) without dilation or a parametrised weight."""
    return (conv.in_channels == conv.groups and tuple(conv.dilation) == (1, 1)
            and not parametrize.is_parametrized(conv))


def _padding_candidates(model: nn.Module, keep: Collection[str],
                        widen: bool) -> Dict[str, str]:
    """``{convolution: its ZeroPad2d child}`` of the convolutions with no padding of their own
    and one non-negative zero-padding child, neither hooked by someone nor kept: a symmetric
    padding, or with ``widen`` an asymmetric one of a :func:`_widenable` convolution."""
    out = {}
    for name, conv in model.named_modules():
        if (not isinstance(conv, nn.Conv2d) or tuple(conv.padding) != (0, 0)
                or conv.padding_mode != "zeros" or _has_hooks(conv)):
            continue
        pads = [(child, m) for child, m in conv.named_children() if type(m) is nn.ZeroPad2d]
        if len(pads) != 1:
            continue
        child, pad = pads[0]
        left, right, top, bottom = pad.padding
        full = f"{name}.{child}" if name else child
        if min(pad.padding) < 0 or _has_hooks(pad) or full in keep:
            continue
        if (left == right and top == bottom) or (widen and _widenable(conv)):
            out[name] = child
    return out


def widened_kernel(weight: torch.Tensor, padding: Tuple[int, int, int, int]) -> torch.Tensor:
    """``weight`` ``[O, I, kh, kw]`` with zero taps added on the less padded side of each axis,
    ``|right - left|`` columns and ``|bottom - top|`` rows, for ``padding`` ``(left, right,
    top, bottom)``: convolved with the symmetric padding ``(max(top, bottom), max(left,
    right))``, each output window starts ``max - min`` samples earlier and the zero taps skip
    them, so the taps meet the same samples as ``weight`` on the asymmetrically padded input,
    at any stride; the output size is the same."""
    left, right, top, bottom = padding
    return F.pad(weight, (max(right - left, 0), max(left - right, 0),
                          max(bottom - top, 0), max(top - bottom, 0)))


class _Shapes(TorchFunctionMode):
    """The input shape of each module in ``names`` at its first call (the mode itself passes
    every torch call through)."""

    def __init__(self, names: Collection[str]) -> None:
        super().__init__()
        self.names = names
        self.shapes: Dict[str, torch.Size] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

    def attach(self, model: nn.Module, handles: List[Any]) -> None:
        for name in self.names:
            handles.append(model.get_submodule(name).register_forward_pre_hook(
                partial(self._pre, name)))

    def _pre(self, name: str, _module: nn.Module, args: tuple) -> None:
        if name not in self.shapes and args and isinstance(args[0], torch.Tensor):
            self.shapes[name] = args[0].shape


def _same_output(conv: nn.Module, x: torch.Tensor, before: torch.Tensor,
                 padding: Tuple[int, int]) -> bool:
    """Whether ``conv(x)`` now equals ``before`` (its output with the explicit padding) within
    the float32 rounding of the sums: ``2 k eps`` of the sum of the terms' magnitudes, ``k``
    the terms per output. A forward that now fails (a kernel wider than the input it is given)
    is not the same."""
    try:
        after = conv(x)
    except RuntimeError as exc:
        log.debug("padding rewrite undone: the forward fails (%s)", exc)
        return False
    if after.shape != before.shape:
        return False
    w = conv.weight
    terms = w[0].numel()
    padded = F.pad(x.abs(), (padding[1], padding[1], padding[0], padding[0]))
    size = F.conv2d(padded, w.abs(), None, conv.stride, 0, conv.dilation, conv.groups)
    bound = 2 * terms * torch.finfo(after.dtype).eps * size + torch.finfo(after.dtype).tiny
    return bool(((after - before).abs() <= bound).all())


@torch.no_grad()
def fold_padding(model: nn.Module, probe: torch.Tensor, keep: Collection[str] = (),
                 widen: Optional[bool] = None) -> List[str]:
    """Fold each symmetric ``nn.ZeroPad2d`` child of a convolution into the convolution's own
    ``padding``, and with ``widen`` a depthwise convolution's asymmetric one (in place; see the
    module docstring); return the convolutions' names.
    ``probe``: an input ``[B, 3, H, W]`` on the model's device, for the sizes the checks use;
    ``keep``: module names whose output must stay as it is; ``widen``: also fold asymmetric
    paddings of depthwise convolutions into a kernel widened by zero taps
    (:func:`widened_kernel`); None: on the CPU, where it is measured faster."""
    widen = probe.device.type == "cpu" if widen is None else widen
    candidates = _padding_candidates(model, keep, widen)
    flow = _Shapes(candidates)
    if not candidates or not probe_pass(model, probe, flow, "padding folding"):
        return []
    shapes = flow.shapes
    gen = torch.Generator(device=probe.device).manual_seed(PADDING_CHECK_SEED)
    folded = []
    for name, child in candidates.items():
        if name not in shapes:  # never ran: nothing to check the rewrite against
            continue
        conv = model.get_submodule(name)
        pad, weight = getattr(conv, child), conv.weight
        x = torch.rand(shapes[name], generator=gen, device=probe.device, dtype=weight.dtype)
        before = conv(x)
        left, right, top, bottom = pad.padding
        setattr(conv, child, nn.Identity())
        conv.padding = (max(top, bottom), max(left, right))
        if (left, top) != (right, bottom):
            _set_kernel(conv, nn.Parameter(widened_kernel(weight, pad.padding),
                                           requires_grad=weight.requires_grad))
        if _same_output(conv, x, before, conv.padding):
            folded.append(name)
        else:  # the module's forward does not pad as assumed: as it was
            setattr(conv, child, pad)
            conv.padding = (0, 0)
            _set_kernel(conv, weight)
    return folded


def _set_kernel(conv: nn.Conv2d, weight: nn.Parameter) -> None:
    """``conv``'s weight and the ``kernel_size`` it records."""
    conv.weight = weight
    conv.kernel_size = tuple(weight.shape[2:])


# -- activations in place --------------------------------------------------------------------
INPLACE_ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU,
                       nn.SiLU, nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.Threshold)


def _storage(t: torch.Tensor) -> Optional[int]:
    """The address of ``t``'s memory (None for a tensor without one)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class _Reads(TorchFunctionMode):
    """The data flow of one forward pass around the activation modules ``watched``: each one's
    inputs (held, so that their ids stay theirs), how many torch calls read each tensor, which
    tensors a torch call made in memory of their own, and which modules returned them."""

    def __init__(self, watched: Collection[str]) -> None:
        super().__init__()
        self.watched = set(watched)
        # id -> (weak reference, count): ids of freed tensors are reused
        self.reads: Dict[int, Tuple[weakref.ref, int]] = {}
        self.fresh: Dict[int, weakref.ref] = {}
        self.returned_by: Dict[int, List[Tuple[str, weakref.ref]]] = defaultdict(list)
        self.inputs: Dict[str, List[Optional[torch.Tensor]]] = defaultdict(list)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        given = list(_tensors((args, kwargs)))
        for t in given:
            self.reads[id(t)] = (weakref.ref(t), self.reads_of(t) + 1)
        out = func(*args, **kwargs)
        taken = {_storage(t) for t in given}
        for t in _tensors(out):  # (torch calls made here are not seen by the mode)
            if t._base is None and not any(t is g for g in given):
                address = _storage(t)
                if address is not None and address not in taken:
                    self.fresh[id(t)] = weakref.ref(t)
        return out

    def reads_of(self, t: torch.Tensor) -> int:
        """How many torch calls read the live tensor ``t``."""
        ref, n = self.reads.get(id(t), (None, 0))
        return n if ref is not None and ref() is t else 0

    def is_fresh(self, t: torch.Tensor) -> bool:
        """Whether a torch call made the live tensor ``t`` in memory of its own."""
        ref = self.fresh.get(id(t))
        return ref is not None and ref() is t

    def attach(self, model: nn.Module, handles: List[Any]) -> None:
        for name, module in model.named_modules():
            if name in self.watched:
                handles.append(module.register_forward_pre_hook(partial(self._pre, name)))
            handles.append(module.register_forward_hook(partial(self._post, name)))

    def _pre(self, name: str, _module: nn.Module, args: tuple) -> None:
        given = args[0] if len(args) == 1 and isinstance(args[0], torch.Tensor) else None
        self.inputs[name].append(given)

    def _post(self, name: str, _module: nn.Module, _args: tuple, output: Any) -> None:
        for tensor in _tensors(output):
            self.returned_by[id(tensor)].append((name, weakref.ref(tensor)))


def inplace_candidates(model: nn.Module) -> List[str]:
    """The activation modules :func:`inplace_activations` considers: of a type in
    :data:`INPLACE_ACTIVATIONS` (exactly), not in place already, not hooked by someone."""
    return [name for name, m in model.named_modules()
            if type(m) in INPLACE_ACTIVATIONS and not m.inplace and not _has_hooks(m)]


def inplace_activations(model: nn.Module, probe: torch.Tensor,
                        keep: Collection[str] = ()) -> List[str]:
    """Set ``inplace`` on every activation module of ``model`` whose inputs nothing else
    needs (see the module docstring) and return their names; none where the model cannot be
    hooked or the probe forward on ``probe`` ``[B, 3, H, W]`` fails. ``keep``: module names
    whose output must stay as it is (hooked layers)."""
    watched = inplace_candidates(model)
    if not watched:
        return []
    modules = dict(model.named_modules())
    hooked = {name for name, m in modules.items() if _has_hooks(m)}
    flow = _Reads(watched)
    if not probe_pass(model, probe, flow, "in-place activations"):
        return []
    done = []
    for name in watched:
        inputs = flow.inputs.get(name)
        if inputs and all(t is not None and _overwritable(flow, t, keep, hooked)
                          for t in inputs):
            modules[name].inplace = True
            done.append(name)
    return done


def _overwritable(flow: _Reads, t: torch.Tensor, keep: Collection[str],
                  hooked: Collection[str]) -> bool:
    """Whether an activation may overwrite its input ``t``: made by a torch call in memory of
    its own, read by that activation's call alone, and returned by no module whose output
    someone takes (a kept or hooked module, the model itself)."""
    if not flow.is_fresh(t) or flow.reads_of(t) != 1:
        return False
    takers = [n for n, ref in flow.returned_by.get(id(t), []) if ref() is t]
    return not any(n == "" or n in keep or n in hooked for n in takers)
