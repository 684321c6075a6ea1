"""Plans that persist: cache hits and misses, no trial for a short job, a trial when it pays, and the
function at the production chunk size checked against eager rows."""

from __future__ import annotations

import numpy as np
import pytest

from tests import models
from tests.engine.conftest import rand
from tests.engine.reference import tape_jacobian
from worker.engine import DiskPlanCache, RunOptions, build_problem, load_model, run_problem
from worker.engine.planning import prepare


def _prepare(model, inputs, cache, **kw):
    return prepare(model, inputs, cache=cache, device="CPU:0", **kw)


def _run_and_store(model, inputs, cache, **kw):
    problem, plan = _prepare(model, inputs, cache, **kw)
    report = run_problem(problem, plan=plan)
    cache.put(report.learned)
    return problem, plan, report


@pytest.fixture
def mlp_model(tmp_path):
    return load_model(str(models.mlp(tmp_path / "mlp")))


def test_a_stored_plan_is_found_and_spares_the_eager_checks(mlp_model, tmp_path, monkeypatch):
    cache = DiskPlanCache(tmp_path / "cache")
    inputs = {"x": rand((3, 8))}
    _, first, _ = _run_and_store(mlp_model, inputs, cache)
    assert first.source == "default"
    import worker.engine.problem as problem_module

    def no_probe(*args, **kwargs):
        raise AssertionError("the eager probe ran although the plan's checks were cached")

    monkeypatch.setattr(problem_module, "_check_request", no_probe)
    problem, plan = _prepare(mlp_model, {"x": rand((3, 8), seed=1)}, cache)
    assert plan.source == "cache" and plan.key == first.key and plan.jobs == 1
    assert plan.current.verified_rows and plan.current.peaks and plan.current.memory is not None
    got = {}
    report = run_problem(problem, plan=plan, on_chunk=lambda s, r: got.update({s: r}))
    assert report.plan["source"] == "cache" and report.plan["trial"] is None
    rows = np.concatenate([got[s] for s in sorted(got)])
    want = tape_jacobian(mlp_model, {"x": rand((3, 8), seed=1)}, "y", "x").reshape(rows.shape)
    np.testing.assert_allclose(rows, want, atol=1e-5)


def test_a_changed_model_file_tensorflow_version_or_device_kind_is_a_miss(mlp_model, tmp_path, monkeypatch):
    cache = DiskPlanCache(tmp_path / "cache")
    inputs = {"x": rand((3, 8))}
    _run_and_store(mlp_model, inputs, cache)
    assert _prepare(mlp_model, inputs, cache)[1].source == "cache"

    # device kind: the same request planned for another device is a miss
    assert _prepare(mlp_model, inputs, cache, )[1].key.device.startswith("CPU/")
    problem, plan = prepare(mlp_model, inputs, cache=cache, device="GPU:0")
    assert plan.source == "default" and plan.key.device.startswith("GPU")

    # TensorFlow version
    import tensorflow as tf

    monkeypatch.setattr(tf, "__version__", "9.99.0")
    assert _prepare(mlp_model, inputs, cache)[1].source == "default"
    monkeypatch.undo()
    assert _prepare(mlp_model, inputs, cache)[1].source == "cache"

    # a re-exported model (same architecture, other weights): a new fingerprint
    import keras

    keras.utils.set_random_seed(7)
    x = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="tanh", name="d0")(x)
    keras.Model(x, {"y": keras.layers.Dense(4, name="out")(h)}).export(str(tmp_path / "mlp"), verbose=False)
    reloaded = load_model(str(tmp_path / "mlp"))
    assert reloaded.fingerprint != mlp_model.fingerprint
    assert _prepare(reloaded, inputs, cache)[1].source == "default"


def test_an_unreadable_plan_file_is_a_miss_not_an_error(mlp_model, tmp_path):
    cache = DiskPlanCache(tmp_path / "cache")
    inputs = {"x": rand((3, 8))}
    _, plan, _ = _run_and_store(mlp_model, inputs, cache)
    path = tmp_path / "cache" / "plans" / f"{plan.key.digest}.json"
    path.write_text("{not json")
    assert _prepare(mlp_model, inputs, cache)[1].source == "default"


def test_a_short_job_starts_at_once_without_a_trial(loaded):
    model = loaded("cnn")
    problem = build_problem(model, {"image": rand((2, 8, 8, 3))})
    report = run_problem(problem)
    assert report.plan["trial"] is None and report.learned.source == "default"
    tried = {label for label, r in report.learned.strategies.items() if r.status != "untried"}
    assert tried == {report.plan["strategy"]}  # one strategy compiled and run, no other


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return load_model(str(models.mlp(tmp_path_factory.mktemp("wide") / "mlp", sizes=(64, 256, 256, 64))))


def test_a_trial_runs_when_earlier_jobs_of_the_plan_pay_for_it(wide):
    inputs = {"x": rand((32, 64))}
    problem = build_problem(wide, inputs)            # 2048 rows
    # a short job, no history: no trial
    first = run_problem(problem, options=RunOptions(try_xla=False), ranges=[(0, 128)])
    assert first.plan["trial"] is None
    plan = first.learned
    plan.work_s = 1e6                                # as if many jobs had run under this plan
    second = run_problem(problem, options=RunOptions(try_xla=False), plan=plan)
    trial = second.plan["trial"]
    assert trial is not None and trial["candidate"] == "tiled" and trial["winner"] in ("tiled", "vectorized")
    assert "ratio" in trial and second.learned.strategies["tiled"].status == "ok"
    assert second.learned.refined  # nothing left to try without XLA


def test_the_status_says_where_a_jobs_seconds_went_trial_included(wide):
    """``time``: every call by strategy and size (the trial's candidate among them), the eager checks, the
    hand-over of rows, and what none of them accounts for; the parts add up to the run's wall time."""
    import time

    problem = build_problem(wide, {"x": rand((32, 64))})
    first = run_problem(problem, options=RunOptions(try_xla=False), ranges=[(0, 128)])
    plan = first.learned
    plan.work_s = 1e6                                # a trial pays
    chunks = []

    def slow_writer(start, rows):
        chunks.append(len(rows))
        time.sleep(0.02)

    report = run_problem(problem, options=RunOptions(try_xla=False), plan=plan, on_chunk=slow_writer)
    spent = report.plan["time"]
    labels = {label for label, *_ in spent["calls"]}
    assert report.plan["trial"] is not None and {"tiled", "vectorized"} <= labels, spent
    assert all(n >= 1 and seconds >= slowest > 0 for _, _, _, n, seconds, slowest in spent["calls"]), spent
    assert spent["deliver_s"] >= 0.02 * len(chunks) and spent["reference_s"] > 0, spent  # new sizes checked
    parts = spent["calls_s"] + spent["reference_s"] + spent["deliver_s"] + spent["other_s"]
    assert abs(parts - spent["wall_s"]) < 0.01, spent
    assert spent["wall_s"] <= report.seconds + 0.001, (spent, report.seconds)   # wall_s is rounded to ms
    assert spent["calls_s"] == pytest.approx(sum(c[4] for c in spent["calls"]), abs=0.01)


def test_a_candidate_whose_trial_does_not_pay_holds_back_no_other(wide):
    """``tiled`` comes first among the candidates, but with a (known) compile far beyond what the plan's
    work can repay its trial does not pay; ``per_example``'s does, and it is tried."""
    inputs = {"x": rand((32, 64))}
    problem = build_problem(wide, inputs, kind="batch_jacobian")
    first = run_problem(problem, options=RunOptions(try_xla=False))
    plan = first.learned
    assert plan.strategy == "vectorized" and plan.strategies["tiled"].status == "untried"
    plan.record("tiled").compile_s = 1e12
    plan.work_s = 1e6
    second = run_problem(problem, options=RunOptions(try_xla=False), plan=plan)
    assert second.plan["trial"] is not None and second.plan["trial"]["candidate"] == "per_example", second.plan
    assert second.plan["trial"]["wall_s"] > 0   # the whole trial, timed (compile, checks, pairs)
    assert second.learned.strategies["tiled"].status == "untried"


def test_a_batch_jacobian_plan_tries_the_per_example_strategy_and_keeps_right_rows(wide):
    """Batch Jacobians have one more candidate, ``per_example`` (pfor over examples of pfor over
    features); a plan whose jobs pay for trials gets to it, and every job's rows stay right."""
    inputs = {"x": rand((32, 64))}
    problem = build_problem(wide, inputs, kind="batch_jacobian")
    want = tape_jacobian(wide, inputs, "y", "x", batch=True)
    plan, candidates = None, []
    for _ in range(30):
        seen: dict[int, np.ndarray] = {}
        report = run_problem(problem, options=RunOptions(try_xla=False, refine="always"), plan=plan,
                             on_chunk=lambda s, r, seen=seen: seen.update({s: r}))
        rows = np.concatenate([seen[s] for s in sorted(seen)])   # (features, batch, features)
        np.testing.assert_allclose(np.moveaxis(rows, 0, 1), want, atol=1e-5)
        candidates += [report.plan["trial"]["candidate"]] if report.plan["trial"] else []
        plan = report.learned
        if plan.refined:
            break
    assert "per_example" in candidates and plan.strategies["per_example"].status == "ok", candidates
    assert plan.refined


def test_the_function_at_the_production_size_is_checked_against_eager_rows(loaded, monkeypatch):
    """A strategy right at small chunks but wrong at 16 rows and more: the check at the production
    size catches it, the job falls back and its rows are right."""
    import worker.engine.chunk_run as chunk_run

    real = chunk_run.chunk_function

    def wrong_when_large(problem, label, **options):
        fn = real(problem, label, **options)
        if label != "vectorized":
            return fn
        return lambda start, k: fn(start, k) * (1.5 if k >= 16 else 1.0)

    monkeypatch.setattr(chunk_run, "chunk_function", wrong_when_large)
    model = loaded("cnn")
    inputs = {"image": rand((4, 8, 8, 3))}   # 20 output rows
    problem = build_problem(model, inputs)
    seen = {}
    report = run_problem(problem, options=RunOptions(strategy="vectorized", chunk_rows=16),
                         on_chunk=lambda s, r: seen.update({s: r}))
    assert "disagrees with the eager reference" in report.failures["vectorized"]
    assert report.plan["strategy"] in ("loop", "eager")
    rows = np.concatenate([seen[s] for s in sorted(seen)])
    np.testing.assert_allclose(rows, tape_jacobian(model, inputs, "logits", "image").reshape(rows.shape), atol=1e-5)


def test_a_size_checked_before_runs_without_eager_code(loaded, monkeypatch):
    model = loaded("mlp")
    inputs = {"x": rand((3, 8))}
    first = run_problem(build_problem(model, inputs), options=RunOptions(chunk_rows=4))
    assert 4 in first.learned.current.verified_rows
    import worker.engine.chunk_run as chunk_run

    def no_eager(self, row):
        raise AssertionError("an eager reference row was computed for a size checked before")

    monkeypatch.setattr(chunk_run.ChunkRun, "eager_row", no_eager)
    run_problem(build_problem(model, inputs), options=RunOptions(chunk_rows=4), plan=first.learned)


def test_a_job_runs_the_strategy_that_finishes_it_first_counting_compiles(loaded):
    """A plan whose fastest strategy is costly to compile: a short job in a process that has not
    compiled it runs the other; a long one compiles it; the plan keeps its steady-state choice."""
    from worker.engine import Plan, StrategyRecord
    from worker.engine.runner import applicable_labels
    from worker.engine.trial import strategy_for_job

    model = loaded("cnn")
    problem = build_problem(model, {"image": rand((3, 8, 8, 3))})
    applicable = applicable_labels(problem)
    plan = Plan(strategy="vectorized", strategies={
        "vectorized": StrategyRecord(status="ok", verified=True, compile_s=100.0, rates={16: 200.0}),
        "tiled": StrategyRecord(status="ok", verified=True, compile_s=1.0, rates={16: 100.0})})
    model.compiled._fns.clear()  # nothing compiled in this process
    assert strategy_for_job(problem, plan, applicable, rows=1000) == "tiled"          # 11 s vs 105 s
    assert strategy_for_job(problem, plan, applicable, rows=1_000_000) == "vectorized"  # 10001 s vs 5100 s
    report = run_problem(problem, plan=plan)   # 15 rows: tiled runs, the plan still says vectorized
    assert report.plan["strategy"] == "tiled" and report.learned.strategy == "vectorized"


def test_a_trial_stops_once_its_pairs_fix_the_verdict(wide, monkeypatch):
    """``tuning.trial_decided`` ends a trial's pairs once they fix the median (two of three on one side): the
    trial ran two pairs, and its verdict stands."""
    from worker.engine import tuning

    problem = build_problem(wide, {"x": rand((32, 64))}, kind="batch_jacobian")
    plan = run_problem(problem, options=RunOptions(try_xla=False)).learned
    plan.work_s = 1e6   # a trial pays
    monkeypatch.setattr(tuning, "clearly_loses", lambda incumbent, candidate: False)
    monkeypatch.setattr(tuning, "trial_decided", lambda incumbent, candidate: len(incumbent) >= 2)
    report = run_problem(problem, options=RunOptions(try_xla=False), plan=plan)
    trial = report.plan["trial"]
    assert trial is not None and trial.get("pairs") == 2, report.plan
    assert trial["winner"] in (trial["candidate"], trial["incumbent"])


def test_a_trial_stops_after_the_pair_that_shows_the_candidate_clearly_slower(wide, monkeypatch):
    """``tuning.clearly_loses`` ends a trial's pairs early (a candidate 4x slower cost a 15 s trial for a 3 s
    compile); its rows are still checked, and the trial says how many pairs it ran."""
    from worker.engine import tuning

    problem = build_problem(wide, {"x": rand((32, 64))}, kind="batch_jacobian")
    plan = run_problem(problem, options=RunOptions(try_xla=False)).learned
    plan.work_s = 1e6   # a trial pays
    monkeypatch.setattr(tuning, "clearly_loses", lambda incumbent, candidate: True)
    report = run_problem(problem, options=RunOptions(try_xla=False), plan=plan)
    assert report.plan["trial"] is not None and report.plan["trial"]["pairs"] == 1, report.plan
    assert report.plan["trial"]["wall_s"] > 0
