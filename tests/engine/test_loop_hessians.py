"""Hessians through a ``tf.while_loop`` whose body reads a captured variable (issue 30): coupled oscillators
integrated in a float64 loop (``tests.loop_models.oscillators``). TensorFlow refused every second derivative of the
loaded loop ('variable without handle data'); with the handle data restored (``worker.engine.loop_handles``) the
dense Hessian, ``hvp`` (w.r.t. the input and w.r.t. the variable) and ``hessian_eig`` equal nested GradientTapes on
the same function exported with the variable read before the loop, and the one-row ``loop`` strategy runs first
(pfor fails on a loop's second derivative after tens of seconds)."""

from __future__ import annotations

import numpy as np
import pytest

from tests import loop_models
from tests.engine.conftest import loader

Q0 = np.random.default_rng(7).standard_normal(6)
PFOR = ("vectorized", "forward/vectorized", "reverse/vectorized")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop_hessians")
    return {"read": loop_models.oscillators(root / "read"),
            "before": loop_models.oscillators(root / "before", read_in_loop=False)}


@pytest.fixture(scope="module")
def model(paths):
    return loader(paths)


@pytest.fixture(scope="module")
def reference(paths):
    """``(H w.r.t. q0, H w.r.t. k)`` of ``energy`` by nested tapes, eagerly, a tape pair per row, on the export that
    reads ``k`` before the loop (the same function; TensorFlow differentiates it twice without our help)."""
    import tensorflow as tf

    loaded = tf.saved_model.load(str(paths["before"]))
    fn = loaded.signatures["serving_default"]
    x = tf.constant(Q0)

    def rows(source, n):
        out = []
        for i in range(n):
            with tf.GradientTape() as outer:
                outer.watch(source)
                with tf.GradientTape() as inner:
                    inner.watch(source)
                    energy = fn(q0=x)["energy"]
                g = tf.reshape(inner.gradient(energy, source), [-1])
            out.append(np.ravel(outer.gradient(g, source, output_gradients=tf.one_hot(i, n, dtype=tf.float64))))
        return np.stack(out)

    return rows(x, 6), rows(loaded.k, 36)


def test_dense_hessian_through_the_loop_equals_nested_tapes(model, reference):
    from worker.engine import compute_in_memory

    hessian, report = compute_in_memory(model("read"), {"q0": Q0}, of="energy", wrt="q0", kind="hessian")
    np.testing.assert_allclose(hessian, reference[0], rtol=1e-10, atol=1e-12)
    assert report.plan["strategy"] == "loop", report.plan
    assert not set(report.failures) & set(PFOR), report.failures   # pfor not tried first


def test_hvp_wrt_input_and_variable_and_hessian_eig(model, reference):
    from worker.engine.matfree import build_operator, run_products
    from worker.engine.spectra import hessian_eig

    op = build_operator(model("read"), {"q0": Q0}, of="energy", wrt="q0", kind="hvp")
    seeds = np.random.default_rng(8).standard_normal((3, 6))
    result = run_products(op, "hvp", seeds)
    np.testing.assert_allclose(result.arrays["products"], seeds @ reference[0], rtol=1e-10, atol=1e-12)
    assert op.labels["hvp"] == "reverse/loop" and not op.failures, (op.labels, op.failures)

    eig = hessian_eig(op, 2, tol=1e-8)
    want = np.linalg.eigvalsh(reference[0])
    want = want[np.argsort(-np.abs(want))][:2]
    np.testing.assert_allclose(eig.arrays["eigenvalues"], want, rtol=1e-8)

    on_k = build_operator(model("read"), {"q0": Q0}, of="energy", wrt="variables/*", kind="hvp")
    seeds = np.random.default_rng(9).standard_normal((2, 36))
    np.testing.assert_allclose(on_k.hvp(seeds), seeds @ reference[1], rtol=1e-10,
                               atol=1e-12 * float(np.abs(reference[1]).max()))


def test_while_ops_get_their_handle_data(model):
    """The loaded loop's resource output carries the variable's dtype and shape (what TensorFlow dropped)."""
    from tensorflow.python.ops import resource_variable_ops

    graphs = [model("read").loaded.__call__.concrete_functions[0].graph]
    loops = [op for g in graphs for op in g.get_operations() if op.type == "While"]
    assert loops and model("read").graph_loops == 1
    handles = [t for op in loops for t in op.outputs if t.dtype.name == "resource"]
    assert handles
    for t in handles:
        data = resource_variable_ops.get_eager_safe_handle_data(t)
        assert data is not None and data.is_set and data.shape_and_type[0].dtype == 2   # DT_DOUBLE


def test_a_hessian_through_loops_starts_with_the_loop_strategy():
    from worker.engine.tuning import default_order

    applicable = ["vectorized", "loop", "eager"]
    assert default_order(applicable, graph_ops=50) == ["vectorized", "loop", "eager"]
    assert default_order(applicable, graph_ops=50, second_order_loops=True) == ["loop", "vectorized", "eager"]
    assert default_order(applicable, "vectorized", second_order_loops=True)[0] == "vectorized"   # a similar request's
