"""Sparse Jacobians where a pattern could go wrong (a review's findings): each either gives a pattern no smaller
than the truth or refuses (``PatternUnknown``, so the job computes densely), and never changes the model."""

from __future__ import annotations

import numpy as np
import pytest


def saved(tmp_path, name, body, shape, **attrs):
    """A ``tf.Module`` whose signature ``x`` (float32 ``shape``) -> ``{"y": body(module, x)}``, loaded."""
    import tensorflow as tf

    from worker.engine import load_model

    module = tf.Module()
    for key, value in attrs.items():
        setattr(module, key, value)
    fn = tf.function(lambda x: {"y": body(module, x)}, input_signature=[tf.TensorSpec(shape, tf.float32, name="x")])
    module.f = fn
    tf.saved_model.save(module, str(tmp_path / name), signatures={"serving_default": fn})
    return load_model(str(tmp_path / name))


def truth(model, x):
    import tensorflow as tf

    xt = tf.constant(x)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(xt)
        y = model.fn(x=xt)["y"]
    return tape.jacobian(y, xt, experimental_use_pfor=False).numpy().reshape(int(np.prod(y.shape)), -1) != 0


def detect(model, x):
    from worker.engine.sparsity.walk import detect as run

    return run(model, {"x": x}, of="y", wrt="x")[0].toarray()


def test_captured_constants_before_variables_keep_each_variable_its_value(tmp_path):
    import tensorflow as tf

    c = tf.constant(np.array([1.0], np.float32))
    model = saved(tmp_path, "captures", lambda m, x: tf.gather(x, m.b) * c[0] + 0.0 * tf.cast(
        tf.reduce_sum(m.a), tf.float32), [3], a=tf.Variable(np.array([0, 1, 2], np.int32)),
        b=tf.Variable(np.array([2, 2, 0], np.int32)))
    x = np.ones(3, np.float32)
    np.testing.assert_array_equal(detect(model, x), truth(model, x))


def test_print_passes_its_input_on(tmp_path):
    import tensorflow as tf

    model = saved(tmp_path, "print", lambda m, x: tf.compat.v1.Print(x, [x]) * 2.0, [3])
    x = np.arange(1, 4, dtype=np.float32)
    np.testing.assert_array_equal(detect(model, x), truth(model, x))


def test_a_model_that_writes_variables_is_refused_and_left_unchanged(tmp_path):
    import tensorflow as tf

    from worker.engine.sparsity.walk import PatternUnknown

    def body(m, x):
        m.v.assign(x * 3.0)
        return m.v * 2.0

    model = saved(tmp_path, "assigns", body, [3], v=tf.Variable(np.array([5.0, 6.0, 7.0], np.float32)))
    before = {n: v.numpy().copy() for n, v in model.variables.items()}
    with pytest.raises(PatternUnknown, match="stateful"):
        detect(model, np.ones(3, np.float32))
    for name, value in model.variables.items():
        np.testing.assert_array_equal(value.numpy(), before[name])


def test_value_dependent_shapes_are_refused(tmp_path):
    import tensorflow as tf

    from worker.engine.sparsity.walk import PatternUnknown

    model = saved(tmp_path, "where", lambda m, x: tf.reduce_sum(tf.gather(x, tf.where(x > 0)[:, 0])) + 0 * x, [4])
    with pytest.raises(PatternUnknown, match="Where"):
        detect(model, np.array([1.0, -1.0, 2.0, 3.0], np.float32))


def test_a_loop_whose_end_depends_on_values_is_never_run_on_stand_ins(tmp_path):
    import tensorflow as tf

    model = saved(tmp_path, "loop", lambda m, x: tf.while_loop(lambda z: tf.reduce_sum(tf.abs(z)) < 100.0,
                                                               lambda z: 2.0 * z, [x])[0], [4])
    x = np.ones(4, np.float32)
    pattern = detect(model, x)     # returns (the loop is given the conservative rule), does not hang
    assert not (truth(model, x) & ~pattern).any()


def test_verification_catches_a_missed_entry_in_a_column_of_small_values(tmp_path):
    import scipy.sparse as sp
    import tensorflow as tf

    from worker.engine.matfree import build_operator
    from worker.engine.sparsity import compressed
    from worker.engine.sparsity.colouring import colour

    model = saved(tmp_path, "scales", lambda m, x: tf.concat([1e6 * x[:5], x[5:]], 0), [10])
    x = np.random.default_rng(0).standard_normal(10).astype(np.float32)
    guess = compressed.sorted_pattern(sp.csr_array((np.ones(5, bool), (np.arange(5), np.arange(5))),
                                                   shape=(10, 10)))    # misses the five small entries
    op = build_operator(model, {"x": x}, of="y", wrt="x")
    c = colour(guess, "forward")
    ok, worst = compressed.verify(op, guess, c, compressed.compute(op, c))
    assert not ok and worst > 0.5
    full = compressed.sorted_pattern(sp.identity(10, dtype=bool, format="csr"))
    c = colour(full, "forward")
    assert compressed.verify(op, full, c, compressed.compute(op, c))[0]


def test_a_job_falls_back_to_dense_when_detection_refuses(tmp_path):
    import tensorflow as tf

    from worker.sparse_job import DenseInstead, compute_sparse_to_storage

    model = saved(tmp_path, "where_job", lambda m, x: tf.reduce_sum(tf.gather(x, tf.where(x > 0)[:, 0])) + 0 * x,
                  [4])
    from worker.execution.local import local_context

    ctx = local_context(model, {"x": np.ones(4, np.float32)}, of="y", wrt="x", sparsity="auto",
                        results_url=str(tmp_path / "results"), job_id="w", cache_dir=str(tmp_path / "cache"))
    outcome = compute_sparse_to_storage(ctx)
    assert isinstance(outcome, DenseInstead) and "Where" in outcome.sparsity["fallback"]
