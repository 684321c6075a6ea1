"""Chunk sizes on a real model: no chunk is ever more than twice the largest size timed before it (in the
run or in the plan it started from), whatever memory is free; the status says so from outside."""

from __future__ import annotations

import pytest

from tests import models
from tests.engine.conftest import rand
from worker.engine import RunOptions, TFMemoryProbe, build_problem, load_model, run_problem
from worker.engine.tuning import FIRST_ROWS


class Recording(TFMemoryProbe):
    """The real CPU probe, recording the size of every call (chunks and trials alike)."""

    def __init__(self) -> None:
        super().__init__("CPU:0")
        self.calls: list[int] = []

    def before_chunk(self, rows: int) -> None:
        self.calls.append(rows)


def over_the_rule(calls: list[int], timed_before: set[int]) -> list[tuple[int, int]]:
    """Calls larger than twice the largest size timed before them; a size counts as timed from its second
    call on (its first is the untimed warm-up), or when the plan had timed it."""
    seen: dict[int, int] = {}
    timed = set(timed_before)
    bad = []
    for k in calls:
        if k > max(FIRST_ROWS, 2 * max(timed, default=0)):
            bad.append((k, max(timed, default=0)))
        seen[k] = seen.get(k, 0) + 1
        if seen[k] >= 2:
            timed.add(k)
    return bad


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return load_model(str(models.mlp(tmp_path_factory.mktemp("wide") / "mlp", sizes=(64, 256, 256, 64))))


def test_no_chunk_is_more_than_twice_the_largest_size_timed(wide):
    """2048 rows whose chunks all fit in a sliver of the free memory: the planner that extrapolated its
    memory line ran them as one chunk after timing 8 and 16 rows. Now each new size is one doubling past
    one already timed, in a fresh run and in the next run from its plan; the job's status records the
    sizes timed and, for each chunk size run, the largest size timed before it."""
    problem = build_problem(wide, {"x": rand((32, 64))})
    assert problem.rows_total == 2048
    probe = Recording()
    first = run_problem(problem, probe=probe, options=RunOptions(try_xla=False))
    assert first.rows_computed == 2048
    assert not over_the_rule(probe.calls, set()), probe.calls
    assert max(probe.calls) < 2048, probe.calls
    plan = first.plan
    assert plan["timed_rows"] and all(size <= max(FIRST_ROWS, 2 * before) for size, before in plan["chunks_run"])
    learned = first.learned
    label = learned.strategy
    timed_in_plan = set(learned.strategies[label].rates)
    again = Recording()
    second = run_problem(problem, plan=learned, probe=again, options=RunOptions(try_xla=False, refine="never"))
    assert not over_the_rule(again.calls, timed_in_plan), (sorted(timed_in_plan), again.calls)
    assert all(size <= max(FIRST_ROWS, 2 * before) for size, before in second.plan["chunks_run"])


def test_the_writer_settles_before_timed_calls_only(wide):
    """The result writer compresses a finished block on the same cores while the next chunk runs: a call timed
    to decide a size waits for it first (``RunOptions.settle``). The calls of a comparison and the first calls
    of a size are settled; once the ladder has settled on a size, the chunks run beside the writer (no wait);
    a forced size is never compared and never waits."""
    problem = build_problem(wide, {"x": rand((128, 64))})   # 8192 rows: a long run after the ladder settles
    probe = Recording()

    def settle() -> None:
        probe.calls.append(0)   # 0: a settle before the call that follows it

    run_problem(problem, probe=probe, options=RunOptions(try_xla=False, refine="never", settle=settle))
    calls = probe.calls
    settled = [calls[i + 1] for i, k in enumerate(calls[:-1]) if k == 0]
    sizes = [k for k in calls if k]
    assert settled and settled[0] == sizes[0], calls   # the first call of the run
    assert len(set(settled)) >= 2, calls               # both sides of a comparison
    last_settle = max(i for i, k in enumerate(calls) if k == 0)
    tail = calls[last_settle + 2:]
    assert len(tail) >= 10 and 0 not in tail and len(set(tail) - {max(tail)}) <= 1, calls
    assert len(settled) < len(sizes) / 3, calls
    forced = Recording()
    run_problem(problem, probe=forced, options=RunOptions(try_xla=False, chunk_rows=512,
                                                           settle=lambda: forced.calls.append(0)))
    assert 0 not in forced.calls and set(forced.calls) == {512}, forced.calls
