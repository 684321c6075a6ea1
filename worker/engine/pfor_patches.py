"""Fill gaps in TensorFlow's pfor: depthwise convolutions and their gradients with loop-invariant operands;
batched matmuls of a stacked operand with a fixed matrix (``_install_matmul``: a oneDNN crash).

TensorFlow 2.21 converts ``DepthwiseConv2dNativeBackpropInput`` only when the filter varies with
the pfor loop (per-example weights); a Jacobian w.r.t. the *input* has a fixed filter, and the
conversion fails with 'Input "filter" ... expected to be not loop invariant'. That makes
``tape.jacobian`` and ``vectorized_map`` fail on every MobileNet-like SavedModel. With a fixed
filter the loop dimension folds into the batch dimension: one batched op, exact same math.

``DepthwiseConv2dNative`` itself has the same gap: pfor converts it only with both operands varying.
A JVP (forward mode: the tangent through the convolution) or the derivative of a VJP (the matrix-free
kinds' reverse route to ``J v``) vectorized over seeds convolves a varying input with the fixed filter;
it folds the same way (and a varying filter with a fixed input stacks the input for TensorFlow's).
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
    # only the input gradient is used, then pruned): stack the fixed input, or the fixed output gradient
    # (a JVP of the backward pass: a varying input), and reuse TensorFlow's.
    filter_type = "DepthwiseConv2dNativeBackpropFilter"
    original_filter = pfor._pfor_converter_registry.get(filter_type)

    def convert_filter(pfor_input):  # type: ignore[no-untyped-def]
        first, last = pfor_input.input(0).is_stacked, pfor_input.input(2).is_stacked
        if first == last:
            return original_filter(pfor_input)
        inputs = list(pfor_input.inputs)
        fixed = 2 if first else 0
        inputs[fixed] = pfor._stack(inputs[fixed].t, pfor_input.pfor.loop_len_vector)
        return original_filter(pfor._PforInput(pfor_input.pfor, pfor_input.op, inputs))

    if original_filter is not None:
        pfor._pfor_converter_registry[filter_type] = convert_filter

    conv_type = "DepthwiseConv2dNative"
    original_conv = pfor._pfor_converter_registry.get(conv_type)

    def convert_conv(pfor_input):  # type: ignore[no-untyped-def]
        if pfor_input.input(1).is_stacked:
            if pfor_input.input(0).is_stacked:
                return original_conv(pfor_input)
            stacked = pfor._stack(pfor_input.input(0).t, pfor_input.pfor.loop_len_vector)
            return original_conv(pfor._PforInput(pfor_input.pfor, pfor_input.op, [stacked, pfor_input.inputs[1]]))
        x = pfor_input.stacked_input(0)  # [L, N, ...], batch first in NHWC and NCHW
        shape = array_ops.shape(x)
        folded = array_ops.reshape(x, array_ops.concat([[-1], shape[2:]], axis=0))
        result = pfor._create_op(conv_type, [folded, pfor_input.unstacked_input(1)],
                                 [t.dtype for t in pfor_input.outputs], attrs=pfor_input.op.node_def.attr).outputs[0]
        out_shape = array_ops.shape(result)
        unfolded = array_ops.reshape(result, array_ops.concat([shape[:2], out_shape[1:]], axis=0))
        return pfor.wrap(unfolded, True)

    if original_conv is not None:
        pfor._pfor_converter_registry[conv_type] = convert_conv
    _install_matmul(pfor)
    _INSTALLED = True


def _install_matmul(pfor):  # type: ignore[no-untyped-def]
    """``BatchMatMulV2`` of a stacked operand with a fixed matrix (a Dense or ``EinsumDense`` over a sequence,
    as in Keras' ``MultiHeadAttention``) as one 2-D ``MatMul``. TensorFlow's converter broadcasts the matrix
    against ``[L, ...]`` batch dimensions instead, and oneDNN's batched matmul on the CPU crashes the process
    (SIGSEGV) on those shapes (TensorFlow 2.21; with ``TF_ENABLE_ONEDNN_OPTS=0`` it does not). Exact same math:
    the loop and batch dimensions fold into the rows."""
    from tensorflow.python.ops import array_ops, math_ops

    op_type = "BatchMatMulV2"
    original = pfor._pfor_converter_registry.get(op_type)
    if original is None:
        return

    def last_two_swapped(t):  # type: ignore[no-untyped-def]
        rank = array_ops.rank(t)
        perm = array_ops.concat([math_ops.range(rank - 2), [rank - 1, rank - 2]], axis=0)
        return array_ops.transpose(t, perm)

    def convert(pfor_input):  # type: ignore[no-untyped-def]
        a, b = pfor_input.input(0), pfor_input.input(1)
        if a.is_stacked == b.is_stacked:
            return original(pfor_input)
        fixed = pfor_input.unstacked_input(1 if a.is_stacked else 0)
        if fixed.shape.rank != 2:
            return original(pfor_input)
        adj_x, adj_y = pfor_input.get_attr("adj_x"), pfor_input.get_attr("adj_y")
        x = pfor_input.stacked_input(0) if a.is_stacked else fixed
        y = fixed if a.is_stacked else pfor_input.stacked_input(1)
        x = math_ops.conj(last_two_swapped(x)) if adj_x else x
        y = math_ops.conj(last_two_swapped(y)) if adj_y else y
        if a.is_stacked:   # [L, ..., m, k] @ [k, n]: rows folded
            shape = array_ops.shape(x)
            out = math_ops.matmul(array_ops.reshape(x, [-1, shape[-1]]), y)
            return pfor.wrap(array_ops.reshape(out, array_ops.concat([shape[:-1], array_ops.shape(y)[-1:]], 0)),
                             True)
        # [m, k] @ [L, ..., k, n] = ([L, ..., n, k] @ [k, m]) with the last two swapped
        yt = last_two_swapped(y)
        shape = array_ops.shape(yt)
        out = math_ops.matmul(array_ops.reshape(yt, [-1, shape[-1]]), x, transpose_b=True)
        out = array_ops.reshape(out, array_ops.concat([shape[:-1], array_ops.shape(x)[:1]], 0))
        return pfor.wrap(last_two_swapped(out), True)

    pfor._pfor_converter_registry[op_type] = convert
