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


def per_example_losses(tf, loss: str, y, t):
    """Each example's loss (axis 0 of ``y``; the mean inside an example, as Keras reduces), TensorFlow's own losses:
    ``mse``, ``sigmoid_cross_entropy``, ``softmax_cross_entropy`` (integer ``t``: class ids)."""
    n = y.shape[0]
    if loss == "mse":
        e = tf.square(y - t)
    elif loss == "sigmoid_cross_entropy":
        e = tf.nn.sigmoid_cross_entropy_with_logits(labels=t, logits=y)
    elif t.dtype.is_integer:
        e = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=t, logits=y)
    else:
        e = tf.nn.softmax_cross_entropy_with_logits(labels=t, logits=y)
    return tf.reduce_mean(tf.reshape(e, [n, -1]), axis=1)


def curvature_references(jac: np.ndarray, y: np.ndarray, loss: str, labels: np.ndarray):
    """``(G, F, L)``: the Gauss-Newton matrix ``J^T H_L J`` (``H_L`` by nested tapes over the loss of the outputs
    ``y``), the empirical Fisher ``(1/N) sum_i g_i g_i^T`` (``g_i = J^T dl_i/dy`` by a tape Jacobian of the
    per-example losses) and the loss value, from ``jac`` ``(y.size, n_wrt)``; no formula of the engine's."""
    import tensorflow as tf

    y64 = tf.constant(np.asarray(y, np.float64))
    t = tf.constant(labels if labels.dtype.kind in "iu" else labels.astype(np.float64))
    with tf.GradientTape() as outer:
        outer.watch(y64)
        with tf.GradientTape(persistent=True) as inner:
            inner.watch(y64)
            each = per_example_losses(tf, loss, y64, t)
            total = tf.reduce_mean(each)
        grad = tf.reshape(inner.gradient(total, y64), [-1])
    n_of = int(np.prod(y.shape))
    hl = np.asarray(outer.jacobian(grad, y64)).reshape(n_of, n_of)
    g = np.asarray(inner.jacobian(each, y64)).reshape(len(each), n_of) @ jac
    return jac.T @ hl @ jac, g.T @ g / len(g), float(total)
