"""The job itself: validate the request, then compute every row, or split the job into shards."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from contracts.jobspec import PRODUCT_KINDS, JobStatus
from contracts.jobstore import JobNotFound, JobRecord, merge_shard_progress
from contracts.records import Progress
from worker.pipeline import at_least
from worker.runs.computing import ComputingAttempt
from worker.sharding import (
    ShardPlan,
    choose_shards,
    enqueue_shards,
    estimated_seconds,
    layout_for,
    live_workers,
    split_rows,
)
from worker.storage import ResultWriter

if TYPE_CHECKING:
    from worker.engine import Plan
    from worker.engine.problem import Problem

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
        job, store = self.job, self.store
        if job.kind.matrix_free:
            if job.kind.value in PRODUCT_KINDS and (job.shards or 1) > 1 and job.rows is None:
                earlier = self._earlier_split()
                if earlier is not None:
                    return earlier
                split = self._split_products()
                if split is not None:
                    return split
            return self._succeed(self.compute_matrix_free(record))
        sparsity = None   # plan.sparsity of a sparse job computed densely
        if getattr(job, "sparsity", None) is not None:
            from worker.sparse_job import DenseInstead

            outcome = self.compute_sparse(record)
            if not isinstance(outcome, DenseInstead):
                return self._succeed(outcome)
            sparsity = outcome.sparsity
            log.info("job %s: computed densely: %s", job.id, sparsity.get("fallback"))
        earlier = self._earlier_split()
        if earlier is not None:
            return earlier
        problem, plan = self.load_problem()
        noted = {} if sparsity is None else {"sparsity": sparsity}
        reported = int((record.progress or {}).get("rows_done") or 0)  # by an earlier attempt

        def compute(rows: tuple[int, int] | None, refine: str = "auto") -> dict[str, Any]:
            return self.compute(
                problem, plan, rows=rows, refine=refine, created_at=record.created_at, on_learned=self.plans.put,
                on_plan=lambda p: store.set_fields(job.id, plan={**p, "shards": 1, **noted}),
                on_progress=lambda p: store.set_fields(job.id, progress=at_least(p, reported)),
                should_stop=lambda: store.is_cancel_requested(job.id),
                manifest_fields={"model": {"path": job.model.path, "signature": job.model.signature}})

        shards = 1 if sparsity is not None else self._choose_shards(problem, plan)
        blocks = iter(self._layout(problem).blocks())
        while shards is None:  # automatic, and no rows/s measured for this request yet: measure on its blocks
            block = next(blocks, None)
            if block is None:
                shards = 1
                break
            compute((block.row_start, block.row_stop), refine="never")
            shards = self._choose_shards(problem, plan)
        if shards > 1:
            return self._split(problem, shards, plan)
        return self._succeed(compute(job.rows), noted)

    def _succeed(self, manifest: dict[str, Any], noted: dict[str, Any] | None = None) -> dict[str, Any]:
        job, store = self.job, self.store
        result = {"uri": manifest["uri"], "shape": manifest["shape"], "dtype": manifest["dtype"]}
        if manifest.get("format") == "coo":
            result["format"] = "coo"
            result["dense_shape"] = manifest["dense_shape"]
        final_plan = {**(manifest.get("plan") or {}), "shards": 1, **(noted or {})}
        if not store.transition(job.id, JobStatus.succeeded, result=result, error=None, plan=final_plan):
            return self._ended_meanwhile()
        log.info("job %s succeeded: %s", job.id, result["uri"])
        return {"id": job.id, "status": JobStatus.succeeded.value, "result": result}

    def _layout(self, problem: Problem) -> Any:
        return layout_for(problem, self.settings.block_bytes)

    # -- splitting the job into shards ------------------------------------------------------------

    def _choose_shards(self, problem: Problem, plan: Plan) -> int | None:
        """How many shards (``choose_shards``); all shards then run ``plan``'s strategy.

        Automatic sharding sizes the job by the plan's measured rows/s: None when there is none yet
        (the caller then computes the first storage block and asks again).
        """
        job = self.job
        blocks = len(self._layout(problem).blocks())
        if job.shards == 1 or blocks < 2 or job.rows is not None:
            return 1
        live = None
        if job.shards is None:
            live = live_workers(self.store.connection, self._queue(), settings=self.settings)
            if live < 2:
                return 1
        estimate_s = estimated_seconds(plan, problem.rows_total)
        if job.shards is None and estimate_s is None:
            log.info("job %s: no measured rows/s for this request yet; measuring on the first block", job.id)
            return None
        n = choose_shards(job.shards, blocks=blocks, live_workers=live, estimated_seconds=estimate_s or 0.0,
                          min_shard_seconds=self.settings.shard_min_seconds)
        log.info("job %s: %d shard(s): %d storage blocks, %s live workers, about %s s of compute",
                 job.id, n, blocks, "-" if live is None else live,
                 "?" if estimate_s is None else f"{estimate_s:.1f}",
                 extra={"event": "shards_chosen", "shards": n, "blocks": blocks, "live_workers": live,
                        "estimated_seconds": None if estimate_s is None else round(estimate_s, 3),
                        "strategy": job.strategy or plan.strategy})
        return n

    def _split(self, problem: Problem, shards: int, plan: Plan) -> dict[str, Any]:
        """Create the result array once, store the shard plan, enqueue the shards and the finalizer.

        Every shard runs the planner's plan with its strategy pinned, so all rows are computed alike."""
        job = self.job
        layout = self._layout(problem)
        split = ShardPlan(shards=shards, ranges=[list(r) for r in split_rows(layout.blocks(), shards)],
                          rows_total=layout.rows_total, strategy=job.strategy or plan.strategy,
                          block_bytes=layout.block_bytes, mode=problem.mode, engine_plan=plan.to_json())
        # Before any shard may write: the array (resuming the blocks an earlier attempt committed).
        writer = ResultWriter.for_problem(job.results_url, job.id, problem, block_bytes=layout.block_bytes)
        committed = {b.index for b in writer.blocks} - {b.index for b in writer.pending_blocks()}
        writer.close()
        stored = ShardPlan.from_json(self.store.set_shard_plan(job.id, split.to_json()))
        if stored.ranges == split.ranges:
            # Rows this planner computed before splitting (measuring the job's rows/s) count for their shard.
            for i, (lo, hi) in enumerate(split.ranges):
                rows = sum(b.row_stop - b.row_start for b in writer.blocks
                           if b.index in committed and lo <= b.row_start < hi)
                if rows:
                    self.store.update_shard_progress(job.id, i, Progress.of(rows, hi - lo, 0.0).model_dump(),
                                                     computed_rows=rows)
        return self._fan_out(stored)

    def _earlier_split(self) -> dict[str, Any] | None:
        """The shards again when an earlier attempt of this job split it (its shard plan is stored), else None."""
        stored = self.store.shard_plan(self.job.id)
        if stored is not None and int(stored.get("shards") or 1) > 1:
            return self._fan_out(ShardPlan.from_json(stored))
        return None

    def _split_products(self) -> dict[str, Any] | None:
        """A product job with ``shards`` > 1: the ``products`` array created, its seeds split on storage blocks
        into shards (``worker.matfree_job.compute_products_shard``), the finalizer after them; None when the
        seeds fill a single block (computed in one piece)."""
        from worker.matfree_job import products_writer

        job = self.job
        op, seeds = self.matrix_free_operator()
        k = len(op._seeds(job.kind.value, seeds)) if seeds is not None else 0  # checked: InvalidRequest names seeds
        writer = products_writer(op, job.kind.value, k, job.results_url, job.id, block_bytes=self.settings.block_bytes)
        writer.close()
        shards = choose_shards(job.shards, blocks=len(writer.blocks), live_workers=None, estimated_seconds=0.0,
                               min_shard_seconds=self.settings.shard_min_seconds)
        if shards < 2:
            return None
        split = ShardPlan(shards=shards, ranges=[list(r) for r in split_rows(writer.blocks, shards)], rows_total=k,
                          strategy="matrix-free", block_bytes=writer.layout.block_bytes, mode=job.kind.value)
        return self._fan_out(ShardPlan.from_json(self.store.set_shard_plan(job.id, split.to_json())))

    def _queue(self) -> Any:
        from rq import Queue
        from rq.serializers import JSONSerializer

        name = getattr(self.rq_job, "origin", None) or self.settings.queue_name
        return Queue(name, connection=self.store.connection, serializer=JSONSerializer)

    def _fan_out(self, plan: ShardPlan) -> dict[str, Any]:
        """Enqueue the shards and the finalizer that are not in rq yet; the job stays ``running``."""
        job = self.job
        enqueue_shards(job, plan, queue=self._queue(), settings=self.settings, timeout_s=self.timeout_s)
        self.store.set_fields(job.id, plan={"shards": plan.shards, "strategy": plan.strategy, "mode": plan.mode},
                              progress=merge_shard_progress(plan.to_json(), {}))
        return {"id": job.id, "status": JobStatus.running.value, "shards": plan.shards}

    # -- outcomes ---------------------------------------------------------------------------------

    def on_stopped(self) -> dict[str, Any]:
        return self.cancel_job()

    def on_failed(self, error: dict[str, str], *, delete: bool) -> dict[str, Any]:
        return self.fail_job(error, delete=delete)

    def on_retry(self, err: BaseException) -> None:
        log.warning("job %s: transient error, rq will retry: %s", self.job.id, err)
        self.store.transition(self.job.id, JobStatus.queued,
                              error={"type": type(err).__name__, "message": str(err), "transient": True})

