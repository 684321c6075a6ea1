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
    """``sort`` (``TopKV2``), an op without an index-set rule: ``x`` (3, 4) -> ``y``."""
    import tensorflow as tf

    class NoRule(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([3, 4], tf.float32, name="x")])
        def __call__(self, x):
            return {"y": tf.sort(tf.sin(x), axis=1) * 2.0}

    m = NoRule()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


# One output per op family with an index-set rule (issue 30), all of ``x`` (6, 4): each output's detected pattern
# must equal the non-zeros of its dense Jacobian, and none of them may take the conservative rule.
INDEX_OPS = {
    "reshape": lambda tf, x, w: tf.reshape(tf.squeeze(tf.expand_dims(x, 1), axis=[1]), [3, 8]),
    "squeeze_all": lambda tf, x, w: tf.squeeze(tf.reshape(x[:, :1], [1, 6, 1])),
    "segment_sum": lambda tf, x, w: tf.math.segment_sum(tf.tanh(x), [0, 0, 1, 2, 2, 2]),
    "segment_mean": lambda tf, x, w: tf.math.segment_mean(x, [0, 1, 1, 1, 3, 3]),
    "segment_prod": lambda tf, x, w: tf.math.segment_prod(x, [0, 0, 0, 1, 1, 2]),
    "unsorted_segment_sum": lambda tf, x, w: tf.math.unsorted_segment_sum(x, [2, 0, -1, 2, 1, 0], 4),
    "unsorted_segment_2d": lambda tf, x, w: tf.math.unsorted_segment_sum(
        x, tf.constant([[0, 1, 1, 2]] * 3 + [[3, 3, 0, 0]] * 3), 5),
    "sparse_segment_sum": lambda tf, x, w: tf.sparse.segment_sum(x, [0, 2, 2, 5], [0, 0, 1, 1]),
    "sparse_segment_mean": lambda tf, x, w: tf.sparse.segment_mean(x, [4, 1, 3], [0, 2, 2], num_segments=4),
    "scatter_nd": lambda tf, x, w: tf.scatter_nd([[1], [3], [1]], x[:3], [5, 4]),
    "scatter_nd_elements": lambda tf, x, w: tf.scatter_nd([[0, 1], [2, 3], [0, 1]],
                                                          tf.reshape(x, [-1])[4:7], [3, 4]),
    "tensor_scatter_update": lambda tf, x, w: tf.tensor_scatter_nd_update(x, [[1], [4]], x[2:4] * 2.0),
    "tensor_scatter_add": lambda tf, x, w: tf.tensor_scatter_nd_add(x, [[0, 0], [5, 3], [0, 0]],
                                                                    tf.stack([x[1, 1], x[2, 2], x[3, 0]])),
    "tensor_scatter_sub_const": lambda tf, x, w: tf.tensor_scatter_nd_sub(x, [[2, 1]], [1.0]),
    "gather_nd": lambda tf, x, w: tf.gather_nd(x, [[0, 1], [5, 2], [3, 3], [0, 1]]),
    "gather_nd_rows": lambda tf, x, w: tf.gather_nd(x, [[1], [4], [1]]),
    "cumsum": lambda tf, x, w: tf.cumsum(x, axis=0),
    "cumsum_exclusive_reverse": lambda tf, x, w: tf.cumsum(x, axis=1, exclusive=True, reverse=True),
    "cumprod": lambda tf, x, w: tf.math.cumprod(x, axis=-1),
    "cumulative_logsumexp": lambda tf, x, w: tf.math.cumulative_logsumexp(x, axis=0),
    "pad": lambda tf, x, w: tf.pad(x, [[1, 0], [0, 2]]),
    "pad_constant": lambda tf, x, w: tf.pad(x, [[0, 1], [2, 0]], constant_values=3.0),
    "mirror_pad": lambda tf, x, w: tf.pad(x, [[1, 1], [2, 2]], mode="REFLECT"),
    "symmetric_pad": lambda tf, x, w: tf.pad(x, [[2, 0], [0, 1]], mode="SYMMETRIC"),
    "tile": lambda tf, x, w: tf.tile(x[:2], [2, 3]),
    "strided": lambda tf, x, w: x[::2, 1:],
    "strided_shrink_reverse": lambda tf, x, w: x[1, ::-1],
    "strided_new_axis": lambda tf, x, w: x[4:0:-2, None, 2],
    "einsum_matmul": lambda tf, x, w: tf.einsum("ij,jk->ik", x, w),
    "einsum_outer": lambda tf, x, w: tf.einsum("ij,ik->jik", x, tf.sin(x)),
    "einsum_sum": lambda tf, x, w: tf.einsum("ij->j", x),
}


def index_ops(path: Path) -> Path:
    """A ``tf.Module`` with one output per entry of ``INDEX_OPS``: ``x`` (6, 4) -> each op's result."""
    import numpy as np
    import tensorflow as tf

    class IndexOps(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = tf.Variable(np.random.default_rng(1).standard_normal((4, 3)).astype("float32"))

        @tf.function(input_signature=[tf.TensorSpec([6, 4], tf.float32, name="x")])
        def __call__(self, x):
            return {name: fn(tf, x, self.w) for name, fn in INDEX_OPS.items()}

    m = IndexOps()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def conv1d_net(path: Path, *, length: int = 32, channels: int = 2) -> Path:
    """Keras Conv1D layers as users stack them (causal and dilated, same, strided valid): ``x`` (None, length,
    channels) -> ``y``. Keras emits ExpandDims, Conv2D, Squeeze, Pad, SpaceToBatchND and BatchToSpaceND."""
    keras = _keras()
    inp = keras.Input((length, channels), name="x")
    h = keras.layers.Conv1D(4, 3, padding="causal", dilation_rate=2, activation="tanh", name="causal")(inp)
    h = keras.layers.Conv1D(3, 2, padding="same", activation="tanh", name="same")(h)
    h = keras.layers.Conv1D(2, 3, padding="valid", strides=2, name="strided")(h)
    keras.Model(inp, {"y": h}).export(str(path), verbose=False)
    return path


SPARSE_BUILDERS = {"conv": conv_net, "depthwise": depthwise_net, "relu_pool": relu_pool_net, "mlp": mlp,
                   "array_ops": array_ops, "no_rule": no_rule, "index_ops": index_ops, "conv1d": conv1d_net}
