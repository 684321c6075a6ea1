"""Submitting a job: read the body, validate it against the model's signature, store the inputs,
create the record and queue ``worker.tasks.run_job``; nothing is left behind when a step fails."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import Mapping
from typing import IO, Any

import numpy as np
from fastapi import Request
from rq import Queue, Retry

from app import checks
from app import inputs as tensors
from app.errors import IdempotencyKeyReused, InvalidRequest, NotReady, UnsupportedMediaType
from app.job_storage import remove_job_files
from app.metrics import JOBS_SUBMITTED
from app.notify import check_notify
from app.quotas import admitted, quota_name
from app.routes.models import load_signature
from app.security import check_path_text
from contracts import npz, storage
from contracts.jobspec import (
    RUN_JOB_TASK,
    SEEDS_MEMBER,
    TIMEOUT_BACKSTOP_S,
    JobCreate,
    JobOptions,
    JobStatus,
    ModelRef,
    PatternUri,
    QueuedJob,
)
from contracts.jobstore import JobRecord, JobStore
from contracts.kinds import kind_spec, several_wrt
from contracts.outbox import Outbox
from contracts.settings import ApiKey, Settings

JSON_MEDIA_TYPE = "application/json"
RETRY_INTERVALS_S = [5, 30]
_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")

log = logging.getLogger(__name__)


async def read_body(request: Request, settings: Settings) -> tuple[bytes, str]:
    """The request body (within the size limit of its media type) and its media type; raises
    ``UnsupportedMediaType`` for anything but JSON and ``.npz``, ``BodyTooLarge``, ``BodyTimeout``."""
    media = (request.headers.get("content-type") or JSON_MEDIA_TYPE).split(";")[0].strip().lower()
    if media not in (JSON_MEDIA_TYPE, tensors.NPZ_MEDIA_TYPE):
        raise UnsupportedMediaType(f"Content-Type: {media!r} is not supported; send {JSON_MEDIA_TYPE} "
                                   f"or {tensors.NPZ_MEDIA_TYPE}")
    max_bytes, limit_name = settings.max_body_bytes, "JACOBIAN_MAX_BODY_BYTES"
    if media == JSON_MEDIA_TYPE and settings.max_json_body_bytes < max_bytes:  # JSON costs ~10x its size parsed
        max_bytes, limit_name = settings.max_json_body_bytes, "JACOBIAN_MAX_JSON_BODY_BYTES"
    body = await tensors.read_limited(request.stream(), max_bytes=max_bytes, limit_name=limit_name,
                                      content_length=request.headers.get("content-length"),
                                      read_timeout_s=settings.body_read_timeout_s)
    return body, media


def submit(body: bytes, media: str, query: Mapping[str, str], *, settings: Settings, store: JobStore,
           queue: Queue, idempotency_key: str | None, api_key: ApiKey | None = None) -> tuple[str, JobStatus]:
    """Validate, then store inputs, create the record and enqueue; returns ``(job id, status)``.
    ``api_key``: the key that sent the request (its name is kept with the job; its secret signs webhooks; its
    quotas admit the job: ``QuotaExceeded`` when over one, nothing queued; ``app.quotas``)."""
    if idempotency_key is not None and not _IDEMPOTENCY_KEY.match(idempotency_key):
        raise InvalidRequest("Idempotency-Key: use 1 to 255 printable ASCII characters without spaces")
    queued, arrays = validate(body, media, query, settings)
    check_notify(queued.notify, settings, api_key)
    if api_key is not None:
        queued = queued.model_copy(update={"api_key": api_key.name})
    checks.check_pattern_from(queued.sparsity, store, model=queued.model, of=queued.of or "",
                              wrt=str(queued.wrt), kind=queued.kind.value)
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
        with admitted(store.connection, quota_name(api_key), job_id, settings.quota_limits(api_key)):
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
    npz.update_digest(h, arrays)
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
    if options.timeout_s is not None and options.timeout_s > settings.max_job_timeout_s:
        raise InvalidRequest(f"timeout_s: {options.timeout_s} s is more than the {settings.max_job_timeout_s} s "
                             "this service allows (JACOBIAN_MAX_JOB_TIMEOUT_S); ask for less or split the job "
                             "(\"shards\")", field="timeout_s")
    model_dir, info, sig = load_signature(model.path, model.signature, settings.model_roots,
                                          op_allow=settings.model_op_allow,
                                          path_field="model.path" if job else "model_path",
                                          signature_field="model.signature" if job else "signature")

    def check(described: Mapping[str, checks.Described]) -> tuple[str, Any]:
        spec = kind_spec(options.kind.value)
        if spec.matrix_free or several_wrt(options.wrt):
            variables = info.variables_of(sig.name)
            of, wrt = checks.check_matrix_free(options, sig, described, variables, seeds=seeds_given(described))
            if not spec.matrix_free:   # a dense kind over several sources: each one's rules, the summed size
                checks.check_sources(options, sig, of, wrt, described, variables,
                                     max_result_bytes=settings.max_result_bytes)
            return of, wrt
        checks.check_signature(described, sig)
        of = checks.resolve_of(options.of, sig)
        variables = info.variables_of(sig.name)
        wrt = checks.resolve_wrt(options.wrt, sig, variables)
        checks.check_sparsity_wrt(options, wrt, sig)
        checks.check_kind(options, sig, of, wrt, described)
        checks.check_result_size(options, sig, of, wrt, described, variables,
                                  max_result_bytes=settings.max_result_bytes)
        return of, wrt

    def seeds_given(described: Mapping[str, checks.Described]) -> checks.Described | None:
        if job is not None and job.seeds is not None:
            if SEEDS_MEMBER in described:
                raise InvalidRequest(f"seeds: given twice, as the JSON field and as the member {SEEDS_MEMBER!r} of "
                                     "inputs_uri; keep one", field="seeds")
            return job.seeds
        return described.get(SEEDS_MEMBER)

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
    if job is not None and job.seeds is not None:
        arrays[SEEDS_MEMBER] = tensors.arrays_from_json({SEEDS_MEMBER: job.seeds}, sig, **limits)[SEEDS_MEMBER]
    checks.check_finite(arrays)
    if isinstance(options.sparsity, PatternUri):
        check_pattern_uri(options.sparsity.pattern_uri, settings)
    spec = options.model_dump(exclude={"of", "wrt"})
    queued = QueuedJob(id="", model=ModelRef(path=str(model_dir), signature=model.signature), inputs_uri="",
                       results_url=storage.normalize(settings.results_url), of=of, wrt=wrt, **spec)
    return queued, arrays


def _open_inputs_uri(uri: str, settings: Settings, *, field: str = "inputs_uri",
                     instead: str = "or send it as the body (Content-Type: application/x-npz)") -> IO[bytes]:
    """The .npz at ``uri`` (the request's ``field``) opened for reading; it must lie under the results
    storage (the service reads nothing else) and be a file. ``instead``: the other way to give it."""
    check_path_text(uri, field=field, local=not storage.is_remote(uri))
    base = storage.normalize(settings.results_url).rstrip("/") + "/"
    if ".." in uri.split("/") or not storage.normalize(uri).startswith(base):
        raise InvalidRequest(f"{field}: {uri!r} is not under the results storage {base!r}; upload the .npz "
                             f"there {instead}", field=field)
    try:
        return storage.open_file(uri)
    except FileNotFoundError:
        raise InvalidRequest(f"{field}: nothing at {uri!r}; upload the .npz first", field=field) from None
    except (IsADirectoryError, NotADirectoryError):
        raise InvalidRequest(f"{field}: {uri!r} is a folder, not a file; give the URL of the .npz itself",
                             field=field) from None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise InvalidRequest(f"{field}: {uri[:80]!r}... is longer than the file system allows; use a "
                                 "shorter name", field=field) from None
        raise NotReady(f"storage: cannot read {field} ({type(exc).__name__}); retry later (see GET /readyz)") \
            from None


def check_pattern_uri(uri: str, settings: Settings) -> None:
    """``sparsity: {"pattern_uri": uri}``: an .npz under the results storage (as ``inputs_uri``: the worker
    reads nothing else) whose members ``rows`` and ``cols`` are 1-d integer arrays of one length (their
    headers are read; the indices' range against the Jacobian's shape is the worker's check)."""
    field = "sparsity.pattern_uri"
    with _open_inputs_uri(uri, settings, field=field, instead="or use sparsity='auto'") as file:
        try:
            with npz.open_zip(file) as zf:
                members = {m.name: m for m in npz.read_headers(zf)}
        except npz.NpzError as exc:
            raise InvalidRequest(f"{field}: {uri!r} is not a readable .npz ({exc}); write it with "
                                 "numpy.savez(path, rows=..., cols=...)", field=field) from None
    fix = "write it with numpy.savez(path, rows=..., cols=...), the flat row and column indices of the non-zeros"
    for name in ("rows", "cols"):
        member = members.get(name)
        if member is None:
            raise InvalidRequest(f"{field}: {uri!r} has no array {name!r} (it has {sorted(members)}); {fix}",
                                 field=field)
        if len(member.shape) != 1 or member.dtype.kind not in "iu":
            raise InvalidRequest(f"{field}: {name!r} is {member.dtype.name} of shape {list(member.shape)}, not a 1-d "
                                 f"integer array; {fix}", field=field)
    if members["rows"].shape != members["cols"].shape:
        raise InvalidRequest(f"{field}: 'rows' has {members['rows'].shape[0]} entries and 'cols' "
                             f"{members['cols'].shape[0]}; give one row and one column index per entry", field=field)


def enqueue(job_id: str, queued: QueuedJob, arrays: Mapping[str, np.ndarray], *, settings: Settings,
            store: JobStore, queue: Queue) -> None:
    """Write ``inputs.npz``, create the job record, put ``worker.tasks.run_job(spec)`` on the rq queue.

    When the record or the queue cannot be written, the record and ``inputs.npz`` are removed again and
    the error is raised: a job is either queued or leaves nothing behind."""
    try:
        url = tensors.write_inputs(queued.results_url, job_id, arrays)
    except OSError as exc:
        raise NotReady(f"storage: cannot write the job's inputs under {queued.results_url!r} ({exc}); "
                       "retry later (see GET /readyz)") from None
    spec = queued.model_copy(update={"id": job_id, "inputs_uri": url}).model_dump(mode="json")
    try:
        store.create(JobRecord(id=job_id, status=JobStatus.queued, spec=spec, created_at=time.time()))
        if queued.notify is not None:
            Outbox(store.connection).watch(job_id, at=time.time())
        queue.enqueue_call(
            RUN_JOB_TASK, args=(spec,), job_id=job_id, timeout=rq_timeout_s(queued, settings),
            result_ttl=settings.result_ttl_s, failure_ttl=settings.result_ttl_s,
            description=f"{spec['kind']} job {job_id}",
            retry=Retry(max=settings.job_retries, interval=RETRY_INTERVALS_S) if settings.job_retries > 0 else None)
    except BaseException:
        _roll_back(job_id, queued.results_url, store)
        raise
    JOBS_SUBMITTED.labels(spec["kind"]).inc()


def rq_timeout_s(job: QueuedJob, settings: Settings) -> int:
    """rq's job timeout: a backstop for a chunk that never returns, ``TIMEOUT_BACKSTOP_S`` past the job's
    limit (its ``timeout_s``, else ``JACOBIAN_JOB_TIMEOUT_S``), which the worker checks between chunks."""
    return (job.timeout_s or settings.job_timeout_s) + TIMEOUT_BACKSTOP_S


def _roll_back(job_id: str, results_url: str, store: JobStore) -> None:
    """Undo a submission that could not be queued: its record (if written) and its stored inputs.

    Called while an exception propagates: a failure here (Redis gone) is logged, never raised over it."""
    try:
        store.delete(job_id)
        Outbox(store.connection).unwatch(job_id)
    except Exception as exc:  # noqa: BLE001 - the original error is the one to answer
        log.warning("job %s: not queued, and its record could not be removed: %s", job_id, exc)
    remove_job_files(results_url, job_id, why="not queued")
