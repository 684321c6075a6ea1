"""What an attempt does when it fails: one classification of errors into outcomes, shared by the job,
its shards and the finalizer, each of which says what an outcome means for it (``Attempt``'s hooks)."""

from __future__ import annotations

import enum
import logging
import time
from typing import Any

import redis

from contracts.graph_scan import ModelRefused
from contracts.jobspec import JobStatus, QueuedJob
from contracts.jobstore import JobStore
from contracts.records import PRECISION_FIELDS, ErrorInfo, ResultInfo, dump
from contracts.savedmodel import SavedModelError
from contracts.settings import Settings
from worker.engine.errors import EngineError, Stopped
from worker.inputs import InvalidInputs, ModelPathNotAllowed
from worker.result_group import remove_job_result, remove_partial_result
from worker.storage import ResultWriteError

log = logging.getLogger(__name__)


class JobTimeout(Exception):
    """The job ran longer than its limit (its ``timeout_s``, else ``JACOBIAN_JOB_TIMEOUT_S``); more time is not a
    retry.

    Not a ``TimeoutError``: those are connection troubles, which ``is_transient`` retries.
    """


class Outcome(enum.Enum):
    """What an error means for the job; the attempt's hooks carry it out."""

    STOPPED = "stopped"      # cancel (or the job ended elsewhere): stop, remove nothing more
    INVALID = "invalid"      # the request cannot succeed (engine, inputs, model path, model refused): fail for good
    TIMEOUT = "timeout"      # the job's limit (or rq's backstop): fail for good as JobTimeout, no retry, re-raise
    RETRY = "retry"          # transient, retries left: re-raise, rq's Retry runs it again (it resumes)
    EXHAUSTED = "exhausted"  # transient, no retries left: fail, keep committed blocks, re-raise
    BUG = "bug"              # anything else: fail, no retry (a bug does not heal), re-raise


def _transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ResultWriteError, redis.exceptions.ConnectionError,
                                        redis.exceptions.TimeoutError, ConnectionError, TimeoutError]
    try:
        import botocore.exceptions as bx

        types += [bx.ConnectionError, bx.HTTPClientError]
    except ImportError:  # pragma: no cover - botocore comes with s3fs
        pass
    return tuple(types)


def is_transient(err: BaseException) -> bool:
    """Storage or connection trouble that a later attempt may not meet (or an error marked ``transient``)."""
    return isinstance(err, _transient_types()) or getattr(err, "transient", False) is True


def _is_rq_timeout(err: BaseException) -> bool:
    from rq.timeouts import JobTimeoutException

    return isinstance(err, JobTimeoutException)


def classify(err: BaseException, *, retries_left: bool) -> Outcome:
    """The outcome of ``err`` for an attempt with (``retries_left``) or without rq retries left."""
    if isinstance(err, Stopped):
        return Outcome.STOPPED
    if _is_rq_timeout(err) or isinstance(err, JobTimeout):
        return Outcome.TIMEOUT
    if is_transient(err):
        return Outcome.RETRY if retries_left else Outcome.EXHAUSTED
    if isinstance(err, (EngineError, InvalidInputs, ModelPathNotAllowed, ModelRefused, SavedModelError)):
        return Outcome.INVALID
    return Outcome.BUG


def error_info(err: BaseException) -> ErrorInfo:
    """The job's ``error``: the exception's type name and message."""
    return ErrorInfo(type=type(err).__name__, message=str(err))


class Attempt:
    """One attempt of one rq job: the queued ``job``, its record in ``store``, the ``rq_job`` running it.

    Subclasses implement ``run`` and the hooks ``on_stopped``, ``on_failed`` and ``on_retry``;
    ``settle(err)`` classifies an error and calls them. ``skipped`` (nothing ran) and
    ``metric_status`` (the status to count, when not the returned one) are read by the metrics.
    """

    what = "job"

    def __init__(self, job: QueuedJob, store: JobStore, settings: Settings, rq_job: Any = None) -> None:
        self.job, self.store, self.settings, self.rq_job = job, store, settings, rq_job
        self.skipped = False
        self.metric_status: str | None = None
        self.started_s = time.monotonic()

    @property
    def retries_left(self) -> bool:
        return bool(self.rq_job is not None and getattr(self.rq_job, "retries_left", None))

    @property
    def timeout_s(self) -> int:
        """This rq job's timeout (the job's own, else ``settings.job_timeout_s``)."""
        return int(getattr(self.rq_job, "timeout", None) or self.settings.job_timeout_s)

    @property
    def limit_s(self) -> int:
        """The job's wall-clock limit: its ``timeout_s``, else ``JACOBIAN_JOB_TIMEOUT_S`` (or rq's timeout where that
        is shorter: a job queued with a short rq timeout and no ``timeout_s``)."""
        if self.job.timeout_s:
            return int(self.job.timeout_s)
        rq_timeout = getattr(self.rq_job, "timeout", None)
        default = int(self.settings.job_timeout_s)
        return min(int(rq_timeout), default) if rq_timeout and int(rq_timeout) > 0 else default

    def check_time(self) -> None:
        """Raise ``JobTimeout`` once this attempt has run longer than ``limit_s`` (asked between chunks)."""
        elapsed_s = time.monotonic() - self.started_s
        if elapsed_s > self.limit_s:
            raise JobTimeout(self.timeout_message(elapsed_s))

    def timeout_message(self, elapsed_s: float) -> str:
        """The ``JobTimeout`` message: which limit was hit, the time spent, and the fix."""
        source = "the request's timeout_s" if self.job.timeout_s else "the default, JACOBIAN_JOB_TIMEOUT_S"
        return (f"timeout_s: the job ran {elapsed_s:.1f} s, longer than its limit of {self.limit_s} s ({source}); "
                f"ask for a larger timeout_s (at most {self.settings.max_job_timeout_s} s, "
                "JACOBIAN_MAX_JOB_TIMEOUT_S) or split the job (\"shards\", fewer inputs)")

    def run(self) -> dict[str, Any]:
        raise NotImplementedError

    def on_stopped(self) -> dict[str, Any]:
        raise NotImplementedError

    def on_failed(self, error: ErrorInfo, *, delete: bool) -> dict[str, Any]:
        """Record the failure (``delete``: the partial result is worthless) and return the attempt's result."""
        raise NotImplementedError

    def on_retry(self, err: BaseException) -> None:
        log.warning("job %s: %s: transient error, rq will retry it: %s", self.job.id, self.what, err)

    def settle(self, err: Exception) -> dict[str, Any]:
        """Carry out ``classify(err)``: returns the attempt's result, or raises ``err`` for rq to see."""
        outcome = classify(err, retries_left=self.retries_left)
        if outcome is Outcome.STOPPED:
            return self.on_stopped()
        if outcome is Outcome.INVALID:
            return self.on_failed(error_info(err), delete=True)
        if outcome is Outcome.TIMEOUT:
            timeout = err if isinstance(err, JobTimeout) else JobTimeout(
                self.timeout_message(time.monotonic() - self.started_s))
            self.on_failed(error_info(timeout), delete=True)
            self._no_more_retries()
        elif outcome is Outcome.RETRY:
            self.on_retry(err)
        elif outcome is Outcome.EXHAUSTED:
            self.on_failed(error_info(err), delete=False)
        else:
            log.exception("job %s: %s: unexpected error", self.job.id, self.what)
            self.on_failed(error_info(err), delete=False)
            self._no_more_retries()
        raise err

    # -- what the job and the finalizer do alike ----------------------------------------------------

    def cancel_job(self) -> dict[str, Any]:
        """Remove the job's result folder and mark it ``canceled``."""
        job = self.job
        try:
            remove_job_result(job.results_url, job.id)
        except OSError as err:
            log.warning("job %s: canceled, but partial data could not be removed: %s", job.id, err)
        if not self.store.transition(job.id, JobStatus.canceled):
            return self._ended_meanwhile()
        log.info("job %s canceled", job.id)
        return {"id": job.id, "status": JobStatus.canceled.value}

    def fail_job(self, error: ErrorInfo, *, delete: bool) -> dict[str, Any]:
        """Mark the job ``failed`` with ``error``; ``delete`` removes its array and commit markers."""
        job = self.job
        if delete:
            remove_partial(job.results_url, job.id)
        if not self.store.transition(job.id, JobStatus.failed, error=error):
            return self._ended_meanwhile()
        log.info("job %s failed: %s: %s", job.id, error.type, error.message)
        return {"id": job.id, "status": JobStatus.failed.value, "error": dump(error)}

    def _ended_meanwhile(self) -> dict[str, Any]:
        """The job reached a terminal status elsewhere (another attempt, a cancel): it keeps that one."""
        status = self.store.get(self.job.id).status.value
        log.info("job %s is already %s; its status stays", self.job.id, status)
        self.metric_status = "stopped"
        return {"id": self.job.id, "status": status}

    def _no_more_retries(self) -> None:
        if self.rq_job is not None:
            self.rq_job.retries_left = None


def result_of(manifest: dict[str, Any]) -> ResultInfo:
    """The job record's ``result`` from a manifest: ``uri``, ``shape``, ``dtype``; a sparse (COO) result adds
    ``format`` and its ``dense_shape``; a spectrum ``converged`` (and the ``warning`` of an unconverged one kept by
    ``allow_unconverged``). Only the keys that apply are set (a dense result's record has none of the others)."""
    given = {name: manifest[name] for name in ("converged", "warning", *PRECISION_FIELDS)
             if manifest.get(name) is not None}
    if manifest.get("format") == "coo":
        given.update(format="coo", dense_shape=manifest["dense_shape"])
    return ResultInfo(uri=manifest["uri"], shape=manifest["shape"], dtype=manifest["dtype"], **given)


def remove_partial(results_url: str, job_id: str) -> None:
    """Remove the array and the commit markers of a failed job (its inputs stay); storage trouble is logged."""
    try:
        remove_partial_result(results_url, job_id)
    except OSError as err:
        log.warning("job %s: partial data could not be removed: %s", job_id, err)
