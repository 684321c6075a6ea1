"""The engine-to-storage pipeline: the pending rows of a problem, computed chunk by chunk and streamed
into the job's Zarr array, with progress and plan reported on the way (jobs, shards, ``jacobian compute``)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from contracts import storage
from contracts.layout import job_url
from contracts.records import Progress, iso_time
from worker import metrics
from worker.engine.errors import WrongRowsDelivered
from worker.result_group import uncommit_rows
from worker.storage import ResultWriteError, ResultWriter

if TYPE_CHECKING:  # the engine imports TensorFlow: only the functions that run it import it
    from worker.engine import Plan
    from worker.engine.memory import MemoryProbe
    from worker.engine.problem import Problem

log = logging.getLogger(__name__)


def at_least(progress: Progress, rows_done: int) -> Progress:
    """``progress`` with ``rows_done`` raised to ``rows_done`` (what an earlier attempt reported).

    A resumed attempt restarts from the committed blocks, behind the rows the last one reported (handed
    to the writer, not yet committed); progress keeps the larger count until the new attempt passes it.
    """
    total = progress.rows_total or 0
    if progress.rows_done >= rows_done:
        return progress
    return Progress.of(min(rows_done, total), total, progress.rows_per_second or 0.0)


@dataclass
class ProgressMeter:
    """Rows done out of ``rows_total``; the rate counts only rows computed in this run (rows/s)."""

    rows_total: int
    rows_done: int
    started_s: float = field(default_factory=time.monotonic)
    rows_this_run: int = 0

    def add(self, n: int) -> None:
        self.rows_done += n
        self.rows_this_run += n

    def snapshot(self) -> Progress:
        elapsed_s = max(time.monotonic() - self.started_s, 1e-9)
        rate = self.rows_this_run / elapsed_s if self.rows_this_run else 0.0
        return Progress.of(self.rows_done, self.rows_total, rate)


def manifest_fields_for(attrs: dict[str, Any], *, plan: dict[str, Any], created_at: float | None,
                    model: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a manifest says beside the array's layout: kind, mode, of, wrt (from the result's ``attrs``),
    the model (``model``, else the one in ``attrs``), the plan, and when the job was created and finished."""
    return {"kind": attrs.get("kind"), "mode": attrs.get("mode"), "of": attrs.get("of"), "wrt": attrs.get("wrt"),
            "model": model or {"path": attrs.get("model"), "signature": attrs.get("signature")},
            "plan": plan, "created_at": iso_time(created_at or time.time()), "finished_at": iso_time(time.time())}


REDO_ROUNDS = 3  # computing again the rows a strategy found wrong delivered: once per strategy, at most


@dataclass
class DenseRun:
    """One run of a dense problem into ``{results_url}/{job_id}/``: what it needs beside the problem.

    ``rows``: a shard's range (None: all; the manifest is written only then); ``plan`` (``worker.engine.Plan``)
    the strategy and what is known of it, ``on_learned`` receives it updated by this run; ``strategy`` pins
    the chunk strategy; ``refine`` and ``trace_dir`` (``RunOptions``) go to ``run_problem``; ``block_bytes``: the
    storage block size (None: the layout's default); ``create=False`` (a shard) writes into the existing array and
    never recreates it.
    """

    results_url: str
    job_id: str
    rows: tuple[int, int] | None = None
    memory_budget_bytes: int | None = None
    chunk_rows: int | None = None
    on_plan: Callable[[dict[str, Any]], None] | None = None
    on_progress: Callable[[Progress], None] | None = None
    should_stop: Callable[[], bool] | None = None
    manifest_fields: dict[str, Any] | None = None
    created_at: float | None = None
    strategy: str | None = None
    block_bytes: int | None = None
    create: bool = True
    plan: Plan | None = None
    refine: str = "auto"
    on_learned: Callable[[Plan], None] | None = None
    probe: MemoryProbe | None = None
    try_xla: bool = True
    trace_dir: str | None = None


def compute_to_storage(problem: Problem, *, results_url: str, job_id: str, precision: str = "highest",
                       **options: Any) -> dict[str, Any]:
    """Compute the pending rows of ``problem`` and stream them to ``{results_url}/{job_id}/`` (``compute_once``,
    ``options`` the fields of ``DenseRun``), with TensorFloat-32 on only for ``precision="tf32"``
    (``devices.tensor_float_32``).

    When a strategy is found wrong after it had delivered rows (``WrongRowsDelivered``: a trial against
    the eager reference rows caught it), the storage blocks holding those rows are uncommitted and
    computed again with the plan that marks it wrong; a stored result never keeps them.
    """
    from worker.engine.devices import tensor_float_32

    run = DenseRun(results_url=results_url, job_id=job_id, **options)
    with tensor_float_32(precision == "tf32"):
        return _compute_redoing(problem, run)


def _compute_redoing(problem: Problem, run: DenseRun) -> dict[str, Any]:
    for _ in range(REDO_ROUNDS):
        try:
            return compute_once(problem, run)
        except WrongRowsDelivered as err:
            uncommit_rows(run.results_url, run.job_id, problem.layout, err.ranges, block_bytes=run.block_bytes)
            run.plan = err.learned
            if run.on_learned is not None:
                run.on_learned(err.learned)
            log.warning("job %s: %s; their storage blocks are computed again", run.job_id, err)
    run.refine = "never"
    return compute_once(problem, run)


def compute_once(problem: Problem, run: DenseRun) -> dict[str, Any]:
    """Compute the pending rows of ``problem`` and stream them to ``{run.results_url}/{run.job_id}/``.

    Resumes from committed blocks; writes ``manifest.json`` last (not for a shard, ``run.rows`` given).
    Returns the manifest. Raises ``EngineError`` (``Stopped`` on cancel), ``ResultWriteError``.
    """
    from worker.engine import RunOptions, run_problem

    results_url, job_id, rows = run.results_url, run.job_id, run.rows
    try:
        writer = ResultWriter.for_problem(results_url, job_id, problem, rows=rows, create=run.create,
                                          block_bytes=run.block_bytes)
    except (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError):
        raise
    except OSError as err:
        raise ResultWriteError(f"storage: cannot open the result at {job_url(results_url, job_id)}: {err}") from err
    progress = ProgressMeter(rows_total=writer.rows_total, rows_done=writer.rows_committed)
    on_plan, on_progress = run.on_plan, run.on_progress
    if on_progress:
        on_progress(progress.snapshot())
    plan_now: dict[str, Any] = {}
    chunk_clock = {"t": time.monotonic()}

    def take_plan(new_plan: dict[str, Any]) -> None:
        if progress.rows_this_run == 0:  # the rate counts compute, not loading and calibration
            progress.started_s = time.monotonic()
            chunk_clock["t"] = time.monotonic()
        metrics.observe_plan(new_plan, dict(plan_now) if plan_now else None)
        _log_plan(new_plan, changed=bool(plan_now))
        plan_now.clear()
        plan_now.update(new_plan)
        if on_plan:
            on_plan(dict(new_plan))

    def take_chunk(row_start: int, chunk: np.ndarray) -> None:
        seconds = time.monotonic() - chunk_clock["t"]
        writer.write_rows(row_start, chunk)
        progress.add(int(chunk.shape[0]))
        metrics.observe_chunk(problem.kind, int(chunk.shape[0]), int(chunk.size) * writer.dtype.itemsize, seconds)
        if on_progress:
            on_progress(progress.snapshot())
        chunk_clock["t"] = time.monotonic()

    ranges = writer.pending_ranges()
    chunk_rows = run.chunk_rows
    if chunk_rows is not None:  # a forced chunk larger than the job would compute padding rows
        chunk_rows = max(1, min(int(chunk_rows), writer.layout.rows_total))
    if not ranges and rows is None and storage.exists(writer.manifest_url):
        writer.close()  # finished before (e.g. a crash before the status update): keep that manifest
        return dict(json.loads(storage.read_bytes(writer.manifest_url)))
    try:
        if ranges:
            options = RunOptions(memory_budget_bytes=run.memory_budget_bytes, chunk_rows=chunk_rows,
                                 strategy=run.strategy, refine=run.refine, try_xla=run.try_xla,
                                 host_reserved_bytes=writer.host_bytes, trace_dir=run.trace_dir,
                                 settle=writer.settle)
            report = run_problem(problem, options=options, ranges=ranges, on_plan=take_plan, on_chunk=take_chunk,
                                 should_stop=run.should_stop, plan=run.plan, probe=run.probe)
            plan_now.update(report.plan or {})
            plan_now.update({"rows_computed": report.rows_computed, "run_seconds": round(report.seconds, 3)})
            if run.on_learned is not None:
                run.on_learned(report.learned)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    fields = manifest_fields_for(problem.attrs, plan=plan_now, created_at=run.created_at)
    fields.update({k: v for k, v in (run.manifest_fields or {}).items() if v is not None})
    manifest = {**writer.manifest_base(), **fields}
    if rows is None:
        writer.write_manifest(fields)
    return manifest


def _log_plan(plan: dict[str, Any], *, changed: bool) -> None:
    """One line per plan: strategy, chunk rows, free bytes and bytes per row, as JSON fields too."""
    fields = {"event": "plan_changed" if changed else "plan_chosen", "strategy": plan.get("strategy"),
              "chunk_rows": plan.get("chunk_rows"), "free_bytes": plan.get("free_bytes_at_start"),
              "bytes_per_row": plan.get("bytes_per_row"), "fixed_bytes": plan.get("fixed_bytes"),
              "mode": plan.get("mode"), "oom_retries": plan.get("oom_retries")}
    log.info("plan %s: strategy %s, %s rows per chunk, %s bytes free, %s bytes per row",
             "changed" if changed else "chosen", fields["strategy"], fields["chunk_rows"], fields["free_bytes"],
             fields["bytes_per_row"], extra=fields)
