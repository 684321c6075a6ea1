"""``J t`` where TensorFlow cannot differentiate twice or run forward mode: the label ``reverse/rows``.

Both of ``worker.engine.matfree``'s ways to a JVP need more than reverse mode: forward mode
(``ForwardAccumulator``) and the derivative of a VJP with respect to its cotangent (``d/du <J^T u, t>``, a
gradient of a gradient). Through a ``While`` op that reads a captured variable (a Keras GRU or LSTM that is not
unrolled, an ODE integrator in a ``tf.while_loop``) TensorFlow fails at both, in every strategy, while VJPs work.
``reverse/rows`` takes ``J``'s rows from VJPs of one-hot cotangents (``n_of`` of them, through the operator's own
``vjp``, chosen and checked as any kind's first call), keeps ``J`` (``n_of x n_wrt``) on the operator and answers
``J t`` as ``t @ J^T`` on the host (and, once ``J`` is kept, ``u^T J`` as ``u @ J``): exact, and each later product
costs a matrix product, which suits ``svd``'s repeated calls. It is tried last, and only while ``J`` fits
``limit_bytes`` (``memory_budget_bytes`` when the request sets one, else ``ROWS_MAX_BYTES``); the refusal that
remains names that fix (``refusal``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from contracts.kinds import kind_spec
from worker.engine.errors import NotDifferentiable

if TYPE_CHECKING:
    from worker.engine.matfree import Operator

LABEL = "reverse/rows"
ROWS_MAX_BYTES = 1 << 30   # J kept on the host for reverse/rows when the request sets no memory budget
BLOCK_ROWS = 256           # one-hot cotangents per call of the operator's vjp


class RowsTooLarge(RuntimeError):
    """``J`` would not fit the limit of ``reverse/rows`` (a failure of that label, not of the request)."""


def applies(kind: str) -> bool:
    """Products along ``of`` of one derivative (``J t``): what J's rows can answer."""
    spec = kind_spec(kind)
    return spec.product_axes == "of" and not spec.scalar_of and "reverse" in spec.routes


def transposes(kind: str) -> bool:
    """Products along ``wrt`` of one derivative (``u^T J``): what a kept J answers on the host as well."""
    spec = kind_spec(kind)
    return spec.seeds == "of" and not spec.scalar_of and not spec.curvature


def rows_bytes(op: Operator) -> int:
    return op.n_of * op.n_wrt * np.dtype(op.compute_dtype).itemsize


def limit_bytes(op: Operator) -> int:
    return int(op.budget_bytes) if op.budget_bytes else ROWS_MAX_BYTES


def jvp_by_rows(op: Operator, seeds: np.ndarray) -> np.ndarray:
    """``J t`` for flat tangents ``(k, n_wrt)``: ``(k, n_of)`` in the compute dtype, from ``J``'s rows (computed on
    the first call by VJPs, then kept). Raises ``RowsTooLarge`` over the limit, ``RuntimeError`` when VJPs fail."""
    if op.jacobian_rows is None:
        need, limit = rows_bytes(op), limit_bytes(op)
        if need > limit:
            raise RowsTooLarge(f"J ({op.n_of} x {op.n_wrt}) takes {need} bytes, over the {limit} bytes it may take")
        rows = np.empty((op.n_of, op.n_wrt), op.compute_dtype)
        before, op.failures = op.failures, {}
        try:
            for start in range(0, op.n_of, BLOCK_ROWS):
                stop = min(op.n_of, start + BLOCK_ROWS)
                onehot = np.zeros((stop - start, op.n_of), op.compute_dtype)
                onehot[np.arange(stop - start), np.arange(start, stop)] = 1
                rows[start:stop] = op.apply("vjp", onehot)
        except NotDifferentiable as err:   # no VJP either: a failure of this label, the refusal names it
            raise RuntimeError(f"VJPs fail too ({err})") from err
        finally:   # the vjp labels that failed, named as such beside the jvp labels
            op.failures = {**before, **{f"vjp {k}": v for k, v in op.failures.items()}}
        op.jacobian_rows = rows
    return np.asarray(seeds, op.compute_dtype) @ op.jacobian_rows.T


def refusal(op: Operator, kind: str) -> NotDifferentiable:
    """The error when no label computes ``kind``: what each label said, and the change that makes one work."""
    tried = "; ".join(f"{k}: {v}" for k, v in op.failures.items())
    head = (f"TensorFlow cannot compute {kind} of {op.of!r} with respect to {', '.join(op.axis.names)} in this "
            f"SavedModel ({tried})")
    asked = op.routes.get(kind, "auto")
    if asked == "forward" and applies(kind):
        return NotDifferentiable(f"mode: {head}. Forward mode fails here; use mode 'auto' or 'reverse' (J v from "
                                 "VJPs)", field="mode")
    why = op.failures.get(LABEL, "")
    if why.startswith(RowsTooLarge.__name__):
        return NotDifferentiable(f"memory_budget_bytes: {head}. Forward mode and second derivatives fail here, and "
                                 f"J v from VJPs keeps J ({rows_bytes(op)} bytes); set memory_budget_bytes to at least "
                                 f"{rows_bytes(op)}, or ask for a smaller of or wrt", field="memory_budget_bytes")
    if applies(kind):
        fix = ("reverse mode fails too; re-export the model with differentiable ops (the failing op is named "
               "above) or choose a wrt that of depends on differentiably")
    else:
        fix = ("second derivatives fail here (the failing op is named above); re-export the model with ops whose "
               "gradients are differentiable, or ask for a kind of first derivatives (jvp, vjp, jacobian)")
    return NotDifferentiable(f"wrt: {head}. {fix[0].upper()}{fix[1:]}", field="wrt")

