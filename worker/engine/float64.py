"""A float64 copy of a loaded float32 (or float16, bfloat16) model, for the precision guard's probes.

``float64_model(model)`` freezes the signature's concrete function (``convert_variables_to_constants_v2``), rewrites
every float type in it (node attributes, constants, the function library's signatures) to ``DT_DOUBLE`` and imports
it as a new function whose inputs are the signature's inputs and the model's float variables, all float64. The
result is a ``LoadedModel`` of the same inputs, outputs and variable names (float64 ``tf.Variable`` copies of the
values), so the matrix-free ``Operator`` computes its products in float64 exactly as it computes them in float32.

Ops that have no float64 kernel cannot run: ``FusedBatchNorm*`` in inference (``is_training`` false) is rewritten to
plain math (``(x - mean) * rsqrt(var + epsilon) * scale + offset``); any other op whose float64 run fails makes
``Float64Unavailable`` say which (``"float64 probe unavailable: op X has no float64 kernel"``). A float64 model is
its own float64 copy. The copy is made once per loaded model (``model.compiled.float64``), and its graph on its
first call (``_Deferred``): a process whose float64 probes come from kept traces (``precision.KEPT``, bound to the
copy's variables by name) never builds it (0.7-0.9 s of a warm MobileNetV3Small process, and the graph's memory).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from worker.engine.model import LoadedModel

FLOAT_TYPES = ("DT_FLOAT", "DT_HALF", "DT_BFLOAT16")
_BATCH_NORMS = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")


class Float64Unavailable(Exception):
    """The model cannot be evaluated in float64; the message says why (the op without a float64 kernel)."""


def float64_fingerprint(fingerprint: str) -> str:
    """The content fingerprint of the float64 copy of a model with ``fingerprint`` ("" where it has none)."""
    return f"{fingerprint}-float64" if fingerprint else ""


def is_float64(model: LoadedModel) -> bool:
    """Every float input, output and variable of ``model`` is float64 already (nothing to promote)."""
    dtypes = [s.dtype for s in [*model.input_specs.values(), *model.output_specs.values()]]
    dtypes += [v.dtype for v in model.variables.values()]
    return all(not d.is_floating or d.name == "float64" for d in dtypes)


def float64_model(model: LoadedModel) -> LoadedModel:
    """``model`` evaluated in float64 (itself when it is float64 already): inputs, outputs and the variables its
    signature reads as float64, the graph built on the first call of ``fn`` (which raises ``Float64Unavailable``
    where it cannot be; raised here once known). Made once per loaded model; a failure is remembered too."""
    if is_float64(model):
        return model
    if model.compiled.float64 is None:
        model.compiled.float64 = _deferred(model)
    found = model.compiled.float64
    if isinstance(found, Float64Unavailable):
        raise found
    return found


def _read_variables(model: LoadedModel) -> dict[str, str]:
    """Placeholder op name -> variable name, for the float variables the signature's graph captures."""
    by_handle = {id(v.handle): name for name, v in model.variables.items() if v.dtype.is_floating}
    return {internal.op.name: by_handle[id(external)] for external, internal in model.fn.graph.captures
            if id(external) in by_handle}


def _deferred(model: LoadedModel) -> LoadedModel:
    import tensorflow as tf

    read = set(_read_variables(model).values())
    variables = {name: tf.Variable(tf.cast(v, tf.float64), trainable=v.trainable,
                                   name=name.replace("/", "_").replace(":", "_").replace("@", "_"))
                 for name, v in model.variables.items() if name in read}

    def spec64(s: Any, name: str | None) -> Any:
        return tf.TensorSpec(s.shape, tf.float64 if s.dtype.is_floating else s.dtype, name)

    input_specs = {n: spec64(s, getattr(s, "name", None)) for n, s in model.input_specs.items()}
    deferred = _Deferred(model, variables, input_specs)
    return LoadedModel(path=model.path, signature=model.signature, loaded=(model.loaded, deferred), fn=deferred,
                       input_specs=input_specs, output_specs={n: spec64(s, n) for n, s in model.output_specs.items()},
                       variables={**{n: v for n, v in model.variables.items() if n not in variables}, **variables},
                       fingerprint=float64_fingerprint(model.fingerprint),
                       graph_ops=model.graph_ops, graph_loops=model.graph_loops,
                       graph_list_loops=model.graph_list_loops, shapes_of=model)


class _Deferred:
    """The float64 copy's ``fn``: builds the graph (``_built``) on its first call, outside any function being
    traced (``tf.init_scope``: the check's forward pass runs eagerly), then calls it. A model that cannot be
    converted raises ``Float64Unavailable`` on every call, and the original remembers it (``float64_model``)."""

    def __init__(self, model: LoadedModel, variables: dict[str, Any], input_specs: dict[str, Any]) -> None:
        self.model, self.variables, self.input_specs = model, variables, input_specs
        self.call: Any = None
        self._lock = threading.Lock()

    def __call__(self, **inputs: Any) -> dict[str, Any]:
        if self.call is None:
            import tensorflow as tf

            with self._lock, tf.init_scope():
                if self.call is None:
                    built = _built(self.model, self.variables, self.input_specs)
                    if isinstance(built, Float64Unavailable):
                        self.model.compiled.float64 = built
                        raise built
                    self.call = built
        return self.call(**inputs)


def _built(model: LoadedModel, variables: dict[str, Any], input_specs: dict[str, Any]) -> Any:
    try:
        return _convert(model, variables, input_specs)
    except Float64Unavailable as err:
        return err
    except Exception as err:  # noqa: BLE001 - any failure to convert is a reason, never a failed job
        first = err
    # A gradient taken through a ``while_v2`` loop (a Keras LSTM, GRU) rewrites the forward ``While`` op in place to
    # output its accumulators, and the frozen graph no longer imports ("Input 0 of node .../output/_14 was passed
    # float from .../while:7 incompatible with expected resource"): the job's own products come first, so convert
    # the graph of a fresh load of the same model, which no gradient has touched.
    try:
        from worker.engine.model import load_model

        return _convert(load_model(model.path, model.signature), variables, input_specs)
    except Float64Unavailable as err:
        return err
    except Exception:  # noqa: BLE001 - the first failure is the one to report
        return Float64Unavailable(f"float64 probe unavailable: the model could not be converted to float64 "
                                  f"({type(first).__name__}: {str(first).splitlines()[0][:200] if str(first) else ''})")


def _convert(model: LoadedModel, variables: dict[str, Any], input_specs: dict[str, Any]) -> Any:
    """``fn(**inputs)`` of ``model``'s graph in float64, fed ``variables`` (``_deferred``'s, by name), checked."""
    import tensorflow as tf
    from tensorflow.python.eager.wrap_function import wrap_function  # tf.compat.v1's, without tf.compat (tf_import)

    fn = model.fn
    captured = _read_variables(model)   # which placeholder reads which variable
    graph_def, arg_names, output_names = _frozen(fn)
    _fed_as_placeholders(graph_def, set(captured))
    _rewrite(graph_def)
    input_names = sorted(model.input_specs)
    flat_inputs = tf.nest.flatten(fn.structured_input_signature)
    specs = {n: model.input_specs[n] for n in input_names}
    order = [s.name if getattr(s, "name", None) in specs else None for s in flat_inputs]
    if len(arg_names) != len(input_names) or None in order:
        order = input_names   # the dict's flattening: sorted keys
    output_tensors = dict(zip(sorted(fn.structured_outputs), output_names))
    var_order = [name for name in model.variables if name in captured.values()]
    const_of = {name: node for node, name in captured.items()}
    held = [graph_def]   # needed while the function is traced, not after

    def imported(*args: Any) -> Any:
        feeds = {f"{arg}:0": a for arg, a in zip(arg_names, args[:len(arg_names)])}
        feeds.update({f"{const_of[n]}:0": a for n, a in zip(var_order, args[len(arg_names):])})
        names = sorted(output_tensors)
        got = tf.graph_util.import_graph_def(held[0], input_map=feeds,
                                             return_elements=[output_tensors[n] for n in names], name="")
        return dict(zip(names, got))

    arg_specs = [input_specs[n] for n in order]
    var_specs = [tf.TensorSpec(variables[n].shape, variables[n].dtype) for n in var_order]
    wrapped = wrap_function(imported, arg_specs + var_specs)
    held.clear()
    del graph_def

    def call(**inputs: Any) -> dict[str, Any]:
        args = [tf.convert_to_tensor(inputs[n], tf.float64 if specs[n].dtype.is_floating else specs[n].dtype)
                for n in order]
        return wrapped(*args, *[variables[n] for n in var_order])

    call.wrapped = wrapped   # type: ignore[attr-defined]
    return _checked(call, input_specs)


@contextmanager
def one_grappler_pass(*, off: bool = False) -> Iterator[None]:
    """Functions first run inside (in this thread) are optimized by one pass of TensorFlow's graph optimizer, not
    the default two: the float64 copy and its backward pass run for a few probes, where the second pass costs more
    than it saves (MobileNetV3Small's copy and three float64 VJPs: 5.3-6.5 s against 6.9-7.5 s, peak RSS the same;
    no optimizer at all saves more but adds ~90 MiB to the peak). ``off``: no pass at all (the reference rows'
    ``loop`` function, run for a few rows: its first row 2.7 s against 3.6 s on MobileNetV3Small). Thread-local:
    other threads keep their options."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    before = ctx.function_call_options
    config = config_pb2.ConfigProto()
    config.ParseFromString(before.config_proto_serialized)
    config.graph_options.rewrite_options.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
    config.graph_options.rewrite_options.disable_meta_optimizer = off
    ctx.function_call_options = context.FunctionCallOptions(executor_type=before.executor_type, config_proto=config)
    try:
        yield
    finally:
        ctx.function_call_options = before


def _frozen(fn: Any) -> tuple[Any, list[str], list[str]]:
    """``fn``'s graph with its captured variables as constants (``convert_variables_to_constants_v2``'s
    ``GraphDef``), the names of its remaining inputs' placeholders and of its output tensors. The public
    ``convert_variables_to_constants_v2_as_graph`` also imports the frozen graph as a function, which is only
    read for these names: 1.1-1.2 s of a MobileNetV3Small job's 3 s copy (2-core AVX2 VM), saved here."""
    from tensorflow.python.framework import convert_to_constants as ctc

    try:
        data = ctc._FunctionConverterDataInEager(func=fn, lower_control_flow=False, aggressive_inlining=False)
        replace = ctc._replace_variables_by_constants
    except AttributeError:   # another TensorFlow's internals: the public path, which builds the function
        frozen, graph_def = ctc.convert_variables_to_constants_v2_as_graph(fn, lower_control_flow=False)
        return graph_def, [t.op.name for t in frozen.inputs], [t.name for t in frozen.outputs]
    graph_def, converted = replace(converter_data=data)
    captures = fn.graph.internal_captures
    gone = {id(captures[i]) for i in converted}
    return graph_def, [t.op.name for t in fn.inputs if id(t) not in gone], [t.name for t in fn.outputs]


def _fed_as_placeholders(graph_def: Any, names: set[str]) -> None:
    """The frozen variables ``names`` (``Const`` nodes that the copy feeds with its float64 variables) as
    placeholders of their dtype and shape: their values are never read, and as constants the copy's graph held the
    model's weights once more (converted to float64 by ``_rewrite``, then imported: MobileNetV3Small's 2.5M weights,
    20 MB, in every graph built from the copy, kept traces included)."""
    from tensorflow.core.framework import attr_value_pb2, tensor_shape_pb2

    for node in graph_def.node:
        if node.name not in names or node.op != "Const":
            continue
        tensor = node.attr["value"].tensor
        dtype, shape = tensor.dtype, tensor_shape_pb2.TensorShapeProto()
        shape.CopyFrom(tensor.tensor_shape)
        node.op = "Placeholder"
        node.ClearField("attr")
        node.attr["dtype"].CopyFrom(attr_value_pb2.AttrValue(type=dtype))
        node.attr["shape"].CopyFrom(attr_value_pb2.AttrValue(shape=shape))


def _checked(call: Any, input_specs: dict[str, Any]) -> Any:
    """One forward pass of ``call`` on zeros (free dims 1) that must run: a missing float64 kernel is named here."""
    import tensorflow as tf

    zeros = {n: tf.zeros([1 if d is None else d for d in s.shape.as_list()], s.dtype) for n, s in input_specs.items()}
    try:
        call(**zeros)
    except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as err:
        raise Float64Unavailable(_why(str(err))) from None
    return call


def _why(message: str) -> str:
    """A failed float64 run's reason in one line, naming the op when TensorFlow does."""
    op = re.search(r"(?:OpKernel|kernel)[^']*'([A-Za-z0-9_]+)'", message) or re.search(r"op[: ]+'?([A-Z][A-Za-z0-9_]+)",
                                                                                        message)
    if op:
        return f"float64 probe unavailable: op {op.group(1)} has no float64 kernel"
    return f"float64 probe unavailable: {message.strip().splitlines()[0][:200]}"


# -- the GraphDef rewrite ---------------------------------------------------------------------------------


def _rewrite(graph_def: Any) -> None:
    """Every float type of ``graph_def`` (and of its function library) to DT_DOUBLE, batch norms to plain math."""
    renamed = {f.signature.name: f"{f.signature.name}_float64" for f in graph_def.library.function}
    _rewrite_nodes(graph_def.node, lambda: graph_def.node.add(), graph_def, renamed)
    for function in graph_def.library.function:
        function.signature.name = renamed[function.signature.name]
        for arg in [*function.signature.input_arg, *function.signature.output_arg]:
            if arg.type and _name(arg.type) in FLOAT_TYPES:
                arg.type = _double()
        _rewrite_nodes(function.node_def, lambda f=function: f.node_def.add(), None, renamed)
    for gradient in graph_def.library.gradient:
        gradient.function_name = renamed.get(gradient.function_name, gradient.function_name)


def _name(dtype: int) -> str:
    from tensorflow.core.framework import types_pb2

    return types_pb2.DataType.Name(dtype)


def _double() -> int:
    from tensorflow.core.framework import types_pb2

    return types_pb2.DT_DOUBLE


def _rewrite_nodes(nodes: Any, add: Any, graph_def: Any, renamed: dict[str, str]) -> None:
    """Float types to DT_DOUBLE in ``nodes``, the library's functions called by their new names (a function of the
    original's name is registered already, with float32 types)."""
    for node in list(nodes):
        node.op = renamed.get(node.op, node.op)
        if "_gradient_op_type" in node.attr:
            # A tf.custom_gradient's IdentityN (Keras' swish is tf.nn.silu, one): its registered gradient is the
            # float32 model's and hands float32 gradients into the float64 graph ("Input 'y' of 'Mul' Op has type
            # float64 that does not match type float32"). Without it the gradient is that of the forward ops the
            # IdentityN passes on: the same derivative wherever the custom one is exact (a probe of a deliberately
            # different one, e.g. a straight-through estimator, would show as a large error).
            del node.attr["_gradient_op_type"]
        for key in node.attr:
            value = node.attr[key]
            if value.HasField("func"):
                value.func.name = renamed.get(value.func.name, value.func.name)
            elif value.HasField("list") and value.list.func:
                for f in value.list.func:
                    f.name = renamed.get(f.name, f.name)
            if value.HasField("type") and _name(value.type) in FLOAT_TYPES:
                value.type = _double()
            elif value.HasField("list") and value.list.type:
                value.list.type[:] = [_double() if _name(t) in FLOAT_TYPES else t for t in value.list.type]
            elif value.HasField("tensor") and _name(value.tensor.dtype) in FLOAT_TYPES:
                value.tensor.CopyFrom(_double_tensor(value.tensor))
        if node.op in _BATCH_NORMS:
            _plain_batch_norm(node, add, in_function=graph_def is None)


def _double_tensor(proto: Any) -> Any:
    import tensorflow as tf

    return tf.make_tensor_proto(tf.make_ndarray(proto).astype("float64"))


def _plain_batch_norm(node: Any, add: Any, *, in_function: bool) -> None:
    """A ``FusedBatchNorm*`` in inference as plain ops of the same name's first output: ``(x - mean) *
    rsqrt(var + epsilon) * scale + offset`` (channels last or first). Training mode has no float64 kernel."""
    if node.attr["is_training"].b:
        raise Float64Unavailable(f"float64 probe unavailable: op {node.op} (is_training) has no float64 kernel")
    if in_function:
        raise Float64Unavailable(f"float64 probe unavailable: op {node.op} inside a function has no float64 kernel")
    x, scale, offset, mean, var = list(node.input)[:5]
    eps = node.attr["epsilon"].f
    channels_first = node.attr["data_format"].s.decode() in ("NCHW", "NCDHW")
    name = node.name
    double = _double()

    def new(op: str, suffix: str, inputs: list[str], **attrs: Any) -> str:
        n = add()
        n.op, n.name = op, f"{name}/f64_{suffix}"
        n.input.extend(inputs)
        n.attr["T"].type = double
        for k, v in attrs.items():
            n.attr[k].CopyFrom(v)
        return n.name

    def const(suffix: str, value: Any) -> str:
        import tensorflow as tf
        from tensorflow.core.framework import attr_value_pb2

        n = add()
        n.op, n.name = "Const", f"{name}/f64_{suffix}"
        n.attr["dtype"].type = value.dtype == "int32" and 3 or double
        n.attr["value"].CopyFrom(attr_value_pb2.AttrValue(tensor=tf.make_tensor_proto(value)))
        return n.name

    import numpy as np

    inv = new("Rsqrt", "rsqrt", [new("AddV2", "var_eps", [var, const("eps", np.float64(eps))])])
    mult = new("Mul", "mult", [inv, scale])
    shift = new("Sub", "shift", [offset, new("Mul", "mean_mult", [mean, mult])])
    if channels_first:
        from tensorflow.core.framework import attr_value_pb2

        shape = const("shape", np.array([-1, 1, 1], np.int32))
        tshape = attr_value_pb2.AttrValue(type=3)
        mult = new("Reshape", "mult_c", [mult, shape], Tshape=tshape)
        shift = new("Reshape", "shift_c", [shift, shape], Tshape=tshape)
    scaled = new("Mul", "scaled", [x, mult])
    node.op = "AddV2"
    del node.input[:]
    node.input.extend([scaled, shift])
    for key in list(node.attr):
        if key != "T":
            del node.attr[key]
    node.attr["T"].type = double
