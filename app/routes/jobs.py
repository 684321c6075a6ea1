"""``/v1/jobs``: submit (validated against the signature, then queued), list, read, cancel, read result rows."""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Mapping
from typing import IO, Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from rq import Queue, Retry
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job
from rq.job import JobStatus as RqStatus
from starlette.concurrency import run_in_threadpool

from app import checks
from app import inputs as tensors
from app import rows as result_rows
from app.deps import JobIdDep, QueueDep, SettingsDep, StoreDep, require_api_key
from app.errors import (ApiError, ClientClosedRequest, IdempotencyKeyReused, InvalidRequest, JobNotFinished,
                        NotReady, UnsupportedMediaType, error_responses)
from app.metrics import JOBS_CANCELED, JOBS_REJECTED, JOBS_SUBMITTED
from app.routes.models import load_signature
from app.security import check_path_text
from contracts import storage
from contracts.jobspec import JobCreate, JobOptions, JobStatus, ModelRef, QueuedJob, is_job_id
from contracts.jobstore import JobRecord, JobStore
from contracts.layout import RESULT_ARRAY, job_url
from contracts.settings import Settings

TASK = "worker.tasks.run_job"
JSON_MEDIA_TYPE = "application/json"
NPY_MEDIA_TYPE = "application/octet-stream"
RETRY_INTERVALS_S = [5, 30]
_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")
MAX_TOKEN_CHARS = 256

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(require_api_key)],
                   responses=error_responses(401))


class JobAccepted(BaseModel):
    id: str
    status: JobStatus


_NPZ_PARAMS = ["model_path", "signature", *JobOptions.model_fields]
# The .npz body's options travel as query parameters, which a JSON body refuses: OpenAPI cannot tie
# parameters to one media type, so they are described here rather than declared as parameters.
_SUBMIT_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": f"A JSON body (JobCreate, no query parameters), or an .npz body (Content-Type: "
                       f"{tensors.NPZ_MEDIA_TYPE}, one array per model input) with the options as query "
                       f"parameters: {', '.join(_NPZ_PARAMS)} (model_path required; values as in JobCreate).",
        "content": {
            JSON_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/JobCreate"}},
            tensors.NPZ_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
        },
    },
}


@router.post("", status_code=202, response_model=JobAccepted, openapi_extra=_SUBMIT_OPENAPI,
             responses={400: {"description": "malformed body"}, 403: {"description": "model path not allowed"},
                        408: {"description": "the body stalled"}, 413: {"description": "body or inputs too large"},
                        415: {"description": "unsupported Content-Type"}, 422: {"description": "invalid request"}})
async def create_job(
    request: Request, settings: SettingsDep, store: StoreDep, queue: QueueDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JSONResponse:
    """Validate a job against the model's signature, store its inputs, queue it: ``202`` and ``Location``.

    JSON body (``JobCreate``) or an ``.npz`` body (``Content-Type: application/x-npz``) with the
    options as query parameters. Nothing is stored or queued when validation fails.
    """
    media = (request.headers.get("content-type") or JSON_MEDIA_TYPE).split(";")[0].strip().lower()
    try:
        if media not in (JSON_MEDIA_TYPE, tensors.NPZ_MEDIA_TYPE):
            raise UnsupportedMediaType(f"Content-Type: {media!r} is not supported; send {JSON_MEDIA_TYPE} "
                                       f"or {tensors.NPZ_MEDIA_TYPE}")
        max_bytes, limit_name = settings.max_body_bytes, "JACOBIAN_MAX_BODY_BYTES"
        if media == JSON_MEDIA_TYPE and settings.max_json_body_bytes < max_bytes:  # JSON costs ~10x its size parsed
            max_bytes, limit_name = settings.max_json_body_bytes, "JACOBIAN_MAX_JSON_BODY_BYTES"
        body = await tensors.read_limited(request.stream(), max_bytes=max_bytes, limit_name=limit_name,
                                          content_length=request.headers.get("content-length"),
                                          read_timeout_s=settings.body_read_timeout_s)
        job_id, status = await run_in_threadpool(
            submit, body, media, dict(request.query_params), settings=settings, store=store, queue=queue,
            idempotency_key=idempotency_key)
    except ClientClosedRequest:
        raise  # not a refusal: nobody is left to read the answer
    except (ApiError, ValidationError) as exc:
        JOBS_REJECTED.labels(type(exc).__name__).inc()
        raise
    return JSONResponse({"id": job_id, "status": status.value}, status_code=202,
                        headers={"Location": f"/v1/jobs/{job_id}"})


def submit(body: bytes, media: str, query: Mapping[str, str], *, settings: Settings, store: JobStore,
           queue: Queue, idempotency_key: str | None) -> tuple[str, JobStatus]:
    """Validate, then store inputs, create the record and enqueue; returns ``(job id, status)``."""
    if idempotency_key is not None and not _IDEMPOTENCY_KEY.match(idempotency_key):
        raise InvalidRequest("Idempotency-Key: use 1 to 255 printable ASCII characters without spaces")
    queued, arrays = validate(body, media, query, settings)
    body_hash = fingerprint(queued, arrays)
    job_id = uuid.uuid4().hex
    if idempotency_key is not None:
        stored_id, stored_hash = store.claim_idempotency_key(idempotency_key, job_id=job_id, body_hash=body_hash,
                                                             ttl_s=settings.result_ttl_s)
        if stored_id != job_id:
            if stored_hash != body_hash:
                raise IdempotencyKeyReused(f"Idempotency-Key: {idempotency_key!r} was used with another body "
                                           f"(job {stored_id}); use a new key for a new job")
            try:
                return stored_id, store.get(stored_id).status
            except KeyError:
                return stored_id, JobStatus.queued
    try:
        enqueue(job_id, queued, arrays, settings=settings, store=store, queue=queue)
    except BaseException:
        if idempotency_key is not None:
            store.release_idempotency_key(idempotency_key)
        raise
    return job_id, JobStatus.queued


def fingerprint(queued: QueuedJob, arrays: Mapping[str, np.ndarray]) -> str:
    """SHA-256 of the validated request (spec and input tensors): equal for JSON and .npz forms of
    the same job, indifferent to key order and whitespace."""
    h = hashlib.sha256(json.dumps(queued.model_dump(mode="json"), sort_keys=True).encode())
    for name in sorted(arrays):
        arr = np.ascontiguousarray(arrays[name])
        h.update(json.dumps([name, arr.dtype.str, list(arr.shape)]).encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def validate(body: bytes, media: str, query: Mapping[str, str],
             settings: Settings) -> tuple[QueuedJob, dict[str, np.ndarray]]:
    """Everything checked before anything is written; returns the spec (id and URIs blank) and inputs.

    Shapes and dtypes (from the JSON or from the ``.npz`` headers) are checked against the signature,
    the kind and the result size limit before any ``.npz`` data is inflated.
    """
    if media == tensors.NPZ_MEDIA_TYPE:
        options, model = tensors.parse_npz_query(query)
        job: JobCreate | None = None
    else:
        if query:
            raise InvalidRequest(f"query: {', '.join(sorted(query))} not used with a JSON body; put the options "
                                 "in the body")
        job = tensors.parse_job_json(body)
        options, model = JobOptions.model_validate(job.model_dump(include=set(JobOptions.model_fields))), job.model
    model_dir, info, sig = load_signature(model.path, model.signature, settings.model_roots,
                                          path_field="model.path" if job else "model_path",
                                          signature_field="model.signature" if job else "signature")

    def check(described: Mapping[str, checks.Described]) -> tuple[str, str]:
        checks.check_signature(described, sig)
        of = checks.resolve_of(options.of, sig)
        wrt = checks.resolve_wrt(options.wrt, sig, info.variables)
        checks.check_kind(options, sig, of, wrt, described, info.variables)
        checks.check_result_size(options, sig, of, wrt, described, info.variables,
                                  max_result_bytes=settings.max_result_bytes)
        return of, wrt

    limits = {"max_bytes": settings.max_input_bytes, "max_elements": settings.max_input_elements}
    if job is not None and job.inputs is not None:
        arrays = tensors.arrays_from_json(job.inputs, sig, **limits)
        of, wrt = check(arrays)
    else:
        with contextlib.ExitStack() as stack:
            if job is None:
                source = stack.enter_context(tensors.NpzInputs(body, field="body", **limits))
            else:
                uri = str(job.inputs_uri)
                file = stack.enter_context(_open_inputs_uri(uri, settings))
                source = stack.enter_context(tensors.NpzInputs(file, field="inputs_uri", **limits))
            of, wrt = check(source.headers)
            arrays = source.arrays()
    checks.check_finite(arrays)
    spec = options.model_dump(exclude={"of", "wrt"})
    queued = QueuedJob(id="", model=ModelRef(path=str(model_dir), signature=model.signature), inputs_uri="",
                       results_url=storage.normalize(settings.results_url), of=of, wrt=wrt, **spec)
    return queued, arrays


def _open_inputs_uri(uri: str, settings: Settings) -> IO[bytes]:
    """The .npz at ``uri`` opened for reading; it must lie under the results storage (the service
    reads nothing else) and be a file."""
    check_path_text(uri, field="inputs_uri", local=not storage.is_remote(uri))
    base = storage.normalize(settings.results_url).rstrip("/") + "/"
    if ".." in uri.split("/") or not storage.normalize(uri).startswith(base):
        raise InvalidRequest(f"inputs_uri: {uri!r} is not under the results storage {base!r}; upload the .npz "
                             "there or send it as the body (Content-Type: application/x-npz)", field="inputs_uri")
    try:
        return storage.open_file(uri)
    except FileNotFoundError:
        raise InvalidRequest(f"inputs_uri: nothing at {uri!r}; upload the .npz first", field="inputs_uri") from None
    except (IsADirectoryError, NotADirectoryError):
        raise InvalidRequest(f"inputs_uri: {uri!r} is a folder, not a file; give the URL of the .npz itself",
                             field="inputs_uri") from None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise InvalidRequest(f"inputs_uri: {uri[:80]!r}... is longer than the file system allows; use a "
                                 "shorter name", field="inputs_uri") from None
        raise NotReady(f"storage: cannot read inputs_uri ({type(exc).__name__}); retry later (see GET /readyz)") \
            from None


def enqueue(job_id: str, queued: QueuedJob, arrays: Mapping[str, np.ndarray], *, settings: Settings,
            store: JobStore, queue: Queue) -> None:
    """Write ``inputs.npz``, create the job record, put ``worker.tasks.run_job(spec)`` on the rq queue."""
    try:
        url = tensors.write_inputs(queued.results_url, job_id, arrays)
    except OSError as exc:
        raise NotReady(f"storage: cannot write the job's inputs under {queued.results_url!r} ({exc}); "
                       "retry later (see GET /readyz)") from None
    spec = queued.model_copy(update={"id": job_id, "inputs_uri": url}).model_dump(mode="json")
    record = JobRecord(id=job_id, status=JobStatus.queued, spec=spec, created_at=time.time(),
                       progress={"rows_done": 0, "rows_total": None, "fraction": 0.0, "rows_per_second": None,
                                 "eta_seconds": None})
    store.create(record)
    try:
        queue.enqueue_call(
            TASK, args=(spec,), job_id=job_id, timeout=settings.job_timeout_s, result_ttl=settings.result_ttl_s,
            failure_ttl=settings.result_ttl_s, description=f"{spec['kind']} job {job_id}",
            retry=Retry(max=settings.job_retries, interval=RETRY_INTERVALS_S) if settings.job_retries > 0 else None)
    except BaseException:
        store.connection.delete(store.key(job_id))
        store.connection.zrem(store.index_key, job_id)
        raise
    JOBS_SUBMITTED.labels(spec["kind"]).inc()


@router.get("")
def list_jobs(
    store: StoreDep,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    page_token: Annotated[str | None, Query(description="next_page_token of the previous page")] = None,
) -> dict[str, Any]:
    """Jobs newest first: ``{"jobs": [...], "next_page_token": str | null}``."""
    before, before_id = _decode_token(page_token) if page_token else (None, None)
    records = store.list(status=status, limit=limit, before=before, before_id=before_id)
    token = _encode_token(records[-1].created_at, records[-1].id) if len(records) == limit else None
    return {"jobs": [r.to_public() for r in records], "next_page_token": token}


def _encode_token(created_at: float, job_id: str) -> str:
    raw = json.dumps({"before": created_at, "id": job_id}).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_token(token: str) -> tuple[float, str | None]:
    """``(created_at, id)`` of a token this service issued; anything else is a 422 naming ``page_token``."""
    error = InvalidRequest("page_token: not a token from a previous page; omit it to start from the newest job",
                           field="page_token")
    if len(token) > MAX_TOKEN_CHARS:
        raise error
    try:
        raw = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (ValueError, RecursionError):  # binascii.Error, UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise error from None
    if not isinstance(raw, dict) or set(raw) - {"before", "id"}:
        raise error
    before, job_id = raw.get("before"), raw.get("id")
    if isinstance(before, bool) or not isinstance(before, (int, float)) or not math.isfinite(before) or before < 0:
        raise error
    if job_id is not None and not (isinstance(job_id, str) and is_job_id(job_id)):
        raise error
    return float(before), job_id


@router.get("/{job_id}", responses=error_responses(404))
def get_job(job_id: JobIdDep, store: StoreDep) -> dict[str, Any]:
    """Status, progress, chunk plan, result and error of one job (404 if unknown)."""
    return store.get(job_id).to_public()


@router.post("/{job_id}/cancel", responses=error_responses(404))
def cancel_job(job_id: JobIdDep, store: StoreDep, queue: QueueDep) -> dict[str, Any]:
    """Request cancellation: a queued job is canceled now; a running one stops at its next chunk boundary."""
    record = store.get(job_id)
    JOBS_CANCELED.labels(record.status.value).inc()
    if record.status.is_terminal:
        return record.to_public()
    store.update(job_id, cancel_requested=True)
    if record.status == JobStatus.queued and _cancel_rq_job(job_id, queue):
        store.update(job_id, status=JobStatus.canceled, finished_at=time.time(),
                     error={"type": "Canceled", "message": "canceled before it started"})
        _remove_job_data(record)
    return store.get(job_id).to_public()


def _remove_job_data(record: JobRecord) -> None:
    """Remove a job's folder (its ``inputs.npz``) once it will never run, as a worker does when it cancels."""
    results_url = record.spec.get("results_url")
    if not results_url:
        return
    try:
        storage.delete_prefix(job_url(results_url, record.id))
    except OSError as exc:  # the job is canceled either way; the folder is only clutter
        log.warning("job %s: canceled, but its inputs could not be removed: %s", record.id, exc)


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
    succeeded, 416 for a range outside the result, 422 for a malformed one.
    """
    record = store.get(job_id)
    if record.status != JobStatus.succeeded:
        detail = f" ({record.error.get('message')})" if record.error else ""
        raise JobNotFinished(f"id: job {job_id!r} is {record.status.value}{detail}; its result can be read once "
                             "its status is 'succeeded'")
    uri = (record.result or {}).get("uri") or f"{job_url(record.spec['results_url'], job_id)}/{RESULT_ARRAY}"
    try:
        array = storage.open_array(uri, mode="r")
    except (FileNotFoundError, KeyError) as exc:
        raise JobNotFinished(f"id: job {job_id!r} succeeded but its result is gone from {uri!r} ({exc}); "
                             "results expire, submit the job again") from None
    layout = result_rows.layout_of(array)
    start, stop = result_rows.parse_rows(rows, layout.rows_total)
    size_bytes = (stop - start) * layout.row_bytes
    if stop - start > 1 and size_bytes > settings.max_body_bytes:
        per = max(1, settings.max_body_bytes // max(1, layout.row_bytes))
        raise InvalidRequest(f"rows: {start}:{stop} is {size_bytes} bytes, over {settings.max_body_bytes} "
                             f"(JACOBIAN_MAX_BODY_BYTES); ask for at most {per} rows at a time, e.g. "
                             f"rows={start}:{min(stop, start + per)} (one row is always served)", field="rows")
    headers = {"Content-Disposition": f'attachment; filename="{job_id}-rows-{start}-{stop}.npy"',
               "X-Rows-Total": str(layout.rows_total), "X-Row-Shape": json.dumps(list(layout.row_shape)),
               "Content-Length": str(result_rows.npy_size(array.dtype, (stop - start,) + layout.row_shape))}
    return StreamingResponse(result_rows.iter_npy(array, layout, start, stop), media_type=NPY_MEDIA_TYPE,
                             headers=headers)
