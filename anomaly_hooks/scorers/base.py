"""The interface every scorer implements, and the registry by method name.

A scorer owns its patch embedder (how layer features become patch embeddings) and its fitted
state. Scores are "higher = more anomalous" everywhere (unlike scikit-learn's ``score_samples``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Dict, List, Sequence, Type

import torch

from anomaly_hooks.embedding import PatchEmbedder
from anomaly_hooks.extractor import LayerInfo


class NotFittedError(RuntimeError):
    """A model was used before ``fit``."""


class Scorer(ABC):
    """Fit on patch embeddings of good images; score patches (higher = more anomalous).

    Life cycle: ``create`` -> ``partial_fit`` (any number of batches) -> ``finalize`` ->
    ``score``; or ``from_state`` for a saved model.
    """

    method: ClassVar[str]
    default_layers: ClassVar[List[str]]
    min_train_images: ClassVar[int] = 1

    def __init__(self, embedder: PatchEmbedder) -> None:
        self.embedder = embedder
        self.fitted = False

    # -- construction ---------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def create(cls, cfg: Any, layers: Sequence[LayerInfo], backbone_name: str,
               seed: int) -> "Scorer":
        """An unfitted scorer for the method's config section ``cfg``; ``seed`` drives every
        random choice it makes."""

    @classmethod
    @abstractmethod
    def from_state(cls, cfg: Any, layers: Sequence[LayerInfo], tensors: Dict[str, torch.Tensor],
                   meta: Dict[str, Any], device: torch.device) -> "Scorer":
        """A fitted scorer from what :meth:`state` returned."""

    # -- fitting --------------------------------------------------------------------------
    def begin(self, n_images: int) -> None:
        """Optional, before the first :meth:`partial_fit`: how many training images will come
        (lets a scorer choose its representation and size its buffers). Ignored by default."""

    @abstractmethod
    def partial_fit(self, embeddings: torch.Tensor) -> None:
        """Accumulate a batch of training embeddings ``[B, D, h, w]``."""

    @abstractmethod
    def finalize(self, progress: bool = False) -> None:
        """Turn the accumulated statistics into the fitted state (``progress``: show a progress
        bar for long steps such as the coreset selection)."""

    # -- scoring --------------------------------------------------------------------------
    @abstractmethod
    def score(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Patch scores ``[B, h, w]`` (higher = more anomalous) of embeddings ``[B, D, h, w]``."""

    def image_scores(self, embeddings: torch.Tensor, patch_scores: torch.Tensor,
                     heatmaps: torch.Tensor) -> torch.Tensor:
        """Image scores ``[B]``: by default the max of each heatmap ``[B, H, W]``."""
        return heatmaps.flatten(1).amax(dim=1)

    # -- persistence ----------------------------------------------------------------------
    @abstractmethod
    def state(self) -> tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """(tensors, JSON-able metadata) that :meth:`from_state` rebuilds the scorer from."""

    def format_version(self) -> int:
        """The oldest model-file format that can hold this scorer's state."""
        return 1

    def check_fitted(self) -> None:
        """Raise :class:`NotFittedError` unless fitted."""
        if not self.fitted:
            raise NotFittedError(f"this {self.method} model is not fitted: call fit() first, or "
                                 "Detector.load() a saved model")


_REGISTRY: Dict[str, Type[Scorer]] = {}


def register(cls: Type[Scorer]) -> Type[Scorer]:
    """Class decorator: make a scorer available by its ``method`` name."""
    _REGISTRY[cls.method] = cls
    return cls


def get_scorer(method: str) -> Type[Scorer]:
    """The scorer class registered under ``method``."""
    try:
        return _REGISTRY[method]
    except KeyError:
        raise ValueError(f"unknown method {method!r}; available: {available_methods()}") from None


def available_methods() -> List[str]:
    """Names of the registered methods."""
    return sorted(_REGISTRY)
