"""The state of one ``run_problem`` call: chunk calls, the eager reference rows that check them, chunk sizes
grown on the job's own chunks (``worker.engine.ladder``), and shrinking on out-of-memory. The rules are in
``worker.engine.tuning``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from contracts.plan_predictions import new_size_cost
from worker.engine import strategies, tf_logs, tuning
from worker.engine.agreement import rows_agree
from worker.engine.errors import EngineError, MemoryBudgetTooSmall
from worker.engine.host_peak import HostPeaks
from worker.engine.ladder import GROWTH_GAIN, Ladder, comparison_rows, side_rows
from worker.engine.memory import MemoryProbe
from worker.engine.plan import Plan, parse_label
from worker.engine.planner import (
    LESS_THAN_A_ROW,
    LinearFit,
    bucket_rows,
    check_one_row_fits,
    fit_bound,
    fit_linear,
    plan_chunk,
)
from worker.engine.problem import Problem, error_summary
from worker.engine.strategies import ChunkKey, allocator_blind, chunk_function, from_kept_trace, is_compiled, keep_trace
from worker.engine.timeline import Timeline

log = logging.getLogger(__name__)

MAX_CHUNK_ROWS = 4096
# On a GPU each chunk's rows are copied to the host (one copy, then the writer's block buffer): a chunk
# takes at most this share of the host memory free at the start, after the writer's own buffers.
HOST_SHARE = 0.5
HOST_COPIES = 2
SAFETY = 0.8   # chunks are planned to peak at no more than this share of the memory limit
# A chunk whose result alone is this large and whose peak reads 0 ran on memory the allocator statistics miss
# (the CPU's keep none in a fresh TensorFlow 2.21 process; a host job's RSS sees it: ``host_measured``).
SEEN_BYTES = 1 << 20


class ChunkRun:
    """The state of one ``run_problem`` call (see that function); ``worker.engine.runner.execute`` drives it."""

    def __init__(self, problem: Problem, plan: Plan, probe: MemoryProbe, *, budget: int | None,
                 chunk_rows: int | None, throughput_cap: bool, refine: str, try_xla: bool, pinned: bool,
                 on_plan: Callable[[dict[str, Any]], None] | None, host_reserved_bytes: int = 0,
                 trace_dir: str | None = None) -> None:
        self.problem, self.plan, self.probe = problem, plan, probe
        self.budget, self.chunk_rows, self.throughput_cap = budget, chunk_rows, throughput_cap
        self.refine, self.pinned, self.on_plan = refine, pinned, on_plan
        self.trace_dir, self.writer_settle = trace_dir, None   # writer_settle: ``RunOptions.settle``
        self.free_at_start = int(probe.free_bytes())
        self.limit = self.free_at_start if budget is None else min(self.free_at_start, budget)
        self.usable = SAFETY * self.limit
        # XLA's memory is invisible to TensorFlow's allocator statistics on the CPU: no XLA under a budget there.
        self.try_xla = try_xla and (budget is None or getattr(probe, "is_gpu", False))
        self.batch = problem.of_shape[0] if problem.spec.batch_axis and problem.of_shape else None
        self.ladders: dict[str, Ladder] = {}
        self.first_call: dict[str, tuple[int, float]] = {}   # per strategy: its first call's size and seconds
        self.first_at_size: dict[tuple[str, int], float] = {}   # a later new size's first call: its seconds
        self.kept: set[str] = set()   # strategies whose function this process loaded from a kept trace
        self.chunks_run: dict[int, int] = {}       # planned chunk size -> the least largest-timed size before it
        self.new_size = False                      # the last call's size had not run before in this process
        self.rows_run = 0
        self.pending = problem.rows_total
        self.k_cap: dict[str, int] = {}
        self.failures: dict[str, str] = {}
        self.eager_rows: dict[int, np.ndarray] = {}
        self.last: tuple[int, np.ndarray, str, int] | None = None   # start, rows, label, peak
        self.last_peak = 0
        self.delivered: list[tuple[int, int, str]] = []   # (start, stop, label) of each chunk handed on
        self.wrong_delivered: list[tuple[int, int]] = []  # rows handed on by a strategy later found wrong
        self._checking, self.in_trial = "", False   # the label verify checks; in_trial: a trial's calls (both timed)
        self.peak, self.timeline = 0, Timeline()
        self.status: dict[str, Any] = {
            "chunk_rows": None, "strategy": plan.strategy, "mode": problem.mode,
            "free_bytes_at_start": self.free_at_start, "bytes_per_row": None, "fixed_bytes": None,
            "oom_retries": 0, "xla": parse_label(plan.strategy)[1], "source": plan.source,
            "plan_key": plan.key.digest if plan.key else None, "trial": None}
        self.max_rows = self._host_rows_cap(host_reserved_bytes)
        # A host job: peaks the allocator misses are measured by RSS, and growth weighs the process's footprint
        self.host = None if getattr(probe, "is_gpu", False) else HostPeaks()

    def _host_rows_cap(self, reserved: int) -> int:
        """The most rows a chunk may have: ``MAX_CHUNK_ROWS``, and on a GPU what the host can take of them
        (``HOST_SHARE`` of its free memory, less ``reserved``: the result writer's buffers, for
        ``HOST_COPIES`` copies of each row). On the CPU the device memory the planner reads is the host's."""
        host_free = getattr(self.probe, "host_free_bytes", None)
        if not getattr(self.probe, "is_gpu", False) or host_free is None:
            return MAX_CHUNK_ROWS
        room = HOST_SHARE * int(host_free()) - reserved
        cap = max(1, min(MAX_CHUNK_ROWS, int(room // max(1, HOST_COPIES * self.problem.layout.row_bytes))))
        self.status.update({"host_free_bytes": int(host_free()), "host_rows_cap": cap})
        if cap < MAX_CHUNK_ROWS:
            log.info("chunks capped at %d rows by host memory (%d bytes free, %d for the writer)", cap,
                     int(host_free()), reserved)
        return cap

    # -- one chunk ------------------------------------------------------------------------------

    def call(self, label: str, start: int, n: int, k: int | None = None) -> tuple[np.ndarray, float, int, bool]:
        """Rows ``start .. start + n`` by ``label`` from a call of ``k >= n`` rows: ``(rows, seconds, peak bytes,
        first call)``. XLA runs a power-of-two ``k`` (one compile per size); surplus rows are sliced off on the
        device. Raises what the strategy raises. The call's whole time (trace, peaks) goes to the timeline, a failed
        call's too. Where its seconds decide something, the writer's queued blocks are written first."""
        if self.writer_settle is not None and self.timing_decides(label):
            self.writer_settle()
        t_call = time.perf_counter()
        k = max(n, k or n)
        if parse_label(label)[1]:
            k = bucket_rows(k)
        try:
            out = self._call(label, start, n, k)
        except BaseException:
            self.timeline.call(label, k, self.new_size, time.perf_counter() - t_call, failed=True)
            raise
        self.timeline.call(label, k, self.new_size, time.perf_counter() - t_call)
        return out

    def _call(self, label: str, start: int, n: int, k: int) -> tuple[np.ndarray, float, int, bool]:
        first = not is_compiled(self.problem, label)
        self.new_size = first or k not in self.problem.model.compiled.sizes(self.key(label))
        fn = chunk_function(self.problem, label, trace_dir=self.trace_dir)
        self.probe.before_chunk(k)
        if self.host is not None:
            self.host.before(self.plan.record(label), blind=allocator_blind(label), first=first, size=(label, k),
                             decides=self.timing_decides(label))
        self.probe.reset_peak()
        t0 = time.perf_counter()
        with tf_logs.captured(f"strategy {label}"):   # pfor's and the loop converters' dumps: one line
            out = fn(start, k)
        if k > n:
            out = out[:n]
        rows = np.asarray(out)  # a view of the tensor's buffer on the CPU: no extra copy
        seconds = time.perf_counter() - t0
        peak, record = int(self.probe.peak_bytes()), self.plan.record(label)
        if peak <= 0 and k * self.problem.layout.row_bytes >= SEEN_BYTES and not self.host_measured:
            record.peak_unseen = True  # its memory is invisible to the allocator statistics, and to /proc
        if self.host is not None:   # where the allocator misses the chunk: the process's RSS delta (host_peak)
            peak = self.host.after(record, peak, k * self.problem.layout.row_bytes)
        self.peak = max(self.peak, peak)
        self.problem.model.compiled.sizes(self.key(label)).add(k)
        self.rows_run += n
        if first and from_kept_trace(self.problem, label):
            self.kept.add(label)
        elif first:   # for later processes: they load the graph instead of tracing it
            keep_trace(self.problem, label, self.trace_dir)
        return rows, seconds, peak, first

    def timing_decides(self, label: str) -> bool:
        """Whether a call of ``label`` is timed for a decision: a trial's (both sides), a comparison of sizes under way,
        or a strategy with no ladder yet in this run (its first calls); not with a forced size. A block compressed
        by the writer's thread beside a timed call slowed it by up to 40 % on 2 cores."""
        return self.in_trial or self.chunk_rows is None and not getattr(self.ladders.get(label), "is_settled", False)

    @property
    def host_measured(self) -> bool:
        """Whether this host job measures its chunks by the process's RSS (``host_peak``): none of its memory is
        then unseen, whatever TensorFlow's CPU allocator statistics read (0, or nothing at all where they are
        off, as in a fresh TensorFlow 2.21 process); a first call, not measured, says nothing of the strategy."""
        return self.host is not None and self.host.resident.available

    def key(self, label: str) -> ChunkKey:
        name, xla = parse_label(label)
        return ChunkKey.of_problem(self.problem, name, xla)

    def eager_row(self, row: int) -> np.ndarray | None:
        """The reference for ``row``, computed by ``strategies.reference_label``'s strategy at one row."""
        if row not in self.eager_rows:
            label = strategies.reference_label(self.problem, tiled_ok=self.plan.record("tiled").status == "ok",
                                               checking=self._checking)
            t0 = time.perf_counter()
            try:
                self.eager_rows[row] = strategies.reference_row(self.problem, label, row, self.trace_dir)
            except EngineError:
                raise
            except Exception as err:  # noqa: BLE001 - no reference: rows cannot be checked
                log.info("no reference row %d (%s); rows are not checked", row, error_summary(err))
                return None
            finally:
                self.timeline.reference_s += time.perf_counter() - t0
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
        self._checking = label
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

    def ladder(self, label: str) -> Ladder:
        """This run's chunk sizes of ``label``, started from what the plan knows of it: a strategy the plan
        has timed starts at ``plan_chunk`` (its kept size, at most twice the largest size timed) and, with
        rows enough, compares that size with half of it again (where that half's first call is repaid:
        ``repays_first_call``); an untimed one starts at ``FIRST_ROWS``."""
        if label in self.ladders:
            return self.ladders[label]
        record = self.plan.record(label)
        memory = record.memory_at(self.batch)
        timed = set(record.rates)
        called = set(self.problem.model.compiled.sizes(self.key(label)))
        ladder = Ladder(size=tuning.FIRST_ROWS, by_throughput=self.throughput_cap, timed=timed, called=called,
                        host=self.host is not None, footprint=self.host.footprint if self.host else 0)
        if memory is not None and timed:
            ladder.calibrated = True
            kept = record.preferred_rows if self.throughput_cap else None
            ladder.size = plan_chunk(rows_total=self.pending, memory=memory, free_bytes=self.free_at_start,
                                     budget_bytes=self.budget, safety=SAFETY, max_rows=self.max_rows,
                                     largest_timed_rows=max(timed), preferred_rows=kept,
                                     peaks=record.peaks if record.batch in (None, self.batch) else None,
                                     seconds=record.seconds if self.throughput_cap else None)
            ladder.note_rates(record.rates)
            if kept and kept in record.rates:  # larger sizes the plan timed that did not pay are not tried again
                ladder.rejected = {k for k, r in record.rates.items()
                                   if k > kept and r < (1 + GROWTH_GAIN) * record.rates[kept]}
            if record.comparing and self.pending >= side_rows(record.comparing, called):
                ladder.resume(*record.comparing)   # before a re-check (``Ladder.recheck``)
            half = ladder.size // 2   # re-checked where its first call here is repaid (conv1d: a 1 s trace in 3 s)
            if half in timed and self.pending >= tuning.RECHECK_CHUNKS * ladder.size and self.repays_first_call(
                    label, half, called, rows_left=self.pending, rate=record.rates.get(ladder.size)):
                ladder.recheck()
        self.ladders[label] = ladder
        if ladder.calibrated and ladder.comparison is None:
            ladder.grow_first(lambda n: self.can_grow_to(label, n, self.pending))
        return ladder

    def next_rows(self, label: str, remaining: int) -> tuple[int, int, int]:
        """``(n, k, planned)``: the next chunk keeps ``n <= remaining`` rows of a call of ``k >= n``
        rows; ``planned`` is the chunk size the run keeps (the status's ``chunk_rows``; a size being
        compared with it may run in between).

        ``k > n`` only at the tail of a range, where a size already run (at most the bucket of the
        rows left) is cheaper than a new one: every new size pays a slow first call.
        """
        if self.chunk_rows is not None:
            n = max(1, min(self.chunk_rows, remaining))
            return n, n, self.chunk_rows
        cap = min(self.k_cap.get(label, self.max_rows), self.max_rows)
        ladder = self.ladder(label)
        k, planned = max(1, min(ladder.next_size(), cap)), max(1, min(ladder.size, cap))
        if remaining >= k:
            return k, k, planned
        seen = [s for s in self.problem.model.compiled.sizes(self.key(label))
                if remaining <= s <= bucket_rows(remaining)]
        return remaining, (min(seen) if seen else remaining), planned

    def can_grow_to(self, label: str, k: int, rows_left: int) -> bool:
        """Whether ``label``'s chunk may double to ``k`` rows: within the chunk cap, with rows left to measure it
        (its warm-up and a pair; one side where the request ran jobs before) and to repay a new size's first call
        (``repays_first_call``), and its predicted peak (the bound through this run's peaks and the plan's line, with
        ``FIRST_CALL_MARGIN`` for a new size's first call) under the limit. Growth stopped by the cap or by memory
        leaves the ladder calibrated; by the rows running out, not."""
        ladder, record = self.ladders[label], self.plan.record(label)
        if rows_left < (comparison_rows(k, warm=k in ladder.called, carried=self.plan.jobs > 0)
                        if self.throughput_cap else k):
            return False
        bound, memory = fit_bound(ladder.peaks), record.memory_at(self.batch)
        predicted, half = (max(bound(n), memory(n) if memory is not None else 0.0) for n in (k, k // 2))
        gain = tuning.later_jobs_gain(half, predicted, self.host.footprint if self.host else 0, host=bool(self.host))
        if not self.repays_first_call(label, k, ladder.called, rows_left=rows_left, later_s=self.plan.work_s * gain,
                                      rate=ladder.rates().get(ladder.size) or record.rates.get(ladder.size)):
            return False
        fits = (k <= min(self.k_cap.get(label, self.max_rows), self.max_rows)
                and predicted * tuning.FIRST_CALL_MARGIN <= self.usable)
        ladder.calibrated = ladder.calibrated or not fits
        return fits

    def repays_first_call(self, label: str, k: int, called: set[int], *, rows_left: int, rate: float | None,
                          later_s: float = 0.0) -> bool:
        """Whether a chunk size of ``k`` rows repays its first call here (``new_size_cost``: a compile under XLA, else
        far less than a trace) from what a doubling saves: this job's rows left (at ``rate`` rows/s) at GROWTH_GAIN,
        and ``later_s`` saved in the plan's later jobs (``can_grow_to``; ENGINE_API.md, step 3, says why they count). A
        kept size's half is re-checked in every process: this job alone. Unknown: yes."""
        record = self.plan.record(label)
        cost = new_size_cost(label, compile_s=record.compile_s, resize_s=record.resize_s)
        if not self.throughput_cap or k in called or not cost or not rate:
            return True
        return rows_left / rate * GROWTH_GAIN + later_s >= cost

    def measured(self, label: str, k: int, seconds: float, peak: int, first: bool, remaining_after: int, *,
                 warm: bool) -> None:
        """Account a chunk of ``k`` rows (``first``: the strategy's first call; ``warm``: its size had run
        before in this process): its ladder decides the next sizes, the plan keeps what it measured."""
        record = self.plan.record(label)
        if first:
            self.first_call[label] = (k, seconds)
        if self.chunk_rows is not None:
            if warm:
                old = record.rates.get(k)
                rate = k / max(seconds, 1e-9)  # a running mean: single chunks are noisy
                record.rates[k] = round(rate if old is None else 0.8 * old + 0.2 * rate, 3)
            return
        ladder = self.ladder(label)
        self.chunks_run[k] = min(self.chunks_run.get(k, ladder.largest_timed), ladder.largest_timed)
        ladder.observe(k, seconds, peak, warm=warm, sampled=not (self.host is not None and self.host.skipped),
                       can_grow_to=lambda n: self.can_grow_to(label, n, remaining_after))
        call = self.first_call.get(label)
        if call is not None and warm:   # its first size's steady seconds: scaled from this size's where it grew first
            first_s = round(max(call[1] - seconds * call[0] / k, 0.0), 3)
            if label in self.kept and record.kept_compile_s is None:
                record.kept_compile_s = first_s
            elif label not in self.kept and record.compile_s is None:
                record.compile_s = first_s
        if not first and not warm:
            self.first_at_size[(label, k)] = seconds
        elif warm and (label, k) in self.first_at_size:   # a running mean: one slow first call does not stop growth
            new, old = max(self.first_at_size.pop((label, k)) - seconds, 0.0), record.resize_s
            record.resize_s = round(new if old is None else 0.5 * (old + new), 4)
        self.settle(label)

    def settle(self, label: str) -> None:
        """Keep what this run measured of ``label`` in the plan: rates and peaks per size, the memory
        bound through every peak measured at this batch size, a time line, and the size kept."""
        ladder, record = self.ladders.get(label), self.plan.record(label)
        if ladder is None or not ladder.peaks:
            return
        for k, rate in ladder.rates().items():
            record.rates[k] = round(rate, 3)
        same = record.batch in (None, self.batch)
        peaks = dict(record.peaks) if same else {}
        for k, peak in ladder.peaks.items():
            peaks[k] = max(peaks.get(k, 0), peak)
        record.peaks, record.last_peaks = peaks, {**(record.last_peaks if same else {}), **ladder.peaks}
        # XLA on the CPU reads 0: a row costs at least its result and seed
        record.memory = fit_bound(peaks, floor_per_row=2.0 * self.problem.layout.row_bytes)
        check_one_row_fits(record.memory_at(self.batch) or record.memory, free_bytes=self.free_at_start,
                           budget_bytes=self.budget, safety=SAFETY)
        timed = sorted(k for k in record.rates if k in ladder.timed)
        if len(timed) >= 2:
            record.seconds = fit_linear(timed[-2], timed[-2] / record.rates[timed[-2]],
                                        timed[-1], timed[-1] / record.rates[timed[-1]])
        elif timed:
            record.seconds = LinearFit(0.0, 1.0 / record.rates[timed[-1]])
        if ladder.size in record.rates:
            record.preferred_rows = ladder.size
        record.batch, record.comparing = self.batch, ladder.carried_on(record.comparing)

    def shrink(self, label: str, k: int, *, oom: bool) -> int:
        """After an OOM (or a peak near the limit) at ``k`` rows: halve, and correct the memory line
        so that this and later jobs plan below ``k``. Raises MemoryBudgetTooSmall at one row."""
        if k <= 1:
            raise MemoryBudgetTooSmall("memory_budget_bytes: out of memory even at one row per chunk; free device "
                                       f"memory or raise memory_budget_bytes; {LESS_THAN_A_ROW}",
                                       field="memory_budget_bytes")
        half = k // 2
        self.k_cap[label] = half
        record = self.plan.record(label)
        if record.memory is not None:
            record.memory = self.below(record.memory, k)
        if label in self.ladders:
            self.ladders[label].cap(half)
        # What the peaks that fitted do not show, kept as a measurement: ``k`` rows need more than the limit.
        if record.batch not in (None, self.batch):
            record.peaks, record.batch = {}, self.batch
        record.peaks[k] = max(record.peaks.get(k, 0), int(1.01 * self.usable) + 1)
        if oom:
            self.status["oom_retries"] += 1
        else:
            self.status["budget_halvings"] = self.status.get("budget_halvings", 0) + 1
        log.warning("%s at %d rows; chunk halved to %d rows", "out of memory" if oom else "peak near the limit",
                    k, half)
        return half

    def below(self, memory: LinearFit, k: int) -> LinearFit:
        """``memory`` corrected so that ``k`` rows no longer fit this run's limit (nor, in the plan, a later
        job's with as much memory): ``k`` rows predict 1 % more than the limit, whatever the fixed part
        (at exactly the limit ``plan_chunk`` would take ``k`` again)."""
        return LinearFit(memory.fixed, max(memory.per_row, 1.01 * self.usable / k))

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
        ladder = self.ladders.get(label)
        new = {"strategy": label, "chunk_rows": k, "xla": parse_label(label)[1], "bytes_per_row": per_row,
               "fixed_bytes": int(memory.fixed) if memory else None,
               "rows_per_second": {str(s): r for s, r in sorted(record.rates.items())},
               "timed_rows": sorted(ladder.timed) if ladder else sorted(record.rates),
               "chunks_run": [[size, before] for size, before in sorted(self.chunks_run.items())],
               "peaks": {str(size): peak for size, peak in sorted(ladder.peaks.items())} if ladder else {}}
        changed = any(self.status.get(f) != new[f] for f in ("strategy", "chunk_rows"))
        self.status.update(new)
        if changed and self.on_plan and not final:
            self.on_plan(dict(self.status))
