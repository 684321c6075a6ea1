"""Memory: the byte budget bounds the measured peak, the peak is flat in the row count, and
out-of-memory chunks are halved until they fit."""

from __future__ import annotations

import numpy as np
import pytest

from tests import models
from tests.engine.conftest import rand
from tests.engine.probes import Probe
from tests.engine.reference import tape_jacobian
from worker.engine import RunOptions, build_problem, compute_in_memory, load_model, run_problem


@pytest.fixture(autouse=True)
def every_chunk_read(monkeypatch):
    """Every host chunk's peak read (``HostPeaks`` reads a settled size's first two and every sixteenth): these
    tests bound or compare the peak of every chunk a job ran, not of the few a job reads for its plan."""
    from worker.engine.host_peak import HostPeaks

    monkeypatch.setattr(HostPeaks, "RECHECK_SPAN", 1)


@pytest.fixture(scope="module")
def wide_mlp(tmp_path_factory):
    return load_model(str(models.mlp(tmp_path_factory.mktemp("wide") / "mlp", sizes=(256, 512, 512, 256))))


def _run(model, inputs, rows, **kw):
    """Rows ``[0, rows)``, planned by memory alone (no timing-dependent sweet spot)."""
    problem = build_problem(model, inputs)
    options = RunOptions(strategy="vectorized", throughput_cap=False, chunk_rows=kw.pop("chunk_rows", None),
                         memory_budget_bytes=kw.pop("memory_budget_bytes", 256 << 20))
    return run_problem(problem, options=options, ranges=[(0, rows)], **kw)


@pytest.mark.parametrize("budget_mb", [24, 64])
def test_peak_stays_within_the_byte_budget(wide_mlp, budget_mb):
    inputs = {"x": rand((64, 256))}
    budget = budget_mb << 20
    report = _run(wide_mlp, inputs, 2048, memory_budget_bytes=budget)
    assert report.peak_bytes <= budget, (report.peak_bytes, budget, report.plan)


def per_row_probe(**kw) -> Probe:
    """Allocator readings of three result rows a row (the wide MLP's rows are 64 KiB) over 1 MiB: the planning
    tests below are about the planner, not about the RSS noise of a process that ran other tests."""
    return Probe(per_row=3 * 64 * 1024, fixed=1 << 20, **kw)


def test_a_tighter_budget_gives_a_smaller_chunk(wide_mlp):
    inputs = {"x": rand((64, 256))}
    tight_probe = per_row_probe()
    tight = _run(wide_mlp, inputs, 512, memory_budget_bytes=12 << 20, probe=tight_probe)
    loose = _run(wide_mlp, inputs, 512, memory_budget_bytes=64 << 20, probe=per_row_probe())
    assert tight.plan["chunk_rows"] < loose.plan["chunk_rows"], (tight.plan, loose.plan)
    # every chunk the tight job ran, calibration included, within the budget's usable share
    assert tight.peak_bytes <= 12 << 20 and tight_probe.fixed + tight_probe.per_row * max(tight_probe.chunks) \
        <= 12 << 20, (tight.peak_bytes, tight_probe.chunks)


def test_peak_is_flat_in_the_number_of_rows(wide_mlp):
    """The peak is per chunk, so it must not grow with the rows. TensorFlow's executor orders
    ops differently from one call to the next (one chunk output more or less alive at the
    peak), so both sides are the worst chunk over a similar number of chunks: three jobs of
    512 rows against one of 2048, all at the chunk size a warm-up job planned under the budget (pinned: a
    host job's peaks are RSS deltas, and a plan drawn through them can choose 64 rows for one job, 128 for
    the next)."""
    inputs = {"x": rand((64, 256))}
    budget = 48 << 20
    warm_up = _run(wide_mlp, inputs, 512, memory_budget_bytes=budget)  # calibration, kept out of both
    k = warm_up.plan["chunk_rows"]
    plan = warm_up.learned
    small = [_run(wide_mlp, inputs, 512, memory_budget_bytes=budget, plan=plan, chunk_rows=k) for _ in range(3)]
    large = _run(wide_mlp, inputs, 2048, memory_budget_bytes=budget, plan=plan, chunk_rows=k)  # four times the rows
    assert {r.plan["chunk_rows"] for r in small} == {large.plan["chunk_rows"]} == {k}
    small_peak = max(r.peak_bytes for r in small)
    # RSS deltas of one chunk size vary 9-18 MiB from job to job here; a peak that grew with the rows would be
    # about four times the small jobs'
    assert large.peak_bytes <= 1.5 * small_peak, ([r.peak_bytes for r in small], large.peak_bytes)


def test_less_free_memory_gives_a_smaller_chunk(wide_mlp):
    inputs = {"x": rand((64, 256))}
    plenty = _run(wide_mlp, inputs, 256, probe=per_row_probe())
    scarce = _run(wide_mlp, inputs, 256, probe=per_row_probe(free_bytes=16 << 20))  # below the 256 MiB budget
    assert scarce.plan["chunk_rows"] < plenty.plan["chunk_rows"], (scarce.plan, plenty.plan)
    assert scarce.plan["free_bytes_at_start"] == 16 << 20 and scarce.peak_bytes <= 16 << 20, scarce.plan


def test_injected_oom_halves_the_chunk_and_the_job_finishes(loaded):
    model = loaded("cnn")
    inputs = {"image": rand((2, 8, 8, 3))}
    want = tape_jacobian(model, inputs, "logits", "image")
    probe = Probe(oom_above_rows=2)
    plans = []
    got, report = compute_in_memory(model, inputs, chunk_rows=8, probe=probe, strategy="vectorized",
                                    on_plan=plans.append)
    assert report.plan["oom_retries"] == 2 and report.plan["chunk_rows"] == 2
    assert [p["chunk_rows"] for p in plans] == [8, 4, 2]
    assert probe.chunks[:3] == [8, 4, 2] and set(probe.chunks[3:]) == {2}
    # the calls that ran out of memory are in the run's timeline, apart from those that delivered rows
    spent = report.plan["time"]
    assert [(c[0], c[1], c[3]) for c in spent["failed_calls"]] == [("vectorized", 8, 1), ("vectorized", 4, 1)], spent
    assert {c[1] for c in spent["calls"]} == {2}, spent
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_oom_at_one_row_is_a_clear_error(loaded):
    from worker.engine import MemoryBudgetTooSmall

    with pytest.raises(MemoryBudgetTooSmall, match="memory_budget_bytes: out of memory even at one row") as info:
        compute_in_memory(loaded("mlp"), {"x": rand((3, 8))}, chunk_rows=4, probe=Probe(oom_above_rows=0),
                          strategy="vectorized")
    assert "cannot be split further" in str(info.value), info.value


def test_budget_below_one_row_is_refused(wide_mlp):
    from worker.engine import MemoryBudgetTooSmall

    with pytest.raises(MemoryBudgetTooSmall, match="raise memory_budget_bytes to at least") as info:
        _run(wide_mlp, {"x": rand((64, 256))}, 64, memory_budget_bytes=1000)
    # why a row is the smallest unit (no rematerialisation of a SavedModel's one graph), and what asks for less
    assert "cannot rematerialise" in str(info.value) and "kind 'vjp'" in str(info.value), info.value
