"""The finalizer of a sharded job: the manifest and the terminal status once every shard has ended."""

from __future__ import annotations

import logging
import time
from typing import Any

from contracts.jobspec import JobStatus, shard_job_id
from contracts.jobstore import JobNotFound, JobRecord
from contracts.records import ErrorInfo, PlanInfo, Progress, dump
from worker.execution import executor_for
from worker.execution.precision import guarded_finish
from worker.runs.attempt import remove_partial, result_of
from worker.runs.computing import ComputingAttempt
from worker.sharding import ShardPlan
from worker.storage import ResultWriter

log = logging.getLogger(__name__)


class Finalizer(ComputingAttempt):
    """The last rq job of a sharded job: once every shard has finished or failed, it writes the
    manifest and marks the job succeeded if every storage block is committed; otherwise it marks the
    job failed (naming the shard) and removes the partial result. It loads the model for the result's precision
    estimate (float64 probes, as a job in one piece records) and a sparse job's verification."""

    what = "finalizer"

    def run(self) -> dict[str, Any]:
        job, store = self.job, self.store
        try:
            record = store.get(job.id)
        except JobNotFound:
            self.skipped = True
            return {"id": job.id, "status": "skipped"}
        raw_plan = store.shard_plan(job.id)
        split = ShardPlan.from_json(raw_plan) if raw_plan else None
        if record.status == JobStatus.failed:
            remove_partial(job.results_url, job.id)  # a shard failed the job (and counted it)
            self.metric_status = "cleanup"
            return {"id": job.id, "status": JobStatus.failed.value, "error": dump(record.error)}
        if record.status.is_terminal:
            self.skipped = True
            return {"id": job.id, "status": record.status.value}
        if record.cancel_requested:
            return self.on_stopped()
        try:
            return self._finish(record, split)
        except FileNotFoundError as err:
            return self.on_failed(ErrorInfo(type="ResultMissing", message=f"result: {err}; resubmit the job"),
                                  delete=True)
        except Exception as err:  # noqa: BLE001 - classified by settle(), which re-raises
            return self.settle(err)

    def _finish(self, record: JobRecord, split: ShardPlan | None) -> dict[str, Any]:
        job, store = self.job, self.store
        executor = executor_for(job)
        writer = ResultWriter.open_existing(job.results_url, job.id, array=executor.array_for(split))
        missing = writer.missing_blocks()
        if missing:
            writer.abort()
            return self.on_failed(self._incomplete(split, missing, len(writer.blocks)), delete=True)
        shards = store.shard_progress(job.id)
        # The job's plan is the planner's (strategy, mode, shards); each shard's own run plan (chunk rows,
        # memory) is listed beside it, in shard order: no shard's plan stands for the others.
        plan = {**dump(record.plan), "shard_plans": [shards[i].get("plan") or {} for i in sorted(shards)]}
        # The model is loaded for a sparse job's verification and for the precision estimate (float64 probes).
        ctx = self.run_context(created_at=record.created_at, on_progress=lambda p: None, on_plan=lambda p: None,
                               should_stop=lambda: store.should_stop(job.id))
        manifest = guarded_finish(executor, ctx, writer, plan)
        plan = manifest.get("plan") or plan   # the products summed over the shards, for a product job
        result = result_of(manifest)
        now = time.time()
        rows_total = split.rows_total if split and split.rows_total else writer.layout.rows_total
        computed = sum(p.get("rows_computed", 0) for p in shards.values())
        wall_s = max(now - (record.started_at or now), 1e-9)
        if not store.transition(job.id, JobStatus.succeeded, result=result, error=None, finished_at=now,
                                plan=PlanInfo.model_validate(plan),
                                progress=Progress.of(rows_total, rows_total, computed / wall_s)):
            return self._ended_meanwhile()
        log.info("job %s succeeded (%s shards): %s", job.id, split.shards if split else "?", result.uri)
        return {"id": job.id, "status": JobStatus.succeeded.value, "result": dump(result)}

    def _incomplete(self, split: ShardPlan | None, missing: list[Any], blocks: int) -> ErrorInfo:
        """The error of a job whose shards left blocks uncommitted, naming those shards and why."""
        from rq.job import Job
        from rq.serializers import JSONSerializer

        parts = []
        for i, (start, stop) in enumerate(split.ranges if split else []):
            lost = [b for b in missing if start <= b.row_start < stop]
            if not lost:
                continue
            why = "unknown"
            try:
                rq_job = Job.fetch(shard_job_id(self.job.id, i), connection=self.store.connection,
                                   serializer=getattr(self.rq_job, "serializer", None) or JSONSerializer)
                status = rq_job.get_status(refresh=True)
                why = getattr(status, "value", None) or str(status or "unknown")
                result = rq_job.latest_result()
                if result is not None and result.exc_string:
                    why = f"{why}: {result.exc_string.strip().splitlines()[-1]}"
            except Exception as err:  # noqa: BLE001 - the shard's rq job may have expired
                why = f"its rq job is gone ({type(err).__name__})"
            parts.append(f"shard {i + 1} of {split.shards if split else '?'} (rows {start}:{stop}) did not finish "
                         f"({len(lost)} blocks missing; rq: {why})")
        message = "; ".join(parts) or f"{len(missing)} of {blocks} storage blocks are not committed"
        return ErrorInfo(type="ShardFailed", message=f"{message}; the result is incomplete, resubmit the job")

    # -- outcomes ---------------------------------------------------------------------------------

    def on_stopped(self) -> dict[str, Any]:
        return self.cancel_job()

    def on_failed(self, error: ErrorInfo, *, delete: bool) -> dict[str, Any]:
        return self.fail_job(error, delete=True)  # a sharded job's blocks are no use alone
