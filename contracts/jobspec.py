"""The job request (HTTP body) and the spec queued for workers; validated on both sides."""

from __future__ import annotations

import re
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from contracts import estimators
from contracts.kinds import (
    CURVATURES,
    FIELD_HELP,
    KIND_FIELDS,
    KINDS,
    LOSSES,
    Family,
    kind_spec,
    kinds_taking,
    kinds_where,
    multiplies,
    no_batch_axis_variable,
)
from contracts.webhooks import Notify

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
                    "uint8", "uint16", "uint32", "uint64", "bool")
DIFFERENTIABLE_DTYPES = ("float16", "bfloat16", "float32", "float64")
STORABLE_DTYPES = ("float16", "float32", "float64")
JOB_ID_PATTERN = "^[0-9a-f]{32}$"  # uuid4().hex: the only ids the service issues
MAX_RANK = 32  # dimensions of an input tensor (numpy allows 64, no model input comes near)
MAX_INT64 = 2**63 - 1
MAX_CHUNK_ROWS = 2**31 - 1  # the worker clamps a forced chunk to the job's rows anyway
MAX_SHARDS = 1024
MAX_INPUTS = 64  # tensors of one request (inline or .npz members): one per model input


class Kind(str, Enum):
    jacobian = "jacobian"
    batch_jacobian = "batch_jacobian"
    hessian = "hessian"
    jvp = "jvp"
    vjp = "vjp"
    hvp = "hvp"
    svd = "svd"
    hessian_eig = "hessian_eig"
    hessian_trace = "hessian_trace"
    ggn_vp = "ggn_vp"
    fisher_vp = "fisher_vp"
    ggn_eig = "ggn_eig"
    ggn_trace = "ggn_trace"
    ggn_diag = "ggn_diag"
    ihvp = "ihvp"
    hessian_diag = "hessian_diag"
    spectral_density = "spectral_density"
    logdet = "logdet"

    @property
    def matrix_free(self) -> bool:
        """Products and spectra: computed from JVPs, VJPs or HVPs, never as the matrix."""
        return kind_spec(self.value).matrix_free

    @property
    def spec(self) -> object:
        """This kind's ``contracts.kinds.KindSpec``."""
        return kind_spec(self.value)


assert {k.value for k in Kind} == set(KINDS), "contracts.kinds.KINDS and jobspec.Kind must name the same kinds"

# Derived from the registry (contracts.kinds): never listed by hand.
DENSE_KINDS = kinds_where(family=Family.dense)
PRODUCT_KINDS = kinds_where(family=Family.products)         # products of seeds
SPECTRAL_KINDS = kinds_where(family=Family.spectral)        # spectra
MATRIX_FREE_KINDS = PRODUCT_KINDS + SPECTRAL_KINDS
MATRIX_FREE_HESSIAN_KINDS = tuple(k for k in MATRIX_FREE_KINDS if kind_spec(k).scalar_of)  # scalar of (or reduce)
SEEDS_MEMBER = "__seeds__"  # the seeds' name in an .npz body, in inputs_uri and in the stored inputs.npz


class Mode(str, Enum):
    auto = "auto"
    reverse = "reverse"
    forward = "forward"


class JobStatus(str, Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    canceled = "canceled"

    @property
    def is_terminal(self) -> bool:
        return self in (JobStatus.succeeded, JobStatus.failed, JobStatus.canceled)

    def can_move_to(self, to: JobStatus) -> bool:
        """Whether a job in this status may move to ``to`` (see ``ALLOWED_MOVES``)."""
        return to in ALLOWED_MOVES[self]


ALLOWED_MOVES: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.queued: frozenset({JobStatus.running, JobStatus.canceled, JobStatus.failed}),
    # queued again: a transient error (or a dead worker) with an rq retry left
    JobStatus.running: frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.canceled, JobStatus.queued}),
    JobStatus.succeeded: frozenset(),
    JobStatus.failed: frozenset(),
    JobStatus.canceled: frozenset(),
}
"""The moves of ``JobStore.transition``: nothing leaves a terminal status, and staying is not a move."""

RUN_JOB_TASK = "worker.tasks.run_job"  # the rq entry points, enqueued by dotted path (no TensorFlow in the API)
FINALIZE_JOB_TASK = "worker.tasks.finalize_job"
TIMEOUT_BACKSTOP_S = 60  # rq's job timeout lies this far past a job's limit: the worker checks the limit itself


class ModelRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1, description="SavedModel directory, under one of the allowed model roots")
    signature: str = "serving_default"


class TensorIn(BaseModel):
    """A tensor given inline: ``data`` is nested lists or a flat list of ``prod(shape)`` numbers."""

    model_config = ConfigDict(extra="forbid")
    shape: list[int]
    dtype: str = "float32"
    data: Any

    @model_validator(mode="after")
    def _check(self) -> TensorIn:
        if len(self.shape) > MAX_RANK:
            raise ValueError(f"shape: {len(self.shape)} dimensions, more than {MAX_RANK}; reshape the input")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"shape: dimensions must be >= 0, got {self.shape}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}")
        return self


class PatternUri(BaseModel):
    """``sparsity`` given as a pattern: an ``.npz`` with the int arrays ``rows`` and ``cols``."""

    model_config = ConfigDict(extra="forbid")
    pattern_uri: str = Field(min_length=1, description="an .npz under the results storage (local path, file:// or "
                             "s3://) with 1-d integer arrays 'rows' and 'cols': the flat row (of) and column (wrt) "
                             "indices of the entries that may be non-zero")


class PatternFrom(BaseModel):
    """``sparsity`` taken from the non-zeros of an earlier succeeded job on the same model, ``of`` and ``wrt``."""

    model_config = ConfigDict(extra="forbid")
    pattern_from: str = Field(pattern=JOB_ID_PATTERN, description="the id of an earlier succeeded 'jacobian' job "
                              "with the same model, signature, of and wrt")


Sparsity = Literal["auto"] | PatternUri | PatternFrom
SPARSITY_FORMS = ("null", "'auto'", "{'pattern_uri': '<.npz with rows and cols>'}", "{'pattern_from': '<job id>'}")


class JobOptions(BaseModel):
    """Everything of a job but its input tensors (also the query parameters of an .npz upload)."""

    model_config = ConfigDict(extra="forbid")
    of: str | None = Field(None, description="output name; may be omitted when the signature has one output")
    wrt: str | list[str] | None = Field(
        None, description="input name or 'variables/<name>'; may be omitted when unambiguous; "
        "also a list of them or 'variables/*' (every trainable variable), concatenated into one wrt axis "
        "(wrt_slices in the result says where each lies); batch_jacobian takes inputs with a batch axis only")
    kind: Kind = Kind.jacobian
    mode: Mode = Mode.auto
    reduce: str | None = Field(None, description="'sum' to take the Hessian of sum(of) for a non-scalar of")
    check_independence: bool = False
    memory_budget_bytes: int | None = Field(None, gt=0, le=MAX_INT64)
    timeout_s: int | None = Field(None, gt=0, le=MAX_INT64, description="wall-clock limit of the job (seconds; at "
                                  "most JACOBIAN_MAX_JOB_TIMEOUT_S); past it the job ends failed with error type "
                                  "JobTimeout; null: JACOBIAN_JOB_TIMEOUT_S")
    output_dtype: str | None = Field(None, description="store the result as this float dtype (default: of's dtype)")
    shards: int | None = Field(None, ge=1, description="row-range shards, each its own rq job (null: chosen from the "
                               "row count, the storage blocks and the live workers; see README 'Scale-out')")
    chunk_rows: int | None = Field(None, ge=1, le=MAX_CHUNK_ROWS, description="force this compute chunk (rows; "
                                   "at most the job's rows); default: planned from free memory")
    rank: int | None = Field(None, ge=1, le=MAX_CHUNK_ROWS, description="svd, hessian_eig: how many singular "
                             "values or eigenpairs (largest first)")
    tol: float | None = Field(None, gt=0, lt=0.5, description="svd, hessian_eig, ggn_eig: relative accuracy (default "
                              "1e-4); ihvp: the relative residual ||(A + damping I) x - v|| / ||v|| to reach (default "
                              "1e-5)")
    max_iterations: int | None = Field(None, ge=1, le=1_000_000, description="svd, hessian_eig, ggn_eig, ihvp: "
                                       "iterations allowed to meet tol (svd: subspace iterations, default 200; "
                                       "hessian_eig, ggn_eig: Lanczos steps, default max(20 rank, 100); ihvp: "
                                       "conjugate-gradient iterations per seed, default min(size of wrt, 1000)); not "
                                       "converged within them, the job fails with error type NotConverged naming "
                                       "the residuals")
    allow_unconverged: bool = Field(False, description="svd, hessian_eig, ggn_eig: keep a result that did not meet "
                                    "tol within max_iterations; the job succeeds with result.converged false and "
                                    "result.warning saying so (default false: such a job fails NotConverged)")
    samples: int | None = Field(None, ge=2, le=MAX_CHUNK_ROWS, description="hessian_trace: Hessian-vector products "
                                "to spend (default 100; at least the wrt size gives the exact trace)")
    probes: int | None = Field(None, ge=2, le=MAX_CHUNK_ROWS, description="hessian_diag, ggn_diag: Rademacher "
                               f"probes of Hutchinson's estimate (default {estimators.DIAGONAL_PROBES}; the exact "
                               f"diagonal when the wrt size is at most {estimators.EXACT_DIAGONAL_MAX} or probes >= "
                               "it); "
                               "spectral_density, logdet: start vectors of the Lanczos quadrature (default "
                               f"{estimators.SLQ_PROBES}; probes >= the wrt size: its unit vectors, no sampling error)")
    steps: int | None = Field(None, ge=1, le=estimators.MAX_STEPS, description="spectral_density, logdet: Lanczos "
                              f"steps per probe (default {estimators.SLQ_STEPS}; at most the wrt size are taken)")
    sigma: float | None = Field(None, gt=0, allow_inf_nan=False, description="spectral_density: the width of the "
                                "Gaussian that smooths the density (eigenvalue units; default "
                                f"{estimators.SIGMA_FRACTION:g} x the range of the Ritz values)")
    precision: Literal["highest", "tf32", "auto"] = Field(
        "highest", description="'highest': full float32 matmuls and convolutions on the GPU (TensorFloat-32 off, "
        "results within the CPU's tolerances); 'tf32': TensorFloat-32 on Ampere and later GPUs, faster, inputs "
        "rounded to 10 bits of mantissa (about 1e-3 relative; no effect on the CPU); 'auto': as 'highest', and when "
        "the result's float64-probe error estimate (result.precision_error) exceeds tol (the kinds that take tol) or "
        "the default of of's dtype (float32 1e-5, float16 1e-2, bfloat16 5e-2), the job is computed again on the "
        "model converted to float64 and stored in the same dtype (result.precision_promoted). Every result records "
        "the estimate; see README 'Precision'")
    sparsity: Sparsity | None = Field(
        None, description="kind 'jacobian' or 'hessian' with one input as wrt: compute J (or H) by colouring its "
        "sparsity pattern and store it as COO (arrays rows, cols, values; see README 'Sparse Jacobians'; a Hessian: "
        "star colouring, one HVP per colour, symmetric recovery). null: dense (the default); 'auto': the pattern "
        "detected from the model's graph (a Hessian's: from the gradient's graph); {'pattern_uri': url}: given as "
        "an .npz of rows and cols; {'pattern_from': job id}: the non-zeros of an earlier job's result")
    notify: Notify | None = Field(
        None, description="webhooks: {'url': ..., 'events': ['succeeded', 'failed', 'canceled', 'progress']}; each "
        "event POSTed to url, signed as Standard Webhooks (webhook-id, webhook-timestamp, webhook-signature) with "
        "the API key's secret, retried with backoff for 24 h (README 'Webhooks'); the url's host must be allowed "
        "by JACOBIAN_WEBHOOK_ALLOW")

    loss: Literal[LOSSES] | None = Field(  # type: ignore[valid-type]
        None, description="ggn_vp, fisher_vp, ggn_eig, ggn_trace, ggn_diag, ihvp with curvature 'ggn': the loss L "
        "on the output of, as Keras computes it (the mean over examples): 'mse' (of: predictions), "
        "'softmax_cross_entropy' (of: logits, classes on the last axis), 'sigmoid_cross_entropy' (of: logits); see "
        "README 'Curvature kinds'")
    labels: str | None = Field(None, min_length=1, description="fisher_vp: the name of the input that holds the "
                               "labels (an entry of inputs, or an .npz member, besides the signature's inputs; or a "
                               "signature input): of's shape, or for softmax_cross_entropy integer classes of "
                               "of.shape[:-1]")
    damping: float | None = Field(None, allow_inf_nan=False, description="ihvp: the damping added to the "
                                  "diagonal, the solve is (A + damping I) x = v; required, > 0. logdet: log det(H + "
                                  "damping I) (default 0); the job fails naming damping when H + damping I is not "
                                  "positive definite")
    curvature: Literal["hessian", "ggn"] | None = Field(None, description="ihvp: the matrix A, 'hessian' (H of a "
                                                        "scalar of; the default) or 'ggn' (with loss)")
    precondition: Literal["none", "diagonal"] | None = Field(
        None, description="ihvp: 'none' (plain conjugate gradients; the default) or 'diagonal' (Jacobi-preconditioned "
        "CG, M = diag(max(diag(A), 0) + damping): the diagonal of A exact from unit-vector products when the wrt size "
        f"is at most {estimators.EXACT_DIAGONAL_MAX}, else Hutchinson's estimate from {estimators.DIAGONAL_PROBES} "
        "Rademacher products; these products are counted, and the result attributes name the preconditioner). "
        "Fewer iterations when A's diagonal spans orders of magnitude")

    @field_validator("sparsity", mode="before")
    @classmethod
    def _sparsity_form(cls, value: Any) -> Any:
        """One clear message for a ``sparsity`` of none of the accepted forms (rather than one per form)."""
        if value is None or value == "auto":
            return value
        if isinstance(value, dict) and len(value) == 1:
            ((key, item),) = value.items()
            if key == "pattern_uri" and isinstance(item, str) and item:
                return value
            if key == "pattern_from" and isinstance(item, str) and is_job_id(item):
                return value
            if key == "pattern_from":
                raise ValueError(f"pattern_from: {_shown(item)} is not a job id; give the 32 hex digits that "
                                 "POST /v1/jobs answered for the earlier job")
        raise ValueError(f"{_shown(value)} is not a sparsity; use one of {', '.join(SPARSITY_FORMS)}")

    @model_validator(mode="after")
    def _check(self) -> JobOptions:
        if self.reduce not in (None, "sum"):
            raise ValueError(f"reduce: {self.reduce!r} is not supported; use 'sum' or omit it")
        spec = kind_spec(self.kind.value)
        if isinstance(self.wrt, list) and len(self.wrt) == 1:
            self.wrt = self.wrt[0]
        several = isinstance(self.wrt, list) or self.wrt == "variables/*"
        if several and not spec.several_wrt:
            raise ValueError(f"wrt: kind {spec.name!r} takes one name; give one input or 'variables/<name>'")
        if isinstance(self.wrt, list) and not 1 <= len(self.wrt) <= MAX_INPUTS + 1024:
            raise ValueError(f"wrt: a list of {len(self.wrt)} names; give 1 to {MAX_INPUTS + 1024}, or 'variables/*'")
        if spec.batch_axis:
            named = self.wrt if isinstance(self.wrt, list) else [self.wrt or ""]
            variables = [n for n in named if n.startswith("variables/")]
            if variables:
                raise ValueError(no_batch_axis_variable(spec.name, variables[0]))
        for name in KIND_FIELDS:
            kinds = kinds_taking(name)
            if getattr(self, name) not in (None, False) and self.kind.value not in kinds:
                raise ValueError(f"{name}: only for kind {' or '.join(repr(k) for k in kinds)}; remove it")
        for name in spec.required:
            if getattr(self, name) is None:
                raise ValueError(f"{name}: kind {spec.name!r} needs {name}, {FIELD_HELP.get(name, 'see its docs')}")
        if "damping" in spec.required and self.damping is not None and self.damping <= 0:   # a solve's shift
            raise ValueError(f"damping: kind {spec.name!r} needs a positive damping, got {self.damping:g}; "
                             f"{FIELD_HELP['damping']}")
        self._check_curvature()
        if self.output_dtype is not None and self.output_dtype not in STORABLE_DTYPES:
            raise ValueError(f"output_dtype: {self.output_dtype!r} cannot be stored (Zarr v3 has no bfloat16); "
                             f"use one of {', '.join(STORABLE_DTYPES)}")
        if self.sparsity is not None:
            self._check_sparsity()
        if self.precision == "auto" and self.shards not in (None, 1):
            raise ValueError(f"shards: precision 'auto' computes a job in one piece (its float64 recompute is of the "
                             f"whole job); set shards to 1 or null, or precision to 'highest' (sharded jobs record "
                             f"the estimate too), not shards={self.shards}")
        return self

    def _check_curvature(self) -> None:
        """A loss for a loss' curvature (``ggn`` products, ``ihvp`` with ``curvature: "ggn"``) and only for it."""
        spec = kind_spec(self.kind.value)
        uses_loss = bool(multiplies(spec, self.curvature).curvature)
        if uses_loss and self.reduce is not None:
            raise ValueError("reduce: the Gauss-Newton matrix is of the loss on of, not of sum(of); remove reduce")
        if "curvature" not in spec.fields:
            return
        if uses_loss and self.loss is None:
            raise ValueError(f"loss: kind {spec.name!r} with curvature {self.curvature!r} needs loss, "
                             f"{FIELD_HELP['loss']}")
        if not uses_loss and self.loss is not None:
            raise ValueError(f"loss: curvature {self.curvature or 'hessian'!r} is the Hessian of of itself and takes "
                             f"no loss; remove loss, or set curvature to one of "
                             + ", ".join(repr(c) for c in CURVATURES if multiplies(spec, c).curvature))

    def _check_sparsity(self) -> None:
        """``sparsity`` only for the kinds that take it (``jacobian``, ``hessian``) with respect to one signature
        input."""
        if not kind_spec(self.kind.value).sparsity:
            sparse = " or ".join(repr(k) for k in kinds_where(sparsity=True))
            raise ValueError(f"sparsity: only for kind {sparse} (a sparse result is the matrix's non-zeros), not "
                             f"{self.kind.value!r}; remove sparsity or use kind={sparse}")
        if isinstance(self.wrt, list) or (self.wrt or "").startswith("variables/"):
            raise ValueError(f"sparsity: works with respect to one signature input, not {self.wrt!r}; name one "
                             "input as wrt (no list, no variables/...) or remove sparsity")


class RequestedOptions(JobOptions):
    """``JobOptions`` as a client sends them (JSON body, ``.npz`` query): ``shards`` bounded as well."""

    shards: int | None = Field(None, ge=1, le=MAX_SHARDS, description="row-range shards, each its own rq job (at "
                               "most the storage blocks; null: chosen from the row count, the storage blocks and the "
                               "live workers; see README 'Scale-out')")


class JobCreate(RequestedOptions):
    """Body of ``POST /v1/jobs`` (JSON form)."""

    model: ModelRef
    inputs: dict[str, TensorIn] | None = Field(None, description=f"at most {MAX_INPUTS} tensors by input name")
    inputs_uri: str | None = Field(None, description="an .npz in storage (local path, file:// or s3://)")
    seeds: TensorIn | None = Field(None, description="jvp, hvp: tangents (k,) + wrt.shape; vjp: cotangents "
                                   f"(k,) + of.shape (in an .npz body or inputs_uri: the member {SEEDS_MEMBER!r})")

    @model_validator(mode="before")
    @classmethod
    def _few_inputs(cls, data: Any) -> Any:
        """Counted before any ``TensorIn`` is built (each costs about 1 KiB)."""
        inputs = data.get("inputs") if isinstance(data, dict) else None
        if isinstance(inputs, dict) and len(inputs) > MAX_INPUTS:
            raise ValueError(f"inputs: {len(inputs)} tensors, more than {MAX_INPUTS}; give one per model input")
        return data

    @model_validator(mode="after")
    def _one_source(self) -> JobCreate:
        if (self.inputs is None) == (self.inputs_uri is None):
            raise ValueError("inputs: give exactly one of 'inputs' (inline tensors) or 'inputs_uri' (an .npz)")
        return self


class QueuedJob(JobOptions):
    """What the API puts on the queue (JSON); inputs always travel as an .npz in storage."""

    id: str
    model: ModelRef
    inputs_uri: str
    results_url: str
    rows: tuple[int, int] | None = Field(None, description="row range of a shard; None means all rows")
    shard: int | None = Field(None, ge=0, description="index of this shard (0-based) when the job is split; "
                              "None for the job itself (which plans the shards) and its finalizer")
    strategy: str | None = Field(None, description="chunk strategy every shard uses (e.g. 'tiled+xla'), pinned by "
                                 "the job's planner so that all rows are computed alike; None: a timed trial picks")
    api_key: str | None = Field(None, description="the name of the API key that submitted the job (its webhooks' "
                                "secret); None without API keys")


def _shown(value: Any) -> str:
    """``repr(value)``, cut to 80 characters, for a message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_job_id(text: str) -> bool:
    """True for a string shaped like the ids the service issues (32 lowercase hex digits)."""
    return _JOB_ID.fullmatch(text) is not None


_JOB_ID = re.compile("[0-9a-f]{32}")


def shard_job_id(job_id: str, index: int) -> str:
    """rq job id of shard ``index`` of ``job_id``."""
    return f"{job_id}-s{index}"


def finalizer_job_id(job_id: str) -> str:
    """rq job id of the finalizer of a sharded job."""
    return f"{job_id}-final"
