"""The interface every scorer implements, and the registry by method name.

A scorer owns its patch embedder (how layer features become patch embeddings) and its fitted
state. Scores are "higher = more anomalous" everywhere (unlike scikit-learn's ``score_samples``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import (
    Any,
    Callable,
    ClassVar,
    Dict,
    FrozenSet,
    List,
    Optional,
    Sequence,
    Tuple,
    Type,
)

import torch
from torch import nn

from anomaly_hooks.embedding import PatchEmbedder
from anomaly_hooks.errors import ConfigError, ExportError, FitError, NotFittedError
from anomaly_hooks.extractor import LayerInfo
from anomaly_hooks.resources import grid_positions


class Scorer(ABC):
    """Fit on patch embeddings of good images; score patches (higher = more anomalous).

    A scorer owns everything about its method: its config section (``config_class``, validated
    by :meth:`validate_config`), its default layers per backbone, its memory estimate, its
    patch embedder and its model-file state. Nothing outside ``scorers/`` branches on a method.

    Life cycle: ``create`` -> ``begin`` -> ``partial_fit`` (any number of batches) ->
    ``finalize`` -> ``score``; or ``from_state`` for a saved model. A sharded fit (the
    ``distributed`` job) runs ``begin_shard`` -> ``partial_fit`` -> ``partial_state`` on each
    shard, then ``merge_states`` and ``finalize_merged`` on one fresh scorer. An update
    (:mod:`anomaly_hooks.updating`) merges the model's :meth:`fitted_state` with the new
    images' state (``begin_update`` -> ``partial_fit`` -> ``partial_state``) the same way, or,
    where the new scorer :meth:`joins` the model's images, takes them first (:meth:`join`).
    """

    method: ClassVar[str]
    config_class: ClassVar[type]  # dataclass of the method's config section (``cfg.<method>``)
    default_layers: ClassVar[Dict[str, List[str]]]  # backbone name -> layers; "*": any other
    memory_advice: ClassVar[str]  # which keys lower the memory of a fit, for the guard's error
    min_train_images: ClassVar[int] = 1
    # threshold.mode=all-images: training images needed to score each as if unseen
    min_out_of_sample_images: ClassVar[int] = 2
    # None: the scorer leaves any partition of the training images out exactly and cheaply
    # (each group by itself); K: it cross-fits, one model per fold, and the fit cuts the groups
    # into K folds (threshold.folds overrides either)
    out_of_sample_folds: ClassVar[Optional[int]] = None
    # model-file tensors that scoring never reads: Detector.load leaves them in the file, and
    # from_state gets a modelfile.StoredTensor for each, read (and verified) on demand
    on_demand_tensors: ClassVar[FrozenSet[str]] = frozenset()
    # model-file tensors that an update usually remakes rather than reads: Detector.load(
    # for_update=True) leaves them in the file too, and the scorer reads them at first use,
    # if ever
    remade_by_update: ClassVar[FrozenSet[str]] = frozenset()

    # -- what the method needs, before any scorer exists --------------------------------
    @classmethod
    def layers_for(cls, backbone_name: str) -> List[str]:
        """The layers to tap on ``backbone_name`` when the config gives none."""
        return list(cls.default_layers.get(backbone_name, cls.default_layers["*"]))

    @classmethod
    def shares_tile_positions(cls, section: Any) -> bool:
        """True when the method's section asks for statistics per *tile* position (a tiled
        model then gives the scorer its grid re-cut into tile windows, ``[B * T, D, th, tw]``,
        and stitches its patch scores back); False: one grid per image (the default)."""
        return False

    @staticmethod  # noqa: B027 (optional: no checks by default)
    def validate_config(section: Any) -> None:
        """Range and cross-field checks of the method's config section (raise ConfigError);
        the choices themselves are enums that omegaconf checks."""

    @classmethod
    def estimate_memory(cls, cfg: Any, layers: Sequence[LayerInfo],
                        input_size: Tuple[int, int], n_train: int) -> Dict[str, int]:
        """Peak bytes of a fit on ``n_train`` images by part, plus ``total`` and ``model``
        (what the fitted model holds); ``cfg`` is the whole config."""
        positions = grid_positions(layers, input_size)
        parts, model = cls.memory_parts(cfg, layers, input_size, positions, n_train)
        return {**parts, "total": sum(parts.values()), "model": model}

    @classmethod
    @abstractmethod
    def memory_parts(cls, cfg: Any, layers: Sequence[LayerInfo], input_size: Tuple[int, int],
                     positions: int, n_train: int) -> Tuple[Dict[str, int], int]:
        """The fit's peak bytes by part, and the fitted model's bytes, for ``positions`` patch
        positions (:meth:`estimate_memory` adds them up)."""

    def __init__(self, embedder: PatchEmbedder) -> None:
        self.embedder = embedder
        self.fitted = False
        self.grid: Optional[Tuple[int, int]] = None  # the embedding grid (h, w) of the fit
        self.n_train = 0
        self.want_out_of_sample = False
        # [n] int64: the group of each training image (fit order) that is left out with it;
        # None: each image alone
        self.oos_groups: Optional[torch.Tensor] = None
        # [n - first, h, w] out-of-sample patch scores of the training images from `first` on,
        # when the fit made them (a fit: all, first 0; an update: possibly the new images')
        self._oos_patch_scores: Optional[torch.Tensor] = None
        self._oos_first = 0

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
    def begin(self, n_images: int) -> None:  # noqa: B027 (optional: ignored by default)
        """Optional, before the first :meth:`partial_fit`: how many training images will come
        (lets a scorer choose its representation and size its buffers). Ignored by default."""

    @abstractmethod
    def partial_fit(self, embeddings: torch.Tensor) -> None:
        """Accumulate a batch of training embeddings ``[B, D, h, w]``."""

    @abstractmethod
    def finalize(self, progress: bool = False) -> None:
        """Turn the accumulated statistics into the fitted state (``progress``: show a progress
        bar for long steps such as the coreset selection)."""

    # -- sharded fitting (mergeable partial states) ---------------------------------------
    # A partial state is a dict of numpy arrays and plain ints / strings / tuples: Ray ships it
    # through its object store without pickling any class of ours, and numpy arrays zero-copy.
    def begin_shard(self, n_total: int, n_shard: int) -> None:
        """Before the first :meth:`partial_fit` of a shard of ``n_shard`` out of ``n_total``
        training images (every shard of one fit gets the same ``n_total``, so each makes the
        choices a single-process fit on ``n_total`` images would make)."""
        raise _unmergeable(self.method)

    def partial_state(self) -> Dict[str, Any]:
        """The shard's mergeable state after its :meth:`partial_fit` calls (the scorer is
        spent afterwards)."""
        raise _unmergeable(self.method)

    @classmethod
    def merge_states(cls, states: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        """One state from the shards' states, given in training-list order (associative: a tree
        of merges gives the same state as one merge)."""
        raise _unmergeable(cls.method)

    def finalize_merged(self, state: Dict[str, Any], device: torch.device,
                        progress: bool = False) -> None:
        """Fit this fresh scorer (from :meth:`create`) from a merged state, as :meth:`finalize`
        fits it from its own batches; the fitted tensors live on ``device``."""
        raise _unmergeable(self.method)

    # -- updates on new good images (anomaly_hooks.updating) --------------------------------
    # An update is a two-shard merge: the fitted model's own state (fitted_state) and the new
    # images' shard state, merged by merge_states and fitted by finalize_merged on a fresh
    # scorer, as a sharded fit does.
    def fitted_state(self) -> Dict[str, Any]:
        """The fitted model as a mergeable partial state (what :meth:`partial_state` gives
        for a shard of its training images): ``merge_states([fitted_state(), new])`` then
        ``finalize_merged`` is the model updated with the new images. Raises
        :class:`FitError` saying what to do where the model keeps too little for it."""
        raise FitError(f"a {self.method} model cannot be updated (its fitted state cannot be "
                       "merged with new images): refit on all the images")

    def training_embeddings(self) -> Optional[torch.Tensor]:
        """The training images' embeddings ``[n, D, h, w]`` in fit order where the fitted model
        keeps them (None by default): an update then groups the model's images with the new
        ones and scores every image out of sample afresh, as a fit on all of them does."""
        return None

    @property
    def keeps_training_embeddings(self) -> bool:
        """Whether :meth:`training_embeddings` gives them (without computing them)."""
        return False

    def begin_update(self, n_model: int, n_new: int) -> None:
        """Before the :meth:`partial_fit` calls of ``n_new`` new images joining a model fitted
        on ``n_model`` images (this scorer's state is then merged with the model's
        :meth:`fitted_state`). By default: a shard of a fit on all ``n_model + n_new``
        images (:meth:`begin_shard`)."""
        self.begin_shard(n_model + n_new, n_new)

    def joins(self, model: "Scorer") -> bool:
        """After :meth:`begin_update`: whether this scorer takes the fitted ``model``'s
        training images in place (:meth:`join`) instead of a merge with its
        :meth:`fitted_state`. Cheap: reads nothing. By default False."""
        return False

    def join(self, model: "Scorer") -> Callable[[], None]:
        """After :meth:`begin_update`, before the first :meth:`partial_fit`, where
        :meth:`joins` said so: take ``model``'s training images as this scorer's first ones,
        so that :meth:`partial_state` is the state of all the images and no merge copies them.
        Sets the state up and returns the reading of the model's part of it, to run (on any
        thread, beside the :meth:`partial_fit` calls) before :meth:`partial_state`."""
        raise NotImplementedError(f"{self.method} merges an update's states instead")

    # -- out-of-sample scores of the training images (threshold.mode=all-images) ----------
    def out_of_sample_unsupported(self) -> Optional[str]:
        """None when this scorer can score its own training images as if each were unseen
        (with the plain max-of-heatmap image score); else the reason, for the error."""
        return f"{self.method} cannot score its training images out of sample"

    def request_out_of_sample(self) -> None:
        """Before :meth:`begin`: make out-of-sample scores of the training images."""
        reason = self.out_of_sample_unsupported()
        if reason is not None:
            raise ConfigError(f"threshold.mode=all-images: {reason}; use threshold.mode=holdout")
        self.want_out_of_sample = True

    def set_out_of_sample_groups(self, groups: Optional[Sequence[int]]) -> None:
        """Before :meth:`finalize`: the group ``[n]`` of each training image in fit order;
        an image's out-of-sample score then comes from a model fitted without its whole group
        (None: without the image alone, the default)."""
        self.oos_groups = None if groups is None else torch.as_tensor(
            list(groups) if not hasattr(groups, "shape") else groups).long().cpu()

    @property
    def out_of_sample_whole_groups(self) -> bool:
        """Whether each call of the second pass (:meth:`out_of_sample_scores`) must get every
        image of the groups it scores (False: any batch will do)."""
        return False

    def out_of_sample_state(self) -> Dict[str, torch.Tensor]:
        """What the second pass needs beyond :meth:`state` (shipped to a sharded fit's actors
        with it): the groups, and whatever the method keeps for them."""
        return {} if self.oos_groups is None else {"oos.groups": self.oos_groups}

    def drop_out_of_sample_state(self) -> None:  # noqa: B027 (optional: nothing by default)
        """After the threshold step: free what only the out-of-sample scores needed."""

    def load_out_of_sample_state(self, tensors: Dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`out_of_sample_state`, on a scorer from :meth:`from_state`."""
        if "oos.groups" in tensors:
            self.set_out_of_sample_groups(tensors["oos.groups"])

    @property
    def out_of_sample_made_from(self) -> Optional[int]:
        """The first training image (fit order) whose out-of-sample scores :meth:`finalize`
        made and holds for :meth:`take_out_of_sample_scores` (0: every image's); None when it
        holds none."""
        return None if self._oos_patch_scores is None else self._oos_first

    def take_out_of_sample_scores(self, first: int = 0) -> Optional[torch.Tensor]:
        """After :meth:`finalize` (or :meth:`finalize_merged`): the out-of-sample patch scores
        ``[n - first, h, w]`` of the training images from ``first`` on (fit order) when the fit
        made them, handed over once; None when they need a second pass over the images
        (:meth:`out_of_sample_scores`). A fit makes every image's or none; a merged fit may
        make only those of its last images (an update's new ones: ``first`` = the model's
        image count)."""
        out, self._oos_patch_scores = self._oos_patch_scores, None
        start, self._oos_first = self._oos_first, 0
        if out is None or first < start:
            return None
        return out[first - start:]

    def out_of_sample_scores(self, embeddings: torch.Tensor,
                             images: Sequence[int]) -> torch.Tensor:
        """Out-of-sample patch scores ``[B, h, w]`` of the training images ``images`` (their
        indices in the fit order) from their embeddings ``[B, D, h, w]``: the second pass, for
        fits that keep too little to make them in :meth:`finalize`."""
        raise NotImplementedError(f"{self.method} makes its out-of-sample scores in the fit")

    # -- scoring --------------------------------------------------------------------------
    @abstractmethod
    def score(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Patch scores ``[B, h, w]`` (higher = more anomalous) of embeddings ``[B, D, h, w]``."""

    def image_scores(self, embeddings: torch.Tensor, patch_scores: torch.Tensor,
                     heatmaps: torch.Tensor) -> torch.Tensor:
        """Image scores ``[B]``: by default the max of each heatmap ``[B, H, W]``."""
        return heatmaps.flatten(1).amax(dim=1)

    # -- export -------------------------------------------------------------------------
    def export_module(self, **options: Any) -> "ScorerGraph":
        """The fitted state as a traceable :class:`ScorerGraph` for the ONNX export
        (:mod:`anomaly_hooks.export`); ``options`` are the method's own export choices."""
        raise ExportError(f"the {self.method} method has no ONNX export")

    # -- persistence ----------------------------------------------------------------------
    def state(self) -> tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """(tensors, JSON-able metadata) that :meth:`from_state` rebuilds the scorer from: the
        method's own (:meth:`method_state`), the embedder's tensors, the grid and the number of
        training images."""
        self.check_fitted()
        tensors, meta = self.method_state()
        return ({**tensors, **self.embedder.state_tensors()},
                {"grid": list(self.grid), "n_train": self.n_train, **meta})

    @abstractmethod
    def method_state(self) -> tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """The fitted state's own tensors and JSON-able metadata (see :meth:`state`)."""

    def summary(self) -> Dict[str, Any]:
        """A few JSON-able facts about the fitted state, for reports (e.g. the bank size)."""
        return {}

    def format_version(self) -> int:
        """The oldest model-file format that can hold this scorer's state."""
        return 1

    @classmethod
    def planned_format_version(cls, cfg: Any, layers: Sequence[LayerInfo],
                               n_train: int) -> int:
        """The oldest model-file format a fit of ``n_train`` images with the whole config
        ``cfg`` on ``layers`` will need (:meth:`format_version` of the fitted scorer), known
        before the fit: what ``anomaly-hooks fit --format-version`` checks before its work."""
        return 1

    def holding_on_demand(self) -> AbstractContextManager:
        """A context within which the tensors left in the model file (``on_demand_tensors``)
        are read once and held in memory, for work that reads them several times (an update);
        nothing by default."""
        return nullcontext()

    def bind_model_file(self, path: Path, file_checksum: str) -> None:  # noqa: B027
        """The model was just saved to ``path`` (recorded ``file_checksum``): tensors left in
        a model file are read from this one from now on. Nothing by default."""

    def check_fitted(self) -> None:
        """Raise :class:`NotFittedError` unless fitted."""
        if not self.fitted:
            raise NotFittedError(f"this {self.method} model is not fitted: call fit() first, or "
                                 "Detector.load() a saved model")


def _unmergeable(method: str) -> FitError:
    return FitError(f"{method} has no mergeable fit state: it cannot be fitted in shards")


class ScorerGraph(nn.Module):
    """A scorer's part of the exported predict graph (built by :meth:`Scorer.export_module`).

    ``forward(rows [B, P, D]) -> (patch scores [B, P], aux)``: ``aux`` is whatever
    :meth:`image_scores` needs besides (None by default). ``form`` names the variant exported
    (stored in the ONNX metadata, e.g. PaDiM's covariance form).
    """

    form: str = ""

    def image_scores(self, rows: torch.Tensor, scores: torch.Tensor, aux: Any,
                     peak: torch.Tensor) -> torch.Tensor:
        """Image scores ``[B]`` from the heatmaps' maxima ``peak`` ``[B]``: by default the
        maxima themselves (as :meth:`Scorer.image_scores`)."""
        return peak


_REGISTRY: Dict[str, Type[Scorer]] = {}


def register(cls: Type[Scorer]) -> Type[Scorer]:
    """Class decorator: make a scorer available by its ``method`` name."""
    _REGISTRY[cls.method] = cls
    return cls


def get_scorer(method: str) -> Type[Scorer]:
    """The scorer class registered under ``method``."""
    try:
        return _REGISTRY[str(method)]
    except KeyError:
        raise ConfigError(f"unknown method {method!r}; available: {available_methods()}") from None


def available_methods() -> List[str]:
    """Names of the registered methods."""
    return sorted(_REGISTRY)


def registered() -> Dict[str, Type[Scorer]]:
    """Method name -> scorer class, in registration order."""
    return dict(_REGISTRY)


def on_demand_tensors(for_update: bool = False) -> FrozenSet[str]:
    """Every registered method's ``on_demand_tensors`` (names are prefixed by method, so a
    file of one method never holds another's); ``for_update``: with their
    ``remade_by_update``."""
    return frozenset().union(*(cls.on_demand_tensors | (
        cls.remade_by_update if for_update else frozenset()) for cls in _REGISTRY.values()))
