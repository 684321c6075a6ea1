"""The sparse route of a dense kind (option ``sparsity``): pattern, colouring, compressed products, verification,
COO entries (``worker.sparse_job``); when it does not pay or fails verification, the dense executor computes it
and ``plan.sparsity`` says why."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from worker.execution.base import Executor
from worker.execution.dense import DenseExecutor

if TYPE_CHECKING:
    from worker.execution.context import RunContext

log = logging.getLogger(__name__)


class SparseExecutor(Executor):
    """J as COO from a colouring of its pattern; one piece (no shards yet), the dense route as the fallback."""

    def run(self, ctx: RunContext) -> dict[str, Any]:
        from worker.sparse_job import DenseInstead, compute_sparse_to_storage

        job = ctx.job
        shared = None
        if ctx.store is not None:
            from worker.plan_store import RedisBlobs

            shared = RedisBlobs(ctx.store.connection)
            if ctx.previous_result is None:
                ctx.previous_result = _previous_result(ctx.store)
        ctx.on_plan({"kind": job.kind.value, "strategy": "sparse", "shards": 1})
        outcome = compute_sparse_to_storage(ctx, shared_cache=shared)
        if not isinstance(outcome, DenseInstead):
            return outcome
        log.info("job %s: computed densely: %s", job.id, outcome.sparsity.get("fallback"))
        return DenseExecutor(noted={"sparsity": outcome.sparsity}).run(ctx)


def _previous_result(store: Any) -> Any:
    """An earlier job's result URI by its id (``sparsity: {"pattern_from": id}``), None when it has none."""
    from contracts.jobstore import JobNotFound

    def previous(job_id: str) -> str | None:
        try:
            earlier = store.get(job_id)
        except JobNotFound:
            return None
        return (earlier.result or {}).get("uri")

    return previous
