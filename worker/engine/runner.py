"""Run a problem chunk by chunk: pick a strategy by a short timed trial, plan the chunk from
the memory free now, halve on out-of-memory, and hand every finished chunk on at once."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from contracts.layout import Block
from worker.engine.errors import MemoryBudgetTooSmall, NotDifferentiable, Stopped
from worker.engine.memory import MemoryProbe, TFMemoryProbe
from worker.engine.planner import LinearFit, bucket_rows, fit_linear, plan_chunk
from worker.engine.problem import Problem, error_summary
from worker.engine.strategies import chunk_function, is_applicable

log = logging.getLogger(__name__)

TRIAL_ROWS = 8                 # every candidate strategy is timed at this chunk
CALIBRATION_ROWS = (32, 128)   # the winner is timed and measured again at these
FAST_ENOUGH = 0.97             # smallest calibrated chunk within 3 % of the best rows/s wins
FINALIST_RATIO = 0.8           # strategies within 20 % of the fastest at TRIAL_ROWS are calibrated too


@dataclass
class Trial:
    """What the timed trial learnt: the winning strategy and its time and memory lines in rows."""

    strategy: str
    xla: bool
    seconds: LinearFit
    memory: LinearFit
    rates: dict[str, float] = field(default_factory=dict)   # rows/s at TRIAL_ROWS per candidate
    failures: dict[str, str] = field(default_factory=dict)
    preferred_rows: int | None = None   # fastest calibrated chunk; None when rows/s still grew at the largest
    calibration: dict[int, float] = field(default_factory=dict)  # rows/s of the winner per chunk size


@dataclass
class RunReport:
    plan: dict[str, Any]
    rows_computed: int = 0
    seconds: float = 0.0
    peak_bytes: int = 0
    trial: Trial | None = None


def _candidates(problem: Problem, strategy: str | None) -> list[tuple[str, bool]]:
    if strategy is not None:
        name, _, flag = strategy.partition("+")
        return [(name, flag == "xla")]
    xla = os.environ.get("JACOBIAN_TRY_XLA", "1") != "0"
    out = [(s, False) for s in ("tiled", "vectorized") if is_applicable(problem, s)]
    if xla:
        out += [(s, True) for s in ("tiled", "vectorized") if is_applicable(problem, s)]
    return out


def _timed(fn: Callable[[int], np.ndarray], probe: MemoryProbe, repeats: int = 2) -> tuple[np.ndarray, float, int]:
    """Result, best seconds and peak bytes of ``fn(0)`` after one warm-up call (the compile)."""
    out = fn(0)
    best = float("inf")
    probe.reset_peak()
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(0)
        best = min(best, time.perf_counter() - t0)
    return out, best, probe.peak_bytes()


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    scale = float(np.abs(b).max()) or 1.0
    tol = 1e-3 if a.dtype in (np.float16,) or str(a.dtype) == "bfloat16" else 1e-4
    return bool(np.abs(a.astype(np.float64) - b.astype(np.float64)).max() <= tol * scale)


def _calibrate(problem: Problem, probe: MemoryProbe, name: str, xla: bool, first: tuple[int, float, int],
               limit_bytes: int | None) -> list[tuple[int, float, int]]:
    """(rows, seconds, peak bytes) of ``name`` at growing chunks, as far as the budget allows
    (a proportional bound from the last point). Rows/s are measured, not extrapolated: past some
    size chunks get slower (caches)."""
    points = [first]
    if name in ("loop", "eager"):
        return points
    for size in CALIBRATION_ROWS:
        k_last, _, peak_last = points[-1]
        if size > bucket_rows(problem.rows_total):
            break
        if limit_bytes is not None and peak_last * size / k_last > 0.8 * limit_bytes:
            break
        _, secs, peak = _timed(chunk_function(problem, name, xla=xla, k=size), probe)
        points.append((size, secs, peak))
    return points


def select_strategy(problem: Problem, probe: MemoryProbe, *, strategy: str | None = None,
                    limit_bytes: int | None = None) -> Trial:
    """Time each applicable strategy at a small chunk, keep the fastest that agrees with the
    reference, and fit time and peak memory as lines in chunk rows (cached per model and shapes)."""
    key = (problem.cache_key(), strategy, probe.device, limit_bytes)
    cached = problem.model.trials.get(key)
    if cached is not None:
        return cached
    trial_rows = min(TRIAL_ROWS, bucket_rows(problem.rows_total))
    rates: dict[str, float] = {}
    failures: dict[str, str] = {}
    reference: np.ndarray | None = None
    try:  # row 0 computed eagerly: compiled paths must agree with it (some are silently wrong)
        eager_row0 = chunk_function(problem, "eager", k=1)(0)[0]
    except Exception:  # noqa: BLE001 - no eager reference; strategies are checked against each other
        eager_row0 = None
    passed: list[tuple[str, bool, float, int]] = []   # name, xla, seconds and peak at trial_rows
    for name, xla in _candidates(problem, strategy) + [("loop", False), ("eager", False)]:
        label = name + ("+xla" if xla else "")
        if name in ("loop", "eager") and passed:
            break
        try:
            out, secs, peak = _timed(chunk_function(problem, name, xla=xla, k=trial_rows), probe)
        except Exception as err:  # noqa: BLE001 - any failure rules the candidate out
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            failures[label] = error_summary(err)
            log.info("strategy %s failed: %s", label, failures[label])
            continue
        if eager_row0 is not None and not _close(out[0], eager_row0):
            failures[label] = "disagrees with the eager reference row"
            continue
        if reference is None:
            reference = out
        elif not _close(out, reference):
            failures[label] = "disagrees with the reference (examples interact?)"
            continue
        rates[label] = trial_rows / secs
        passed.append((name, xla, secs, peak))
    if not passed:
        reasons = sorted(set(failures.values()))
        detail = reasons[0] if len(reasons) == 1 else "; ".join(f"{k}: {v}" for k, v in failures.items())
        if problem.mode == "forward":
            raise NotDifferentiable(f"mode: TensorFlow's forward mode fails on this SavedModel ({detail}); "
                                    f"use mode 'reverse' or 'auto'", field="mode")
        raise NotDifferentiable(f"wrt: TensorFlow cannot differentiate {problem.of!r} with respect to "
                                f"{problem.wrt!r} in this SavedModel ({detail}); every strategy failed, the "
                                f"per-row eager loop included. Re-export the model so that its graph is "
                                f"differentiable (e.g. pass variables into loops as loop variables)", field="wrt")
    # The finalists (within FINALIST_RATIO of the fastest at trial_rows, at most two) are measured
    # again at growing chunks: which strategy wins can change with the chunk (XLA gains at scale).
    passed.sort(key=lambda c: c[2])
    finalists = [c for c in passed if c[2] <= passed[0][2] / FINALIST_RATIO][:2]
    runs = [(name, xla, _calibrate(problem, probe, name, xla, (trial_rows, secs, peak), limit_bytes))
            for name, xla, secs, peak in finalists]
    name, xla, points = max(runs, key=lambda r: max(k / t for k, t, _ in r[2]))
    secs_trial, peak_trial = points[0][1], points[0][2]
    if len(points) > 1:
        (k1, s1, p1), (k2, s2, p2) = points[-2], points[-1]
        seconds, memory = fit_linear(k1, s1, k2, s2), fit_linear(k1, p1, k2, p2)
    else:
        seconds = LinearFit(0.0, secs_trial / trial_rows)
        memory = LinearFit(0.0, peak_trial / trial_rows)
    best_rate = max(k / t for k, t, _ in points)
    fast_enough = min(k for k, t, _ in points if k / t >= FAST_ENOUGH * best_rate)
    preferred = fast_enough if fast_enough < points[-1][0] else None  # None: still growing, extrapolate
    # XLA on the CPU allocates outside TensorFlow's allocator (its peaks read 0): a row costs at
    # least its result and its seed, so never plan with less than that.
    floor = 2 * problem.layout.row_bytes
    if memory.per_row < floor:
        log.info("measured %d bytes per row is below the floor %d; using the floor", memory.per_row, floor)
        memory = LinearFit(memory.fixed, float(floor))
    trial = Trial(name, xla, seconds, memory, rates, failures, preferred_rows=preferred,
                  calibration={k: round(k / t, 2) for k, t, _ in points})
    problem.model.trials[key] = trial
    return trial


def run_problem(problem: Problem, *, ranges: list[tuple[int, int]] | None = None,
                memory_budget_bytes: int | None = None, chunk_rows: int | None = None,
                probe: MemoryProbe | None = None, strategy: str | None = None,
                on_plan: Callable[[dict[str, Any]], None] | None = None,
                on_chunk: Callable[[int, np.ndarray], None] | None = None,
                should_stop: Callable[[], bool] | None = None, throughput_cap: bool = True) -> RunReport:
    """Compute ``ranges`` of rows (default all) chunk by chunk; see docs/ENGINE_API.md.

    ``throughput_cap=False`` plans by memory alone (the largest chunk that fits), ignoring the
    measured rows/s sweet spot; tests of the memory logic use it to be independent of timing.
    """
    import tensorflow as tf

    probe = probe or TFMemoryProbe()
    t_start = time.perf_counter()
    probe.reset_peak()
    peak = 0
    free_at_start = probe.free_bytes()
    limit = free_at_start if memory_budget_bytes is None else min(free_at_start, memory_budget_bytes)
    trial = select_strategy(problem, probe, strategy=strategy, limit_bytes=memory_budget_bytes)
    peak = max(peak, probe.peak_bytes())
    if chunk_rows is not None:
        k = int(chunk_rows)
    else:
        k = plan_chunk(rows_total=problem.rows_total, memory=trial.memory, free_bytes=free_at_start,
                       budget_bytes=memory_budget_bytes, seconds=trial.seconds if throughput_cap else None,
                       preferred_rows=trial.preferred_rows if throughput_cap else None)
    plan = {"chunk_rows": k, "strategy": trial.strategy + ("+xla" if trial.xla else ""), "mode": problem.mode,
            "free_bytes_at_start": int(free_at_start), "bytes_per_row": int(trial.memory.per_row),
            "fixed_bytes": int(trial.memory.fixed), "oom_retries": 0, "xla": trial.xla,
            "trial_rows_per_second": {n: round(r, 2) for n, r in trial.rates.items()},
            "calibration_rows_per_second": {str(k): r for k, r in trial.calibration.items()}}
    log.info("plan %s", plan)
    if on_plan:
        on_plan(dict(plan))
    report = RunReport(plan=plan, trial=trial)
    todo = list(ranges) if ranges is not None else [(0, problem.rows_total)]
    out_dtype = np.dtype(problem.dtype)
    probe.reset_peak()
    for lo, hi in todo:
        start = lo
        while start < hi:
            if should_stop is not None and should_stop():
                raise Stopped("canceled between chunks", field=None)
            n = min(k, hi - start)
            try:
                probe.before_chunk(k)
                rows = chunk_function(problem, trial.strategy, xla=trial.xla, k=k)(start)
            except tf.errors.ResourceExhaustedError as err:
                if k == 1:
                    raise MemoryBudgetTooSmall(f"memory_budget_bytes: out of memory even at one row per chunk: "
                                               f"{str(err).splitlines()[0][:200]}; free device memory",
                                               field="memory_budget_bytes") from err
                k //= 2
                plan["oom_retries"] += 1
                plan["chunk_rows"] = k
                log.warning("out of memory; chunk halved to %d rows", k)
                if on_plan:
                    on_plan(dict(plan))
                continue
            chunk_peak = probe.peak_bytes()
            peak = max(peak, chunk_peak)
            probe.reset_peak()
            if chunk_rows is None and k > 1 and chunk_peak > 0.95 * limit:
                k //= 2  # the fit under-predicted: shrink before the next chunk, keep these rows
                plan["chunk_rows"] = k
                plan["budget_halvings"] = plan.get("budget_halvings", 0) + 1
                log.warning("chunk peak %d bytes is near the limit %d; chunk halved to %d rows", chunk_peak, limit, k)
                if on_plan:
                    on_plan(dict(plan))
            rows = rows[:n]
            if rows.dtype != out_dtype:
                rows = rows.astype(out_dtype)
            if on_chunk:
                on_chunk(start, rows)
            report.rows_computed += n
            start += n
    report.seconds = time.perf_counter() - t_start
    report.peak_bytes = peak
    return report


def compute_in_memory(model_or_path: Any, inputs: dict[str, Any], *, signature: str = "serving_default",
                      of: str | None = None, wrt: str | None = None, kind: str = "jacobian", mode: str = "auto",
                      reduce: str | None = None, check_independence: bool = False,
                      output_dtype: str | None = None, **run_options: Any) -> tuple[np.ndarray, RunReport]:
    """The whole result as one array of ``layout.shape`` (for tests, notebooks and benchmarks)."""
    from worker.engine.model import LoadedModel, load_model
    from worker.engine.problem import build_problem

    model = model_or_path if isinstance(model_or_path, LoadedModel) else load_model(str(model_or_path), signature)
    problem = build_problem(model, inputs, of=of, wrt=wrt, kind=kind, mode=mode, reduce=reduce,
                            check_independence=check_independence, output_dtype=output_dtype)
    layout = problem.layout
    flat = np.empty((layout.rows_total,) + layout.row_shape, dtype=problem.dtype)

    def keep(start: int, rows: np.ndarray) -> None:
        flat[start:start + len(rows)] = rows

    report = run_problem(problem, on_chunk=keep, **run_options)
    whole = Block(0, 0, layout.rows_total, tuple(slice(0, d) for d in layout.shape), layout.iter_shape)
    return np.ascontiguousarray(layout.place(whole, flat)), report
