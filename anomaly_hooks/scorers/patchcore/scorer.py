"""PatchCore (Roth et al. 2022): a coreset memory bank of patch features, nearest-neighbour
distance.

Fit: every training patch embedding goes into a bank, reduced by the greedy k-center coreset
(:mod:`anomaly_hooks.scorers.patchcore.coreset`). With ``prereduce`` set (high resolution), each
image's patches are first reduced by the same rule as the image arrives
(:mod:`anomaly_hooks.scorers.patchcore.prereduce`), so the final selection runs over a small
multiple of the bank, not over every patch. With ``max_bank_points`` set, the fit is
*bounded*: each batch's patches are reduced as they arrive and the kept set is re-reduced
whenever it exceeds the budget (merge-reduce), so peak memory does not depend on the number of
training images.
Score: L2 distance (not squared) of each patch to its nearest bank feature.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from anomaly_hooks.devices import synchronize
from anomaly_hooks.embedding import PatchEmbedder
from anomaly_hooks.errors import FitError
from anomaly_hooks.extractor import LayerInfo
from anomaly_hooks.resources import batch_bytes
from anomaly_hooks.scorers.base import Scorer, ScorerGraph, register
from anomaly_hooks.scorers.patchcore import partial
from anomaly_hooks.scorers.patchcore.config import PatchCoreConfig, validate
from anomaly_hooks.scorers.patchcore.coreset import (
    StreamingCoreset,
    coreset_size,
    greedy_coreset,
    projection_matrix,
)
from anomaly_hooks.scorers.patchcore.crossfit import (
    cross_fit_patch_scores,
    fold_banks,
    knn_scores,
)
from anomaly_hooks.scorers.patchcore.export import patchcore_graph
from anomaly_hooks.scorers.patchcore.knn import NearestNeighbors
from anomaly_hooks.scorers.patchcore.oos import foreign_neighbor_distances
from anomaly_hooks.scorers.patchcore.prereduce import PerImageReduction
from anomaly_hooks.threshold import out_of_sample

log = logging.getLogger(__name__)

SEED_PROJECTION = 11
SEED_CORESET = 12
OOS_QUERY_CHUNK = 65536  # training patches per out-of-sample search


def build_embedder(cfg: Any, layers: Sequence[LayerInfo], seed: int,
                   projection: Optional[torch.Tensor] = None) -> PatchEmbedder:
    """PatchCore embedder: local 3x3 averaging, bilinear upsampling, optional reduction."""
    total = sum(info.channels for info in layers)
    pool_dim = None
    if cfg.reduce_dim is not None and cfg.reduce_dim < total:
        if cfg.reduce_method == "pool":
            pool_dim = cfg.reduce_dim
        elif projection is None:
            projection = projection_matrix(total, cfg.reduce_dim, seed + SEED_PROJECTION)
    return PatchEmbedder(layers, upsample="bilinear", local_pool=cfg.local_pool,
                         projection=projection, pool_dim=pool_dim)


@register
class PatchCoreScorer(Scorer):
    """Coreset memory bank; patch score = distance to the nearest bank feature."""

    method = "patchcore"
    config_class = PatchCoreConfig
    validate_config = staticmethod(validate)
    # stride 8 and 16 taps: ResNets' layer2-3; EfficientNet-Lite0's blocks 4, 10
    default_layers = {"*": ["layer2", "layer3"], "efficientnet_lite0": ["_blocks.4", "_blocks.10"]}
    memory_advice = ("set patchcore.max_bank_points (bounded-memory fit, e.g. 200000), lower "
                     "patchcore.reduce_dim, or fit on fewer or smaller images")
    min_train_images = 1
    # out-of-sample scores cross-fit 5 folds: each fold's images are scored by the coreset of
    # the other folds (scorers/patchcore/crossfit.py)
    out_of_sample_folds = 5

    def __init__(self, embedder: PatchEmbedder, cfg: Any, seed: int) -> None:
        super().__init__(embedder)
        self.cfg = cfg
        self.seed = seed
        self._chunks: List[torch.Tensor] = []
        self._stream: Optional[StreamingCoreset] = None
        if cfg.max_bank_points is not None:
            self._stream = StreamingCoreset(
                ratio=cfg.coreset_ratio if cfg.coreset_count is None else None,
                count=cfg.coreset_count, max_points=cfg.max_bank_points,
                projection_dim=cfg.projection_dim, seed=seed + SEED_CORESET)
        self.bank: Optional[torch.Tensor] = None  # [M, D]
        self.bank_image: Optional[torch.Tensor] = None  # [M] int32: each point's source image
        self.index: Optional[NearestNeighbors] = None
        self.n_patches = 0
        self._expected: Optional[int] = None  # training images announced by begin()
        self._buffer: Optional[torch.Tensor] = None  # [capacity, D]: every patch, in place
        # a sharded fit's fold banks (second pass of cross-fitted scores) and their indexes
        self._fold_banks: List[torch.Tensor] = []
        self._fold_index: Dict[int, NearestNeighbors] = {}
        self._reducer: Optional[PerImageReduction] = None  # prereduce: made at the first batch

    @classmethod
    def memory_parts(cls, cfg: Any, layers: Sequence[LayerInfo], input_size: Tuple[int, int],
                     positions: int, n_train: int) -> Tuple[Dict[str, int], int]:
        pc = cfg.patchcore
        total_channels = sum(info.channels for info in layers)
        d = pc.reduce_dim if pc.reduce_dim and pc.reduce_dim < total_channels else total_channels
        patches = n_train * positions
        bank_rows = (min(patches, pc.coreset_count) if pc.coreset_count is not None
                     else math.ceil(pc.coreset_ratio * patches))
        kept = patches
        if pc.prereduce is not None:  # what the per-image reduction keeps
            kept = min(patches, math.ceil(pc.prereduce * bank_rows) + n_train)
        if pc.max_bank_points is not None:
            kept = min(kept, pc.max_bank_points) + cfg.data.batch_size * positions
        bank = bank_rows * d * (2 if pc.bank_dtype == "float16" else 4)
        # cross-fitted out-of-sample scores select each fold's coreset from a copy of the
        # other folds' patches
        fold_copy = kept * d * 4 if out_of_sample(cfg.threshold) else 0
        return ({"patch features before the coreset": kept * d * 4,
                 "patches of the other folds (cross-fitted threshold scores)": fold_copy,
                 # projected features, their bound rows, float64 norms and distances, and two
                 # [8192, pool 2048] float32 blocks of the batched selection
                 "coreset selection (projection, distances)":
                     kept * (2 * (pc.projection_dim or d) + 6) * 4 + 2 * 8192 * 2048 * 4,
                 "model (memory bank + index)": 2 * bank,
                 "batch": batch_bytes(layers, input_size, cfg.data.batch_size, d)}, bank)

    @classmethod
    def create(cls, cfg: Any, layers: Sequence[LayerInfo], backbone_name: str,
               seed: int) -> "PatchCoreScorer":
        return cls(build_embedder(cfg, layers, seed), cfg, seed)

    # -- fitting --------------------------------------------------------------------------
    def begin(self, n_images: int) -> None:
        """``n_images`` training images will come: the one-shot fit writes every patch into
        one ``[n_images * h * w, D]`` buffer, allocated at the first batch (when the grid is
        known), so that the features are never held twice (no concatenation at the end)."""
        if self.n_train or self.fitted:
            raise RuntimeError("begin() comes before the first partial_fit()")
        self._expected = int(n_images)

    def partial_fit(self, embeddings: torch.Tensor) -> None:
        b, d, h, w = embeddings.shape
        if self.grid is None:
            self.grid = (h, w)
        elif self.grid != (h, w):
            raise ValueError(f"embedding grid {(h, w)} differs from the first batch's {self.grid}")
        patches = embeddings.permute(0, 2, 3, 1).reshape(-1, d).float()
        first_image = self.n_train
        self.n_train += b
        start, self.n_patches = self.n_patches, self.n_patches + patches.shape[0]
        if self.cfg.prereduce is not None:
            kept = self._reduction().add(patches.view(b, h * w, d), first_image,
                                         keep=self._stream is None)
            if self._stream is not None:
                self._stream.add(kept, represented=b * h * w)
        elif self._stream is not None:
            self._stream.add(patches)
        elif self._expected is not None and self._expected * h * w >= self.n_patches:
            if self._buffer is None:
                self._buffer = torch.empty(self._expected * h * w, d, dtype=torch.float32,
                                           device=patches.device)
            self._buffer[start:self.n_patches] = patches
        else:  # no begin(), or more images than announced: keep the batches, join them later
            if self._buffer is not None:
                self._chunks.append(self._buffer[:start])
                self._buffer, self._expected = None, None
            self._chunks.append(patches)

    def finalize(self, progress: bool = False) -> None:
        if self.n_train < self.min_train_images:
            raise FitError("PatchCore needs at least one training image")
        start = time.perf_counter()
        features = None
        if self._stream is not None:
            bank = self._stream.finalize(progress)
        elif self._reducer is not None:
            bank, self.bank_image = self._select_reduced(progress)
        else:
            features = self._features()
            k = coreset_size(features.shape[0], self.cfg.coreset_ratio if self.cfg.coreset_count
                             is None else None, self.cfg.coreset_count)
            idx = greedy_coreset(features, k, projection_dim=self.cfg.projection_dim,
                                 seed=self.seed + SEED_CORESET, progress=progress)
            bank = features[idx]  # advanced indexing: already a new tensor
            # patches come image by image, h * w of each, in fit order
            self.bank_image = torch.div(idx.cpu(), self.grid[0] * self.grid[1],
                                        rounding_mode="floor").to(torch.int32)
        synchronize(bank.device)  # the selection's queued GPU work is the coreset's time
        selected = time.perf_counter()
        self.set_bank(bank)
        synchronize(bank.device)
        self.finalize_timings_ = {"coreset": selected - start,
                                  "search index": time.perf_counter() - selected}
        self._stream = self._reducer = None
        self.fitted = True
        if features is not None and self.want_out_of_sample:
            # every training patch is still here: no second pass over the images
            mark = time.perf_counter()
            per_image = self.grid[0] * self.grid[1]
            if self.oos_groups is None:  # leave one image out of the search
                ids = torch.arange(self.n_train, dtype=torch.int32).repeat_interleave(per_image)
                scores = self._foreign_scores(features, ids)
            else:
                scores = cross_fit_patch_scores(
                    features, self._folds(), per_image, self._bank_size, self._fold_search,
                    self.cfg.k, self.cfg.projection_dim, self.seed + SEED_CORESET, progress)
            self._oos_patch_scores = scores.reshape(self.n_train, *self.grid)
            synchronize(bank.device)
            self.finalize_timings_["out-of-sample scores"] = time.perf_counter() - mark
        del features

    def _reduction(self) -> PerImageReduction:
        """The per-image pre-reduction (``prereduce``), made at the first batch."""
        if self._reducer is None:
            c = self.cfg
            self._reducer = PerImageReduction(
                c.prereduce, c.coreset_ratio if c.coreset_count is None else None,
                c.coreset_count, self._expected, c.projection_dim, self.seed + SEED_CORESET)
        return self._reducer

    def _select_reduced(self, progress: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """The bank ``[k, D]`` selected from the pre-reduced points (the final size is the
        share of *all* the training patches) and each bank point's image ``[k]`` int32. With
        cross-fitted out-of-sample scores, each fold's bank comes from the other folds'
        pre-reduced points too (a point was reduced with its own image only, so no fold's
        points were chosen in view of another fold): the threshold's second pass uses them."""
        kept, images = self._reducer.take()
        k = min(kept.shape[0], coreset_size(self.n_patches, self.cfg.coreset_ratio if
                                            self.cfg.coreset_count is None else None,
                                            self.cfg.coreset_count))
        idx = greedy_coreset(kept, k, projection_dim=self.cfg.projection_dim,
                             seed=self.seed + SEED_CORESET, progress=progress)
        if self.want_out_of_sample and self.oos_groups is not None:
            self._make_fold_banks(kept, images.long(), progress)
        return kept[idx], images[idx.cpu()]

    def _make_fold_banks(self, candidates: torch.Tensor, image: torch.Tensor,
                         progress: bool) -> None:
        """Each fold's bank from the candidates ``[M, D]`` of the other folds (``image``
        ``[M]``: each candidate's image), of the size a fit on those folds' patches keeps."""
        folds = self._folds()
        per_image = self.grid[0] * self.grid[1]
        images_in = torch.bincount(folds, minlength=int(folds.max()) + 1)
        sizes = [self._bank_size(int(self.n_train - n) * per_image) for n in images_in.tolist()]
        self._fold_banks = fold_banks(candidates, folds[image.cpu()], sizes,
                                      self.cfg.projection_dim, self.seed + SEED_CORESET,
                                      progress)

    # -- out-of-sample scores of the training images ----------------------------------------
    def out_of_sample_unsupported(self) -> Optional[str]:
        if self.cfg.reweight:
            return "patchcore.reweight (eq. 7) has no skip-own-image variant"
        if self.cfg.max_bank_points is not None:
            return ("the bounded fit (patchcore.max_bank_points) does not record which image "
                    "each bank point came from")
        return None

    def _foreign_scores(self, patches: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Out-of-sample patch scores ``[N]`` of training patches ``[N, D]`` of images ``ids``
        ``[N]``: mean distance to the ``k`` nearest bank points of other images."""
        out = torch.empty(patches.shape[0], dtype=torch.float32, device=patches.device)
        for lo in range(0, patches.shape[0], OOS_QUERY_CHUNK):
            hi = lo + OOS_QUERY_CHUNK
            dist = foreign_neighbor_distances(self.index, self.bank_image, patches[lo:hi],
                                              ids[lo:hi], self.cfg.k)
            out[lo:hi] = dist.mean(dim=1)
        return out

    def _bank_size(self, n_patches: int) -> int:
        """The bank a fit on ``n_patches`` patches keeps."""
        return partial.final_size(self.cfg, n_patches)

    def _fold_search(self, bank: torch.Tensor) -> NearestNeighbors:
        """The search index a fit with ``bank`` builds (dtype and backend of the config)."""
        dtype = torch.float16 if self.cfg.bank_dtype == "float16" else torch.float32
        return NearestNeighbors(bank.to(dtype).contiguous(), backend=self.cfg.knn_backend,
                                **self._index_params())

    def _folds(self) -> torch.Tensor:
        """The fold ``[n]`` of each training image (the out-of-sample groups, numbered 0..)."""
        folds = self.oos_groups
        if folds.numel() != self.n_train:
            raise FitError(f"{folds.numel()} out-of-sample folds given for {self.n_train} "
                           "training images")
        return torch.unique(folds, return_inverse=True)[1]

    def out_of_sample_scores(self, embeddings: torch.Tensor,
                             images: Sequence[int]) -> torch.Tensor:
        """Out-of-sample patch scores ``[B, h, w]`` of training images ``images`` (indices in
        the fit order) from their embeddings ``[B, D, h, w]``: from the bank of their fold's
        fit-without-it (a sharded fit, :meth:`finalize_merged`), or without folds from the
        nearest bank points of other images."""
        self.check_fitted()
        b, _, h, w = embeddings.shape
        ids = torch.as_tensor(list(images), dtype=torch.long)
        return self._held_out_scores(self._patches(embeddings), ids).reshape(b, h, w)

    def _held_out_scores(self, patches: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Out-of-sample scores ``[B * h * w]`` of the patches ``[B * h * w, D]`` of training
        images ``ids`` ``[B]`` (fit order), image by image."""
        per_image = self.grid[0] * self.grid[1]
        if self.oos_groups is None:
            if self.bank_image is None:
                raise FitError("this bank records no source images (a bounded fit, or a model "
                               "file written before they were saved): use "
                               "threshold.mode=holdout")
            return self._foreign_scores(patches,
                                        ids.to(torch.int32).repeat_interleave(per_image))
        if not self._fold_banks:
            raise FitError("no fold banks: the cross-fitted scores of a single-process fit are "
                           "made in finalize()")
        fold = self._folds()[ids].repeat_interleave(per_image).to(patches.device)
        out = torch.empty(patches.shape[0], dtype=torch.float32, device=patches.device)
        for f in torch.unique(fold).tolist():
            if f not in self._fold_index:
                self._fold_index[f] = self._fold_search(self._fold_banks[f])
            mine = torch.nonzero(fold == f).flatten()
            out[mine] = knn_scores(self._fold_index[f], patches[mine], self.cfg.k)
        return out

    def out_of_sample_state(self) -> Dict[str, torch.Tensor]:
        return {**super().out_of_sample_state(),
                **{f"oos.fold_bank.{f}": bank for f, bank in enumerate(self._fold_banks)}}

    def drop_out_of_sample_state(self) -> None:
        self._fold_banks, self._fold_index = [], {}

    def load_out_of_sample_state(self, tensors: Dict[str, torch.Tensor]) -> None:
        super().load_out_of_sample_state(tensors)
        device = self.bank.device
        self._fold_banks = [tensors[f"oos.fold_bank.{f}"].to(device)
                            for f in range(sum(k.startswith("oos.fold_bank.") for k in tensors))]
        self._fold_index = {}

    # -- updates (anomaly_hooks.updating) ---------------------------------------------------
    def fitted_state(self) -> Dict[str, Any]:
        """The bank as a merged state's candidates (merge-reduce): an update selects the new
        bank from the current bank and every patch of the new images by the same greedy rule,
        at the size a fit on all the images' patches keeps (``n_patches`` counts them all).
        Each bank point keeps its image (None for a bank that records none: a bounded fit, or
        a file written before they were saved)."""
        self.check_fitted()
        image = (None if self.bank_image is None
                 else self.bank_image.to(torch.int32).cpu().contiguous().numpy())
        return {"form": "coreset", "n_train": int(self.n_train),
                "n_patches": int(self.n_patches), "grid": tuple(self.grid),
                "features": self.bank.detach().float().cpu().contiguous().numpy(),
                "image": image}

    def begin_update(self, n_model: int, n_new: int) -> None:
        """The new images' state keeps every patch (a shard of a fit on the new images
        alone): they all join the current bank as candidates of the final selection."""
        self.begin_shard(n_new, n_new)

    # -- sharded fitting (scorers/patchcore/partial.py) ------------------------------------
    def begin_shard(self, n_total: int, n_shard: int) -> None:
        """A shard of ``n_shard`` of the ``n_total`` training images: its state keeps its share
        of the final bank (see :mod:`anomaly_hooks.scorers.patchcore.partial`)."""
        self._n_total = int(n_total)
        self.begin(n_shard)

    def partial_state(self) -> Dict[str, Any]:
        if not self.n_train:
            raise FitError("this PatchCore shard got no training image")
        bounded = self._stream is not None
        images = None
        if bounded:  # what the stream kept (<= max_bank_points)
            features, self._stream = torch.cat(self._stream.kept), None
        elif self._reducer is not None:  # what the per-image reduction kept, in image order
            features, images = self._reducer.take()
            self._reducer = None
        else:
            features = self._features()
        n_total = getattr(self, "_n_total", self.n_train)
        return partial.shard_state(features, self.cfg, self.seed + SEED_CORESET, self.n_train,
                                   n_total, self.grid, with_images=not bounded, images=images)

    @classmethod
    def merge_states(cls, states: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        return partial.merge(states)

    def finalize_merged(self, state: Dict[str, Any], device: torch.device,
                        progress: bool = False) -> None:
        self.grid = tuple(state["grid"])
        self.n_train, self.n_patches = int(state["n_train"]), int(state["n_patches"])
        bank, self.bank_image = partial.select(state, self.cfg, self.seed + SEED_CORESET,
                                               device, progress)
        self.set_bank(bank)
        self._stream = None
        self.fitted = True
        if not self.want_out_of_sample or (self.oos_groups is None
                                           and state.get("complete_from") is None):
            return  # nothing to make here: the second pass scores every image
        features = torch.from_numpy(np.ascontiguousarray(state["features"])).to(device)
        if self.oos_groups is not None:
            if state.get("image") is None:
                raise FitError("the merged state records no source images: cross-fitted "
                               "out-of-sample scores need them (use threshold.mode=holdout)")
            # each fold's bank from the merged candidates of the other folds
            image = torch.from_numpy(np.asarray(state["image"])).long()
            self._make_fold_banks(features, image, progress)
        self._score_complete_tail(state, features)

    def _score_complete_tail(self, state: Dict[str, Any], features: torch.Tensor) -> None:
        """The out-of-sample scores of the merged images whose every patch is in the state
        (an update's new images), from those patches: no second pass over them. The other
        images (the current bank's, a reduced shard's) need the second pass."""
        first = state.get("complete_from")
        if first is None or (self.oos_groups is None and self.bank_image is None):
            return
        count = (self.n_train - first) * self.grid[0] * self.grid[1]  # the tail's rows
        if not 0 < count <= features.shape[0]:
            return
        scores = self._held_out_scores(features[features.shape[0] - count:],
                                       torch.arange(first, self.n_train))
        self._oos_patch_scores = scores.reshape(self.n_train - first, *self.grid)
        self._oos_first = first

    def _features(self) -> torch.Tensor:
        """All training patches ``[N, D]``: the in-place buffer (a view of its filled rows:
        fewer images than announced leave its tail unused), else the kept batches joined."""
        if self._buffer is not None:
            features, self._buffer = self._buffer[:self.n_patches], None
            return features
        return self._concatenate()

    def _concatenate(self) -> torch.Tensor:
        """The kept batches joined ``[N, D]``, freeing each chunk as it is copied (on the CPU
        the output's pages are only touched as they are written, so resident memory stays
        ~1x; on a GPU the output is reserved whole: 2x at the end, which ``begin()`` avoids)."""
        n = sum(c.shape[0] for c in self._chunks)
        out = torch.empty(n, self._chunks[0].shape[1], dtype=torch.float32,
                          device=self._chunks[0].device)
        start = 0
        while self._chunks:
            chunk = self._chunks.pop(0)
            out[start:start + chunk.shape[0]] = chunk
            start += chunk.shape[0]
            del chunk
        return out

    def set_bank(self, bank: torch.Tensor) -> None:
        """Install ``bank`` ``[k, D]`` as the memory bank (stored in ``patchcore.bank_dtype``)
        and build its search index (``patchcore.knn_backend``)."""
        dtype = torch.float16 if self.cfg.bank_dtype == "float16" else torch.float32
        self.bank = bank.to(dtype).contiguous()
        # the index gets the bank itself: a float16 bank is searched on its own values,
        # without a float32 copy (which would make it 1.5x a float32 bank, not 0.5x)
        self.index = NearestNeighbors(self.bank, backend=self.cfg.knn_backend,
                                      **self._index_params())

    def _index_params(self) -> Dict[str, Any]:
        c = self.cfg
        per_image = None if self.grid is None else self.grid[0] * self.grid[1]
        return {"nlist": c.nlist, "nprobe": c.nprobe, "hnsw_m": c.hnsw_m, "ef_search": c.ef_search,
                "seed": self.seed, "queries_per_image": per_image}

    # -- scoring --------------------------------------------------------------------------
    def _patches(self, embeddings: torch.Tensor) -> torch.Tensor:
        b, d, h, w = embeddings.shape
        if (h, w) != self.grid or d != self.bank.shape[1]:
            raise ValueError(f"embeddings {tuple(embeddings.shape)} do not match the fitted grid "
                             f"{self.grid} and dimension {self.bank.shape[1]}")
        return embeddings.permute(0, 2, 3, 1).reshape(-1, d).float()

    def score(self, embeddings: torch.Tensor) -> torch.Tensor:
        self.check_fitted()
        b, _, h, w = embeddings.shape
        dist, _ = self.index.search(self._patches(embeddings), self.cfg.k)
        return dist.mean(dim=1).reshape(b, h, w)

    def image_scores(self, embeddings: torch.Tensor, patch_scores: torch.Tensor,
                     heatmaps: torch.Tensor) -> torch.Tensor:
        """Max of the heatmap; with ``reweight`` scaled by the paper's eq. 7 weight."""
        scores = heatmaps.flatten(1).amax(dim=1)
        if not self.cfg.reweight:
            return scores
        return scores * self.reweight_factors(embeddings, patch_scores)

    def reweight_factors(self, embeddings: torch.Tensor,
                         patch_scores: torch.Tensor) -> torch.Tensor:
        """Eq. 7: ``1 - softmax`` weight of the most anomalous patch, ``[B]``.

        For the patch ``m_test`` with the highest score and its nearest bank point ``m*``, take
        the ``b`` nearest bank neighbours ``N_b(m*)`` (``m*`` itself first); the weight is
        ``1 - exp(|m_test - m*|) / sum_{m in N_b(m*)} exp(|m_test - m|)``.
        """
        b = embeddings.shape[0]
        patches = self._patches(embeddings).reshape(b, -1, embeddings.shape[1])
        worst = patches[torch.arange(b), patch_scores.flatten(1).argmax(dim=1)]  # [B, D]
        _, nearest = self.index.search(worst, 1)
        n_b = min(self.cfg.reweight_neighbors, self.bank.shape[0])
        # only the rows needed are widened to float32, never the whole bank
        _, support = self.index.search(self.bank[nearest[:, 0]].float(), n_b)  # [B, n_b]
        dists = torch.linalg.vector_norm(self.bank[support].float() - worst.unsqueeze(1), dim=2)
        return 1.0 - torch.softmax(dists, dim=1)[:, 0]

    # -- export -------------------------------------------------------------------------
    def export_module(self, search: str = "auto") -> ScorerGraph:
        """Exact k-NN in graph form (:mod:`anomaly_hooks.scorers.patchcore.export`)."""
        self.check_fitted()
        return patchcore_graph(self, search)

    # -- persistence ----------------------------------------------------------------------
    def summary(self) -> Dict[str, Any]:
        return {"bank_size": int(self.bank.shape[0]), "patches": self.n_patches}

    def method_state(self) -> tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        tensors = {"patchcore.bank": self.bank}
        if self.bank_image is not None:  # optional: readers before it ignore it
            tensors["patchcore.bank_image"] = self.bank_image.to(torch.int32).contiguous()
        return tensors, {"n_patches": self.n_patches, "seed": self.seed,
                         "bank_size": int(self.bank.shape[0])}

    @classmethod
    def from_state(cls, cfg: Any, layers: Sequence[LayerInfo], tensors: Dict[str, torch.Tensor],
                   meta: Dict[str, Any], device: torch.device) -> "PatchCoreScorer":
        if "patchcore.bank" not in tensors:
            raise ValueError("not a PatchCore model: tensor patchcore.bank is missing")
        seed = int(meta["seed"])
        embedder = build_embedder(cfg, layers, seed, projection=tensors.get("embed.projection"))
        scorer = cls(embedder, cfg, seed)
        scorer._stream = None
        scorer.grid = tuple(meta["grid"])
        scorer.n_train, scorer.n_patches = int(meta["n_train"]), int(meta["n_patches"])
        bank = tensors["patchcore.bank"]
        if bank.ndim != 2 or bank.shape[1] != embedder.out_channels or bank.shape[0] < 1:
            raise ValueError(f"patchcore.bank {tuple(bank.shape)} does not fit "
                             f"{embedder.out_channels} channels")
        scorer.set_bank(bank.to(device))
        if "patchcore.bank_image" in tensors:  # optional: files written before it existed
            ids = tensors["patchcore.bank_image"]
            if tuple(ids.shape) != (bank.shape[0],) or ids.dtype != torch.int32:
                raise ValueError(f"patchcore.bank_image {tuple(ids.shape)} {ids.dtype} does not "
                                 f"fit a bank of {bank.shape[0]} points (int32 expected)")
            scorer.bank_image = ids
        scorer.fitted = True
        return scorer
