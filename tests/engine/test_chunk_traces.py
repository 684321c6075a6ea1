"""Dense chunk functions kept across processes (``strategies.keep_trace``, ``worker.engine.trace_cache``): a process
that finds a kept trace of its strategy loads the graph instead of tracing it, bound to its own model's variables;
the plan weighs a strategy whose trace is kept at what its first call then costs. A fresh ``load_model`` stands for
a new process: compiled functions live on the loaded model."""

from __future__ import annotations

import numpy as np
import pytest

from tests import models
from tests.engine.conftest import rand
from tests.engine.reference import tape_jacobian
from worker.engine import Plan, RunOptions, StrategyRecord, build_problem, load_model, run_problem
from worker.engine.strategies import from_kept_trace, trace_kept


@pytest.fixture(scope="module")
def cnn_path(tmp_path_factory):
    return models.cnn(tmp_path_factory.mktemp("cnn") / "cnn")


def _rows(model, inputs, trace_dir, strategy="tiled", plan=None, chunk_rows=8):
    problem = build_problem(model, inputs)
    seen = {}
    report = run_problem(problem, options=RunOptions(strategy=strategy, chunk_rows=chunk_rows, trace_dir=trace_dir),
                         plan=plan, on_chunk=lambda s, r: seen.update({s: r}))
    return problem, report, np.concatenate([seen[s] for s in sorted(seen)])


@pytest.mark.parametrize("strategy", ["tiled", "vectorized"])
def test_a_new_process_runs_the_kept_chunk_function_bound_to_its_own_variables(cnn_path, tmp_path, strategy):
    inputs = {"image": rand((2, 8, 8, 3))}
    first = load_model(str(cnn_path))
    problem, _, _ = _rows(first, inputs, str(tmp_path))
    if strategy != "tiled":
        problem, _, _ = _rows(first, inputs, str(tmp_path), strategy)
    assert not from_kept_trace(problem, strategy) and trace_kept(problem, strategy, str(tmp_path))
    assert list((tmp_path / "operators").glob("*.graph.npz"))

    second = load_model(str(cnn_path))
    for v in second.variables.values():   # a graph that still read the first model's variables would disagree
        v.assign(v * 2.0)
    problem, report, rows = _rows(second, inputs, str(tmp_path), strategy)
    assert from_kept_trace(problem, strategy), report.plan
    want = tape_jacobian(second, inputs, "logits", "image").reshape(rows.shape)
    np.testing.assert_allclose(rows, want, rtol=1e-4, atol=1e-5)


def test_a_first_call_from_a_kept_trace_is_recorded_apart_from_a_traced_one(cnn_path, tmp_path):
    inputs = {"image": rand((8, 8, 8, 3))}   # 40 rows, planned: the first size runs again after the first call
    _, report, _ = _rows(load_model(str(cnn_path)), inputs, str(tmp_path), chunk_rows=None)
    traced = report.learned.record("tiled")
    assert traced.compile_s is not None and traced.kept_compile_s is None
    problem, report, _ = _rows(load_model(str(cnn_path)), inputs, str(tmp_path), plan=Plan.loads(
        report.learned.dumps()), chunk_rows=None)
    kept = report.learned.record("tiled")
    assert from_kept_trace(problem, "tiled")
    assert kept.compile_s == traced.compile_s and kept.kept_compile_s is not None, (report.plan["time"], kept)
    assert Plan.loads(report.learned.dumps()).record("tiled").kept_compile_s == kept.kept_compile_s


def test_no_trace_is_kept_without_a_folder_for_xla_or_from_other_code(cnn_path, tmp_path, monkeypatch):
    from worker.engine import trace_cache

    inputs = {"image": rand((2, 8, 8, 3))}
    _rows(load_model(str(cnn_path)), inputs, None)
    _rows(load_model(str(cnn_path)), inputs, str(tmp_path), "tiled+xla")
    assert not (tmp_path / "operators").exists()   # XLA compiles per shape: no graph keeps that
    _rows(load_model(str(cnn_path)), inputs, str(tmp_path))
    monkeypatch.setattr(trace_cache, "code_digest", lambda: "another release")
    problem, _, _ = _rows(load_model(str(cnn_path)), inputs, str(tmp_path))
    assert not from_kept_trace(problem, "tiled")   # its traced bodies may differ: traced again


def test_a_damaged_kept_chunk_function_is_traced_again(cnn_path, tmp_path):
    inputs = {"image": rand((2, 8, 8, 3))}
    _, _, want = _rows(load_model(str(cnn_path)), inputs, str(tmp_path))
    for graph in (tmp_path / "operators").glob("*.graph.npz"):
        graph.write_bytes(b"PK\x03\x04 not a graph")
    problem, _, rows = _rows(load_model(str(cnn_path)), inputs, str(tmp_path))
    assert not from_kept_trace(problem, "tiled")
    np.testing.assert_allclose(rows, want, rtol=1e-6)


def test_a_kept_trace_makes_the_faster_strategy_worth_its_first_call(cnn_path, monkeypatch):
    """A short job in a fresh process runs the strategy that is cheap to trace; where the faster one's trace
    is kept, its first call costs what a kept trace cost (measured, or scaled from another strategy's)."""
    from worker.engine import trial
    from worker.engine.runner import applicable_labels

    model = load_model(str(cnn_path))
    problem = build_problem(model, {"image": rand((3, 8, 8, 3))})
    applicable = applicable_labels(problem)
    records = {"vectorized": StrategyRecord(status="ok", verified=True, compile_s=100.0, rates={16: 200.0}),
               "tiled": StrategyRecord(status="ok", verified=True, compile_s=4.0, rates={16: 100.0})}
    plan = Plan(strategy="vectorized", strategies=records)
    kept: set[str] = set()
    monkeypatch.setattr(trial, "trace_kept", lambda problem, label, trace_dir: label in kept)
    choose = lambda: trial.strategy_for_job(problem, plan, applicable, rows=1000, trace_dir="cache")  # noqa: E731
    assert choose() == "tiled"        # 4 + 10 s against 100 + 5 s
    kept.add("vectorized")
    assert choose() == "tiled"        # nothing measured of a kept trace yet: its compile_s stands
    records["tiled"].kept_compile_s = 1.0
    kept.add("tiled")
    assert trial.first_call_s(records, "vectorized", kept=True) == pytest.approx(25.0)   # tiled's share, 1/4
    assert choose() == "tiled"        # 1 + 10 s against 25 + 5 s
    records["vectorized"].kept_compile_s = 2.0
    assert choose() == "vectorized"   # 2 + 5 s against 1 + 10 s
    assert trial.first_call_s(records, "vectorized", kept=False) == 100.0
