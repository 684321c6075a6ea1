"""How one product is formulated in TensorFlow, for ``worker.engine.matfree`` (routes and strategies: its docstring).

``row_fn`` gives ``one(seed) -> row`` for a kind and a route, flat along the concatenated ``wrt``
axis; ``body`` maps a batch of seeds through it by a strategy (``vectorized``: ``tf.vectorized_map``;
``loop`` and ``eager``: one seed per call), or, ``tiled``, pushes all ``k`` seeds through one pass of the
model over its inputs tiled ``k`` times on the batch axis (``tiled_ok``: every ``wrt`` an input, every
input and ``of`` leading with one batch axis the signature leaves free). ``tiled`` is the dense path's
cheap trace (a plain forward or backward pass, no pfor) at the price of the model's forward pass per seed;
it is valid only when examples are independent, which the first call's probe row checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from contracts.kinds import kind_spec
from worker.engine.problem import unconnected
from worker.engine.strategies import batch_axis_free, tile_inputs

if TYPE_CHECKING:
    from worker.engine.matfree import Operator


def _pieces(tf: Any, flat: Any, targets: list[Any]) -> list[Any]:
    """A flat seed ``(n_wrt,)`` as one tensor per source, shaped and typed like it."""
    parts = tf.split(flat, [tf.size(t) for t in targets], num=len(targets))
    return [tf.cast(tf.reshape(p, tf.shape(t)), t.dtype) for p, t in zip(parts, targets)]


def _flat(tf: Any, parts: Sequence[Any], dtype: str) -> Any:
    return tf.concat([tf.reshape(tf.cast(p, dtype), [-1]) for p in parts], axis=0)


def _grads(tf: Any, op: Operator, tape: Any, y: Any, targets: list[Any], cotangent: Any = None) -> list[Any]:
    """``tape.gradient`` w.r.t. every source, dense; an unconnected source (None) named explicitly raises
    InvalidRequest, one from ``"variables/*"`` gets zeros (unless ``of`` depends on none of them). Through a
    loaded function TensorFlow gives zeros, not None, for a captured variable ``of`` does not read."""
    grads = tape.gradient(y, targets, output_gradients=cotangent)
    if all(g is None for g in grads):
        raise unconnected(op.of, ", ".join(op.axis.names))
    out = []
    for name, g, t in zip(op.axis.names, grads, targets):
        if g is None and name not in op.axis.optional:
            raise unconnected(op.of, name)
        out.append(tf.zeros(tf.shape(t), t.dtype) if g is None else tf.convert_to_tensor(g))
    return out


def row_fn(tf: Any, op: Operator, kind: str, route: str, inputs: dict[str, Any]) -> Callable[[Any], Any]:
    """``one(seed) -> row`` (flat, compute dtype) against ``inputs``; reverse routes record the model's
    forward pass here, once, and differentiate it per seed. The kind's spec says which product: seeds along
    ``of`` (cotangents) give ``v^T J``, a kind that differentiates twice ``H v``, the others ``J v``."""
    spec = kind_spec(kind)
    fn, of, dtype = op.model.fn, op.of, op.compute_dtype
    targets = op.axis.targets(op.model, inputs)
    zero = tf.UnconnectedGradients.ZERO

    if spec.seeds == "of":   # v^T J
        tape = tf.GradientTape()  # not persistent: see strategies._row_fn
        with tape:
            tape.watch(targets)
            y = fn(**inputs)[of]
        return lambda u: _flat(tf, _grads(tf, op, tape, y, targets, tf.cast(tf.reshape(u, tf.shape(y)), y.dtype)),
                               dtype)

    if not spec.scalar_of and route == "forward":   # J v
        def jvp(t: Any) -> Any:
            with tf.autodiff.ForwardAccumulator(targets, _pieces(tf, t, targets)) as acc:
                y = fn(**inputs)[of]
            return tf.reshape(tf.cast(acc.jvp(y, unconnected_gradients=zero), dtype), [-1])
        return jvp

    if not spec.scalar_of:  # J t = d/du <J^T u, t>: the VJP is linear in u, its derivative along t is J t
        outer = tf.GradientTape()
        with outer:
            with tf.GradientTape() as inner:
                inner.watch(targets)
                y = fn(**inputs)[of]
            u = tf.zeros_like(y)
            outer.watch(u)
            grads = _grads(tf, op, inner, y, targets, u)
        return lambda t: tf.reshape(tf.cast(outer.gradient(grads, u, output_gradients=_pieces(tf, t, targets),
                                                           unconnected_gradients=zero), dtype), [-1])

    def scalar() -> Any:
        return tf.reduce_sum(fn(**inputs)[of])

    if route == "forward":  # hvp, forward over reverse
        def hvp(v: Any) -> Any:
            with tf.autodiff.ForwardAccumulator(targets, _pieces(tf, v, targets)) as acc:
                with tf.GradientTape() as tape:
                    tape.watch(targets)
                    s = scalar()
                grads = _grads(tf, op, tape, s, targets)
            return _flat(tf, acc.jvp(grads, unconnected_gradients=zero), dtype)
        return hvp

    outer = tf.GradientTape()  # hvp, reverse over reverse
    with outer:
        outer.watch(targets)
        with tf.GradientTape() as inner:
            inner.watch(targets)
            s = scalar()
        grads = _grads(tf, op, inner, s, targets)
    return lambda v: _flat(tf, outer.gradient(grads, targets, output_gradients=_pieces(tf, v, targets),
                                              unconnected_gradients=zero), dtype)


def tiled_ok(op: Operator) -> bool:
    """Whether ``tiled`` can express ``op``'s products: ``wrt`` inputs only, and every input and ``of`` leading
    with the same batch axis, free in the signature (``strategies.batch_axis_free``, as the dense path)."""
    return not op.axis.variables and batch_axis_free(op.of_shape, op.inputs, op.model)


def tiled_route(kind: str) -> str | None:
    """The route of ``kind``'s ``tiled`` label: forward mode for J v (products along ``of``), reverse for v^T J;
    None for the kinds that differentiate twice (H v)."""
    spec = kind_spec(kind)
    if spec.scalar_of or not spec.routes:
        return None
    return "forward" if spec.product_axes == "of" else "reverse"


def _tiled(tf: Any, op: Operator, kind: str, seeds: Any, inputs: dict[str, Any]) -> Any:
    """``k`` products in one pass over the inputs tiled ``k`` times: tangents (``jvp``, forward mode) or
    cotangents (``vjp``) of copy ``i`` are seed ``i``; rows flat, ``(k, n_of)`` or ``(k, n_wrt)``."""
    k = tf.shape(seeds)[0]
    tiled = tile_inputs(tf, inputs, k)
    targets = [tiled[n] for n in op.axis.names]
    dtype = op.compute_dtype
    if tiled_route(kind) == "forward":
        per_copy = tf.split(seeds, list(op.axis.sizes), num=len(targets), axis=1)
        tangents = [tf.cast(tf.reshape(p, tf.shape(t)), t.dtype) for p, t in zip(per_copy, targets)]
        with tf.autodiff.ForwardAccumulator(targets, tangents) as acc:
            y = op.model.fn(**tiled)[op.of]
        return tf.reshape(tf.cast(acc.jvp(y, unconnected_gradients=tf.UnconnectedGradients.ZERO), dtype), [k, -1])
    with tf.GradientTape() as tape:
        tape.watch(targets)
        y = op.model.fn(**tiled)[op.of]
    grads = tape.gradient(y, targets, output_gradients=tf.cast(tf.reshape(seeds, tf.shape(y)), y.dtype))
    for name, g in zip(op.axis.names, grads):
        if g is None:
            raise unconnected(op.of, name)
    return tf.concat([tf.reshape(tf.cast(g, dtype), [k, -1]) for g in grads], axis=1)


def body(tf: Any, op: Operator, kind: str, label: str) -> Callable[[Any, dict[str, Any]], Any]:
    route, strategy = label.split("/")
    if strategy == "tiled":
        return lambda seeds, inputs: _tiled(tf, op, kind, seeds, inputs)

    def run(seeds: Any, inputs: dict[str, Any]) -> Any:
        one = row_fn(tf, op, kind, route, inputs)
        if strategy == "vectorized":
            return tf.vectorized_map(one, seeds, fallback_to_while_loop=False)
        return tf.expand_dims(one(seeds[0]), 0)   # loop and eager: one seed per call
    return run
