"""Network inputs kept beside an original image, so that a model update reads them instead of
decoding and preprocessing the image again.

The service (``anomaly-hooks serve --keep-originals ... --keep-inputs``) writes, beside each
original upload it keeps, ``<request id>_input.safetensors``: the network input ``[3, h, w]``
float32 that its model computed from the upload, with what made it (the preprocessing, the
library and its version), the image's own (H, W) and a SHA-256 of the tensor's bytes. An update
from the results log (:mod:`anomaly_hooks.learning`) gives each such image as a
:class:`KeptImage` (a path of the original that also names its input); the loader
(:func:`anomaly_hooks.data.load_preprocessed`) takes the kept input where the updating model's
preprocessing, run by the same library version, made it -- the very tensor decoding the
original would give -- and otherwise decodes the original.

Why: the service decoded and preprocessed each image when it scored it, and on the CPU that
work is a large part of an update's pass over its new images: 100 of visa_macaroni1's
1500 x 1000 JPEGs, PaDiM EfficientNet-Lite0 on 2 cores, the pass took 0.7 s reading the kept
inputs against 1.3 s decoding the originals, the update 1.8 against 2.4 s
(``benchmarks/bench_loop.py --keep-inputs``). The cost: 4 x 3 x h x w bytes a kept result
(588 KiB at 224 x 224; those JPEGs are 107 KiB).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

log = logging.getLogger(__name__)

FORMAT = "anomaly_hooks.network_input"
VERSION = "1"


def producer() -> str:
    """What computes a network input here: the library and its version (a kept input is taken
    only where the same produced it, so that it is the tensor this process would compute)."""
    return f"torch {torch.__version__}"


def preprocess_key(pre: Any) -> str:
    """The preprocessing as canonical JSON (``pre``: a
    :class:`~anomaly_hooks.preprocess.Preprocessor`)."""
    return json.dumps(pre.as_dict(), sort_keys=True, separators=(",", ":"))


def encode(tensor: torch.Tensor, pre: Any, size: Tuple[int, int]) -> bytes:
    """The file of one network input ``tensor`` ``[3, h, w]`` float32 made by ``pre`` from an
    image of (H, W) ``size``: a safetensors file with the metadata above."""
    x = tensor.detach().to("cpu", torch.float32).contiguous()
    from safetensors.torch import save

    meta = {"format": FORMAT, "version": VERSION, "preprocess": preprocess_key(pre),
            "producer": producer(), "size": json.dumps([int(size[0]), int(size[1])]),
            "sha256": _digest(x)}
    return save({"input": x}, metadata=meta)


def _digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class KeptImage(os.PathLike):
    """An original image (``os.fspath`` gives its path: it names, reports and decodes as that
    path) with the file of its kept network ``input``."""

    original: Path
    input: Path

    def __fspath__(self) -> str:
        return os.fspath(self.original)

    def __str__(self) -> str:
        return os.fspath(self.original)


def mismatch(path: Path, pre: Any) -> Optional[str]:
    """Why the kept input at ``path`` is not the one ``pre`` would compute here (another
    preprocessing, library version or file format), from its header alone; None: it is."""
    try:
        from safetensors import safe_open

        with safe_open(os.fspath(path), framework="pt") as fh:
            return _made_otherwise(fh.metadata() or {}, pre)
    except Exception as exc:  # noqa: BLE001 (any unreadable file: the original is decoded)
        return f"unreadable ({type(exc).__name__}: {exc})"


def _made_otherwise(meta: Dict[str, str], pre: Any) -> Optional[str]:
    """:func:`mismatch` of a file's metadata ``meta``."""
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        return "not a network-input file of this version"
    if meta.get("preprocess") != preprocess_key(pre):
        return "made by another preprocessing"
    if meta.get("producer") != producer():
        return f"made by {meta.get('producer')}, not {producer()}"
    return None


def load(item: KeptImage, pre: Any) -> Optional[Tuple[torch.Tensor, Tuple[int, int]]]:
    """The kept network input ``[3, h, w]`` of ``item`` and the image's (H, W), where ``pre``
    made it here and the file is whole (its SHA-256 checked); else None (a damaged file is
    logged), and the caller decodes the original."""
    try:
        from safetensors import safe_open

        with safe_open(os.fspath(item.input), framework="pt") as fh:
            meta = fh.metadata() or {}
            if _made_otherwise(meta, pre) is not None:
                return None
            x = fh.get_tensor("input")
        size = tuple(int(v) for v in json.loads(meta["size"]))
    except Exception as exc:  # noqa: BLE001 (any unreadable file: the original is decoded)
        log.warning("%s: kept network input unreadable (%s: %s); decoding the original",
                    item.input, type(exc).__name__, exc)
        return None
    if x.dtype != torch.float32 or tuple(x.shape) != (3, *pre.input_size) or len(size) != 2 \
            or _digest(x.contiguous()) != meta.get("sha256"):
        log.warning("%s: kept network input damaged (checksum or shape); decoding the "
                    "original", item.input)
        return None
    return x, (size[0], size[1])
