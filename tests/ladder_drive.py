"""Chunk-ladder drivers shared by the ladder tests (tests/unit/test_ladder.py, test_host_growth.py): a job's
chunks as the engine runs them, on fake timings and peaks, no TensorFlow."""

from __future__ import annotations

from collections.abc import Callable

from worker.engine.ladder import Ladder
from worker.engine.tuning import FIRST_ROWS


def drive(ladder: Ladder, seconds_of: Callable[[int, int], float], chunks: int, *,
          peak_of: Callable[[int], float] = lambda k: 1000 * k,
          can_grow_to: Callable[[int], bool] = lambda k: True) -> list[int]:
    """Run ``chunks`` chunks as the engine does (a size's first call is its untimed warm-up); the sizes run.
    Every chunk is checked against the rule: at most twice the largest size timed before it."""
    sizes: list[int] = []
    timed_before = set(ladder.timed)
    for i in range(chunks):
        k = ladder.next_size()
        assert k <= max(FIRST_ROWS, 2 * max(timed_before, default=0)), (k, sorted(timed_before), sizes)
        warm = k in ladder.called
        ladder.observe(k, seconds_of(k, i), int(peak_of(k)), warm=warm, can_grow_to=can_grow_to)
        if warm or not ladder.by_throughput:
            timed_before.add(k)
        sizes.append(k)
    return sizes
