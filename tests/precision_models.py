"""Models for the precision guard's tests: a float32 model whose derivatives lose digits to cancellation."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def cancelling_weights(n: int = 6, m: int = 8, scale: float = 3e3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``W1`` (n, 2m) and ``W2`` (2m, n), float32, with ``W1 @ W2`` of order 1 from terms of order ``scale``:
    ``W1 = scale [R, R]``, ``W2 = [S; -S + E / scale]``, so every product through them cancels ~log10(scale) digits."""
    rng = np.random.default_rng(seed)
    r, s, e = rng.standard_normal((n, m)), rng.standard_normal((m, n)), rng.standard_normal((m, n))
    w1 = scale * np.concatenate([r, r], axis=1)
    w2 = np.concatenate([s, -s + e / scale], axis=0)
    return w1.astype("float32"), w2.astype("float32")


def cancelling(path: Path, *, n: int = 6, m: int = 8, scale: float = 3e3) -> Path:
    """``x`` (None, n) float32 -> ``y = tanh(x) @ W1 @ W2`` (None, n) and ``loss = 0.5 sum(y^2)`` (), the weights
    ``w1``, ``w2`` variables (``cancelling_weights``): float32 J, H and their products carry ~1e-4 relative error."""
    import tensorflow as tf

    w1, w2 = cancelling_weights(n, m, scale)

    class Cancelling(tf.Module):
        def __init__(self):
            super().__init__()
            self.w1 = tf.Variable(w1, name="w1")
            self.w2 = tf.Variable(w2, name="w2")

        @tf.function(input_signature=[tf.TensorSpec([None, n], tf.float32, name="x")])
        def __call__(self, x):
            y = tf.tanh(x) @ self.w1 @ self.w2
            return {"y": y, "loss": 0.5 * tf.reduce_sum(y * y)}

    module = Cancelling()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.__call__})
    return path


def batch_norm(path: Path, *, training: bool = False) -> Path:
    """``image`` (None, 6, 6, 2) -> conv -> ``tf.compat.v1.nn.fused_batch_norm`` (FusedBatchNormV3, which has no
    float64 kernel) -> relu6 -> ``y``; ``training``: the batch norm in training mode (batch statistics)."""
    import tensorflow as tf

    rng = np.random.default_rng(0)

    class Norm(tf.Module):
        def __init__(self):
            super().__init__()
            self.k = tf.Variable(rng.normal(size=(3, 3, 2, 4)).astype("float32"), name="k")
            self.scale = tf.Variable(rng.uniform(0.5, 2, size=4).astype("float32"), name="scale")
            self.offset = tf.Variable(rng.normal(size=4).astype("float32"), name="offset")
            self.mean = tf.Variable(rng.normal(size=4).astype("float32"), name="mean", trainable=False)
            self.var = tf.Variable(rng.uniform(0.5, 2, size=4).astype("float32"), name="var", trainable=False)

        @tf.function(input_signature=[tf.TensorSpec([None, 6, 6, 2], tf.float32, name="image")])
        def __call__(self, image):
            h = tf.nn.conv2d(image, self.k, 1, "SAME")
            if training:
                y, _, _ = tf.compat.v1.nn.fused_batch_norm(h, self.scale, self.offset, epsilon=1e-3, is_training=True)
            else:
                y, _, _ = tf.compat.v1.nn.fused_batch_norm(h, self.scale, self.offset, self.mean, self.var,
                                                           epsilon=1e-3, is_training=False)
            return {"y": tf.nn.relu6(y)}

    module = Norm()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.__call__})
    return path
