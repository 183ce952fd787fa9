"""The JSON bodies of the service as pydantic models: FastAPI checks each response against its
route's model and publishes them all in the OpenAPI document (``/openapi.json``, ``/docs``).

The verdict fields are :class:`anomaly_hooks.prediction.Verdict`'s, read from that dataclass
(:data:`Verdict` here is built from it), so a prediction, a result of the log and the library
share one definition. Fields that a response carries only in some cases (``overlay_png`` with
``heatmap=png``, the ``*_url`` of stored pictures) are left out of the JSON when absent: the
routes that have them answer with ``response_model_exclude_unset``.
"""
from __future__ import annotations

import inspect
import re
import typing
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model

from anomaly_hooks import prediction
from anomaly_hooks.serve.errors import CODES
from anomaly_hooks.serve.results import NOTE_MAX


class ErrorBody(BaseModel):
    """The body of every error response."""

    code: str = Field(description="stable machine-readable code (listed under each status)")
    status: int = Field(description="the HTTP status, repeated")
    message: str = Field(description="what was wrong, and what to do about it")


def _attribute_docs(cls: type) -> Dict[str, str]:
    """The ``Attributes:`` section of a Google-style class docstring, as name -> text."""
    docs: Dict[str, str] = {}
    doc = inspect.cleandoc(cls.__doc__ or "")
    section = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    name = None
    for line in section.splitlines():
        entry = re.match(r"^ {4}(\w+): (.*)$", line)
        if entry:
            name = entry.group(1)
            docs[name] = entry.group(2)
        elif name and line.startswith(" " * 8):
            docs[name] += " " + line.strip()
        elif line.strip():
            break
    return docs


def _verdict_model() -> type[BaseModel]:
    """:class:`anomaly_hooks.prediction.Verdict` as a pydantic model: its fields, in order, with
    its docs; every float may be null (``Verdict.as_dict`` sends a non-finite value as null)."""
    hints = typing.get_type_hints(prediction.Verdict)
    docs = _attribute_docs(prediction.Verdict)
    fields: Dict[str, Any] = {}
    for name in prediction.VERDICT_FIELDS:
        kind = Optional[float] if hints[name] is float else hints[name]
        fields[name] = (kind, Field(description=docs.get(name)))
    return create_model("Verdict", __doc__="The decision on one image (higher score = more "
                        "anomalous).", **fields)


Verdict = _verdict_model()


# ---- probes ---------------------------------------------------------------------------------
class Health(BaseModel):
    """The process is up (says nothing about the model)."""

    status: Literal["ok"]
    uptime_s: float


class Ready(BaseModel):
    """Every model is loaded and warm."""

    ready: bool
    model_id: str = Field(description="the default model's id")
    models: Optional[Dict[str, str]] = Field(
        None, description="on a server of several models: each one's id, by name")


# ---- predictions ----------------------------------------------------------------------------
class ImageInfo(BaseModel):
    """The uploaded image as decoded."""

    width: int
    height: int
    format: str = Field(description="PNG, JPEG, TIFF, BMP or WEBP (from the bytes)")


class ModelRef(BaseModel):
    """The model that scored the image."""

    id: str
    sha256: str
    name: str = Field(description="the server's name of the model (default for a server of "
                      "one --model PATH)")


class Timing(BaseModel):
    """Where the request's time went, in milliseconds (``batch_size``: images in its batch)."""

    read: float
    decode: float
    queue: float
    inference: float
    batch_size: int
    postprocess: float
    log: float
    total: float


class Prediction(Verdict):  # type: ignore[misc,valid-type]
    """One scored image."""

    id: Optional[int] = Field(description="the results-log id (null without a results log)")
    request_id: str
    time: str = Field(description="ISO 8601 UTC")
    part_id: Optional[str]
    source: Optional[str] = Field(description="the source given, else the upload's file name")
    image: ImageInfo
    model: ModelRef
    timing_ms: Timing
    overlay_png: Optional[str] = Field(None, description="base64 PNG (heatmap=png only)")
    mask_png: Optional[str] = Field(None, description="base64 PNG (heatmap=png only)")
    overlay_url: Optional[str] = Field(None, description="the kept overlay (when kept)")
    mask_url: Optional[str] = Field(None, description="the kept mask (when kept)")
    thumb_url: Optional[str] = Field(None, description="the kept thumbnail (when kept)")


class BatchPrediction(Prediction):
    """One image of a batch request, scored."""

    index: int
    filename: Optional[str]


class BatchFailure(BaseModel):
    """One image of a batch request, refused (the others are still scored)."""

    index: int
    filename: Optional[str]
    error: ErrorBody


class BatchResponse(BaseModel):
    """The images of a batch request, in the order sent."""

    count: int
    failed: int
    results: List[Union[BatchPrediction, BatchFailure]]


# ---- the results log ------------------------------------------------------------------------
class ResultRecord(Verdict):  # type: ignore[misc,valid-type]
    """One prediction of the results log."""

    id: int
    time: Optional[float] = Field(description="Unix seconds (UTC); null only in a damaged row")
    time_iso: Optional[str]
    request_id: str
    model_id: str
    model_checksum: str
    model_name: Optional[str] = Field(description="the server's name of the model that scored "
                                      "it (null: recorded before models had names)")
    part_id: Optional[str]
    source: Optional[str]
    width: Optional[int]
    height: Optional[int]
    latency_ms: Optional[float]
    label: Optional[str] = Field(description="the operator's label: good or defect; null: none")
    label_note: Optional[str] = Field(description="the operator's note with the label")
    label_by: Optional[str] = Field(description="who labelled it: token:<fingerprint of the "
                                    "server's token>")
    label_at: Optional[float] = Field(description="when it was labelled, Unix seconds (UTC)")
    label_at_iso: Optional[str]
    overlay_url: Optional[str]
    mask_url: Optional[str]
    thumb_url: Optional[str]


class LabelRequest(BaseModel):
    """An operator's label for a result (``POST /v1/results/{id}/label``): it replaces any
    earlier one."""

    model_config = ConfigDict(extra="forbid")

    label: Literal["good", "defect"] = Field(description="good: not a defect; defect: one")
    note: Optional[str] = Field(None, max_length=NOTE_MAX,
                                description=f"why, at most {NOTE_MAX} characters")


class ResultPage(BaseModel):
    """Results, newest first."""

    count: int
    results: List[ResultRecord]
    next_before_id: Optional[int] = Field(
        description="pass as before_id for the next page (null: no more)")


# ---- the model ------------------------------------------------------------------------------
class ReloadResult(BaseModel):
    """A reload that went through: the new model serves from the next batch on."""

    reloaded: bool
    model: str = Field("default", description="the name of the model reloaded")
    model_id: str
    previous_model_id: Optional[str]
    path: str
    unchanged: bool = Field(description="the same file content as the model before")
    seconds: float


class ReloadDone(ReloadResult):
    """The last reload, which went through."""

    ok: Literal[True]
    at: str


class ReloadRefused(BaseModel):
    """The last reload, refused (the model before it serves on)."""

    ok: Literal[False]
    at: str
    path: str
    error: str
    serving: Optional[str]


class PromoteResult(ReloadResult):
    """A promote or a rollback that went through: the version serves from the next batch on."""

    version: str = Field(description="the file name of the version now serving")
    rollbacks: int = Field(description="versions on the rollback stack now")


# ---- versions (--models-dir) ----------------------------------------------------------------
class LineageSummary(BaseModel):
    """What a model file's ``lineage`` records (the updates it went through, written by
    ``anomaly-hooks update``), in short."""

    updates: int = Field(description="updates recorded")
    images_added: int = Field(description="good images the updates added, all together")
    parent_checksum: Optional[str] = Field(
        description="the last update's parent: the checksum recorded in the parent model file")
    labels_used: Optional[int] = Field(
        description="labelled defective images the last update's threshold used")
    last_update: Optional[str] = Field(description="when the last update was made (ISO 8601)")
    parent_version: Optional[str] = Field(
        None, description="the file of the models folder that is the parent, where there is one")


class VersionRef(BaseModel):
    """A version of the rollback stack."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(description="its file name in the models folder")
    checksum: str = Field(description="its SHA-256")
    until: Optional[str] = Field(None, description="when it stopped serving")


class ServingVersion(BaseModel):
    """The serving model as a version of the models folder."""

    name: str = Field(description="its file name in the models folder (a path outside it)")
    checksum: str = Field(description="its SHA-256")
    since: Optional[str] = Field(description="when it was promoted (or first served)")
    previous: Optional[VersionRef] = Field(description="what a rollback returns to")
    rollbacks: int = Field(description="versions on the rollback stack")


class ModelVersion(BaseModel):
    """One model file of the models folder."""

    name: str
    checksum: Optional[str] = Field(
        description="the file's SHA-256 (as the service computes it when it loads the file); "
        "null when the file cannot be served as it is (see problem)")
    size: int = Field(description="bytes")
    mtime: float = Field(description="modification time, Unix seconds")
    mtime_iso: str
    engine: Optional[str] = Field(description="torch (.safetensors) or onnx")
    method: Optional[str]
    model_id: Optional[str] = Field(description="the model id it would serve as")
    content_checksum: Optional[str] = Field(
        description="the checksum recorded inside the file (what a lineage's parent names)")
    lineage: Optional[LineageSummary]
    problem: Optional[str] = Field(
        description="why the file cannot be served as it is now (incomplete, being written, "
        "not a model file); null when it looks complete (the loader verifies it on promote)")
    serving: bool


class VersionList(BaseModel):
    """The model files of the models folder (``--models-dir``), newest first."""

    folder: str
    model: str = Field("default", description="the served model the serving version, the "
                       "serving flags and the rollback stack are of")
    serving: Optional[ServingVersion]
    count: int
    versions: List[ModelVersion]
    history: List[VersionRef] = Field(
        description="the rollback stack, newest first: history[0] is what a rollback "
        "returns to")


class Backbone(BaseModel):
    """The feature extractor."""

    model_config = ConfigDict(populate_by_name=True)

    name: str
    weights: Optional[str]
    class_: str = Field(alias="class")


class Batching(BaseModel):
    """The dynamic batcher's state."""

    wait_ms: float
    batches: int
    seconds_per_image: float


class ModelSummary(BaseModel):
    """One model of the server."""

    name: str = Field(description="its name in /v1/models/{name}/...")
    default: bool = Field(description="the model of the routes without a name")
    ready: bool
    model_id: Optional[str]
    file_sha256: Optional[str]
    path: str = Field(description="the file it serves (or loads)")
    engine: Optional[str]
    method: Optional[str]
    error: Optional[str] = Field(description="why it could not be loaded at start")


class ModelList(BaseModel):
    """The models this server serves (the first is the default one)."""

    count: int
    default: str
    models: List[ModelSummary]


class ModelInfo(BaseModel):
    """The serving model, and how it is served."""

    name: str = Field("default", description="its name on this server (/v1/models/{name})")
    model_id: str
    path: str
    file_sha256: str
    file_bytes: int
    loaded_at: str
    load_seconds: float
    method: str
    backbone: Backbone
    layers: List[str]
    layer_info: List[Dict[str, Any]]
    input_size: List[int]
    preprocess: Dict[str, Any]
    threshold: Dict[str, Any]
    fitted_on: Optional[int] = Field(description="training images (None: an ONNX export, "
                                     "which does not record it)")
    fit: Dict[str, Any]
    device: str = Field(description="the torch device, or the ONNX Runtime providers")
    config: Dict[str, Any] = Field(description="the fit's configuration (empty for an ONNX "
                                   "export)")
    engine: str = Field("torch", description="torch (a .safetensors model on PyTorch) or onnx "
                        "(an exported .onnx model on ONNX Runtime, no PyTorch)")
    drift_unavailable: Optional[str] = Field(
        None, description="why this model cannot feed a drift monitor (None: it can)")
    export: Optional[Dict[str, Any]] = Field(
        None, description="an ONNX model's export record: scorer form, grid, int8, checksums")
    lineage: Optional[LineageSummary] = Field(
        None, description="the updates the model file records (null: a model from a fit)")
    version: Optional[ServingVersion] = Field(
        None, description="the serving model as a version of --models-dir (null without it)")
    serving: Dict[str, Any] = Field(description="the server's settings (the token as 'set')")
    batching: Batching
    last_reload: Optional[Union[ReloadDone, ReloadRefused]]
    drift_monitor: bool


# ---- drift ----------------------------------------------------------------------------------
class DriftStatus(BaseModel):
    """The drift monitor's ``status()`` as it returns it, or ``{"enabled": false}``."""

    model_config = ConfigDict(extra="allow")

    enabled: bool
    state: Optional[str] = Field(None, description="ok, warning, drift, ... (the monitor's)")
    message: Optional[str] = None


# ---- what the routes declare ----------------------------------------------------------------
def error_responses(*statuses: int) -> Dict[Union[int, str], Dict[str, Any]]:
    """``responses=`` of a route: the error body for each status, with its codes."""
    return {status: {"model": ErrorBody, "description": "; ".join(
        f"`{code}`: {meaning}" for s, code, meaning in CODES if s == status)}
        for status in statuses}


def media(media_type: str, description: str, *, binary: bool = False
          ) -> Dict[Union[int, str], Dict[str, Any]]:
    """``responses=`` of a route whose 200 is not JSON."""
    schema = {"type": "string", "format": "binary"} if binary else {"type": "string"}
    return {200: {"description": description, "content": {media_type: {"schema": schema}}}}
