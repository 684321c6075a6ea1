"""What the job and its shards share: the ``RunContext`` the executors run with (inputs and model loaded once,
the budget, this worker's probe and plan cache)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from worker import metrics
from worker.execution import RunContext
from worker.inputs import effective_budget, load_inputs
from worker.runs.attempt import Attempt

if TYPE_CHECKING:
    from contracts.records import Progress
    from worker.engine import PlanCache, TFMemoryProbe


class ComputingAttempt(Attempt):
    """An attempt that runs an executor: the job itself or one of its shards."""

    _probe: TFMemoryProbe | None = None

    def run_context(self, *, on_progress: Callable[[Progress], None], on_plan: Callable[[dict[str, Any]], None],
                    should_stop: Callable[[], bool], created_at: float | None = None) -> RunContext:
        """This attempt's ``RunContext``: the job's inputs (read once) and model (from the worker's cache, under
        the allowed roots), its budget, this worker's settings, probe, plan cache and job store."""
        job, settings = self.job, self.settings
        loaded: dict[str, Any] = {}

        def inputs() -> dict[str, Any]:
            if "inputs" not in loaded:
                loaded["inputs"] = load_inputs(job.inputs_uri, settings=settings)
            return dict(loaded["inputs"])

        def model() -> Any:   # once per attempt: an S3 model's local copy is looked up (and counted) once
            if "model" not in loaded:
                from worker.model_cache import get_job_model

                loaded["model"] = get_job_model(job.model.path, job.model.signature, settings)
            return loaded["model"]

        def stop() -> bool:  # between chunks: the job's wall-clock limit (raises JobTimeout), then cancel
            self.check_time()
            return should_stop()

        return RunContext(job=job, load_inputs=inputs, load_model=model,
                          budget_bytes=effective_budget(job.memory_budget_bytes, settings.memory_budget_bytes),
                          block_bytes=settings.block_bytes, created_at=created_at, on_progress=on_progress,
                          on_plan=on_plan, on_units=metrics.observe_chunk, should_stop=stop,
                          probe=self.probe, plans=self.plans,
                          store=self.store, cache_dir=str(settings.cache_dir) if settings.cache_dir else None,
                          try_xla=settings.try_xla)

    @property
    def plans(self) -> PlanCache:
        from worker.plan_store import worker_plan_cache

        return worker_plan_cache(self.store.connection, self.settings.cache_dir)

    @property
    def probe(self) -> TFMemoryProbe:
        from worker.engine import TFMemoryProbe

        if self._probe is None:
            self._probe = TFMemoryProbe()
        return self._probe
