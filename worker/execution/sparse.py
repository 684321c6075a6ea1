"""The sparse route of a dense kind (option ``sparsity``): pattern, colouring, compressed products, verification,
COO entries (``worker.sparse_job``); when it does not pay or fails verification, the dense executor computes it
and ``plan.sparsity`` says why. Shards and resume are by blocks of colours (the array ``compressed``)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from worker.execution.base import Executor, ShardHost
from worker.execution.dense import DenseExecutor
from worker.sharding import ShardPlan, choose_shards, credit_committed, split_rows
from worker.sparse_job import (
    COMPRESSED_ARRAY,
    DenseInstead,
    SparseSetup,
    compressed_writer,
    compute_compressed,
    compute_sparse_to_storage,
    conclude_sparse,
    prepare_sparse,
    read_compressed,
)

if TYPE_CHECKING:
    from worker.execution.context import RunContext
    from worker.storage import ResultWriter

log = logging.getLogger(__name__)


class SparseExecutor(Executor):
    """J (or a Hessian: star colouring, HVPs) as COO from a colouring of its pattern, the dense route as the fallback.

    Shards (``shards`` > 1, or automatic with live workers and a rate measured on the first colour block): the
    job computes the pattern and its colouring (cached), creates the array ``compressed`` (one row per colour)
    and splits its storage blocks into colour ranges (``ShardPlan`` with ``strategy="sparse"``); each shard
    computes and commits its blocks, resuming the committed ones; the finalizer, which loads the model for it,
    verifies the products against direct VJPs (HVPs) and writes the COO entries and the manifest as a job in one piece
    does (a failed verification: the finalizer computes J densely, in one piece). A pattern that does not pay
    shards as a dense job (``DenseExecutor.split``), ``plan.sparsity`` saying why.
    """

    array = COMPRESSED_ARRAY

    def __init__(self) -> None:
        self._setup: SparseSetup | DenseInstead | None = None
        self._dense: DenseExecutor | None = None

    def setup(self, ctx: RunContext, *, check_host: bool = True) -> SparseSetup | DenseInstead:
        """The pattern and its colouring (``worker.sparse_job.prepare_sparse``), once per executor."""
        if self._setup is None:
            self._setup = prepare_sparse(ctx, shared_cache=_shared(ctx), check_host=check_host)
        return self._setup

    def run(self, ctx: RunContext) -> dict[str, Any]:
        job = ctx.job
        ctx.on_plan({"kind": job.kind.value, "strategy": "sparse", "shards": 1})
        outcome = compute_sparse_to_storage(ctx, setup=self.setup(ctx))
        if not isinstance(outcome, DenseInstead):
            return outcome
        log.info("job %s: computed densely: %s", job.id, outcome.sparsity.get("fallback"))
        return DenseExecutor(noted={"sparsity": outcome.sparsity}).run(ctx) if self._dense is None \
            else self._dense.run(ctx)

    # -- shards: ranges of colour blocks ------------------------------------------------------------

    def split(self, ctx: RunContext, host: ShardHost) -> ShardPlan | None:
        """The shard plan over the colour blocks (None: one piece); a dense fallback splits as a dense job."""
        job = ctx.job
        if job.shards == 1 or job.rows is not None or (job.shards is None and host.live_workers() < 2):
            return None
        setup = self.setup(ctx)
        if isinstance(setup, DenseInstead):
            log.info("job %s: computed densely (split as a dense job): %s", job.id, setup.sparsity.get("fallback"))
            self._dense = DenseExecutor(noted={"sparsity": setup.sparsity})
            return self._dense.split(ctx, host)
        writer = compressed_writer(ctx, setup)
        try:
            shards = self._choose(ctx, host, setup, writer)
        except BaseException:
            writer.abort()
            raise
        writer.close()
        if shards < 2:
            return None
        blocks = writer.blocks
        committed = {b.index for b in blocks} - {b.index for b in writer.pending_blocks()}
        split = ShardPlan(shards=shards, ranges=[list(r) for r in split_rows(blocks, shards)],
                          rows_total=setup.colouring.count, strategy="sparse", block_bytes=writer.layout.block_bytes,
                          mode=setup.colouring.mode, sparsity=dict(setup.summary))
        stored = host.store_split(split)
        if stored.ranges == split.ranges and ctx.store is not None:
            credit_committed(ctx.store, job.id, split, blocks, committed)
        return stored

    def _choose(self, ctx: RunContext, host: ShardHost, setup: SparseSetup, writer: ResultWriter) -> int:
        """The job's ``shards``, or automatically: the live workers and the seconds the colours take at the rate
        of the first colour block, computed here and committed (the shard or the job that owns it reuses it)."""
        job, blocks = ctx.job, len(writer.blocks)
        live, estimate_s = None, 0.0
        if job.shards is None and blocks >= 2:
            live = host.live_workers()
            first = writer.pending_blocks()[:1]
            if first:
                started = time.monotonic()
                compute_compressed(ctx, setup, writer, ranges=[(first[0].row_start, first[0].row_stop)])
                estimate_s = (time.monotonic() - started) / first[0].rows * setup.colouring.count
        n = choose_shards(job.shards, blocks=blocks, live_workers=live, estimated_seconds=estimate_s,
                          min_shard_seconds=host.min_shard_seconds)
        log.info("job %s: %d shard(s): %d colour blocks of %d colours, %s live workers, about %.1f s of compute",
                 job.id, n, blocks, setup.colouring.count, "-" if live is None else live, estimate_s,
                 extra={"event": "shards_chosen", "shards": n, "blocks": blocks, "live_workers": live,
                        "estimated_seconds": round(estimate_s, 3), "strategy": "sparse"})
        return n

    def run_shard(self, ctx: RunContext, split: ShardPlan) -> None:
        if split.strategy != "sparse":
            DenseExecutor().run_shard(ctx, split)
            return
        setup = self._sparse_setup(ctx)
        writer = compressed_writer(ctx, setup, rows=ctx.rows, block_bytes=split.block_bytes, create=False)
        reused = compute_compressed(ctx, setup, writer)
        ctx.on_plan({"strategy": "sparse", "labels": dict(setup.op.labels), "colour_blocks_reused": reused,
                     "oom_retries": setup.op.oom_retries})

    def array_for(self, split: ShardPlan | None) -> str:
        return COMPRESSED_ARRAY if split is not None and split.strategy == "sparse" else DenseExecutor.array

    def finish(self, ctx: RunContext, writer: ResultWriter, plan: dict[str, Any]) -> dict[str, Any]:
        """Verify the committed products and write the COO entries and the manifest (the model is loaded for the
        direct VJPs of verification); a dense fallback's shards finish as a dense job's."""
        if writer.array_name != COMPRESSED_ARRAY:
            return DenseExecutor().finish(ctx, writer, plan)
        writer.close()
        setup = self._sparse_setup(ctx)
        if writer.attrs.get("colouring") != setup.stamp:
            raise ValueError(f"sparse: the stored compressed products are of colouring {writer.attrs.get('colouring')}"
                             f", not {setup.stamp}: the pattern changed since the job was split (resubmit the job)")
        products = read_compressed(ctx.job.results_url, ctx.job.id)
        shards = {k: plan[k] for k in ("shards", "shard_plans") if k in plan}
        outcome = conclude_sparse(ctx, setup, products, plan=shards)
        if not isinstance(outcome, DenseInstead):
            return outcome
        outcome.sparsity["fallback"] += "; computed densely in one piece by the finalizer"
        log.info("job %s: %s", ctx.job.id, outcome.sparsity["fallback"])
        return DenseExecutor(noted={"sparsity": outcome.sparsity}).run(ctx)

    def _sparse_setup(self, ctx: RunContext) -> SparseSetup:
        """A shard's or the finalizer's setup, which must take the sparse route as the split did."""
        setup = self.setup(ctx, check_host=False)
        if isinstance(setup, DenseInstead):
            raise ValueError(f"sparse: the job was split on colours, but its pattern now takes the dense route "
                             f"({setup.sparsity.get('fallback')}); resubmit the job")
        return setup


def _shared(ctx: RunContext) -> Any:
    """The detected patterns shared by the workers (Redis), and ``pattern_from``'s earlier results; None outside
    the service."""
    if ctx.store is None:
        return None
    from worker.plan_store import RedisBlobs

    if ctx.previous_result is None:
        ctx.previous_result = _previous_result(ctx.store)
    return RedisBlobs(ctx.store.connection)


def _previous_result(store: Any) -> Any:
    """An earlier job's result URI by its id (``sparsity: {"pattern_from": id}``), None when it has none."""
    from contracts.jobstore import JobNotFound

    def previous(job_id: str) -> str | None:
        try:
            earlier = store.get(job_id)
        except JobNotFound:
            return None
        return earlier.result.uri if earlier.result is not None else None

    return previous
