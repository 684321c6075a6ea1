"""``contracts.quote``: the quote of a job from the kind registry, the shapes and a persisted plan (pure), and
``contracts.plans``: the request digest the API computes is the one the worker's plan key carries."""

from __future__ import annotations

import time

from contracts.jobspec import SEEDS_MEMBER, ModelRef, QueuedJob
from contracts.plan_predictions import first_call_sizes, first_calls
from contracts.plans import plan_request, request_digest, request_key_json
from contracts.quote import quote
from contracts.savedmodel import Signature, TensorSpec
from worker.engine.plan import Plan, PlanKey, StrategyRecord
from worker.engine.planner import LinearFit

SIG = Signature("serving_default", inputs={"x": TensorSpec("x", "float32", (None, 8))},
                outputs={"y": TensorSpec("y", "float32", (None, 4)), "loss": TensorSpec("loss", "float32", ())})
SHAPES = {"x": ((16, 8), "float32")}


def job(**options) -> QueuedJob:
    return QueuedJob(id="", model=ModelRef(path="/nowhere"), inputs_uri="", results_url="", **options)


def test_dense_rows_follow_the_mode_and_the_bytes_the_dtype():
    q = quote(job(of="y", wrt="x"), SIG, {}, SHAPES)
    assert q.mode == "reverse" and q.passes.count == 16 * 4 and q.result_bytes == 16 * 4 * 16 * 8 * 4
    half = quote(job(of="y", wrt="x", output_dtype="float16"), SIG, {}, SHAPES)
    assert half.result_bytes == q.result_bytes // 2 and half.arrays[0].dtype == "float16"
    batch = quote(job(of="y", wrt="x", kind="batch_jacobian", mode="forward"), SIG, {}, SHAPES)
    assert batch.arrays[0].shape == [16, 4, 8] and batch.passes.count == 8
    assert q.guess and batch.guess and q.predicted_seconds is None and "no plan" in q.basis


def test_matrix_free_kinds_count_products_and_their_arrays():
    jvp = quote(job(of="y", wrt="x", kind="jvp"), SIG, {}, SHAPES | {SEEDS_MEMBER: ((3, 16, 8), "float32")})
    assert jvp.passes.unit == "products" and jvp.passes.count == 3 and jvp.arrays[0].shape == [3, 16, 4]
    svd = quote(job(of="y", wrt="x", kind="svd", rank=2), SIG, {}, SHAPES)
    assert [a.shape for a in svd.arrays] == [[2], [2, 16, 4], [2, 16, 8]] and svd.passes.estimate
    trace = quote(job(of="loss", wrt="x", kind="hessian_trace", samples=500), SIG, {}, SHAPES)
    assert [a.shape for a in trace.arrays] == [[], []] and trace.passes.count == 16 * 8   # exact: n products
    assert trace.result_bytes == 8


def test_the_estimating_kinds_count_probes_and_lanczos_steps():
    diag = quote(job(of="loss", wrt="x", kind="hessian_diag"), SIG, {}, SHAPES)   # n = 128 > 64: 100 probes
    assert [a.shape for a in diag.arrays] == [[16, 8], [16, 8]] and diag.passes.count == 100
    small = quote(job(of="loss", wrt="x", kind="hessian_diag", probes=200), SIG, {}, SHAPES)
    assert small.passes.count == 128 and "exact" in small.passes.note
    density = quote(job(of="loss", wrt="x", kind="spectral_density", probes=4, steps=300), SIG, {}, SHAPES)
    assert [a.shape for a in density.arrays] == [[512], [512], [4, 128], [4, 128]]   # steps: at most n
    assert density.passes.count == 4 * 128 and density.passes.estimate
    logdet = quote(job(of="loss", wrt="x", kind="logdet", damping=0.1), SIG, {}, SHAPES)
    assert [a.shape for a in logdet.arrays] == [[], []] and logdet.passes.count == 10 * 50


def test_sparsity_counts_colours_unknown_until_the_pattern():
    q = quote(job(of="y", wrt="x", sparsity="auto"), SIG, {}, SHAPES)
    assert q.passes.unit == "colours" and q.passes.count is None and q.result_bytes is None
    assert "at most 64" in q.passes.note


def _plan(key: PlanKey) -> dict:
    plan = Plan(strategy="vectorized", key=key, jobs=3, updated_at=time.time())
    plan.strategies["vectorized"] = StrategyRecord(status="ok", memory=LinearFit(1000.0, 100.0),
                                                   seconds=LinearFit(0.01, 0.001), preferred_rows=16)
    return plan.to_json()


def _key(kind: str = "jacobian", shape=(16, 8)) -> PlanKey:
    return PlanKey(model="fp", signature="serving_default", of="y", wrt="x", kind=kind, mode="auto", reduce=None,
                   inputs=(("x", shape, "float32"),), device="GPU/NVIDIA H100/cc9.0", tensorflow="2.21.0")


def test_a_plan_predicts_peak_and_seconds_at_its_chunk_under_the_budget():
    plan = _plan(_key())
    q = quote(job(of="y", wrt="x"), SIG, {}, SHAPES, plan=plan, plan_name="abc")
    assert not q.guess and q.predicted_chunk_rows == 16 and q.predicted_peak_bytes == 1000 + 100 * 16
    assert q.predicted_seconds == round(4 * (0.01 + 0.001 * 16), 4) and "persisted plan abc" in q.basis
    tight = quote(job(of="y", wrt="x", memory_budget_bytes=2000), SIG, {}, SHAPES, plan=plan)
    assert tight.predicted_chunk_rows == 4 and tight.predicted_peak_bytes == 1400   # 0.8 x 2000 holds 4 rows
    pinned = quote(job(of="y", wrt="x", chunk_rows=64), SIG, {}, SHAPES, plan=plan)
    assert pinned.predicted_chunk_rows == 64 and pinned.predicted_seconds == round(0.01 + 0.064, 4)


def test_the_api_request_digest_is_the_workers_plan_key_without_device():
    for kind, shape in (("jacobian", (16, 8)), ("batch_jacobian", (13, 8))):
        worker_shape = (16, 8) if kind == "batch_jacobian" else shape   # the worker buckets the batch
        key = _key(kind, worker_shape)
        api = request_key_json(model="fp", signature="serving_default", of="y", wrt="x", kind=kind, mode="auto",
                               reduce=None, inputs=[("x", shape, "float32")], batch_axis=kind == "batch_jacobian")
        assert request_digest(api) == key.request
        assert request_digest(key.to_json()) == key.request != key.digest
    assert plan_request(job(of="y", wrt="x", kind="svd", rank=2), SHAPES) is None   # only dense kinds are planned


def test_a_chunk_size_the_plan_ran_is_quoted_at_its_measured_peak():
    """The memory line is a bound through every peak (above most); a size the plan ran is quoted at the peak the
    latest job measured at it, with the largest any job measured as the bound; the line only where nothing was
    measured."""
    plan = Plan.from_json(_plan(_key()))
    plan.strategies["vectorized"].peaks = {16: 2100}
    measured = quote(job(of="y", wrt="x"), SIG, {}, SHAPES, plan=plan.to_json())
    assert measured.predicted_chunk_rows == 16 and measured.predicted_peak_bytes == measured.peak_bound_bytes == 2100
    plan.strategies["vectorized"].last_peaks = {16: 1500}   # a later job measured less: the bound stays
    latest = quote(job(of="y", wrt="x"), SIG, {}, SHAPES, plan=Plan.from_json(plan.to_json()).to_json())
    assert latest.predicted_peak_bytes == 1500 and latest.peak_bound_bytes == 2100
    other = quote(job(of="y", wrt="x", chunk_rows=8), SIG, {}, SHAPES, plan=plan.to_json())
    assert other.predicted_peak_bytes == other.peak_bound_bytes == 1000 + 100 * 8


def test_seconds_count_the_first_calls_of_a_fresh_process_beside_the_steady_part():
    """64 rows at 16: four steady chunks, and the plan's ``compile_s`` for the one size a fresh process calls."""
    plan = Plan.from_json(_plan(_key()))
    steady = round(4 * (0.01 + 0.001 * 16), 4)
    bare = quote(job(of="y", wrt="x"), SIG, {}, SHAPES, plan=plan.to_json())
    assert bare.predicted_seconds == bare.predicted_steady_seconds == steady
    assert "first calls not measured yet" in bare.basis
    plan.strategies["vectorized"].compile_s = 2.5
    q = quote(job(of="y", wrt="x"), SIG, {}, SHAPES, plan=plan.to_json())
    assert q.predicted_steady_seconds == steady and q.predicted_seconds == round(steady + 2.5, 4)
    assert "fresh worker process" in q.basis and "1 chunk size)" in q.basis
    # a pinned chunk of 24 rows: 24, 24 and a tail of 16, a second size: its first call reuses the trace, and costs
    # the plan's ``resize_s`` (nothing while none is measured), not a second trace
    pinned = quote(job(of="y", wrt="x", chunk_rows=24), SIG, {}, SHAPES, plan=plan.to_json())
    assert pinned.predicted_seconds == round(pinned.predicted_steady_seconds + 2.5, 4)
    assert "2 chunk sizes" in pinned.basis
    plan.strategies["vectorized"].resize_s = 0.03
    pinned = quote(job(of="y", wrt="x", chunk_rows=24), SIG, {}, SHAPES, plan=plan.to_json())
    assert pinned.predicted_seconds == round(pinned.predicted_steady_seconds + 2.5 + 0.03, 4)
    # under XLA every shape compiles: the second size costs another compile
    plan.strategies["tiled+xla"] = StrategyRecord.from_json(plan.strategies["vectorized"].to_json())
    assert first_calls(plan.to_json(), "tiled+xla", 64, 24, forced=True) == (2 * 2.5, 2)
    assert first_calls(plan.to_json(), "vectorized", 64, 24, forced=True) == (2.5 + 0.03, 2)


def test_a_first_call_from_a_kept_trace_is_quoted_where_the_plan_timed_one():
    """A plan whose processes loaded the strategy's traced graph (``kept_compile_s``): a fresh worker pays that
    first call, not the trace; a strategy cheaper to start from its kept trace is the one quoted fresh."""
    plan = Plan.from_json(_plan(_key()))
    plan.strategies["vectorized"].compile_s = 2.5
    plan.strategies["vectorized"].kept_compile_s = 0.5
    steady = round(4 * (0.01 + 0.001 * 16), 4)
    assert quote(job(of="y", wrt="x"), SIG, {}, SHAPES, plan=plan.to_json()).predicted_seconds == round(
        steady + 0.5, 4)
    plan.strategies["vectorized"].compile_s, plan.strategies["vectorized"].rates = 100.0, {16: 500.0}
    plan.strategies["vectorized"].kept_compile_s = None
    plan.strategies["tiled"] = StrategyRecord(status="ok", verified=True, compile_s=50.0, kept_compile_s=1.0,
                                              rates={16: 100.0})
    q = quote(job(of="y", wrt="x"), SIG, {}, SHAPES, plan=plan.to_json())
    assert q.predicted_seconds == round(1.0 + 64 / 100.0, 4) and "with tiled" in q.basis


def test_the_sizes_a_fresh_process_calls_first():
    assert first_call_sizes("vectorized", 64, 16) == [16]
    assert first_call_sizes("vectorized", 100, 64) == [64]            # the tail of 36 pads to 64, a size run
    assert first_call_sizes("vectorized", 100, 32) == [4, 32]         # a tail of 4: its own size
    assert first_call_sizes("tiled+xla", 100, 32) == [4, 32]          # XLA: a power of two, padded
    assert first_call_sizes("tiled+xla", 99, 32) == [4, 32]           # a tail of 3 pads to 4
    assert first_call_sizes("tiled+xla", 24, 32) == [32]              # one call, padded to its bucket
    assert first_call_sizes("vectorized", 10, 16) == [10]             # fewer rows than a chunk: one call
    assert first_call_sizes("vectorized", 100, 64, forced=True) == [36, 64]   # chunk_rows: no padding
    # a kept size with its half timed, and rows for RECHECK_CHUNKS chunks: the half is called again
    assert first_call_sizes("vectorized", 16 * 16, 16, timed={8: 1.0, 16: 2.0}) == [8, 16]
    assert first_call_sizes("vectorized", 15 * 16, 16, timed={8: 1.0, 16: 2.0}) == [16]


def test_a_fresh_process_is_quoted_on_the_strategy_that_finishes_first_counting_compiles():
    """The plan's fastest strategy costs 100 s to compile; ``tiled`` (1 s) finishes 64 rows first on a fresh
    process, as ``strategy_for_job`` chooses: the fresh seconds are its; the steady part stays the plan's."""
    plan = Plan.from_json(_plan(_key()))
    plan.strategies["vectorized"].compile_s = 100.0
    plan.strategies["vectorized"].rates = {16: 500.0}
    plan.strategies["tiled"] = StrategyRecord(status="ok", verified=True, compile_s=1.0, rates={16: 100.0})
    q = quote(job(of="y", wrt="x"), SIG, {}, SHAPES, plan=plan.to_json())
    assert q.strategy == "vectorized" and q.predicted_steady_seconds == round(4 * (0.01 + 0.001 * 16), 4)
    assert q.predicted_seconds == round(1.0 + 64 / 100.0, 4) and "with tiled" in q.basis
    plan.strategies["tiled"].verified = False   # not verified: never chosen
    assert quote(job(of="y", wrt="x"), SIG, {}, SHAPES, plan=plan.to_json()).predicted_seconds == round(
        q.predicted_steady_seconds + 100.0, 4)


def test_a_quote_names_the_strategies_a_later_job_may_still_try():
    """A plan whose jobs have not tried every strategy may switch after a trial, to a peak and time the quote cannot
    know: the quote names them (none with a pinned chunk size or strategy, which runs no trial)."""
    plan = Plan.from_json(_plan(_key()))
    plan.record("tiled")   # applicable, never tried
    q = quote(job(of="y", wrt="x"), SIG, {}, SHAPES, plan=plan.to_json())
    assert q.untried_strategies == ["tiled"] and "not tried yet: tiled" in q.basis
    assert q.predicted_peak_bytes == 1000 + 100 * 16 and q.strategy == "vectorized"   # the plan's strategy's figures
    assert quote(job(of="y", wrt="x", chunk_rows=8), SIG, {}, SHAPES, plan=plan.to_json()).untried_strategies == []
    assert quote(job(of="y", wrt="x", strategy="vectorized"), SIG, {}, SHAPES,
                 plan=plan.to_json()).untried_strategies == []
    plan.strategies["tiled"].status = "ok"
    tried = quote(job(of="y", wrt="x"), SIG, {}, SHAPES, plan=plan.to_json())
    assert tried.untried_strategies == [] and "not tried" not in tried.basis


def test_a_peak_measured_as_process_rss_is_quoted_as_such():
    """A host job's ``loop`` chunks escape the allocator's statistics: the plan's peaks are the process's RSS
    delta (``peak_measure``), and the quote says so instead of passing them off as allocator bytes."""
    plan = Plan.from_json(_plan(_key()))
    record = plan.strategies["vectorized"]
    record.peaks, record.peak_measure = {16: 3 << 20}, "process_rss"
    q = quote(job(of="y", wrt="x"), SIG, {}, SHAPES, plan=plan.to_json())
    assert q.predicted_peak_bytes == 3 << 20 and q.peak_measure == "process_rss"
    assert "resident-set growth" in q.basis and "not allocator bytes" in q.basis
    plain = quote(job(of="y", wrt="x"), SIG, {}, SHAPES, plan=_plan(_key()))
    assert plain.peak_measure == "allocator" and "resident" not in plain.basis
    guessed = quote(job(of="y", wrt="x"), SIG, {}, SHAPES)
    assert guessed.guess and guessed.peak_measure == "estimate"
    assert StrategyRecord.from_json({}).peak_measure == "allocator"   # plans stored before this field
