"""The rules of choosing, as pure functions: a default strategy, when a trial pays, who wins one,
and how far a chunk grows while it is calibrated on the job's own rows.

- Default: on a small graph ``vectorized`` (pfor shares the forward pass between rows, and its
  trace is cheap there); on a large graph ``tiled`` where it applies (its trace is a plain
  gradient, where pfor's conversion costs ~8 ms per op: 9 s on MobileNetV3Small), else
  ``vectorized``. A similar request's last choice comes first. Failures fall through
  ``vectorized``, ``tiled``, ``loop``, ``eager`` (a pinned strategy: ``vectorized``, ``loop``, ``eager``).
  Second derivatives (Hessians) of a graph with ``While`` loops start
  with ``loop`` (``second_order_loops``): pfor cannot convert the loop's gradient (its ``TensorList``
  accumulators lack the handle data pfor needs, TensorFlow 2.21) and spends 50-70 s failing on a 6-variable
  RK4 integrator, where ``loop``'s one-row function traces in seconds and runs a row in milliseconds.
- A trial of an alternative is a rent-or-buy decision: it costs about the alternative's compile
  time and can save at most ``EXPECTED_GAIN`` of the compute still to come. It runs once
  ``EXPECTED_GAIN * (this job's remaining seconds + the seconds earlier jobs of the plan spent)``
  reaches the estimated cost, so a short job never pays for one and a repeated job pays once. The cost
  is the candidate's measured compile, else the incumbent's scaled by ``compile_factor`` (grown with the
  graph: pfor's and XLA's compiles outgrow a plain trace on large graphs) or by the factor a trial of this
  plan measured (``learned_factor``).
- A trial is decided on the job's real chunks at the size each strategy would run, interleaved
  (incumbent, candidate, incumbent, ...): the median of the paired per-row time ratios must beat
  the incumbent by ``TIE_BAND``; ties keep the incumbent.
- Per job, among the strategies a plan has verified and timed: the one that finishes this job first,
  counting a compile where this process has not compiled it; the plan's fastest strategy (the
  steady-state choice) replaces it once what renting the other has lost in this process covers the
  compile (``buy_compile``). A one-shot ``jacobian compute`` of 1000 MobileNet rows stays on ``tiled``
  (2.4 s compile) although ``vectorized`` is 1.6x faster per row (6.5 s compile); a worker switches
  after a job or two.
- Chunk sizes (``worker.engine.ladder``): from ``FIRST_ROWS``, doubling only while a doubled size,
  timed in interleaved pairs against the size it doubles on the job's own chunks, gives
  ``GROWTH_GAIN`` more rows/s (median of the pairs) and its predicted peak (the memory bound
  through the measured peaks, with ``FIRST_CALL_MARGIN``) fits the limit. A size that does not pay is
  dropped as soon as the pairs say so; no chunk is ever more than twice the largest size timed. A plan's
  kept size is compared with half of it again when a job starts with enough rows to pay for it, and, where
  half of it has not run in the process, enough to repay that size's first call (``compile_s``) at a doubling's
  gain (``ChunkRun.repays_first_call``; a doubling is held to the same).
- On a host (CPU) job growth also weighs memory and noise (``host_growth_gain``, ``host_growth_verdict``,
  ``next_doubling_gain``, below): beside two CPU hogs the 10 % rule let MobileNetV3Small grow to 128-row
  chunks, a warm process at 0.96 of the ``tape.jacobian`` script's peak RSS.
- Batch Jacobians have a third batched strategy, ``per_example`` (pfor over examples of pfor over
  features): the most expensive trace, so its trials come last.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

FIRST_ROWS = 8            # the first chunk of an uncalibrated strategy
FIRST_CALL_MARGIN = 1.25  # a new chunk size's first call can peak this much above its steady calls
RECHECK_CHUNKS = 16       # a job re-checks its plan's chunk size when it has this many chunks of it to run
EXPECTED_GAIN = 0.3       # what an alternative strategy may save, at most, as a fraction of the compute
# ``tiled`` against a ``vectorized`` whose body is inlined (``expected_gain``): with the body in the trace pfor
# shares the forward pass and converts plain ops, and ``tiled`` ran 1.5x (MobileNetV3Small) and 2.3x
# (EfficientNetB0) its seconds per row; it lost every trial (14 of 14, on five models and two VM kinds, 2026-11-28),
# each 0.1-0.4 s of a 1-3 s small-model job and 2.6-4.3 s of a large one. It is still tried, once the plan's work
# covers ten times the trial.
INLINED_TILED_GAIN = 0.1
TIE_BAND = 0.05           # a candidate must be 5 % faster per row (median of pairs) to replace the incumbent
CLEAR_LOSS = 1.5          # a candidate this many times slower per row in every pair so far has lost: no more pairs
TRIAL_PAIRS = 3           # timed (incumbent, candidate) pairs in a trial
# Compile cost of a strategy never compiled for this request, as a multiple of ``tiled``'s (a plain
# gradient's trace), on MobileNetV3Small (``REFERENCE_GRAPH_OPS`` ops): pfor converts every op of the backward
# graph (~6x a plain gradient's trace); XLA compiles the whole graph on top of that; ``per_example`` nests pfor
# in pfor (4x ``vectorized``'s trace on a 32x32 MobileNetV3Small, 2x on an MLP).
COMPILE_FACTOR = {"tiled": 1.0, "vectorized": 4.2, "tiled+xla": 4.0, "vectorized+xla": 10.0,
                  "per_example": 24.0, "per_example+xla": 28.0}
UNKNOWN_FACTOR = 4.0
# On a larger graph pfor and XLA cost much more again than a plain trace: the factor is scaled by
# ``(graph_ops / REFERENCE_GRAPH_OPS) ** exponent`` (``compile_factor``), one exponent below the reference graph
# and one above it. Measured 2026-11-26 by ``python -m bench.bench_compile`` (each strategy's first call minus
# a steady call at 8 rows, in a fresh process after a warm-up; the 2-core VM under a load of ~10-16 from other
# agents, so single figures are noisy, the growth is not):
#   model (graph_ops)          tiled s   vectorized s (x tiled)   tiled+xla s (x tiled)
#   Conv1D x3 (50)             1.3       2.5   (1.89)             1.3   (1.01)
#   MobileNetV3Small (1083)    18.0      47.4  (2.63)             14.3  (0.79)
#   EfficientNetB0 (3187)      14.9      121.4 (8.14)             382.5 (25.6)
# Above the reference: pfor's ratio grows as ops^1.05 (2.63 -> 8.14 over 2.94x the ops), XLA's as ops^3.2
# (0.79 -> 25.6); below it barely moves (pfor ops^0.1, XLA not at all). The factors keep their reference values
# (measured on a quiet machine, higher than these) and take the growth; a measured compile replaces them all.
# Re-measured 2026-11-27 (twelfth session, quiet 2-core AMD EPYC VM) once our functions were traced without
# AutoGraph (01a2c86), which had converted pfor's work too:
#   model (graph_ops)          tiled s   vectorized s (x tiled)
#   Conv1D x3 (50)             0.11      0.55  (4.89)
#   transformer (163)          0.47      1.23  (2.63)
#   MobileNetV3Small (1083)    2.04      8.42  (4.12)
#   EfficientNetB0 (3187)      2.91      12.17 (4.18)
# pfor's trace is now about 4x a plain gradient's at any size: ``vectorized`` takes 4.2 and no growth (with
# the old growth its estimate on EfficientNetB0, 78 s, kept every job from a trial of a strategy 1.8x faster
# per row there, 12 s to trace). ``per_example`` (pfor in pfor) was not re-measured and keeps the old growth.
# Where the model's body is imported into the trace (``worker.engine.inline``: reverse-mode chunks of a signature
# without loops), pfor converts the body's own ops, not a backward function of the call op: trace and first call
# at 16 rows (``python -m bench.bench_inline_trace``), MobileNetV3Small:
#   machine                        tiled s (call -> inlined)   vectorized s (call -> inlined)   inlined ratio
#   2-core AMD EPYC, AVX2          5.6 -> 3.1                  18.7 -> 6.7                      2.1
#   2-core Intel Xeon, AVX-512     6.4 -> 5.9                  23.3 -> 7.7                      1.3
# ``vectorized`` then takes INLINED_FACTOR, and goes first at any graph size (``default_order``): its steady rows/s
# were 1.5x (AVX2) and 1.7x (AVX-512) ``tiled``'s on MobileNetV3Small, and warm processes had kept it after
# trials on MobileNetV3Small and EfficientNetB0 even at its old trace cost.
INLINED_FACTOR = {"vectorized": 2.1}
REFERENCE_GRAPH_OPS = 1083   # MobileNetV3Small's signature, where COMPILE_FACTOR was measured
PFOR_EXPONENTS, XLA_EXPONENTS = (0.1, 1.05), (0.0, 3.2)   # (below, above) the reference graph
GRAPH_EXPONENT = {"vectorized": (0.0, 0.0), "per_example": PFOR_EXPONENTS, "tiled+xla": XLA_EXPONENTS,
                  "vectorized+xla": XLA_EXPONENTS, "per_example+xla": XLA_EXPONENTS}
GRAPH_SCALE_LIMITS = (0.05, 4.0)   # ops / REFERENCE_GRAPH_OPS is held within these: about the range measured
FALLBACKS = ("vectorized", "loop", "eager")
SMALL_GRAPH_OPS = 200     # up to this many ops pfor traces in about a second: start with vectorized
GROWTH_GAIN = 0.10        # a doubled chunk (twice the memory) must give 10 % more rows/s, on paired timings
HOST_MARGIN = 0.05        # a host job's doubling: rows/s per resident byte must rise this much (below)

# Growth on a host (CPU) job. Memory a chunk takes there is memory the other processes of the host do not
# get, and a loaded host's timings are noisy (under load the fixed cost of a call grows, so larger chunks
# look better and better while each doubling adds its memory to the whole process). A doubling must:
# - pay for its memory: rows/s per resident byte of the process must still rise by HOST_MARGIN, i.e. a gain
#   of (1 + HOST_MARGIN) * (1 + added) - 1, ``added`` the larger chunk's extra peak as a share of the
#   process's footprint with the smaller chunk (resident bytes at the job's start plus its peak), and at least
#   the plain GROWTH_GAIN. On MobileNetV3Small ``tiled`` (13 MiB a row in a 1.2 GiB process): 13 % from 8 to 16
#   rows, 20 % from 16 to 32, 47 % from 64 to 128; on a small model whose chunks are a sliver of the process,
#   10 % as before. (Until 2026-11-27 the margin was GROWTH_GAIN, 19 % from 8 to 16 rows: on two VM kinds the
#   cold MobileNet job's 16-row chunks ran 10-25 % faster than 8 and were kept in one job of three; the warm
#   process kept to 8 rows was 2.5 s slower, and its peak RSS was the same as with 16, 0.42 of the script's.)
# - clear the pairs' own spread: the median of the pairs' gains less half their range must reach that bar
#   (with two or three pairs about "the worst pair clears it"); noise shows up as spread and stops growth.
# - be able to pay at all: with a chunk's time ``fixed + per_row * k`` a doubling that gained ``g`` leaves
#   the next one ``g / (2 - g)`` (the fixed part's share halves; caches only make it less), so a doubling
#   whose predicted gain is under its bar is not compared: its memory is not spent on a comparison it cannot
#   win (a comparison's warm-up and pairs run the larger chunk, and the process's peak is theirs).
# GPU jobs keep the 10 % majority rule: device memory is the job's own, and the run stops where it fits.


def host_growth_gain(peak_small: float, peak_large: float, footprint: float, *, gain: float = GROWTH_GAIN,
                     margin: float = HOST_MARGIN) -> float:
    """The gain in rows/s a host job's doubling must show: ``margin`` more rows/s per resident byte with the memory
    the doubled chunk adds to the process (``footprint``: resident bytes without any chunk), and never less than
    ``gain`` (the plain rule; ``gain`` alone when the footprint is unknown, 0)."""
    if footprint <= 0:
        return gain
    added = max(peak_large - peak_small, 0.0) / (footprint + max(peak_small, 0.0))
    return max(gain, (1.0 + margin) * (1.0 + added) - 1.0)


def later_jobs_gain(peak_small: float, peak_large: float, footprint: float, *, host: bool) -> float:
    """The gain at which a plan's later jobs repay a larger chunk size's first call (``ChunkRun.repays_first_call``):
    a trial's ``EXPECTED_GAIN``; on a host job whose doubled chunk adds more than ``HOST_MARGIN`` of the process's
    resident bytes, ``GROWTH_GAIN``: the process's peak is the user's even when the size loses (MobileNetV3Small's
    second process tried 32 rows at 0.3 and its peak RSS went from 1196 to 1427 MiB, 32 rows lost)."""
    if host and (footprint <= 0 or peak_large - peak_small > HOST_MARGIN * footprint):
        return GROWTH_GAIN
    return EXPECTED_GAIN


def next_doubling_gain(last_gain: float) -> float:
    """The most the next doubling can gain after one that gained ``last_gain``, for a chunk time
    ``fixed + per_row * k`` (a measured gain of 100 % or more says nothing of the next one: 1.0)."""
    return 1.0 if last_gain >= 1.0 else max(last_gain, 0.0) / (2.0 - max(last_gain, 0.0))


def pair_gains(pairs: Iterable[tuple[float, float]]) -> list[float]:
    """Each ``(small, large)`` pair's per-row seconds as the larger size's gain in rows/s."""
    return [s / lg - 1.0 for s, lg in pairs if s > 0 and lg > 0]


def proven_gain(gains: list[float]) -> float:
    """What paired gains show beyond their noise: the median less half the range."""
    return statistics.median(gains) - (max(gains) - min(gains)) / 2 if gains else 0.0


def host_growth_verdict(pairs: list[tuple[float, float]], *, gain: float, pairs_needed: int = 3) -> bool | None:
    """A host job's doubling from interleaved ``(small, large)`` per-row seconds: True once two or more pairs
    give a median gain less half their range of at least ``gain``; False once a majority of ``pairs_needed``
    falls short of ``gain``, or all of them are in without a True; None before."""
    gains = pair_gains(pairs)
    need = pairs_needed // 2 + 1
    if sum(1 for g in gains if g < gain) >= need:
        return False
    if len(gains) >= 2 and proven_gain(gains) >= gain:
        return True
    return False if len(gains) >= pairs_needed else None


def default_order(applicable: Iterable[str], similar: str | None = None, *, graph_ops: int = 0,
                  second_order_loops: bool = False, list_loops: bool = False, inlined: bool = False) -> list[str]:
    """Strategies to start with, in order: a similar request's choice, then by graph size unless the model's body
    is ``inlined`` (``vectorized`` first: INLINED_FACTOR) or ``list_loops`` (``tiled`` first: pfor fails on the
    gradient of a loop that carries a ``TensorList``, ``strategies.pfor_fails_on_loops``) (``loop`` first for
    ``second_order_loops``: a Hessian through ``While`` loops), then the fallbacks."""
    applicable = list(applicable)
    small = (graph_ops <= SMALL_GRAPH_OPS or inlined) and not list_loops
    first = ["vectorized", "tiled"] if small else ["tiled", "vectorized"]
    first = ["loop", *first] if second_order_loops else first
    order = [s for s in ([similar] if similar else []) + first + list(FALLBACKS) if s in applicable]
    return list(dict.fromkeys(order))


def fallbacks(*, pinned: bool) -> tuple[str, ...]:
    """Where a strategy fails, the next ones in order: the other batched strategy first (pfor fails on a Keras
    LSTM's loop, where ``tiled`` ran 400 rows in a third of ``loop``'s time), then the per-row ones. A pinned
    strategy (``RunOptions.strategy``: shards compute every row alike) keeps ``FALLBACKS``."""
    return FALLBACKS if pinned else ("vectorized", "tiled", "loop", "eager")


def alternatives(applicable: Iterable[str], tried: Iterable[str], *, xla: bool) -> list[str]:
    """Candidates for a trial, in the order tried: the other batched strategy, XLA forms, then (batch
    Jacobians) ``per_example`` and its XLA form. ``maybe_trial`` runs the first whose trial pays."""
    order = ["tiled", "vectorized"] + (["tiled+xla", "vectorized+xla"] if xla else [])
    order += ["per_example"] + (["per_example+xla"] if xla else [])
    skip = set(tried)
    return [s for s in order if s in set(applicable) and s not in skip]


def compile_factor(label: str, graph_ops: int = 0, *, unknown: float = UNKNOWN_FACTOR, inlined: bool = False) -> float:
    """``label``'s compile as a multiple of ``tiled``'s on a graph of ``graph_ops`` ops (0: unknown, the
    reference graph's factor); ``unknown``: the factor of a label without one (``loop``, ``eager``); ``inlined``:
    the model's body imported into the trace (INLINED_FACTOR)."""
    if inlined and label in INLINED_FACTOR:
        return INLINED_FACTOR[label]
    base = COMPILE_FACTOR.get(label, unknown)
    if graph_ops <= 0:
        return base
    low, high = GRAPH_SCALE_LIMITS
    scale = min(max(graph_ops / REFERENCE_GRAPH_OPS, low), high)
    below, above = GRAPH_EXPONENT.get(label, (0.0, 0.0))
    return base * scale ** (above if scale >= 1.0 else below)


def _transforms(label: str) -> set[str]:
    """What makes ``label``'s compile dearer than a plain trace: ``pfor``, ``xla``, or both."""
    name, _, flag = label.partition("+")
    return ({"pfor"} if name in ("vectorized", "per_example") else set()) | ({"xla"} if flag == "xla" else set())


def learned_factor(label: str, *, graph_ops: int = 0, learned: Mapping[str, float] | None = None,
                   unknown: float = UNKNOWN_FACTOR, inlined: bool = False) -> float:
    """``label``'s factor for this request: the one a plan measured for it (``learned``: label -> measured
    factor, recorded where a trial's compile exceeded its estimate), else ``compile_factor`` scaled by the
    largest excess a plan measured for a strategy sharing one of its transforms (an XLA compile that took 3x
    its estimate makes the other XLA forms' estimates 3x too)."""
    learned = learned or {}
    if learned.get(label):
        return float(learned[label])
    factor = compile_factor(label, graph_ops, unknown=unknown, inlined=inlined)
    excess = [float(f) / compile_factor(other, graph_ops, inlined=inlined) for other, f in learned.items()
              if f and _transforms(other) & _transforms(label)]
    return factor * max([1.0, *excess])


def estimated_compile_s(candidate: str, *, known: float | None, incumbent: str, incumbent_compile_s: float,
                        graph_ops: int = 0, learned: Mapping[str, float] | None = None, inlined: bool = False) -> float:
    """Seconds to compile ``candidate``: measured before if known, else scaled from the incumbent's by
    ``learned_factor`` (the graph's size, whether the body is inlined, and what the plan measured)."""
    if known is not None:
        return known
    base = learned_factor(incumbent, graph_ops=graph_ops, learned=learned, unknown=1.0,   # loop, eager: as tiled
                          inlined=inlined)
    return incumbent_compile_s * learned_factor(candidate, graph_ops=graph_ops, learned=learned,
                                                inlined=inlined) / base


def expected_gain(candidate: str, incumbent: str, *, inlined: bool) -> float:
    """What a trial of ``candidate`` may save against ``incumbent`` (``trial_pays``): INLINED_TILED_GAIN for ``tiled``
    against an inlined ``vectorized``, else EXPECTED_GAIN."""
    if inlined and candidate == "tiled" and incumbent == "vectorized":
        return INLINED_TILED_GAIN
    return EXPECTED_GAIN


def trial_pays(*, cost_s: float, remaining_s: float, past_work_s: float, gain: float = EXPECTED_GAIN) -> bool:
    """Rent or buy: try an alternative once what it could save covers what it costs."""
    return gain * (max(remaining_s, 0.0) + max(past_work_s, 0.0)) >= cost_s


def buy_compile(*, rent_job_s: float, best_rows_s: float, compile_s: float, regret_s: float) -> bool:
    """Whether to compile the faster strategy now: once the time lost by not having it (``regret_s``,
    earlier jobs in this process, plus this job's) reaches its compile time (2-competitive)."""
    return regret_s + max(rent_job_s - best_rows_s, 0.0) >= compile_s


def clearly_loses(incumbent_s_per_row: list[float], candidate_s_per_row: list[float], *,
                  factor: float = CLEAR_LOSS) -> bool:
    """True when every pair so far has the candidate ``factor`` times slower per row: the remaining pairs could
    not make it win (noise on 2 busy cores is 5-30 %), and each costs two of its slow calls (``tiled+xla`` on
    MobileNet on an AVX2 machine: 4.1x slower, a 15 s trial for a 3 s compile)."""
    return bool(incumbent_s_per_row) and all(c >= factor * i for i, c in zip(incumbent_s_per_row,
                                                                              candidate_s_per_row))


def paired_ratios(incumbent_s_per_row: list[float], candidate_s_per_row: list[float]) -> list[float]:
    """Candidate / incumbent seconds per row of each timed pair (a pair whose incumbent read 0 is left out)."""
    return [c / i for i, c in zip(incumbent_s_per_row, candidate_s_per_row) if i > 0]


def trial_decided(incumbent_s_per_row: list[float], candidate_s_per_row: list[float], *, pairs: int = TRIAL_PAIRS,
                  tie_band: float = TIE_BAND) -> bool:
    """True when the pairs so far fix ``candidate_wins``'s verdict over ``pairs`` pairs whatever the others show: more
    than half of ``pairs`` on one side of the tie band (two of three), so the median is on that side too. The
    remaining pairs would only cost their four calls (0.8 s of a warm EfficientNetB0 process's 14 s trial)."""
    ratios = paired_ratios(incumbent_s_per_row, candidate_s_per_row)
    majority = pairs // 2 + 1
    faster = sum(r < 1.0 - tie_band for r in ratios)
    return faster >= majority or len(ratios) - faster >= majority


def candidate_wins(incumbent_s_per_row: list[float], candidate_s_per_row: list[float], *,
                   tie_band: float = TIE_BAND) -> bool:
    """True when the median of paired ratios candidate/incumbent is below ``1 - tie_band``."""
    ratios = paired_ratios(incumbent_s_per_row, candidate_s_per_row)
    return bool(ratios) and statistics.median(ratios) < 1.0 - tie_band
