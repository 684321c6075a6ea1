"""Typed job records as they travel worker -> Redis -> API -> client: progress, plan, result, error.

The JSON the API serves is these models dumped with ``exclude_unset=True``: a key is in the answer
exactly when it is in the stored record (a job not yet planned has ``"plan": {}``, which the UI reads
as "not chosen yet"). A field added here with a default therefore shows up only where it is set.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from contracts.jobspec import JobStatus, Kind, ModelRef
from contracts.webhooks import NotifyStatus


class Progress(BaseModel):
    """Rows of the job's result done so far: ``rows_done`` of ``rows_total``, ``fraction`` (0..1),
    ``rows_per_second`` and ``eta_seconds`` (None: unknown). ``Progress.not_started()`` is a job not started yet
    (rows_total unknown until a worker has loaded the model); ``Progress.of`` is every other state."""

    rows_done: int = 0
    rows_total: int | None = None
    fraction: float = 0.0
    rows_per_second: float | None = None
    eta_seconds: float | None = None

    @classmethod
    def not_started(cls) -> Progress:
        """``Progress()`` with every key set: a new job's record stores and serves all five (``rows_total`` null)."""
        return cls(rows_done=0, rows_total=None, fraction=0.0, rows_per_second=None, eta_seconds=None)

    @classmethod
    def of(cls, rows_done: int, rows_total: int, rows_per_second: float) -> Progress:
        """Progress at ``rows_done`` of ``rows_total`` rows at ``rows_per_second``.

        ``fraction`` is rounded to 6 digits (1.0 when there are no rows), the rate to 3; the ETA is
        ``(rows_total - rows_done) / rows_per_second`` rounded to 3, 0.0 when nothing is left and
        None when the rate is 0 (not measured yet). E.g. ``Progress.of(1, 4, 0.5)``: fraction 0.25,
        ETA 6.0 s.
        """
        left = rows_total - rows_done
        return cls(rows_done=rows_done, rows_total=rows_total,
                   fraction=1.0 if rows_total == 0 else round(rows_done / rows_total, 6),
                   rows_per_second=round(rows_per_second, 3),
                   eta_seconds=0.0 if left <= 0 else (round(left / rows_per_second, 3) if rows_per_second > 0
                                                     else None))


class PlanInfo(BaseModel):
    """The public chunk plan. The engine writes more keys than these (``fixed_bytes``, ``xla``,
    ``source``, ``plan_key``, ``trial``, ``rows_per_second`` by chunk size, ``budget_halvings``,
    ``rows_computed``, ``run_seconds``, ``timed_rows`` and ``chunks_run``: the chunk sizes timed, and per chunk size
    run the largest size timed before it; ``peaks``: the peak bytes measured per chunk size in this run); they are
    kept as given (the UI lists every scalar one)."""

    model_config = ConfigDict(extra="allow")

    chunk_rows: int | None = Field(None, description="rows per compute chunk")
    strategy: str | None = Field(None, description="chunk strategy, e.g. 'vectorized' or 'tiled+xla'")
    mode: str | None = Field(None, description="'reverse' or 'forward'")
    free_bytes_at_start: int | None = Field(None, description="device memory free when the job started (bytes)")
    bytes_per_row: int | None = Field(None, description="measured memory per row of a chunk (bytes)")
    oom_retries: int | None = Field(None, description="chunks retried smaller after running out of memory")
    shards: int | None = Field(None, description="row-range shards the job runs as (1: not split)")
    sparsity: dict[str, Any] | None = Field(
        None, description="a job with option sparsity: the pattern's 'source', 'nnz', 'density', 'colors', "
        "'verified', 'mode', and 'fallback' (why the result is dense) when the sparse path was not taken")


PRECISION_FIELDS = ("precision_error", "precision_probes", "precision_method", "precision_tol", "precision_promoted",
                    "precision_error_before", "precision_reason")   # the precision guard's, in manifest and result


class ResultInfo(BaseModel):
    """Where a succeeded job's result lies: a Zarr array at ``uri`` of ``shape`` and ``dtype``. A sparse
    Jacobian (``format`` ``"coo"``) has ``shape`` ``[nnz]`` (its ``values``) and the matrix's ``dense_shape``
    ``[n_of, n_wrt]``."""

    uri: str
    shape: list[int]
    dtype: str
    format: str | None = Field(None, description="'coo' for a sparse Jacobian (arrays rows, cols, values, indptr "
                               "in the group); absent for a dense result")
    dense_shape: list[int] | None = Field(None, description="format 'coo': the matrix's shape [n_of, n_wrt]")
    converged: bool | None = Field(None, description="svd, hessian_eig: whether every value met tol (false only "
                                   "when the request said allow_unconverged: true)")
    warning: str | None = Field(None, description="what is wrong with a result kept anyway (an unconverged "
                                "spectrum: its largest residual against tol; precision 'auto' on a model that cannot "
                                "run in float64)")
    precision_error: float | None = Field(None, description="the result's relative error estimate from float64 "
                                          "probes (README 'Precision': what it measures per kind); 0 for a float64 "
                                          "model; absent when the model cannot run in float64 or the job had shards")
    precision_probes: int | None = Field(None, description="the float64 products the estimate spent")
    precision_method: str | None = Field(None, description="how the estimate was made, or why none was")
    precision_tol: float | None = Field(None, description="precision 'auto': the tolerance the estimate was held to")
    precision_promoted: bool | None = Field(None, description="precision 'auto': whether the job was computed again "
                                            "in float64 (precision_error is then the promoted result's estimate)")
    precision_error_before: float | None = Field(None, description="a promoted job: the first result's estimate")
    precision_reason: str | None = Field(None, description="a promoted job: why it was promoted")


class ErrorInfo(BaseModel):
    """Why a job failed (or was canceled): the error's ``type`` and a ``message`` naming the fix;
    ``transient`` is set on an error that rq retries (the job is ``queued`` again)."""

    type: str
    message: str
    transient: bool | None = None


class JobAccepted(BaseModel):
    """The body of ``202`` to ``POST /v1/jobs``: the job's id and status (``queued``, or the status of the
    job an ``Idempotency-Key`` named before)."""

    id: str
    status: JobStatus


class JobPublic(BaseModel):
    """The body of ``GET /v1/jobs/{id}`` (and of ``POST /v1/jobs/{id}/cancel``); times are ISO 8601 UTC."""

    id: str
    status: JobStatus
    progress: Progress
    plan: PlanInfo
    result: ResultInfo | None
    error: ErrorInfo | None
    created_at: str | None
    started_at: str | None
    finished_at: str | None
    kind: Kind | None
    model: ModelRef | None
    notify: NotifyStatus | None = Field(None, description="a job with notify: its URL, events and each event's "
                                        "last delivery (delivered, attempts, last_error); absent otherwise")


class JobList(BaseModel):
    """A page of ``GET /v1/jobs``: newest first; ``next_page_token`` is null on the last page."""

    jobs: list[JobPublic]
    next_page_token: str | None


def dump(record: BaseModel | Any) -> Any:
    """``record`` as stored and served: a model dumped to JSON types with the keys it was given; anything
    else (a dict, None) as it is."""
    if isinstance(record, BaseModel):
        return record.model_dump(mode="json", exclude_unset=True)
    return record


def iso_time(ts: float) -> str:
    """``ts`` (seconds since the epoch) as ISO 8601 UTC with milliseconds, as records and manifests show times."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int((ts % 1) * 1000):03d}Z"
