"""Where the computation runs, and how exactly: device names resolved against the hardware that
is present (a config's device is a requirement, a saved model's a preference), the IEEE float32
scope that keeps TF32 out of every float32 computation, and the few device helpers (sync,
block sizes) the compute paths share.

TF32: on Ampere and later GPUs cuDNN runs float32 convolutions in TF32 by default (10-bit
mantissa: ~1e-3 relative error), and a caller may have allowed it for matrix products too
(``torch.set_float32_matmul_precision("high")``). anomaly_hooks computes in float32 to give the
same scores on every device within float32 rounding, so its compute runs inside
:func:`ieee_float32`, which turns TF32 (and oneDNN's bf16 for float32 products on the CPU) off
while any thread is inside it and restores the caller's settings when the last one leaves.
These are process-wide flags in PyTorch (there is no per-thread or per-call switch): other code
running *at the same time* in another thread also computes in IEEE float32 meanwhile.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from anomaly_hooks.errors import ConfigError

# Elements of a temporary (e.g. a queries x bank-rows distance block) per block: cache-sized on
# the CPU (16 MB: glibc hands larger temporaries back to the kernel and faults them in anew);
# on a GPU big enough that a block is a few large kernel launches rather than many small ones.
CPU_BLOCK_ELEMENTS = 1 << 22
CUDA_BLOCK_ELEMENTS = 1 << 26  # 256 MB of float32


def block_elements(device: torch.device) -> int:
    """Elements per temporary block of the chunked computations on ``device``."""
    return CUDA_BLOCK_ELEMENTS if device.type == "cuda" else CPU_BLOCK_ELEMENTS


def synchronize(device: torch.device) -> None:
    """Wait for the queued work of ``device`` (a no-op on the CPU): before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- device names ---------------------------------------------------------------------------
def cuda_count() -> int:
    """GPUs this process can use (0 without a CUDA build or driver)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _parse(name: str) -> torch.device:
    if name != "cpu" and not name.startswith("cuda"):
        raise ConfigError(f"device={name!r}: one of auto, cpu, cuda, cuda:N")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device={name!r}: one of auto, cpu, cuda, cuda:N") from None


def resolve_device(name: Union[str, torch.device]) -> torch.device:
    """``auto`` = CUDA when available, else the CPU; ``cpu``; ``cuda``; ``cuda:N`` (or a
    ``torch.device`` of those).

    Raises:
        ConfigError: a CUDA device this machine does not have (no GPU at all, or ``N`` beyond
            the GPUs present), or a name that is none of the above.
    """
    name = str(name).strip()
    if name == "auto":
        return torch.device("cuda" if cuda_count() else "cpu")
    dev = _parse(name)
    if dev.type == "cuda":
        count = cuda_count()
        if count == 0:
            raise ConfigError(f"device={name!r} but CUDA is not available here: use device=auto "
                              "or cpu")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"device={name!r} but this machine has {count} GPU(s) "
                              f"(cuda:0 to cuda:{count - 1}): use one of those, auto or cpu")
    return dev


def channels_last_for(setting: Optional[bool], device: torch.device) -> bool:
    """Whether the backbone runs in the channels-last memory format: ``setting`` where given
    (``backbone.channels_last``), else on CPUs, whose oneDNN convolutions run 1.2-1.4 times as
    fast in it (EfficientNet-Lite0 and Wide-ResNet-50 at 224 x 224, docs/benchmarks.md), and
    not on GPUs (float32 without TF32: not measured faster)."""
    return bool(setting) if setting is not None else device.type == "cpu"


def resolve_saved_device(name: str) -> torch.device:
    """The device a saved model was fitted for, as a *preference*: where it is not available
    here (a model fitted on a GPU machine, loaded on a CPU-only host, or ``cuda:N`` on a machine
    with fewer GPUs) this warns and uses ``auto`` instead. Scores then differ from the fitting
    machine's only by float32 rounding (docs/determinism.md)."""
    try:
        return resolve_device(name)
    except ConfigError as exc:
        fallback = resolve_device("auto")
        reason = str(exc).split(": use ")[0]
        warnings.warn(f"the model was saved for {reason}; using {fallback} instead",
                      UserWarning, stacklevel=3)
        return fallback


# -- IEEE float32 scope ---------------------------------------------------------------------
def _new_api_leaves() -> List[Tuple[Any, str]]:
    """The per-backend ``fp32_precision`` settings (PyTorch >= 2.9) that may allow a reduced
    precision for float32 convolutions or products, as (namespace, attribute) pairs."""
    b = torch.backends
    spaces = [getattr(getattr(b, "cudnn", None), "conv", None),
              getattr(getattr(b, "cudnn", None), "rnn", None),
              getattr(getattr(b, "cuda", None), "matmul", None),
              getattr(getattr(b, "mkldnn", None), "matmul", None),
              getattr(getattr(b, "mkldnn", None), "conv", None)]
    return [(ns, "fp32_precision") for ns in spaces if hasattr(ns, "fp32_precision")]


def _legacy_flags() -> Dict[str, Any]:
    """The legacy settings, each None where it cannot be read (PyTorch refuses to read one
    that a mix of the legacy and new APIs left inconsistent: those are then left alone)."""
    flags: Dict[str, Any] = {}
    for key, read in (("cudnn", lambda: torch.backends.cudnn.allow_tf32),
                      ("matmul", torch.get_float32_matmul_precision)):
        try:
            flags[key] = read()
        except RuntimeError:
            flags[key] = None
    return flags


def _set_flags(legacy: Dict[str, Any], leaves: List[Any]) -> None:
    """Legacy settings first (their setters also reset the new API's values), then the new
    API's values themselves, so that both APIs read the same state (PyTorch checks that they
    agree)."""
    if legacy["cudnn"] is not None:
        torch.backends.cudnn.allow_tf32 = legacy["cudnn"]
    if legacy["matmul"] is not None:
        torch.set_float32_matmul_precision(legacy["matmul"])
    for (ns, attr), value in zip(_new_api_leaves(), leaves):
        setattr(ns, attr, value)


IEEE_LEGACY = {"cudnn": False, "matmul": "highest"}  # the legacy settings' IEEE values
_scope_lock = threading.Lock()
_scope_depth = 0
_scope_saved: Tuple[Dict[str, Any], List[Any]] = ({}, [])


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """Float32 convolutions and matrix products in IEEE float32 (no TF32 on the GPU, no bf16
    products on the CPU) inside the block, from any number of threads and nested: the first
    thread in saves the caller's settings and turns the reduced precisions off, the last one
    out restores them exactly (also when the block raises)."""
    global _scope_depth, _scope_saved
    with _scope_lock:
        if _scope_depth == 0:
            legacy = _legacy_flags()
            _scope_saved = (legacy, [getattr(ns, attr) for ns, attr in _new_api_leaves()])
            ieee = {k: None if v is None else IEEE_LEGACY[k] for k, v in legacy.items()}
            _set_flags(ieee, ["ieee"] * len(_scope_saved[1]))
        _scope_depth += 1
    try:
        yield
    finally:
        with _scope_lock:
            _scope_depth -= 1
            if _scope_depth == 0:
                _set_flags(*_scope_saved)
