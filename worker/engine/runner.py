"""Run a problem chunk by chunk under a plan: start at once, calibrate on the job's own chunks,
check rows against the eager reference, try an alternative strategy only when that pays, halve on
out-of-memory, and hand every finished chunk on at once. The rules are in ``worker.engine.tuning``;
one run's state is ``worker.engine.chunk_run.ChunkRun``, the choosing ``worker.engine.trial``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from contracts.layout import Block
from worker.engine.agreement import rows_agree
from worker.engine.chunk_run import ChunkRun
from worker.engine.devices import prepare_gpus
from worker.engine.errors import EngineError, NotDifferentiable, Stopped, WrongRowsDelivered
from worker.engine.memory import MemoryProbe, TFMemoryProbe, is_out_of_memory
from worker.engine.plan import Plan
from worker.engine.problem import Problem, error_summary
from worker.engine.strategies import BASE_STRATEGIES, BATCHED, is_applicable, start_order
from worker.engine.trial import avoid_unseen, fall_back, mark_refined, maybe_trial, strategy_for_job

log = logging.getLogger(__name__)

__all__ = ["RunOptions", "RunReport", "applicable_labels", "compute_in_memory", "default_plan", "execute",
           "rows_agree", "run_problem"]


@dataclass(frozen=True)
class RunOptions:
    """How ``run_problem`` runs a problem. ``memory_budget_bytes``: at most this much device memory (None: the
    free memory). ``chunk_rows``: force a chunk size (skips planning). ``strategy`` pins a strategy (no trial;
    ``loop`` and ``eager`` remain as fallbacks). ``refine``: ``"auto"`` tries an alternative when it pays
    (``worker.engine.tuning``), ``"never"`` does not (shards: every row computed alike), ``"always"`` tries
    every alternative now. ``try_xla``: trials may try XLA forms (never under a CPU budget).
    ``throughput_cap=False`` plans by memory alone (the largest chunk that fits), ignoring the measured rows/s
    sweet spot; tests of the memory logic use it to be independent of timing. ``host_reserved_bytes``: host
    memory the caller holds per job besides the chunks (the result writer's buffers); on a GPU chunks are
    capped so that their rows fit on the host beside it. ``trace_dir``: the cache folder, where chunk functions
    traced by earlier processes are loaded from and this process's are kept (``strategies.keep_trace``).
    ``settle``: called before a call whose time decides a size or a strategy; it waits for the work the caller
    does beside the chunks (``ResultWriter.settle``: blocks being compressed and uploaded) to finish."""

    memory_budget_bytes: int | None = None
    chunk_rows: int | None = None
    strategy: str | None = None
    refine: str = "auto"
    try_xla: bool = True
    throughput_cap: bool = True
    host_reserved_bytes: int = 0
    trace_dir: str | None = None
    settle: Callable[[], None] | None = None


@dataclass
class RunReport:
    """``plan``: what this run did (the job status's ``plan``); ``learned``: the plan to keep for next time."""

    plan: dict[str, Any]
    learned: Plan
    rows_computed: int = 0
    seconds: float = 0.0
    peak_bytes: int = 0
    failures: dict[str, str] = field(default_factory=dict)


def applicable_labels(problem: Problem) -> list[str]:
    names = [s for s in BASE_STRATEGIES if is_applicable(problem, s)]
    return names + [s + "+xla" for s in BATCHED if is_applicable(problem, s)]


def default_plan(problem: Problem, *, similar: str | None = None, key: Any = None) -> Plan:
    """A plan to start with at once: by kind and model structure, or what a similar request ran."""
    applicable = applicable_labels(problem)
    order = start_order(problem, applicable, similar if similar in applicable else None)
    return Plan(strategy=order[0], key=key, source="default")


def run_problem(problem: Problem, *, options: RunOptions | None = None, plan: Plan | None = None,
                ranges: list[tuple[int, int]] | None = None, probe: MemoryProbe | None = None,
                on_plan: Callable[[dict[str, Any]], None] | None = None,
                on_chunk: Callable[[int, np.ndarray], None] | None = None,
                should_stop: Callable[[], bool] | None = None) -> RunReport:
    """Compute ``ranges`` of rows (default all) chunk by chunk, as ``options`` say (``RunOptions``; default:
    its defaults); see docs/ENGINE_API.md.

    ``plan`` (from a plan cache; default: ``default_plan``) says which strategy runs and what is
    known of it; the returned ``report.learned`` is that plan updated with what this run measured,
    for the caller to store. ``probe``: the device's memory (default: the real probe for the device in use).
    ``on_plan(status)`` hears when the strategy or the chunk size changes.
    ``on_chunk(start, rows)`` gets rows ``(n,) + row_shape`` in ``problem.dtype`` in ascending order.
    Raises EngineError (``Stopped`` when ``should_stop()`` turns true between chunks).
    """
    options = options or RunOptions()
    strategy, memory_budget_bytes = options.strategy, options.memory_budget_bytes
    prepare_gpus()  # a problem built from a model loaded elsewhere: growth and TF32 as load_model sets them
    probe = probe or TFMemoryProbe()
    t_start = time.perf_counter()
    applicable = applicable_labels(problem)
    if strategy is not None:
        if strategy not in applicable:
            raise NotDifferentiable(f"strategy: {strategy!r} cannot express this request; use one of "
                                    f"{', '.join(applicable)}", field="strategy")
        plan = plan or Plan(strategy=strategy, source="pinned")
        plan.strategy, plan.source = strategy, "pinned"
    plan = plan or default_plan(problem)
    if plan.strategy not in applicable or not plan.current.usable:
        plan.strategy = default_plan(problem).strategy
    todo = list(ranges) if ranges is not None else [(0, problem.rows_total)]
    steady = plan.strategy
    if strategy is None:
        plan.strategy = strategy_for_job(problem, plan, applicable, sum(hi - lo for lo, hi in todo),
                                         budget_bytes=memory_budget_bytes, trace_dir=options.trace_dir)
    run = ChunkRun(problem, plan, probe, budget=memory_budget_bytes, chunk_rows=options.chunk_rows,
                   throughput_cap=options.throughput_cap, refine="never" if strategy is not None else options.refine,
                   try_xla=options.try_xla, pinned=strategy is not None, on_plan=on_plan,
                   host_reserved_bytes=options.host_reserved_bytes, trace_dir=options.trace_dir)
    run.writer_settle = options.settle
    job_strategy = plan.strategy
    rows_done, compute_s = execute(run, todo, applicable, on_chunk=on_chunk, should_stop=should_stop)
    if plan.strategy == job_strategy and plan.record(steady).usable:
        plan.strategy = steady  # the plan keeps its steady-state choice; this job ran what finished it first
    plan.work_s += compute_s
    plan.jobs += 1
    plan.updated_at = time.time()
    plan.checked = problem.checked()
    mark_refined(run, applicable)
    report = RunReport(plan=dict(run.status), learned=plan, rows_computed=rows_done,
                       seconds=time.perf_counter() - t_start, peak_bytes=run.peak, failures=dict(run.failures))
    log.info("run done: %d rows in %.3f s, plan %s", rows_done, report.seconds, report.plan)
    return report


def execute(run: ChunkRun, todo: list[tuple[int, int]], applicable: list[str], *,
            on_chunk: Callable[[int, np.ndarray], None] | None,
            should_stop: Callable[[], bool] | None) -> tuple[int, float]:
    """Every row of ``todo`` in ascending order; returns ``(rows computed, compute seconds)``."""
    pending = run.pending = sum(hi - lo for lo, hi in todo)
    rows_done, compute_s = 0, 0.0
    succeeded: set[str] = set()
    for lo, hi in todo:
        start = lo
        while start < hi:
            if should_stop is not None and should_stop():
                raise Stopped("canceled between chunks", field=None)
            label = run.plan.strategy
            n, k, planned = run.next_rows(label, hi - start)
            run.publish(label, planned)
            try:
                rows, seconds, peak, first = run.call(label, start, n, k)
            except Exception as err:  # noqa: BLE001 - sorted below: OOM halves, a first failure falls back
                if is_out_of_memory(err):
                    half = run.shrink(label, n, oom=True)
                    if run.chunk_rows is not None:
                        run.chunk_rows = half
                    continue
                if isinstance(err, (KeyboardInterrupt, SystemExit, EngineError)) or label in succeeded:
                    raise
                fall_back(run, applicable, label, error_summary(err))
                continue
            if not run.verify(label, start, rows, k):
                fall_back(run, applicable, label, "disagrees with the eager reference row", status="disagrees")
                continue
            succeeded.add(label)
            run.plan.record(label).status = "ok"
            compute_s += seconds
            if run.chunk_rows is None and n > 1 and peak > 0.95 * run.limit:
                run.shrink(label, n, oom=False)  # the fit under-predicted: shrink before the next chunk
            run.measured(label, k, seconds, peak, first, pending - rows_done - n, warm=not run.new_size)
            if on_chunk:
                t_deliver = time.perf_counter()
                on_chunk(start, rows)
                run.timeline.deliver_s += time.perf_counter() - t_deliver
            run.delivered.append((start, start + n, label))
            run.last = (start, rows, label, peak)
            run.last_peak = peak
            start += n
            rows_done += n
            if run.budget is not None and run.plan.record(label).peak_unseen and avoid_unseen(run, applicable, label):
                continue  # a budget cannot bound memory the statistics do not see: the next chunk runs another
            ladder = run.ladders.get(label)
            # trials wait for the chunk size to be measured (calibrated), not for a doubling under comparison to
            # end: a comparison longer than the job goes on in the next one (its pairs in the plan)
            if not first and ladder is not None and ladder.calibrated and (ladder.is_settled or ladder.comparison):
                maybe_trial(run, applicable, rows_left=pending - rows_done, seconds_per_row=seconds / k)
                if run.wrong_delivered:
                    mark_refined(run, applicable)
                    run.plan.checked = run.problem.checked()
                    raise WrongRowsDelivered(
                        f"strategy {label} delivered wrong rows (found by a trial against the eager reference "
                        f"rows); rows {run.wrong_delivered} must be computed again with {run.plan.strategy}",
                        ranges=list(run.wrong_delivered), learned=run.plan)
    if run.status.get("chunk_rows") is not None:  # the measured figures, for the report (no callback)
        run.publish(run.plan.strategy, run.status["chunk_rows"], final=True)
    run.status["time"] = run.timeline.to_json()
    return rows_done, compute_s


def compute_in_memory(model_or_path: Any, inputs: dict[str, Any], *, signature: str = "serving_default",
                      of: str | None = None, wrt: str | None = None, kind: str = "jacobian", mode: str = "auto",
                      reduce: str | None = None, check_independence: bool = False,
                      output_dtype: str | None = None, **run_options: Any) -> tuple[np.ndarray, RunReport]:
    """The whole result as one array of ``layout.shape`` (for tests, notebooks and benchmarks). ``run_options``:
    the fields of ``RunOptions`` and the other keywords of ``run_problem``, side by side."""
    from worker.engine.model import LoadedModel, load_model
    from worker.engine.problem import build_problem

    model = model_or_path if isinstance(model_or_path, LoadedModel) else load_model(str(model_or_path), signature)
    plan = run_options.get("plan")
    problem = build_problem(model, inputs, of=of, wrt=wrt, kind=kind, mode=mode, reduce=reduce,
                            check_independence=check_independence, output_dtype=output_dtype,
                            checked=plan.checked if plan is not None else None)
    layout = problem.layout
    flat = np.empty((layout.rows_total,) + layout.row_shape, dtype=problem.dtype)

    def keep(start: int, rows: np.ndarray) -> None:
        flat[start:start + len(rows)] = rows

    knobs = {f.name for f in fields(RunOptions)}
    options = RunOptions(**{k: v for k, v in run_options.items() if k in knobs})
    rest = {k: v for k, v in run_options.items() if k not in knobs}
    try:
        report = run_problem(problem, options=options, on_chunk=keep, **rest)
    except WrongRowsDelivered as err:  # every row again, with the plan that knows which strategy was wrong
        report = run_problem(problem, options=options, on_chunk=keep, **{**rest, "plan": err.learned})
    whole = Block(0, 0, layout.rows_total, tuple(slice(0, d) for d in layout.shape), layout.iter_shape)
    out = np.ascontiguousarray(layout.place(whole, flat))
    return (out.reshape(()) if layout.shape == () else out), report
