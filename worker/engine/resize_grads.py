"""Second derivatives through image resizing, which TensorFlow 2.21 gets silently wrong or refuses.

A resize is linear in its image: ``ResizeBilinear`` is y = R x, and its registered gradient ``ResizeBilinearGrad``
computes Rᵀ g (the image input gives only a shape). TensorFlow registers ``ResizeBilinearGrad`` as
``NotDifferentiable`` (``tensorflow/python/ops/image_grad.py``), so every derivative of a resize's gradient is
*silently zero*: a Hessian or HVP through ``tf.image.resize(method="bilinear")`` or a Keras ``Resizing`` /
``UpSampling2D(interpolation="bilinear")`` layer, and a forward-mode JVP (TensorFlow computes one as the derivative
of a VJP), came back as zeros where they are not (found on a model of bilinear resizing, then tanh of a Dense
layer, whose Hessian Rᵀ Wᵀ diag(tanh'') W R is not zero). ``ResizeNearestNeighborGrad`` and ``ResizeBicubicGrad``
have no gradient at all, so the same derivatives fail with ``LookupError``.

Each gradient op is linear in its first input (Rᵀ g), so its derivative there is R, the resize itself, to the
gradient's spatial size, with the same ``align_corners`` and ``half_pixel_centers``. The derivative cannot be
registered on the gradient ops themselves: TensorFlow's tapes keep no inputs of an op it lists as needing none
(``NotDifferentiable`` ones included), so such a gradient would not know the size. ``install`` therefore replaces
the three resizes' own gradients with the same op (``resize_*_grad``, same values) wrapped in a
``tf.custom_gradient`` whose gradient is the resize. Exact, not an approximation:
``tests/engine/test_resize_grads.py`` checks Hessians, HVPs and JVPs against the explicit matrix R.
"""

from __future__ import annotations

from typing import Any

_INSTALLED = False


def _transposed(grad: Any, adjoint: Any, resize: Any, shape_arg: Any, op: Any) -> Any:
    """``adjoint(grad, shape_arg)`` (the resize's registered gradient, Rᵀ grad) with R as its own gradient."""
    import tensorflow as tf

    attrs = {"align_corners": op.get_attr("align_corners"), "half_pixel_centers": op.get_attr("half_pixel_centers")}

    @tf.custom_gradient
    def rt(g: Any) -> Any:
        def r(upstream: Any) -> Any:
            return resize(upstream, tf.shape(g)[1:3], **attrs)

        return adjoint(g, shape_arg, **attrs), r

    return rt(grad)


def _bilinear(op: Any, grad: Any) -> list[Any]:
    from tensorflow.python.ops import gen_image_ops as ops

    return [_transposed(grad, ops.resize_bilinear_grad, ops.resize_bilinear, op.inputs[0], op), None]


def _bicubic(op: Any, grad: Any) -> list[Any]:
    import tensorflow as tf
    from tensorflow.python.ops import gen_image_ops as ops

    if op.inputs[0].dtype not in (tf.float32, tf.float64):   # as TensorFlow's: no gradient for other dtypes
        return [None, None]
    return [_transposed(grad, ops.resize_bicubic_grad, ops.resize_bicubic, op.inputs[0], op), None]


def _nearest(op: Any, grad: Any) -> list[Any]:
    import tensorflow as tf
    from tensorflow.python.ops import gen_image_ops as ops

    image = op.inputs[0]
    size = image.shape[1:3] if image.shape[1:3].is_fully_defined() else tf.shape(image)[1:3]
    return [_transposed(grad, ops.resize_nearest_neighbor_grad, ops.resize_nearest_neighbor, size, op), None]


GRADIENTS = {"ResizeBilinear": _bilinear, "ResizeBicubic": _bicubic, "ResizeNearestNeighbor": _nearest}


def install() -> None:
    """Replace the three resizes' gradients (once per process; TensorFlow's registry has no public way to replace
    an entry, so it is removed and registered again)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from tensorflow.python.framework import ops

    entries = ops.gradient_registry._registry   # noqa: SLF001 (TensorFlow's, no public replace)
    for name, fn in GRADIENTS.items():
        entries.pop(name, None)
        ops.RegisterGradient(name)(fn)
    _INSTALLED = True
