"""A job's files in storage as the API sees them: its result array opened for reading, its folder removed."""

from __future__ import annotations

import logging
from typing import Any

from app.errors import JobNotFinished
from app.sparse import SparseResult, is_sparse
from contracts import storage
from contracts.jobspec import JobStatus
from contracts.jobstore import JobRecord
from contracts.layout import RESULT_GROUP, job_url

log = logging.getLogger(__name__)


def result_uri(record: JobRecord, *, use: str = "its result can be read") -> str:
    """Where a succeeded job's result lies; ``JobNotFinished`` (409) until the job has succeeded.
    ``use`` is what waits for success, for the message ("its preview can be drawn")."""
    if record.status != JobStatus.succeeded:
        detail = f" ({record.error.message})" if record.error is not None else ""
        raise JobNotFinished(f"id: job {record.id!r} is {record.status.value}{detail}; {use} once its status is "
                             "'succeeded'")
    if record.result is not None and record.result.uri:
        return record.result.uri
    return f"{job_url(record.spec['results_url'], record.id)}/{RESULT_GROUP}"


def open_result(record: JobRecord, *, use: str = "its result can be read", sparse: bool = False) -> Any:
    """The result array of a succeeded job (``result_uri``), opened read-only (nothing read yet); with
    ``sparse``, a sparse Jacobian's group as an ``app.sparse.SparseResult`` (``open_result_at``)."""
    return open_result_at(record.id, result_uri(record, use=use), sparse=sparse)


def open_result_at(job_id: str, uri: str, *, sparse: bool = False) -> Any:
    """The result array (``jacobian``, the kind's main array) of job ``job_id`` in its group at ``uri``,
    opened read-only; with ``sparse``, a group of format ``coo`` as an ``app.sparse.SparseResult`` instead
    (without: its ``values``).

    Raises ``JobNotFinished`` (409) when it is missing: the service never deletes a stored result, so
    it was removed from storage by someone, or this API reads other storage than the worker wrote
    (``JACOBIAN_RESULTS_URL``, the S3 endpoint or credentials).
    """
    try:
        node = storage.open_result_node(uri)
        if sparse and is_sparse(node):
            return SparseResult.of_group(node)
        return storage.result_array(node)
    except (FileNotFoundError, KeyError) as exc:
        raise JobNotFinished(
            f"id: job {job_id!r} succeeded but its result is gone from {uri!r} ({exc}); stored results are never "
            "deleted by the service, so it was removed from storage, or this API reads other storage than the "
            "worker wrote (check JACOBIAN_RESULTS_URL and the S3 endpoint and credentials of both); restore the "
            "result there or submit the job again") from None


def remove_job_files(results_url: str | None, job_id: str, *, why: str) -> None:
    """Remove the job's folder (its ``inputs.npz``, any partial result) once the job will never run.

    Storage errors are logged, not raised: the job's fate is decided either way, the folder is only
    clutter. ``why`` says what happened to the job, for the log ("canceled", "not queued").
    """
    if not results_url:
        return
    try:
        storage.delete_prefix(job_url(results_url, job_id))
    except OSError as exc:
        log.warning("job %s: %s, but its files could not be removed: %s", job_id, why, exc)
