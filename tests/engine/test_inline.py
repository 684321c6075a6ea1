"""Reverse-mode chunk functions import the model's body into their trace (``worker.engine.inline``) where the
signature is one call op of a function without loops; elsewhere, and with ``JACOBIAN_INLINE=0``, they call it."""

from __future__ import annotations

import numpy as np
import pytest

from tests import models
from tests.engine.conftest import rand
from tests.engine.reference import tape_jacobian
from worker.engine import RunOptions, build_problem, inline, load_model, run_problem
from worker.engine.strategies import ChunkKey


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("inline")
    return {"cnn": models.cnn(root / "cnn"), "multi_io": models.multi_io(root / "multi_io"),
            "control_flow": models.control_flow(root / "control_flow"), "swish": models.swish_cnn(root / "swish"),
            "straight_through": models.straight_through(root / "straight_through")}


def _rows(model, inputs, of, wrt, strategy):
    problem = build_problem(model, inputs, of=of, wrt=wrt)
    seen = {}
    run_problem(problem, options=RunOptions(strategy=strategy, chunk_rows=8), on_chunk=lambda s, r: seen.update({s: r}))
    name, _, xla = strategy.partition("+")
    fn = model.compiled.peek(ChunkKey.of_problem(problem, name, bool(xla)))
    graph = fn.get_concrete_function().graph.as_graph_def()
    calls = [n for n in graph.node if n.op in inline.CALL_OPS]   # the model's signature, called (not inlined)
    return np.concatenate([seen[s] for s in sorted(seen)]), calls


@pytest.mark.parametrize("strategy", ["tiled", "vectorized", "loop", "tiled+xla"])
def test_one_call_of_a_function_without_loops_is_imported_and_its_rows_agree(paths, strategy, monkeypatch):
    inputs = {"image": rand((2, 8, 8, 3))}
    inlined, calls = _rows(load_model(str(paths["cnn"])), inputs, "logits", "image", strategy)
    assert not calls, [n.name for n in calls]
    monkeypatch.setenv("JACOBIAN_INLINE", "0")
    called, calls = _rows(load_model(str(paths["cnn"])), inputs, "logits", "image", strategy)
    assert calls
    want = tape_jacobian(load_model(str(paths["cnn"])), inputs, "logits", "image").reshape(inlined.shape)
    np.testing.assert_allclose(inlined, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(inlined, called, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("of,wrt", [("u", "a"), ("v", "b"), ("v", "a")])
def test_each_output_and_input_of_a_signature_is_fed_and_read_by_name(paths, of, wrt):
    model = load_model(str(paths["multi_io"]))
    assert inline.inlined(model) is not None
    inputs = {n: rand((3,) + tuple(s.shape[1:]), seed=i) for i, (n, s) in enumerate(sorted(model.input_specs.items()))}
    rows, calls = _rows(model, inputs, of, wrt, "vectorized")
    assert not calls
    np.testing.assert_allclose(rows, tape_jacobian(model, inputs, of, wrt).reshape(rows.shape), rtol=1e-4, atol=1e-5)


def test_a_body_with_a_loop_keeps_the_call_op_and_its_rows(paths):
    model = load_model(str(paths["control_flow"]))
    assert model.graph_loops and inline.inlined(model) is None
    inputs = {"x": rand((3,))}
    rows, calls = _rows(model, inputs, "y", "x", "loop")
    assert calls
    np.testing.assert_allclose(rows, tape_jacobian(model, inputs, "y", "x").reshape(rows.shape), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy", ["tiled", "vectorized"])
def test_silu_whose_override_restates_its_gradient_is_imported_with_the_engines_silu_gradient(paths, strategy):
    """Keras' ``swish`` (EfficientNet's activation) is ``tf.nn.silu``: a gradient override that recomputes the
    sigmoid to save memory. Its loaded gradient cannot run on imported ops: the override is pointed at the engine's
    own silu gradient (``inline.SILU_OP_TYPE``), and the rows are the tape's."""
    model = load_model(str(paths["swish"]))
    body = inline.inlined(model)
    assert body is not None
    assert any("_gradient_op_type" in n.attr and n.attr["_gradient_op_type"].s == inline.SILU_OP_TYPE.encode()
               for n in body.graph_def.node)
    inputs = {"image": rand((2, 6, 6, 2))}
    rows, calls = _rows(model, inputs, "logits", "image", strategy)
    assert not calls
    want = tape_jacobian(load_model(str(paths["swish"])), inputs, "logits", "image").reshape(rows.shape)
    np.testing.assert_allclose(rows, want, rtol=1e-4, atol=1e-5)


def test_an_override_with_silus_forward_ops_but_another_gradient_keeps_the_call_op_and_its_gradient(paths):
    """A straight-through ``tf.custom_gradient`` over ``x * sigmoid(x)``: the forward ops match silu's, its
    gradient function does not. Dropping that override would differentiate the sigmoid and give other rows."""
    model = load_model(str(paths["straight_through"]))
    assert inline.inlined(model) is None
    inputs = {"x": rand((3, 4))}
    rows, calls = _rows(model, inputs, "y", "x", "vectorized")
    assert calls
    want = tape_jacobian(model, inputs, "y", "x").reshape(rows.shape)
    np.testing.assert_allclose(rows, want, rtol=1e-5, atol=1e-6)
    (weights,) = model.variables.values()   # straight through: d y[b, j] / d x[b, i] is w[i, j]
    np.testing.assert_allclose(rows.reshape(3, 3, 3, 4)[1, :, 1, :], weights.numpy().T, rtol=1e-6)


def test_vectorized_rows_are_checked_against_a_compiled_plain_gradient_that_catches_a_wrong_row(paths, monkeypatch):
    """Where the body is inlined, a ``vectorized`` job's reference rows come from the ``loop`` function (one plain
    ``tf.gradients``, compiled; no eager backward function): it is what the default plan starts with, and a wrong
    row of it is caught there and the job goes on with another strategy, its rows equal to the tape's."""
    import tensorflow as tf

    import worker.engine.chunk_run as chunk_run

    real = chunk_run.chunk_function

    def wrong_vectorized(problem, label, **options):
        fn = real(problem, label, **options)
        if label != "vectorized":
            return fn
        return lambda start, k: tf.concat([fn(start, k)[:-1], fn(start, k)[-1:] + 1.0], axis=0)

    monkeypatch.setattr(chunk_run, "chunk_function", wrong_vectorized)
    model = load_model(str(paths["cnn"]))
    inputs = {"image": rand((2, 8, 8, 3))}
    problem = build_problem(model, inputs, of="logits", wrt="image")
    seen = {}
    report = run_problem(problem, on_chunk=lambda s, r: seen.update({s: r}))
    assert "disagrees with the eager reference row" in report.failures.get("vectorized", ""), report.failures
    assert model.compiled.peek(ChunkKey.of_problem(problem, "loop", False)) is not None   # the reference's function
    rows = np.concatenate([seen[s] for s in sorted(seen)])
    want = tape_jacobian(model, inputs, "logits", "image").reshape(rows.shape)
    np.testing.assert_allclose(rows, want, rtol=1e-4, atol=1e-5)
    monkeypatch.undo()
    monkeypatch.setenv("JACOBIAN_INLINE", "0")   # through the call op: eager reference rows, no loop function
    called = load_model(str(paths["cnn"]))
    problem = build_problem(called, inputs, of="logits", wrt="image")
    run_problem(problem, options=RunOptions(strategy="vectorized", chunk_rows=8))
    assert called.compiled.peek(ChunkKey.of_problem(problem, "loop", False)) is None
