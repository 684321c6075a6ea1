"""A trial's cost sized by the graph (``tuning.compile_factor``) and learnt from what a trial measured
(``StrategyRecord.compile_factor``), on a real model and real XLA compiles."""

from __future__ import annotations

import pytest

from tests import models
from tests.engine.conftest import rand
from worker.engine import Plan, RunOptions, StrategyRecord, build_problem, load_model, run_problem, tuning
from worker.engine.trial import learned_factors


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return load_model(str(models.mlp(tmp_path_factory.mktemp("wide") / "mlp", sizes=(64, 256, 256, 64))))


def _plan(problem, tiled_compile_s: float, work_s: float) -> Plan:
    """``tiled`` runs, calibrated (its chunk size settled, so that trials may start after a chunk), with the
    measured compile given; ``vectorized`` and ``vectorized+xla`` ruled out, so that the one candidate left
    is ``tiled+xla``."""
    plan = Plan(strategy="tiled", strategies={
        "vectorized": StrategyRecord(status="failed", reason="ruled out by the test"),
        "vectorized+xla": StrategyRecord(status="failed", reason="ruled out by the test")})
    plan = run_problem(problem, plan=plan, options=RunOptions(refine="never")).learned
    assert plan.strategy == "tiled" and plan.record("tiled").memory is not None
    plan.record("tiled").compile_s, plan.work_s = tiled_compile_s, work_s
    return plan


def test_a_large_graph_estimate_holds_back_the_trial_a_small_one_pays_for(wide, monkeypatch):
    """The same plan and job: on a graph of the reference size the ``tiled+xla`` trial pays (earlier work
    covers its estimate); with the graph as large as the factors are scaled for, its estimate does not."""
    problem = build_problem(wide, {"x": rand((32, 64))})
    ref, large = tuning.REFERENCE_GRAPH_OPS, int(tuning.REFERENCE_GRAPH_OPS * tuning.GRAPH_SCALE_LIMITS[1])
    at_ref = tuning.estimated_compile_s("tiled+xla", known=None, incumbent="tiled", incumbent_compile_s=1.0,
                                        graph_ops=ref)
    at_large = tuning.estimated_compile_s("tiled+xla", known=None, incumbent="tiled", incumbent_compile_s=1.0,
                                          graph_ops=large)
    assert at_large > at_ref + 2.0      # room for this job's own seconds and the trial's chunks
    work_s = (at_ref + at_large) / 2 / tuning.EXPECTED_GAIN

    monkeypatch.setattr(wide, "graph_ops", large)
    held = run_problem(problem, plan=_plan(problem, 1.0, work_s), ranges=[(0, 256)])
    assert held.plan["trial"] is None, held.plan
    assert held.learned.record("tiled+xla").status == "untried"

    monkeypatch.setattr(wide, "graph_ops", ref)
    tried = run_problem(problem, plan=_plan(problem, 1.0, work_s), ranges=[(0, 256)])
    assert tried.plan["trial"] is not None and tried.plan["trial"]["candidate"] == "tiled+xla", tried.plan
    assert tried.learned.strategies["tiled+xla"].status != "untried"


def test_a_compile_over_its_estimate_is_learnt_and_kept_with_the_plan(wide, monkeypatch):
    """A trial whose compile took longer than estimated records the factor that would have predicted it; the
    plan keeps it through JSON, and the other XLA form's estimate grows with it. The strategy that lost is
    not tried again by the next job of the plan."""
    problem = build_problem(wide, {"x": rand((32, 64))})
    monkeypatch.setattr(wide, "graph_ops", tuning.REFERENCE_GRAPH_OPS)
    wide.compiled._fns.clear()   # tiled+xla not compiled in this process: its first call is its compile
    report = run_problem(problem, plan=_plan(problem, 1e-4, 1e6), ranges=[(0, 256)])
    trial = report.plan["trial"]
    assert trial is not None and trial["candidate"] == "tiled+xla", report.plan
    record = report.learned.strategies["tiled+xla"]
    assert trial["estimated_compile_s"] == pytest.approx(1e-4 * tuning.COMPILE_FACTOR["tiled+xla"], abs=1e-3)
    assert trial["compile_s"] > trial["estimated_compile_s"]
    assert record.compile_factor is not None and record.compile_factor > tuning.COMPILE_FACTOR["tiled+xla"]
    # XLA compiles each shape: the trial's first call at its own size compiled again, and the plan's compile
    # is the larger of the two (a later job compiles once, at its size)
    k_c = trial["chunk_rows"]
    again_at_k = [c for c in report.plan["time"]["calls"] if c[0] == "tiled+xla" and c[1] == k_c and c[2]]
    assert again_at_k and k_c > 1, report.plan["time"]
    assert record.compile_s >= again_at_k[0][5] - k_c / record.rates[k_c] - 0.05, (record, again_at_k)
    again = Plan.loads(report.learned.dumps())
    assert learned_factors(again) == {"tiled+xla": record.compile_factor}
    plain = tuning.estimated_compile_s("vectorized+xla", known=None, incumbent="tiled", incumbent_compile_s=1.0,
                                       graph_ops=tuning.REFERENCE_GRAPH_OPS)
    learnt = tuning.estimated_compile_s("vectorized+xla", known=None, incumbent="tiled", incumbent_compile_s=1.0,
                                        graph_ops=tuning.REFERENCE_GRAPH_OPS, learned=learned_factors(again))
    assert learnt == pytest.approx(plain * record.compile_factor / tuning.COMPILE_FACTOR["tiled+xla"])
    # the next job of this plan: nothing left to try (the loser is not tried again)
    winner = again.strategy
    nxt = run_problem(problem, plan=again, ranges=[(0, 256)])
    assert nxt.plan["trial"] is None and nxt.learned.strategies["tiled+xla"].compile_factor == record.compile_factor
    assert nxt.learned.strategy == winner


@pytest.mark.parametrize("work_s, grows", [(0.0, False), (10.0, False), (20.0, True), (1000.0, True)])
def test_a_new_size_s_compile_is_repaid_by_the_plan_s_jobs_not_only_by_this_one(tmp_path, work_s, grows):
    """A short job never repays a dear new chunk size's first call (``resize_s``) by itself; the jobs its plan has
    run (``work_s``) stand for the jobs to come, as they do for a strategy trial. Without them a 256-row
    request kept its 8-row chunk for ever: on an H100 the MLP's 300th job still ran 8-row chunks, 8x slower
    than ``tape.batch_jacobian`` (docs/BENCHMARKS.md, "GPU: TensorFlow on an H100"). Those jobs count at a
    trial's ``EXPECTED_GAIN`` (0.3), not at the smallest gain a doubling must show (0.1): at 0.1 a 5 s compile
    waited for 50 s of earlier jobs, and on the H100 the request still ran 8-row chunks after 1249 jobs."""
    model = load_model(str(models.mlp(tmp_path / "mlp", sizes=(64, 256, 256, 64))))
    problem = build_problem(model, {"x": rand((4, 64))})
    plan = run_problem(problem, plan=Plan(strategy="tiled"),
                       options=RunOptions(strategy="tiled", chunk_rows=8, refine="never")).learned
    record = plan.record("tiled")
    assert 8 in record.rates, plan
    record.preferred_rows, record.resize_s, plan.work_s = 8, 5.0, work_s
    model.compiled._fns.clear()   # no size called in this process
    report = run_problem(problem, plan=plan, options=RunOptions(strategy="tiled", refine="never"))
    sizes = {size for size, _ in report.plan["chunks_run"]}
    assert (16 in sizes) is grows, report.plan


def test_a_short_job_compares_its_plan_s_size_with_twice_it_from_its_first_chunk(tmp_path):
    """A 256-row job whose plan keeps 32-row chunks compares 32 with 64 rows: begun after two 32-row chunks (192
    rows left), that comparison needs 256 and never ran (the steady MLP request on an H100 kept small chunks)."""
    model = load_model(str(models.mlp(tmp_path / "mlp", sizes=(256, 16, 256))))
    problem = build_problem(model, {"x": rand((4, 256))}, kind="batch_jacobian")
    assert problem.rows_total == 256
    plan = run_problem(problem, plan=Plan(strategy="tiled"), options=RunOptions(strategy="tiled", refine="never")
                       ).learned
    record = plan.record("tiled")
    assert record.memory is not None, plan
    # as a plan that grew to 32 rows and never timed 64 (its jobs were too short, before ``grow_first``)
    record.rates, record.preferred_rows, record.comparing, plan.work_s = {16: 1000.0, 32: 1500.0}, 32, None, 1000.0
    report = run_problem(problem, plan=plan, options=RunOptions(strategy="tiled", refine="never"))
    assert 64 in {size for size, _ in report.plan["chunks_run"]}, report.plan


def test_a_request_of_jobs_too_short_for_a_pair_compares_one_side_a_job(tmp_path):
    """256-row jobs whose plan keeps 64-row chunks: 64 against 128 needs 128's warm-up and a pair (512 rows), more
    than a job has; a request that ran jobs before times one side a job instead (two calls of a size, the second
    timed) and carries the timing in the plan to the next job, which times the other side: 128 is timed and
    decided over a few jobs. Before, the request kept 64-row chunks for ever (the short-jobs bench: 4x slower
    than ``tape.batch_jacobian``)."""
    model = load_model(str(models.mlp(tmp_path / "mlp", sizes=(256, 16, 256))))
    problem = build_problem(model, {"x": rand((4, 256))}, kind="batch_jacobian")
    plan = run_problem(problem, plan=Plan(strategy="tiled"), options=RunOptions(strategy="tiled", refine="never")
                       ).learned
    record = plan.record("tiled")
    record.rates, record.preferred_rows, record.comparing = {32: 1000.0, 64: 1500.0}, 64, None
    plan.work_s, plan.jobs = 1000.0, 10
    carried, runs = [], []
    for _ in range(8):
        report = run_problem(problem, plan=plan, options=RunOptions(strategy="tiled", refine="never"))
        plan = report.learned
        runs.append(sorted({size for size, _ in report.plan["chunks_run"]}))
        carried.append(plan.record("tiled").comparing)
        if 128 in plan.record("tiled").rates and plan.record("tiled").comparing is None:
            break
    record = plan.record("tiled")
    assert 128 in record.rates, (runs, carried)
    assert any(c is not None and len(c) == 4 for c in carried), carried   # a small timing waited for its partner
    assert record.comparing is None and record.preferred_rows in (64, 128), (runs, carried, record)
    assert max(max(r) for r in runs) == 128


def test_a_job_too_short_for_either_side_leaves_the_carried_comparison_in_the_plan(tmp_path):
    """A request's plan carries 64 against 128 rows (a 64-row timing waiting for its partner); a job of 128 rows
    (a range of the request) has rows for neither side (128's warm-up and two calls): it runs 64-row chunks and
    leaves the comparison to the next job, instead of dropping it."""
    model = load_model(str(models.mlp(tmp_path / "mlp", sizes=(256, 16, 256))))
    problem = build_problem(model, {"x": rand((4, 256))}, kind="batch_jacobian")
    options = RunOptions(strategy="tiled", refine="never")
    plan = run_problem(problem, plan=Plan(strategy="tiled"), options=options).learned
    carried = [64, 128, [], 0.0005]
    record = plan.record("tiled")
    record.rates, record.preferred_rows, record.comparing = {32: 1000.0, 64: 1500.0}, 64, carried
    plan.work_s, plan.jobs = 1000.0, 10
    report = run_problem(problem, plan=plan, ranges=[(0, 128)], options=options)
    assert {size for size, _ in report.plan["chunks_run"]} == {64}
    assert report.learned.record("tiled").comparing == carried


def test_where_pfor_fails_on_a_keras_loop_the_job_falls_back_on_tiled_before_the_per_row_loop(tmp_path):
    """A Keras GRU (not unrolled: a ``While`` op): pfor cannot convert its gradient, and the fallbacks skipped the
    other batched strategy; the bench's LSTM (400 rows) then ran ``loop`` at 125 rows/s in its cold process where
    ``tiled`` runs 320. A pinned ``vectorized`` still falls back on ``loop`` only (shards compute rows alike). The
    default plan starts such a model on ``tiled`` (``test_list_loops``): here a plan that starts on ``vectorized``
    (a similar request's choice) fails over."""
    from tests import loop_models

    model = load_model(str(loop_models.gru(tmp_path / "gru", steps=6, features=3, units=8)))
    problem = build_problem(model, {"seq": rand((1, 6, 3))}, kind="jacobian")
    report = run_problem(problem, plan=Plan(strategy="vectorized"), options=RunOptions(refine="never"))
    assert report.plan["strategy"] == "tiled", report.plan
    assert report.learned.record("vectorized").status == "failed"
    pinned = run_problem(problem, options=RunOptions(strategy="vectorized"))
    assert pinned.plan["strategy"] == "loop", pinned.plan
    assert tuning.fallbacks(pinned=True) == tuning.FALLBACKS
