"""SavedModels with sparse Hessians (issue 27), built in the tests and in bench/bench_sparse_hessian.py. Each takes
``x`` and gives a scalar ``f`` (the Keras one: ``y`` of shape (1, 1))."""

from __future__ import annotations

from pathlib import Path


def separable(path: Path, *, n: int = 12, dtype: str = "float32") -> Path:
    """A partially separable function ``f = sum_i (x_i^2 x_{i+1} + sin x_i)``: H is tridiagonal."""
    import tensorflow as tf

    class Separable(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([n], dtype, name="x")])
        def __call__(self, x):
            return {"f": tf.reduce_sum(tf.square(x[:-1]) * x[1:]) + tf.reduce_sum(tf.sin(x))}

    m = Separable()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def arrowhead(path: Path, *, n: int = 10, dtype: str = "float32") -> Path:
    """``f = x_0 sum_{i>0} x_i^2 + sum_i cos x_i``: H is an arrowhead (the diagonal, row 0 and column 0), which
    distance-2 colouring cannot compress (every column shares row 0) and star colouring does in 2 colours."""
    import tensorflow as tf

    class Arrow(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([n], dtype, name="x")])
        def __call__(self, x):
            return {"f": x[0] * tf.reduce_sum(tf.square(x[1:])) + tf.reduce_sum(tf.cos(x))}

    m = Arrow()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def dense_hessian(path: Path, *, n: int = 8, dtype: str = "float32") -> Path:
    """``f = log sum exp(x) + tanh(sum x)^2``: every pair of elements interacts, H is dense."""
    import tensorflow as tf

    class Dense(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([n], dtype, name="x")])
        def __call__(self, x):
            return {"f": tf.reduce_logsumexp(x) + tf.square(tf.tanh(tf.reduce_sum(x)))}

    m = Dense()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def per_feature_keras(path: Path, *, groups: int = 3, width: int = 2) -> Path:
    """A Keras model with per-feature layers: ``x`` (None, groups * width) reshaped to (groups, width), one shared
    Dense(4, tanh) and Dense(1) per group, summed: H is block diagonal (blocks of ``width``)."""
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((groups * width,), name="x")
    h = keras.layers.Reshape((groups, width))(inp)
    h = keras.layers.Dense(4, activation="tanh", name="per_feature")(h)
    h = keras.layers.Dense(1, name="head")(h)
    out = keras.layers.Flatten()(h)
    out = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", trainable=False, name="sum")(out)
    keras.Model(inp, {"y": out}).export(str(path), verbose=False)
    return path


HESSIAN_BUILDERS = {"separable": separable, "arrowhead": arrowhead, "dense": dense_hessian,
                    "keras": per_feature_keras}
