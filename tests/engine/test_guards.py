"""The engine's guards against a silently wrong result: the forward-mode test before a job, and the eager
reference rows that decide the strategy trials."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.conftest import rand
from tests.engine.reference import tape_jacobian
from worker.engine import compute_in_memory


@pytest.fixture(scope="module")
def constant_sum(tmp_path_factory):
    """Outputs whose sum does not depend on anything (``J^T 1 = 0``): ``y = [h, -h]`` with ``h = tanh(x w)``,
    and ``p = softmax(x w)``; ``x`` (None, 2), ``w`` (2, 3) a variable."""
    import tensorflow as tf

    from worker.engine import load_model

    class ConstantSum(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(rand((2, 3)), name="w")

        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x")])
        def __call__(self, x):
            h = tf.tanh(x @ self.w)
            return {"y": tf.concat([h, -h], axis=1), "p": tf.nn.softmax(x @ self.w)}

    path = tmp_path_factory.mktemp("guards") / "constant_sum"
    module = ConstantSum()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.__call__})
    return load_model(str(path))


def test_forward_mode_of_a_softmax_is_not_refused(constant_sum):
    """With an all-ones cotangent both sides of the dot-product test were rounding noise (``J^T 1 = 0``), and
    a correct forward mode was refused; random cotangents test it."""
    inputs = {"x": rand((8, 2), seed=1)}
    got, report = compute_in_memory(constant_sum, inputs, of="p", wrt="x", mode="forward")
    assert report.plan["mode"] == "forward" and not report.failures, report.failures
    np.testing.assert_allclose(got, tape_jacobian(constant_sum, inputs, "p", "x"), rtol=0, atol=1e-6)


def test_a_wrong_jvp_that_keeps_the_sum_is_caught(constant_sum, monkeypatch):
    """A JVP that is wrong but keeps ``sum(J t)`` (here: its rows in reverse order) passed the all-ones
    test; random cotangents see it, and ``auto`` runs in reverse mode (right), ``forward`` is refused."""
    import tensorflow as tf

    from worker.engine import NotDifferentiable, build_problem

    jvp = tf.autodiff.ForwardAccumulator.jvp

    def reversed_jvp(self, y, **kwargs):
        return tf.reverse(jvp(self, y, **kwargs), [0])

    monkeypatch.setattr(tf.autodiff.ForwardAccumulator, "jvp", reversed_jvp)
    inputs = {"x": rand((8, 2), seed=1)}
    assert build_problem(constant_sum, inputs, of="y", wrt="x", mode="auto").mode == "reverse"
    with pytest.raises(NotDifferentiable, match=r"^mode: TensorFlow's forward mode fails .*dot-product test") as info:
        build_problem(constant_sum, inputs, of="y", wrt="x", mode="forward")
    assert info.value.field == "mode" and "use mode 'reverse' or 'auto'" in str(info.value)
    monkeypatch.undo()
    assert build_problem(constant_sum, inputs, of="y", wrt="x", mode="auto").mode == "forward"


@pytest.mark.parametrize("kind", ["jacobian", "batch_jacobian"])
def test_forward_mode_is_not_used_at_non_finite_derivatives(tmp_path, kind):
    """``sqrt`` at 0: forward mode spreads ``0 * inf = NaN`` over entries where GradientTape (reverse mode) has
    0. The dot-product test sees a non-finite derivative: 'auto' (forward by count here) runs in reverse mode
    and equals the tape, NaN and inf in the same places; an explicit 'forward' is refused with the reason."""
    import tensorflow as tf

    from worker.engine import NotDifferentiable, load_model

    class Sqrt(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x")])
        def __call__(self, x):
            return {"y": tf.concat([tf.sqrt(x), x * x], axis=1)}

    module = Sqrt()
    tf.saved_model.save(module, str(tmp_path / "sqrt"), signatures={"serving_default": module.__call__})
    model = load_model(str(tmp_path / "sqrt"))
    inputs = {"x": np.array([[0.0, 4.0], [1.0, 0.0], [9.0, 2.0]], np.float32)}
    want = tape_jacobian(model, inputs, "y", "x", batch=kind == "batch_jacobian")
    got, report = compute_in_memory(model, inputs, kind=kind, mode="auto")
    assert report.plan["mode"] == "reverse"
    np.testing.assert_array_equal(got, want)
    with pytest.raises(NotDifferentiable, match=r"^mode: .*the derivative is not finite at these inputs"):
        compute_in_memory(model, inputs, kind=kind, mode="forward")


def test_a_trial_is_judged_by_the_reference_rows_not_by_the_incumbent(loaded, monkeypatch, tmp_path):
    """A ``tiled`` that is wrong beyond the first and last rows of a chunk (the rows every chunk size has
    checked against the reference) used to be the reference of the trials: a right ``vectorized`` was
    dropped for disagreeing with it. The eager reference rows decide: the candidate stays, and the
    incumbent is the one dropped; the rows it delivered are computed again, so that even this job's
    result, in memory or in storage, equals the tape."""
    import tensorflow as tf
    import zarr

    import worker.engine.chunk_run as chunk_run
    from worker.engine import RunOptions, build_problem, run_problem
    from worker.engine.errors import WrongRowsDelivered
    from worker.pipeline import compute_to_storage

    real = chunk_run.chunk_function

    def wrong_inside(problem, label, **options):
        fn = real(problem, label, **options)
        if label != "tiled":
            return fn

        def rows(start, k):
            out = fn(start, k)
            return out if k < 3 else tf.concat([out[:1], out[1:-1] + 1.0, out[-1:]], axis=0)
        return rows

    monkeypatch.setattr(chunk_run, "chunk_function", wrong_inside)
    model = loaded("mlp")
    inputs = {"x": rand((16, 8), seed=3)}
    want = tape_jacobian(model, inputs, "y", "x")
    problem = build_problem(model, inputs)
    with pytest.raises(WrongRowsDelivered) as caught:  # run_problem: the rows tiled delivered, to redo
        run_problem(problem, options=RunOptions(refine="always", memory_budget_bytes=10**9), plan=calibrated_tiled())
    learned = caught.value.learned
    ranges = caught.value.ranges  # tiled's 16-row chunks before the trial (one or two: when it came first)
    assert ranges[0] == (0, 16) and all(b - a == 16 for a, b in ranges), ranges
    assert learned.record("vectorized").status == "ok", learned.record("vectorized")
    assert learned.record("tiled").status == "disagrees" and learned.strategy == "vectorized"
    # compute_in_memory computes them again: the first job is right already
    got, report = compute_in_memory(model, inputs, plan=calibrated_tiled(), refine="always",
                                    memory_budget_bytes=10**9)
    assert report.learned.record("tiled").status == "disagrees" and report.plan["strategy"] == "vectorized"
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # compute_to_storage uncommits the storage blocks that hold them and computes those again
    results = str(tmp_path / "results")
    learned_plans = []
    manifest = compute_to_storage(problem, results_url=results, job_id="redo", plan=calibrated_tiled(),
                                  refine="always", memory_budget_bytes=10**9, block_bytes=8 * 4 * 4,
                                  on_learned=learned_plans.append)
    stored = zarr.open_array(manifest["uri"] + "/jacobian", mode="r")[...]
    np.testing.assert_allclose(stored, want, rtol=0, atol=1e-5)
    assert learned_plans[0].record("tiled").status == "disagrees"


def calibrated_tiled():
    """A plan calibrated already on ``tiled``: 16-row chunks at once, a trial after the second."""
    from worker.engine import LinearFit
    from worker.engine.plan import Plan

    plan = Plan(strategy="tiled")
    tiled = plan.record("tiled")
    tiled.status, tiled.rates, tiled.preferred_rows = "ok", {16: 1e4}, 16
    tiled.memory, tiled.seconds = LinearFit(0.0, 1e7), LinearFit(0.0, 1e-4)
    return plan


@pytest.fixture(scope="module")
def sqrt_models(tmp_path_factory):
    """``y = sqrt(x)`` (independent examples, an infinite derivative at 0) and ``z = sqrt(x) + mean(x)`` over
    the batch (dependent); ``x`` (None, 3)."""
    import tensorflow as tf

    from worker.engine import load_model

    class Sqrt(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def __call__(self, x):
            return {"y": tf.sqrt(x), "z": tf.sqrt(x) + tf.reduce_mean(x, axis=0, keepdims=True)}

    path = tmp_path_factory.mktemp("guards") / "sqrt"
    module = Sqrt()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.__call__})
    return load_model(str(path))


def test_the_independence_check_is_nan_aware(sqrt_models):
    """A zero in the probed example made its derivative infinite, the tolerance infinite, and a batch that
    depends on other examples passed; and 0 * inf = NaN on an independent example is no dependence."""
    from worker.engine import build_problem
    from worker.engine.errors import BatchNotIndependent

    x = np.abs(rand((4, 3), seed=2)) + 0.5
    x[0, 0] = x[3, 1] = 0.0  # the probed examples (first and last) have an infinite derivative
    inputs = {"x": x}
    independent = build_problem(sqrt_models, inputs, of="y", kind="batch_jacobian", check_independence=True)
    got, _ = compute_in_memory(sqrt_models, inputs, of="y", kind="batch_jacobian")
    assert np.isinf(got[0, 0, 0]) and got[1, 0, 0] == 0.5 / np.sqrt(x[1, 0])
    assert independent.kind == "batch_jacobian"
    with pytest.raises(BatchNotIndependent, match="independent examples"):
        build_problem(sqrt_models, inputs, of="z", kind="batch_jacobian", check_independence=True)
