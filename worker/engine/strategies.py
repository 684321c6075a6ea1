"""Chunk functions: ``k`` rows of a Jacobian (or Hessian) from one compiled call.

Every strategy maps a chunk start to ``(k,) + layout.row_shape`` rows; seeds are one-hot
rows built inside the graph, so a chunk function is traced once per (strategy, XLA, k) and
reused across chunks and across jobs with the same input shapes (inputs are arguments, not
captured constants). Rows past ``rows_total`` get zero seeds: the last chunk is padded.

- ``vectorized``: ``tf.vectorized_map`` (pfor) over VJPs (reverse) or JVPs (forward).
- ``tiled``: tile every input ``k`` times on the batch axis and push all ``k`` seeds through one
  batched pass; valid only when examples are independent (checked against ``vectorized``).
- ``loop``: one compiled single-row function called ``k`` times (when pfor cannot convert an op).
- ``eager``: the same row by row without ``tf.function`` (when graph mode cannot differentiate
  the model, e.g. loop bodies that read variables of a loaded SavedModel).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from worker.engine import pfor_patches
from worker.engine.problem import Problem

STRATEGIES = ("tiled", "vectorized", "loop", "eager")


def is_applicable(problem: Problem, strategy: str) -> bool:
    """Whether ``strategy`` can express ``problem`` at all."""
    if strategy != "tiled":
        return True
    if problem.kind == "hessian" or problem.wrt_variable is not None or not problem.of_shape:
        return False
    batch = problem.of_shape[0]
    return all(len(t.shape) >= 1 and int(t.shape[0]) == batch for t in problem.inputs.values())


def _seeds(tf: Any, problem: Problem, start: Any, k: int) -> Any:
    dtype = problem.compute_dtype if problem.mode == "reverse" or problem.kind == "hessian" else (
        problem.inputs[problem.wrt].dtype.name if problem.wrt_variable is None else problem.wrt_variable.dtype.name)
    idx = start + tf.range(k, dtype=tf.int64)
    onehot = tf.one_hot(idx, depth=problem.rows_total, dtype=dtype)
    shape = problem.seed_shape
    if problem.kind == "batch_jacobian":
        onehot = tf.reshape(onehot, (k, 1) + shape[1:])
        return tf.broadcast_to(onehot, (k,) + shape)
    return tf.reshape(onehot, (k,) + shape)


def _dense(tf: Any, g: Any) -> Any:
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _row_fn(tf: Any, problem: Problem, inputs: dict[str, Any]) -> Callable[[Any], Any]:
    """``one_row(seed)`` against ``inputs`` (used by vectorized, loop and eager)."""
    fn, of, var = problem.model.fn, problem.of, problem.wrt_variable
    target = var if var is not None else inputs[problem.wrt]

    def scalar(y: Any) -> Any:
        return tf.reduce_sum(y) if problem.reduce == "sum" else y

    if problem.kind == "hessian" and problem.mode == "forward":
        def one(v: Any) -> Any:
            with tf.autodiff.ForwardAccumulator(target, v) as acc:
                with tf.GradientTape() as tape:
                    tape.watch(target)
                    s = scalar(fn(**inputs)[of])
                g = _dense(tf, tape.gradient(s, target))
            return acc.jvp(g, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return one

    if problem.kind == "hessian":
        outer = tf.GradientTape(persistent=True)
        with outer:
            outer.watch(target)
            with tf.GradientTape() as inner:
                inner.watch(target)
                s = scalar(fn(**inputs)[of])
            g = _dense(tf, inner.gradient(s, target))
        return lambda v: _dense(tf, outer.gradient(g, target, output_gradients=v))

    if problem.mode == "forward":
        def one(t: Any) -> Any:
            with tf.autodiff.ForwardAccumulator(target, t) as acc:
                y = fn(**inputs)[of]
            return acc.jvp(y, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return one

    tape = tf.GradientTape(persistent=True)
    with tape:
        tape.watch(target)
        y = fn(**inputs)[of]
    return lambda v: _dense(tf, tape.gradient(y, target, output_gradients=v))


def _tiled(tf: Any, problem: Problem, inputs: dict[str, Any], seeds: Any, k: int) -> Any:
    batch = problem.of_shape[0]
    tiled = {n: tf.tile(t, [k] + [1] * (len(t.shape) - 1)) for n, t in inputs.items()}
    x = tiled[problem.wrt]
    flat = tf.reshape(seeds, (k * batch,) + tuple(seeds.shape[2:]))
    if problem.mode == "forward":
        with tf.autodiff.ForwardAccumulator(x, flat) as acc:
            y = problem.model.fn(**tiled)[problem.of]
        out = acc.jvp(y, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    else:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = problem.model.fn(**tiled)[problem.of]
        out = tape.gradient(y, x, output_gradients=flat)
    return tf.reshape(out, (k,) + problem.layout.row_shape)


def _batched(tf: Any, problem: Problem, strategy: str, k: int) -> Callable[[Any, dict[str, Any]], Any]:
    def body(start: Any, inputs: dict[str, Any]) -> Any:
        seeds = _seeds(tf, problem, start, k)
        if strategy == "tiled":
            return _tiled(tf, problem, inputs, seeds, k)
        one = _row_fn(tf, problem, inputs)
        if strategy == "vectorized":
            return tf.vectorized_map(one, seeds, fallback_to_while_loop=False)
        return tf.stack([one(seeds[i]) for i in range(k)])
    return body


def chunk_function(problem: Problem, strategy: str, *, xla: bool = False, k: int) -> Callable[[int], np.ndarray]:
    """A callable ``start -> rows`` of shape ``(k,) + row_shape`` for ``strategy`` (cached per model)."""
    import tensorflow as tf

    if strategy == "eager":
        def eager(start: int) -> np.ndarray:
            rows = [_batched(tf, problem, "loop", 1)(tf.constant(start + i, tf.int64), problem.inputs)
                    for i in range(k)]
            return tf.concat(rows, axis=0).numpy()
        return eager
    if strategy == "loop":
        one = _compiled(tf, problem, "loop", xla, 1)

        def loop(start: int) -> np.ndarray:
            return np.concatenate([one(tf.constant(start + i, tf.int64), problem.inputs).numpy() for i in range(k)])
        return loop
    compiled = _compiled(tf, problem, strategy, xla, k)
    return lambda start: compiled(tf.constant(start, tf.int64), problem.inputs).numpy()


def _compiled(tf: Any, problem: Problem, strategy: str, xla: bool, k: int) -> Any:
    pfor_patches.install()
    key = (problem.cache_key(), strategy, xla, k)
    with problem.model.lock:
        fn = problem.model.compiled.get(key)
        if fn is None:
            spec = {n: tf.TensorSpec(t.shape, t.dtype) for n, t in problem.inputs.items()}
            # A partial has no __code__: TensorFlow's frequent-retracing detector then keys on this
            # function alone, not on the body shared by every (strategy, k); each is traced once.
            body = functools.partial(_batched(tf, problem, strategy, k))
            fn = tf.function(body, jit_compile=xla, reduce_retracing=False,
                             input_signature=[tf.TensorSpec([], tf.int64), spec])
            problem.model.compiled[key] = fn
    return fn
