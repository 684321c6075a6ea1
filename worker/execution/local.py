"""``jacobian compute``'s side of the interface: a request run in this process, no Redis, through the same
executors as a job (same arrays, manifest and plans, cached under ``JACOBIAN_CACHE_DIR``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from contracts import storage
from contracts.jobspec import SEEDS_MEMBER, QueuedJob
from contracts.layout import MANIFEST, RESULT_GROUP, job_url
from contracts.records import Progress
from worker.execution import RunContext, executor_for


def local_job(options: dict[str, Any], *, model_path: str, signature: str, out: str, job_id: str,
              inputs_path: str) -> QueuedJob:
    """The request of a local run as a ``QueuedJob``: the same rules as at POST (``JobOptions``), so a refused
    combination is refused here too (``pydantic.ValidationError`` naming the field). A ``pattern_from`` names a
    folder under ``out`` (any ``--job-id``), not only a service's job id."""
    from contracts.jobspec import PatternFrom

    given = {k: v for k, v in options.items() if v is not None}
    earlier = given.get("sparsity", {}).get("pattern_from") if isinstance(given.get("sparsity"), dict) else None
    if earlier is not None:
        given["sparsity"] = "auto"    # the other rules of sparsity still apply
    job = QueuedJob.model_validate({**given, "id": job_id, "model": {"path": model_path, "signature": signature},
                                    "inputs_uri": inputs_path, "results_url": storage.normalize(out)})
    if earlier is not None:
        job.sparsity = PatternFrom.model_construct(pattern_from=str(earlier))
    return job


def run_local(job: QueuedJob, *, inputs: dict[str, Any], seeds: Any = None,
              on_progress: Callable[[Progress], None], on_plan: Callable[[dict[str, Any]], None],
              budget_bytes: int | None = None) -> dict[str, Any]:
    """Run ``job`` here (``executor_for(job).run``) on ``inputs`` (and ``seeds``); returns the manifest.
    Raises ``EngineError`` (``InvalidRequest`` naming the field), ``InvalidInputs``, storage errors."""
    from contracts.settings import get_settings
    from worker.engine import DiskPlanCache, TFMemoryProbe
    from worker.model_cache import get_model

    settings = get_settings()
    tensors = dict(inputs) | ({SEEDS_MEMBER: seeds} if seeds is not None else {})
    path = str(Path(job.model.path).expanduser().resolve())

    def previous(earlier: str) -> str | None:
        url = job_url(job.results_url, earlier)
        return storage.join(url, RESULT_GROUP) if storage.exists(storage.join(url, MANIFEST)) else None

    def model() -> Any:
        return get_model(path, job.model.signature)

    ctx = RunContext(job=job, load_inputs=lambda: dict(tensors), load_model=model,
                     budget_bytes=budget_bytes, block_bytes=settings.block_bytes, on_progress=on_progress,
                     on_plan=on_plan, probe=TFMemoryProbe(), plans=DiskPlanCache(settings.cache_dir),
                     cache_dir=str(settings.cache_dir) if settings.cache_dir else None, try_xla=settings.try_xla,
                     previous_result=previous)
    from worker.execution.precision import run_guarded

    return run_guarded(executor_for(job), ctx, keep_copy=False)   # one job in this process


def local_context(model: Any, inputs: dict[str, Any], *, results_url: str, job_id: str = "local",
                  probe: Any = None, cache_dir: str | None = None,
                  on_progress: Callable[[Progress], None] | None = None,
                  previous_result: Callable[[str], str | None] | None = None, **options: Any) -> RunContext:
    """A ``RunContext`` for a loaded ``model`` and ``inputs`` in this process (library use, tests, benchmarks):
    ``options`` are the request's (``of``, ``wrt``, ``kind``, ``sparsity``, ``chunk_rows``, ...), checked by the
    same rules as at POST."""
    job = QueuedJob.model_validate({**options, "id": job_id, "inputs_uri": "-", "results_url": results_url,
                                    "model": {"path": str(model.path), "signature": model.signature}})
    return RunContext(job=job, load_inputs=lambda: dict(inputs), load_model=lambda: model,
                      budget_bytes=job.memory_budget_bytes, probe=probe, cache_dir=cache_dir,
                      on_progress=on_progress or (lambda _: None), previous_result=previous_result)
