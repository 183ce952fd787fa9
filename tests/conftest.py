"""Shared fixtures: small seeded random-init backbones, the sample data, the shared real data,
a throw-away PostgreSQL server and the results stores."""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Iterator, List, Sequence, Tuple

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data" / "sample"
SHARED_DATA = ROOT.parent / "shared" / "data"

warnings.filterwarnings("ignore", message="backbone.weights is null")

# The suite builds the same seeded random backbones hundreds of times: hand out bit-identical
# copies instead of re-running the init (~25 s of the quick suite; tests/test_backbones.py checks
# that a copy equals a fresh build).
from anomaly_hooks.backbones import keep_random_backbones  # noqa: E402

keep_random_backbones(4)

# Compute-path tests take the ``device`` fixture: always the CPU, plus CUDA where a GPU is
# present, so the same suite checks the GPU paths when run on one (../shared/gpu/README.md).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """``cpu``, and ``cuda`` when available."""
    return torch.device(request.param)


def shared_dataset(name: str) -> Path:
    """A dataset under ../shared/data, or skip the test where it is absent."""
    path = SHARED_DATA / name
    if not path.is_dir():
        pytest.skip(f"{path} not available")
    return path


@pytest.fixture(scope="session")
def resnet18() -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).eval()


@pytest.fixture(scope="session")
def wrn50() -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.wide_resnet50_2(weights=None).eval()


# ---- float tolerances -------------------------------------------------------------------
F32_EPS = float(np.finfo(np.float32).eps)  # 2**-23: the spacing of float32 numbers at 1.0


def f32_tol(n_ops: int, scale: float = 1.0) -> float:
    """A float32 tolerance derived from the computation: ``n_ops * F32_EPS * scale``.

    Each float32 operation (add, multiply, divide, a conversion) rounds its result to the
    nearest float32, a relative error of at most F32_EPS / 2. A chain of ``n_ops`` such roundings
    on values of magnitude at most ``scale`` errs by at most ``n_ops * F32_EPS / 2 * scale``, so
    two float32 implementations of the same formula (different order, fused or not) differ by at
    most ``n_ops * F32_EPS * scale``, and a float32 result differs from a float64 reference by
    at most half that. For a sum or dot product of ``n`` terms ``n_ops`` is ``n`` (the bound
    of any summation order) and ``scale`` the sum of the terms' magnitudes.

    Use it as ``atol`` with ``rtol=0`` and ``scale`` the largest magnitude involved, or with
    ``scale=1`` as an ``rtol`` where every value has the same relative error.
    """
    return n_ops * F32_EPS * scale


def resample_tolerance(in_size, value_range: float, max_abs: float) -> float:
    """The largest difference two float32 implementations of one bilinear / antialiased resize
    may show. Each computes the source coordinate ``scale * (dst + 0.5) - 0.5`` in its own
    order and precision: the coordinates, hence the interpolation weights, may differ by a few
    ulps of the input size (``2 eps (H + W)``); a weight error moves an output by at most that
    error times the value range. The weighted sums then round each output by a few ulps of the
    values (``8 eps max|x|``)."""
    return F32_EPS * (2 * (in_size[0] + in_size[1]) * value_range + 8 * max_abs)


def backbone_rtol(convolutions: int = 13, fan_in: int = 3 * 3 * 256) -> float:
    """Relative tolerance for a score computed twice through a float32 backbone by different
    kernels (another batch size or composition, another thread count or process, another
    device): each of ``convolutions`` layers sums up to ``fan_in`` products in its own order.
    Rounding errors of random sign grow as sqrt(fan_in) * eps per layer (the statistical
    estimate: the worst case, fan_in * eps, needs every rounding to go the same way), and add
    over the layers: ``convolutions * sqrt(fan_in) * F32_EPS``. The defaults are ResNet18's up
    to layer3 (13 convolutions of at most 3 * 3 * 256 inputs): 7.4e-5."""
    return convolutions * math.sqrt(fan_in) * F32_EPS


def knn_distance_tol(queries: torch.Tensor, bank: torch.Tensor,
                     dist: torch.Tensor) -> torch.Tensor:
    """Absolute tolerances (``dist``'s shape ``[m, k]``) of float32 nearest-neighbour distances
    of ``queries`` ``[m, D]`` to ``bank`` ``[N, D]`` against float64 ones (``dist``). The fast
    form d**2 = |q|**2 + |b|**2 - 2 q.b (a D-term dot product, the norms, two additions: D + 3
    roundings of magnitudes up to |q|**2 + |b|**2) errs in d**2 by at most E; the square root
    makes that min(E / (2 d), sqrt(E)) in d (the second near d = 0), plus its own rounding."""
    q, b, d = queries.double().cpu(), bank.double().cpu(), dist.double().cpu()
    e = f32_tol(q.shape[1] + 3) * ((q ** 2).sum(1, keepdim=True) + (b ** 2).sum(1).max())
    return torch.minimum(e / (2 * d), e.sqrt()) + f32_tol(1) * d


F64_EPS = float(np.finfo(np.float64).eps)  # 2**-52
F16_EPS = float(np.finfo(np.float16).eps)  # 2**-10


def f64_tol(n_ops: int, scale: float = 1.0) -> float:
    """``f32_tol`` for float64 computations: ``n_ops * F64_EPS * scale``."""
    return n_ops * F64_EPS * scale


def textured_images(n: int, size=(96, 112), seed: int = 0) -> list[np.ndarray]:
    """Good images: a smooth striped texture with mild noise, uint8 HxWx3."""
    rng = np.random.default_rng(seed)
    h, w = size
    yy, xx = np.mgrid[0:h, 0:w]
    out = []
    for _ in range(n):
        phase = rng.uniform(0, 2 * np.pi)
        base = 0.5 + 0.2 * np.sin(xx / 4.0 + phase)[..., None] * np.array([1.0, 0.9, 0.8])
        img = base + rng.normal(0, 0.02, (h, w, 3))
        out.append((np.clip(img, 0, 1) * 255).astype(np.uint8))
    return out


def with_defect(img: np.ndarray) -> np.ndarray:
    """A bright square stain in the middle."""
    bad = img.copy()
    h, w = bad.shape[:2]
    bad[h // 2 - 10:h // 2 + 10, w // 2 - 10:w // 2 + 10] = [250, 30, 30]
    return bad


TILED_SIZE = (96, 144)  # the small tiled models' training images: 2 x 4 tiles of 64 px


def tiled_cfg(method: str = "patchcore", **section) -> dict:
    """A small tiled (high-resolution) config: random-init ResNet18, the working frame at the
    images' own size (scale 1), tiles of 64 px overlapping by 32; ``section``: the method's
    keys."""
    cfg = {"method": method, "seed": 0, "device": "cpu",
           "backbone": {"name": "resnet18", "weights": None},
           "tiling": {"enabled": True, "scale": 1.0, "tile": 64, "overlap": 32,
                      "tile_batch": 8},
           "threshold": {"mode": "all-images"},
           "data": {"batch_size": 4, "num_workers": 0},
           "patchcore": {"coreset_ratio": 0.1, "prereduce": 4}, "padim": {"n_features": 40}}
    cfg[method] = {**cfg[method], **section}
    return cfg


@pytest.fixture(scope="session")
def small_cfg() -> dict:
    """A fast PaDiM config: random-init ResNet18, small input."""
    return {"method": "padim", "seed": 0, "device": "cpu",
            "backbone": {"name": "resnet18", "weights": None},
            "preprocess": {"resize": [80, 96], "crop": [64, 80]},
            "padim": {"n_features": 40},
            # the hold-out and quantile + margin rule these tests were written for
            # (tests/test_threshold.py sets threshold.mode=all-images itself)
            "threshold": {"mode": "holdout", "false_alarm_rate": None, "holdout_fraction": 0.25},
            "data": {"batch_size": 4, "num_workers": 0}}


@pytest.fixture(scope="session")
def fitted(small_cfg):
    """A PaDiM detector fitted on 16 textured images."""
    from anomaly_hooks import Detector

    det = Detector.from_config(small_cfg)
    det.fit(textured_images(16), progress=False)
    return det


def safetensors_header(path: Path) -> tuple[int, dict]:
    """(header length, parsed JSON header) of a safetensors file."""
    import json
    import struct

    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8:8 + n])


def rewrite_safetensors_header(src: Path, dst: Path, edit) -> None:
    """Copy a safetensors file, editing its JSON header (length prefix recomputed)."""
    import json
    import struct

    raw = src.read_bytes()
    n, header = safetensors_header(src)
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    dst.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


@pytest.fixture(scope="session")
def padim_file(fitted, tmp_path_factory) -> Path:
    """The ``fitted`` detector saved (low-rank PaDiM, format 2); tests copy it, never edit it."""
    return fitted.save(tmp_path_factory.mktemp("padim") / "padim.safetensors")


def one_error_line(err: str) -> str:
    """The single ``error:`` line of a command's stderr (no traceback, no second error)."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


# ---- a throw-away PostgreSQL server (anomaly_hooks.serve.pgtesting) ----------------------
def _postgres() -> Iterator[Any]:
    """A started ``pgtesting.PostgresServer``, stopped and removed afterwards; skips where
    psycopg or the PostgreSQL programs are absent."""
    pytest.importorskip("psycopg", reason="psycopg (the [postgres] extra) is not installed")
    from anomaly_hooks.serve.pgtesting import PostgresServer, PostgresUnavailableError

    try:
        server = PostgresServer()
    except PostgresUnavailableError as exc:
        pytest.skip(f"{exc} to run the PostgreSQL results-store tests")
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Any]:
    """One PostgreSQL server for the session (see :func:`_postgres`)."""
    yield from _postgres()


@pytest.fixture
def own_postgres_server() -> Iterator[Any]:
    """A PostgreSQL server of the test's own, which it may kill -9 and restart (the session's
    server stays up for the others)."""
    yield from _postgres()


@pytest.fixture
def postgres_url(postgres_server) -> Iterator[str]:
    """The URL of a fresh database on the session's server, dropped after the test."""
    name = postgres_server.new_database()
    try:
        yield postgres_server.url(name)
    finally:
        postgres_server.drop_database(name)


class StoreFactory:
    """Opens the store under test, again and again on the same log (``kind``: sqlite or
    postgres); :meth:`sql` runs raw SQL on that log with the store's own driver."""

    def __init__(self, kind: str, spec: str) -> None:
        self.kind = kind
        self.spec = spec  # what open_store and --results-db take
        self.opened: List[Any] = []

    def __call__(self) -> Any:
        from anomaly_hooks.serve.stores import open_store

        store = open_store(self.spec)
        self.opened.append(store)
        return store

    def sql(self, query: str, params: Sequence[Any] = ()) -> List[Tuple[Any, ...]]:
        """Rows of ``query`` (``?`` placeholders), committed, on a connection of its own."""
        if self.kind == "sqlite":
            import sqlite3

            con = sqlite3.connect(self.spec[len("sqlite:///"):])
            try:
                with con:
                    return con.execute(query, list(params)).fetchall()
            finally:
                con.close()
        import psycopg

        with psycopg.connect(self.spec, autocommit=True) as con:
            cur = con.execute(query.replace("?", "%s"), list(params))
            return cur.fetchall() if cur.description else []

    def close(self) -> None:
        for store in self.opened:
            try:
                store.close()
            except Exception:  # noqa: BLE001  (a test may have closed it, or broken it)
                pass


@pytest.fixture(params=["sqlite", "postgres"])
def store_factory(request, tmp_path) -> Iterator[StoreFactory]:
    """Each results-store test once per store: the SQLite file, and PostgreSQL (a fresh
    database on the session's server; skipped where there is none)."""
    if request.param == "sqlite":
        factory = StoreFactory("sqlite", f"sqlite:///{tmp_path / 'r.sqlite'}")
    else:
        factory = StoreFactory("postgres", request.getfixturevalue("postgres_url"))
    try:
        yield factory
    finally:
        factory.close()
