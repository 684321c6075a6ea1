"""The curvature of a loss on ``of``: the generalized Gauss-Newton matrix ``G = J^T H_L J`` and the empirical Fisher
``F = (1/N) sum_i g_i g_i^T``, as products without forming a matrix: one JVP (``J v``), the middle matrix applied
on the host in float64, one VJP (kinds ``ggn_vp``, ``fisher_vp``, and ``ggn_eig``, ``ggn_trace``, ``ihvp`` through
them). The loss is never differentiated twice through the model: ``H_L`` is written out for each loss.

The losses, on ``y`` = ``of`` of shape ``(N,) + rest`` with ``M`` elements, ``t`` the labels; they are what Keras
computes with its default reduction (the mean) and ``from_logits=True``:

- ``mse``: ``L = (1/M) sum (y - t)^2``; ``H_L = (2/M) I``.
- ``sigmoid_cross_entropy`` (``y`` logits, ``p = sigmoid(y)``): ``L = (1/M) sum [softplus(y) - t y]``;
  ``H_L = (1/M) diag(p (1 - p))``.
- ``softmax_cross_entropy`` (``y`` logits, classes on the last axis, ``R = M / C`` rows, ``p = softmax`` of each):
  ``L = (1/R) sum_rows [logsumexp(y) - t . y]`` for label rows ``t`` that sum to one (class ids are one-hot rows);
  ``H_L = (1/R) blockdiag(diag(p) - p p^T)``.

None of these Hessians depends on the labels, so ``G`` needs none. The empirical Fisher does: its examples are
the entries of ``y``'s axis 0 (``N`` of them; a 0-d ``y``, or the class axis of a 1-d one, is one example), the
loss is ``L = (1/N) sum_i l_i``, and ``g_i`` is the gradient of example ``i``'s loss ``l_i`` w.r.t. the ``wrt``
axis: ``g_i = J^T r_i`` with ``r_i = dl_i/dy``, zero outside example ``i``'s outputs. So
``F v = J^T [(1/N) sum_i r_i r_i^T] J v``, the same sandwich with a block-diagonal middle of rank one per example.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from contracts import losses
from contracts.kinds import KINDS
from contracts.rules import RuleViolation
from worker.engine.errors import InvalidRequest

Middle = Callable[[np.ndarray], np.ndarray]   # (k, M) -> (k, M), float64


def examples(loss: str, shape: tuple[int, ...]) -> int:
    """``N``: the examples of ``y`` (its axis 0; one for a 0-d ``y`` or a 1-d softmax ``y``, whose axis is classes)."""
    if not shape or (loss == losses.SPARSE and len(shape) == 1):
        return 1
    return int(shape[0])


class LossCurvature:
    """The middle matrices of ``loss`` at the outputs ``y`` (any shape; float64 on the host) and ``labels``
    (None: the Gauss-Newton matrix only). ``ggn(u)`` and ``fisher(u)`` take and give ``(k, M)``."""

    def __init__(self, loss: str, y: np.ndarray, labels: np.ndarray | None = None) -> None:
        self.loss, self.shape = loss, tuple(int(d) for d in np.shape(y))
        y = np.asarray(y, np.float64)
        self.size = y.size
        if loss == losses.SPARSE:
            self.classes = self.shape[-1]
            z = y.reshape(-1, self.classes)
            z = np.exp(z - z.max(axis=1, keepdims=True))
            self.p = z / z.sum(axis=1, keepdims=True)          # (R, C)
        else:
            self.p = 1.0 / (1.0 + np.exp(-y.ravel())) if loss == "sigmoid_cross_entropy" else None
        self.y = y.ravel()
        self.targets = None if labels is None else self._targets(np.asarray(labels))

    def _targets(self, labels: np.ndarray) -> np.ndarray:
        """The labels as rows of ``y``'s layout, float64: class ids as one-hot rows."""
        if self.loss == losses.SPARSE and labels.shape == self.shape[:-1] and labels.dtype.kind in "iu":
            ids = labels.ravel().astype(np.int64)
            bad = (ids < 0) | (ids >= self.classes)
            if bad.any():
                at = [int(i) for i in np.unravel_index(int(np.argmax(bad)), labels.shape)] if labels.ndim else []
                raise InvalidRequest(f"labels: class id {int(ids[bad][0])} (at index {at}) is not one of the "
                                     f"{self.classes} classes of the last axis of of; send ids in [0, {self.classes})",
                                     field="labels")
            out = np.zeros((ids.size, self.classes))
            out[np.arange(ids.size), ids] = 1.0
            return out.ravel()
        return labels.astype(np.float64).ravel()

    def ggn(self, u: np.ndarray) -> np.ndarray:
        """``H_L u`` for rows ``u`` ``(k, M)``: the loss' Hessian w.r.t. ``y`` (module docstring)."""
        if self.loss == "mse":
            return u * (2.0 / self.size)
        if self.loss == "sigmoid_cross_entropy":
            return u * (self.p * (1.0 - self.p) / self.size)
        rows = u.reshape(len(u), -1, self.classes)                           # (k, R, C)
        pu = np.einsum("krc,rc->kr", rows, self.p)
        return ((self.p * rows - self.p * pu[..., None]) / rows.shape[1]).reshape(u.shape)

    def residuals(self) -> np.ndarray:
        """``r_i = dl_i/dy`` of each example ``(N, M / N)``: the per-example loss gradients w.r.t. ``y``."""
        if self.targets is None:
            raise InvalidRequest("labels: the empirical Fisher needs the labels; name the input that holds them",
                                 field="labels")
        n = examples(self.loss, self.shape)
        t = self.targets
        if self.loss == "mse":
            r = 2.0 * (self.y - t) * (n / self.size)
        elif self.loss == "sigmoid_cross_entropy":
            r = (self.p - t) * (n / self.size)
        else:
            rows = t.reshape(-1, self.classes)
            r = ((self.p * rows.sum(axis=1, keepdims=True) - rows) * (n * self.classes / self.size)).ravel()
        return r.reshape(n, -1)

    def fisher(self, u: np.ndarray) -> np.ndarray:
        """``(1/N) sum_i r_i (r_i . u)`` for rows ``u`` ``(k, M)``: the empirical Fisher's middle matrix."""
        r = self.residuals()
        n = len(r)
        per = u.reshape(len(u), n, -1)
        return (r[None] * np.einsum("knm,nm->kn", per, r)[..., None] / n).reshape(u.shape)


def loss_curvature(op: Any, loss: str, labels: np.ndarray | None = None) -> LossCurvature:
    """The curvature of ``loss`` on ``op``'s ``of`` at its inputs (one eager forward pass for ``y``), the rules of
    ``contracts.losses`` applied to the concrete shapes (``InvalidRequest`` naming ``of`` or ``labels``)."""
    shape = tuple(op.of_shape)
    try:
        losses.check_loss_of(loss, op.of, shape)
        if labels is not None:
            arr = np.asarray(labels)
            losses.check_labels(loss, "labels", arr.dtype.name, arr.shape, of=op.of, of_shape=shape)
    except RuleViolation as err:
        raise InvalidRequest(str(err), field=err.field) from None
    if labels is not None and not np.isfinite(np.asarray(labels, np.float64)).all():
        raise InvalidRequest("labels: hold NaN or infinite values; send finite labels", field="labels")
    y = np.asarray(op.model.fn(**op.inputs)[op.of], np.float64)
    return LossCurvature(loss, y, labels)


def middles(curvature: LossCurvature) -> dict[str, Middle]:
    """The middle matrix of each curvature product kind of the registry (``KindSpec.curvature``: the method of
    ``LossCurvature`` by that name), for ``Operator.middles``."""
    return {name: getattr(curvature, spec.curvature) for name, spec in KINDS.items() if spec.curvature}


def sandwich(op: Any, middle: Middle, seeds: np.ndarray) -> np.ndarray:
    """``J^T M J v`` for flat seeds ``(k, n_wrt)``: one batch of JVPs and one of VJPs through ``op``'s chosen routes
    (counted as such), ``M`` between them in float64; rows in ``op.compute_dtype``."""
    k = len(seeds)
    jv = op._call("jvp", seeds)
    op.counts["jvp"] += k
    mid = middle(np.asarray(jv, np.float64).reshape(k, -1))
    out = op._call("vjp", np.ascontiguousarray(mid, dtype=op.compute_dtype))
    op.counts["vjp"] += k
    return out

