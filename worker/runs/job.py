"""The job itself: validate the request, then compute every row, or split the job into shards."""

from __future__ import annotations

import logging
import time
from typing import Any

from contracts.jobspec import JobStatus
from contracts.jobstore import JobNotFound, JobRecord, merge_shard_progress
from contracts.records import ErrorInfo, PlanInfo, dump
from worker.execution import executor_for
from worker.execution.precision import run_guarded
from worker.pipeline import at_least
from worker.runs.attempt import result_of
from worker.runs.computing import ComputingAttempt
from worker.sharding import ShardPlan, enqueue_shards, live_workers

log = logging.getLogger(__name__)


class JobRun(ComputingAttempt):
    """One attempt at the job itself; status, plan and progress go to the ``JobStore``.

    It validates the request and either computes every row or, when it is split (see
    ``worker.sharding``), creates the result array, enqueues one rq job per row-range shard and a
    finalizer that depends on them, and returns with the job ``running``.
    """

    def run(self) -> dict[str, Any]:
        """Run the attempt; returns ``{"id", "status", "result" | "error"}``; raises transient errors."""
        job, store = self.job, self.store
        record = self._record()
        if record.status.is_terminal:
            log.info("job %s is already %s; nothing to do", job.id, record.status.value)
            self.skipped = True
            return {"id": job.id, "status": record.status.value}
        if record.cancel_requested:
            return self.on_stopped()
        if record.status == JobStatus.queued:  # else a retried attempt of a running job: it resumes
            store.transition(job.id, JobStatus.running, error=None)
        try:
            return self._compute(record)
        except Exception as err:  # noqa: BLE001 - classified by settle(), which re-raises
            return self.settle(err)

    def _record(self) -> JobRecord:
        try:
            return self.store.get(self.job.id)
        except JobNotFound:
            record = JobRecord(id=self.job.id, status=JobStatus.queued, spec=self.job.model_dump(mode="json"),
                               created_at=time.time())
            self.store.create(record)
            return record

    def _compute(self, record: JobRecord) -> dict[str, Any]:
        """Split the job (its executor decides, ``Executor.split``) or compute it whole (``Executor.run``)."""
        job, store = self.job, self.store
        earlier = self._earlier_split()
        if earlier is not None:
            return earlier
        reported = record.progress.rows_done  # by an earlier attempt

        def on_plan(engine_plan: dict[str, Any]) -> None:
            store.set_fields(job.id, plan=PlanInfo.model_validate({"shards": 1, **engine_plan}))

        ctx = self.run_context(created_at=record.created_at, on_plan=on_plan,
                               on_progress=lambda p: store.set_fields(job.id, progress=at_least(p, reported)),
                               should_stop=lambda: store.should_stop(job.id))  # cancel, or ended elsewhere
        executor = executor_for(job)
        # precision 'auto' may compute the job again in float64: the job is one piece (POST refuses shards > 1)
        split = None if job.precision == "auto" else executor.split(ctx, self)
        if split is not None:
            return self._fan_out(split)
        return self._succeed(run_guarded(executor, ctx))

    def _succeed(self, manifest: dict[str, Any]) -> dict[str, Any]:
        job, store = self.job, self.store
        result = result_of(manifest)
        final_plan = PlanInfo.model_validate({**(manifest.get("plan") or {}), "shards": 1})
        if not store.transition(job.id, JobStatus.succeeded, result=result, error=None, plan=final_plan):
            return self._ended_meanwhile()
        log.info("job %s succeeded: %s", job.id, result.uri)
        return {"id": job.id, "status": JobStatus.succeeded.value, "result": dump(result)}

    # -- splitting the job into shards (the executor's ShardHost) -----------------------------------

    @property
    def min_shard_seconds(self) -> float:
        return float(self.settings.shard_min_seconds)

    def live_workers(self) -> int:
        return live_workers(self.store.connection, self._queue(), settings=self.settings)

    def store_split(self, split: ShardPlan) -> ShardPlan:
        return ShardPlan.from_json(self.store.set_shard_plan(self.job.id, split.to_json()))

    def _earlier_split(self) -> dict[str, Any] | None:
        """The shards again when an earlier attempt of this job split it (its shard plan is stored), else None."""
        stored = self.store.shard_plan(self.job.id)
        if stored is not None and int(stored.get("shards") or 1) > 1:
            return self._fan_out(ShardPlan.from_json(stored))
        return None

    def _queue(self) -> Any:
        from rq import Queue
        from rq.serializers import JSONSerializer

        name = getattr(self.rq_job, "origin", None) or self.settings.queue_name
        return Queue(name, connection=self.store.connection, serializer=JSONSerializer)

    def _fan_out(self, plan: ShardPlan) -> dict[str, Any]:
        """Enqueue the shards and the finalizer that are not in rq yet; the job stays ``running``."""
        job = self.job
        enqueue_shards(job, plan, queue=self._queue(), settings=self.settings, timeout_s=self.timeout_s)
        noted = {"sparsity": plan.sparsity} if plan.sparsity else {}
        planned = PlanInfo(shards=plan.shards, strategy=plan.strategy, mode=plan.mode, **noted)
        self.store.set_fields(job.id, plan=planned, progress=merge_shard_progress(plan.to_json(), {}))
        return {"id": job.id, "status": JobStatus.running.value, "shards": plan.shards}

    # -- outcomes ---------------------------------------------------------------------------------

    def on_stopped(self) -> dict[str, Any]:
        """Cancel requested: cancel. Else the job ended elsewhere (another worker took it over while this one was
        cut off from Redis, then finished it): keep that end and its result."""
        record = self.store.get(self.job.id)
        if record.status.is_terminal and not record.cancel_requested:
            return self._ended_meanwhile()
        return self.cancel_job()

    def on_failed(self, error: ErrorInfo, *, delete: bool) -> dict[str, Any]:
        return self.fail_job(error, delete=delete)

    def on_retry(self, err: BaseException) -> None:
        log.warning("job %s: transient error, rq will retry: %s", self.job.id, err)
        self.store.transition(self.job.id, JobStatus.queued,
                              error=ErrorInfo(type=type(err).__name__, message=str(err), transient=True))

