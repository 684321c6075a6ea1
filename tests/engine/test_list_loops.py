"""A first-order Jacobian through a loop that carries a ``TensorList`` (a Keras GRU not unrolled: its steps are a
``TensorArray``) starts with ``tiled``: pfor cannot convert that loop's gradient (TensorFlow 2.21: "Required handle
data not set" on its ``variant`` accumulators), and trying it first cost a cold LSTM process 0.9 s of its 4.1 s
(2 s on this GRU). A loop of plain tensors (the RK4 integrator) converts, and keeps ``vectorized`` first."""

from __future__ import annotations

import numpy as np
import pytest

from tests import loop_models
from tests.engine.conftest import loader
from tests.engine.reference import tape_jacobian
from worker.engine import RunOptions, TFMemoryProbe, build_problem, run_problem
from worker.engine.runner import default_plan
from worker.engine.strategies import pfor_fails_on_loops

SEQ = np.random.default_rng(0).standard_normal((2, 5, 3)).astype("float32")
X0 = np.random.default_rng(1).standard_normal(4)


@pytest.fixture(scope="module")
def loop_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("list_loops")
    return loader({"gru": loop_models.gru(root / "gru"), "rk4": loop_models.rk4(root / "rk4")})


def run_rows(problem, **options):
    rows = {}
    report = run_problem(problem, probe=TFMemoryProbe("CPU:0"), options=RunOptions(**options),
                         on_chunk=lambda start, r: rows.update({start + i: np.array(row) for i, row in enumerate(r)}))
    return report, np.stack([rows[i].reshape(-1) for i in sorted(rows)])


def test_the_model_counts_its_loops_that_carry_tensor_lists(loop_model):
    gru, rk4 = loop_model("gru"), loop_model("rk4")
    assert (gru.graph_loops, gru.graph_list_loops) == (1, 1)
    assert (rk4.graph_loops, rk4.graph_list_loops) == (1, 0)


def test_a_gru_jacobian_starts_tiled_and_never_tries_pfor(loop_model):
    gru = loop_model("gru")
    problem = build_problem(gru, {"seq": SEQ})
    assert pfor_fails_on_loops(problem) and default_plan(problem).strategy == "tiled"
    report, rows = run_rows(problem)
    assert report.plan["strategy"] == "tiled" and not report.failures, report.failures
    assert not report.plan["time"].get("failed_calls"), report.plan["time"]
    want = tape_jacobian(gru, {"seq": SEQ}, "y", "seq", use_pfor=False).reshape(len(rows), -1)
    np.testing.assert_allclose(rows, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_pfor_still_fails_on_that_loop(loop_model):
    """Why the order: pinned to ``vectorized``, the GRU's Jacobian fails over to another strategy with pfor's error.
    Should a TensorFlow release convert the loop, this fails and ``pfor_fails_on_loops`` is stale."""
    report, _ = run_rows(build_problem(loop_model("gru"), {"seq": SEQ}), strategy="vectorized")
    assert "handle data" in report.failures.get("vectorized", ""), report.failures


def test_a_loop_of_plain_tensors_keeps_vectorized_first(loop_model):
    problem = build_problem(loop_model("rk4"), {"x0": X0})
    assert not pfor_fails_on_loops(problem) and default_plan(problem).strategy == "vectorized"
    report, _ = run_rows(problem)
    assert report.plan["strategy"] == "vectorized" and not report.failures, report.failures


def test_the_matrix_free_products_of_such_a_loop_try_tiled_before_pfor(loop_model):
    from worker.engine.matfree import build_operator
    from worker.engine.product_labels import candidates

    labels = candidates(build_operator(loop_model("gru"), {"seq": SEQ}, kind="vjp"), "vjp")
    assert labels.index("reverse/tiled") < labels.index("reverse/vectorized"), labels
    labels = candidates(build_operator(loop_model("rk4"), {"x0": X0}, kind="vjp"), "vjp")
    assert "reverse/tiled" not in labels and labels[0] == "reverse/vectorized", labels


def test_the_float64_copy_keeps_the_loop_counts(loop_model):
    """A ``precision: "auto"`` promotion runs the job again on the float64 copy: its strategies are ordered by
    the same counts (a Hessian through loops on ``loop`` first, not on pfor that fails)."""
    from worker.engine.float64 import float64_model

    copy = float64_model(loop_model("gru"))
    assert copy is not loop_model("gru") and (copy.graph_loops, copy.graph_list_loops) == (1, 1)
