"""Chunk sizes of one strategy in one run, by doubling from paired timings: pure logic, no TensorFlow.

A ladder runs one size (``size``, the best measured so far) and grows to twice that size only when a
paired, interleaved comparison on the job's own chunks shows the doubled size faster per row by
``GROWTH_GAIN`` on this machine now; a size that does not pay is dropped as soon as the pairs decide,
and the chunk goes back to the size it was compared with. No chunk it hands out is larger than twice
the largest size timed (in this run or in the plan it started from), whatever the memory line says:
a memory fit is extrapolated at most one doubling past what was measured.

- Each size's first call in a process is a warm-up (trace, allocator, oneDNN primitives): not timed.
- A size is timed only on a call that follows a call of the same size (``steady``): the call after a switch pays
  for the switch (on MobileNetV3Small's host chunks on one VM kind, 8 rows timed between 16-row calls ran 7-28 %
  slower per row than 8 rows in a row, 16 rows 1-9 %: strict alternation made every doubling look better than it
  is; another VM kind showed no penalty).
- A comparison of ``small`` and ``large = 2 * small`` times them in turn, two calls of a size at a time (small,
  small, large, large, ...: the second of each timed). Each pair gives one ratio of per-row times; the median of
  ``PAIRS`` (so: the majority, which may be known after two) decides. Load that comes and goes falls on both
  sides of a pair alike. A job too short for every pair leaves them in the plan and the next job goes on
  (``resume``); a request's job too short for even one pair times one side (a ``small`` timing then waits in the
  plan for the next job's ``large`` one), so jobs of 256 rows still compare 64 with 128 rows.
- Memory-only ladders (``by_throughput=False``) grow after one call of a size while memory allows.
- A host (CPU) job's ladder (``host``) weighs memory and noise: the bar grows with the memory a doubling
  adds to the process (``footprint``), the pairs' spread must be cleared, and a doubling the last one says
  cannot reach its bar is not compared (``worker.engine.tuning``, "Growth on a host job").
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from worker.engine import tuning
from worker.engine.tuning import GROWTH_GAIN

PAIRS = 3            # pairs in a comparison: the median decides (the majority, often known after two)


def comparison_rows(large: int, *, warm: bool = False, carried: bool = False) -> int:
    """Rows a comparison of ``large // 2`` with ``large`` needs to make progress in a job: the warm-up of
    ``large`` (unless ``warm``) and one pair (two calls of each size: the second is timed). The pairs a job leaves
    undecided are carried in the plan to the next job (``open_pairs``), so a short job's chunks still decide a
    doubling over a few jobs; ``carried`` (a request whose jobs recur): one side of a pair is progress enough
    (``side_rows``)."""
    return (0 if warm else large) + 2 * (large // 2 if carried else large // 2 + large)


def side_rows(comparing: list[Any], called: set[int]) -> int:
    """Rows a job needs to go on with a comparison carried from an earlier job (``open_pairs``): the warm-up of
    ``large`` (unless ``called``) and two calls of the side the comparison waits for (``large`` when a ``small``
    timing waiting for its partner came with it, else ``small``), the second of them timed. A request of jobs too
    short for a pair still decides a doubling, one side a job: 256-row jobs compared 64 with 128 rows over jobs."""
    small, large, _, *waiting = comparing
    return (0 if large in called else large) + 2 * (large if waiting else small)


def growth_verdict(pairs: list[tuple[float, float]], *, gain: float = GROWTH_GAIN,
                   pairs_needed: int = PAIRS) -> bool | None:
    """Whether the larger size pays, from ``(small, large)`` per-row seconds of interleaved pairs.

    True once a majority of ``pairs_needed`` pairs has ``large <= small / (1 + gain)`` (the median
    of ``pairs_needed`` ratios is then below the bar), False once a majority has not, None before.
    """
    bar = 1.0 / (1.0 + gain)
    good = sum(1 for s, lg in pairs if s > 0 and lg / s <= bar)
    bad = len(pairs) - good
    need = pairs_needed // 2 + 1
    if good >= need:
        return True
    if bad >= need:
        return False
    return None


@dataclass
class Comparison:
    """``small`` against ``large = 2 * small``, timed in interleaved pairs."""

    small: int
    large: int
    pairs: list[tuple[float, float]] = field(default_factory=list)   # per-row seconds (small, large)
    waiting: float | None = None      # the small side's timing, waiting for its large partner

    def next_size(self, called: set[int]) -> int:
        """``large``'s warm-up first (a new size's first call is not timed), then the side a pair waits for: each
        side runs until a call of it follows one of the same size (``Ladder.observe`` times only that one)."""
        if self.large not in called:
            return self.large
        return self.small if self.waiting is None else self.large


@dataclass
class Ladder:
    """The chunk sizes of one strategy in one run; ``next_size`` says what runs next, ``observe`` takes
    each chunk's timing and peak. ``timed``: sizes with a steady timing (the plan's and this run's)."""

    size: int
    by_throughput: bool = True
    timed: set[int] = field(default_factory=set)
    called: set[int] = field(default_factory=set)     # sizes already run in this process (warm)
    rejected: set[int] = field(default_factory=set)   # sizes measured not to pay (never tried again here)
    samples: dict[int, list[float]] = field(default_factory=dict)   # per-row seconds of timed calls, this run
    peaks: dict[int, int] = field(default_factory=dict)             # peak bytes per size, this run
    comparison: Comparison | None = None
    growing: bool = True
    calibrated: bool = False   # growth ended by a measurement (a verdict, memory, the cap), or the plan's was
    host: bool = False         # a host (CPU) job: growth weighs memory and the pairs' spread (tuning)
    footprint: int = 0         # host: the process's resident bytes at the job's start (0: unknown)
    last_gain: float | None = None   # host: the gain the last doubling that paid showed beyond its spread
    previous: int | None = None      # the size of the last call observed (None: none yet in this run)
    capped: int | None = None        # no chunk above this many rows (``cap``; None: not capped)

    @property
    def largest_timed(self) -> int:
        return max(self.timed, default=0)

    @property
    def is_settled(self) -> bool:
        """No comparison under way and no growth to come: the size stays for the rest of the run."""
        return self.comparison is None and not self.growing

    def next_size(self) -> int:
        """The next chunk's size: ``size``, or a side of the comparison under way."""
        if self.comparison is not None:
            return self.comparison.next_size(self.called)
        return self.size

    def recheck(self) -> None:
        """Compare ``size`` with half of it first (a size a plan kept: does it still pay here, now?), unless a
        comparison carried from an earlier job (``resume``) is under way: it goes first, or a re-check in every
        256-row job at 16 rows dropped the carried 16-vs-32 comparison in every job."""
        if self.size >= 2 and self.by_throughput and self.comparison is None:
            self.comparison = Comparison(self.size // 2, self.size)

    def resume(self, small: int, large: int, pairs: list[list[float]], waiting: float | None = None) -> None:
        """Go on with a comparison an earlier job left undecided (its pairs, and a ``small`` timing ``waiting``
        for its ``large`` partner, from the plan)."""
        if self.by_throughput and self.size == small and large == 2 * small and large not in self.rejected:
            self.comparison = Comparison(small, large, pairs=[(float(a), float(b)) for a, b in pairs],
                                         waiting=None if waiting is None else float(waiting))

    def grow_first(self, can_grow_to: Callable[[int], bool]) -> None:
        """A plan's kept size whose doubling no job has timed: compare the two from the job's first call, where
        ``can_grow_to`` allows it (the job's rows hold the larger size's warm-up and a pair, ...). Begun after
        two calls of the kept size, as ``observe`` does, a 256-row job never had the rows to compare 32 with
        64: on an H100 the MLP's request kept 32 rows or fewer, 9x slower than ``tape.batch_jacobian``."""
        nxt = 2 * self.size
        if (self.by_throughput and self.size in self.timed and nxt not in self.timed and nxt not in self.rejected
                and self.may_pay(nxt) and can_grow_to(nxt)):
            self.comparison = Comparison(self.size, nxt)

    def open_pairs(self) -> list[Any] | None:
        """The comparison under way as ``[small, large, pairs]`` for the plan, ``[small, large, pairs, waiting]``
        where a ``small`` timing waits for its partner (None: none, or nothing timed yet)."""
        c = self.comparison
        if c is None or not (c.pairs or c.waiting is not None):
            return None
        carried = [c.small, c.large, [list(p) for p in c.pairs]]
        return carried if c.waiting is None else [*carried, c.waiting]

    def carried_on(self, carried: list[Any] | None) -> list[Any] | None:
        """The comparison the plan keeps after this run: the one under way (``open_pairs``), else the one the plan
        carried (``carried``, in that form) where this run left it as it was: nothing of a comparison timed here,
        its small side kept, nothing larger timed or refused, no cap below its large side. A job too short for
        either side of a carried comparison leaves it to the next job instead of dropping it."""
        under_way = self.open_pairs()
        if under_way is not None or not carried:
            return under_way
        small, large = carried[0], carried[1]
        untouched = (self.size == small and large not in self.rejected and not any(k > small for k in self.samples)
                     and (self.capped or large) >= large)
        return carried if untouched else None

    def cap(self, rows: int) -> None:
        """No chunk above ``rows`` (out of memory at twice that, or a peak near the limit): no more growth."""
        self.capped = rows
        self.size = max(1, min(self.size, rows))
        self.comparison, self.growing, self.calibrated = None, False, True

    def observe(self, k: int, seconds: float, peak: int, *, warm: bool, can_grow_to: Callable[[int], bool],
                sampled: bool = True) -> None:
        """Take a chunk of ``k`` rows; ``warm``: its size had run before in this process (a timed call).
        ``can_grow_to(2 * size)`` says whether memory, the chunk cap and the rows left allow a doubling.
        ``sampled=False``: a settled size's chunk that ran without the host's peak reading the others had
        (``HostPeaks.skipped``): its time is faster by what that reading costs, so it is no sample."""
        self.called.add(k)
        self.peaks[k] = max(self.peaks.get(k, 0), int(peak))
        if not sampled and self.is_settled:
            self.previous = k
            return
        steady, self.previous = warm and self.previous == k, k   # timed: a warm call after one of its own size
        if not self.by_throughput:
            self.timed.add(k)     # planned by memory alone: one call of a size is all it needs
            self.samples.setdefault(k, []).append(seconds / max(k, 1))
            if k == self.size and self.growing:
                if can_grow_to(2 * k) and 2 * k not in self.rejected:
                    self.size = 2 * k
                else:
                    self.growing = False
            return
        if not steady:
            return
        per_row = seconds / max(k, 1)
        self.samples.setdefault(k, []).append(per_row)
        self.timed.add(k)
        c = self.comparison
        if c is not None and k in (c.small, c.large):
            if k == c.small:
                c.waiting = per_row
                return
            if c.waiting is None:
                return            # a large call with no small one before it: not a pair
            c.pairs.append((c.waiting, per_row))
            c.waiting = None
            verdict = self.verdict(c)
            if verdict is None:
                return
            self.comparison = None
            self.calibrated = True
            if not verdict:       # slower, or not enough faster: back to the smaller size at once
                self.size, self.growing = c.small, False
                self.rejected.add(c.large)
                return
            self.size = c.large
            self.last_gain = tuning.proven_gain(tuning.pair_gains(c.pairs))
        if self.comparison is None and self.growing and k in (self.size, self.size // 2):
            nxt = 2 * self.size
            if nxt in self.rejected or self.size not in self.timed or not can_grow_to(nxt):
                self.growing = False
            elif not self.may_pay(nxt):   # host: the last doubling's gain says this one cannot reach its bar
                self.growing, self.calibrated = False, True
            else:
                self.comparison = Comparison(self.size, nxt)

    def verdict(self, c: Comparison) -> bool | None:
        """The comparison's verdict so far: the 10 % majority rule, or on a host job ``host_growth_verdict``."""
        if not self.host:
            return growth_verdict(c.pairs)
        return tuning.host_growth_verdict(c.pairs, gain=self.required_gain(c.small, c.large), pairs_needed=PAIRS)

    def required_gain(self, small: int, large: int) -> float:
        """The gain a doubling from ``small`` to ``large`` must show (host: with the memory it adds)."""
        if not self.host:
            return GROWTH_GAIN
        return tuning.host_growth_gain(self.peaks.get(small, 0), self.predicted_peak(large), self.footprint,
                                       margin=tuning.HOST_MARGIN)

    def predicted_peak(self, k: int) -> float:
        """``k`` rows' peak: measured in this run, else the line through the two largest measured below it."""
        if k in self.peaks:
            return float(self.peaks[k])
        below = sorted(s for s in self.peaks if s < k)[-2:]
        if not below:
            return 0.0
        if len(below) == 1:
            return self.peaks[below[0]] * k / below[0]
        (a, pa), (b, pb) = ((s, self.peaks[s]) for s in below)
        return max(float(pb), pb + (pb - pa) / (b - a) * (k - b))

    def note_rates(self, rates: dict[int, float]) -> None:
        """A plan's rows/s per size: the gain of the doubling to ``size``, until this run measures one."""
        if self.size in rates and rates.get(self.size // 2):
            self.last_gain = rates[self.size] / rates[self.size // 2] - 1.0

    def may_pay(self, k: int) -> bool:
        """Host: whether a doubling to ``k`` can reach its bar, as far as the last doubling's gain tells."""
        if not self.host or self.last_gain is None:
            return True
        return tuning.next_doubling_gain(self.last_gain) >= self.required_gain(k // 2, k)

    def rates(self) -> dict[int, float]:
        """Rows/s per size timed in this run: the median of its timed calls."""
        return {k: 1.0 / statistics.median(v) for k, v in self.samples.items() if v and statistics.median(v) > 0}
