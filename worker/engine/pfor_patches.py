"""Fill a gap in TensorFlow's pfor: depthwise-conv gradients with loop-invariant operands.

TensorFlow 2.21 converts ``DepthwiseConv2dNativeBackpropInput`` only when the filter varies with
the pfor loop (per-example weights); a Jacobian w.r.t. the *input* has a fixed filter, and the
conversion fails with 'Input "filter" ... expected to be not loop invariant'. That makes
``tape.jacobian`` and ``vectorized_map`` fail on every MobileNet-like SavedModel. With a fixed
filter the loop dimension folds into the batch dimension: one batched op, exact same math.
"""

from __future__ import annotations

_INSTALLED = False


def install() -> None:
    """Wrap TensorFlow's converter once per process (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from tensorflow.python.ops import array_ops
    from tensorflow.python.ops.parallel_for import pfor

    op_type = "DepthwiseConv2dNativeBackpropInput"
    original = pfor._pfor_converter_registry.get(op_type)

    def convert(pfor_input):  # type: ignore[no-untyped-def]
        filter_stacked = pfor_input.input(1).is_stacked
        if filter_stacked or not pfor_input.input(2).is_stacked or pfor_input.input(0).is_stacked:
            return original(pfor_input)
        loop_len = pfor_input.pfor.loop_len_vector  # shape [1]
        input_sizes = pfor_input.unstacked_input(0)  # [N, ..., C], batch first in NHWC and NCHW
        kernel = pfor_input.unstacked_input(1)
        out_backprop = pfor_input.stacked_input(2)  # [L, N, ...]
        shape = array_ops.shape(out_backprop)
        folded = array_ops.reshape(out_backprop, array_ops.concat([[-1], shape[2:]], axis=0))
        sizes = array_ops.concat([loop_len * input_sizes[:1], input_sizes[1:]], axis=0)
        result = pfor._create_op(op_type, [sizes, kernel, folded], [x.dtype for x in pfor_input.outputs],
                                 attrs=pfor_input.op.node_def.attr).outputs[0]
        unfolded = array_ops.reshape(result, array_ops.concat([loop_len, input_sizes], axis=0))
        return pfor.wrap(unfolded, True)

    if original is not None:
        pfor._pfor_converter_registry[op_type] = convert

    # The filter gradient of the same op (computed by a loaded function's backward pass even when
    # only the input gradient is used, then pruned): stack the fixed input and reuse TensorFlow's.
    filter_type = "DepthwiseConv2dNativeBackpropFilter"
    original_filter = pfor._pfor_converter_registry.get(filter_type)

    def convert_filter(pfor_input):  # type: ignore[no-untyped-def]
        if pfor_input.input(0).is_stacked or not pfor_input.input(2).is_stacked:
            return original_filter(pfor_input)
        stacked = pfor._stack(pfor_input.input(0).t, pfor_input.pfor.loop_len_vector)
        inputs = [stacked] + list(pfor_input.inputs[1:])
        return original_filter(pfor._PforInput(pfor_input.pfor, pfor_input.op, inputs))

    if original_filter is not None:
        pfor._pfor_converter_registry[filter_type] = convert_filter
    _INSTALLED = True
