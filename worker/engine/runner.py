"""Run a problem chunk by chunk under a plan: start at once, calibrate on the job's own chunks,
check rows against the eager reference, try an alternative strategy only when that pays, halve on
out-of-memory, and hand every finished chunk on at once. The rules are in ``worker.engine.tuning``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from contracts.layout import Block
from worker.engine import tuning
from worker.engine.errors import EngineError, MemoryBudgetTooSmall, NotDifferentiable, Stopped
from worker.engine.memory import MemoryProbe, TFMemoryProbe, is_out_of_memory
from worker.engine.plan import Plan, parse_label
from worker.engine.planner import LinearFit, bucket_rows, fit_linear, plan_chunk
from worker.engine.problem import Problem, error_summary
from worker.engine.strategies import ChunkKey, chunk_function, is_applicable, is_compiled

log = logging.getLogger(__name__)

MAX_CHUNK_ROWS = 4096
SAFETY = 0.8   # chunks are planned to peak at no more than this share of the memory limit


@dataclass
class RunReport:
    """``plan``: what this run did (the job status's ``plan``); ``learned``: the plan to keep for next time."""

    plan: dict[str, Any]
    learned: Plan
    rows_computed: int = 0
    seconds: float = 0.0
    peak_bytes: int = 0
    failures: dict[str, str] = field(default_factory=dict)


def rows_agree(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal up to 1e-4 (1e-3 for 16-bit floats) of ``want``'s largest finite magnitude, with NaN and
    infinities in the same places (``tape.jacobian`` of ``sqrt`` at 0 is inf, and so must ours be)."""
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    if not np.array_equal(np.isposinf(a), np.isposinf(b)) or not np.array_equal(np.isneginf(a), np.isneginf(b)):
        return False
    finite = np.isfinite(b)
    if not finite.any():
        return True
    scale = float(np.abs(b[finite]).max()) or 1.0
    tol = 1e-3 if np.asarray(got).dtype.itemsize <= 2 else 1e-4
    return bool(np.abs(a[finite] - b[finite]).max() <= tol * scale)


@dataclass
class _Calibration:
    """One strategy's chunk sizes so far in this run: calls, steady seconds and peaks per size."""

    calls: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    peaks: dict[int, int] = field(default_factory=dict)
    first_call_s: float | None = None
    k: int = tuning.FIRST_ROWS
    done: bool = False


class _Run:
    """The state of one ``run_problem`` call; see that function."""

    def __init__(self, problem: Problem, plan: Plan, probe: MemoryProbe, *, budget: int | None,
                 chunk_rows: int | None, throughput_cap: bool, refine: str, try_xla: bool, pinned: bool,
                 on_plan: Callable[[dict[str, Any]], None] | None) -> None:
        self.problem, self.plan, self.probe = problem, plan, probe
        self.budget, self.chunk_rows, self.throughput_cap = budget, chunk_rows, throughput_cap
        self.refine, self.pinned, self.on_plan = refine, pinned, on_plan
        self.free_at_start = int(probe.free_bytes())
        self.limit = self.free_at_start if budget is None else min(self.free_at_start, budget)
        self.usable = SAFETY * self.limit
        # XLA's memory is invisible to TensorFlow's allocator statistics on the CPU: no XLA under a budget there.
        self.try_xla = try_xla and (budget is None or getattr(probe, "is_gpu", False))
        self.batch = problem.of_shape[0] if problem.kind == "batch_jacobian" and problem.of_shape else None
        self.cal: dict[str, _Calibration] = {}
        self.rows_run = 0
        self.pending = problem.rows_total
        self.k_cap: dict[str, int] = {}
        self.failures: dict[str, str] = {}
        self.eager_rows: dict[int, np.ndarray] = {}
        self.last: tuple[int, np.ndarray, str, int] | None = None   # start, rows, label, peak
        self.last_peak = 0
        self._tiled_running = False
        self.peak = 0
        self.status: dict[str, Any] = {
            "chunk_rows": None, "strategy": plan.strategy, "mode": problem.mode,
            "free_bytes_at_start": self.free_at_start, "bytes_per_row": None, "fixed_bytes": None,
            "oom_retries": 0, "xla": parse_label(plan.strategy)[1], "source": plan.source,
            "plan_key": plan.key.digest if plan.key else None, "trial": None}

    # -- one chunk ------------------------------------------------------------------------------

    def call(self, label: str, start: int, n: int, k: int | None = None) -> tuple[np.ndarray, float, int, bool]:
        """Rows ``start .. start + n`` by ``label`` from a call of ``k >= n`` rows:
        ``(rows, seconds, peak bytes, first call)``.

        XLA runs a power-of-two ``k`` (one compile per size); surplus rows are sliced off on the
        device. Raises what the strategy raises.
        """
        _, xla = parse_label(label)
        k = max(n, k or n)
        if xla:
            k = bucket_rows(k)
        first = not is_compiled(self.problem, label)
        fn = chunk_function(self.problem, label)
        self.probe.before_chunk(k)
        self.probe.reset_peak()
        t0 = time.perf_counter()
        out = fn(start, k)
        if k > n:
            out = out[:n]
        rows = np.asarray(out)  # a view of the tensor's buffer on the CPU: no extra copy
        seconds = time.perf_counter() - t0
        peak = int(self.probe.peak_bytes())
        self.peak = max(self.peak, peak)
        self.problem.model.compiled.sizes(self.key(label)).add(k)
        self.rows_run += n
        return rows, seconds, peak, first

    def key(self, label: str) -> ChunkKey:
        name, xla = parse_label(label)
        return ChunkKey.of_problem(self.problem, name, xla)

    def eager_row(self, row: int) -> np.ndarray | None:
        """The reference for ``row``: one eager VJP/JVP, or, in reverse mode once ``tiled`` has run, the
        ``tiled`` function at one row, which is exactly one backward pass of the model on its own
        inputs (no tiling, no pfor) and costs no eager backward function (2 s on a large graph)."""
        if row not in self.eager_rows:
            label = "eager"
            if self.problem.mode == "reverse" and self.plan.record("tiled").status == "ok" or self._tiled_running:
                label = "tiled"
            try:
                self.eager_rows[row] = np.asarray(chunk_function(self.problem, label)(row, 1))[0]
            except EngineError:
                raise
            except Exception as err:  # noqa: BLE001 - no reference: rows cannot be checked
                log.info("no reference row %d (%s); rows are not checked", row, error_summary(err))
                return None
        return self.eager_rows[row]

    def verify(self, label: str, start: int, rows: np.ndarray, k: int) -> bool:
        """First and last row of a chunk of a size not checked yet for this plan, against eager rows.

        Each chunk size is checked once per plan (``StrategyRecord.verified_rows``, kept with it), so
        the function at the size the job runs is checked, not only a small trial one (XLA compiles
        each size apart), and a later job at a checked size runs no eager code at all.
        """
        record = self.plan.record(label)
        if label == "eager" or k in record.verified_rows or (label == "tiled" and k == 1):
            record.verified = True
            return True
        self._tiled_running = label == "tiled" and self.problem.mode == "reverse"
        for i in sorted({0, len(rows) - 1}):
            want = self.eager_row(start + i)
            if want is None:
                return True
            if not rows_agree(rows[i], want):
                log.warning("strategy %s: row %d of a %d-row chunk disagrees with the eager reference", label,
                            start + i, k)
                return False
        record.verified = True
        record.verified_rows = sorted({*record.verified_rows, k})
        return True

    # -- chunk sizes ----------------------------------------------------------------------------

    def next_rows(self, label: str, remaining: int) -> tuple[int, int, int]:
        """``(n, k, planned)``: the next chunk keeps ``n <= remaining`` rows of a call of ``k >= n``
        rows; ``planned`` is the chunk size the plan runs (the status's ``chunk_rows``).

        ``k > n`` only at the tail of a range, where a size already run (at most the bucket of the
        rows left) is cheaper than a new one: every new size pays a slow first call.
        """
        if self.chunk_rows is not None:
            n = max(1, min(self.chunk_rows, remaining))
            return n, n, self.chunk_rows
        cap = self.k_cap.get(label, MAX_CHUNK_ROWS)
        cal = self.cal.setdefault(label, _Calibration())
        record = self.plan.record(label)
        memory = record.memory_at(self.batch)
        if not cal.done and memory is not None and record.rates and not cal.calls:
            cal.done = True  # calibrated by an earlier job
        if not cal.done:
            k = max(1, min(cal.k, cap))
        elif memory is None:
            k = max(1, min(cal.k, cap))
        else:
            # Planned from the rows this run has to do (a shard's or a resumed job's, not the job's).
            k = plan_chunk(rows_total=self.pending, memory=memory, free_bytes=self.free_at_start,
                           budget_bytes=self.budget, safety=SAFETY, max_rows=MAX_CHUNK_ROWS,
                           seconds=record.seconds if self.throughput_cap else None,
                           preferred_rows=record.preferred_rows if self.throughput_cap else None)
            k = max(1, min(k, cap))
        if remaining >= k:
            return k, k, k
        seen = [s for s in self.problem.model.compiled.sizes(self.key(label)) if remaining <= s <= bucket_rows(remaining)]
        return remaining, (min(seen) if seen else remaining), k

    def measured(self, label: str, k: int, seconds: float, peak: int, first: bool, remaining_after: int) -> None:
        """Account a chunk of ``k`` rows; grow or settle the chunk of a calibrating strategy."""
        cal = self.cal.setdefault(label, _Calibration())
        record = self.plan.record(label)
        if first:
            cal.first_call_s = seconds
        if cal.done or self.chunk_rows is not None or k != cal.k:
            if not first and k in record.rates:  # a running mean: single chunks are noisy
                record.rates[k] = round(0.8 * record.rates[k] + 0.2 * k / max(seconds, 1e-9), 3)
            elif not first:
                record.rates[k] = round(k / max(seconds, 1e-9), 3)
            return
        cal.calls[k] = cal.calls.get(k, 0) + 1
        cal.peaks[k] = max(cal.peaks.get(k, 0), peak)
        if self.throughput_cap:
            if cal.calls[k] == 1:
                return  # a size's first call is slower (trace, allocator, oneDNN primitives): time the next two
            cal.seconds[k] = min(seconds, cal.seconds.get(k, seconds))
            if cal.calls[k] < 1 + tuning.TIMED_CALLS:
                record.rates[k] = round(k / max(cal.seconds[k], 1e-9), 3)
                return
        else:  # planned by memory alone: the first call's peak (the higher one) is all it needs
            cal.seconds[k] = seconds
        record.rates[k] = round(k / max(cal.seconds[k], 1e-9), 3)
        if cal.first_call_s is not None and record.compile_s is None and k == min(cal.seconds):
            record.compile_s = round(max(cal.first_call_s - seconds, 0.0), 3)
        grow = tuning.keep_growing(dict(cal.seconds), k,
                                   peak_bytes=cal.peaks[k], usable_bytes=self.usable,
                                   max_rows=min(self.k_cap.get(label, MAX_CHUNK_ROWS), MAX_CHUNK_ROWS),
                                   by_throughput=self.throughput_cap)
        if grow and remaining_after >= 2 * k:
            cal.k = 2 * k
            return
        self.settle(label)

    def settle(self, label: str) -> None:
        """Fit time and memory lines from the calibration and keep them in the plan."""
        cal, record = self.cal[label], self.plan.record(label)
        cal.done = True
        timed = sorted(cal.seconds)
        if not timed:
            return
        floor = 2.0 * self.problem.layout.row_bytes  # XLA on the CPU reads 0: a row costs its result and seed
        if len(timed) >= 2:
            k1, k2 = timed[-2], timed[-1]
            memory = fit_linear(k1, cal.peaks[k1], k2, cal.peaks[k2])
            seconds = fit_linear(k1, cal.seconds[k1], k2, cal.seconds[k2])
        else:
            k2 = timed[-1]
            memory = LinearFit(0.0, cal.peaks[k2] / k2)
            seconds = LinearFit(0.0, cal.seconds[k2] / k2)
        record.memory = LinearFit(memory.fixed, max(memory.per_row, floor))
        record.seconds = seconds
        record.preferred_rows = tuning.preferred_rows({k: k / cal.seconds[k] for k in timed})
        record.batch = self.batch
        record.status = "ok"

    def shrink(self, label: str, k: int, *, oom: bool) -> int:
        """After an OOM (or a peak near the limit) at ``k`` rows: halve, and correct the memory line
        so that this and later jobs plan below ``k``. Raises MemoryBudgetTooSmall at one row."""
        if k <= 1:
            raise MemoryBudgetTooSmall("memory_budget_bytes: out of memory even at one row per chunk; "
                                       "free device memory or raise memory_budget_bytes", field="memory_budget_bytes")
        half = k // 2
        self.k_cap[label] = half
        record = self.plan.record(label)
        if record.memory is not None:
            record.memory = LinearFit(record.memory.fixed, max(record.memory.per_row, self.usable / k))
        cal = self.cal.setdefault(label, _Calibration())
        cal.k = min(cal.k, half)
        if oom:
            self.status["oom_retries"] += 1
        else:
            self.status["budget_halvings"] = self.status.get("budget_halvings", 0) + 1
        log.warning("%s at %d rows; chunk halved to %d rows", "out of memory" if oom else "peak near the limit",
                    k, half)
        return half

    # -- the loop -------------------------------------------------------------------------------

    def execute(self, todo: list[tuple[int, int]], applicable: list[str], *,
                on_chunk: Callable[[int, np.ndarray], None] | None,
                should_stop: Callable[[], bool] | None) -> tuple[int, float]:
        """Every row of ``todo`` in ascending order; returns ``(rows computed, compute seconds)``."""
        pending = self.pending = sum(hi - lo for lo, hi in todo)
        rows_done, compute_s = 0, 0.0
        succeeded: set[str] = set()
        for lo, hi in todo:
            start = lo
            while start < hi:
                if should_stop is not None and should_stop():
                    raise Stopped("canceled between chunks", field=None)
                label = self.plan.strategy
                n, k, planned = self.next_rows(label, hi - start)
                self.publish(label, planned)
                try:
                    rows, seconds, peak, first = self.call(label, start, n, k)
                except Exception as err:  # noqa: BLE001 - sorted below: OOM halves, a first failure falls back
                    if is_out_of_memory(err):
                        half = self.shrink(label, n, oom=True)
                        if self.chunk_rows is not None:
                            self.chunk_rows = half
                        continue
                    if isinstance(err, (KeyboardInterrupt, SystemExit, EngineError)) or label in succeeded:
                        raise
                    _fall_back(self, applicable, label, error_summary(err))
                    continue
                if not self.verify(label, start, rows, k):
                    _fall_back(self, applicable, label, "disagrees with the eager reference row", status="disagrees")
                    continue
                succeeded.add(label)
                self.plan.record(label).status = "ok"
                compute_s += seconds
                if self.chunk_rows is None and n > 1 and peak > 0.95 * self.limit:
                    self.shrink(label, n, oom=False)  # the fit under-predicted: shrink before the next chunk
                self.measured(label, k, seconds, peak, first, hi - start - n)
                if on_chunk:
                    on_chunk(start, rows)
                self.last = (start, rows, label, peak)
                self.last_peak = peak
                start += n
                rows_done += n
                cal = self.cal.get(label)
                if not first and cal is not None and cal.done:
                    _maybe_trial(self, applicable, rows_left=pending - rows_done, seconds_per_row=seconds / k)
        if self.status.get("chunk_rows") is not None:  # the measured figures, for the report (no callback)
            self.publish(self.plan.strategy, self.status["chunk_rows"], final=True)
        return rows_done, compute_s

    # -- status ---------------------------------------------------------------------------------

    def publish(self, label: str, k: int, *, final: bool = False) -> None:
        """The status plan for the next chunk; ``on_plan`` hears of a new strategy or chunk size.
        ``final``: the figures measured by the end of the run, for the report alone."""
        record = self.plan.record(label)
        memory = record.memory_at(self.batch)
        last_k = len(self.last[1]) if self.last else 0
        if memory is not None:
            per_row = int(memory.per_row)
        elif last_k:
            per_row = int(self.last_peak / last_k)
        else:
            per_row = int(2 * self.problem.layout.row_bytes)  # a floor until a chunk is measured
        new = {"strategy": label, "chunk_rows": k, "xla": parse_label(label)[1], "bytes_per_row": per_row,
               "fixed_bytes": int(memory.fixed) if memory else None,
               "rows_per_second": {str(s): r for s, r in sorted(record.rates.items())}}
        changed = any(self.status.get(f) != new[f] for f in ("strategy", "chunk_rows"))
        self.status.update(new)
        if changed and self.on_plan and not final:
            self.on_plan(dict(self.status))


def _fail_all(problem: Problem, failures: dict[str, str]) -> NotDifferentiable:
    reasons = sorted(set(failures.values()))
    detail = reasons[0] if len(reasons) == 1 else "; ".join(f"{k}: {v}" for k, v in failures.items())
    if problem.mode == "forward":
        return NotDifferentiable(f"mode: TensorFlow's forward mode fails on this SavedModel ({detail}); "
                                 f"use mode 'reverse' or 'auto'", field="mode")
    return NotDifferentiable(f"wrt: TensorFlow cannot differentiate {problem.of!r} with respect to "
                             f"{problem.wrt!r} in this SavedModel ({detail}); every strategy failed, the "
                             f"per-row eager loop included. Re-export the model so that its graph is "
                             f"differentiable (e.g. pass variables into loops as loop variables)", field="wrt")


def applicable_labels(problem: Problem) -> list[str]:
    names = [s for s in ("tiled", "vectorized", "loop", "eager") if is_applicable(problem, s)]
    return names + [s + "+xla" for s in ("tiled", "vectorized") if is_applicable(problem, s)]


def default_plan(problem: Problem, *, similar: str | None = None, key: Any = None) -> Plan:
    """A plan to start with at once: by kind and model structure, or what a similar request ran."""
    applicable = applicable_labels(problem)
    order = tuning.default_order(applicable, similar if similar in applicable else None,
                                 graph_ops=problem.model.graph_ops)
    return Plan(strategy=order[0], key=key, source="default")


def run_problem(problem: Problem, *, plan: Plan | None = None, ranges: list[tuple[int, int]] | None = None,
                memory_budget_bytes: int | None = None, chunk_rows: int | None = None,
                probe: MemoryProbe | None = None, strategy: str | None = None, refine: str = "auto",
                try_xla: bool = True, on_plan: Callable[[dict[str, Any]], None] | None = None,
                on_chunk: Callable[[int, np.ndarray], None] | None = None,
                should_stop: Callable[[], bool] | None = None, throughput_cap: bool = True) -> RunReport:
    """Compute ``ranges`` of rows (default all) chunk by chunk; see docs/ENGINE_API.md.

    ``plan`` (from a plan cache; default: ``default_plan``) says which strategy runs and what is
    known of it; the returned ``report.learned`` is that plan updated with what this run measured,
    for the caller to store. ``strategy`` pins a strategy (no trial; ``loop`` and ``eager`` remain
    as fallbacks). ``refine``: ``"auto"`` tries an alternative when it pays (``worker.engine.tuning``),
    ``"never"`` does not (shards: every row computed alike), ``"always"`` tries every alternative now.
    ``throughput_cap=False`` plans by memory alone (the largest chunk that fits), ignoring the
    measured rows/s sweet spot; tests of the memory logic use it to be independent of timing.
    ``on_chunk(start, rows)`` gets rows ``(n,) + row_shape`` in ``problem.dtype`` in ascending order.
    Raises EngineError (``Stopped`` when ``should_stop()`` turns true between chunks).
    """
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
        plan.strategy = _strategy_for_job(problem, plan, applicable, sum(hi - lo for lo, hi in todo))
    run = _Run(problem, plan, probe, budget=memory_budget_bytes, chunk_rows=chunk_rows, throughput_cap=throughput_cap,
               refine="never" if strategy is not None else refine, try_xla=try_xla, pinned=strategy is not None,
               on_plan=on_plan)
    job_strategy = plan.strategy
    rows_done, compute_s = run.execute(todo, applicable, on_chunk=on_chunk, should_stop=should_stop)
    if plan.strategy == job_strategy and plan.record(steady).usable:
        plan.strategy = steady  # the plan keeps its steady-state choice; this job ran what finished it first
    plan.work_s += compute_s
    plan.jobs += 1
    plan.updated_at = time.time()
    plan.checked = problem.checked()
    _mark_refined(run, applicable)
    report = RunReport(plan=dict(run.status), learned=plan, rows_computed=rows_done,
                       seconds=time.perf_counter() - t_start, peak_bytes=run.peak, failures=dict(run.failures))
    log.info("run done: %d rows in %.3f s, plan %s", rows_done, report.seconds, report.plan)
    return report


def _strategy_for_job(problem: Problem, plan: Plan, applicable: list[str], rows: int) -> str:
    """Among the plan's verified and timed strategies, the one to run this job (``tuning.buy_compile``)."""
    known = {label: r for label, r in plan.strategies.items()
             if label in applicable and r.status == "ok" and r.verified and r.best_rate()}
    if plan.strategy not in known or len(known) < 2:
        return plan.strategy

    def compile_s(label: str) -> float:
        return 0.0 if is_compiled(problem, label) else float(known[label].compile_s or 0.0)

    def rows_s(label: str) -> float:
        return rows / float(known[label].best_rate() or 1e-9)

    best = min(known, key=rows_s)
    rent = min(known, key=lambda label: compile_s(label) + rows_s(label))
    if rent == best or compile_s(best) == 0.0:
        return best
    digest = plan.key.digest if plan.key else ""
    regret = problem.model.compiled.regret_s.get(digest, 0.0)
    rent_s = compile_s(rent) + rows_s(rent)
    if tuning.buy_compile(rent_job_s=rent_s, best_rows_s=rows_s(best), compile_s=compile_s(best), regret_s=regret):
        problem.model.compiled.regret_s[digest] = 0.0
        return best
    problem.model.compiled.regret_s[digest] = regret + max(rent_s - rows_s(best), 0.0)
    log.info("this job runs %s (%.1f s expected) rather than the plan's faster %s (%.1f s to compile here)",
             rent, rent_s, best, compile_s(best))
    return rent


def _fall_back(run: _Run, applicable: list[str], label: str, why: str, *, status: str = "failed") -> None:
    """Mark ``label`` unusable and move to the next strategy that may work; raise when none is left."""
    record = run.plan.record(label)
    record.status, record.reason = status, why
    run.failures[label] = why
    log.info("strategy %s %s: %s", label, status, why)
    order = [s for s in tuning.FALLBACKS if s in applicable]
    left = [s for s in order if run.plan.record(s).usable and s != label]
    if not left:
        raise _fail_all(run.problem, run.failures)
    run.plan.strategy = left[0]
    run.plan.source = run.plan.source if run.plan.source == "pinned" else "default"


def _mark_refined(run: _Run, applicable: list[str]) -> None:
    tried = [label for label, r in run.plan.strategies.items() if r.status != "untried"]
    if not tuning.alternatives(applicable, tried, xla=run.try_xla):
        run.plan.refined = True


def _maybe_trial(run: _Run, applicable: list[str], *, rows_left: int, seconds_per_row: float) -> None:
    """Between chunks: try the next alternative if it pays (``tuning.trial_pays``) or ``refine="always"``."""
    if run.refine == "never" or run.pinned or run.chunk_rows is not None or run.last is None:
        return
    plan = run.plan
    while True:
        tried = [label for label, r in plan.strategies.items() if r.status != "untried"]
        candidates = tuning.alternatives(applicable, tried, xla=run.try_xla)
        if not candidates:
            plan.refined = True
            return
        incumbent = plan.strategy
        candidate = candidates[0]
        k_inc = len(run.last[1])
        compile_inc = plan.record(incumbent).compile_s or 1.0
        cost = tuning.estimated_compile_s(candidate, known=plan.record(candidate).compile_s, incumbent=incumbent,
                                          incumbent_compile_s=compile_inc)
        cost += (2 + 4 * tuning.TRIAL_PAIRS) * seconds_per_row * k_inc
        if run.refine != "always" and not tuning.trial_pays(cost_s=cost, remaining_s=rows_left * seconds_per_row,
                                                             past_work_s=plan.work_s):
            return
        _trial(run, candidate)
        if plan.strategy != incumbent:
            return  # the winner calibrates on the next chunks; further trials come after that


def _trial(run: _Run, candidate: str) -> None:
    """Time ``candidate`` against the incumbent on the incumbent's last chunk (recomputed, not kept).

    The candidate first runs a quarter of that chunk (compile, memory reading, rows checked against
    the incumbent's), then the largest power-of-two share of it whose proportional peak stays under
    the job's memory plan, then ``TRIAL_PAIRS`` interleaved pairs decide (``tuning.candidate_wins``),
    each timed call after an untimed one of the same strategy.
    """
    assert run.last is not None
    start, ref, incumbent, peak_inc = run.last
    plan, k_inc = run.plan, len(ref)
    record = plan.record(candidate)
    k_small = max(1, k_inc // 4)
    trial: dict[str, Any] = {"candidate": candidate, "incumbent": incumbent}
    run.status["trial"] = trial
    try:
        rows, seconds, peak_small, first = run.call(candidate, start, k_small)
        if first:
            record.compile_s = round(seconds, 3)
        if not rows_agree(rows, ref[:k_small]):
            record.status, record.reason = "disagrees", "disagrees with the incumbent's rows"
            trial["result"] = record.reason
            return
        # The job's chunk size, unless the candidate's proportional peak would pass the job's memory
        # plan there (a budget set: the incumbent's own chunk peak, so a trial never peaks above it).
        cap = max(peak_inc, 1) if run.budget is not None else run.usable
        k_c = k_inc
        if peak_small > 0:
            while k_c > k_small and peak_small * k_c / k_small > cap and k_c > 1:
                k_c //= 2
            if peak_small > cap * 1.05 and k_c <= k_small:
                record.status, record.reason = "too_much_memory", f"{peak_small} bytes at {k_small} rows"
                trial["result"] = record.reason
                return
        if k_c != k_small:
            rows, _, _, _ = run.call(candidate, start, k_c)
            if not rows_agree(rows, ref[:k_c]):
                record.status, record.reason = "disagrees", "disagrees with the incumbent's rows"
                trial["result"] = record.reason
                return
        inc_times, cand_times, peaks = [], [], []
        for _ in range(tuning.TRIAL_PAIRS):
            # Each side's timed call follows an untimed one of the same side: right after the other
            # side, the thread pools of the other runtime (TensorFlow's executor, XLA's) still spin
            # and the first call pays for it (5-10 % on 2 cores), whichever side it is.
            run.call(incumbent, start, k_inc)
            _, s_inc, _, _ = run.call(incumbent, start, k_inc)
            run.call(candidate, start, k_c)
            _, s_c, p_c, _ = run.call(candidate, start, k_c)
            inc_times.append(s_inc / k_inc)
            cand_times.append(s_c / k_c)
            peaks.append(p_c)
    except Exception as err:  # noqa: BLE001 - a candidate that fails is ruled out, the job goes on
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        record.status, record.reason = "failed", error_summary(err)
        run.failures[candidate] = record.reason
        trial["result"] = f"failed: {record.reason}"
        return
    record.status = "ok"  # its rows agreed with the incumbent's, which agree with the eager rows
    record.rates[k_c] = round(1.0 / float(np.median(cand_times)), 3)
    if record.compile_s is not None:
        record.compile_s = round(max(record.compile_s - float(np.median(cand_times)) * k_small, 0.0), 3)
    if k_c != k_small:
        record.memory = fit_linear(k_small, peak_small, k_c, max(peaks)) if max(peaks) > 0 else None
    ratio = float(np.median([c / i for i, c in zip(inc_times, cand_times)]))
    wins = tuning.candidate_wins(inc_times, cand_times)
    trial.update({"ratio": round(ratio, 4), "winner": candidate if wins else incumbent, "chunk_rows": k_c})
    log.info("trial %s vs %s: per-row time ratio %.3f (median of %d pairs): %s", candidate, incumbent, ratio,
             len(inc_times), "switch" if wins else "keep")
    if wins:
        plan.strategy, plan.source = candidate, "trial"
        cal = run.cal.setdefault(candidate, _Calibration())
        cal.k = k_c
        cal.calls[k_c] = 2
        cal.seconds[k_c] = float(np.median(cand_times)) * k_c
        cal.peaks[k_c] = max(peaks)


def compute_in_memory(model_or_path: Any, inputs: dict[str, Any], *, signature: str = "serving_default",
                      of: str | None = None, wrt: str | None = None, kind: str = "jacobian", mode: str = "auto",
                      reduce: str | None = None, check_independence: bool = False,
                      output_dtype: str | None = None, **run_options: Any) -> tuple[np.ndarray, RunReport]:
    """The whole result as one array of ``layout.shape`` (for tests, notebooks and benchmarks)."""
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

    report = run_problem(problem, on_chunk=keep, **run_options)
    whole = Block(0, 0, layout.rows_total, tuple(slice(0, d) for d in layout.shape), layout.iter_shape)
    out = np.ascontiguousarray(layout.place(whole, flat))
    return (out.reshape(()) if layout.shape == () else out), report
