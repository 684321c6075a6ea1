"""Naive references: TensorFlow's own ``tape.jacobian`` / ``batch_jacobian`` and finite differences."""

from __future__ import annotations

import numpy as np


def _target(model, inputs, wrt):
    import tensorflow as tf

    if wrt.startswith("variables/"):
        return model.find_variable(wrt[10:])[1], {n: tf.constant(v) for n, v in inputs.items()}
    tensors = {n: tf.constant(v) for n, v in inputs.items()}
    return tensors[wrt], tensors


def tape_jacobian(model, inputs, of, wrt, *, batch=False, use_pfor=True):
    import tensorflow as tf

    target, tensors = _target(model, inputs, wrt)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(target)
        y = model.fn(**tensors)[of]
    if batch:
        return tape.batch_jacobian(y, target, experimental_use_pfor=use_pfor).numpy()
    return tape.jacobian(y, target, experimental_use_pfor=use_pfor).numpy()


def eager_rows(model, inputs, of, wrt):
    """Row by row in eager mode (for models that graph-mode gradients cannot handle)."""
    import tensorflow as tf

    target, tensors = _target(model, inputs, wrt)
    rows = []
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(target)
        y = model.fn(**tensors)[of]
    for i in range(int(np.prod(y.shape))):
        seed = tf.reshape(tf.one_hot(i, int(np.prod(y.shape)), dtype=y.dtype), y.shape)
        rows.append(tape.gradient(y, target, output_gradients=seed).numpy())
    return np.stack(rows).reshape(tuple(y.shape) + tuple(target.shape))


def tape_hessian(model, inputs, of, wrt, *, reduce=None):
    import tensorflow as tf

    target, tensors = _target(model, inputs, wrt)
    with tf.GradientTape() as outer:
        outer.watch(target)
        with tf.GradientTape() as inner:
            inner.watch(target)
            y = model.fn(**tensors)[of]
            s = tf.reduce_sum(y) if reduce == "sum" else y
        g = inner.gradient(s, target)
    return outer.jacobian(g, target).numpy()


def finite_differences(model, inputs, of, wrt, *, eps=1e-6):
    """Central differences d of / d wrt (float64 models); shape of.shape + wrt.shape."""
    import tensorflow as tf

    x0 = np.array(inputs[wrt], dtype=np.float64)
    cols = []
    for i in range(x0.size):
        d = np.zeros_like(x0)
        d.flat[i] = eps
        up = dict(inputs, **{wrt: x0 + d})
        dn = dict(inputs, **{wrt: x0 - d})
        fu = model.fn(**{n: tf.constant(v) for n, v in up.items()})[of].numpy()
        fd = model.fn(**{n: tf.constant(v) for n, v in dn.items()})[of].numpy()
        cols.append((fu - fd) / (2 * eps))
    out = np.stack(cols, axis=-1)
    return out.reshape(cols[0].shape + x0.shape)
