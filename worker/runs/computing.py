"""What the job and its shards share: loading the problem with its plan, and computing rows of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from worker.inputs import check_model_path, effective_budget, load_inputs
from worker.pipeline import compute_to_storage
from worker.runs.attempt import Attempt

if TYPE_CHECKING:
    from contracts.records import Progress
    from worker.engine import Plan, PlanCache, TFMemoryProbe
    from worker.engine.problem import Problem


class ComputingAttempt(Attempt):
    """An attempt that runs the engine: the job itself or one of its shards."""

    _probe: TFMemoryProbe | None = None

    def load_problem(self, plan: Plan | None = None) -> tuple[Problem, Plan]:
        """The job's problem and plan: ``plan`` given (a shard's, made by its planner) is used as it
        is; otherwise the plan cache's (Redis, then this worker's folder) or a default."""
        from worker.engine.planning import prepare
        from worker.model_cache import get_model

        job = self.job
        model_path = check_model_path(job.model.path, self.settings.model_roots)
        inputs = load_inputs(job.inputs_uri, settings=self.settings)
        model = get_model(model_path, job.model.signature)
        return prepare(model, inputs, cache=self.plans, device=self.probe.device, of=job.of, wrt=job.wrt,
                       kind=job.kind.value, mode=job.mode.value, reduce=job.reduce,
                       check_independence=job.check_independence, output_dtype=job.output_dtype, plan=plan)

    def matrix_free_operator(self) -> tuple[Any, Any]:
        """The job's ``worker.engine.matfree.Operator`` (memory planned) and its seeds (None for the spectra)."""
        from contracts.jobspec import SEEDS_MEMBER
        from worker.engine.matfree import build_operator
        from worker.model_cache import get_model

        job = self.job
        inputs = load_inputs(job.inputs_uri, settings=self.settings)
        seeds = inputs.pop(SEEDS_MEMBER, None)
        model = get_model(check_model_path(job.model.path, self.settings.model_roots), job.model.signature)
        op = build_operator(model, inputs, of=job.of, wrt=job.wrt, kind=job.kind.value, reduce=job.reduce,
                            output_dtype=job.output_dtype)
        op.plan_memory(self.probe, effective_budget(job.memory_budget_bytes, self.settings.memory_budget_bytes))
        return op, seeds

    def compute_matrix_free(self, record: Any) -> dict[str, Any]:
        """A matrix-free job (``worker.matfree_job``) with progress in seeds or iterations; returns the manifest."""
        import time

        from contracts.records import Progress
        from worker.matfree_job import compute_matfree_to_storage

        job, store = self.job, self.store
        op, seeds = self.matrix_free_operator()
        started = time.monotonic()

        def on_progress(done: int, total: int | None) -> None:
            rate = done / max(time.monotonic() - started, 1e-9)
            store.set_fields(job.id, progress=Progress.of(done, max(total or done, done), rate))

        store.set_fields(job.id, plan={"kind": job.kind.value, "strategy": "matrix-free", "shards": 1})
        manifest = compute_matfree_to_storage(
            op, job.kind.value, results_url=job.results_url, job_id=job.id, seeds=seeds, rank=job.rank, tol=job.tol,
            samples=job.samples, chunk_size=job.chunk_rows, on_progress=on_progress,
            should_stop=lambda: store.is_cancel_requested(job.id), created_at=record.created_at,
            block_bytes=self.settings.block_bytes,
            manifest_fields={"model": {"path": job.model.path, "signature": job.model.signature}})
        manifest["plan"] = {**manifest["plan"], "strategy": "matrix-free", "shards": 1}
        return manifest

    def compute_sparse(self, record: Any) -> Any:
        """A sparse Jacobian (``worker.sparse_job``): the manifest, or a ``DenseInstead`` when the dense path must
        compute it (pattern too dense or not found, verification failed)."""
        import time

        from contracts.jobstore import JobNotFound
        from contracts.records import Progress
        from worker.engine.plan_cache import default_cache_dir
        from worker.model_cache import get_model
        from worker.plan_store import RedisBlobs
        from worker.sparse_job import compute_sparse_to_storage

        job, store = self.job, self.store
        inputs = load_inputs(job.inputs_uri, settings=self.settings)
        model = get_model(check_model_path(job.model.path, self.settings.model_roots), job.model.signature)
        started = time.monotonic()

        def on_progress(done: int, total: int) -> None:
            rate = done / max(time.monotonic() - started, 1e-9)
            store.set_fields(job.id, progress=Progress.of(done, max(total, done), rate))

        def previous(job_id: str) -> str | None:
            try:
                earlier = store.get(job_id)
            except JobNotFound:
                return None
            return (earlier.result or {}).get("uri")

        store.set_fields(job.id, plan={"kind": "jacobian", "strategy": "sparse", "shards": 1})
        return compute_sparse_to_storage(
            model, inputs, of=job.of, wrt=job.wrt if isinstance(job.wrt, str) or job.wrt is None else job.wrt[0],
            sparsity=job.sparsity, results_url=job.results_url, job_id=job.id, probe=self.probe,
            budget_bytes=effective_budget(job.memory_budget_bytes, self.settings.memory_budget_bytes),
            chunk_size=job.chunk_rows, cache_dir=str(self.settings.cache_dir or default_cache_dir()),
            output_dtype=job.output_dtype, on_progress=on_progress,
            should_stop=lambda: store.is_cancel_requested(job.id), previous=previous,
            shared_cache=RedisBlobs(store.connection), created_at=record.created_at,
            manifest_fields={"model": {"path": job.model.path, "signature": job.model.signature}})

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

    def compute(self, problem: Problem, plan: Plan, *, rows: tuple[int, int] | None,
                on_plan: Callable[[dict[str, Any]], None], on_progress: Callable[[Progress], None],
                should_stop: Callable[[], bool], **options: Any) -> dict[str, Any]:
        """``compute_to_storage`` of ``rows`` (None: all) with the job's options and this worker's settings;
        ``options`` are passed on (``refine``, ``create``, ``block_bytes``, ``created_at``, ...)."""
        job, settings = self.job, self.settings
        options.setdefault("block_bytes", settings.block_bytes)
        return compute_to_storage(
            problem, results_url=job.results_url, job_id=job.id, rows=rows,
            memory_budget_bytes=effective_budget(job.memory_budget_bytes, settings.memory_budget_bytes),
            chunk_rows=job.chunk_rows, strategy=job.strategy, on_plan=on_plan, on_progress=on_progress,
            should_stop=should_stop, plan=plan, probe=self.probe, try_xla=settings.try_xla,
            precision=job.precision, **options)
