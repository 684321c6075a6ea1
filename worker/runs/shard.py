"""One shard of a sharded job: its row range computed into the job's existing array."""

from __future__ import annotations

import logging
from typing import Any

from contracts.jobspec import JobStatus
from contracts.jobstore import JobNotFound
from contracts.records import ErrorInfo, Progress, dump
from worker.execution import executor_for
from worker.pipeline import at_least
from worker.runs.computing import ComputingAttempt
from worker.sharding import ShardPlan

log = logging.getLogger(__name__)


class ShardRun(ComputingAttempt):
    """One attempt at shard ``job.shard`` of ``job.shards`` (rows ``job.rows``) of a sharded job.

    It runs the planner's plan with its strategy pinned and never writes the manifest or a terminal
    status, except ``failed`` when it fails for good; the finalizer removes the partial result then.
    """

    @property
    def what(self) -> str:  # type: ignore[override]
        start, stop = self.job.rows or (0, 0)
        return f"shard {(self.job.shard or 0) + 1} of {self.job.shards} (rows {start}:{stop})"

    def run(self) -> dict[str, Any]:
        job, store = self.job, self.store
        out = {"id": job.id, "shard": job.shard}
        try:
            record = store.get(job.id)
        except JobNotFound:
            log.warning("job %s: %s has no job record (expired?); nothing to do", job.id, self.what)
            self.skipped = True
            return {**out, "status": "skipped"}
        if record.status.is_terminal or record.cancel_requested:
            log.info("job %s is %s; %s stops before computing", job.id,
                     "canceled" if record.cancel_requested else record.status.value, self.what)
            self.metric_status = "stopped"
            return {**out, "status": "stopped"}
        try:
            self._compute()
        except Exception as err:  # noqa: BLE001 - classified by settle(), which re-raises
            return {**out, **self.settle(err)}
        log.info("job %s: %s done", job.id, self.what)
        self.metric_status = "shard_done"
        return {**out, "status": "shard_done"}

    def _compute(self) -> None:
        job, store = self.job, self.store
        index = int(job.shard or 0)
        split = ShardPlan.from_json(store.shard_plan(job.id) or {"shards": job.shards, "ranges": [], "rows_total": 0})
        last = {"rows_done": None}
        reported = int(store.shard_progress(job.id).get(index, {}).get("rows_done") or 0)  # by an earlier attempt

        def on_progress(progress: Progress) -> None:
            # rows computed by this attempt since the last report (the first report is the resume point)
            computed = 0 if last["rows_done"] is None else progress.rows_done - last["rows_done"]
            last["rows_done"] = progress.rows_done
            store.update_shard_progress(job.id, index, at_least(progress, reported), computed_rows=computed)

        ctx = self.run_context(on_plan=lambda p: store.set_shard_run_plan(job.id, index, p),
                               on_progress=on_progress, should_stop=lambda: store.should_stop(job.id))
        executor_for(job).run_shard(ctx, split)

    # -- outcomes ---------------------------------------------------------------------------------

    def on_stopped(self) -> dict[str, Any]:
        log.info("job %s: %s stopped (cancel, or the job ended)", self.job.id, self.what)
        self.metric_status = "stopped"
        return {"status": "stopped"}

    def on_failed(self, error: ErrorInfo, *, delete: bool) -> dict[str, Any]:
        """Fail the whole job (unless it already ended); the finalizer removes the partial result."""
        job = self.job
        error = ErrorInfo(type=error.type, message=f"{self.what}: {error.message}")
        if not self.store.transition(job.id, JobStatus.failed, error=error):
            self.metric_status = "stopped"
            log.info("job %s: %s failed after the job ended: %s", job.id, self.what, error.message)
        else:
            self.metric_status = JobStatus.failed.value
            log.info("job %s failed: %s: %s", job.id, error.type, error.message)
        return {"status": JobStatus.failed.value, "error": dump(error)}

    def on_retry(self, err: BaseException) -> None:
        log.warning("job %s: %s: transient error, rq will retry this shard alone: %s", self.job.id, self.what, err)
