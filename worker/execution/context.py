"""The one typed context every executor runs with: the request, where the result goes, the budget, and the
callbacks for progress, plan and cancel. A job, a shard, a finalizer and ``jacobian compute`` each build one."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from contracts.jobspec import SEEDS_MEMBER, QueuedJob
from contracts.kinds import KindSpec, kind_spec
from contracts.records import Progress

if TYPE_CHECKING:
    from contracts.jobstore import JobStore
    from worker.engine import PlanCache
    from worker.engine.model import LoadedModel


def _never() -> bool:
    return False


def _ignore(_: Any) -> None:
    return None


def _ignore_units(kind: str, units: int, nbytes: int, seconds: float) -> None:
    return None


@dataclass
class RunContext:
    """What an executor needs to run ``job`` (a ``QueuedJob``: kind, of, wrt, options, ``rows`` of a shard).

    ``load_inputs``/``load_model`` give the request's tensors (the seeds under ``SEEDS_MEMBER``) and the
    loaded model; the worker checks the model root, ``jacobian compute`` reads local files. ``budget_bytes``:
    the memory cap (job's, else the settings'); ``block_bytes``: storage blocks, the unit of resume and shards.
    ``on_progress``/``on_plan`` receive progress and the plan as they change; ``on_units(kind, units, bytes,
    seconds)`` hears of each piece of work done by the kinds whose progress goes through ``counter`` or
    ``units_done`` (seeds, colours, iterations, stacked rows: the worker's Prometheus series);
    ``should_stop`` raises nothing, it answers whether to stop (cancel) before the next chunk. ``store`` is
    None outside the service (no shards, no shared caches).
    """

    job: QueuedJob
    load_inputs: Callable[[], dict[str, Any]]
    load_model: Callable[[], LoadedModel]
    budget_bytes: int | None = None
    block_bytes: int | None = None
    created_at: float | None = None
    on_progress: Callable[[Progress], None] = _ignore
    on_plan: Callable[[dict[str, Any]], None] = _ignore
    on_units: Callable[[str, int, int, float], None] = _ignore_units
    should_stop: Callable[[], bool] = _never
    probe: Any = None
    plans: PlanCache | None = None
    store: JobStore | None = None
    cache_dir: str | None = None
    try_xla: bool = True
    manifest_fields: dict[str, Any] = field(default_factory=dict)
    previous_result: Callable[[str], str | None] | None = None   # an earlier job's result URI (pattern_from)

    @property
    def spec(self) -> KindSpec:
        return kind_spec(self.job.kind.value)

    @property
    def results_url(self) -> str:
        return self.job.results_url

    @property
    def job_id(self) -> str:
        return self.job.id

    @property
    def rows(self) -> tuple[int, int] | None:
        """The seeds or rows of a shard; None for the whole job."""
        return self.job.rows

    @property
    def chunk_rows(self) -> int | None:
        return self.job.chunk_rows

    def inputs_and_seeds(self) -> tuple[dict[str, Any], Any]:
        """The request's tensors, and its seeds (None when it has none)."""
        inputs = dict(self.load_inputs())
        return inputs, inputs.pop(SEEDS_MEMBER, None)

    def model_ref(self) -> dict[str, str]:
        return {"path": self.job.model.path, "signature": self.job.model.signature}

    def counter(self, total: int | None = None) -> Callable[[int, int | None], None]:
        """``(done, total)`` callbacks (seeds, iterations, colours) as ``Progress`` to ``on_progress``."""
        started = time.monotonic()
        last = [0, started]

        def report(done: int, now_total: int | None = total) -> None:
            now = time.monotonic()
            rate = done / max(now - started, 1e-9)
            if done > last[0]:
                self.units_done(done - last[0], 0, now - last[1])
            last[:] = [max(done, last[0]), now]
            self.on_progress(Progress.of(done, max(now_total or done, done), rate))

        return report

    def units_done(self, units: int, nbytes: int, seconds: float) -> None:
        """``units`` of this job's work done in ``seconds`` (``nbytes`` of result handed to storage)."""
        self.on_units(self.job.kind.value, units, nbytes, seconds)
