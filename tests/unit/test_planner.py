"""The chunk planner as pure logic: injected memory readings, no TensorFlow."""

from __future__ import annotations

import pytest

from worker.engine.errors import MemoryBudgetTooSmall
from worker.engine.planner import LinearFit, bucket_rows, fit_bound, fit_linear, plan_chunk


def by_memory(**kw) -> int:
    """``plan_chunk`` with a largest timed size that caps nothing: tests of the memory rules."""
    return plan_chunk(largest_timed_rows=1 << 20, **kw)


def test_fit_linear_recovers_a_line():
    fit = fit_linear(2, 1000 + 2 * 300, 8, 1000 + 8 * 300)
    assert fit.fixed == pytest.approx(1000) and fit.per_row == pytest.approx(300)


def test_fit_linear_never_negative():
    fit = fit_linear(2, 5000, 8, 4000)  # noisy: the bigger chunk measured less
    assert fit.per_row > 0 and fit.fixed >= 0


def test_bucket_rows():
    assert [bucket_rows(n) for n in (1, 2, 3, 5, 8, 9, 1000)] == [1, 2, 4, 8, 8, 16, 1024]


def test_largest_power_of_two_that_fits_free_memory():
    mem = LinearFit(fixed=100, per_row=10)
    # usable = 0.8 * 1000 = 800 -> 100 + 10k <= 800 -> k <= 70 -> 64
    assert by_memory(rows_total=10_000, memory=mem, free_bytes=1000) == 64


def test_budget_caps_free_memory():
    mem = LinearFit(fixed=100, per_row=10)
    assert by_memory(rows_total=10_000, memory=mem, free_bytes=10**9, budget_bytes=500) == 16  # 0.8*500=400 -> 30


def test_never_more_than_the_bucket_of_the_rows():
    """A chunk is a power-of-two bucket (one compiled function serves many sizes): all the rows of a
    small job fit in one chunk padded to their bucket, never in a larger one."""
    mem = LinearFit(fixed=0, per_row=1)
    for rows in (1, 3, 5, 8, 9, 31, 33):
        chunk = by_memory(rows_total=rows, memory=mem, free_bytes=10**12)
        assert chunk == bucket_rows(rows), (rows, chunk)
        assert rows <= chunk < 2 * rows


def test_less_free_memory_shrinks_the_chunk():
    mem = LinearFit(fixed=1 << 20, per_row=1 << 20)
    chunks = [by_memory(rows_total=4096, memory=mem, free_bytes=free << 20) for free in (4000, 1000, 100, 10)]
    assert chunks == sorted(chunks, reverse=True) and chunks[0] > chunks[-1] >= 1


def test_one_row_must_fit():
    with pytest.raises(MemoryBudgetTooSmall, match="memory_budget_bytes.*at least") as info:
        by_memory(rows_total=100, memory=LinearFit(0, 1000), free_bytes=10**9, budget_bytes=500)
    assert info.value.field == "memory_budget_bytes"


def test_throughput_plateau_stops_growth():
    # 10 ms fixed per call, 1 ms per row: 90 % of the attainable rows/s at k = 9 * 10 = 90 -> 128
    secs = LinearFit(fixed=0.010, per_row=0.001)
    k = by_memory(rows_total=100_000, memory=LinearFit(0, 1), free_bytes=10**6, seconds=secs, throughput_fraction=0.9)
    assert k == 128


def test_effective_budget_is_the_tighter_cap():
    from worker.inputs import effective_budget

    assert effective_budget(None, None) is None
    assert effective_budget(100, None) == 100
    assert effective_budget(None, 50) == 50
    assert effective_budget(100, 50) == 50 and effective_budget(10, 50) == 10


def test_a_fit_without_fixed_cost_does_not_shrink_chunks_to_one_row():
    k = by_memory(rows_total=10_000, memory=LinearFit(0, 1), free_bytes=10**5, seconds=LinearFit(0.0, 0.01))
    assert k == 32


def test_memory_still_wins_over_the_throughput_floor():
    k = by_memory(rows_total=10_000, memory=LinearFit(0, 100), free_bytes=1000, seconds=LinearFit(0.0, 0.01))
    assert k == 8


def test_a_measured_sweet_spot_caps_the_chunk():
    k = by_memory(rows_total=10_000, memory=LinearFit(0, 1), free_bytes=10**5, seconds=LinearFit(1.0, 0.001),
                   preferred_rows=32)
    assert k == 32


def test_never_more_than_twice_the_largest_size_timed():
    """The issue's case: calibrated at 8 and 16 rows, 1000 rows to go, memory for all of them: the chunk is
    at most 32 rows (one doubling past what was measured), never the 1024-row bucket of the job."""
    mem = LinearFit(fixed=0, per_row=1)
    for timed in (1, 8, 16, 100, 512):
        k = plan_chunk(rows_total=1000, memory=mem, free_bytes=10**12, largest_timed_rows=timed)
        largest_power_of_two = 1 << ((2 * timed).bit_length() - 1)
        assert k <= 2 * timed and k == min(1024, largest_power_of_two), (timed, k)
    assert plan_chunk(rows_total=1000, memory=mem, free_bytes=10**12, largest_timed_rows=16, preferred_rows=8) == 8


def test_the_memory_bound_covers_every_measured_peak():
    import random

    rng = random.Random(0)
    for _ in range(200):
        sizes = sorted(rng.sample([1, 2, 4, 8, 16, 32, 64, 128, 256], rng.randint(1, 5)))
        peaks = {k: rng.uniform(0, 1e6) + rng.uniform(0, 1e4) * k for k in sizes}
        bound = fit_bound(peaks)
        assert bound.fixed >= 0 and bound.per_row >= 0
        assert all(bound(k) >= peaks[k] * (1 - 1e-12) for k in sizes), (peaks, bound)
        # beyond the largest size it grows at least as steeply as any measured step
        steps = [(peaks[b] - peaks[a]) / (b - a) for a, b in zip(sizes, sizes[1:])]
        assert all(bound.per_row >= s for s in steps)


def test_the_memory_bound_is_above_an_average_fit():
    """Peaks 1.0, 1.5 and 4.0 MB at 8, 16 and 32 rows (a step the line through 8 and 16 misses): the bound
    predicts at least 4.0 MB at 32 rows and twice the steepest step past it."""
    peaks = {8: 1.0e6, 16: 1.5e6, 32: 4.0e6}
    bound = fit_bound(peaks)
    assert bound(32) >= 4.0e6 and bound.per_row == (4.0e6 - 1.5e6) / 16
    assert fit_linear(8, 1.0e6, 16, 1.5e6)(32) < 4.0e6   # what the line through two points said
    assert fit_bound({16: 1600.0}) == LinearFit(0.0, 100.0)
    assert fit_bound({}, floor_per_row=8.0) == LinearFit(0.0, 8.0)
    assert fit_bound({8: 0.0, 16: 0.0}, floor_per_row=8.0).per_row == 8.0  # peaks the statistics do not see


def test_a_measured_peak_stands_for_the_bound_at_its_own_size():
    """The bound through 4.7, 8, 14 and 33.5 MB at 8..64 rows predicts 39 MB at 64 (its intercept comes
    from the 8-row point); 64 rows were measured at 33.5 MB, under the 38.4 usable: 64 is planned."""
    mib = 1 << 20
    peaks = {8: int(4.7 * mib), 16: 8 * mib, 32: 14 * mib, 64: int(33.5 * mib)}
    bound = fit_bound(peaks)
    assert bound(64) > 0.8 * 48 * mib
    assert plan_chunk(rows_total=512, memory=bound, free_bytes=1 << 40, budget_bytes=48 * mib,
                      largest_timed_rows=64) == 32
    assert plan_chunk(rows_total=512, memory=bound, free_bytes=1 << 40, budget_bytes=48 * mib,
                      largest_timed_rows=64, peaks=peaks) == 64
    too_much = {**peaks, 64: 40 * mib}   # out of memory there: never planned again
    assert plan_chunk(rows_total=512, memory=fit_bound(too_much), free_bytes=1 << 40, budget_bytes=48 * mib,
                      largest_timed_rows=64, peaks=too_much) == 32
