"""Structural sparsity pattern of a SavedModel signature, by propagating index sets through its graph.

Every tensor of the signature's graph (and of the functions it calls: Keras exports nest their layers in
``StatefulPartitionedCall``) gets one of three states, op by op in graph order:

- ``Dep(shape, pattern)``: depends on ``wrt``; ``pattern`` is a boolean CSR matrix ``(size, n_wrt)`` whose row
  ``e`` holds the ``wrt`` elements that element ``e`` may depend on;
- ``Val(value)``: a value known without ``wrt``: constants, variables, other inputs, shapes;
- ``Opaque(shape)``: neither (e.g. ``wrt`` cast to integers): no derivative flows through it, value unknown.

An op with a ``Dep`` input is given its output patterns by its rule (``worker.engine.sparsity.rules``); an op
without a rule gets the conservative one (every output element depends on every ``wrt`` element any of its
inputs depends on), so the pattern is never smaller than the true one; ``detect`` names such ops (``no_rule``)
so that a plan can say which op made the pattern denser than it may be. An op without ``Dep`` inputs is run
eagerly on its inputs (``Val``) or zeros (``Opaque``, for its output shapes). The pattern does not depend
on the values of ``wrt``: it is structural (``Val`` of the other inputs may steer gathers).
"""

from __future__ import annotations

import contextvars
import inspect
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from worker.engine.errors import EngineError


class PatternUnknown(EngineError):
    """The pattern could not be found (an op could not be run, a shape stayed unknown) or it is too dense to
    hold; the job takes the dense path and says why in ``plan.sparsity``."""


MAX_NNZ = 600_000_000  # entries of one tensor's pattern beyond which detection stops: dense is cheaper then


@dataclass
class Dep:
    shape: tuple[int, ...]
    pattern: Any   # scipy.sparse.csr_array, bool, (prod(shape), n_wrt)
    dtype: Any = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass
class Val:
    value: Any     # numpy array, or an eager tensor (resource handles)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in np.shape(self.value)) if isinstance(self.value, np.ndarray) \
            else tuple(int(d) for d in self.value.shape)


@dataclass
class Opaque:
    shape: tuple[int, ...] | None
    dtype: Any = None


State = Dep | Val | Opaque

CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")
SKIPPED = ("NoOp", "Assert", "PrintV2")
# Stateful ops that only read: run as any other. Any other stateful op (a variable written, a random draw, a
# queue) makes the pattern unknown: detection must neither change the model nor trust a value that moves.
READS = frozenset(("ReadVariableOp", "VarHandleOp", "Placeholder", "Print", "PrintV2", "Assert", "NoOp",
                   "StatefulPartitionedCall", "ResourceGather", "ResourceGatherNd", "VariableShape"))
# Ops whose output shape depends on values: never run on stand-ins.
VALUE_SHAPED = frozenset(("Where", "Unique", "UniqueV2", "UniqueWithCounts", "UniqueWithCountsV2", "ListDiff",
                          "Range", "DynamicPartition", "DenseToDenseSetOperation", "DenseToSparseSetOperation",
                          "NonMaxSuppressionV3", "NonMaxSuppressionV4", "NonMaxSuppressionV5", "Bincount",
                          "DenseBincount", "RaggedRange", "StringSplit", "StringSplitV2"))
CONTROL_FLOW = frozenset(("While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase"))


_NO_RULE: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("sparsity_no_rule", default=None)


def note_no_rule(op: Any) -> None:
    """Record that ``op`` (a ``wrt``-dependent op) got the conservative rule, in the running ``detect``'s
    ``no_rule``: its type and the first such op's name."""
    found = _NO_RULE.get()
    if found is not None:
        found.setdefault(op.type, op.name)


def detect(model: Any, inputs: dict[str, Any], *, of: str, wrt: str, no_rule: dict[str, str] | None = None
           ) -> tuple[Any, tuple[int, ...], tuple[int, ...]]:
    """The pattern of ``d of / d wrt`` for these inputs: a boolean CSR ``(n_of, n_wrt)`` with ``of`` and
    ``wrt`` flattened row-major, and their shapes. ``no_rule``, when given, is filled with the types of the ops
    that got the conservative rule (each with the name of one such op). Raises ``PatternUnknown``."""
    token = _NO_RULE.set({} if no_rule is None else no_rule)
    try:
        return _detect(model, inputs, of=of, wrt=wrt)
    finally:
        _NO_RULE.reset(token)


def _detect(model: Any, inputs: dict[str, Any], *, of: str, wrt: str
            ) -> tuple[Any, tuple[int, ...], tuple[int, ...]]:
    import scipy.sparse as sp
    import tensorflow as tf

    fn = model.fn
    graph = fn.graph
    state: dict[str, State] = {}
    args = [t for t in graph.inputs if t.dtype != tf.resource]
    by_name = {t.op.name: t for t in args}
    for name in sorted(inputs):
        tensor = by_name.get(name)
        if tensor is None:
            raise PatternUnknown(f"sparsity: input {name!r} has no placeholder in the signature's graph")
        value = np.asarray(inputs[name])
        if name == wrt:
            n = value.size
            state[tensor.name] = Dep(tuple(value.shape), sp.identity(n, dtype=bool, format="csr"), value.dtype)
        else:
            state[tensor.name] = Val(value)
    captured = list(fn.captured_inputs)   # the graph's last inputs, in order (resources and captured constants)
    for placeholder, value in zip(graph.inputs[len(graph.inputs) - len(captured):], captured):
        state[placeholder.name] = Val(value if value.dtype == tf.resource else value.numpy())
    walk_graph(graph, state, lookup=graph)
    out = fn.outputs[sorted(fn.structured_outputs).index(of)]   # tf.nest's order: sorted keys
    result = state.get(out.name)
    n_wrt = int(np.asarray(inputs[wrt]).size)
    if isinstance(result, Dep):
        return result.pattern.tocsr(), result.shape, tuple(np.shape(inputs[wrt]))
    shape = result.shape if result is not None else None
    if shape is None:
        raise PatternUnknown(f"sparsity: the shape of output {of!r} could not be found")
    return sp.csr_array((math.prod(shape), n_wrt), dtype=bool), tuple(shape), tuple(np.shape(inputs[wrt]))


def walk_graph(graph: Any, state: dict[str, State], *, lookup: Any) -> None:
    """Give every tensor of ``graph`` a state, its inputs (placeholders) set in ``state`` beforehand."""
    from worker.engine.sparsity import rules

    ops = graph.get_operations()
    last_use: dict[str, int] = {}
    for i, op in enumerate(ops):
        for t in op.inputs:
            last_use[t.name] = i
    keep = {t.name for t in graph.outputs}
    for i, op in enumerate(ops):
        if op.type == "Placeholder":
            if op.outputs[0].name not in state:
                state[op.outputs[0].name] = _placeholder(op)
            continue
        if op.type in SKIPPED:
            continue
        ins = [_state(state, t, op) for t in op.inputs]
        _check_op(op, ins)
        if op.type in CALL_OPS:
            outs = _call(op, ins, lookup)
        elif any(isinstance(s, Dep) for s in ins):
            outs = rules.apply(op, ins)
        else:
            outs = _constant(op, ins)
        for tensor, s in zip(op.outputs, outs):
            if isinstance(s, Dep) and s.pattern.nnz > MAX_NNZ:
                raise PatternUnknown(f"sparsity: the pattern of {op.name} ({op.type}) holds {s.pattern.nnz} "
                                     "entries: too dense to pay")
            state[tensor.name] = s
        for t in op.inputs:   # states no later op reads are freed: the walk holds a few layers, not all
            if last_use.get(t.name) == i and t.name not in keep:
                state.pop(t.name, None)


def _state(state: dict[str, State], tensor: Any, op: Any) -> State:
    found = state.get(tensor.name)
    if found is None:
        raise PatternUnknown(f"sparsity: op {op.name} ({op.type}) reads {tensor.name}, which no op gave a state")
    return found


def _check_op(op: Any, ins: list[State]) -> None:
    """Raise ``PatternUnknown`` for what detection must not run or cannot trust: a stateful op that writes or
    draws, an op whose output shape depends on values it does not know, integers of unknown value steering
    anything but elementwise ops and gathers."""
    from worker.engine.sparsity.rules import ELEMENTWISE

    if op.op_def.is_stateful and op.type not in READS and op.type not in CALL_OPS:
        raise PatternUnknown(f"sparsity: the model runs {op.type} ({op.name}), a stateful op (it writes a variable "
                             "or draws random numbers): its pattern is not structural")
    unknown = [s for s in ins if isinstance(s, Opaque) or isinstance(s, Dep)]
    if op.type in VALUE_SHAPED and unknown:
        raise PatternUnknown(f"sparsity: {op.type} ({op.name}) has an output shape that depends on values "
                             "that depend on wrt")
    if op.type in ELEMENTWISE or op.type in CALL_OPS or op.type in CONTROL_FLOW or "Gather" in op.type:
        return
    for s in ins:
        if isinstance(s, Opaque) and s.dtype is not None and _integer(s.dtype):
            raise PatternUnknown(f"sparsity: {op.type} ({op.name}) takes integers computed from wrt: its result "
                                 "may depend on their values")


def _integer(dtype: Any) -> bool:
    import tensorflow as tf

    d = tf.as_dtype(dtype)
    return d.is_integer or d == tf.bool


def _placeholder(op: Any) -> State:
    return Opaque(_static(op.outputs[0]), op.outputs[0].dtype)


def _static(tensor: Any) -> tuple[int, ...] | None:
    shape = tensor.shape
    if shape.rank is None or not shape.is_fully_defined():
        return None
    return tuple(int(d) for d in shape.as_list())


def _call(op: Any, ins: list[State], lookup: Any) -> list[State]:
    """A call into another function of the library: walked with the call's inputs."""
    name = op.get_attr("f").name
    fn = None
    for where in (op.graph, lookup):
        try:
            fn = where._get_function(name)   # noqa: SLF001 - the loaded library's function, with its graph
        except Exception:  # noqa: BLE001 - look in the next graph
            fn = None
        if fn is not None:
            break
    inner = getattr(fn, "graph", None)
    if inner is None:
        from worker.engine.sparsity import rules

        return rules.conservative(op, ins)
    state: dict[str, State] = {}
    for placeholder, s in zip(inner.inputs, ins):
        state[placeholder.name] = s
    walk_graph(inner, state, lookup=lookup)
    return [state.get(t.name) or Opaque(_static(t)) for t in inner.outputs]


def substitutes(ins: list[State]) -> list[Any]:
    """Tensors to run an op on: values, and zeros in the shape and dtype of the others."""
    import tensorflow as tf

    out = []
    for s in ins:
        if isinstance(s, Val):
            out.append(s.value)
            continue
        if s.shape is None:
            raise PatternUnknown("sparsity: a tensor's shape could not be found")
        dtype = tf.as_dtype(s.dtype) if s.dtype is not None else tf.float32
        out.append(tf.zeros(s.shape, dtype))
    return out


def run_op(op: Any, inputs: list[Any]) -> list[Any]:
    """Run graph op ``op`` eagerly on ``inputs`` (``tf.raw_ops``; attributes those the op does not infer from
    its inputs): its outputs as numpy arrays (eager tensors for resources)."""
    import tensorflow as tf

    raw = getattr(tf.raw_ops, op.type, None)
    if raw is None:
        raise PatternUnknown(f"sparsity: op {op.type} cannot be run eagerly")
    op_def = op.op_def
    kwargs: dict[str, Any] = {}
    inferred: set[str] = set()
    # raw_ops name inputs as the op's definition does, mostly: take their names in order (Sum: ``axis``)
    params = [p for p in inspect.signature(raw).parameters if p != "name"]
    positional = dict(zip((arg.name for arg in op_def.input_arg), params))
    i = 0
    for arg in op_def.input_arg:
        inferred.update(a for a in (arg.type_attr, arg.number_attr, arg.type_list_attr) if a)
        if arg.number_attr:
            n = int(op.get_attr(arg.number_attr))
        elif arg.type_list_attr:
            n = len(op.get_attr(arg.type_list_attr))
        else:
            n = None
        name = positional.get(arg.name, arg.name)
        if n is None:
            kwargs[name] = inputs[i]
            i += 1
        else:
            kwargs[name] = list(inputs[i:i + n])
            i += n
    attrs = [attr.name for attr in op_def.attr if attr.name not in inferred]
    # an attribute raw_ops renames (Squeeze's ``squeeze_dims`` is ``axis``) takes the parameter no input or
    # attribute of the graph's op definition names, in order
    renamed = iter(p for p in params if p not in kwargs and p not in attrs)
    for attr in attrs:
        kwargs[attr if attr in params else next(renamed, attr)] = op.get_attr(attr)
    result = raw(**kwargs)
    if isinstance(result, (list, tuple)):
        flat = list(tf.nest.flatten(result))
    elif result is None:
        flat = []
    else:
        flat = [result]
    return [t if t.dtype == tf.resource else t.numpy() for t in flat]


def _constant(op: Any, ins: list[State]) -> list[State]:
    """An op no ``wrt`` reaches: run on its values (``Val`` out) or on zeros for the ``Opaque`` ones (their
    shapes); an op that cannot run gives ``Opaque`` outputs of their static shapes."""
    import tensorflow as tf

    if op.type == "Const":
        return [Val(tf.make_ndarray(op.get_attr("value")))]
    known = all(isinstance(s, Val) for s in ins)
    if op.type in CONTROL_FLOW and not known:   # never run on stand-ins: a loop may not end
        return [Opaque(_static(t), t.dtype) for t in op.outputs]
    try:
        outs = run_op(op, substitutes(ins))
    except Exception:  # noqa: BLE001 - an op we cannot run: its outputs' static shapes, values unknown
        return [Opaque(_static(t), t.dtype) for t in op.outputs]
    if known:
        return [Val(v) for v in outs]
    return [Opaque(tuple(np.shape(v)), t.dtype) for v, t in zip(outs, op.outputs)]
