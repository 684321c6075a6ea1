"""The rq entry points (JSON serializer, enqueued by dotted path so the API never imports TensorFlow).

``worker.tasks.run_job`` runs a queued job, or one of its shards when ``spec["shard"]`` is set;
``worker.tasks.finalize_job`` finishes a sharded job. The work itself is in ``worker.runs``; here a
spec is validated, and each attempt is logged and counted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from contracts.jobspec import JobStatus, QueuedJob
from contracts.jobstore import JobStore
from contracts.logs import job_context
from contracts.records import ErrorInfo, dump
from contracts.settings import Settings, get_settings
from worker import metrics
from worker.runs import Attempt, Finalizer, JobRun, ShardRun

log = logging.getLogger(__name__)


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    """rq entry point (``"worker.tasks.run_job"``): validate ``spec`` as a ``QueuedJob`` and run it.

    The job itself, or one of its shards (``spec["shard"]`` set). Engine errors end the job ``failed``
    without raising (rq must not retry them); transient storage or connection errors are re-raised
    so rq's ``Retry`` applies (to the failing shard alone, for a sharded job).
    """
    return _validated_run(spec, lambda job: ShardRun if job.shard is not None else JobRun)


def finalize_job(spec: dict[str, Any]) -> dict[str, Any]:
    """rq entry point (``"worker.tasks.finalize_job"``) of a sharded job's finalizer: see ``Finalizer``."""
    return _validated_run(spec, lambda job: Finalizer, part="finalizer")


def _rq_context() -> tuple[Settings, Any, JobStore]:
    from rq import get_current_job

    settings = get_settings()
    rq_job = get_current_job()
    connection = rq_job.connection if rq_job is not None else redis.Redis.from_url(settings.redis_url)
    return settings, rq_job, JobStore(connection, ttl_s=settings.result_ttl_s)


def _validated_run(spec: dict[str, Any], attempt_class: Any, part: str | None = None) -> dict[str, Any]:
    """``spec`` validated as a ``QueuedJob`` (else the job fails as ``InvalidJobSpec``), then run."""
    from pydantic import ValidationError

    settings, rq_job, store = _rq_context()
    try:
        job = QueuedJob.model_validate(spec)
    except ValidationError as err:
        return _invalid_spec(spec, err, store)
    with job_context(job.id):
        return _run_observed(attempt_class(job)(job, store, settings, rq_job), part=part)


def _invalid_spec(spec: Any, err: Exception, store: JobStore) -> dict[str, Any]:
    job_id = spec.get("id") if isinstance(spec, dict) else None
    error = ErrorInfo(type="InvalidJobSpec", message=f"spec: not a valid queued job: {err}")
    with job_context(str(job_id) if job_id else None):
        if job_id and store.exists(str(job_id)):
            store.transition(str(job_id), JobStatus.failed, error=error)
        log.error("job %s failed: %s", job_id, error.message, extra={"event": "job_finished", "status": "failed"})
        metrics.observe_job_end("other", JobStatus.failed.value, 0.0)
    return {"id": job_id, "status": JobStatus.failed.value, "error": dump(error)}


def _run_observed(run: Attempt, part: str | None = None) -> dict[str, Any]:
    """``run.run()`` with its start and end logged and counted: queue wait, duration, finished by status.

    A shard or a finalizer counts as a finished job only when it sets the job's terminal status.
    """
    kind = run.job.kind.value
    if part is None and run.job.shard is not None:
        part = f"shard {run.job.shard + 1}/{run.job.shards}"
    what = f"job {run.job.id}" + (f" {part}" if part else "")
    wait_s = metrics.queue_wait_seconds(run.rq_job)
    if wait_s is not None:
        metrics.QUEUE_WAIT.observe(wait_s)
    log.info("%s started: %s of %s, queue wait %s s", what, kind, run.job.model.path,
             "?" if wait_s is None else f"{wait_s:.3f}",
             extra={"event": "job_started", "kind": kind, "queue_wait_s": wait_s, "part": part,
                    "attempt_retries_left": getattr(run.rq_job, "retries_left", None)})
    start = time.monotonic()
    status = "interrupted"
    try:
        with metrics.JOBS_RUNNING.track_inprogress():
            result = run.run()
        status = "skipped" if run.skipped else (run.metric_status or str(result.get("status")))
        return result
    except Exception:
        status = "retrying" if run.retries_left else (run.metric_status or JobStatus.failed.value)
        raise
    finally:
        seconds = time.monotonic() - start
        metrics.observe_job_end(kind, status, seconds)
        finished = status in metrics.FINISHED_STATUSES
        log.log(logging.WARNING if status in ("failed", "retrying") else logging.INFO,
                "%s %s %s after %.3f s", what, "ended" if finished else "attempt ended", status, seconds,
                extra={"event": "job_finished" if finished else "job_attempt_ended", "kind": kind, "status": status,
                       "duration_s": round(seconds, 6), "part": part})
