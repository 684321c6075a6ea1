"""The dense family (``jacobian``, ``batch_jacobian``, ``hessian`` with one ``wrt``): rows of the matrix by the
chunk planner's strategies, streamed into the ``jacobian`` array; resumes and shards by storage blocks."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from worker.execution.base import Executor, ShardHost
from worker.pipeline import compute_to_storage, manifest_fields_for
from worker.sharding import ShardPlan, choose_shards, credit_committed, estimated_seconds, layout_for, split_rows
from worker.storage import ResultWriter

if TYPE_CHECKING:
    from worker.engine import Plan
    from worker.engine.problem import Problem
    from worker.execution.context import RunContext

log = logging.getLogger(__name__)


class DenseExecutor(Executor):
    """Rows of J (or H) by ``worker.pipeline.compute_to_storage``; a job with more than one shard is split on
    storage blocks, every shard running the planner's plan with its strategy pinned."""

    array = "jacobian"

    def __init__(self, noted: dict[str, Any] | None = None) -> None:
        self.noted = dict(noted or {})   # added to the plan (plan.sparsity of a sparse job computed densely)
        self._loaded: tuple[Problem, Plan] | None = None

    def problem(self, ctx: RunContext, plan: Plan | None = None) -> tuple[Problem, Plan]:
        """The job's problem and plan: ``plan`` given (a shard's) is used as it is; else the plan cache's or a
        default (``worker.engine.planning.prepare``)."""
        from worker.engine.planning import prepare

        if self._loaded is None or plan is not None:
            job = ctx.job
            self._loaded = prepare(ctx.load_model(), ctx.load_inputs(), cache=ctx.plans, device=ctx.probe.device,
                                   of=job.of, wrt=job.wrt, kind=job.kind.value, mode=job.mode.value,
                                   reduce=job.reduce, check_independence=job.check_independence,
                                   output_dtype=job.output_dtype, plan=plan)
        return self._loaded

    def compute(self, ctx: RunContext, problem: Problem, plan: Plan, **options: Any) -> dict[str, Any]:
        """``compute_to_storage`` of ``options["rows"]`` (default: the context's) with the job's options."""
        job = ctx.job
        options.setdefault("rows", ctx.rows)
        options.setdefault("block_bytes", ctx.block_bytes)
        options.setdefault("on_plan", ctx.on_plan)
        options.setdefault("on_progress", ctx.on_progress)
        return compute_to_storage(
            problem, results_url=job.results_url, job_id=job.id, memory_budget_bytes=ctx.budget_bytes,
            chunk_rows=job.chunk_rows, strategy=job.strategy, should_stop=ctx.should_stop, plan=plan,
            probe=ctx.probe, try_xla=ctx.try_xla, precision=job.precision, created_at=ctx.created_at,
            trace_dir=ctx.cache_dir,
            on_learned=ctx.plans.put if ctx.plans is not None else None,
            manifest_fields={"model": ctx.model_ref(), **ctx.manifest_fields}, **options)

    def run(self, ctx: RunContext) -> dict[str, Any]:
        problem, plan = self.problem(ctx)
        noted = self.noted
        on_plan = ctx.on_plan
        manifest = self.compute(ctx, problem, plan, on_plan=lambda p: on_plan({**p, **noted}))
        manifest["plan"] = {**(manifest.get("plan") or {}), **noted}
        return manifest

    # -- shards -------------------------------------------------------------------------------------

    def split(self, ctx: RunContext, host: ShardHost) -> ShardPlan | None:
        """The shard plan (None: one piece). Automatic sharding sizes the job by the plan's measured rows/s;
        with none yet it computes the first storage blocks, one at a time, until it has one."""
        problem, plan = self.problem(ctx)
        layout = layout_for(problem, ctx.block_bytes)
        shards = self._choose(ctx, host, problem, plan)
        blocks = iter(layout.blocks())
        while shards is None:
            block = next(blocks, None)
            if block is None:
                return None
            self.compute(ctx, problem, plan, rows=(block.row_start, block.row_stop), refine="never",
                         on_progress=lambda p: None)
            shards = self._choose(ctx, host, problem, plan)
        if shards <= 1:
            return None
        job = ctx.job
        split = ShardPlan(shards=shards, ranges=[list(r) for r in split_rows(layout.blocks(), shards)],
                          rows_total=layout.rows_total, strategy=job.strategy or plan.strategy,
                          block_bytes=layout.block_bytes, mode=problem.mode, engine_plan=plan.to_json(),
                          sparsity=self.noted.get("sparsity"))
        # Before any shard may write: the array (resuming the blocks an earlier attempt committed).
        writer = ResultWriter.for_problem(job.results_url, job.id, problem, block_bytes=layout.block_bytes)
        committed = {b.index for b in writer.blocks} - {b.index for b in writer.pending_blocks()}
        writer.close()
        stored = host.store_split(split)
        if stored.ranges == split.ranges and ctx.store is not None:
            credit_committed(ctx.store, job.id, split, writer.blocks, committed)
        return stored

    def _choose(self, ctx: RunContext, host: ShardHost, problem: Problem, plan: Plan) -> int | None:
        job = ctx.job
        blocks = len(layout_for(problem, ctx.block_bytes).blocks())
        if job.shards == 1 or blocks < 2 or job.rows is not None:
            return 1
        live = None
        if job.shards is None:
            live = host.live_workers()
            if live < 2:
                return 1
        estimate_s = estimated_seconds(plan, problem.rows_total)
        if job.shards is None and estimate_s is None:
            log.info("job %s: no measured rows/s for this request yet; measuring on the first block", job.id)
            return None
        n = choose_shards(job.shards, blocks=blocks, live_workers=live, estimated_seconds=estimate_s or 0.0,
                          min_shard_seconds=host.min_shard_seconds)
        log.info("job %s: %d shard(s): %d storage blocks, %s live workers, about %s s of compute",
                 job.id, n, blocks, "-" if live is None else live,
                 "?" if estimate_s is None else f"{estimate_s:.1f}",
                 extra={"event": "shards_chosen", "shards": n, "blocks": blocks, "live_workers": live,
                        "estimated_seconds": None if estimate_s is None else round(estimate_s, 3),
                        "strategy": job.strategy or plan.strategy})
        return n

    def run_shard(self, ctx: RunContext, split: ShardPlan) -> None:
        problem, plan = self.problem(ctx, plan=split.plan())
        self.compute(ctx, problem, plan, create=False, block_bytes=split.block_bytes, refine="never")

    def finish(self, ctx: RunContext, writer: ResultWriter, plan: dict[str, Any]) -> dict[str, Any]:
        fields = manifest_fields_for(writer.attrs, plan=plan, created_at=ctx.created_at, model=ctx.model_ref())
        writer.write_manifest(fields)
        return {**writer.manifest_base(), **fields}
