"""The model's function imported into the graph being traced, op by op, for reverse-mode chunk functions.

A loaded signature's function is one ``StatefulPartitionedCall`` op in a traced graph. Its gradient makes
TensorFlow build a forward function that outputs its intermediates and a backward function, and pfor
(``vectorized``) converts that backward function's ops again: on MobileNetV3Small (2-core AVX2 VM, 16 rows)
``vectorized``'s trace and first call took 15.2 + 3.5 s through the call op and 4.3 + 2.4 s with the called
function's ``FunctionDef`` imported into the traced graph (its resource arguments fed the captured variables) and
differentiated op by op with ``tf.gradients``; ``tiled`` 3.6 + 2.0 s against 1.6 + 1.5 s; the same rows and steady
speed (``python -m bench.bench_inline_trace``).

A gradient tape does not see ops that ``import_graph_def`` creates, and neither does a forward accumulator: only
first-order reverse-mode chunks (``tf.gradients``) use ``inlined``, and only in a graph being traced. A signature
this cannot express exactly returns None and keeps the call op: several call ops, a call fed by anything but the
signature's inputs and captured variables, outputs that are not the call's, or a body that calls functions
(``While``, ``If``, nested calls: their gradients need the Python graphs TensorFlow built them from) or overrides an
op's gradient (``_gradient_op_type``), except where the override is ``tf.nn.silu``'s (Keras' ``swish``,
EfficientNet's activation): forward ops ``x * sigmoid(beta * x)`` and a loaded gradient function with silu's
gradient ops (``SILU_GRADIENT_OPS``). Loaded gradient functions cannot be called on imported ops (their captures
are out of scope), so the override is pointed at ``SILU_OP_TYPE``, this module's own silu gradient, built from
the op's forward inputs: under pfor its ``sigmoid`` terms are computed once and each row costs one product. (Without
any override, ``tf.gradients`` differentiates the three forward ops and a ``vectorized`` EfficientNetB0 chunk ran
at 1.5x the seconds.) Any other override keeps the call op. ``JACOBIAN_INLINE=0`` keeps the call op everywhere.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

CALL_OPS = ("StatefulPartitionedCall", "PartitionedCall")
PASS_THROUGH = ("Identity", "IdentityN")   # between the call's outputs and the signature's
_NOT_INLINED = "not inlined"
_lock = threading.RLock()
# The ops (besides ``Const`` and ``Identity``) of ``tf.nn.silu``'s gradient function as a SavedModel keeps it.
SILU_GRADIENT_OPS = {"Mul": 8, "Sub": 2, "Sigmoid": 1, "AddV2": 1, "Square": 1, "Sum": 1}
SILU_OP_TYPE = "JacobianServiceSiluGrad"
_registered: list[bool] = []


@dataclass(frozen=True)
class Body:
    """The signature's called function as a ``GraphDef``; calling it imports it into the graph being traced."""

    graph_def: Any                  # the called function's body
    feeds: tuple[tuple[str, str, str], ...]   # (body placeholder, "input" or "capture", input name / capture op)
    outputs: dict[str, str]         # signature output name -> the body's tensor name
    captured: dict[str, Any]        # the signature graph's capture placeholder -> the captured (external) handle

    def feeds_input(self, name: str) -> bool:
        """Whether the signature passes input ``name`` to its call: through the call op, its gradient is then
        zeros where ``of`` does not read it, and ``None`` (refused as unconnected) where it is not passed."""
        return any(kind == "input" and source == name for _, kind, source in self.feeds)

    def __call__(self, inputs: dict[str, Any]) -> dict[str, Any]:
        import tensorflow as tf
        from tensorflow.python.framework.ops import get_default_graph  # tf.compat.v1's, without tf.compat (tf_import)

        graph = get_default_graph()
        feeds = {f"{placeholder}:0": (tf.convert_to_tensor(inputs[source]) if kind == "input"
                                      else graph.capture(self.captured[source]))
                 for placeholder, kind, source in self.feeds}
        names = sorted(self.outputs)
        got = tf.graph_util.import_graph_def(self.graph_def, input_map=feeds,
                                             return_elements=[self.outputs[n] for n in names], name="model")
        return dict(zip(names, got))


def enabled() -> bool:
    return os.environ.get("JACOBIAN_INLINE", "1") != "0"


def inlined(model: Any) -> Body | None:
    """``model``'s signature as a ``Body`` to import into the graph being traced, or None where it cannot be
    (module doc). Prepared once per loaded model (``model.compiled.inline``)."""
    if not enabled():
        return None
    with _lock:
        if model.compiled.inline is None:
            try:
                model.compiled.inline = _body(model.fn) or _NOT_INLINED
            except Exception:  # noqa: BLE001 - any graph this cannot read keeps the call op
                model.compiled.inline = _NOT_INLINED
    body = model.compiled.inline
    return None if body == _NOT_INLINED else body


def _calls_functions(node: Any, library: set[str]) -> bool:
    if node.op in library or node.op in CALL_OPS:
        return True
    if "_gradient_op_type" in node.attr and node.attr["_gradient_op_type"].s != SILU_OP_TYPE.encode():
        return True
    return any(value.HasField("func") or (value.HasField("list") and len(value.list.func))
               for value in node.attr.values())


def _body(fn: Any) -> Body | None:
    """``fn``'s single call op's body and how to feed it, or None (module doc)."""
    import tensorflow as tf
    from tensorflow.python.framework.function_def_to_graph import function_def_to_graph_def

    graph = getattr(fn, "graph", None)
    if graph is None or not hasattr(fn, "structured_input_signature"):
        return None
    graph_def = graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    names = set(library)
    calls = [n for n in graph_def.node if n.op in CALL_OPS]
    others = [n for n in graph_def.node if n.op not in CALL_OPS]
    if len(calls) != 1 or any(_calls_functions(n, names) for n in others):
        return None
    call = calls[0]
    fdef = library.get(call.attr["f"].func.name)
    if fdef is None:
        return None
    body_def, flat_names = function_def_to_graph_def(fdef)
    for node in _restated_overrides(body_def, library):
        _register_silu_gradient()
        node.attr["_gradient_op_type"].s = SILU_OP_TYPE.encode()
    if any(_calls_functions(n, names) for n in body_def.node):
        return None
    # Every argument is fed (``input_map``): its placeholder would stay in the graph, unused, and fail XLA's compile.
    args = {a.name for a in fdef.signature.input_arg}
    kept = [n for n in body_def.node if n.name not in args]
    del body_def.node[:]
    body_def.node.extend(kept)

    # The signature's inputs in flat order are ``fn.inputs``' first placeholders (a dict flattens by sorted key).
    specs = tf.nest.flatten(fn.structured_input_signature)
    input_of = {t.op.name: s.name for t, s in zip(fn.inputs, specs)}
    if len(input_of) != len(specs) or None in input_of.values():
        return None
    captured = {internal.op.name: external for external, internal in graph.captures}
    data_inputs = [i for i in call.input if not i.startswith("^")]
    if len(data_inputs) != len(fdef.signature.input_arg):
        return None
    feeds = []
    for arg, source in zip(fdef.signature.input_arg, data_inputs):
        op_name, _, index = source.partition(":")
        if index not in ("", "0"):
            return None
        if op_name in input_of:
            feeds.append((arg.name, "input", input_of[op_name]))
        elif op_name in captured:
            feeds.append((arg.name, "capture", op_name))
        else:
            return None

    if not isinstance(fn.structured_outputs, dict) or len(fn.outputs) != len(fn.structured_outputs):
        return None   # composite outputs (ragged, sparse) flatten to several tensors: not read by name here
    by_name = {n.name: n for n in graph_def.node}
    outputs = {}
    for name, tensor in zip(sorted(fn.structured_outputs), fn.outputs):
        source = _through_identities(tensor.name, by_name)
        op_name, _, index = source.partition(":")
        if op_name != call.name:
            return None
        ret = fdef.ret[fdef.signature.output_arg[int(index or 0)].name]
        flat = flat_names.get(ret, ret)
        if flat.partition(":")[0] in args:
            return None   # an output that is an argument: its placeholder is gone (above)
        outputs[name] = flat if ":" in flat else f"{flat}:0"
    return Body(body_def, tuple(feeds), outputs, captured)


def _restated_overrides(graph_def: Any, library: dict[str, Any]) -> list[Any]:
    """The ``IdentityN`` nodes whose gradient override is ``tf.nn.silu``'s: its inputs are ``(y, x, beta)`` with
    ``y = x * sigmoid(beta * x)`` (``tf.custom_gradient`` passes the result, then the arguments) and its gradient
    function is silu's (``_silu_gradient``)."""
    by_name = {n.name: n for n in graph_def.node}

    def op_of(tensor: str) -> Any:
        name, _, index = tensor.partition(":")
        return by_name.get(name) if index in ("", "0") else None

    def operands(node: Any, op: str) -> list[Any] | None:
        data = [i for i in node.input if not i.startswith("^")] if node is not None and node.op == op else []
        return [op_of(i) for i in data] if len(data) == (1 if op == "Sigmoid" else 2) else None

    found = []
    for node in graph_def.node:
        if node.op != "IdentityN" or "_gradient_op_type" not in node.attr or len(node.input) != 3:
            continue
        y, x, beta = (op_of(i) for i in node.input)
        product = operands(y, "Mul")
        if x is None or beta is None or not product or not any(p is x for p in product):
            continue
        (sigmoid,) = [p for p in product if p is not x] or [x]
        scaled = operands(sigmoid, "Sigmoid")
        inner = operands(scaled[0], "Mul") if scaled else None
        if (inner and sorted(map(id, inner)) == sorted(map(id, (x, beta)))
                and _silu_gradient(node.attr["_gradient_op_type"].s.decode(), library)):
            found.append(node)
    return found


def _register_silu_gradient() -> None:
    """Registers ``SILU_OP_TYPE``'s gradient once per process: ``tf.nn.silu``'s, for ``IdentityN(y, x, beta)``."""
    import tensorflow as tf

    with _lock:
        if _registered:
            return

        @tf.RegisterGradient(SILU_OP_TYPE)
        def _silu_grad(op: Any, dy: Any, dx: Any, dbeta: Any) -> tuple[Any, Any, Any]:
            x, beta = op.inputs[1], op.inputs[2]
            s = tf.sigmoid(beta * x)
            grad_x = dy * (s * (1.0 + beta * x * (1.0 - s)))
            grad_beta = tf.reduce_sum(dy * tf.square(x) * s * (1.0 - s))
            return (None, grad_x if dx is None else grad_x + dx, grad_beta if dbeta is None else grad_beta + dbeta)

        _registered.append(True)


def _silu_gradient(op_type: str, library: dict[str, Any]) -> bool:
    """Whether the gradient that loading registered for ``op_type`` is a function of ``library`` with
    ``tf.nn.silu``'s gradient ops. Loading registers a Python wrapper whose closure holds the loaded function."""
    from collections import Counter

    from tensorflow.python.framework import ops

    try:
        wrapper = ops.gradient_registry.lookup(op_type)
        names = {getattr(c.cell_contents, "name", None) for c in wrapper.__closure__ or ()}
    except (LookupError, AttributeError, ValueError):
        return False
    names = {n.decode() if isinstance(n, bytes) else n for n in names} & set(library)
    return len(names) == 1 and Counter(n.op for n in library[names.pop()].node_def
                                       if n.op not in ("Const", "Identity")) == SILU_GRADIENT_OPS


def _through_identities(tensor: str, by_name: dict[str, Any]) -> str:
    """The tensor that ``tensor`` copies through ``Identity`` ops (``op:index``)."""
    op_name, _, index = tensor.partition(":")
    node = by_name.get(op_name)
    while node is not None and node.op in PASS_THROUGH:
        source = [i for i in node.input if not i.startswith("^")][int(index or 0) if node.op == "IdentityN" else 0]
        op_name, _, index = source.partition(":")
        node = by_name.get(op_name)
    return f"{op_name}:{index or 0}"
