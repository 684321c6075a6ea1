"""The index-set rules of ``worker.engine.sparsity.walk``: how an op's output patterns follow from its inputs'.

Patterns are boolean CSR matrices ``(elements, n_wrt)``. A rule builds a boolean *map* ``(out elements, in
elements)`` saying which input elements each output element reads, and the output's pattern is ``map @ in``
(OR of the rows read). Kinds of rules:

- elementwise, with broadcasting (activations, arithmetic, ``BiasAdd``, ``Select``, ``Fill``, ...);
- reshapes (``Reshape``, ``ExpandDims``, ``Squeeze``): the row-major order of the elements is kept, so is the
  pattern;
- moves (transpose, slice, strided slice, concat, pad, gather, gather_nd, tile, split, ...): the op itself is run
  on the element ids (int64), so each output element names the input element it copies (0: none);
- accumulations (segment reductions, ``ScatterNd``, ``TensorScatter*``, ``Cumsum``/``Cumprod``, ``Einsum``):
  ``worker.engine.sparsity.accumulate``, from the op's attributes and its index inputs' values;
- windows (``Conv2D``, ``DepthwiseConv2dNative``, ``MaxPool``, ``AvgPool``; strides, dilations, SAME /
  VALID / explicit padding, NHWC): ``ExtractImagePatches`` run on the ids gives each output's window;
- ``MatMul``/``BatchMatMul*``: an output element reads a row of one operand and a column of the other;
- reductions (``Sum``, ``Mean``, ``Max``, ..., and a gradient graph's ``BiasAddGrad``) and
  ``Softmax``/``LogSoftmax`` (over the last axis);
- ``FusedBatchNorm*`` at inference: elementwise in ``x``;
- anything else: ``conservative``, every output element reads every input element; the op is noted
  (``walk.note_no_rule``) so that the plan names the ops that made the pattern denser than it may be.

Outputs of a non-float dtype carry no derivative: ``Opaque``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from worker.engine.sparsity.walk import (
    CONTROL_FLOW,
    MAX_NNZ,
    Dep,
    Opaque,
    PatternUnknown,
    State,
    Val,
    note_no_rule,
    run_op,
    substitutes,
)

ELEMENTWISE = frozenset("""
Abs Acos Acosh Add AddN AddV2 Asin Asinh Atan Atan2 Atanh BiasAdd BroadcastTo Cast Ceil CheckNumerics ClipByValue
Cos Cosh Digamma Div DivNoNan Elu EnsureShape Erf Erfc Exp Expm1 Fill Floor FloorDiv FloorMod Gelu Identity
Inv Lgamma Log Log1p LeakyRelu Maximum Minimum Mod Mul MulNoNan Neg Pow PreventGradient Reciprocal RealDiv Relu
Relu6 Round Rsqrt Select SelectV2 Selu Sigmoid Sign Sin Sinh Snapshot Softplus Softsign Sqrt Square
SquaredDifference StopGradient Sub Tan Tanh TruncateDiv Xdivy Xlog1py Xlogy
EluGrad InvGrad LeakyReluGrad ReciprocalGrad Relu6Grad ReluGrad RsqrtGrad SeluGrad SigmoidGrad SoftplusGrad
SoftsignGrad SqrtGrad TanhGrad
""".split())   # the *Grad ops: a gradient's graph (a Hessian's pattern), elementwise in their inputs

MOVES = frozenset("""
BatchToSpaceND Concat ConcatV2 DepthToSpace Gather GatherNd GatherV2 MirrorPad Pack Pad PadV2 ReverseV2 Roll
Slice SpaceToBatchND SpaceToDepth Split SplitV StridedSlice StridedSliceGrad Tile Transpose Unpack
""".split())

RESHAPES = frozenset(("Reshape", "ExpandDims", "Squeeze"))
SHAPES = frozenset(("Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike"))
WINDOWS = frozenset(("Conv2D", "DepthwiseConv2dNative", "MaxPool", "AvgPool"))
BATCH_NORMS = frozenset(("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"))
REDUCTIONS = frozenset(("Sum", "Mean", "Max", "Min", "Prod", "EuclideanNorm"))
MATMULS = frozenset(("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"))


def apply(op: Any, ins: list[State]) -> list[State]:
    """Output states of ``op``, some of whose inputs are ``Dep``."""
    if op.type == "IdentityN":
        return list(ins)
    if op.type == "Print":   # tf.compat.v1.Print: its first input, printed
        return [ins[0]]
    if op.type in CONTROL_FLOW:   # never run on stand-ins (a loop may not end): static shapes, conservative
        return conservative(op, ins)
    try:
        outs = run_op(op, substitutes(ins))
    except PatternUnknown:
        raise
    except Exception as err:  # noqa: BLE001 - no shapes: the pattern cannot be found
        raise PatternUnknown(f"sparsity: op {op.name} ({op.type}) could not be run for its shapes: "
                             f"{type(err).__name__}") from err
    if op.type in SHAPES:   # what they give does not depend on the values: run on zeros, it is right
        return [Val(v) for v in outs]
    shapes = [tuple(np.shape(v)) for v in outs]
    floats = [t.dtype.is_floating or t.dtype.is_complex for t in op.outputs]
    patterns, ruled = _patterns(op, ins, shapes)
    if not ruled and any(floats):
        note_no_rule(op)
    if any(f and p is None for f, p in zip(floats, patterns)) and op.type not in BATCH_NORMS:
        note_no_rule(op)
        fill = iter(conservative_patterns(ins, [sh for sh, f, p in zip(shapes, floats, patterns) if f and p is None]))
        patterns = [next(fill) if f and p is None else p for f, p in zip(floats, patterns)]
    for shape, p in zip(shapes, patterns):
        if p is not None and p.shape[0] != math.prod(shape):
            raise PatternUnknown(f"sparsity: the rule of {op.type} ({op.name}) gave {p.shape[0]} rows for "
                                 f"{math.prod(shape)} elements")
    return [Dep(shape, p, t.dtype) if f and p is not None else Opaque(shape, t.dtype)
            for shape, p, f, t in zip(shapes, patterns, floats, op.outputs)]


def _patterns(op: Any, ins: list[State], shapes: list[tuple[int, ...]]) -> tuple[list[Any], bool]:
    """The output patterns (None: no pattern for that output) and whether a rule gave them (else conservative)."""
    from worker.engine.sparsity import accumulate

    kind = op.type
    try:
        if kind in ELEMENTWISE:
            return [elementwise(op, ins, shapes[0])], True
        if kind in RESHAPES and isinstance(ins[0], Dep) and math.prod(shapes[0]) == ins[0].size:
            return [ins[0].pattern], True
        if kind in MOVES:
            return moves(op, ins), True
        if kind in accumulate.OPS:
            return accumulate.patterns(op, ins, shapes), True
        if kind in WINDOWS and isinstance(ins[0], Dep) and not any(isinstance(s, Dep) for s in ins[1:]):
            return [window(op, ins, shapes[0])], True
        if kind in MATMULS:
            return [matmul(op, ins, shapes[0])], True
        if kind in REDUCTIONS and isinstance(ins[0], Dep) and isinstance(ins[1], Val):
            return [reduction(op, ins[0], np.asarray(ins[1].value), shapes[0])], True
        if kind in ("Softmax", "LogSoftmax"):
            return [last_axis(ins[0])], True
        if kind == "BiasAddGrad" and isinstance(ins[0], Dep) and _attr(op, "data_format", b"NHWC") == b"NHWC":
            return [reduction(op, ins[0], np.arange(len(ins[0].shape) - 1), shapes[0])], True   # a gradient's
        if kind in BATCH_NORMS and not op.get_attr("is_training") and isinstance(ins[0], Dep) \
                and not any(isinstance(s, Dep) for s in ins[1:]):
            return [ins[0].pattern] + [None] * (len(shapes) - 1), True
    except NoRule:
        pass
    return conservative_patterns(ins, shapes), False


class NoRule(Exception):
    """The rule does not fit this use of the op: the conservative rule is taken."""


def conservative(op: Any, ins: list[State]) -> list[State]:
    """Every output element depends on every ``wrt`` element an input does (outputs in static shapes)."""
    note_no_rule(op)
    shapes = []
    for t in op.outputs:
        if t.shape.rank is None or not t.shape.is_fully_defined():
            raise PatternUnknown(f"sparsity: op {op.name} ({op.type}) has an output of unknown shape")
        shapes.append(tuple(int(d) for d in t.shape.as_list()))
    return [Dep(s, p, t.dtype) for s, p, t in zip(shapes, conservative_patterns(ins, shapes), op.outputs)]


def conservative_patterns(ins: list[State], shapes: list[tuple[int, ...]]) -> list[Any]:
    import scipy.sparse as sp

    deps = [s.pattern for s in ins if isinstance(s, Dep)]
    n_wrt = deps[0].shape[1]
    union = np.unique(np.concatenate([p.indices for p in deps])) if deps else np.empty(0, np.int64)
    out = []
    for shape in shapes:
        n = math.prod(shape)
        if n * len(union) > MAX_NNZ:
            raise PatternUnknown(f"sparsity: an op without a rule joins {len(union)} wrt elements into each of "
                                 f"its {n} outputs: too dense to pay")
        indptr = np.arange(n + 1, dtype=np.int64) * len(union)
        out.append(sp.csr_array((np.ones(n * len(union), bool), np.tile(union, n), indptr), shape=(n, n_wrt)))
    return out


def _rows(pattern: Any, index: np.ndarray) -> Any:
    """Rows ``index`` of a pattern, ``-1`` for an empty row."""
    import scipy.sparse as sp

    index = np.asarray(index, np.int64).ravel()
    counts = np.diff(pattern.indptr)
    if index.size and int(counts[np.clip(index, 0, None)].sum()) > MAX_NNZ:
        raise PatternUnknown(f"sparsity: a pattern of more than {MAX_NNZ} entries: too dense to pay")
    if index.size and index.min() < 0:
        pattern = sp.vstack([pattern, sp.csr_array((1, pattern.shape[1]), dtype=bool)], format="csr")
        index = np.where(index < 0, pattern.shape[0] - 1, index)
    if index.size == pattern.shape[0] and np.array_equal(index, np.arange(index.size)):
        return pattern
    return pattern[index]


def union(patterns: list[Any]) -> Any:
    out = patterns[0]
    for p in patterns[1:]:
        out = (out + p).tocsr()
    return out


def index_map(rows: np.ndarray, cols: np.ndarray, n_out: int, n_in: int) -> Any:
    """The boolean map ``(n_out, n_in)`` with entries ``(rows, cols)``, entries with ``cols < 0`` dropped."""
    import scipy.sparse as sp

    keep = cols >= 0
    return sp.csr_array((np.ones(int(keep.sum()), bool), (rows[keep], cols[keep])), shape=(n_out, n_in))


def elementwise(op: Any, ins: list[State], shape: tuple[int, ...]) -> Any:
    """Broadcasting: an output element reads the element of each ``Dep`` input that broadcasts onto it."""
    parts = []
    data_format = _attr(op, "data_format", b"NHWC")
    for position, s in enumerate(ins):
        if not isinstance(s, Dep):
            continue
        src_shape = s.shape
        if op.type == "BiasAdd" and position == 1 and data_format.startswith(b"NC") and len(shape) > 2:
            src_shape = (s.shape[0],) + (1,) * (len(shape) - 2)
        ids = np.arange(s.size, dtype=np.int64).reshape(src_shape)
        try:
            index = np.broadcast_to(ids, shape)
        except ValueError as err:
            raise NoRule from err
        parts.append(_rows(s.pattern, index))
    return union(parts)


def moves(op: Any, ins: list[State]) -> list[Any]:
    """The op run on ids: 1-based int64 ids for ``Dep`` inputs (offset per input), 0 for other float data."""
    import scipy.sparse as sp
    import tensorflow as tf

    args, deps, offset = [], [], 0
    for s in ins:
        if isinstance(s, Dep):
            args.append(tf.constant(np.arange(offset + 1, offset + s.size + 1, dtype=np.int64).reshape(s.shape)))
            deps.append(s.pattern)
            offset += s.size
        elif isinstance(s, Val) and not _is_float(s.value):
            args.append(s.value)
        elif s.shape is not None and (isinstance(s, Val) or s.dtype is None or tf.as_dtype(s.dtype).is_floating):
            args.append(tf.zeros(s.shape, tf.int64))
        else:
            raise NoRule   # an index argument of unknown value
    try:
        outs = run_op(op, args)
    except Exception as err:  # noqa: BLE001 - no int64 kernel, or arguments it refuses: conservative
        raise NoRule from err
    stacked = sp.vstack(deps, format="csr") if len(deps) > 1 else deps[0]
    return [_rows(stacked, np.asarray(o, np.int64).ravel() - 1) if np.asarray(o).dtype == np.int64 else None
            for o in outs]


def _is_float(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    try:
        return bool(np.issubdtype(np.dtype(dtype), np.floating))
    except TypeError:
        return bool(getattr(dtype, "is_floating", False))


def _attr(op: Any, name: str, default: Any) -> Any:
    try:
        return op.get_attr(name)
    except ValueError:
        return default


def window(op: Any, ins: list[State], shape: tuple[int, ...]) -> Any:
    """Each output element reads its window: all channels (``Conv2D``) or its own channel (depthwise, pools)."""
    import tensorflow as tf

    x = ins[0]
    assert isinstance(x, Dep)
    if len(x.shape) != 4 or _attr(op, "data_format", b"NHWC") != b"NHWC":
        raise NoRule
    channels = x.shape[3]
    if op.type in ("MaxPool", "AvgPool"):
        k, st = list(op.get_attr("ksize")), list(op.get_attr("strides"))
        if k[0] != 1 or k[3] != 1 or st[0] != 1 or st[3] != 1:   # pooling across the batch or the channels
            raise NoRule
        size, strides, rates = [1, k[1], k[2], 1], st, [1, 1, 1, 1]
    else:
        filt = ins[1].shape
        if filt is None or len(filt) != 4:
            raise NoRule
        size, strides, rates = [1, filt[0], filt[1], 1], list(op.get_attr("strides")), list(op.get_attr("dilations"))
    padding = op.get_attr("padding").decode()
    ids = tf.constant(np.arange(1, x.size + 1, dtype=np.int64).reshape(x.shape))
    if padding == "EXPLICIT":
        pads = np.asarray(op.get_attr("explicit_paddings"), np.int64).reshape(4, 2)
        ids, padding = tf.pad(ids, pads), "VALID"
    patches = tf.image.extract_patches(ids, sizes=size, strides=strides, rates=rates, padding=padding).numpy()
    n_pos = math.prod(patches.shape[:3])
    if patches.shape[:3] != shape[:3]:
        raise NoRule
    out_channels = shape[3]
    if op.type == "Conv2D":
        cols = patches.reshape(n_pos, -1) - 1
        rows = np.repeat(np.arange(n_pos, dtype=np.int64), cols.shape[1])
        per_position = index_map(rows, cols.ravel(), n_pos, x.size) @ x.pattern
        return _rows(per_position.tocsr(), np.repeat(np.arange(n_pos, dtype=np.int64), out_channels))
    cols = patches.reshape(n_pos, -1, channels).transpose(0, 2, 1).reshape(n_pos * channels, -1) - 1
    rows = np.repeat(np.arange(n_pos * channels, dtype=np.int64), cols.shape[1])
    per_channel = (index_map(rows, cols.ravel(), n_pos * channels, x.size) @ x.pattern).tocsr()
    multiplier = out_channels // channels
    return _rows(per_channel, np.repeat(np.arange(n_pos * channels, dtype=np.int64), multiplier))



def matmul(op: Any, ins: list[State], shape: tuple[int, ...]) -> Any:
    """``a @ b`` (batched, broadcasting): output ``[..., i, j]`` reads row ``i`` of ``a`` and column ``j`` of ``b``."""
    a, b = ins[0], ins[1]
    if op.type == "MatMul":
        ta, tb = op.get_attr("transpose_a"), op.get_attr("transpose_b")
    else:
        ta, tb = op.get_attr("adj_x"), op.get_attr("adj_y")
    parts = []
    for s, transposed, reads_rows in ((a, ta, True), (b, tb, False)):
        if not isinstance(s, Dep):
            continue
        ids = np.arange(s.size, dtype=np.int64).reshape(s.shape)
        if transposed:
            ids = np.swapaxes(ids, -1, -2)
        if not reads_rows:
            ids = np.swapaxes(ids, -1, -2)     # lines of b are its columns
        lines = ids.reshape(-1, ids.shape[-1])  # (batch... * lines, k)
        n_lines = lines.shape[0]
        per_line = (index_map(np.repeat(np.arange(n_lines, dtype=np.int64), lines.shape[1]), lines.ravel(), n_lines,
                         s.size) @ s.pattern).tocsr()
        line_ids = np.arange(n_lines, dtype=np.int64).reshape(ids.shape[:-1])
        line_ids = line_ids[..., :, None] if reads_rows else line_ids[..., None, :]
        try:
            index = np.broadcast_to(line_ids, shape)
        except ValueError as err:
            raise NoRule from err
        parts.append(_rows(per_line, index))
    return union(parts)


def reduction(op: Any, x: Dep, axes: np.ndarray, shape: tuple[int, ...]) -> Any:
    """Each output element reads the input elements reduced into it."""
    axes = tuple(int(a) % len(x.shape) for a in np.atleast_1d(axes)) if len(x.shape) else ()
    grids = np.indices(x.shape, dtype=np.int64) if x.shape else np.zeros((0,), np.int64)
    kept = [i for i in range(len(x.shape)) if i not in axes]
    kept_shape = tuple(x.shape[i] for i in kept)
    if math.prod(kept_shape) != math.prod(shape):
        raise NoRule
    target = np.ravel_multi_index(tuple(grids[i] for i in kept), kept_shape) if kept else \
        np.zeros(x.shape, np.int64)
    return (index_map(np.asarray(target).ravel(), np.arange(x.size, dtype=np.int64), math.prod(shape), x.size)
            @ x.pattern).tocsr()


def last_axis(x: Any) -> Any:
    """Softmax over the last axis: an element reads every element of its row."""
    if not isinstance(x, Dep) or not x.shape:
        raise NoRule
    n = x.shape[-1]
    rows = x.size // n
    group = np.arange(x.size, dtype=np.int64) // n
    per_row = (index_map(group, np.arange(x.size, dtype=np.int64), rows, x.size) @ x.pattern).tocsr()
    return _rows(per_row, group)
