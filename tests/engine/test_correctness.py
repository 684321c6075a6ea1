"""Every kind, mode and strategy equals TensorFlow's own answer on a spread of models."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.conftest import rand
from tests.engine.reference import finite_differences, tape_hessian, tape_jacobian
from worker.engine import compute_in_memory

STRATEGIES = ["vectorized", "vectorized+xla", "tiled", "loop", "eager", None]

# name, inputs, of, wrt, batch-capable
CASES = {
    "mlp": (lambda: {"x": rand((3, 8))}, "y", "x"),
    "cnn": (lambda: {"image": rand((2, 8, 8, 3))}, "logits", "image"),
    "multi_io_u_a": (lambda: {"a": rand((2, 4)), "b": rand((2, 3), seed=1)}, "u", "a"),
    "multi_io_v_b": (lambda: {"a": rand((2, 4)), "b": rand((2, 3), seed=1)}, "v", "b"),
    "int_input": (lambda: {"ids": np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32), "x": rand((2, 4))}, "y", "x"),
    "rnn": (lambda: {"seq": rand((2, 4, 3))}, "h", "seq"),
    "float64": (lambda: {"x": rand((3, 5), "float64")}, "y", "x"),
    "grid": (lambda: {"x": rand((3, 6))}, "grid", "x"),
}
MODEL_OF = {"multi_io_u_a": "multi_io", "multi_io_v_b": "multi_io"}


def _case(name):
    make, of, wrt = CASES[name]
    return MODEL_OF.get(name, name), make(), of, wrt


def _assert_close(got, want, dtype="float32"):
    tol = 1e-9 if dtype == "float64" else 2e-5
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)


# TensorFlow's forward mode breaks on int_input: test_forward_mode_failure_inside_tensorflow_is_explained
JACOBIAN_CASES = [(case, mode) for case in CASES for mode in ("reverse", "forward")
                  if not (case == "int_input" and mode == "forward")]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case,mode", JACOBIAN_CASES)
def test_jacobian_matches_tape(loaded, case, mode, strategy):
    name, inputs, of, wrt = _case(case)
    model = loaded(name)
    want = tape_jacobian(model, inputs, of, wrt)
    got, report = compute_in_memory(model, inputs, of=of, wrt=wrt, mode=mode, strategy=strategy, chunk_rows=3)
    assert got.shape == want.shape
    _assert_close(got, want, str(want.dtype))
    if strategy is not None:
        assert report.plan["strategy"] == strategy


@pytest.mark.parametrize("mode", ["reverse", "forward"])
@pytest.mark.parametrize("strategy", STRATEGIES + ["per_example", "per_example+xla"])
@pytest.mark.parametrize("case", ["mlp", "cnn", "multi_io_u_a", "rnn", "float64", "int_input", "grid"])
def test_batch_jacobian_matches_tape(loaded, case, mode, strategy):
    name, inputs, of, wrt = _case(case)
    model = loaded(name)
    if case == "int_input" and mode == "forward":
        mode = "auto"  # TensorFlow's forward mode breaks on this model; auto must pick reverse
    want = tape_jacobian(model, inputs, of, wrt, batch=True)
    got, report = compute_in_memory(model, inputs, of=of, wrt=wrt, kind="batch_jacobian", mode=mode,
                                    strategy=strategy, chunk_rows=3, check_independence=True)
    assert got.shape == want.shape
    _assert_close(got, want, str(want.dtype))
    if strategy is not None:  # the pinned strategy ran: no fallback hid a failure of it
        assert report.plan["strategy"] == strategy and not report.failures, report.failures


@pytest.mark.parametrize("kind", ["jacobian", "batch_jacobian"])
@pytest.mark.parametrize("mode", ["reverse", "forward"])
@pytest.mark.parametrize("case", ["mlp", "cnn", "float64"])
def test_tiled_xla_matches_tape(loaded, case, mode, kind):
    """``tiled+xla``: XLA pads a chunk to a power of two (3 rows run as 4) and slices on the device."""
    name, inputs, of, wrt = _case(case)
    model = loaded(name)
    want = tape_jacobian(model, inputs, of, wrt, batch=kind == "batch_jacobian")
    got, report = compute_in_memory(model, inputs, of=of, wrt=wrt, kind=kind, mode=mode, strategy="tiled+xla",
                                    chunk_rows=3)
    assert report.plan["strategy"] == "tiled+xla" and not report.failures, report.failures
    _assert_close(got, want, str(want.dtype))


@pytest.mark.parametrize("mode", ["reverse", "forward"])
@pytest.mark.parametrize("strategy", ["vectorized", "loop", "eager", None])
def test_hessian_of_scalar_matches_tape(loaded, mode, strategy):
    model = loaded("float64")
    inputs = {"x": rand((2, 5), "float64")}
    want = tape_hessian(model, inputs, "loss", "x")
    got, _ = compute_in_memory(model, inputs, of="loss", kind="hessian", mode=mode, strategy=strategy, chunk_rows=4)
    assert got.shape == (2, 5, 2, 5)
    _assert_close(got, want, "float64")
    np.testing.assert_allclose(got.reshape(10, 10), got.reshape(10, 10).T, atol=1e-9)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_hessian_with_reduce_sum(loaded, mode):
    model = loaded("mlp")
    inputs = {"x": rand((2, 8))}
    want = tape_hessian(model, inputs, "y", "x", reduce="sum")
    got, _ = compute_in_memory(model, inputs, of="y", kind="hessian", reduce="sum", mode=mode, chunk_rows=5)
    _assert_close(got, want)


@pytest.mark.parametrize("mode", ["reverse", "auto"])
@pytest.mark.parametrize("strategy", ["vectorized", "loop", None])
def test_parameter_jacobian(loaded, mode, strategy):
    model = loaded("mlp")
    inputs = {"x": rand((3, 8))}
    want = tape_jacobian(model, inputs, "y", "variables/d0/kernel")
    got, _ = compute_in_memory(model, inputs, wrt="variables/d0/kernel", mode=mode, strategy=strategy, chunk_rows=5)
    assert got.shape == (3, 4, 8, 16)
    _assert_close(got, want)


def test_parameter_jacobian_by_unique_suffix_and_embedding(loaded):
    model = loaded("int_input")
    inputs = {"ids": np.array([[1, 2, 3, 4]], np.int32), "x": rand((1, 4))}
    want = tape_jacobian(model, inputs, "y", "variables/emb/embeddings")
    got, _ = compute_in_memory(model, inputs, wrt="variables/embeddings", chunk_rows=2)
    _assert_close(got, want)


@pytest.mark.parametrize("mode", ["reverse", "auto"])
def test_control_flow_module(loaded, mode):
    model = loaded("control_flow")
    for x in (np.array([0.3, -0.2, 0.5], np.float32), np.array([-0.3, -0.2, 0.1], np.float32)):  # both cond branches
        want = tape_jacobian(model, {"x": x}, "y", "x")
        got, _ = compute_in_memory(model, {"x": x}, mode=mode, chunk_rows=2)
        _assert_close(got, want)


@pytest.mark.parametrize("kind", ["jacobian", "batch_jacobian"])
@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_float64_matches_finite_differences(loaded, kind, mode):
    model = loaded("float64")
    inputs = {"x": rand((3, 5), "float64")}
    fd = finite_differences(model, inputs, "y", "x")
    got, _ = compute_in_memory(model, inputs, kind=kind, of="y", mode=mode, chunk_rows=3)
    if kind == "batch_jacobian":
        fd = np.stack([fd[b, :, b, :] for b in range(3)])
    np.testing.assert_allclose(got, fd, atol=1e-6, rtol=1e-6)


def test_hessian_matches_finite_differences_of_gradient(loaded):
    import tensorflow as tf

    model = loaded("float64")
    x0 = rand((1, 5), "float64")
    got, _ = compute_in_memory(model, {"x": x0}, of="loss", kind="hessian", chunk_rows=3)

    def grad(x):
        xt = tf.constant(x)
        with tf.GradientTape() as t:
            t.watch(xt)
            s = model.fn(x=xt)["loss"]
        return t.gradient(s, xt).numpy()

    eps = 1e-6
    cols = []
    for i in range(5):
        d = np.zeros_like(x0)
        d.flat[i] = eps
        cols.append((grad(x0 + d) - grad(x0 - d)) / (2 * eps))
    fd = np.stack(cols, axis=-1).reshape(1, 5, 1, 5)
    np.testing.assert_allclose(got, fd, atol=1e-6)


@pytest.mark.parametrize("strategy", ["vectorized", "loop", "eager", None])
def test_loop_reading_a_variable_is_differentiated(model_dir, strategy):
    """A loop body that reads a variable of the loaded model: on a persistent tape TensorFlow fails with
    'variable without handle data' (the engine refused this model before); the engine's tapes are
    not persistent, so every strategy gets through, and the rows are right: y = x * v**2, v = 1.5.
    (A model of its own per case: once graph-mode gradients of it were built, TensorFlow's eager
    gradient of the same loaded object fails the same way.)"""
    from worker.engine import load_model

    model = load_model(str(model_dir["variable_in_loop"]))
    got, report = compute_in_memory(model, {"x": rand((2, 2))}, strategy=strategy, chunk_rows=3)
    assert not report.failures, report.failures
    np.testing.assert_allclose(got.reshape(4, 4), 2.25 * np.eye(4), atol=1e-6)


def test_every_strategy_failing_gives_one_message_naming_the_field_and_the_fix(loaded):
    from worker.engine import build_problem
    from worker.engine.trial import fail_all

    problem = build_problem(loaded("mlp"), {"x": rand((2, 8))})
    err = fail_all(problem, {"vectorized": "ValueError: variable without handle data",
                              "eager": "ValueError: variable without handle data"})
    message = str(err)
    assert err.field == "wrt" and message.startswith("wrt: TensorFlow cannot differentiate 'y'")
    assert "variable without handle data" in message and "Re-export the model" in message and len(message) < 800


def test_op_without_gradient_gives_a_message(loaded):
    """build_problem probes only the forward pass in reverse mode; the missing gradient surfaces from
    the first chunk, every strategy failing alike, as one message naming the op."""
    from worker.engine import NotDifferentiable

    with pytest.raises(NotDifferentiable, match=r"wrt: TensorFlow cannot differentiate 'y'.*LookupError.*Lu"):
        compute_in_memory(loaded("no_gradient"), {"x": rand((2, 3, 3))})


@pytest.mark.parametrize("strategy", [None, "tiled", "loop", "eager"])
def test_unconnected_wrt_is_refused_naming_the_field(tmp_path, strategy):
    import tensorflow as tf

    from worker.engine import InvalidRequest, load_model

    class Unused(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="a"),
                                      tf.TensorSpec([None, 2], tf.float32, name="b")])
        def __call__(self, a, b):
            return {"y": 2.0 * a}

    module = Unused()
    tf.saved_model.save(module, str(tmp_path / "unused"), signatures={"serving_default": module.__call__})
    model = load_model(str(tmp_path / "unused"))
    with pytest.raises(InvalidRequest, match=r"wrt: 'y' does not depend on 'b'") as info:
        compute_in_memory(model, {"a": rand((2, 2)), "b": rand((2, 2), seed=1)}, wrt="b", strategy=strategy)
    assert info.value.field == "wrt"


@pytest.mark.parametrize("chunk_rows", [1, 3, 5, 7, 64])
@pytest.mark.parametrize("strategy", ["vectorized", "tiled"])
def test_chunked_equals_unchunked(loaded, chunk_rows, strategy):
    model = loaded("cnn")
    inputs = {"image": rand((2, 8, 8, 3))}  # 10 output rows: most chunk sizes do not divide it
    whole, _ = compute_in_memory(model, inputs, strategy=strategy, chunk_rows=16)
    chunked, _ = compute_in_memory(model, inputs, strategy=strategy, chunk_rows=chunk_rows)
    np.testing.assert_allclose(chunked, whole, atol=1e-6)


def test_same_chunking_is_bitwise_reproducible(loaded):
    model = loaded("cnn")
    inputs = {"image": rand((2, 8, 8, 3))}
    a, _ = compute_in_memory(model, inputs, strategy="vectorized", chunk_rows=4)
    b, _ = compute_in_memory(model, inputs, strategy="vectorized", chunk_rows=4)
    assert a.tobytes() == b.tobytes()


def test_row_ranges_cover_only_what_is_asked(loaded):
    from worker.engine import RunOptions, build_problem, run_problem

    model = loaded("mlp")
    inputs = {"x": rand((3, 8))}
    want = tape_jacobian(model, inputs, "y", "x").reshape(12, 3, 8)
    problem = build_problem(model, inputs)
    seen = {}
    run_problem(problem, options=RunOptions(chunk_rows=2), ranges=[(1, 4), (9, 12)],
                on_chunk=lambda s, r: seen.update({s: r}))
    rows = sorted(seen)
    assert rows == [1, 3, 9, 11]
    for s in rows:
        _assert_close(seen[s], want[s:s + len(seen[s])])


def test_compiled_once_across_jobs_chunk_sizes_and_batch_sizes(loaded):
    """One trace per strategy serves every chunk size and every batch size the signature accepts."""
    model = loaded("mlp")
    for seed, batch in enumerate((3, 3, 5, 2)):  # four jobs, new values, new batch sizes
        for chunk in (5, 2):
            compute_in_memory(model, {"x": rand((batch, 8), seed=seed)}, strategy="vectorized", chunk_rows=chunk)
    counts = {k: n for k, n in model.compiled.tracing_counts().items() if k.strategy == "vectorized" and not k.xla}
    assert counts and set(counts.values()) == {1}, counts


def test_output_dtype_is_applied(loaded):
    model = loaded("mlp")
    got, _ = compute_in_memory(model, {"x": rand((3, 8))}, output_dtype="float16", chunk_rows=4)
    assert got.dtype == np.float16


def test_forward_mode_failure_inside_tensorflow_is_explained(loaded):
    """Forward mode through an integer gather breaks inside TensorFlow; auto falls back to reverse."""
    from worker.engine import NotDifferentiable

    model = loaded("int_input")
    inputs = {"ids": np.array([[1, 2, 3, 4]], np.int32), "x": rand((1, 4))}
    with pytest.raises(NotDifferentiable, match="mode: TensorFlow's forward mode fails") as info:
        compute_in_memory(model, inputs, mode="forward", chunk_rows=2)
    assert info.value.field == "mode" and "use mode 'reverse'" in str(info.value)
    got, report = compute_in_memory(model, inputs, of="y", wrt="x", kind="batch_jacobian", chunk_rows=2)
    assert report.plan["mode"] == "reverse"


def test_forward_mode_wrt_variable_is_refused_not_silently_zero(loaded):
    """TensorFlow's JVP w.r.t. a variable captured by a loaded function is silently zero."""
    from worker.engine import NotDifferentiable

    model = loaded("mlp")
    inputs = {"x": rand((3, 8))}
    try:
        got, report = compute_in_memory(model, inputs, wrt="variables/d0/kernel", mode="forward", chunk_rows=7)
    except NotDifferentiable as err:
        assert str(err).startswith("mode: TensorFlow's forward mode fails")
        return
    assert "disagrees with the eager reference row" in report.failures.get("vectorized", "")
    _assert_close(got, tape_jacobian(model, inputs, "y", "variables/d0/kernel"))


def test_forward_mode_through_while_loop_of_loaded_model_is_explained(loaded):
    """TensorFlow's forward mode cannot pass the while_loop of a loaded SavedModel: a clear error."""
    from worker.engine import NotDifferentiable

    with pytest.raises(NotDifferentiable, match="mode: TensorFlow's forward mode fails.*use mode 'reverse'"):
        compute_in_memory(loaded("control_flow"), {"x": np.array([0.3, -0.2, 0.5], np.float32)}, mode="forward")


def test_no_retracing_warnings_across_jobs_and_chunk_sizes(loaded, caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="tensorflow")
    model = loaded("cnn")
    for seed in range(4):
        for chunk in (3, 4, 7):
            compute_in_memory(model, {"image": rand((2, 8, 8, 3), seed=seed)}, chunk_rows=chunk)
    assert not [r for r in caplog.records if "retracing" in r.getMessage()]


def test_depthwise_conv_vectorizes_with_the_pfor_patch(loaded):
    """Once a tiled gradient of a loaded MobileNet was traced, TensorFlow's pfor cannot convert its
    depthwise-conv input gradients ('filter ... expected to be not loop invariant');
    worker.engine.pfor_patches can. Without the patch this run falls back to a slower strategy."""
    model = loaded("depthwise")
    inputs = {"image": rand((1, 32, 32, 3))}
    want = tape_jacobian(model, inputs, "out", "image", use_pfor=False)
    compute_in_memory(model, inputs, strategy="tiled", chunk_rows=3)
    got, report = compute_in_memory(model, inputs, strategy="vectorized", chunk_rows=3)
    assert report.plan["strategy"] == "vectorized" and not report.failures, report.failures
    _assert_close(got, want)
