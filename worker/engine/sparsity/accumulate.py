"""Index-set rules of the ops that gather many input elements into one output element by index or by position:
segment reductions (sorted, unsorted, sparse), ``ScatterNd``, ``TensorScatter*``, cumulative sums and products,
``Einsum``. Each builds the boolean map ``(out elements, in elements)`` of ``worker.engine.sparsity.rules`` from
the op's attributes and its index inputs' values (``Val``); an index of unknown value has no rule here.

The moves of ``rules`` run the op itself on element ids, which is right only when each output element copies at
most one input element: a segment sum or a scatter with repeated indices adds ids, hence this module.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from worker.engine.sparsity.rules import _map, _NoRule, _or
from worker.engine.sparsity.walk import Dep, State, Val

SEGMENTS = frozenset(("SegmentSum", "SegmentMean", "SegmentMax", "SegmentMin", "SegmentProd", "SegmentSumV2",
                      "SegmentMaxV2", "SegmentMinV2", "SegmentProdV2", "UnsortedSegmentSum", "UnsortedSegmentMax",
                      "UnsortedSegmentMin", "UnsortedSegmentProd"))
SPARSE_SEGMENTS = frozenset(("SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN",
                             "SparseSegmentSumWithNumSegments", "SparseSegmentMeanWithNumSegments",
                             "SparseSegmentSqrtNWithNumSegments"))
TENSOR_SCATTERS = frozenset(("TensorScatterUpdate", "TensorScatterAdd", "TensorScatterSub", "TensorScatterMax",
                             "TensorScatterMin"))
CUMULATIVE = frozenset(("Cumsum", "Cumprod", "CumulativeLogsumexp"))
OPS = SEGMENTS | SPARSE_SEGMENTS | TENSOR_SCATTERS | CUMULATIVE | {"ScatterNd", "Einsum"}


def patterns(op: Any, ins: list[State], shapes: list[tuple[int, ...]]) -> list[Any]:
    """The output patterns of ``op`` (one of ``OPS``); raises ``_NoRule`` when its index inputs are not known."""
    kind, shape = op.type, shapes[0]
    if kind in SEGMENTS:
        return [segments(ins[0], _known(ins[1]), shape)]
    if kind in SPARSE_SEGMENTS:
        return [segments(ins[0], _known(ins[2]), shape, rows=_known(ins[1]))]
    if kind == "ScatterNd":
        return [scatter(ins[1], _known(ins[0]), shape)]
    if kind in TENSOR_SCATTERS:
        return [tensor_scatter(ins[0], _known(ins[1]), ins[2], shape, replaces=kind == "TensorScatterUpdate")]
    if kind in CUMULATIVE:
        return [cumulative(ins[0], int(_known(ins[1])), exclusive=bool(op.get_attr("exclusive")),
                           reverse=bool(op.get_attr("reverse")))]
    if kind == "Einsum":
        return [einsum(op.get_attr("equation").decode(), ins, shape)]
    raise _NoRule


def _known(s: State) -> np.ndarray:
    if not isinstance(s, Val):
        raise _NoRule   # an index computed from wrt, or a placeholder's: its values are not known
    return np.asarray(s.value).astype(np.int64)


def _dep(s: State) -> Dep:
    if not isinstance(s, Dep):
        raise _NoRule
    return s


def segments(data: State, segment_ids: np.ndarray, shape: tuple[int, ...], *, rows: np.ndarray | None = None) -> Any:
    """``out[segment_ids[k], ...]`` reads ``data[rows[k], ...]`` (``rows``: the sparse segments' ``indices``; else
    ``data``'s leading elements in order, ``segment_ids`` of any leading shape). Negative ids drop their rows."""
    data = _dep(data)
    lead = segment_ids.shape if rows is None else rows.shape
    if rows is None and tuple(data.shape[:segment_ids.ndim]) != tuple(segment_ids.shape):
        raise _NoRule
    inner = math.prod(data.shape[segment_ids.ndim if rows is None else 1:])
    if not shape or math.prod(shape[1:]) != inner:
        raise _NoRule
    source = np.arange(math.prod(lead), dtype=np.int64) if rows is None else rows.ravel()
    target = segment_ids.ravel()
    if target.shape != source.shape:
        raise _NoRule
    keep = (target >= 0) & (target < shape[0])
    return _spread(data, source[keep], target[keep], inner, math.prod(shape))


def _spread(src: Dep, src_rows: np.ndarray, out_rows: np.ndarray, inner: int, n_out: int) -> Any:
    """Output element ``out_rows[k] * inner + t`` reads input element ``src_rows[k] * inner + t``."""
    t = np.arange(inner, dtype=np.int64)
    out = (out_rows[:, None] * inner + t).ravel()
    cols = (src_rows[:, None] * inner + t).ravel()
    return (_map(out, cols, n_out, src.size) @ src.pattern).tocsr()


def _targets(indices: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """The output slices ``indices (..., K)`` address (flat over ``shape[:K]``) and the elements in each."""
    depth = indices.shape[-1] if indices.ndim else 0
    if indices.ndim == 0 or depth > len(shape):
        raise _NoRule
    index = indices.reshape(-1, depth)
    if index.size and (index.min() < 0 or np.any(index >= np.asarray(shape[:depth]))):
        raise _NoRule   # out of range: the op refuses or drops them; no exact rule
    flat = np.ravel_multi_index(tuple(index.T), shape[:depth]) if depth else np.zeros(len(index), np.int64)
    return np.asarray(flat, np.int64), math.prod(shape[depth:])


def scatter(updates: State, indices: np.ndarray, shape: tuple[int, ...]) -> Any:
    """``ScatterNd``: the slice at ``indices[k]`` reads ``updates[k, ...]`` (repeated indices add)."""
    updates = _dep(updates)
    targets, inner = _targets(indices, shape)
    if updates.size != len(targets) * inner:
        raise _NoRule
    return _spread(updates, np.arange(len(targets), dtype=np.int64), targets, inner, math.prod(shape))


def tensor_scatter(tensor: State, indices: np.ndarray, updates: State, shape: tuple[int, ...], *,
                   replaces: bool) -> Any:
    """``TensorScatter*``: every element reads its own in ``tensor`` (but the ones an update ``replaces``), and
    the slice at ``indices[k]`` reads ``updates[k, ...]``."""
    n = math.prod(shape)
    targets, inner = _targets(indices, shape)
    parts = []
    if isinstance(tensor, Dep):
        keep = np.ones(n, bool)
        if replaces:
            keep[(targets[:, None] * inner + np.arange(inner, dtype=np.int64)).ravel()] = False
        ids = np.arange(n, dtype=np.int64)
        parts.append((_map(ids, np.where(keep, ids, -1), n, n) @ tensor.pattern).tocsr())
    if isinstance(updates, Dep):
        if updates.size != len(targets) * inner:
            raise _NoRule
        parts.append(_spread(updates, np.arange(len(targets), dtype=np.int64), targets, inner, n))
    if not parts:
        raise _NoRule
    return _or(parts)


def cumulative(x: State, axis: int, *, exclusive: bool, reverse: bool) -> Any:
    """``Cumsum`` and kin along ``axis``: position ``k`` reads positions ``j <= k`` (``j < k`` exclusive; ``>=``,
    ``>`` reversed) of its line."""
    x = _dep(x)
    if not x.shape:
        raise _NoRule
    axis %= len(x.shape)
    ids = np.moveaxis(np.arange(x.size, dtype=np.int64).reshape(x.shape), axis, -1)
    lines = ids.reshape(-1, x.shape[axis])          # (lines, length): each line's element ids in order
    k = lines.shape[1]
    j, i = np.meshgrid(np.arange(k), np.arange(k))  # i: the output position, j: a position it may read
    reads = (j >= i) if reverse else (j <= i)
    if exclusive:
        reads &= i != j
    out_pos, in_pos = np.nonzero(reads)
    rows = lines[:, out_pos].ravel()
    cols = lines[:, in_pos].ravel()
    return (_map(rows, cols, x.size, x.size) @ x.pattern).tocsr()


_LABELS = re.compile(r"^[a-zA-Z]*$")


def einsum(equation: str, ins: list[State], shape: tuple[int, ...]) -> Any:
    """``Einsum`` without ellipses or repeated labels within an operand: an output element reads, in each
    operand, the elements whose labels shared with the output equal its own (every value of the summed ones)."""
    if "->" not in equation:
        raise _NoRule
    lhs, out_labels = equation.replace(" ", "").split("->")
    operands = lhs.split(",")
    if len(operands) != len(ins) or not all(_LABELS.match(s) for s in operands + [out_labels]) \
            or len(set(out_labels)) != len(out_labels) or len(out_labels) != len(shape):
        raise _NoRule
    n_out = math.prod(shape)
    out_index = np.indices(shape, dtype=np.int64).reshape(len(shape), -1) if shape else np.zeros((0, 1), np.int64)
    parts = []
    for labels, s in zip(operands, ins):
        if not isinstance(s, Dep):
            continue
        if len(set(labels)) != len(labels) or len(labels) != len(s.shape):
            raise _NoRule
        ids = np.arange(s.size, dtype=np.int64).reshape(s.shape)
        shared = [c for c in labels if c in out_labels]
        summed = [c for c in labels if c not in out_labels]
        ids = np.transpose(ids, [labels.index(c) for c in shared + summed])
        ids = ids.reshape(ids.shape[:len(shared)] + (-1,))          # (shared dims..., summed elements)
        at = tuple(out_index[out_labels.index(c)] for c in shared)  # each output element's shared labels
        if any(s.shape[labels.index(c)] not in (1, shape[out_labels.index(c)]) for c in shared):
            raise _NoRule
        at = tuple(np.minimum(a, ids.shape[d] - 1) for d, a in enumerate(at))   # a size-1 label broadcasts
        cols = ids[at] if shared else np.broadcast_to(ids, (n_out, ids.shape[-1]))
        rows = np.repeat(np.arange(n_out, dtype=np.int64), cols.shape[-1])
        parts.append((_map(rows, np.asarray(cols).ravel(), n_out, s.size) @ s.pattern).tocsr())
    if not parts:
        raise _NoRule
    return _or(parts)
