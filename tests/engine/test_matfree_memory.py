"""Seeds per call of the matrix-free products planned from memory: the first call of a kind runs a few seeds,
its measured peak sets the rest to fit the free memory (or the budget); without a probe, or with a chunk size
given, nothing changes. The probe is a fake (peaks as a GPU would report them); the products are real."""

from __future__ import annotations

import numpy as np
import pytest

from tests import models
from tests.engine.reference import tape_jacobian
from worker.engine import load_model
from worker.engine.chunk_run import SAFETY
from worker.engine.matfree import FIRST_SEEDS, build_operator


class Probe:
    """``free`` bytes free; every call peaks at ``per_seed`` bytes a seed of the call just made."""

    device = "GPU:0"

    def __init__(self, free: int, per_seed: int) -> None:
        self.free, self.per_seed, self.seeds = free, per_seed, 0

    def free_bytes(self) -> int:
        return self.free

    def reset_peak(self) -> None:
        self.seeds = 0

    def peak_bytes(self) -> int:
        return self.per_seed * FIRST_SEEDS

    def before_chunk(self, rows: int) -> None:
        return None


@pytest.fixture(scope="module")
def f64(tmp_path_factory):
    path = models.float64_model(tmp_path_factory.mktemp("mem") / "f64")
    return load_model(str(path)), {"x": np.random.default_rng(0).normal(size=(3, 5))}


@pytest.mark.parametrize("budget,per_call", [(None, 40), (25_000, 20)])
def test_seeds_per_call_come_from_the_first_calls_peak(f64, budget, per_call):
    model, inputs = f64
    op = build_operator(model, inputs, of="y", wrt="x", kind="vjp")
    op.plan_memory(Probe(free=50_000, per_seed=1000), budget)  # 0.8 * 50 kB (or 25 kB) / 1 kB a seed
    assert per_call == int(SAFETY * min(50_000, budget or 50_000) / 1000)
    seeds = np.random.default_rng(1).normal(size=(100, 12))
    calls: list[tuple[int, int]] = []
    out = op.vjp(seeds, on_chunk=lambda start, rows: calls.append((start, len(rows))))
    sizes = [n for _, n in calls]
    assert sizes[0] == FIRST_SEEDS and max(sizes[1:]) == per_call and sum(sizes) == 100, calls
    J = tape_jacobian(model, inputs, "y", "x").reshape(12, 15)
    np.testing.assert_allclose(out, seeds @ J, rtol=1e-10, atol=1e-12)


def test_a_given_chunk_rows_or_no_probe_plans_nothing(f64):
    model, inputs = f64
    seeds = np.random.default_rng(2).normal(size=(30, 12))
    op = build_operator(model, inputs, of="y", wrt="x", kind="vjp")
    calls: list[int] = []
    op.vjp(seeds, on_chunk=lambda start, rows: calls.append(len(rows)))
    assert calls == [30]  # no probe: all at once
    op.plan_memory(Probe(free=50_000, per_seed=1000))
    calls.clear()
    op.vjp(seeds, chunk_rows=7, on_chunk=lambda start, rows: calls.append(len(rows)))
    assert calls == [7, 7, 7, 7, 2]
