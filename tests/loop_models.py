"""Models whose outputs come out of a loop, where TensorFlow's forward mode fails (issue 30): a Keras GRU (not
unrolled: a ``While`` op in the SavedModel), an RK4 integrator in a float64 ``tf.while_loop``, and coupled oscillators
in one whose body reads a captured variable (Hessians through loops)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def gru(path: Path, *, steps: int = 5, features: int = 3, units: int = 4) -> Path:
    """Keras GRU (``unroll=False``) then Dense: ``seq`` (None, steps, features) float32 -> ``y`` (None, 2)."""
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((steps, features), name="seq")
    h = keras.layers.GRU(units, name="gru")(inp)
    out = keras.layers.Dense(2, name="out")(h)
    keras.Model(inp, {"y": out}).export(str(path), verbose=False)
    return path


def rk4(path: Path, *, n: int = 4, steps: int = 8, dt: float = 0.05, read_in_loop: bool = True) -> Path:
    """A ``tf.Module``: ``steps`` RK4 steps of ``dx/dt = tanh(W x) - 0.3 x`` in a float64 ``tf.while_loop``;
    ``x0`` (n,) float64 -> ``x`` (n,), the state at ``t = steps * dt``. ``read_in_loop``: the loop body reads the
    variable ``w`` (as users write it), else one tensor read before the loop."""
    import tensorflow as tf

    w0 = np.random.default_rng(3).standard_normal((n, n))

    class RK4(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = tf.Variable(w0, dtype=tf.float64, name="w")

        @tf.function(input_signature=[tf.TensorSpec([n], tf.float64, name="x0")])
        def __call__(self, x0):
            w_before = tf.convert_to_tensor(self.w)
            h = tf.constant(dt, tf.float64)

            def f(x):
                w = self.w if read_in_loop else w_before
                return tf.tanh(tf.linalg.matvec(w, x)) - 0.3 * x

            def body(i, x):
                k1 = f(x)
                k2 = f(x + 0.5 * h * k1)
                k3 = f(x + 0.5 * h * k2)
                k4 = f(x + h * k3)
                return i + 1, x + h / 6.0 * (k1 + 2.0 * k2 + 2.0 * k3 + k4)

            _, x = tf.while_loop(lambda i, x: i < steps, body, (tf.constant(0), x0))
            return {"x": x}

    m = RK4()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def oscillators(path: Path, *, n: int = 6, steps: int = 10, dt: float = 0.1, read_in_loop: bool = True) -> Path:
    """A ``tf.Module``: ``steps`` symplectic Euler steps of ``n`` anharmonic oscillators coupled by the variable
    ``k`` (n, n), in a float64 ``tf.while_loop`` (issue 30's second derivatives through a loop): ``q0`` (n,) float64
    -> ``energy`` (), the final ``sum(p^2 / 2 + q^4 / 4) + q^T k q / 2``, and ``q`` (n,). ``read_in_loop``: the loop
    body reads ``k`` (a captured variable, as users write it), else one tensor read before the loop (the re-export
    a refusal used to ask for: the same function)."""
    import tensorflow as tf

    k0 = np.random.default_rng(4).standard_normal((n, n)) * 0.3
    k0 = k0 @ k0.T + np.eye(n)

    class Oscillators(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.k = tf.Variable(k0, dtype=tf.float64, name="k")

        @tf.function(input_signature=[tf.TensorSpec([n], tf.float64, name="q0")])
        def __call__(self, q0):
            k_before = tf.convert_to_tensor(self.k)
            h = tf.constant(dt, tf.float64)

            def force(q):
                k = self.k if read_in_loop else k_before
                return -tf.linalg.matvec(k, q) - q ** 3

            def body(i, q, p):
                p = p + h * force(q)
                return i + 1, q + h * p, p

            _, q, p = tf.while_loop(lambda i, q, p: i < steps, body, (tf.constant(0), q0, tf.zeros_like(q0)))
            k = self.k if read_in_loop else k_before
            energy = tf.reduce_sum(p ** 2 / 2 + q ** 4 / 4) + 0.5 * tf.tensordot(q, tf.linalg.matvec(k, q), 1)
            return {"energy": energy, "q": q}

    m = Oscillators()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def crop(path: Path, *, side: int = 3, out: int = 4) -> Path:
    """A ``tf.Module`` where forward mode and second derivatives fail without a loop, reverse mode works:
    ``tf.image.crop_and_resize`` of the whole image to twice its side (TensorFlow 2.21 registers no gradient for
    ``CropAndResizeGradImage``), then ``tanh`` of a Dense layer: ``x`` (None, side, side, 1) float32 -> ``y``
    (None, out). (Bilinear resizing was this model until ``worker.engine.resize_grads`` made it differentiable.)"""
    import tensorflow as tf

    w0 = np.random.default_rng(5).standard_normal((4 * side * side, out)).astype("float32") / side

    class Crop(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = tf.Variable(w0, name="w")

        @tf.function(input_signature=[tf.TensorSpec([None, side, side, 1], tf.float32, name="x")])
        def __call__(self, x):
            n = tf.shape(x)[0]
            boxes = tf.tile(tf.constant([[0.0, 0.0, 1.0, 1.0]]), [n, 1])
            up = tf.image.crop_and_resize(x, boxes, tf.range(n), [2 * side, 2 * side])
            return {"y": tf.tanh(tf.matmul(tf.reshape(up, [-1, 4 * side * side]), self.w))}

    m = Crop()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def resize(path: Path, *, side: int = 3, out: int = 4, method: str = "bilinear") -> Path:
    """Image resizing (``method``: bilinear, bicubic, nearest), then ``tanh`` of a Dense layer: ``x`` (None, side,
    side, 1) float32 -> ``y`` (None, out). TensorFlow 2.21 alone gives zero second derivatives and forward-mode
    JVPs through the bilinear resize and none through the others (``worker.engine.resize_grads``)."""
    import tensorflow as tf

    w0 = np.random.default_rng(5).standard_normal((4 * side * side, out)).astype("float32") / side

    class Resize(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = tf.Variable(w0, name="w")

        @tf.function(input_signature=[tf.TensorSpec([None, side, side, 1], tf.float32, name="x")])
        def __call__(self, x):
            up = tf.image.resize(x, [2 * side, 2 * side], method=method)
            return {"y": tf.tanh(tf.matmul(tf.reshape(up, [-1, 4 * side * side]), self.w))}

    m = Resize()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path
