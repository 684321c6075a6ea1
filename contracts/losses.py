"""The rules of a ``loss`` on ``of`` and its ``labels`` (the curvature kinds: ``ggn_vp``, ``fisher_vp``, ``ggn_eig``,
``ggn_trace``, ``ihvp`` with ``curvature: "ggn"``), on dtype names and shapes: no TensorFlow, no numpy.

The API applies them to ``of``'s declared shape and the request's tensors, the engine to the concrete ones
(``worker.engine.curvature``); each raises ``contracts.rules.RuleViolation`` naming the field and the fix.

- ``softmax_cross_entropy`` needs ``of`` with a class axis (its last): a 0-d ``of`` is refused.
- ``labels`` names an input of the request: an entry of ``inputs`` (an ``.npz`` member) that the signature does
  not take, or one of its inputs. Its shape is ``of``'s (targets, probabilities), or for
  ``softmax_cross_entropy`` also ``of.shape[:-1]`` with an integer dtype (class ids, as Keras'
  ``SparseCategoricalCrossentropy`` takes them). A tensor of ``of``'s shape is taken as targets or probabilities
  (one-hot rows) whatever its dtype.
"""

from __future__ import annotations

from contracts.rules import RuleViolation, Shape, fits, fmt_shape

INTEGER_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
LABEL_DTYPES = ("float16", "bfloat16", "float32", "float64", "bool", *INTEGER_DTYPES)
SPARSE = "softmax_cross_entropy"   # the one loss that takes class ids


def check_loss_of(loss: str, of: str, of_shape: Shape) -> None:
    """``of`` can carry ``loss``: ``softmax_cross_entropy`` needs a class axis (the last one)."""
    if loss == SPARSE and of_shape is not None and len(of_shape) == 0:
        raise RuleViolation(f"of: {loss} needs logits with a class axis (the last), and {of!r} is a scalar; choose "
                            "the logits output, or loss 'sigmoid_cross_entropy' for one logit", field="of")


def check_labels(loss: str, labels: str, dtype: str, shape: Shape, *, of: str, of_shape: Shape) -> None:
    """The tensor ``labels`` (``dtype``, ``shape``) fits ``loss`` on ``of`` (``of_shape``; ``None`` dims: any)."""
    if dtype not in LABEL_DTYPES:
        raise RuleViolation(f"labels: input {labels!r} is {dtype}; labels are numbers: send float targets or integer "
                            "class ids", field="labels")
    if fits(shape, of_shape):   # targets, probabilities or one-hot rows, whatever the dtype
        return
    if loss == SPARSE and of_shape is not None and len(of_shape) >= 1 and fits(shape, of_shape[:-1]):
        if dtype in INTEGER_DTYPES:
            return
        raise RuleViolation(f"labels: input {labels!r} has the shape of class ids ({fmt_shape(shape)}) but dtype "
                            f"{dtype}; send class ids as integers, or probabilities of {of!r}'s shape "
                            f"{fmt_shape(of_shape)}", field="labels")
    sparse = (f", or class ids (integers) of shape {fmt_shape(of_shape[:-1])}"
              if loss == SPARSE and of_shape is not None and len(of_shape) >= 1 else "")
    raise RuleViolation(f"labels: input {labels!r} has shape {fmt_shape(shape)}; {loss} on {of!r} takes labels of its "
                        f"shape {fmt_shape(of_shape)}{sparse}", field="labels")
