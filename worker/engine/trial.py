"""Choosing between strategies while a job runs: which one runs this job, falling back when one fails, and
a trial of an alternative timed against the incumbent at the job's chunk size, only when it pays."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from worker.engine import tuning
from worker.engine.agreement import rows_agree
from worker.engine.chunk_run import ChunkRun
from worker.engine.errors import NotDifferentiable
from worker.engine.ladder import Ladder
from worker.engine.memory import is_out_of_memory
from worker.engine.plan import Plan, StrategyRecord, parse_label
from worker.engine.planner import fit_bound
from worker.engine.problem import Problem, error_summary
from worker.engine.strategies import inlined, is_compiled, start_order, trace_kept

log = logging.getLogger(__name__)


def fail_all(problem: Problem, failures: dict[str, str]) -> NotDifferentiable:
    reasons = sorted(set(failures.values()))
    detail = reasons[0] if len(reasons) == 1 else "; ".join(f"{k}: {v}" for k, v in failures.items())
    if problem.mode == "forward":
        return NotDifferentiable(f"mode: TensorFlow's forward mode fails on this SavedModel ({detail}); "
                                 f"use mode 'reverse' or 'auto'", field="mode")
    return NotDifferentiable(f"wrt: TensorFlow cannot differentiate {problem.of!r} with respect to "
                             f"{problem.wrt!r} in this SavedModel ({detail}); every strategy failed, the "
                             f"per-row eager loop included. Re-export the model so that its graph is "
                             f"differentiable (for a Hessian: every op's gradient differentiable again)", field="wrt")


def is_unseen(plan: Plan, label: str) -> bool:
    """Whether ``label``'s chunks peaked at 0 bytes: its memory is invisible to the allocator statistics."""
    record = plan.strategies.get(label)
    return record is not None and record.peak_unseen


def seen_strategy(problem: Problem, plan: Plan, applicable: list[str]) -> str:
    """Of ``applicable`` strategies whose memory is seen: the plan's fastest verified one, else the default."""
    known = [label for label in applicable if not is_unseen(plan, label) and label in plan.strategies
             and plan.strategies[label].status == "ok" and plan.strategies[label].best_rate()]
    if known:
        return max(known, key=lambda label: float(plan.strategies[label].best_rate() or 0.0))
    usable = [label for label in applicable if not is_unseen(plan, label)
              and (label not in plan.strategies or plan.strategies[label].usable)]
    order = start_order(problem, usable)
    return order[0] if order else plan.strategy   # none left (the default order names no eager): stay


def avoid_unseen(run: ChunkRun, applicable: list[str], label: str) -> bool:
    """Under a memory budget, move this job off ``label``, whose chunks peaked at 0 bytes: the budget cannot
    bound memory it cannot see. True when it moved; a pinned strategy stays (with a warning)."""
    if run.pinned:
        if not run.status.get("budget_unbounded"):
            run.status["budget_unbounded"] = True
            log.warning("strategy %s (pinned): its memory is invisible to TensorFlow's allocator statistics, so "
                        "memory_budget_bytes cannot bound it", label)
        return False
    other = seen_strategy(run.problem, run.plan, [s for s in applicable if s != label])
    if other == run.plan.strategy or is_unseen(run.plan, other):
        return False
    log.warning("strategy %s: its memory is invisible to TensorFlow's allocator statistics (peak 0), so "
                "memory_budget_bytes cannot bound it; this job goes on with %s", label, other)
    run.plan.strategy = other
    return True


def strategy_for_job(problem: Problem, plan: Plan, applicable: list[str], rows: int, *,
                     budget_bytes: int | None = None, trace_dir: str | None = None) -> str:
    """Among the plan's verified and timed strategies, the one to run this job (``tuning.buy_compile``);
    under a memory budget none whose memory is invisible to the allocator statistics (``is_unseen``). A strategy
    whose trace ``trace_dir`` keeps costs its first call from that trace (``first_call_s``)."""
    if budget_bytes is not None and any(is_unseen(plan, label) for label in applicable):
        seen = [label for label in applicable if not is_unseen(plan, label)]
        if seen and plan.strategy not in seen:
            return seen_strategy(problem, plan, seen)
        applicable = seen or applicable
    known = {label: r for label, r in plan.strategies.items()
             if label in applicable and r.status == "ok" and r.verified and r.best_rate()}
    if plan.strategy not in known or len(known) < 2:
        return plan.strategy

    def compile_s(label: str) -> float:
        if is_compiled(problem, label):
            return 0.0
        return first_call_s(known, label, kept=trace_kept(problem, label, trace_dir))

    def rows_s(label: str) -> float:
        return rows / float(known[label].best_rate() or 1e-9)

    best = min(known, key=rows_s)
    if rows_s(plan.strategy) * (1.0 - tuning.TIE_BAND) <= rows_s(best):
        best = plan.strategy  # within the tie band: the plan's choice, decided on paired timings, stays
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


def first_call_s(records: dict[str, StrategyRecord], label: str, *, kept: bool) -> float:
    """What ``label``'s first call costs a process beyond a steady call: its ``compile_s``, or where its trace
    is kept, its ``kept_compile_s``; not measured yet, its ``compile_s`` scaled by what a kept trace saved another
    strategy (the least saving measured), else its ``compile_s``."""
    record = records[label]
    traced = float(record.compile_s or 0.0)
    if not kept:
        return traced
    if record.kept_compile_s is not None:
        return float(record.kept_compile_s)
    shares = [r.kept_compile_s / r.compile_s for r in records.values()
              if r.kept_compile_s is not None and r.compile_s]
    return traced * min(1.0, max(shares)) if shares else traced


def fall_back(run: ChunkRun, applicable: list[str], label: str, why: str, *, status: str = "failed") -> None:
    """Mark ``label`` unusable and move to the next strategy that may work; raise when none is left."""
    record = run.plan.record(label)
    record.status, record.reason = status, why
    run.failures[label] = why
    log.info("strategy %s %s: %s", label, status, why)
    order = [s for s in tuning.fallbacks(pinned=run.plan.source == "pinned") if s in applicable]
    left = [s for s in order if run.plan.record(s).usable and s != label]
    if not left:
        raise fail_all(run.problem, run.failures)
    run.plan.strategy = left[0]
    run.plan.source = run.plan.source if run.plan.source == "pinned" else "default"


def mark_refined(run: ChunkRun, applicable: list[str]) -> None:
    tried = [label for label, r in run.plan.strategies.items() if r.status != "untried"]
    if not tuning.alternatives(applicable, tried, xla=run.try_xla):
        run.plan.refined = True


def maybe_trial(run: ChunkRun, applicable: list[str], *, rows_left: int, seconds_per_row: float) -> None:
    """Between chunks: try the next alternative if it pays (``tuning.trial_pays``) or ``refine="always"``."""
    if run.refine == "never" or run.pinned or run.chunk_rows is not None or run.last is None:
        return
    plan = run.plan
    while True:
        tried = [label for label, r in plan.strategies.items() if r.status != "untried"]
        left = tuning.alternatives(applicable, tried, xla=run.try_xla)
        # Under a budget, not one whose memory the statistics cannot see (it stays untried for other jobs).
        candidates = [c for c in left if run.budget is None or not is_unseen(plan, c)]
        if not candidates:
            plan.refined = plan.refined or not left
            return
        incumbent = plan.strategy
        # The first candidate whose trial pays: an expensive one that does not pay yet holds back no other.
        candidate = next((c for c in candidates if run.refine == "always" or _pays(
            run, c, rows_left=rows_left, seconds_per_row=seconds_per_row)), None)
        if candidate is None:
            return
        t0 = time.perf_counter()
        run.in_trial = True
        try:
            run_trial(run, candidate)
        finally:
            run.in_trial = False
        run.status["trial"]["wall_s"] = round(time.perf_counter() - t0, 3)   # all of it: compile, checks, pairs
        if plan.strategy != incumbent:
            return  # the winner calibrates on the next chunks; further trials come after that


def learned_factors(plan: Plan) -> dict[str, float]:
    """label -> the compile factor a trial measured for it (``StrategyRecord.compile_factor``)."""
    return {label: r.compile_factor for label, r in plan.strategies.items() if r.compile_factor}


def estimated_compile(run: ChunkRun, candidate: str) -> float:
    """``tuning.estimated_compile_s`` of ``candidate`` in this run: scaled from the incumbent's measured compile
    by the graph's size and what the plan learnt."""
    plan = run.plan
    return tuning.estimated_compile_s(candidate, known=plan.record(candidate).compile_s, incumbent=plan.strategy,
                                      incumbent_compile_s=plan.record(plan.strategy).compile_s or 1.0,
                                      graph_ops=run.problem.model.graph_ops, learned=learned_factors(plan),
                                      inlined=inlined(run.problem))


def _pays(run: ChunkRun, candidate: str, *, rows_left: int, seconds_per_row: float) -> bool:
    """``tuning.trial_pays`` for ``candidate``: its estimated compile plus the trial's chunks, against
    this job's remaining seconds and what earlier jobs of the plan spent."""
    assert run.last is not None
    k = len(run.last[1])
    # an XLA candidate compiles at a quarter of the chunk and again at the chunk (one compile per shape)
    compiles = 2 if parse_label(candidate)[1] and max(1, k // 4) != k else 1
    cost = compiles * estimated_compile(run, candidate) + (2 + 4 * tuning.TRIAL_PAIRS) * seconds_per_row * k
    return tuning.trial_pays(cost_s=cost, remaining_s=rows_left * seconds_per_row, past_work_s=run.plan.work_s,
                             gain=tuning.expected_gain(candidate, run.plan.strategy, inlined=inlined(run.problem)))


def learn_compile(run: ChunkRun, candidate: str, estimate: float | None, trial: dict[str, Any]) -> None:
    """Where ``candidate``'s measured compile exceeded the ``estimate`` its trial was decided on, keep the factor
    that would have predicted it (``StrategyRecord.compile_factor``): later jobs and processes of this plan
    estimate with it, and the strategies sharing its transforms (``tuning.learned_factor``) too."""
    record = run.plan.record(candidate)
    if estimate is None or record.compile_s is None:
        return
    trial.update({"estimated_compile_s": round(estimate, 3), "compile_s": record.compile_s})
    if record.compile_s <= estimate or estimate <= 0:
        return
    factor = tuning.learned_factor(candidate, graph_ops=run.problem.model.graph_ops,
                                   learned=learned_factors(run.plan), inlined=inlined(run.problem))
    record.compile_factor = round(factor * record.compile_s / estimate, 3)
    log.info("trial %s: its compile took %.1f s against %.1f s estimated; its compile factor is now %.3g", candidate,
             record.compile_s, estimate, record.compile_factor)


def run_trial(run: ChunkRun, candidate: str) -> None:
    """Time ``candidate`` against the incumbent on the incumbent's last chunk (recomputed, not kept).

    The candidate first runs a quarter of that chunk (compile, memory reading, rows checked by
    ``_rows_hold``), then the largest power-of-two share of it whose proportional peak stays under
    the job's memory plan, then up to ``TRIAL_PAIRS`` interleaved pairs decide (``tuning.candidate_wins``; fewer
    where the first already fix the median, ``tuning.trial_decided``),
    each timed call after an untimed one of the same strategy.
    """
    assert run.last is not None
    start, ref, incumbent, peak_inc = run.last
    plan, k_inc = run.plan, len(ref)
    record = plan.record(candidate)
    estimate = None if record.compile_s is not None else estimated_compile(run, candidate)
    k_small = max(1, k_inc // 4)
    trial: dict[str, Any] = {"candidate": candidate, "incumbent": incumbent}
    run.status["trial"] = trial
    try:
        rows, seconds, peak_small, first = run.call(candidate, start, k_small)
        if first:
            record.compile_s = round(seconds, 3)
        if run.budget is not None and record.peak_unseen:
            trial["result"] = "ruled out: its memory is invisible to the allocator statistics, under a budget"
            return
        if not _rows_hold(run, trial, candidate, start, rows, ref):
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
        recompile_s = None   # XLA compiles each shape: the first call at the trial's size compiles again
        if k_c != k_small:
            rows, seconds, _, _ = run.call(candidate, start, k_c)
            recompile_s = seconds if parse_label(candidate)[1] and run.new_size else None
            if not _rows_hold(run, trial, candidate, start, rows, ref):
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
            if tuning.clearly_loses(inc_times, cand_times) or tuning.trial_decided(inc_times, cand_times):
                break
        trial["pairs"] = len(inc_times)
    except Exception as err:  # noqa: BLE001 - a candidate that fails is ruled out, the job goes on
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        if is_out_of_memory(err):  # it needs more memory than the job has: no failure to differentiate
            record.status, record.reason = "too_much_memory", f"out of memory in a trial: {error_summary(err)}"
            trial["result"] = record.reason
            log.info("trial %s vs %s: %s", candidate, incumbent, record.reason)
            return
        record.status, record.reason = "failed", error_summary(err)
        run.failures[candidate] = record.reason
        trial["result"] = f"failed: {record.reason}"
        return
    record.status = "ok"  # its rows agreed with the eager reference rows and with the incumbent's
    record.rates[k_c] = round(1.0 / float(np.median(cand_times)), 3)
    if record.compile_s is not None:   # a compile at the job's size: the larger of the two sizes' for XLA
        steady = float(np.median(cand_times))
        record.compile_s = round(max(record.compile_s - steady * k_small, (recompile_s or 0.0) - steady * k_c, 0.0), 3)
    learn_compile(run, candidate, estimate, trial)
    if k_c != k_small:
        for k, peak in ((k_small, peak_small), (k_c, max(peaks))):
            record.peaks[k] = max(record.peaks.get(k, 0), int(peak))
            record.last_peaks[k] = int(peak)
        record.memory = fit_bound({k_small: peak_small, k_c: max(peaks)}) if max(peaks) > 0 else None
    ratio = float(np.median([c / i for i, c in zip(inc_times, cand_times)]))
    wins = tuning.candidate_wins(inc_times, cand_times)
    trial.update({"ratio": round(ratio, 4), "winner": candidate if wins else incumbent, "chunk_rows": k_c})
    log.info("trial %s vs %s: per-row time ratio %.3f (median of %d pairs): %s", candidate, incumbent, ratio,
             len(inc_times), "switch" if wins else "keep")
    if wins:
        plan.strategy, plan.source = candidate, "trial"
        # The winner's chunk sizes start at the size it was timed at, and grow from there as they pay.
        sizes = run.problem.model.compiled.sizes(run.key(candidate))
        run.ladders[candidate] = Ladder(size=k_c, by_throughput=run.throughput_cap, timed={*record.rates, k_c},
                                        called=set(sizes), samples={k_c: list(cand_times)},
                                        peaks={k_c: max(peaks)}, host=run.host is not None,
                                        footprint=run.host.footprint if run.host else 0)


def _rows_hold(run: ChunkRun, trial: dict[str, Any], candidate: str, start: int, rows: np.ndarray,
               ref: np.ndarray) -> bool:
    """Whether the trial goes on with the candidate's ``rows`` from row ``start`` (``ref``: the incumbent's).

    The eager reference rows are the reference, not the incumbent: the candidate's first and last rows
    are checked against them as every chunk size is (``ChunkRun.verify``), then its rows against the
    incumbent's; where those differ, the reference row where they differ most tells which is wrong. A
    wrong candidate is dropped. A wrong incumbent (right at the rows its own chunk sizes had checked,
    wrong between them) is dropped, and the candidate takes over now; the rows it handed on are listed
    in ``run.wrong_delivered`` and the run stops with ``WrongRowsDelivered`` for them to be computed again.
    """
    wrong, why = None, "disagrees with the eager reference rows"
    if not run.verify(candidate, start, rows, len(rows)):
        wrong = candidate
    elif not rows_agree(rows, ref[:len(rows)]):
        i = _worst_row(rows, ref[:len(rows)])
        want = run.eager_row(start + i)
        if want is None:  # no reference here: the incumbent's rows decide
            wrong, why = candidate, "disagrees with the incumbent's rows"
        elif not rows_agree(rows[i], want):
            wrong = candidate
        elif not rows_agree(ref[i], want):
            wrong, why = trial["incumbent"], f"row {start + i} {why} (found by a trial of {candidate})"
    if wrong is None:
        return True
    loser = run.plan.record(wrong)
    loser.status, loser.reason = "disagrees", why
    trial["result"] = f"{wrong} {why}"
    if wrong == candidate:
        return False
    run.failures[wrong] = why
    run.wrong_delivered = [(a, b) for a, b, label in run.delivered if label == wrong]
    log.warning("strategy %s %s: %s takes over; the %d rows it handed on are computed again", wrong, why,
                candidate, sum(b - a for a, b in run.wrong_delivered))
    run.plan.record(candidate).status = "ok"
    run.plan.strategy, run.plan.source = candidate, "trial"
    trial["winner"] = candidate
    return False


def _worst_row(got: np.ndarray, want: np.ndarray) -> int:
    """The row where ``got`` and ``want`` differ most: a NaN or infinity in one place only first."""
    a = np.asarray(got, np.float64).reshape(len(got), -1)
    b = np.asarray(want, np.float64).reshape(len(want), -1)
    unlike = (np.isnan(a) != np.isnan(b)) | ((np.isinf(a) | np.isinf(b)) & (a != b))
    if unlike.any():
        return int(np.argmax(unlike.any(axis=1)))
    finite = np.isfinite(a) & np.isfinite(b)
    return int(np.argmax(np.where(finite, np.abs(a - b), 0.0).max(axis=1)))
