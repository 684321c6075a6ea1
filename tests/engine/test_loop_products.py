"""JVPs and VJPs through loops (issue 30): a Keras GRU that is not unrolled and an RK4 integrator in a float64
``tf.while_loop``, both reading a captured variable in the loop body. ``jvp`` and ``svd`` equal ``J v`` and numpy's svd
of the Jacobian from GradientTape (rows by reverse mode, no pfor); with the loop's handle data restored
(``worker.engine.loop_handles``) the GRU's products run in a ``tf.function``, not eagerly. Where forward mode and
second derivatives still fail (``crop_and_resize``: no gradient of ``CropAndResizeGradImage``) ``reverse/rows`` answers,
and refusals that remain name the fix; TensorFlow's own error dumps stay out of the log (``worker.engine.tf_logs``)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tests import loop_models
from tests.engine.conftest import loader

SEQ = np.random.default_rng(0).standard_normal((2, 5, 3)).astype("float32")
X0 = np.random.default_rng(1).standard_normal(4)
IMAGES = np.random.default_rng(6).standard_normal((2, 3, 3, 1)).astype("float32")
EAGER_OR_ROWS = ("reverse/eager", "reverse/rows")


@pytest.fixture(scope="module")
def loop_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("loops")
    paths = {"gru": loop_models.gru(root / "gru"), "rk4": loop_models.rk4(root / "rk4"),
             "crop": loop_models.crop(root / "crop")}
    return loader(paths)


def operator(model, kind="jvp", **options):
    from worker.engine.matfree import build_operator

    inputs = {"seq": SEQ} if "seq" in model.input_specs else {"x": IMAGES} if "x" in model.input_specs else {"x0": X0}
    return build_operator(model, inputs, kind=kind, **options)


def tape_matrix(op) -> np.ndarray:
    """J (n_of, n_wrt) over the operator's sources by GradientTape, eagerly, one row (one-hot cotangent) at a time:
    ``tape.jacobian`` runs its rows in a ``tf.function``, where TensorFlow fails on the GRU's loop."""
    import tensorflow as tf

    targets = op.axis.targets(op.model, op.inputs)
    rows = []
    for i in range(op.n_of):   # a tape per row: through the GRU's loop a persistent tape fails too
        with tf.GradientTape() as tape:
            tape.watch(targets)
            y = op.model.fn(**op.inputs)[op.of]
        onehot = tf.reshape(tf.one_hot(i, op.n_of, dtype=y.dtype), tf.shape(y))
        grads = tape.gradient(y, targets, output_gradients=onehot, unconnected_gradients="zero")
        rows.append(np.concatenate([np.asarray(g, np.float64).ravel() for g in grads]))
    return np.stack(rows)


def assert_close(got: np.ndarray, want: np.ndarray, tol: float) -> None:
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * scale)


def test_jvp_on_a_gru_equals_tape_jacobian_times_v(loop_model):
    from worker.engine.matfree import run_products

    op = operator(loop_model("gru"))
    seeds = np.random.default_rng(2).standard_normal((3, op.n_wrt)).astype("float32")
    result = run_products(op, "jvp", seeds)
    assert_close(result.arrays["products"].reshape(3, -1), seeds @ tape_matrix(op).T, 1e-5)
    assert result.arrays["products"].shape == (3,) + op.of_shape and result.arrays["products"].dtype == np.float32
    assert op.labels["jvp"] not in EAGER_OR_ROWS, (op.labels, op.failures)   # compiled: the loop's handles restored


def test_vjps_on_a_gru_run_compiled_and_equal_the_tape(loop_model):
    """Issue 30's "GRU VJPs eager-only": in a tf.function TensorFlow failed on the loop's variable handle ('variable
    without handle data'); with it restored the VJPs run compiled (tiled or vectorized)."""
    op = operator(loop_model("gru"), kind="vjp")
    cotangents = np.random.default_rng(7).standard_normal((5, op.n_of)).astype("float32")
    assert_close(op.vjp(cotangents), cotangents @ tape_matrix(op), 1e-5)
    assert op.labels["vjp"] not in EAGER_OR_ROWS and op.labels["vjp"].startswith("reverse/"), (op.labels, op.failures)


def test_svd_rank_2_on_a_gru_equals_numpys(loop_model):
    from worker.engine.spectra import svd

    op = operator(loop_model("gru"))
    jac = tape_matrix(op)
    result = svd(op, 2, tol=1e-4)
    s_ref = np.linalg.svd(jac, compute_uv=False)
    np.testing.assert_allclose(result.arrays["S"], s_ref[:2], rtol=1e-4)
    assert result.converged and result.products["jvp"] > 0 and result.products["vjp"] > 0


@pytest.mark.parametrize("wrt", ["x0", ["x0", "variables/w"]], ids=["x0", "x0+w"])
def test_jvp_on_the_rk4_integrator_equals_tape_jacobian_times_v(loop_model, wrt):
    op = operator(loop_model("rk4"), wrt=wrt)
    assert op.compute_dtype == "float64"
    seeds = np.random.default_rng(3).standard_normal((4, op.n_wrt))
    assert_close(op.jvp(seeds).reshape(4, -1), seeds @ tape_matrix(op).T, 1e-9)


def test_rows_route_is_chosen_where_forward_mode_fails_and_each_failure_is_one_log_line(loop_model, caplog):
    """On crop_and_resize every other label fails; each failure is one INFO line from the engine, none of
    TensorFlow's own records reaches the log, and the J kept by reverse/rows serves the next calls (J v and u^T J)
    without more VJPs through TensorFlow."""
    op = operator(loop_model("crop"))
    seeds = np.random.default_rng(4).standard_normal((2, op.n_wrt)).astype("float32")
    with caplog.at_level(logging.INFO):
        op.jvp(seeds)
    if op.labels["jvp"] != "reverse/rows":
        pytest.fail(f"forward mode or the derivative of a VJP worked on crop_and_resize ({op.labels}): the test "
                    "model no longer shows the failure reverse/rows answers")
    assert not [r for r in caplog.records if r.name.startswith("tensorflow")]
    failed = [r.getMessage() for r in caplog.records if r.name == "worker.engine.matfree" and " failed: " in
              r.getMessage()]
    assert all("\n" not in line for line in failed)
    tried = [line.split(" failed: ")[0] for line in failed]   # "kind: label", each once
    assert len(tried) == len(set(tried)), failed
    raised = {k for k, v in op.failures.items() if not v.startswith("disagrees")}   # wrong rows: caught, not logged
    assert raised == {t.split(": ")[1] if t.startswith("jvp: ") else t.replace(": ", " ") for t in tried}
    assert [t for t in tried if t.startswith("jvp: ")] == [f"jvp: {label}" for label in op.candidates("jvp")[:-1]
                                                           if label in raised]
    vjps = op.counts["vjp"]
    assert vjps == op.n_of
    products = op.jvp(seeds)
    assert op.counts["vjp"] == vjps and op.counts["jvp"] == 4
    assert_close(products.reshape(2, -1), seeds @ tape_matrix(op).T, 1e-5)
    cotangents = np.random.default_rng(5).standard_normal((2, op.n_of)).astype("float32")
    assert_close(op.vjp(cotangents), cotangents @ tape_matrix(op), 1e-5)   # u^T J from the J kept


def test_a_refusal_names_the_fix(loop_model):
    from worker.engine.errors import NotDifferentiable

    op = operator(loop_model("crop"))
    op.plan_memory(None, budget_bytes=100)   # J takes 8 x 18 x 4 = 576 bytes
    with pytest.raises(NotDifferentiable) as err:
        op.jvp(np.ones((1, op.n_wrt), "float32"))
    assert err.value.field == "memory_budget_bytes"
    assert "set memory_budget_bytes to at least 576" in str(err.value), str(err.value)

    forward = operator(loop_model("crop"), routes={"jvp": "forward"})
    with pytest.raises(NotDifferentiable) as err:
        forward.jvp(np.ones((1, forward.n_wrt), "float32"))
    assert err.value.field == "mode" and "use mode 'auto' or 'reverse'" in str(err.value), str(err.value)


def test_tensorflow_log_records_are_held_and_counted_on_the_error():
    from worker.engine import tf_logs
    from worker.engine.problem import error_summary

    logger = logging.getLogger("tensorflow")
    before = (logger.handlers[:], logger.propagate)
    with tf_logs.captured() as records:
        logger.error("Got error while pfor was converting op %s", "While")
        logger.info("not kept: below WARNING")
    assert [r.getMessage() for r in records] == ["Got error while pfor was converting op While"]
    assert (logger.handlers, logger.propagate) == before

    with pytest.raises(ValueError) as err:
        with tf_logs.captured():
            logger.error("Created at:\n  File ...")
            logger.warning("Using a while_loop for converting ...")
            raise ValueError("pfor failed")
    assert err.value.tf_logged == 2
    assert error_summary(err.value) == "ValueError: pfor failed (TensorFlow logged 2 lines before this error; " \
                                       "not shown)"
    assert (logger.handlers, logger.propagate) == before
