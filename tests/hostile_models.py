"""SavedModels that are programs doing more than math: each serving function reads or writes a file, or
calls Python. Input ``x`` (None, 3) float32, output ``y`` (None, 3); for the graph scan's tests."""

from __future__ import annotations

from pathlib import Path


def _save(module, path: Path) -> Path:
    import tensorflow as tf

    tf.saved_model.save(module, str(path), signatures={"serving_default": module.__call__})
    return path


def writes_file(path: Path, target: Path) -> Path:
    """``tf.io.write_file(target, ...)`` on every call (op ``WriteFile``)."""
    import tensorflow as tf

    class Writes(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def __call__(self, x):
            written = tf.io.write_file(str(target), tf.strings.as_string(tf.reduce_sum(x)))
            with tf.control_dependencies([written]):
                return {"y": x * 2.0}

    return _save(Writes(), path)


def reads_file(path: Path, source: Path) -> Path:
    """``tf.io.read_file(source)``: its length is added to ``x`` (op ``ReadFile``)."""
    import tensorflow as tf

    class Reads(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def __call__(self, x):
            size = tf.cast(tf.strings.length(tf.io.read_file(str(source))), tf.float32)
            return {"y": x + size}

    return _save(Reads(), path)


def calls_python(path: Path) -> Path:
    """``tf.py_function`` around a Python lambda (op ``EagerPyFunc``)."""
    import tensorflow as tf

    class Python(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def __call__(self, x):
            y = tf.py_function(lambda t: t * 2.0, [x], tf.float32)
            return {"y": tf.ensure_shape(y, [None, 3])}

    return _save(Python(), path)


def clean(path: Path) -> Path:
    """The same shapes, only math: ``y = tanh(x @ w)`` with a variable ``w`` (3, 3)."""
    import tensorflow as tf

    class Clean(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(tf.eye(3), name="w")

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def __call__(self, x):
            return {"y": tf.tanh(tf.matmul(x, self.w))}

    return _save(Clean(), path)
