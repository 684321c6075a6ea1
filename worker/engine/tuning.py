"""The rules of choosing, as pure functions: a default strategy, when a trial pays, who wins one,
and how far a chunk grows while it is calibrated on the job's own rows.

- Default: on a small graph ``vectorized`` (pfor shares the forward pass between rows, and its
  trace is cheap there); on a large graph ``tiled`` where it applies (its trace is a plain
  gradient, where pfor's conversion costs ~8 ms per op: 9 s on MobileNetV3Small), else
  ``vectorized``. A similar request's last choice comes first. Failures fall through
  ``vectorized``, ``loop``, ``eager``.
- A trial of an alternative is a rent-or-buy decision: it costs about the alternative's compile
  time and can save at most ``EXPECTED_GAIN`` of the compute still to come. It runs once
  ``EXPECTED_GAIN * (this job's remaining seconds + the seconds earlier jobs of the plan spent)``
  reaches the estimated cost, so a short job never pays for one and a repeated job pays once.
- A trial is decided on the job's real chunks at the size each strategy would run, interleaved
  (incumbent, candidate, incumbent, ...): the median of the paired per-row time ratios must beat
  the incumbent by ``TIE_BAND``; ties keep the incumbent.
- Per job, among the strategies a plan has verified and timed: the one that finishes this job first,
  counting a compile where this process has not compiled it; the plan's fastest strategy (the
  steady-state choice) replaces it once what renting the other has lost in this process covers the
  compile (``buy_compile``). A one-shot ``jacobian compute`` of 1000 MobileNet rows stays on ``tiled``
  (2.4 s compile) although ``vectorized`` is 1.6x faster per row (6.5 s compile); a worker switches
  after a job or two.
- Calibration: each chunk size runs three times (the first call of a size is slower: allocator and
  oneDNN primitives; the faster of the next two counts), growing by doubling from ``FIRST_ROWS`` while rows/s improve by
  ``MIN_GROWTH_GAIN`` (measured on the slower of the new size's timed calls, and predicted for the
  next size) and the measured peak, doubled
  with a margin, still fits the memory limit. The chunk kept is the largest within ``FAST_ENOUGH``
  of the best rows/s, so calibration rarely peaks above the job's own chunks, and never above the
  limit. A job whose rows run out first settles on the sizes it timed (``ChunkRun.settle_unfinished``).
- Batch Jacobians have a third batched strategy, ``per_example`` (pfor over examples of pfor over
  features): the most expensive trace, so its trials come last.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

FIRST_ROWS = 8            # the first chunk of an uncalibrated strategy
TIMED_CALLS = 2           # steady calls timed per calibrated size (the faster counts: single timings are noisy)
MIN_GROWTH_GAIN = 0.15    # a doubled chunk (twice the memory) must be this much faster per row to keep growing
FIRST_CALL_MARGIN = 1.25  # a new chunk size's first call can peak this much above its steady calls
FAST_ENOUGH = 0.95        # the preferred chunk: the smallest within 5 % of the best rows/s measured
EXPECTED_GAIN = 0.3       # what an alternative strategy may save, at most, as a fraction of the compute
TIE_BAND = 0.05           # a candidate must be 5 % faster per row (median of pairs) to replace the incumbent
TRIAL_PAIRS = 3           # timed (incumbent, candidate) pairs in a trial
# Compile cost of a strategy never compiled for this request, as a multiple of the incumbent's
# measured compile: pfor converts every op of the backward graph (~6x a plain gradient's trace
# on MobileNetV3Small); XLA compiles the whole graph on top of that; ``per_example`` nests pfor in
# pfor (4x ``vectorized``'s trace on a 32x32 MobileNetV3Small, 2x on an MLP).
COMPILE_FACTOR = {"tiled": 1.0, "vectorized": 6.0, "tiled+xla": 4.0, "vectorized+xla": 10.0,
                  "per_example": 24.0, "per_example+xla": 28.0}
FALLBACKS = ("vectorized", "loop", "eager")
SMALL_GRAPH_OPS = 200     # up to this many ops pfor traces in about a second: start with vectorized


def default_order(applicable: Iterable[str], similar: str | None = None, *, graph_ops: int = 0) -> list[str]:
    """Strategies to start with, in order: a similar request's choice, then by graph size, then the fallbacks."""
    applicable = list(applicable)
    first = ["vectorized", "tiled"] if graph_ops <= SMALL_GRAPH_OPS else ["tiled", "vectorized"]
    order = [s for s in ([similar] if similar else []) + first + list(FALLBACKS) if s in applicable]
    return list(dict.fromkeys(order))


def alternatives(applicable: Iterable[str], tried: Iterable[str], *, xla: bool) -> list[str]:
    """Candidates for a trial, in the order tried: the other batched strategy, XLA forms, then (batch
    Jacobians) ``per_example`` and its XLA form. ``maybe_trial`` runs the first whose trial pays."""
    order = ["tiled", "vectorized"] + (["tiled+xla", "vectorized+xla"] if xla else [])
    order += ["per_example"] + (["per_example+xla"] if xla else [])
    skip = set(tried)
    return [s for s in order if s in set(applicable) and s not in skip]


def estimated_compile_s(candidate: str, *, known: float | None, incumbent: str, incumbent_compile_s: float) -> float:
    """Seconds to compile ``candidate``: measured before if known, else scaled from the incumbent's."""
    if known is not None:
        return known
    base = COMPILE_FACTOR.get(incumbent, 1.0)
    return incumbent_compile_s * COMPILE_FACTOR.get(candidate, 4.0) / base


def trial_pays(*, cost_s: float, remaining_s: float, past_work_s: float, gain: float = EXPECTED_GAIN) -> bool:
    """Rent or buy: try an alternative once what it could save covers what it costs."""
    return gain * (max(remaining_s, 0.0) + max(past_work_s, 0.0)) >= cost_s


def buy_compile(*, rent_job_s: float, best_rows_s: float, compile_s: float, regret_s: float) -> bool:
    """Whether to compile the faster strategy now: once the time lost by not having it (``regret_s``,
    earlier jobs in this process, plus this job's) reaches its compile time (2-competitive)."""
    return regret_s + max(rent_job_s - best_rows_s, 0.0) >= compile_s


def candidate_wins(incumbent_s_per_row: list[float], candidate_s_per_row: list[float], *,
                   tie_band: float = TIE_BAND) -> bool:
    """True when the median of paired ratios candidate/incumbent is below ``1 - tie_band``."""
    ratios = [c / i for i, c in zip(incumbent_s_per_row, candidate_s_per_row) if i > 0]
    return bool(ratios) and statistics.median(ratios) < 1.0 - tie_band


def keep_growing(seconds: dict[int, float], k: int, *, peak_bytes: int, usable_bytes: float, max_rows: int,
                 by_throughput: bool = True) -> bool:
    """Whether calibration should try ``2k`` after timing ``k`` (``seconds``: steady seconds per size).

    Memory: the measured peak doubled, with ``FIRST_CALL_MARGIN`` for a new size's first call, must
    fit. Throughput (``by_throughput``): the last doubling bought ``MIN_GROWTH_GAIN`` rows/s, and the
    time line through the last two sizes predicts the next one will too.
    """
    if 2 * k > max_rows or 2 * peak_bytes * FIRST_CALL_MARGIN > usable_bytes:
        return False
    if not by_throughput:
        return True
    smaller = [s for s in seconds if s < k]
    if not smaller:
        return True
    j = max(smaller)
    if k / seconds[k] < (1.0 + MIN_GROWTH_GAIN) * (j / seconds[j]):
        return False
    per_row = (seconds[k] - seconds[j]) / (k - j)
    fixed = seconds[k] - per_row * k
    if per_row <= 0:
        return True
    predicted_gain = (2 * k / (fixed + 2 * per_row * k)) / (k / seconds[k]) - 1.0
    return predicted_gain >= MIN_GROWTH_GAIN


def preferred_rows(rates: dict[int, float]) -> int | None:
    """The largest measured chunk within ``FAST_ENOUGH`` of the best rows/s (calibration has already
    paid its memory, so the largest near-best size costs no more and exploration stays below it)."""
    if not rates:
        return None
    best = max(rates.values())
    return max(k for k, r in rates.items() if r >= FAST_ENOUGH * best)
