"""Sharding: how many row-range shards a job gets, where they split, and their rq jobs.

A sharded job is one array written by several rq jobs (``worker.tasks.run_job`` with ``shard`` set),
each computing a run of whole storage blocks, and a finalizer (``worker.tasks.finalize_job``) that
depends on them all. README "Scale-out" describes the rule; ``ShardPlan`` is what every shard reads.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from datetime import UTC
from typing import TYPE_CHECKING, Any

from contracts.jobspec import QueuedJob, finalizer_job_id, shard_job_id
from contracts.settings import Settings, get_settings

if TYPE_CHECKING:
    from contracts.layout import ResultLayout
    from worker.engine import Plan
    from worker.engine.problem import Problem

log = logging.getLogger(__name__)

TASK = "worker.tasks.run_job"
FINALIZE_TASK = "worker.tasks.finalize_job"


@dataclass(frozen=True)
class ShardPlan:
    """The split of one job, stored once (the first planner's wins) and read by every shard.

    ``ranges``: ``[start, stop)`` rows of each shard, on storage-block boundaries; ``strategy``: the
    chunk strategy every shard runs (so all rows are computed alike; ``"sparse"``: the rows are the colours
    of a sparse job's compressed products); ``block_bytes``: the storage block size of the array;
    ``engine_plan``: the planner's ``Plan`` as JSON (None in plans stored by earlier versions, which also
    lack ``mode``'s companions); ``sparsity``: a job with option ``sparsity``, its ``plan.sparsity``.
    """

    shards: int
    ranges: list[list[int]]
    rows_total: int
    strategy: str | None = None
    block_bytes: int | None = None
    mode: str | None = None
    engine_plan: dict[str, Any] | None = None
    sparsity: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardPlan:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})

    def plan(self) -> Plan | None:
        """The planner's engine plan, None when the stored plan has none."""
        from worker.engine import Plan

        return Plan.from_json(self.engine_plan) if self.engine_plan else None


def layout_for(problem: Problem, block_bytes: int | None) -> ResultLayout:
    """``problem.layout`` with the storage block size ``block_bytes`` (None keeps the layout's)."""
    return replace(problem.layout, block_bytes=block_bytes) if block_bytes else problem.layout


def choose_shards(requested: int | None, *, blocks: int, live_workers: int | None, estimated_seconds: float,
                  min_shard_seconds: float) -> int:
    """The number of shards of a job of ``blocks`` storage blocks.

    - never more shards than storage blocks (a shard is a run of whole blocks), never fewer than 1;
    - ``requested`` (the job's ``shards``) is taken as given, capped by the blocks;
    - ``requested`` null (automatic): ``min(live workers on the queue, blocks,
      floor(estimated single-worker compute seconds / min_shard_seconds))``, so a job that one worker
      finishes in less than ``2 * min_shard_seconds`` (10 s by default) or a queue with one worker
      stays in one piece.
    """
    if blocks < 2:
        return 1
    if requested is not None:
        return max(1, min(int(requested), blocks))
    if not live_workers or live_workers < 2:
        return 1
    by_time = blocks if min_shard_seconds <= 0 else int(estimated_seconds // min_shard_seconds)
    return max(1, min(live_workers, blocks, by_time))


def estimated_seconds(plan: Plan | None, rows_total: int) -> float | None:
    """Compute seconds of ``rows_total`` rows at the best rows/s the plan's strategy has measured
    (None when it has measured none)."""
    rate = plan.current.best_rate() if plan is not None else None
    return rows_total / rate if rate else None


def split_rows(blocks: list[Any], shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous row ranges on block boundaries, as equal in rows as the blocks allow."""
    n = max(1, min(shards, len(blocks)))
    total = blocks[-1].row_stop if blocks else 0
    out: list[tuple[int, int]] = []
    first = 0
    for i in range(n):
        if i == n - 1:
            last = len(blocks)
        else:
            target = total * (i + 1) / n
            lo, hi = first + 1, len(blocks) - (n - i - 1)  # each shard >= 1 block, leave 1 per later shard
            last = min(range(lo, hi + 1), key=lambda e: (abs(blocks[e - 1].row_stop - target), e))
        out.append((blocks[first].row_start, blocks[last - 1].row_stop))
        first = last
    return out


def credit_committed(store: Any, job_id: str, split: ShardPlan, blocks: list[Any], committed: set[int]) -> None:
    """Rows (colours) committed before the split (the planner measuring the job's rate) count for their shard."""
    from contracts.records import Progress

    for i, (lo, hi) in enumerate(split.ranges):
        rows = sum(b.row_stop - b.row_start for b in blocks if b.index in committed and lo <= b.row_start < hi)
        if rows:
            store.update_shard_progress(job_id, i, Progress.of(rows, hi - lo, 0.0), computed_rows=rows)


def live_workers(connection: Any, queue: Any, *, recent_s: float | None = None,
                 settings: Settings | None = None) -> int:
    """rq workers of ``queue`` whose last heartbeat is at most ``recent_s`` old (default: twice the longest
    gap between a live worker's heartbeats, ``settings.worker_heartbeat_s`` while busy and
    ``worker_maintenance_s`` while idle). A killed worker's key outlives it by a minute or more;
    its ``last_heartbeat`` stops. Heartbeats carry the worker's clock: keep the machines' clocks in sync."""
    from datetime import datetime

    from rq import worker_registration
    from rq.utils import utcparse

    if recent_s is None:
        settings = settings or get_settings()
        recent_s = 2.0 * max(settings.worker_heartbeat_s, settings.worker_maintenance_s)
    keys = worker_registration.get_keys(queue=queue, connection=connection)
    if not keys:
        return 0
    with connection.pipeline() as pipe:
        for key in keys:
            pipe.hget(key, "last_heartbeat")
        beats = pipe.execute()
    now = datetime.now(UTC)
    alive = 0
    for beat in beats:
        try:
            alive += bool(beat) and (now - utcparse(beat.decode())).total_seconds() <= recent_s
        except ValueError:  # not rq's timestamp format: not a worker we can judge
            continue
    return alive


def enqueue_shards(job: QueuedJob, plan: ShardPlan, *, queue: Any, settings: Settings, timeout_s: int) -> None:
    """Put the shards and the finalizer of ``job`` that are not in rq yet on ``queue`` (idempotent
    across attempts: ids are derived from the job's)."""
    from rq import Retry
    from rq.job import Dependency, Job

    connection = queue.connection
    n = plan.shards
    base = job.model_dump(mode="json")
    # Immediate retries: a shard resumes from its committed blocks, and the writer already backs
    # off on storage errors (rq's retry intervals would need a worker started with a scheduler).
    retry = Retry(max=settings.job_retries) if settings.job_retries > 0 else None
    ttls = {"result_ttl": settings.result_ttl_s, "failure_ttl": settings.result_ttl_s}
    ids = []
    for i, (start, stop) in enumerate(plan.ranges):
        rq_id = shard_job_id(job.id, i)
        ids.append(rq_id)
        if Job.exists(rq_id, connection=connection):
            continue
        spec = {**base, "shards": n, "shard": i, "rows": [start, stop], "strategy": plan.strategy}
        queue.enqueue_call(TASK, args=(spec,), job_id=rq_id, timeout=timeout_s, retry=retry, **ttls,
                           description=f"shard {i + 1}/{n} (rows {start}:{stop}) of {job.kind.value} job {job.id}")
    final_id = finalizer_job_id(job.id)
    if not Job.exists(final_id, connection=connection):
        # allow_failure: the finalizer runs once every shard has finished *or failed for good*, and
        # checks the commit markers itself (a failed dependency would otherwise defer it forever).
        queue.enqueue_call(FINALIZE_TASK, args=({**base, "shards": n},), job_id=final_id,
                           depends_on=Dependency(jobs=ids, allow_failure=True), timeout=timeout_s, retry=retry,
                           **ttls, description=f"finalizer of {job.kind.value} job {job.id} ({n} shards)")
    log.info("job %s split into %d shards: rows %s", job.id, n, ", ".join(f"{a}:{b}" for a, b in plan.ranges),
             extra={"event": "job_split", "shards": n, "ranges": plan.ranges})
