"""``/v1/jobs``: submit (validated against the signature, then queued), list, read, cancel, read result rows.

The handlers are thin: submission is ``app.submit``, page tokens ``app.paging``, a job's files
``app.job_storage``; answers are the typed records of ``contracts.records``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from rq import Queue
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job
from rq.job import JobStatus as RqStatus
from starlette.concurrency import run_in_threadpool

from app import inputs as tensors
from app import rows as result_rows
from app.deps import ApiKeyDep, JobIdDep, QueueDep, SettingsDep, StoreDep, require_api_key
from app.dry_run import dry_run as quote_job
from app.errors import ApiError, ClientClosedRequest, InvalidRequest, error_responses
from app.events import EVENT_MEDIA_TYPE, EventStreamResponse, job_events
from app.job_storage import open_result, remove_job_files
from app.metrics import JOBS_CANCELED, JOBS_REJECTED
from app.paging import decode_token, encode_token
from app.sparse import SparseResult
from app.submit import JSON_MEDIA_TYPE, read_body, submit
from app.submit import enqueue as enqueue  # re-exported: bench/bench_shards.py enqueues as the API does
from contracts.jobspec import JobOptions, JobStatus
from contracts.layout import SPARSE_FORMAT
from contracts.quote import Quote
from contracts.records import ErrorInfo, JobAccepted, JobList, JobPublic

NPY_MEDIA_TYPE = "application/octet-stream"
_CANCELED_QUEUED = ErrorInfo(type="Canceled", message="canceled before it started")

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(require_api_key)],
                   responses=error_responses(401, 429))


_NPZ_PARAMS = ["model_path", "signature", *JobOptions.model_fields]
# The .npz body's options travel as query parameters, which a JSON body refuses: OpenAPI cannot tie
# parameters to one media type, so they are described here rather than declared as parameters.
_SUBMIT_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": f"A JSON body (JobCreate, no query parameters), or an .npz body (Content-Type: "
                       f"{tensors.NPZ_MEDIA_TYPE}, one array per model input) with the options as query "
                       f"parameters: {', '.join(_NPZ_PARAMS)} (model_path required; values as in JobCreate; "
                       "sparsity as auto, pattern_from:<job id>, pattern_uri:<url> or the JSON object; notify as its "
                       "JSON object).",
        "content": {
            JSON_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/JobCreate"}},
            tensors.NPZ_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
        },
    },
}


@router.post("", status_code=202, response_model=JobAccepted, openapi_extra=_SUBMIT_OPENAPI,
             responses={200: {"model": Quote, "description": "dry_run=true: the quote; nothing queued or written"},
                        400: {"description": "malformed body"},
                        403: {"description": "model path not allowed, or notify.url not allowed for webhooks "
                              "(JACOBIAN_WEBHOOK_ALLOW) or no secret to sign them"},
                        408: {"description": "the body stalled"}, 413: {"description": "body or inputs too large"},
                        415: {"description": "unsupported Content-Type"}, 422: {"description": "invalid request"},
                        503: {"description": "Redis, or the S3 model root the model lies under, unreachable"}})
async def create_job(
    request: Request, settings: SettingsDep, store: StoreDep, queue: QueueDep, api_key: ApiKeyDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
    dry_run: Annotated[bool, Query(description="true: run every check, then answer 200 with the quote (result "
                                   "bytes, passes, predicted peak memory and time, whether they are guesses); "
                                   "nothing is queued or written")] = False,
) -> JSONResponse:
    """Validate a job against the model's signature, store its inputs, queue it: ``202`` and ``Location``.

    JSON body (``JobCreate``) or an ``.npz`` body (``Content-Type: application/x-npz``) with the
    options as query parameters. Nothing is stored or queued when validation fails. ``dry_run=true``
    (with either body): the same checks and refusals, then ``200`` with the ``Quote``, nothing written.
    """
    query = {k: v for k, v in request.query_params.items() if k != "dry_run"}
    try:
        body, media = await read_body(request, settings)
        if dry_run:
            quoted = await run_in_threadpool(quote_job, body, media, query, settings=settings, store=store,
                                             api_key=api_key)
            return JSONResponse(quoted.model_dump(mode="json"), status_code=200)
        job_id, status = await run_in_threadpool(submit, body, media, query, settings=settings,
                                                 store=store, queue=queue, idempotency_key=idempotency_key,
                                                 api_key=api_key)
    except ClientClosedRequest:
        raise  # not a refusal: nobody is left to read the answer
    except (ApiError, ValidationError) as exc:
        JOBS_REJECTED.labels(type(exc).__name__).inc()
        raise
    return JSONResponse(JobAccepted(id=job_id, status=status).model_dump(mode="json"), status_code=202,
                        headers={"Location": f"/v1/jobs/{job_id}"})


@router.get("", response_model=JobList, response_model_exclude_unset=True)
def list_jobs(
    store: StoreDep,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    page_token: Annotated[str | None, Query(description="next_page_token of the previous page")] = None,
) -> JobList:
    """Jobs newest first: ``{"jobs": [...], "next_page_token": str | null}``."""
    before, before_id = decode_token(page_token) if page_token else (None, None)
    records = store.list(status=status, limit=limit, before=before, before_id=before_id)
    token = encode_token(records[-1].created_at, records[-1].id) if len(records) == limit else None
    return JobList(jobs=[r.public() for r in records], next_page_token=token)


@router.get("/{job_id}", response_model=JobPublic, response_model_exclude_unset=True,
            responses=error_responses(404))
def get_job(job_id: JobIdDep, store: StoreDep) -> JobPublic:
    """Status, progress, chunk plan, result and error of one job (404 if unknown)."""
    return store.get(job_id).public()


@router.get("/{job_id}/events", summary="Follow a job: Server-Sent Events of its status and progress",
            response_class=EventStreamResponse, status_code=200,
            responses={200: {"content": {EVENT_MEDIA_TYPE: {}},
                             "description": "events 'status', 'progress' and 'end' (data: the GET /v1/jobs/{id} body)"},
                       **error_responses(404, 503)})
async def job_events_stream(
    request: Request, job_id: JobIdDep, store: StoreDep, settings: SettingsDep,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> EventStreamResponse:
    """Server-Sent Events of one job until it ends: ``status`` on each new status, ``progress`` (rows, rate,
    ETA) as rows are done, ``end`` with the terminal record, then the stream closes.

    Every event's ``data`` is the ``GET /v1/jobs/{id}`` body; its ``id`` sent back as ``Last-Event-ID``
    resumes with the later events only. A comment every ``JACOBIAN_EVENT_HEARTBEAT_S`` keeps the
    connection open. 404 for an unknown job; 503 with ``Retry-After`` beyond ``JACOBIAN_MAX_EVENT_STREAMS``
    open streams in this process.
    """
    record = await run_in_threadpool(store.get, job_id)
    slots = request.app.state.event_streams
    events = job_events(store, record, last_event_id=last_event_id, poll_s=settings.event_poll_s,
                        heartbeat_s=settings.event_heartbeat_s)
    slots.acquire(settings.max_event_streams)
    return EventStreamResponse(events, slots)


@router.post("/{job_id}/cancel", response_model=JobPublic, response_model_exclude_unset=True,
             responses=error_responses(404))
def cancel_job(job_id: JobIdDep, store: StoreDep, queue: QueueDep) -> JobPublic:
    """Request cancellation: a queued job is canceled now; a running one stops at its next chunk boundary.

    Answers the job's record; a job that had already ended is left as it is."""
    record = store.get(job_id)
    JOBS_CANCELED.labels(record.status.value).inc()
    if record.status.is_terminal:
        return record.public()
    store.set_fields(job_id, cancel_requested=True)
    if (record.status == JobStatus.queued and _cancel_rq_job(job_id, queue)
            and store.transition(job_id, JobStatus.canceled, error=_CANCELED_QUEUED)):
        remove_job_files(record.spec.get("results_url"), job_id, why="canceled")  # its inputs: it never runs
    return store.get(job_id).public()


def _cancel_rq_job(job_id: str, queue: Queue) -> bool:
    """Cancel the rq job unless a worker has it already; True when it will never start."""
    try:
        job = Job.fetch(job_id, connection=queue.connection, serializer=queue.serializer)
    except NoSuchJobError:
        return True
    if job.get_status() not in (RqStatus.QUEUED, RqStatus.SCHEDULED, RqStatus.DEFERRED, RqStatus.CANCELED):
        return False
    try:
        job.cancel()
    except InvalidJobOperation:
        pass
    return True


@router.get("/{job_id}/result", response_class=Response,
            responses={200: {"content": {NPY_MEDIA_TYPE: {}}, "description": "rows a:b as .npy bytes"},
                       **error_responses(404, 409, 416)})
def get_result(
    job_id: JobIdDep, store: StoreDep, settings: SettingsDep,
    rows: Annotated[str | None, Query(description="row range 'a:b' (0-based, b exclusive); default all")] = None,
) -> Response:
    """Rows ``a:b`` of a succeeded job's result as ``.npy``, shaped ``(b - a,) + row_shape``.

    Rows run over the result's iterated axes (``X-Rows-Total``, ``X-Row-Shape`` headers). The answer
    streams one storage block at a time; a range of several rows is limited to
    ``JACOBIAN_MAX_BODY_BYTES``, a single row is always served, however large. 409 until the job has
    succeeded, 416 for a range outside the result, 422 for a malformed one. A sparse Jacobian (stored as
    COO, ``X-Result-Format: coo``) answers dense rows of its ``(n_of, n_wrt)`` matrix, ``(b - a,) + wrt_shape``
    (as a dense Jacobian in reverse mode), built from the entries of those rows only.
    """
    result = open_result(store.get(job_id), sparse=True)
    headers: dict[str, str] = {}
    if isinstance(result, SparseResult):
        rows_total, row_shape, row_bytes, dtype = result.rows_total, result.row_shape, result.row_bytes, result.dtype
        headers["X-Result-Format"] = SPARSE_FORMAT
    else:
        layout = result_rows.layout_of(result)
        rows_total, row_shape, row_bytes, dtype = layout.rows_total, layout.row_shape, layout.row_bytes, result.dtype
    start, stop = result_rows.parse_rows(rows, rows_total)
    _check_size(start, stop, row_bytes, max_bytes=settings.max_body_bytes)
    headers |= {"Content-Disposition": f'attachment; filename="{job_id}-rows-{start}-{stop}.npy"',
                "X-Rows-Total": str(rows_total), "X-Row-Shape": json.dumps(list(row_shape)),
                "Content-Length": str(result_rows.npy_size(dtype, (stop - start,) + row_shape))}
    if isinstance(result, SparseResult):
        body = result_rows.npy_stream(dtype, (stop - start,) + row_shape, result.iter_rows(start, stop))
    else:
        body = result_rows.iter_npy(result, layout, start, stop)
    return StreamingResponse(body, media_type=NPY_MEDIA_TYPE, headers=headers)


def _check_size(start: int, stop: int, row_bytes: int, *, max_bytes: int) -> None:
    """Rows ``start:stop`` fit in ``max_bytes`` (a single row always does); else a 422 naming a range that fits."""
    size_bytes = (stop - start) * row_bytes
    if stop - start > 1 and size_bytes > max_bytes:
        per = max(1, max_bytes // max(1, row_bytes))
        raise InvalidRequest(f"rows: {start}:{stop} is {size_bytes} bytes, over {max_bytes} "
                             f"(JACOBIAN_MAX_BODY_BYTES); ask for at most {per} rows at a time, e.g. "
                             f"rows={start}:{min(stop, start + per)} (one row is always served)", field="rows")
