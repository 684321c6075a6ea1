"""The state of one ``run_problem`` call: chunk calls, the eager reference rows that check them, calibration
of chunk sizes on the job's own chunks, and shrinking on out-of-memory. The rules are in ``worker.engine.tuning``."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from worker.engine import tuning
from worker.engine.errors import EngineError, MemoryBudgetTooSmall
from worker.engine.memory import MemoryProbe
from worker.engine.plan import Plan, parse_label
from worker.engine.planner import LinearFit, bucket_rows, fit_linear, plan_chunk
from worker.engine.problem import Problem, error_summary
from worker.engine.strategies import ChunkKey, chunk_function, is_compiled

log = logging.getLogger(__name__)

MAX_CHUNK_ROWS = 4096
# On a GPU each chunk's rows are copied to the host (one copy, then the writer's block buffer): a chunk
# takes at most this share of the host memory free at the start, after the writer's own buffers.
HOST_SHARE = 0.5
HOST_COPIES = 2
SAFETY = 0.8   # chunks are planned to peak at no more than this share of the memory limit
# TensorFlow's CPU allocator counts allocations from about 128 KiB up (smaller ones read 0), its GPU allocator
# all of them: a chunk whose result alone is this large and whose peak reads 0 ran on memory it does not see.
SEEN_BYTES = 1 << 20


TF32_TOLERANCE = 1e-2


def _tf32_enabled() -> bool:
    tf = sys.modules.get("tensorflow")
    return bool(tf is not None and tf.config.experimental.tensor_float_32_execution_enabled())


def rows_agree(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal up to 1e-4 (1e-3 for 16-bit floats, 1e-2 with TensorFloat-32 on) of ``want``'s largest finite
    magnitude, with NaN and infinities in the same places (``tape.jacobian`` of ``sqrt`` at 0 is inf, and so
    must ours be)."""
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
    if _tf32_enabled():  # a job that asked for precision "tf32": matmul inputs carry 10 bits of mantissa
        tol = max(tol, TF32_TOLERANCE)
    return bool(np.abs(a[finite] - b[finite]).max() <= tol * scale)


@dataclass(frozen=True)
class Adjoint:
    """A JVP probe's reference: ``w = J^T u`` for a random ``u`` (``Operator._adjoint``)."""

    u: np.ndarray
    w: np.ndarray


def agrees(row: np.ndarray, seed: np.ndarray, reference: Any) -> bool:
    """A probe row against its reference: equal rows (``rows_agree``), or for an ``Adjoint`` the dot-product
    test ``u . row == w . seed`` within ``rows_agree``'s tolerance of the products' Cauchy-Schwarz bound."""
    if not isinstance(reference, Adjoint):
        return rows_agree(row, reference)
    row64, seed64 = np.asarray(row, np.float64), np.asarray(seed, np.float64)
    if not np.isfinite(row64).all():
        return False
    u, w = reference.u.astype(np.float64), reference.w.astype(np.float64)
    bound = max(float(np.linalg.norm(u) * np.linalg.norm(row64)), float(np.linalg.norm(w) * np.linalg.norm(seed64)))
    tol = 1e-3 if np.asarray(row).dtype.itemsize <= 2 else 1e-4
    return abs(float(u @ row64) - float(w @ seed64)) <= tol * max(bound, 1e-300)


@dataclass
class Calibration:
    """One strategy's chunk sizes so far in this run: calls, steady seconds and peaks per size."""

    calls: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)   # the faster of a size's timed calls
    slowest: dict[int, float] = field(default_factory=dict)   # the slower one (growth must hold for it too)
    peaks: dict[int, int] = field(default_factory=dict)
    first_call_s: float | None = None
    k: int = tuning.FIRST_ROWS
    done: bool = False
    too_big: int | None = None   # the smallest chunk that ran out of memory (or peaked near the limit)


class ChunkRun:
    """The state of one ``run_problem`` call (see that function); ``worker.engine.runner.execute`` drives it."""

    def __init__(self, problem: Problem, plan: Plan, probe: MemoryProbe, *, budget: int | None,
                 chunk_rows: int | None, throughput_cap: bool, refine: str, try_xla: bool, pinned: bool,
                 on_plan: Callable[[dict[str, Any]], None] | None, host_reserved_bytes: int = 0) -> None:
        self.problem, self.plan, self.probe = problem, plan, probe
        self.budget, self.chunk_rows, self.throughput_cap = budget, chunk_rows, throughput_cap
        self.refine, self.pinned, self.on_plan = refine, pinned, on_plan
        self.free_at_start = int(probe.free_bytes())
        self.limit = self.free_at_start if budget is None else min(self.free_at_start, budget)
        self.usable = SAFETY * self.limit
        # XLA's memory is invisible to TensorFlow's allocator statistics on the CPU: no XLA under a budget there.
        self.try_xla = try_xla and (budget is None or getattr(probe, "is_gpu", False))
        self.batch = problem.of_shape[0] if problem.spec.batch_axis and problem.of_shape else None
        self.cal: dict[str, Calibration] = {}
        self.rows_run = 0
        self.pending = problem.rows_total
        self.k_cap: dict[str, int] = {}
        self.failures: dict[str, str] = {}
        self.eager_rows: dict[int, np.ndarray] = {}
        self.last: tuple[int, np.ndarray, str, int] | None = None   # start, rows, label, peak
        self.last_peak = 0
        self.delivered: list[tuple[int, int, str]] = []   # (start, stop, label) of each chunk handed on
        self.wrong_delivered: list[tuple[int, int]] = []  # rows handed on by a strategy later found wrong
        self._tiled_running = False
        self.peak = 0
        self.status: dict[str, Any] = {
            "chunk_rows": None, "strategy": plan.strategy, "mode": problem.mode,
            "free_bytes_at_start": self.free_at_start, "bytes_per_row": None, "fixed_bytes": None,
            "oom_retries": 0, "xla": parse_label(plan.strategy)[1], "source": plan.source,
            "plan_key": plan.key.digest if plan.key else None, "trial": None}
        self.max_rows = self._host_rows_cap(host_reserved_bytes)

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
        if peak <= 0 and k * self.problem.layout.row_bytes >= SEEN_BYTES:
            self.plan.record(label).peak_unseen = True  # its memory is invisible to the allocator statistics
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
        cap = min(self.k_cap.get(label, self.max_rows), self.max_rows)
        cal = self.cal.setdefault(label, Calibration())
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
                           budget_bytes=self.budget, safety=SAFETY, max_rows=self.max_rows,
                           seconds=record.seconds if self.throughput_cap else None,
                           preferred_rows=record.preferred_rows if self.throughput_cap else None)
            k = max(1, min(k, cap))
        if remaining >= k:
            return k, k, k
        seen = [s for s in self.problem.model.compiled.sizes(self.key(label))
                if remaining <= s <= bucket_rows(remaining)]
        return remaining, (min(seen) if seen else remaining), k

    def measured(self, label: str, k: int, seconds: float, peak: int, first: bool, remaining_after: int) -> None:
        """Account a chunk of ``k`` rows; grow or settle the chunk of a calibrating strategy."""
        cal = self.cal.setdefault(label, Calibration())
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
            cal.slowest[k] = max(seconds, cal.slowest.get(k, seconds))
            if cal.calls[k] < 1 + tuning.TIMED_CALLS:
                record.rates[k] = round(k / max(cal.seconds[k], 1e-9), 3)
                return
        else:  # planned by memory alone: the first call's peak (the higher one) is all it needs
            cal.seconds[k] = seconds
        record.rates[k] = round(k / max(cal.seconds[k], 1e-9), 3)
        if cal.first_call_s is not None and record.compile_s is None and k == min(cal.seconds):
            record.compile_s = round(max(cal.first_call_s - seconds, 0.0), 3)
        # A doubling must pay even on the slower timed call of this size: judged on the faster one, a
        # cold MobileNet job on the shared 2-core VM grew its chunks to 64 rows (0.7 of the peer's
        # peak RSS) and kept 32, no faster than 16.
        grow = tuning.keep_growing({**cal.seconds, k: cal.slowest.get(k, cal.seconds[k])}, k,
                                   peak_bytes=cal.peaks[k], usable_bytes=self.usable,
                                   max_rows=min(self.k_cap.get(label, self.max_rows), self.max_rows),
                                   by_throughput=self.throughput_cap)
        if grow and remaining_after >= 2 * k:
            cal.k = 2 * k
            return
        self.settle(label)

    def settle_unfinished(self) -> None:
        """At the end of a whole job: settle every calibration the job's rows ran out on, from the sizes
        it timed, so that the next job plans from them (and may run a trial) instead of calibrating from
        the start again: repeated jobs smaller than a calibration would otherwise never settle. Not for
        part of a job (a shard, a resumed job, the job planner's first block): the job's own rows would
        then run at the few sizes a part had time to reach."""
        if self.pending != self.problem.rows_total:
            return
        for label, cal in self.cal.items():
            if not cal.done and cal.seconds and self.plan.record(label).status == "ok":
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
        per_row = max(memory.per_row, floor)
        for k, peak in cal.peaks.items():  # a size with only its first call (not timed) peaked too
            if k not in cal.seconds and memory.fixed + per_row * k < peak:
                per_row = (peak - memory.fixed) / k
        record.memory = LinearFit(memory.fixed, per_row)
        if cal.too_big is not None:  # what the sizes that fitted do not show: the one that did not
            record.memory = self.below(record.memory, cal.too_big)
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
            record.memory = self.below(record.memory, k)
        cal = self.cal.setdefault(label, Calibration())
        cal.k = min(cal.k, half)
        cal.too_big = k if cal.too_big is None else min(cal.too_big, k)  # for the fit of a calibration under way
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
        new = {"strategy": label, "chunk_rows": k, "xla": parse_label(label)[1], "bytes_per_row": per_row,
               "fixed_bytes": int(memory.fixed) if memory else None,
               "rows_per_second": {str(s): r for s, r in sorted(record.rates.items())}}
        changed = any(self.status.get(f) != new[f] for f in ("strategy", "chunk_rows"))
        self.status.update(new)
        if changed and self.on_plan and not final:
            self.on_plan(dict(self.status))
