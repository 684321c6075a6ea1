"""SavedModels with sparse Jacobians (issue 15), built in the tests and the sparse benchmark."""

from __future__ import annotations

from pathlib import Path


def _keras():
    import keras

    keras.utils.set_random_seed(0)
    return keras


def conv_net(path: Path, *, size: int = 16, channels: tuple[int, ...] = (4, 4, 3), activation: str = "tanh",
             strides: int = 1, padding: str = "same") -> Path:
    """Image-to-image 3x3 convolutions: ``image`` (None, size, size, 3) -> ``out``; the last layer linear."""
    keras = _keras()
    inp = keras.Input((size, size, 3), name="image")
    h = inp
    for i, c in enumerate(channels):
        last = i == len(channels) - 1
        h = keras.layers.Conv2D(c, 3, padding=padding, strides=strides if i == 0 else 1,
                                activation=None if last else activation, name=f"conv{i}")(h)
    keras.Model(inp, {"out": h}).export(str(path), verbose=False)
    return path


def depthwise_net(path: Path) -> Path:
    """Conv, strided valid depthwise (multiplier 2), dilated conv, average pooling: ``image`` (None, 12, 12, 3)."""
    keras = _keras()
    inp = keras.Input((12, 12, 3), name="image")
    h = keras.layers.Conv2D(4, 3, padding="same", activation="tanh", name="c0")(inp)
    h = keras.layers.DepthwiseConv2D(3, strides=2, padding="valid", depth_multiplier=2, activation="tanh",
                                     name="dw")(h)
    h = keras.layers.Conv2D(3, 2, padding="same", dilation_rate=2, name="dil")(h)
    h = keras.layers.AveragePooling2D(2, name="pool")(h)
    keras.Model(inp, {"out": h}).export(str(path), verbose=False)
    return path


def relu_pool_net(path: Path) -> Path:
    """ReLU and max pooling (value-dependent zeros: the structural pattern is a superset): (None, 10, 10, 2)."""
    keras = _keras()
    inp = keras.Input((10, 10, 2), name="image")
    h = keras.layers.Conv2D(3, 3, padding="same", activation="relu", name="c0")(inp)
    h = keras.layers.MaxPooling2D(2, name="pool")(h)
    h = keras.layers.Conv2D(2, 3, padding="valid", name="c1")(h)
    keras.Model(inp, {"out": h}).export(str(path), verbose=False)
    return path


def mlp(path: Path) -> Path:
    """``tests.models.mlp`` 6-8-3, ``x`` (None, 6) -> ``y`` (None, 3): dense per example, block diagonal over a
    batch."""
    from tests import models

    return models.mlp(path, sizes=(6, 8, 3))


def array_ops(path: Path) -> Path:
    """A ``tf.Module`` of moves and reductions (transpose, reshape, slice, pad, concat, gather, reverse, tile,
    sum, softmax, matmul, elementwise with broadcasting): ``x`` (2, 4, 5) -> ``y`` and ``z``."""
    import numpy as np
    import tensorflow as tf

    class Ops(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = tf.Variable(np.random.default_rng(0).standard_normal((5, 3)).astype("float32"))

        @tf.function(input_signature=[tf.TensorSpec([2, 4, 5], tf.float32, name="x")])
        def __call__(self, x):
            t = tf.transpose(x, [0, 2, 1])                          # (2, 5, 4)
            s = tf.reshape(t[:, 1:4, :], [2, 12])                   # slice, reshape
            p = tf.pad(s, [[0, 0], [1, 2]])                         # (2, 15)
            c = tf.concat([p, tf.reverse(s, [1])], axis=1)          # (2, 27)
            g = tf.gather(c, [0, 3, 5, 26, 1], axis=1) * tf.constant([1.0, 2.0, 3.0, 4.0, 5.0])
            m = tf.matmul(tf.reshape(x, [8, 5]), self.w)            # (8, 3)
            r = tf.reduce_sum(tf.tanh(x), axis=1)                   # (2, 5)
            y = tf.concat([g, tf.nn.softmax(r), tf.tile(r[:, :1], [1, 2])], axis=1)
            return {"y": y, "z": tf.sin(m) + tf.reduce_mean(x)}

    m = Ops()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def no_rule(path: Path) -> Path:
    """``cumsum`` and ``matrix_band_part``, ops without an index-set rule: ``x`` (3, 4) -> ``y``."""
    import tensorflow as tf

    class NoRule(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([3, 4], tf.float32, name="x")])
        def __call__(self, x):
            return {"y": tf.math.cumsum(tf.sin(x), axis=1) * 2.0}

    m = NoRule()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


SPARSE_BUILDERS = {"conv": conv_net, "depthwise": depthwise_net, "relu_pool": relu_pool_net, "mlp": mlp,
                   "array_ops": array_ops, "no_rule": no_rule}
