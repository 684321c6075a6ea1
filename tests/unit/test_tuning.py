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


def test_a_loop_that_carries_tensor_lists_puts_tiled_first_even_on_a_small_or_inlined_graph():
    applicable = ["tiled", "vectorized", "loop", "eager"]
    assert tuning.default_order(applicable, graph_ops=50, list_loops=True)[:2] == ["tiled", "vectorized"]
    assert tuning.default_order(applicable, graph_ops=50, inlined=True, list_loops=True)[0] == "tiled"
    assert tuning.default_order(["vectorized", "loop", "eager"], list_loops=True)[0] == "vectorized"   # no tiled
    assert tuning.default_order(applicable, list_loops=True, second_order_loops=True)[0] == "loop"


def test_a_trial_runs_once_what_it_can_save_covers_its_cost():
    assert not tuning.trial_pays(cost_s=10.0, remaining_s=5.0, past_work_s=0.0)   # a short job: never
    assert tuning.trial_pays(cost_s=10.0, remaining_s=40.0, past_work_s=0.0)      # a long job: now
    assert tuning.trial_pays(cost_s=10.0, remaining_s=0.1, past_work_s=40.0)      # repeated jobs: once paid


def test_tiled_against_an_inlined_vectorized_is_tried_only_once_the_plans_work_covers_ten_times_the_trial():
    """MobileNetV3Small's second process: a 6 s trial of ``tiled`` against 13 s of work done and 13 s left. It paid
    at the general gain and lost every time; against an inlined ``vectorized`` it waits for ~60 s of work."""
    inlined = tuning.expected_gain("tiled", "vectorized", inlined=True)
    assert inlined == tuning.INLINED_TILED_GAIN < tuning.EXPECTED_GAIN
    assert tuning.expected_gain("tiled", "vectorized", inlined=False) == tuning.EXPECTED_GAIN   # through the call op
    assert tuning.expected_gain("vectorized", "tiled", inlined=True) == tuning.EXPECTED_GAIN
    assert tuning.expected_gain("tiled+xla", "vectorized", inlined=True) == tuning.EXPECTED_GAIN
    assert tuning.trial_pays(cost_s=6.0, remaining_s=13.0, past_work_s=13.0)
    assert not tuning.trial_pays(cost_s=6.0, remaining_s=13.0, past_work_s=13.0, gain=inlined)
    assert tuning.trial_pays(cost_s=6.0, remaining_s=13.0, past_work_s=52.0, gain=inlined)


def test_a_candidate_clearly_slower_in_every_pair_so_far_has_lost():
    assert tuning.clearly_loses([1.0], [4.1])                      # one pair at 4x: no more pairs
    assert not tuning.clearly_loses([1.0], [1.3])                  # within what noise and a warm-up can do
    assert not tuning.clearly_loses([1.0, 1.0], [4.0, 1.2])        # not every pair: the pairs go on
    assert not tuning.clearly_loses([], [])
    assert not tuning.candidate_wins([1.0], [4.1])                 # and a trial stopped there keeps the incumbent


def test_a_trial_ends_once_its_pairs_so_far_fix_the_median():
    assert tuning.trial_decided([1.0, 1.0], [0.5, 0.6])            # two of three faster: the candidate wins
    assert tuning.trial_decided([1.0, 1.0], [1.0, 1.3])            # two of three not faster: the incumbent stays
    assert not tuning.trial_decided([1.0, 1.0], [0.5, 1.0])        # one each: the third pair decides
    assert not tuning.trial_decided([1.0], [0.5])                  # one pair of three decides nothing
    assert not tuning.trial_decided([], [])


def test_a_trial_ended_early_has_the_verdict_all_its_pairs_would_have_given():
    """Whatever the pairs not run would have shown, ``candidate_wins`` over all ``TRIAL_PAIRS`` agrees with the
    verdict on the pairs a trial stopped at (``trial_decided``)."""
    ratios = [0.3, 0.9, 0.94, 0.95, 0.96, 1.0, 1.2, 3.0]   # candidate / incumbent, around the 5 % tie band
    for first in ratios:
        for second in ratios:
            done = [first, second]
            if not tuning.trial_decided([1.0] * 2, done):
                continue
            for third in ratios:
                whole = tuning.candidate_wins([1.0] * 3, [*done, third])
                assert tuning.candidate_wins([1.0] * 2, done) == whole, (done, third)


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
    vectorized = tuning.COMPILE_FACTOR["vectorized"]
    assert tuning.estimated_compile_s("vectorized", known=None, incumbent="tiled",
                                      incumbent_compile_s=2.0) == pytest.approx(2.0 * vectorized)
    assert tuning.estimated_compile_s("vectorized", known=3.0, incumbent="tiled", incumbent_compile_s=2.0) == 3.0
    # an incumbent without a factor (the per-row loop) counts as a plain trace
    assert tuning.estimated_compile_s("tiled+xla", known=None, incumbent="loop", incumbent_compile_s=2.0) == 8.0


def test_compiling_the_faster_strategy_is_bought_once_renting_has_lost_its_cost():
    # one-shot: this job alone loses 4.5 s by renting, compiling the faster one costs 6.5 s
    assert not tuning.buy_compile(rent_job_s=8.1, best_rows_s=3.6, compile_s=6.5, regret_s=0.0)
    # a worker's second job: 4.5 s lost before, 2.1 s now
    assert tuning.buy_compile(rent_job_s=5.7, best_rows_s=3.6, compile_s=6.5, regret_s=4.5)
    # a long job pays for the compile on its own
    assert tuning.buy_compile(rent_job_s=31.1, best_rows_s=18.2, compile_s=6.5, regret_s=0.0)


def test_compile_factors_grow_with_the_graph_for_xla_not_for_pfor_or_a_plain_trace():
    ref = tuning.REFERENCE_GRAPH_OPS
    for label, base in tuning.COMPILE_FACTOR.items():
        assert tuning.compile_factor(label, ref) == pytest.approx(base)   # the reference graph's factors
        assert tuning.compile_factor(label, 0) == base                    # an unknown size: the same
    assert tuning.compile_factor("tiled", 8 * ref) == 1.0
    for label in ("tiled+xla", "vectorized+xla", "per_example"):
        small, big = tuning.compile_factor(label, ref // 4), tuning.compile_factor(label, 2 * ref)
        assert small <= tuning.COMPILE_FACTOR[label] < 1.5 * tuning.COMPILE_FACTOR[label] < big, label
    # without AutoGraph pfor's trace is ~4x a plain gradient's on 50 to 3187 ops (tuning's table)
    for ops in (50, 163, ref, 3187, 8 * ref):
        assert tuning.compile_factor("vectorized", ops) == tuning.COMPILE_FACTOR["vectorized"]
    assert 3.5 < tuning.COMPILE_FACTOR["vectorized"] < 5
    # EfficientNetB0 (3187 ops): XLA ~30x its reference factor, as measured
    assert 20 < tuning.compile_factor("tiled+xla", 3187) / tuning.COMPILE_FACTOR["tiled+xla"] < 40
    # beyond the measured range the scale is held, not extrapolated
    high = tuning.GRAPH_SCALE_LIMITS[1]
    assert tuning.compile_factor("tiled+xla", int(10 * high * ref)) == tuning.compile_factor("tiled+xla",
                                                                                            int(high * ref))


def test_on_a_large_graph_an_xla_trial_no_longer_pays_what_it_paid_on_the_reference_graph():
    """EfficientNetB0's warm job (docs/BENCHMARKS.md): 36 s of earlier work made a ``tiled+xla`` trial pay on
    MobileNetV3Small's factor, and its compile took ~70 s. Sized by the graph, the estimate holds it back."""
    ref = tuning.REFERENCE_GRAPH_OPS
    incumbent_s = 4.0    # tiled's trace
    at_ref = tuning.estimated_compile_s("tiled+xla", known=None, incumbent="tiled", incumbent_compile_s=incumbent_s,
                                        graph_ops=ref)
    large = tuning.estimated_compile_s("tiled+xla", known=None, incumbent="tiled", incumbent_compile_s=incumbent_s,
                                       graph_ops=4 * ref)
    assert at_ref == pytest.approx(16.0) and large > 1.5 * at_ref
    past = at_ref / tuning.EXPECTED_GAIN      # exactly what pays at the reference graph
    assert tuning.trial_pays(cost_s=at_ref, remaining_s=0.0, past_work_s=past)
    assert not tuning.trial_pays(cost_s=large, remaining_s=0.0, past_work_s=past)


def test_a_learned_factor_replaces_the_estimate_and_raises_those_sharing_its_transform():
    ops = tuning.REFERENCE_GRAPH_OPS
    plain = {label: tuning.learned_factor(label, graph_ops=ops) for label in tuning.COMPILE_FACTOR}
    learned = {"tiled+xla": 3 * plain["tiled+xla"]}        # XLA measured at 3x its estimate
    assert tuning.learned_factor("tiled+xla", graph_ops=ops, learned=learned) == learned["tiled+xla"]
    assert tuning.learned_factor("vectorized+xla", graph_ops=ops, learned=learned) == pytest.approx(
        3 * plain["vectorized+xla"])                       # shares XLA
    assert tuning.learned_factor("vectorized", graph_ops=ops, learned=learned) == plain["vectorized"]   # pfor only
    assert tuning.learned_factor("tiled", graph_ops=ops, learned=learned) == 1.0
    est = tuning.estimated_compile_s("vectorized+xla", known=None, incumbent="tiled", incumbent_compile_s=2.0,
                                     graph_ops=ops, learned=learned)
    assert est == pytest.approx(2.0 * 3 * plain["vectorized+xla"])
    # a measured compile still wins over any factor
    assert tuning.estimated_compile_s("tiled+xla", known=5.0, incumbent="tiled", incumbent_compile_s=2.0,
                                      graph_ops=ops, learned=learned) == 5.0


def test_a_learned_compile_factor_persists_with_the_plan():
    plan = Plan(strategy="tiled", key=key(), strategies={"tiled+xla": StrategyRecord(status="ok", compile_s=70.0,
                                                                                      compile_factor=17.5)})
    again = Plan.loads(plan.dumps())
    assert again.strategies["tiled+xla"].compile_factor == 17.5
    assert Plan.loads(Plan(strategy="tiled", key=key(), strategies={"tiled": StrategyRecord()}).dumps()) \
        .strategies["tiled"].compile_factor is None


def test_efficientnets_second_job_tries_the_strategy_its_first_job_could_not_afford():
    """EfficientNetB0 (3187 ops), 1000 rows of ``tiled`` at ~26 rows/s: the cold job traced ``tiled`` in 4.2 s and
    worked 43.6 s. With pfor's estimate grown with the graph (78 s) no job of the request ever tried ``vectorized``,
    1.8x faster per row there and 12 s to trace; now the second job does (the first alone cannot repay it)."""
    est = tuning.estimated_compile_s("vectorized", known=None, incumbent="tiled", incumbent_compile_s=4.22,
                                     graph_ops=3187)
    assert 15 < est < 20
    assert not tuning.trial_pays(cost_s=est, remaining_s=38.0, past_work_s=0.0)    # the cold job
    assert tuning.trial_pays(cost_s=est, remaining_s=38.0, past_work_s=43.6)       # the next one


def test_an_inlined_body_puts_vectorized_first_at_any_size_and_scales_its_compile_by_the_inlined_factor():
    applicable = ["tiled", "vectorized", "loop", "eager"]
    assert tuning.default_order(applicable, graph_ops=5000, inlined=True)[0] == "vectorized"
    assert tuning.default_order(applicable, "tiled", graph_ops=5000, inlined=True)[0] == "tiled"   # a similar choice
    ref = tuning.REFERENCE_GRAPH_OPS
    assert tuning.compile_factor("vectorized", ref, inlined=True) == tuning.INLINED_FACTOR["vectorized"]
    assert tuning.compile_factor("vectorized", ref) == tuning.COMPILE_FACTOR["vectorized"]
    assert tuning.compile_factor("tiled+xla", ref, inlined=True) == tuning.compile_factor("tiled+xla", ref)
    # tiled's compile estimated from vectorized's: half of it inlined, a quarter through the call op
    inlined = tuning.estimated_compile_s("tiled", known=None, incumbent="vectorized", incumbent_compile_s=8.4,
                                         graph_ops=ref, inlined=True)
    called = tuning.estimated_compile_s("tiled", known=None, incumbent="vectorized", incumbent_compile_s=8.4,
                                        graph_ops=ref)
    assert inlined == pytest.approx(8.4 / tuning.INLINED_FACTOR["vectorized"]) and called == pytest.approx(2.0)
