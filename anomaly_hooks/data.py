"""Training/scoring sources -> batches of preprocessed images, with bad files reported by name.

Decoding and preprocessing run on ``data.num_workers`` threads ahead of the consumer (or, with
``data.worker_processes``, in DataLoader worker processes when the items are file paths), so
decoding overlaps with the backbone.
"""
from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader, Dataset

from anomaly_hooks.errors import DataError, ImageReadError
from anomaly_hooks.images import (
    decode_pool,
    describe,
    is_folder,
    is_image_file,
    read_image_reduced,
)
from anomaly_hooks.keptinputs import KeptImage
from anomaly_hooks.keptinputs import load as load_kept
from anomaly_hooks.preprocess import Preprocessor

log = logging.getLogger(__name__)


def list_images(folder: Path) -> List[Path]:
    """Image files directly inside ``folder`` (sorted by name); other files are reported.

    Raises:
        DataError: the folder is missing or holds no image file.
    """
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder of images")
    entries = sorted(folder.iterdir())
    images = [p for p in entries if is_image_file(p)]
    others = [p.name for p in entries if not is_image_file(p) and not p.name.startswith(".")]
    if others:
        log.warning("%s: ignoring %d non-image entries: %s", folder, len(others), others[:10])
    if not images:
        raise DataError(f"{folder}: no image files (looked for {sorted({'.png', '.jpg', '.bmp'})}"
                        " and other common suffixes)")
    return images


def train_folder(path: Path) -> Path:
    """An MVTec-style dataset root means its ``train/good`` folder; any other folder itself."""
    mvtec = path / "train" / "good"
    return mvtec if mvtec.is_dir() else path


def resolve_items(source: Any, *, training: bool = False) -> List[Any]:
    """A directory, a path, a list of paths/folders, or an iterable of images -> a list of items.

    Folders are expanded to their image files; with ``training=True`` an MVTec root is read from
    its ``train/good`` folder.
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if is_folder(path):
            return list_images(train_folder(path) if training else path)
        if not path.exists():
            raise DataError(f"{path}: no such file or folder")
        return [path]
    if isinstance(source, (bytes, bytearray)):
        raise DataError("raw bytes are not a supported source: decode them or give a path")
    try:
        items = list(source)
    except TypeError:
        raise DataError(f"cannot read images from a {type(source).__name__}: give a folder, a "
                        "list of paths, or an iterable of images") from None
    out: List[Any] = []
    for item in items:
        if isinstance(item, (str, os.PathLike)) and is_folder(item):
            out.extend(list_images(Path(item)))
        else:
            out.append(item)
    if not out:
        raise DataError("no images given")
    return out


def load_preprocessed(item: Any, pre: Preprocessor, max_pixels: int
                      ) -> Tuple[torch.Tensor, Tuple[int, int]]:
    """One image, decoded (a huge one at a reduced scale that keeps at least twice the resize:
    ``images.decode_reduced``) and preprocessed: ``[3, h, w]`` and the image's own (H, W).
    Only the preprocessed tensor outlives the call, whatever the image's size. A
    :class:`~anomaly_hooks.keptinputs.KeptImage` gives its kept network input where ``pre``
    made it (:func:`~anomaly_hooks.keptinputs.load`), else its original decoded."""
    if isinstance(item, KeptImage):
        kept = load_kept(item, pre)
        if kept is not None and kept[1][0] * kept[1][1] <= max_pixels:
            return kept
        item = item.original  # (over max_pixels: refused as the original would be)
    image, size = read_image_reduced(item, pre.min_source_size, max_pixels)
    return pre(image, size), size  # placed by its original size (a working frame needs it)


@dataclass
class Batch:
    """Preprocessed images ``[b, 3, h, w]``, their item indices and original (H, W) sizes."""

    indices: List[int]
    images: torch.Tensor
    sizes: List[Tuple[int, int]]
    errors: List[Tuple[int, str]]

    def pin_memory(self) -> "Batch":
        """The same batch with its images in page-locked memory (called by the DataLoader's
        pinning thread with ``pin_memory=True``)."""
        return Batch(self.indices, self.images.pin_memory() if self.indices else self.images,
                     self.sizes, self.errors)


class _ItemDataset(Dataset):
    def __init__(self, items: Sequence[Any], pre: Preprocessor, max_pixels: int) -> None:
        self.items, self.pre, self.max_pixels = items, pre, max_pixels

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Tuple[int, Optional[torch.Tensor], Tuple[int, int], str]:
        return _load_item(self.items, i, self.pre, self.max_pixels)


def _collate(samples: List[Tuple[int, Optional[torch.Tensor], Tuple[int, int], str]],
             pin_memory: bool = False) -> Batch:
    """One batch of loaded items; ``pin_memory``: its images stacked straight into
    page-locked memory (one copy)."""
    ok = [s for s in samples if s[1] is not None]
    images = torch.empty(0)
    if ok:
        first = ok[0][1]
        out = torch.empty((len(ok), *first.shape), dtype=first.dtype, pin_memory=pin_memory)
        images = torch.stack([s[1] for s in ok], out=out)
    return Batch([s[0] for s in ok], images, [s[2] for s in ok],
                 [(s[0], s[3]) for s in samples if s[1] is None])


def loader_workers(n_items: int, batch_size: int, num_workers: int) -> Tuple[int, int]:
    """The worker processes that decode ``n_items`` paths, and the share of a batch each decodes
    at a time: ``(workers, share)``.

    Each worker decodes about a ``1 / num_workers`` share of a batch (the largest divisor of
    ``batch_size`` not above ``ceil(batch_size / num_workers)``), so the first batch is ready
    after that share, not after a whole batch decoded by one worker. Workers are as many as
    there are shares to decode, at most ``num_workers``: 100 images in batches of 32 are 25
    shares of 4 for 8 workers, not 3 whole batches for 3 of them. Fewer items than one batch
    get none (the caller's thread decodes them): too few to pay for starting processes where a
    fork is dear (a large process copies its page tables).
    """
    most = max(1, -(-batch_size // max(1, num_workers)))
    share = max(d for d in range(1, most + 1) if batch_size % d == 0)
    shares = -(-n_items // share)
    if n_items < batch_size or shares < 2:
        return 0, batch_size
    return min(num_workers, shares), share


def iter_batches(items: Sequence[Any], pre: Preprocessor, *, batch_size: int, num_workers: int,
                 max_pixels: int, pin_memory: bool = False,
                 processes: bool = False) -> Iterator[Batch]:
    """Batches of ``batch_size`` items (preprocessed images, in item order); unreadable items
    come back in ``errors``. ``pin_memory`` (for a model on a GPU): the images come in
    page-locked memory, so that copying them to the GPU does not block the host.

    ``num_workers`` threads decode ahead of the consumer (:func:`thread_batches`; 0: the
    caller's thread, as it asks). ``processes``: DataLoader worker processes instead
    (:func:`process_batches`).
    """
    if processes:
        return process_batches(items, pre, batch_size=batch_size, num_workers=num_workers,
                               max_pixels=max_pixels, pin_memory=pin_memory)
    return thread_batches(items, pre, batch_size=batch_size, num_workers=num_workers,
                          max_pixels=max_pixels, pin_memory=pin_memory)


def _load_item(items: Sequence[Any], i: int, pre: Preprocessor, max_pixels: int
               ) -> Tuple[int, Optional[torch.Tensor], Tuple[int, int], str]:
    """``(i, image, (H, W), "")`` of item ``i``, or ``(i, None, (0, 0), message)``."""
    try:
        return (i, *load_preprocessed(items[i], pre, max_pixels), "")
    except ImageReadError as exc:
        return i, None, (0, 0), str(exc)


def thread_batches(items: Sequence[Any], pre: Preprocessor, *, batch_size: int,
                   num_workers: int, max_pixels: int, pin_memory: bool = False
                   ) -> Iterator[Batch]:
    """:func:`iter_batches` on ``num_workers`` threads (0: each batch decoded on the caller's
    thread when it is asked for).

    While the consumer works on a batch the threads decode the next one: at most two batches
    of items are submitted ahead, and the images being decoded at once hold at most
    ``images.DECODE_BUDGET_PIXELS`` between them (:func:`~anomaly_hooks.images.decode_pool`).
    No process starts (nothing forked: safe beside the caller's other threads, and no copy of
    a large process's page tables); on visa_macaroni1 a PaDiM EfficientNet-Lite0 fit on 200
    images took 5.0 s against 5.6 s with two worker processes. Closing the iterator early
    leaves the items not started unread.
    """
    n = len(items)

    def load(i: int) -> Tuple[int, Optional[torch.Tensor], Tuple[int, int], str]:
        return _load_item(items, i, pre, max_pixels)

    if num_workers < 1 or n < 2:
        for lo in range(0, n, batch_size):
            yield _collate([load(i) for i in range(lo, min(lo + batch_size, n))], pin_memory)
        return
    pending: deque = deque()  # the futures of items lo, lo + 1, ...
    with decode_pool(num_workers) as submit:  # closing the iterator cancels what is not started
        for lo in range(0, n, batch_size):
            while lo + len(pending) < min(n, lo + 2 * batch_size):  # this batch and the next
                pending.append(submit(load, lo + len(pending)))
            part = [pending.popleft().result() for _ in range(min(batch_size, n - lo))]
            yield _collate(part, pin_memory)


def process_batches(items: Sequence[Any], pre: Preprocessor, *, batch_size: int,
                    num_workers: int, max_pixels: int, pin_memory: bool = False
                    ) -> Iterator[Batch]:
    """:func:`iter_batches` in DataLoader worker processes (``data.worker_processes``), used
    only when every item is a path (in-memory images are not worth sending to another
    process); how many: :func:`loader_workers`.
    """
    all_paths = all(isinstance(it, (str, os.PathLike)) for it in items)
    workers, share = loader_workers(len(items) if all_paths else 0, batch_size, num_workers)
    # a batch of several parts is pinned where they are joined (that copy is needed anyway);
    # a batch of one part by the DataLoader's pinning thread
    loader = DataLoader(_ItemDataset(items, pre, max_pixels), batch_size=share,
                        shuffle=False, num_workers=workers, collate_fn=_collate,
                        persistent_workers=False, pin_memory=pin_memory and share == batch_size)
    parts: List[Batch] = []
    for part in loader:
        parts.append(part)
        if sum(len(p.indices) + len(p.errors) for p in parts) >= batch_size:
            yield _merge(parts, pin_memory)
            parts = []
    if parts:
        yield _merge(parts, pin_memory)


def _merge(parts: List[Batch], pin_memory: bool = False) -> Batch:
    if len(parts) == 1:
        part = parts[0]
        return part.pin_memory() if pin_memory and not part.images.is_pinned() else part
    images = [p.images for p in parts if p.indices]
    if images:
        out = torch.empty((sum(len(im) for im in images), *images[0].shape[1:]),
                          dtype=images[0].dtype, pin_memory=pin_memory)
        joined = torch.cat(images, out=out)
    else:
        joined = torch.empty(0)
    return Batch([i for p in parts for i in p.indices], joined,
                 [s for p in parts for s in p.sizes], [e for p in parts for e in p.errors])


def format_errors(errors: Iterable[str], limit: int = 20) -> str:
    """A bullet list of error messages (at most ``limit`` shown)."""
    errs = list(errors)
    lines = [f"  - {e}" for e in errs[:limit]]
    if len(errs) > limit:
        lines.append(f"  ... and {len(errs) - limit} more")
    return "\n".join(lines)


__all__ = ["Batch", "DataError", "describe", "format_errors", "iter_batches", "list_images",
           "process_batches", "resolve_items", "thread_batches", "train_folder"]
