"""Chunk functions: ``k`` rows of a Jacobian (or Hessian) from one compiled call.

Every strategy maps ``(start, k)`` to rows ``start .. start + k`` of shape ``(k,) + layout.row_shape``,
cast on the device to the stored dtype. Seeds are one-hot rows built inside the graph from the
shapes of the tensors themselves, and ``k`` and the inputs' free dimensions are run-time values:
one trace per strategy serves every chunk size and every batch size the signature accepts, across
jobs (inputs are arguments, not captured constants). XLA compiles once per distinct ``k``; its
callers pad ``k`` to a power of two and slice on the device. Rows past ``rows_total`` get zero seeds.

- ``tiled``: tile every input ``k`` times on the batch axis and push all ``k`` seeds through one
  batched pass: the model's own batched kernels, a cheap trace, more memory per row; valid only
  when examples are independent (the runner checks rows against the eager reference).
- ``vectorized``: ``tf.vectorized_map`` (pfor) over VJPs (reverse) or JVPs (forward): less memory
  per row, an expensive trace on large graphs.
- ``per_example`` (batch Jacobians): pfor over the examples of pfor over the features, as JAX's
  ``vmap(jacrev)``: what does not depend on the example (the seeds' product with the output layer's
  kernel, a quarter of an MLP's FLOPs) is computed once for the batch; a trace 2-4x ``vectorized``'s.
- ``loop``: one compiled single-row function called ``k`` times (when pfor cannot convert an op).
- ``eager``: the same row by row without ``tf.function`` (when graph mode cannot differentiate
  the model, e.g. loop bodies that read variables of a loaded SavedModel).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker.engine import inline, pfor_patches, trace_cache, tuning
from worker.engine.plan import parse_label
from worker.engine.problem import Problem, unconnected

BASE_STRATEGIES = ("tiled", "vectorized", "per_example", "loop", "eager")
BATCHED = ("tiled", "vectorized", "per_example")  # the strategies with an XLA form
# Row at a time: each allocation is one row's, mostly under the ~128 KiB from which the CPU allocator's
# statistics count, so they read ~0 (an LSTM's ``loop`` chunks: 0 bytes); a host job measures them by RSS.
ROW_AT_A_TIME = ("loop", "eager")


def allocator_blind(label: str) -> bool:
    """Whether ``label``'s chunks escape TensorFlow's CPU allocator statistics by construction."""
    return parse_label(label)[0] in ROW_AT_A_TIME


def is_applicable(problem: Problem, strategy: str) -> bool:
    """Whether ``strategy`` (a base name or a label such as ``"tiled+xla"``) can express ``problem``."""
    name, xla = parse_label(strategy)
    if name not in BASE_STRATEGIES or xla and name not in BATCHED:
        return False
    if name == "tiled":
        return not problem.spec.scalar_of and _batched(problem)   # not a Hessian
    if name == "per_example":
        return problem.spec.batch_axis and _batched(problem)
    return True


def inlined(problem: Problem) -> bool:
    """Whether ``problem``'s chunks import the model's body into their trace (``_reverse``; ``worker.engine.inline``):
    first-order reverse mode w.r.t. an input of a signature that can be imported."""
    return _inlined_body(problem) is not None


def _inlined_body(problem: Problem) -> inline.Body | None:
    if problem.mode != "reverse" or problem.spec.scalar_of or problem.wrt_variable is not None:
        return None
    return inline.inlined(problem.model)


def reference_label(problem: Problem, *, tiled_ok: bool, checking: str) -> str:
    """The strategy whose one-row calls are the reference rows that check ``checking``'s chunks. In reverse mode
    ``tiled`` once it has run (or is the one checked): exactly one backward pass of the model on its own inputs,
    no tiling, no pfor; else, where the body is inlined, ``loop``: one plain ``tf.gradients`` compiled (3.7 s to
    its first row on MobileNetV3Small, then 0.05 s a row) where an eager VJP builds the call op's backward function
    (6.1 s, then 0.07-0.3 s); else (and to check ``loop`` itself) one eager VJP/JVP."""
    if problem.mode == "reverse" and (tiled_ok or checking == "tiled"):
        return "tiled"
    if inlined(problem) and parse_label(checking)[0] != "loop":
        return "loop"
    return "eager"


def reference_row(problem: Problem, label: str, row: int, trace_dir: str | None) -> Any:
    """Row ``row`` by ``label`` (``reference_label``) as a NumPy array; a ``loop`` function made for these few rows
    runs without TensorFlow's graph optimizer (``float64.one_grappler_pass(off=True)``)."""
    import numpy as np

    from worker.engine.float64 import one_grappler_pass

    fn = chunk_function(problem, label, trace_dir=trace_dir)
    with one_grappler_pass(off=True) if label == "loop" else contextlib.nullcontext():
        return np.asarray(fn(row, 1))[0]


def pfor_fails_on_loops(problem: Problem) -> bool:
    """A first-order reverse Jacobian through a ``While`` loop that carries a ``TensorList`` (a Keras RNN not
    unrolled): pfor cannot convert the loop's gradient (TensorFlow 2.21: "Required handle data not set" for its
    ``variant`` accumulators; 0.9 s to fail on the benchmark's LSTM, 2 s on a small GRU), where loops of plain
    tensors (an RK4 integrator) convert. ``tiled`` is tried first (``tuning.default_order``)."""
    return bool(problem.mode == "reverse" and not problem.spec.scalar_of and problem.model.graph_list_loops)


def start_order(problem: Problem, applicable: list[str], similar: str | None = None) -> list[str]:
    """``tuning.default_order`` of ``applicable`` for ``problem``'s model and request: by graph size, the body
    inlined, loops that pfor cannot convert (``pfor_fails_on_loops``, ``second_order_loops``)."""
    return tuning.default_order(applicable, similar, graph_ops=problem.model.graph_ops, inlined=inlined(problem),
                                second_order_loops=second_order_loops(problem),
                                list_loops=pfor_fails_on_loops(problem))


def second_order_loops(problem: Problem) -> bool:
    """A Hessian through ``While`` loops: ``loop`` is tried before pfor (``tuning.default_order``)."""
    return bool(problem.spec.scalar_of and problem.model.graph_loops)


def _batched(problem: Problem) -> bool:
    """``batch_axis_free`` for a problem w.r.t. an input (a variable has no batch axis)."""
    return problem.wrt_variable is None and batch_axis_free(problem.of_shape, problem.inputs, problem.model)


def batch_axis_free(of_shape: tuple[int, ...] | None, inputs: dict[str, Any], model: Any) -> bool:
    """Whether every input and ``of`` lead with the same batch axis, free in the signature (so any
    number of examples can be fed: one, or ``k`` tiled copies of the batch). Also the matrix-free
    products' ``tiled`` (``worker.engine.products.tiled_ok``)."""
    if not of_shape:
        return False
    batch = of_shape[0]
    return all(len(t.shape) >= 1 and int(t.shape[0]) == batch for t in inputs.values()) and all(
        s.shape.rank is not None and s.shape.rank >= 1 and s.shape[0] is None for s in model.input_specs.values())


def tile_inputs(tf: Any, inputs: dict[str, Any], k: Any) -> dict[str, Any]:
    """Every input repeated ``k`` times along its batch axis (``tiled``: one pass for ``k`` seeds)."""
    k32 = tf.cast(k, tf.int32)
    return {n: tf.tile(t, tf.concat([[k32], tf.ones([tf.rank(t) - 1], tf.int32)], 0)) for n, t in inputs.items()}


@dataclass(frozen=True)
class ChunkKey:
    """One compiled chunk function of a loaded model: the request, the strategy, the input dtypes."""

    of: str
    wrt: str
    kind: str
    mode: str
    reduce: str | None
    strategy: str
    xla: bool
    out_dtype: str
    inputs: tuple[tuple[str, str], ...]

    @classmethod
    def of_problem(cls, problem: Problem, strategy: str, xla: bool) -> ChunkKey:
        inputs = tuple(sorted((n, t.dtype.name) for n, t in problem.inputs.items()))
        return cls(problem.of, problem.wrt, problem.kind, problem.mode, problem.reduce, strategy, xla,
                   problem.dtype, inputs)


def _seed_dtype(problem: Problem) -> str:
    """Cotangents take ``of``'s dtype; tangents and Hessian-vector seeds take ``wrt``'s."""
    if problem.mode == "reverse" and not problem.spec.scalar_of:
        return problem.of_dtype
    var = problem.wrt_variable
    return (var.dtype if var is not None else problem.inputs[problem.wrt].dtype).name


def _seeds(tf: Any, problem: Problem, like_shape: Any, start: Any, k: Any) -> Any:
    """``(k,) + like_shape`` one-hot seeds for rows ``start .. start + k`` (dynamic shapes).

    For a batch Jacobian the one-hot runs over the features and is broadcast over the examples.
    """
    dtype = _seed_dtype(problem)
    idx = start + tf.range(k, dtype=tf.int64)
    like_shape = tf.cast(like_shape, tf.int64)
    if problem.spec.batch_axis:
        depth = tf.cast(tf.reduce_prod(like_shape[1:]), tf.int32)
        onehot = tf.reshape(tf.one_hot(idx, depth=depth, dtype=dtype), tf.concat([[k, 1], like_shape[1:]], 0))
        return tf.broadcast_to(onehot, tf.concat([[k], like_shape], 0))
    depth = tf.cast(tf.reduce_prod(like_shape), tf.int32)
    return tf.reshape(tf.one_hot(idx, depth=depth, dtype=dtype), tf.concat([[k], like_shape], 0))


def _dense(tf: Any, g: Any, problem: Problem | None = None) -> Any:
    """A gradient as a dense tensor; ``None`` (``of`` does not depend on ``wrt``) raises InvalidRequest."""
    if g is None and problem is not None:
        raise unconnected(problem.of, problem.wrt)
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _target(problem: Problem, inputs: dict[str, Any]) -> Any:
    var = problem.wrt_variable
    return var if var is not None else inputs[problem.wrt]


def _row_fn(tf: Any, problem: Problem, inputs: dict[str, Any]) -> tuple[Any, Callable[[Any], Any]]:
    """``(shape of one seed, one_row(seed))`` against ``inputs`` (vectorized, loop and eager)."""
    fn, of = problem.model.fn, problem.of
    target = _target(problem, inputs)

    def scalar(y: Any) -> Any:
        return tf.reduce_sum(y) if problem.reduce == "sum" else y

    if problem.spec.scalar_of and problem.mode == "forward":   # a Hessian, forward over reverse
        def hvp_forward(v: Any) -> Any:
            with tf.autodiff.ForwardAccumulator(target, v) as acc:
                with tf.GradientTape() as tape:
                    tape.watch(target)
                    s = scalar(fn(**inputs)[of])
                g = _dense(tf, tape.gradient(s, target), problem)
            return acc.jvp(g, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return tf.shape(target), hvp_forward

    if problem.spec.scalar_of:   # a Hessian, reverse over reverse
        outer = tf.GradientTape(persistent=True)
        with outer:
            outer.watch(target)
            with tf.GradientTape() as inner:
                inner.watch(target)
                s = scalar(fn(**inputs)[of])
            g = _dense(tf, inner.gradient(s, target), problem)
        return tf.shape(target), lambda v: _dense(tf, outer.gradient(g, target, output_gradients=v))

    if problem.mode == "forward":
        def jvp(t: Any) -> Any:
            with tf.autodiff.ForwardAccumulator(target, t) as acc:
                y = fn(**inputs)[of]
            return acc.jvp(y, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return tf.shape(target), jvp

    y, vjp = _reverse(tf, problem, inputs, target)
    return tf.shape(y), vjp


def _reverse(tf: Any, problem: Problem, inputs: dict[str, Any], target: Any) -> tuple[Any, Callable[[Any], Any]]:
    """``(y, vjp(v))``: ``of`` on ``inputs`` and its products with cotangents ``v`` of ``y``'s shape. In a graph
    being traced, w.r.t. an input, the model's body is imported op by op and differentiated by ``tf.gradients``
    (``worker.engine.inline``: a third of ``vectorized``'s trace); elsewhere through the signature's call op."""
    body = None if tf.executing_eagerly() else _inlined_body(problem)
    if body is not None:
        y = body(inputs)[problem.of]
        unconnected = tf.UnconnectedGradients.ZERO if body.feeds_input(problem.wrt) else tf.UnconnectedGradients.NONE
        return y, lambda v: _dense(tf, tf.gradients(y, target, grad_ys=v, unconnected_gradients=unconnected)[0],
                                   problem)
    # Non-persistent: through a loaded model's while_loop that reads a variable, TensorFlow fails with
    # 'variable without handle data' on a persistent tape, in graph and eager mode alike, and a
    # persistent tape makes it build a second backward function (3 s on MobileNetV3Small). pfor
    # traces the row function once, so one gradient per tape is all any strategy needs.
    tape = tf.GradientTape()
    with tape:
        tape.watch(target)
        y = problem.model.fn(**inputs)[problem.of]
    return y, lambda v: _dense(tf, tape.gradient(y, target, output_gradients=v), problem)


def _tiled(tf: Any, problem: Problem, inputs: dict[str, Any], start: Any, k: Any) -> Any:
    """All ``k`` seeds in one pass over the inputs tiled ``k`` times on the batch axis."""
    k32 = tf.cast(k, tf.int32)
    tiled = tile_inputs(tf, inputs, k32)
    x = tiled[problem.wrt]
    batch = tf.shape(inputs[problem.wrt])[:1]
    if problem.mode == "forward":
        seeds = _seeds(tf, problem, tf.shape(inputs[problem.wrt]), start, k)
        with tf.autodiff.ForwardAccumulator(x, tf.reshape(seeds, tf.shape(x))) as acc:
            y = problem.model.fn(**tiled)[problem.of]
        out = acc.jvp(y, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return tf.reshape(out, tf.concat([[k32], batch, tf.shape(y)[1:]], 0))
    y, vjp = _reverse(tf, problem, tiled, x)
    seeds = _seeds(tf, problem, tf.concat([batch, tf.shape(y)[1:]], 0), start, k)
    out = vjp(tf.reshape(seeds, tf.shape(y)))
    return tf.reshape(out, tf.concat([[k32], batch, tf.shape(x)[1:]], 0))


def _vectorized(tf: Any, problem: Problem, inputs: dict[str, Any], start: Any, k: Any) -> Any:
    """All ``k`` rows by pfor over the seeds' VJPs (JVPs)."""
    like, one = _row_fn(tf, problem, inputs)
    return tf.vectorized_map(one, _seeds(tf, problem, like, start, k), fallback_to_while_loop=False)


def _per_example(tf: Any, problem: Problem, inputs: dict[str, Any], start: Any, k: Any) -> Any:
    """A batch Jacobian's rows as ``(k, batch) + features``, by pfor over the examples (each a batch of
    one) of pfor over the ``k`` seeds: pfor computes loop-invariant values once, so whatever does not
    depend on the example (in reverse mode the seeds through the output layer, in forward mode through
    the first) is computed once for the batch instead of once per example."""
    def example(one: dict[str, Any]) -> Any:
        return _vectorized(tf, problem, {n: t[None] for n, t in one.items()}, start, k)[:, 0]  # (k,) + features
    rows = tf.vectorized_map(example, inputs, fallback_to_while_loop=False)  # (batch, k) + features
    return tf.transpose(rows, tf.concat([[1, 0], tf.range(2, tf.rank(rows))], 0))


def _body(tf: Any, problem: Problem, strategy: str) -> Callable[[Any, Any, dict[str, Any]], Any]:
    def body(start: Any, k: Any, inputs: dict[str, Any]) -> Any:
        if strategy == "tiled":
            rows = _tiled(tf, problem, inputs, start, k)
        elif strategy == "per_example":
            rows = _per_example(tf, problem, inputs, start, k)
        elif strategy == "vectorized":
            rows = _vectorized(tf, problem, inputs, start, k)
        else:  # loop and eager: one row per call
            like, one = _row_fn(tf, problem, inputs)
            rows = tf.expand_dims(one(_seeds(tf, problem, like, start, k)[0]), 0)
        return tf.cast(rows, problem.dtype)
    return body


def chunk_function(problem: Problem, label: str, *, trace_dir: str | None = None) -> Callable[[int, int], Any]:
    """``(start, k) -> rows``: a tensor of shape ``(k,) + row_shape`` in ``problem.dtype``.

    ``label`` is a strategy, ``+xla`` for XLA. Compiled functions are cached on the loaded model
    (``model.compiled``) and shared by every problem with the same request and input dtypes. ``trace_dir`` (the
    cache folder): a function traced by an earlier process is loaded from there instead of traced (``keep_trace``
    keeps one; never an XLA function, whose compile no graph keeps).
    """
    import tensorflow as tf

    name, xla = parse_label(label)
    if name == "eager":
        body = _body(tf, problem, "eager")

        def eager(start: int, k: int) -> Any:
            return tf.concat([body(tf.constant(start + i, tf.int64), tf.constant(1, tf.int64), problem.inputs)
                              for i in range(k)], axis=0)
        return eager
    compiled = _compiled(tf, problem, name, xla, trace_dir)
    if name == "loop":
        one = tf.constant(1, tf.int64)

        def loop(start: int, k: int) -> Any:
            return tf.concat([compiled(tf.constant(start + i, tf.int64), one, problem.inputs) for i in range(k)],
                             axis=0)
        return loop
    return lambda start, k: compiled(tf.constant(start, tf.int64), tf.constant(k, tf.int64), problem.inputs)


def is_compiled(problem: Problem, label: str) -> bool:
    """Whether this process has traced ``label`` for ``problem``'s request already."""
    name, xla = parse_label(label)
    return name == "eager" or ChunkKey.of_problem(problem, name, xla) in problem.model.compiled


def _trace_key(problem: Problem, strategy: str, xla: bool) -> tuple[Any, ...] | None:
    """What a kept trace of this chunk function is stored under (None: it is not kept): the model's content,
    the request, the input shapes (the body reads ``of``'s and ``wrt``'s shapes) and the code that traced it."""
    if xla or strategy == "eager" or not problem.model.fingerprint:
        return None
    return ("chunk-trace", trace_cache.code_digest(), problem.model.fingerprint, problem.model.signature,
            trace_cache.input_shapes(problem.inputs), ChunkKey.of_problem(problem, strategy, xla))


def keep_trace(problem: Problem, label: str, trace_dir: str | None) -> None:
    """Store ``label``'s function, traced in this process, in ``trace_dir`` for later processes (once)."""
    name, xla = parse_label(label)
    key = _trace_key(problem, name, xla) if trace_dir else None
    trace_cache.keep(trace_dir, key, problem.model.compiled.peek(ChunkKey.of_problem(problem, name, xla)),
                     problem.model.variables)


def from_kept_trace(problem: Problem, label: str) -> bool:
    """Whether this process's function for ``label`` was loaded from a kept trace, not traced."""
    name, xla = parse_label(label)
    return trace_cache.loaded(problem.model.compiled.peek(ChunkKey.of_problem(problem, name, xla)))


def trace_kept(problem: Problem, label: str, trace_dir: str | None) -> bool:
    """Whether ``trace_dir`` holds a trace of ``label``'s function that this process could load."""
    name, xla = parse_label(label)
    key = _trace_key(problem, name, xla) if trace_dir else None
    return key is not None and trace_cache.has(trace_dir, key)


def _compiled(tf: Any, problem: Problem, strategy: str, xla: bool, trace_dir: str | None = None) -> Any:
    pfor_patches.install()

    def build() -> Any:
        key = _trace_key(problem, strategy, xla) if trace_dir else None
        stored = trace_cache.load(trace_dir, key, problem.model.variables) if key else None
        if stored is not None:
            return stored
        # The signature's own input specs: free dimensions stay free, so one trace serves every batch size.
        spec = {n: tf.TensorSpec(s.shape, s.dtype) for n, s in problem.model.input_specs.items()}
        # A partial has no __code__: TensorFlow's frequent-retracing detector then keys on this
        # function alone, not on the body shared by every strategy.
        body = functools.partial(_body(tf, problem, strategy))
        # No AutoGraph: the bodies branch on Python values only, and converting them converted everything they call
        # while tracing (tests/engine/test_no_autograph.py); a .keras model's own call keeps it (keras_model.py).
        return tf.function(body, jit_compile=xla, reduce_retracing=False, autograph=False,
                           input_signature=[tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64), spec])

    return problem.model.compiled.get(ChunkKey.of_problem(problem, strategy, xla), build)
