"""Chunk sizes grown on paired timings (worker.engine.ladder): fake timings and peaks, no TensorFlow."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tests.ladder_drive import drive
from worker.engine.ladder import GROWTH_GAIN, Ladder, growth_verdict


def rates(table: dict[int, float]) -> Callable[[int, int], float]:
    """Seconds of a chunk of ``k`` rows at ``table[k]`` rows/s (sizes not listed: as fast as the largest)."""
    return lambda k, i: k / table.get(k, table[max(table)])


def test_a_size_that_is_slower_is_abandoned_at_once():
    """The issue's second machine: 8 rows at 48.9 rows/s, 16 at 39.4. 16 runs its warm-up and the two pairs
    that decide (two calls of a size at a time, the second timed), then never again; the job goes on at 8."""
    ladder = Ladder(size=8)
    sizes = drive(ladder, rates({8: 48.9, 16: 39.4}), 40)
    assert sizes[:11] == [8, 8, 16, 8, 8, 16, 16, 8, 8, 16, 16] and sizes.count(16) == 5, sizes
    assert set(sizes[11:]) == {8} and ladder.size == 8 and ladder.is_settled and 16 in ladder.rejected


def test_a_call_after_a_switch_of_size_is_not_timed():
    """16 rows are no faster per row than 8, but a call that follows a call of another size pays 40 ms more (a
    switch: buffers of another size, caches): in strict alternation 8 rows looked 24 % slower per row and the
    ladder grew. Timed only after a call of their own size, the sizes are equal: no growth."""
    last: list[int] = []

    def switching(k: int, i: int) -> float:
        switched = bool(last) and last[-1] != k
        last.append(k)
        return k / 100.0 + (0.04 if switched else 0.0)

    ladder = Ladder(size=8)
    sizes = drive(ladder, switching, 30)
    assert ladder.size == 8 and ladder.is_settled and 16 in ladder.rejected and sizes[-10:] == [8] * 10, sizes
    assert ladder.rates() == {8: pytest.approx(100.0), 16: pytest.approx(100.0)}


def test_a_flat_throughput_curve_stops_growth():
    """8 rows at 23 rows/s and 16 at 25 (9 % more, under the 10 % bar): no growth past 8."""
    ladder = Ladder(size=8)
    drive(ladder, rates({8: 23.0, 16: 25.0}), 30)
    assert ladder.size == 8 and ladder.is_settled
    # a fixed cost per call, 0.1 s + 1 ms a row: doubling pays (>= 10 %) up to 256 -> 512, not 512 -> 1024
    ladder = Ladder(size=8)
    sizes = drive(ladder, lambda k, i: 0.1 + 0.001 * k, 80)
    assert ladder.size == 512 and max(sizes) == 1024 and ladder.is_settled, sizes
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:]) if b > a), sizes


def test_growth_never_passes_twice_the_largest_size_timed():
    """Always faster when larger, memory unbounded: each new size is one doubling past one already timed,
    and growth stops where memory says (can_grow_to)."""
    ladder = Ladder(size=8)
    sizes = drive(ladder, lambda k, i: 1.0, 60, can_grow_to=lambda k: k <= 256)
    assert ladder.size == 256 and max(sizes) == 256, sizes
    # from a plan that timed up to 64: the ladder starts at 128 at most, never at the job's bucket
    ladder = Ladder(size=128, timed={8, 16, 32, 64})
    drive(ladder, lambda k, i: 1.0, 30)


def test_paired_timings_see_through_a_load_that_comes_and_goes():
    """16 rows are truly 25 % faster per row than 8. A CPU hog doubles every call's time from the fifth call
    on: timed one after the other (8 before, 16 after) 16 would look slower; in pairs it wins."""
    truth = {8: 100.0, 16: 125.0 * 2}   # rows/s

    def loaded(k: int, i: int) -> float:
        return k / truth[k] * (2.0 if i >= 4 else 1.0)

    ladder = Ladder(size=8)
    drive(ladder, loaded, 12, can_grow_to=lambda k: k <= 16)
    assert ladder.size == 16, ladder
    # one lucky fast call of the larger size does not make it win: the median of the pairs decides
    assert growth_verdict([(1.0, 0.6), (1.0, 1.0), (1.0, 1.0)]) is False
    assert growth_verdict([(1.0, 0.6), (1.0, 1.0)]) is None
    assert growth_verdict([(1.0, 0.8), (1.0, 0.85)]) is True
    assert growth_verdict([(1.0, 1.0 / (1 + GROWTH_GAIN) + 1e-9), (1.0, 0.5), (1.0, 0.5)]) is True


@pytest.mark.parametrize("gain,grows", [(0.30, True), (0.0, False)])
def test_decisions_hold_under_random_noise(gain, grows):
    """5 % noise on every call (lognormal): a true 30 % gain grows and no gain does not, on at least 96 of
    100 seeds; one timing of each size (what calibration decided on before) errs several times as often."""
    wrong = single_wrong = 0
    for seed in range(100):
        rng = random.Random(seed)

        def noisy(k: int, i: int, rng: random.Random = rng) -> float:
            return k / (100.0 * (1 + gain) ** (k > 8)) * rng.lognormvariate(0, 0.05)

        ladder = Ladder(size=8)
        drive(ladder, noisy, 12, can_grow_to=lambda k: k <= 16)
        wrong += (ladder.size == 16) is not grows
        single = noisy(16, 0) / 16 <= noisy(8, 0) / 8 / (1 + GROWTH_GAIN)
        single_wrong += single is not grows
    assert wrong <= 4 and single_wrong >= 2 * wrong, (wrong, single_wrong)


def test_a_kept_size_is_checked_again_against_half_of_it():
    """A plan kept 32 rows; on this machine now 32 is no faster than 16: the job goes back to 16."""
    ladder = Ladder(size=32, timed={8, 16, 32})
    ladder.recheck()
    sizes = drive(ladder, rates({16: 50.0, 32: 50.0}), 20)
    assert ladder.size == 16 and set(sizes[-10:]) == {16} and max(sizes) == 32, sizes
    ladder = Ladder(size=32, timed={8, 16, 32})   # where it still pays, it stays, then tries 64
    ladder.recheck()
    sizes = drive(ladder, rates({16: 50.0, 32: 80.0, 64: 82.0}), 30)
    assert ladder.size == 32 and 64 in ladder.rejected and set(sizes[-10:]) == {32}, sizes


def test_memory_only_ladders_grow_after_one_call_per_size():
    ladder = Ladder(size=8, by_throughput=False)
    sizes = drive(ladder, lambda k, i: 1.0, 8, can_grow_to=lambda k: k <= 64)
    assert sizes == [8, 16, 32, 64, 64, 64, 64, 64] and ladder.is_settled
    ladder.cap(16)   # out of memory above 16: no growth again
    assert ladder.next_size() == 16 and ladder.is_settled


def test_a_comparison_too_long_for_one_job_goes_on_in_the_next():
    """A short job runs one pair of 32 against 64 and ends; the pair travels in the plan (``open_pairs`` ->
    ``StrategyRecord.comparing``, JSON and back) and the next job's ladder resumes it: one more pair decides."""
    from worker.engine.plan import StrategyRecord

    first = Ladder(size=32, timed={32}, called={32})
    first.comparison = None
    for _ in range(2):   # the job's first call is not timed (nothing of its size ran before it in the job)
        first.observe(32, 32 / 100.0, 1, warm=True, can_grow_to=lambda k: True)   # the second opens 32 vs 64
    assert first.comparison is not None and (first.comparison.small, first.comparison.large) == (32, 64)
    drive(first, rates({32: 100.0, 64: 150.0}), 5)    # 64's warm-up, then 32, 32 and 64, 64: one pair
    assert first.size == 32 and len(first.comparison.pairs) == 1
    record = StrategyRecord(comparing=first.open_pairs())
    carried = StrategyRecord.from_json(record.to_json()).comparing
    assert carried == [32, 64, [list(first.comparison.pairs[0])]]

    second = Ladder(size=32, timed={32, 64}, called={32, 64})
    second.resume(*carried)
    drive(second, rates({32: 100.0, 64: 150.0}), 4)    # 32, 32, 64, 64: the second pair, a majority of three
    assert second.size == 64
    assert StrategyRecord.from_json({"comparing": ["x", 2]}).comparing is None   # a damaged entry: ignored


def test_a_kept_size_whose_doubling_no_job_timed_is_compared_from_the_first_call():
    """``grow_first``: begun after two calls of the kept size, a 256-row job never had the rows for 32 against
    64 (the larger size's warm-up and a pair: 256 rows), so a request of 256-row jobs kept 32-row chunks."""
    asked = []
    ladder = Ladder(size=32, timed={16, 32}, called={16, 32})
    ladder.grow_first(lambda n: asked.append(n) or True)
    assert asked == [64] and ladder.comparison is not None
    assert (ladder.comparison.small, ladder.comparison.large, ladder.next_size()) == (32, 64, 64)


@pytest.mark.parametrize("why", ["the job's rows or memory", "timed before", "rejected", "size untimed", "memory"])
def test_a_doubling_is_not_begun_first_where_it_cannot_or_need_not_be(why):
    ladder = Ladder(size=32, timed={16, 32}, called={16, 32}, by_throughput=why != "memory")
    if why == "timed before":
        ladder.timed.add(64)
    if why == "rejected":
        ladder.rejected.add(64)
    if why == "size untimed":
        ladder.timed.discard(32)
    ladder.grow_first(lambda n: why != "the job's rows or memory")
    assert ladder.comparison is None


def test_a_job_with_rows_for_one_side_carries_its_timing_to_the_next():
    """A 256-row job times 64 rows (after 128's warm-up) and ends; the timing waits in the plan for its partner
    (``[small, large, pairs, waiting]``), which the next job's 128-row calls give: a pair over two jobs."""
    from worker.engine.ladder import side_rows
    from worker.engine.plan import StrategyRecord

    first = Ladder(size=64, timed={32, 64}, called={32, 64})
    first.grow_first(lambda n: True)
    assert drive(first, rates({64: 100.0, 128: 150.0}), 3) == [128, 64, 64]   # 256 rows
    carried = StrategyRecord.from_json(StrategyRecord(comparing=first.open_pairs()).to_json()).comparing
    assert carried == [64, 128, [], pytest.approx(1 / 100.0)]   # per-row seconds of 64 rows
    assert side_rows(carried, {64, 128}) == 256 and side_rows([64, 128, []], {64}) == 128 + 128

    second = Ladder(size=64, timed={32, 64}, called={32, 64, 128})
    second.resume(*carried)
    second.recheck()   # a plan's re-check of 32 against 64 waits: the carried comparison goes first
    assert (second.comparison.small, second.comparison.large) == (64, 128)
    assert drive(second, rates({64: 100.0, 128: 150.0}), 2) == [128, 128]   # the job's first call is not timed
    assert second.open_pairs() == [64, 128, [[pytest.approx(1 / 100.0), pytest.approx(1 / 150.0)]]]


def test_a_job_too_short_for_either_side_leaves_the_carried_comparison_to_the_next():
    """A plan carries 64 against 128 with a 64-row timing waiting; a 128-row job of the request (a shard, a
    smaller request) has rows for neither side and runs 64 rows as before: the comparison stays in the plan for
    the next job. Before, the job's settle wrote its own (no) comparison over it, and it began again."""
    carried = [64, 128, [], 0.01]
    short = Ladder(size=64, timed={32, 64}, called={32, 64})
    assert drive(short, rates({64: 100.0}), 2) == [64, 64]
    assert short.open_pairs() is None and short.carried_on(carried) == carried
    assert short.carried_on(None) is None
    # it is dropped once the run has decided otherwise: a size kept other than its small side, its large side
    # timed or refused, or a cap below its large side
    moved = Ladder(size=32, timed={32, 64}, called={32, 64})
    assert moved.carried_on(carried) is None
    grown = Ladder(size=64, timed={32, 64}, called={32, 64}, samples={128: [0.01]})
    assert grown.carried_on(carried) is None
    refused = Ladder(size=64, timed={32, 64}, called={32, 64}, rejected={128})
    assert refused.carried_on(carried) is None
    capped = Ladder(size=64, timed={32, 64}, called={32, 64})
    capped.cap(64)
    assert capped.carried_on(carried) is None
    # a comparison under way is what the plan keeps
    going = Ladder(size=64, timed={32, 64}, called={32, 64, 128})
    going.resume(*carried)
    assert going.carried_on(carried) == carried and going.carried_on(None) == carried
