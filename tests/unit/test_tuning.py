"""The rules of choosing (worker.engine.tuning) and the plan's JSON form: pure, no TensorFlow."""

from __future__ import annotations

import json

import pytest

from worker.engine import tuning
from worker.engine.plan import Plan, PlanKey, StrategyRecord, batch_bucketed, parse_label, strategy_label
from worker.engine.planner import LinearFit


def key(**changes) -> PlanKey:
    base = dict(model="f" * 32, signature="serving_default", of="y", wrt="x", kind="jacobian", mode="auto",
                reduce=None, inputs=(("x", (3, 8), "float32"),), device="CPU/test/2", tensorflow="2.21.0")
    return PlanKey(**{**base, **changes})


def test_plan_round_trips_through_json():
    record = StrategyRecord(status="ok", verified=True, verified_rows=[8, 16], compile_s=1.5,
                            memory=LinearFit(1024.0, 4096.0), seconds=LinearFit(0.01, 0.002),
                            rates={8: 100.0, 16: 150.0}, peaks={8: 4096, 16: 8192}, preferred_rows=16, batch=64)
    plan = Plan(strategy="tiled", key=key(), source="trial", strategies={"tiled": record}, checked={"mode": "reverse"},
                refined=True, work_s=12.5, jobs=3)
    again = Plan.loads(json.dumps(json.loads(plan.dumps())))
    assert again.to_json() == plan.to_json()
    assert again.strategies["tiled"].memory == LinearFit(1024.0, 4096.0) and again.key == plan.key
    assert again.strategies["tiled"].peaks == {8: 4096, 16: 8192}


def test_a_plan_of_another_format_is_refused():
    data = Plan(strategy="tiled", key=key()).to_json()
    data["format"] = 1
    with pytest.raises(ValueError, match="format"):
        Plan.from_json(data)


def test_a_plan_stored_before_memory_bounds_is_a_miss_not_a_crash(tmp_path):
    """Format 2 plans hold a memory line through two peaks (an average, not a bound) and no peaks: a cache
    that finds one treats it as a miss and the job plans afresh."""
    from worker.engine.plan_cache import DiskPlanCache

    cache = DiskPlanCache(tmp_path)
    plan = Plan(strategy="tiled", key=key(), strategies={"tiled": StrategyRecord(status="ok", rates={8: 10.0})})
    cache.put(plan)
    assert cache.get(key()) is not None
    old = plan.to_json()
    old["format"] = 2
    del old["strategies"]["tiled"]["peaks"]
    (tmp_path / "plans" / f"{key().digest}.json").write_text(json.dumps(old))
    assert cache.get(key()) is None


@pytest.mark.parametrize("field,value", [("model", "e" * 32), ("tensorflow", "2.22.0"), ("device", "GPU/H100/cc9.0"),
                                         ("inputs", (("x", (4, 8), "float32"),)), ("mode", "forward"),
                                         ("of", "z"), ("signature", "other")])
def test_every_part_of_the_key_changes_its_digest(field, value):
    assert key(**{field: value}).digest != key().digest


def test_the_family_ignores_input_shapes_only():
    assert key(inputs=(("x", (64, 8), "float32"),)).family == key().family
    assert key(tensorflow="2.22.0").family != key().family


def test_batch_bucketing_and_labels():
    assert batch_bucketed((5, 3, 2)) == (8, 3, 2) and batch_bucketed((64, 3)) == (64, 3) and batch_bucketed(()) == ()
    assert parse_label("vectorized+xla") == ("vectorized", True) and strategy_label("tiled", False) == "tiled"


def test_memory_line_scales_up_to_a_larger_batch_of_the_bucket():
    record = StrategyRecord(memory=LinearFit(100.0, 10.0), batch=40)
    assert record.memory_at(64) == LinearFit(160.0, 16.0)
    assert record.memory_at(30) == LinearFit(100.0, 10.0)  # a smaller batch needs no more


def test_default_order_by_graph_size_and_similar_choice():
    applicable = ["tiled", "vectorized", "loop", "eager"]
    assert tuning.default_order(applicable, graph_ops=50)[0] == "vectorized"
    assert tuning.default_order(applicable, graph_ops=5000)[0] == "tiled"
    assert tuning.default_order(applicable, "loop", graph_ops=5000)[0] == "loop"
    assert tuning.default_order(["vectorized", "loop", "eager"], graph_ops=5000)[0] == "vectorized"


def test_a_trial_runs_once_what_it_can_save_covers_its_cost():
    assert not tuning.trial_pays(cost_s=10.0, remaining_s=5.0, past_work_s=0.0)   # a short job: never
    assert tuning.trial_pays(cost_s=10.0, remaining_s=40.0, past_work_s=0.0)      # a long job: now
    assert tuning.trial_pays(cost_s=10.0, remaining_s=0.1, past_work_s=40.0)      # repeated jobs: once paid


def test_a_candidate_wins_on_the_median_of_paired_ratios_beyond_the_tie_band():
    incumbent = [1.0, 1.0, 1.0]
    assert tuning.candidate_wins(incumbent, [0.8, 0.9, 0.85])
    assert not tuning.candidate_wins(incumbent, [0.97, 0.96, 0.98])        # within 5 %: the incumbent stays
    assert not tuning.candidate_wins(incumbent, [0.5, 1.2, 1.1])           # one lucky pair does not decide
    assert not tuning.candidate_wins([], [])


def test_alternatives_batched_strategies_first_then_xla_and_without_the_tried():
    applicable = ["tiled", "vectorized", "loop", "eager", "tiled+xla", "vectorized+xla"]
    assert tuning.alternatives(applicable, ["tiled"], xla=True) == ["vectorized", "tiled+xla", "vectorized+xla"]
    assert tuning.alternatives(applicable, ["vectorized"], xla=False) == ["tiled"]
    batch = applicable + ["per_example", "per_example+xla"]   # a batch Jacobian
    assert tuning.alternatives(batch, ["vectorized", "tiled"], xla=True) == [
        "tiled+xla", "vectorized+xla", "per_example", "per_example+xla"]
    assert tuning.alternatives(batch, ["vectorized"], xla=False) == ["tiled", "per_example"]
    assert tuning.estimated_compile_s("vectorized", known=None, incumbent="tiled", incumbent_compile_s=2.0) == 12.0
    assert tuning.estimated_compile_s("vectorized", known=3.0, incumbent="tiled", incumbent_compile_s=2.0) == 3.0


def test_compiling_the_faster_strategy_is_bought_once_renting_has_lost_its_cost():
    # one-shot: this job alone loses 4.5 s by renting, compiling the faster one costs 6.5 s
    assert not tuning.buy_compile(rent_job_s=8.1, best_rows_s=3.6, compile_s=6.5, regret_s=0.0)
    # a worker's second job: 4.5 s lost before, 2.1 s now
    assert tuning.buy_compile(rent_job_s=5.7, best_rows_s=3.6, compile_s=6.5, regret_s=4.5)
    # a long job pays for the compile on its own
    assert tuning.buy_compile(rent_job_s=31.1, best_rows_s=18.2, compile_s=6.5, regret_s=0.0)
