"""PaDiM (Defard et al. 2020): a Gaussian per patch position, Mahalanobis distance.

The Gaussians (:mod:`anomaly_hooks.scorers.padim.gaussians`) are kept in one of two exact forms,
``padim.covariance``: ``dense`` Cholesky factors ``[P, D, D]`` fitted from streaming sums (memory
independent of the number of images), or ``lowrank``: the centred training embeddings
``[P, n, D]`` and a small ``[P, n, n]`` factor, for fits on fewer images than dimensions (the
usual case: MVTec AD has 60-390 training images per category, WRN50 PaDiM keeps 550 channels),
where it is several times cheaper to fit, smaller, and faster to score. ``auto`` picks low-rank
for ``n <= 0.4 D`` training images. The patch score is the Mahalanobis distance (not squared);
with ``padim.neighbourhood`` r > 0, the least one to the Gaussians of the positions within r grid
cells (parts placed a little differently in each image: an edge one cell off its place is
still typical of the neighbouring position).
"""
from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from itertools import product
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from anomaly_hooks.embedding import PatchEmbedder, random_channel_subset
from anomaly_hooks.errors import ConfigError, ExportError, FitError
from anomaly_hooks.extractor import LayerInfo
from anomaly_hooks.resources import batch_bytes
from anomaly_hooks.scorers.base import Scorer, ScorerGraph, register
from anomaly_hooks.scorers.padim import partial
from anomaly_hooks.scorers.padim.config import PadimConfig, validate
from anomaly_hooks.scorers.padim.export import padim_graph
from anomaly_hooks.scorers.padim.gaussians import (
    BUFFER_SAMPLES,
    DenseGaussians,
    GaussianAccumulator,
    LowRankGaussians,
    SampleStore,
    choose_covariance,
    lowrank_capacity,
)
from anomaly_hooks.scorers.padim.loo import group_members
from anomaly_hooks.threshold import out_of_sample

DEFAULT_FEATURES = {"wide_resnet50_2": 550, "resnet18": 100}
Gaussians = Union[DenseGaussians, LowRankGaussians]
# dense form, out-of-sample scores: keep the training samples during the fit (exact LOO
# distances from their Gram matrices in finalize, no second pass) while they take at most this
# many times the memory of the dense factors (n <= 2 D); beyond, a second pass (dense series)
DENSE_KEEP_SAMPLES = 2.0


def kept_for_loo(out_of_sample: bool, n: int, d: int) -> bool:
    """Whether a dense fit of ``n`` images of dimension ``d`` holds every training sample for
    the exact leave-one-out scores (``DENSE_KEEP_SAMPLES``); the model keeps them too where
    ``padim.keep_embeddings`` is on."""
    return out_of_sample and n <= DENSE_KEEP_SAMPLES * d


def default_n_features(backbone_name: str, total: int) -> int:
    """The paper's d (550 for WRN50, 100 for ResNet18); otherwise min(total, 550)."""
    return min(DEFAULT_FEATURES.get(backbone_name, 550), total)


@register
class PadimScorer(Scorer):
    """Per-position Gaussian; patch score = Mahalanobis distance (not squared)."""

    method = "padim"
    config_class = PadimConfig
    validate_config = staticmethod(validate)
    # stride 4, 8 and 16 taps: ResNets' layer1-3; EfficientNet-Lite0's blocks 2, 4, 10
    default_layers = {"*": ["layer1", "layer2", "layer3"],
                      "efficientnet_lite0": ["_blocks.2", "_blocks.4", "_blocks.10"]}
    memory_advice = ("lower padim.n_features (dense memory grows with its square, low-rank "
                     "with it times the number of images), or preprocess.crop / resize, or use "
                     "layers with a coarser grid")
    min_train_images = 2
    min_out_of_sample_images = 3  # a leave-one-out covariance needs two images
    # the dense form's kept embeddings: read by updates and saves only, never by scoring
    on_demand_tensors = frozenset({"padim.dense_samples"})
    # a dense model keeping its embeddings is refactorised from them by an update (the old
    # factors never read); one without them reads its factors when the update starts
    remade_by_update = frozenset({"padim.chol"})

    @classmethod
    def shares_tile_positions(cls, section: Any) -> bool:
        """``padim.positions: tile``: Gaussians shared by tile position (textures)."""
        return section.positions == "tile"

    def __init__(self, embedder: PatchEmbedder, epsilon: float,
                 factor_dtype: str = "float32", covariance: str = "auto",
                 keep_embeddings: bool = True, neighbourhood: int = 0) -> None:
        super().__init__(embedder)
        self.epsilon = epsilon
        self.neighbourhood = int(neighbourhood)  # grid cells of alignment tolerance
        self.factor_dtype = factor_dtype
        self.covariance = covariance  # as asked for; the fitted form is gaussians.kind
        self.keep_embeddings = keep_embeddings  # dense form: see keeps_samples
        self._expected: Optional[int] = None
        self._acc: Optional[GaussianAccumulator] = None
        self._store: Optional[SampleStore] = None
        self._oos_store: Optional[SampleStore] = None  # dense form: samples kept for LOO
        self.gaussians: Optional[Gaussians] = None

    @staticmethod
    def _dim(cfg: Any, layers: Sequence[LayerInfo]) -> int:
        """The embedding dimension ``D`` a fit with the whole config ``cfg`` on ``layers``
        will use."""
        return cfg.padim.n_features or default_n_features(
            cfg.backbone.name, sum(info.channels for info in layers))

    @classmethod
    def planned_format_version(cls, cfg: Any, layers: Sequence[LayerInfo],
                               n_train: int) -> int:
        pad, d = cfg.padim, cls._dim(cfg, layers)
        if choose_covariance(pad.covariance, n_train, d, pad.factor_dtype) == "lowrank":
            return 2
        keeps = pad.keep_embeddings and kept_for_loo(out_of_sample(cfg.threshold), n_train, d)
        return 2 if keeps else 1

    @classmethod
    def memory_parts(cls, cfg: Any, layers: Sequence[LayerInfo], input_size: Tuple[int, int],
                     positions: int, n_train: int) -> Tuple[Dict[str, int], int]:
        pad = cfg.padim
        d = cls._dim(cfg, layers)
        batch = batch_bytes(layers, input_size, cfg.data.batch_size, d)
        if choose_covariance(pad.covariance, n_train, d, pad.factor_dtype) == "lowrank":
            # the stored samples become the centred embeddings Y in place; plus C^-1 [n, n]
            samples, small = positions * n_train * d * 4, positions * n_train * n_train * 4
            return ({"training embeddings (low-rank form, centred in place)": samples,
                     "inverse Gram factors": small, "batch": batch},
                    samples + small + positions * d * 4)
        factor_bytes = 2 if pad.factor_dtype == "float16" else 4
        loo = kept_for_loo(out_of_sample(cfg.threshold), n_train, d)
        # the float32 sums become the covariances, then the factors, in place
        return ({"statistics (float32 sums, factorised in place)": positions * d * d * 4,
                 "float16 factors": positions * d * d * 2 if factor_bytes == 2 else 0,
                 "sample buffer": positions * BUFFER_SAMPLES * d * 4, "batch": batch,
                 "training samples kept for leave-one-out":
                     positions * n_train * d * 4 if loo else 0},
                positions * d * d * factor_bytes + positions * d * 4
                + (positions * n_train * d * 4 if loo and pad.keep_embeddings else 0))

    @classmethod
    def create(cls, cfg: Any, layers: Sequence[LayerInfo], backbone_name: str,
               seed: int) -> "PadimScorer":
        total = sum(info.channels for info in layers)
        n = cfg.n_features if cfg.n_features is not None else default_n_features(backbone_name,
                                                                                  total)
        if n > total:
            raise ConfigError(f"padim.n_features={n} is larger than the {total} channels the "
                             f"layers {[i.name for i in layers]} give: choose 1..{total}")
        idx = random_channel_subset(total, n, seed)
        return cls(PatchEmbedder(layers, upsample="nearest", channel_idx=idx), cfg.epsilon,
                   cfg.factor_dtype, cfg.covariance, bool(cfg.keep_embeddings),
                   cfg.neighbourhood)

    # -- fitting --------------------------------------------------------------------------
    def begin(self, n_images: int) -> None:
        """``n_images`` training images will come: choose the covariance form up front."""
        if self._acc is not None or self._store is not None or self.fitted:
            raise RuntimeError("begin() comes before the first partial_fit()")
        self._expected = int(n_images)

    def _start(self) -> None:
        d = self.embedder.out_channels
        n = self._expected if self._expected is not None else 0  # unknown: low-rank first
        if choose_covariance(self.covariance, n, d, self.factor_dtype) == "lowrank":
            self._store = SampleStore(capacity=n)
        else:
            self._acc = GaussianAccumulator()
            if kept_for_loo(self.want_out_of_sample, n, d):
                self._oos_store = SampleStore(capacity=n)

    def partial_fit(self, embeddings: torch.Tensor) -> None:
        if self.fitted:
            raise RuntimeError("this PaDiM scorer is already fitted")
        b, d, h, w = embeddings.shape
        if self.grid is None:
            self.grid = (h, w)
        if self._acc is None and self._store is None:
            self._start()
        x = embeddings.flatten(2).permute(2, 0, 1).float()  # [P, B, D]; a view when channels-last
        if (self._store is not None and self.covariance == "auto"
                and self._store.n + b > lowrank_capacity(d)):
            self._to_dense()  # more images than auto keeps in low-rank form
        if self._oos_store is not None and not kept_for_loo(True, self._oos_store.n + b, d):
            self._drop_samples()  # too many to keep: sums, and a second pass for LOO
        if self._oos_store is not None:  # every sample kept: the Gaussians come from them
            self._oos_store.update(x)
        else:
            (self._store if self._store is not None else self._acc).update(x)

    def _to_dense(self) -> None:
        """Go on in the dense form: the stored samples stay kept where leave-one-out is wanted
        (the dense Gaussians are then made from them), else they move into streaming sums."""
        acc = GaussianAccumulator()
        if self.want_out_of_sample:
            self._oos_store = self._store
        elif self._store.n:
            acc.update(self._store.samples())
        self._store, self._acc = None, acc

    def _drop_samples(self) -> None:
        """Move the kept samples into the streaming sums and keep no more."""
        if self._oos_store.n:
            self._acc.update(self._oos_store.samples())
        self._oos_store = None

    @torch.inference_mode()  # state is only ever touched in inference mode
    def finalize(self, progress: bool = False) -> None:
        source = next((s for s in (self._store, self._oos_store, self._acc) if s is not None),
                      None)
        n = 0 if source is None else source.n
        if n < self.min_train_images:
            raise FitError(f"PaDiM needs at least {self.min_train_images} training images "
                           f"for a covariance; got {n}")
        groups = self._groups(n) if self.want_out_of_sample else None
        if self._store is not None:
            self.gaussians = LowRankGaussians.from_samples(
                self._store, self.epsilon, loo=self.want_out_of_sample, groups=groups)
            loo, self.gaussians.loo = self.gaussians.loo, None
        else:
            dtype = torch.float16 if self.factor_dtype == "float16" else torch.float32
            loo = None
            if self._oos_store is not None:  # every image's samples: made from them
                self.gaussians = DenseGaussians.from_samples(
                    self._oos_store.samples(), self.epsilon, dtype, loo=True, groups=groups)
                loo, self.gaussians.loo = self.gaussians.loo, None
            else:
                self.gaussians = DenseGaussians.from_accumulator(self._acc, self.epsilon, dtype)
            if self._oos_store is not None and self.keeps_samples(n):
                self.gaussians.samples = self._oos_store.samples().contiguous()
        if loo is not None:  # [P, n] -> [n, h, w]
            self._oos_patch_scores = loo.t().reshape(n, *self.grid)
        self.n_train = n
        self._acc = self._store = self._oos_store = None
        self.fitted = True

    # -- sharded fitting (scorers/padim/partial.py) ----------------------------------------
    def begin_shard(self, n_total: int, n_shard: int) -> None:
        """Fix the covariance form a single-process fit on ``n_total`` images would use (so
        that ``auto`` does not pick per shard), and size the buffers for ``n_shard``."""
        self.covariance = choose_covariance(self.covariance, n_total, self.embedder.out_channels,
                                            self.factor_dtype)
        self.begin(n_shard)

    def partial_state(self) -> Dict[str, Any]:
        if self._store is None and self._acc is None:
            raise FitError("this PaDiM shard got no training image")
        state = (partial.lowrank_state(self._store, self.grid) if self._store is not None
                 else partial.samples_state(self._oos_store, self.grid)
                 if self._oos_store is not None else partial.dense_state(self._acc, self.grid))
        self._acc = self._store = self._oos_store = None
        return state

    @classmethod
    def merge_states(cls, states: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        return partial.merge(states)

    def finalize_merged(self, state: Dict[str, Any], device: torch.device,
                        progress: bool = False) -> None:
        n = int(state["n"])
        if n < self.min_train_images:
            raise FitError(f"PaDiM needs at least {self.min_train_images} training images "
                           f"for a covariance; got {n}")
        self.gaussians = partial.gaussians(
            state, self.epsilon, self.factor_dtype, device, loo=self.want_out_of_sample,
            groups=self._groups(n) if self.want_out_of_sample else None,
            keep_samples=self.keeps_samples(n))
        self.grid, self.n_train = tuple(state["grid"]), n
        loo = self.gaussians.loo
        if loo is not None:  # exact LOO from the samples: [P, n] -> [n, h, w]
            self.gaussians.loo = None
            self._oos_patch_scores = loo.t().reshape(n, *self.grid)
        self._acc = self._store = None
        self.fitted = True

    # -- updates (anomaly_hooks.updating) ---------------------------------------------------
    def joins(self, model: Scorer) -> bool:
        """Where the model keeps its training embeddings and this update keeps every sample
        (the low-rank form, or the dense form with leave-one-out scores and at most
        ``DENSE_KEEP_SAMPLES * D`` images in all): they are read into the sample store the new
        images join (one buffer of all the images' samples instead of the model's, the new
        ones' and their joined copy)."""
        if not (isinstance(model, PadimScorer) and model.keeps_training_embeddings
                and self._expected is not None and self._acc is None and self._store is None):
            return False
        n_total = int(model.n_train) + self._expected
        return self.covariance == "lowrank" or (
            self.covariance == "dense" and self.want_out_of_sample
            and n_total <= DENSE_KEEP_SAMPLES * self.embedder.out_channels)

    @torch.inference_mode()  # state is only ever touched in inference mode
    def join(self, model: Scorer) -> Callable[[], None]:
        """The sample store of all the images, the model's first: the new images' samples go
        after its ``n_model`` places, which the returned reading fills."""
        if not self.joins(model):
            raise RuntimeError("join() follows begin_update() and joins() == True")
        n_model, g = int(model.n_train), model.gaussians
        p, d = g.mean.shape
        store = SampleStore(capacity=n_model + self._expected)
        store.buf = torch.empty(p, store.capacity, d, dtype=torch.float32, device=g.mean.device)
        store.n = n_model
        self.grid = tuple(model.grid)
        if self.covariance == "lowrank":
            self._store = store
        else:
            self._acc, self._oos_store = GaussianAccumulator(), store
        head = store.buf[:, :n_model]

        def read() -> None:
            with torch.inference_mode():
                partial.samples_into(g, n_model, head)

        return read

    def fitted_state(self) -> Dict[str, Any]:
        """The training images' state (:func:`partial.fitted_state`): the low-rank form's
        samples, or the dense form's exact sums from its mean, factors and image count."""
        self.check_fitted()
        return partial.fitted_state(self.gaussians, self.n_train, self.grid, self.epsilon)

    def training_embeddings(self) -> Optional[torch.Tensor]:
        """The low-rank form's samples as embeddings ``[n, D, h, w]`` (``sqrt(n - 1) Y + mu``,
        float32 rounding), or the dense form's kept ones; None for a dense model that keeps
        only their sums."""
        self.check_fitted()
        g = self.gaussians
        if g.kind != "lowrank":
            x = g.samples
            if x is None:
                return None
        else:
            x = g.y.float() * math.sqrt(self.n_train - 1) + g.mean.float().unsqueeze(1)
        return x.permute(1, 2, 0).reshape(self.n_train, -1, *self.grid)  # from [P, n, D]

    @property
    def keeps_training_embeddings(self) -> bool:
        g = self.gaussians
        return g is not None and (g.kind == "lowrank" or g.keeps_samples)

    def keeps_samples(self, n: int) -> bool:
        """Whether a dense model of ``n`` training images keeps their embeddings
        ``[P, n, D]`` (``padim.keep_embeddings``, an all-images threshold, ``n <= 2 D``: where
        the fit keeps them anyway for the exact leave-one-out scores, at most twice the
        factors' size): an update then scores every image out of sample exactly, as a refit."""
        return self.keep_embeddings and kept_for_loo(self.want_out_of_sample, n,
                                                     self.embedder.out_channels)

    # -- out-of-sample (exact leave-one-out) scores of the training images -----------------
    # With padim.neighbourhood > 0 these are the own position's leave-one-out distances: an
    # upper bound of the neighbourhood's least one (the own position is one of its Gaussians),
    # so the threshold they give errs towards fewer false alarms, never more.
    def out_of_sample_unsupported(self) -> Optional[str]:
        return None

    def _groups(self, n: int) -> Optional[torch.Tensor]:
        """The leave-out groups of ``n`` training images; None where every image is alone
        (plain leave-one-out, formulas (1)-(2))."""
        groups = self.oos_groups
        if groups is None:
            return None
        if groups.numel() != n:
            raise FitError(f"{groups.numel()} out-of-sample groups given for {n} training "
                           "images")
        return None if int(torch.bincount(groups).max()) == 1 else groups

    @property
    def out_of_sample_whole_groups(self) -> bool:
        return self.oos_groups is not None and int(torch.bincount(self.oos_groups).max()) > 1

    def out_of_sample_scores(self, embeddings: torch.Tensor,
                             images: Sequence[int]) -> torch.Tensor:
        """Exact leave-one-(group-)out patch distances ``[B, h, w]`` of *training* images
        ``images`` (dense form with ``n > 2 D``). With groups, the batch holds whole groups:
        each is scored by the model refitted without it."""
        self.check_fitted()
        if self.gaussians.kind != "dense":
            raise FitError("the low-rank form makes its leave-one-out distances in the fit")
        b, _, h, w = embeddings.shape
        x = embeddings.flatten(2).permute(2, 0, 1)  # [P, B, D]
        groups = self._groups(self.n_train)
        if groups is None:
            dist = self.gaussians.loo_distances(x, self.n_train, self.epsilon)
            return dist.t().reshape(b, h, w)
        ids = torch.as_tensor(list(images), dtype=torch.long)
        local = groups[ids]
        if not torch.equal(torch.bincount(local, minlength=int(groups.max()) + 1)[local],
                           torch.bincount(groups)[local]):
            raise FitError("the second pass must score whole groups at a time")
        out = torch.empty(x.shape[0], b, dtype=torch.float32, device=x.device)
        for g, members in group_members(local).items():  # batch positions of each group
            members = members.to(x.device)
            if g == 1:
                out[:, members[:, 0]] = self.gaussians.loo_distances(
                    x[:, members[:, 0]], self.n_train, self.epsilon)
            else:
                dist = self.gaussians.group_out_distances(x[:, members], self.n_train,
                                                          self.epsilon)
                out[:, members.reshape(-1)] = dist.reshape(x.shape[0], -1)
        return out.t().reshape(b, h, w)

    # -- scoring --------------------------------------------------------------------------
    def score(self, embeddings: torch.Tensor) -> torch.Tensor:
        self.check_fitted()
        b, d, h, w = embeddings.shape
        dim = self.gaussians.mean.shape[1]
        if (h, w) != self.grid or d != dim:
            raise ValueError(f"embeddings {tuple(embeddings.shape)} do not match the fitted grid "
                             f"{self.grid} and dimension {dim}")
        if self.neighbourhood:
            return self._neighbourhood_distances(embeddings)
        x = embeddings.flatten(2).permute(2, 0, 1)  # [P, B, D]
        return self.gaussians.distances(x).t().reshape(b, h, w)

    def _neighbourhood_distances(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``[B, h, w]``: each patch's least distance to the Gaussians of the positions within
        ``neighbourhood`` cells (Chebyshev) inside the grid, of embeddings ``[B, D, h, w]``.

        One full scoring per offset ``o``: the patches shifted by ``o`` (edge-replicated, the
        replicas discarded) against every position's own Gaussian give ``d(x_p, G_{p+o})`` at
        ``p + o``, so the Gaussians are never copied or gathered."""
        b, _, h, w = embeddings.shape
        r = self.neighbourhood
        padded = F.pad(embeddings.float(), (r, r, r, r), mode="replicate")
        best = None
        for dy, dx in product(range(-r, r + 1), repeat=2):
            if abs(dy) >= h or abs(dx) >= w:
                continue  # no position of the grid has a neighbour at this offset
            shifted = padded[:, :, r - dy:r - dy + h, r - dx:r - dx + w]  # [:, :, q] = x[q - o]
            dist = self.gaussians.distances(shifted.flatten(2).permute(2, 0, 1))
            dist = dist.t().reshape(b, h, w)
            if best is None:  # offsets start at (-r, -r): fill with +inf, then take minima
                best = torch.full_like(dist, math.inf)
            # p = q - o for the q inside the grid
            ys, xs = slice(max(0, -dy), h - max(0, dy)), slice(max(0, -dx), w - max(0, dx))
            yq, xq = slice(ys.start + dy, ys.stop + dy), slice(xs.start + dx, xs.stop + dx)
            torch.minimum(best[:, ys, xs], dist[:, yq, xq], out=best[:, ys, xs])
        return best

    # -- export -------------------------------------------------------------------------
    def export_module(self, **options: Any) -> ScorerGraph:
        """Distances in graph form (:mod:`anomaly_hooks.scorers.padim.export`); no options."""
        self.check_fitted()
        if options:
            raise ExportError(f"PaDiM takes no export options, got {sorted(options)}")
        if self.neighbourhood:
            raise ExportError(f"padim.neighbourhood={self.neighbourhood} has no ONNX export: "
                              "export a model fitted with padim.neighbourhood=0, or serve the "
                              ".safetensors model")
        return padim_graph(self.gaussians)

    # -- persistence ----------------------------------------------------------------------
    def format_version(self) -> int:
        g = self.gaussians
        return 2 if g is not None and (g.kind == "lowrank" or g.keeps_samples) else 1

    def summary(self) -> Dict[str, Any]:
        out = {"covariance": self.gaussians.kind, "n_train": self.n_train,
               "neighbourhood": self.neighbourhood}
        if self.gaussians.kind == "dense":
            out["keeps_embeddings"] = self.gaussians.keeps_samples
        return out

    def holding_on_demand(self) -> AbstractContextManager:
        """The dense form's kept embeddings, when left in the model file, read once for the
        block (:meth:`DenseGaussians.hold_samples`)."""
        g = self.gaussians
        return g.hold_samples() if g is not None and g.kind == "dense" else nullcontext()

    def bind_model_file(self, path: Path, file_checksum: str) -> None:
        g = self.gaussians
        if g is not None and g.kind == "dense":
            g.bind_file(path, file_checksum)

    def method_state(self) -> tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        return self.gaussians.tensors(), {"epsilon": self.epsilon,
                                          "covariance": self.gaussians.kind}

    @classmethod
    def from_state(cls, cfg: Any, layers: Sequence[LayerInfo], tensors: Dict[str, Any],
                   meta: Dict[str, Any], device: torch.device) -> "PadimScorer":
        """The fitted scorer from a model file's tensors (``padim.dense_samples``, and
        ``padim.chol`` of a model loaded for an update, may be a
        :class:`~anomaly_hooks.modelfile.StoredTensor`, left in the file)."""
        if "embed.channel_idx" not in tensors:
            raise ValueError("not a PaDiM model: tensor embed.channel_idx is missing")
        embedder = PatchEmbedder(layers, upsample="nearest",
                                 channel_idx=tensors["embed.channel_idx"])
        kind = meta.get("covariance", "dense")  # format 1 files are dense
        if kind not in ("dense", "lowrank"):
            raise ValueError(f"unknown PaDiM covariance form {kind!r}")
        scorer = cls(embedder, float(meta["epsilon"]), cfg.factor_dtype, cfg.covariance,
                     bool(cfg.keep_embeddings), cfg.neighbourhood)
        p = int(meta["grid"][0]) * int(meta["grid"][1])
        d = int(embedder.out_channels)
        if kind == "dense":
            scorer.gaussians = DenseGaussians.from_tensors(tensors, p, d, device,
                                                           int(meta["n_train"]))
        else:
            scorer.gaussians = LowRankGaussians.from_tensors(tensors, p, d, scorer.epsilon,
                                                             device)
        scorer.grid = tuple(meta["grid"])
        scorer.n_train = int(meta["n_train"])
        scorer.fitted = True
        return scorer
