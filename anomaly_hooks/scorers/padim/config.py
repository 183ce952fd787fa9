"""PaDiM's config section (``padim:``) and its checks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from anomaly_hooks.choices import check, choices

FactorDtype = choices("FactorDtype", ["float32", "float16"])
Covariance = choices("Covariance", ["auto", "dense", "lowrank"])
Positions = choices("Positions", ["frame", "tile"])
MAX_NEIGHBOURHOOD = 4  # 81 Gaussians per patch: beyond, a position-free method (PatchCore) fits


@dataclass
class PadimConfig:
    """PaDiM: a Gaussian per patch position."""

    n_features: Optional[int] = None  # random channel subset; null = 550 (WRN50) / 100 (ResNet18)
    epsilon: float = 0.01  # added to the covariance diagonal
    factor_dtype: FactorDtype = FactorDtype["float32"]  # float16: dense factors, half the memory
    covariance: Covariance = Covariance["auto"]  # auto: lowrank for <= 0.4 D training images
    # a tiled model's Gaussians: one per position of the stitched grid (aligned parts), or
    # shared by tile position, every tile of every image a sample (textures; needs tiling)
    positions: Positions = Positions["frame"]
    # dense form with an all-images threshold and n <= 2 D training images: keep their
    # embeddings [P, n, D] in the model (the leave-one-out scores are made from them) so that
    # an update scores every image out of sample exactly, as a refit does; false: a smaller
    # model whose updates keep the stored out-of-sample scores of its images
    keep_embeddings: bool = True
    # alignment tolerance in grid cells: a patch's score is its least Mahalanobis distance to
    # the Gaussians of the positions within this many cells (0: its own position's only);
    # scoring costs (2 r + 1)^2 times as much
    neighbourhood: int = 0


def validate(pad: Any) -> None:
    """Range and cross-field checks of a ``padim`` section."""
    if pad.n_features is not None:
        check(pad.n_features >= 1, "padim.n_features", "a positive int or null", pad.n_features)
    check(0 <= pad.neighbourhood <= MAX_NEIGHBOURHOOD, "padim.neighbourhood",
          f"an int in 0..{MAX_NEIGHBOURHOOD} (grid cells; scoring costs (2 r + 1)^2 times r = 0's)",
          pad.neighbourhood)
    check(pad.epsilon > 0, "padim.epsilon", "a positive float", pad.epsilon)
    check(not (pad.covariance == "lowrank" and pad.factor_dtype == "float16"),
          "padim.factor_dtype", "float32 with padim.covariance=lowrank (float16 applies to "
          "dense factors only: the low-rank form loses up to 15 % in float16); use "
          "padim.covariance=dense or auto", pad.factor_dtype)
