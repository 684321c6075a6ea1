"""Small SavedModels built in the tests: a spread of architectures the engine must handle."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _keras():
    import keras

    keras.utils.set_random_seed(0)
    return keras


def mlp(path: Path, *, sizes=(8, 16, 4), dtype="float32") -> Path:
    """Dense tanh MLP; signature input ``x`` (None, sizes[0]), output ``y``."""
    keras = _keras()
    inp = keras.Input((sizes[0],), name="x", dtype=dtype)
    h = inp
    for i, n in enumerate(sizes[1:-1]):
        h = keras.layers.Dense(n, activation="tanh", name=f"d{i}", dtype=dtype)(h)
    out = keras.layers.Dense(sizes[-1], name="out", dtype=dtype)(h)
    model = keras.Model(inp, {"y": out})
    model.export(str(path), verbose=False)
    return path


def cnn(path: Path) -> Path:
    """Conv2D -> pool -> dense; input ``image`` (None, 8, 8, 3), outputs ``logits`` (None, 5)."""
    keras = _keras()
    inp = keras.Input((8, 8, 3), name="image")
    h = keras.layers.Conv2D(4, 3, activation="relu", padding="same", name="conv")(inp)
    h = keras.layers.AveragePooling2D(2, name="pool")(h)
    h = keras.layers.Flatten(name="flat")(h)
    out = keras.layers.Dense(5, name="dense")(h)
    keras.Model(inp, {"logits": out}).export(str(path), verbose=False)
    return path


def multi_io(path: Path) -> Path:
    """Two float inputs ``a`` (None, 4), ``b`` (None, 3); outputs ``u`` (None, 2), ``v`` (None, 3)."""
    keras = _keras()
    a = keras.Input((4,), name="a")
    b = keras.Input((3,), name="b")
    h = keras.layers.Concatenate(name="cat")([a, b])
    u = keras.layers.Dense(2, activation="sigmoid", name="u")(h)
    v = keras.layers.Multiply(name="v")([keras.layers.Dense(3, name="bproj")(a), b])
    keras.Model({"a": a, "b": b}, {"u": u, "v": v}).export(str(path), verbose=False)
    return path


def depthwise(path: Path) -> Path:
    """MobileNetV3Small with 4 classes (depthwise convolutions): ``image`` (None, 32, 32, 3) -> ``out``."""
    keras = _keras()
    base = keras.applications.MobileNetV3Small(weights=None, input_shape=(32, 32, 3), classes=4,
                                               include_preprocessing=False, classifier_activation=None)
    inp = keras.Input((32, 32, 3), name="image")
    keras.Model(inp, {"out": base(inp)}).export(str(path), verbose=False)
    return path


def int_input(path: Path) -> Path:
    """Integer ``ids`` (None, 4) through an embedding, plus float ``x`` (None, 4); output ``y`` (None, 3)."""
    keras = _keras()
    ids = keras.Input((4,), name="ids", dtype="int32")
    x = keras.Input((4,), name="x")
    e = keras.layers.Flatten()(keras.layers.Embedding(10, 2, name="emb")(ids))
    h = keras.layers.Concatenate()([e, x])
    y = keras.layers.Dense(3, activation="tanh", name="dense")(h)
    keras.Model({"ids": ids, "x": x}, {"y": y}).export(str(path), verbose=False)
    return path


def rnn_unrolled(path: Path) -> Path:
    """SimpleRNN with ``unroll=True``: input ``seq`` (None, 4, 3), output ``h`` (None, 6)."""
    keras = _keras()
    inp = keras.Input((4, 3), name="seq")
    out = keras.layers.SimpleRNN(6, unroll=True, name="rnn")(inp)
    keras.Model(inp, {"h": out}).export(str(path), verbose=False)
    return path


def control_flow(path: Path) -> Path:
    """A ``tf.Module`` with ``tf.while_loop`` and ``tf.cond``: ``x`` (3,) float32 -> ``y`` (3,)."""
    import tensorflow as tf

    class Ctrl(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable([[0.5, -0.2, 0.1], [0.3, 0.8, -0.4], [-0.1, 0.2, 0.6]], name="w")

        @tf.function(input_signature=[tf.TensorSpec([3], tf.float32, name="x")])
        def __call__(self, x):
            w = tf.convert_to_tensor(self.w)

            def body(i, h):
                h = tf.tanh(tf.linalg.matvec(w, h) + x)
                return i + 1, h

            _, h = tf.while_loop(lambda i, h: i < 3, body, (tf.constant(0), x))
            y = tf.cond(tf.reduce_sum(x) > 0.0, lambda: h * h, lambda: tf.sin(h))
            return {"y": y}

    m = Ctrl()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def swish_cnn(path: Path) -> Path:
    """Conv2D and Dense with Keras' ``swish`` (``tf.nn.silu``, a gradient override that restates its gradient):
    ``image`` (None, 6, 6, 2) -> ``logits`` (None, 4)."""
    keras = _keras()
    inp = keras.Input((6, 6, 2), name="image")
    h = keras.layers.Conv2D(3, 3, activation="swish", name="conv")(inp)
    h = keras.layers.Flatten(name="flat")(h)
    out = keras.layers.Dense(4, activation="swish", name="dense")(h)
    keras.Model(inp, {"logits": out}).export(str(path), verbose=False)
    return path


def straight_through(path: Path) -> Path:
    """``x * sigmoid(x)``, silu's forward ops, under a ``tf.custom_gradient`` that passes the gradient straight
    through (``dy``), not silu's: ``x`` (None, 4) -> ``y`` (None, 3). Its Jacobian is the weights'."""
    import tensorflow as tf

    class StraightThrough(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(np.random.default_rng(0).normal(size=(4, 3)).astype("float32"), name="w")

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
        def __call__(self, x):
            @tf.custom_gradient
            def act(h, beta):
                return h * tf.sigmoid(beta * h), lambda dy: (dy, tf.reduce_sum(dy) * 0.0)

            return {"y": act(x @ self.w, tf.constant(1.0))}

    m = StraightThrough()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def float64_model(path: Path) -> Path:
    """float64 ``x`` (None, 5) -> ``y`` (None, 4) and scalar ``loss`` (); for finite differences."""
    import tensorflow as tf

    rng = np.random.default_rng(0)

    class F64(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(rng.normal(size=(5, 4)), dtype=tf.float64, name="w")
            self.b = tf.Variable(rng.normal(size=(4,)), dtype=tf.float64, name="b")

        @tf.function(input_signature=[tf.TensorSpec([None, 5], tf.float64, name="x")])
        def __call__(self, x):
            y = tf.sin(x @ self.w + self.b) * tf.reduce_sum(x * x, axis=1, keepdims=True)
            loss = tf.reduce_sum(tf.tanh(y) ** 2) + tf.reduce_sum(x ** 3)
            return {"y": y, "loss": loss}

    m = F64()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def softmax_mlp(path: Path, *, sizes=(6, 8, 3), dtype="float32", seed=0) -> Path:
    """A ``tf.Module`` tanh MLP classifier: ``x`` (None, sizes[0]) and int32 ``labels`` (None,) -> ``logits``
    (None, sizes[-1]) and ``loss`` () (mean softmax cross-entropy); variables ``w0``, ``b0``, ``w1``, ... For the
    matrix-free kinds: a classification loss over every parameter (``variables/*``)."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)

    class Classifier(tf.Module):
        def __init__(self):
            super().__init__()
            self.layers = [(tf.Variable(rng.normal(size=(a, b)) / np.sqrt(a), dtype=dtype, name=f"w{i}"),
                            tf.Variable(rng.normal(size=(b,)) * 0.1, dtype=dtype, name=f"b{i}"))
                           for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]

        @tf.function(input_signature=[tf.TensorSpec([None, sizes[0]], dtype, name="x"),
                                      tf.TensorSpec([None], tf.int32, name="labels")])
        def __call__(self, x, labels):
            h = x
            for i, (w, b) in enumerate(self.layers):
                h = h @ w + b
                if i < len(self.layers) - 1:
                    h = tf.tanh(h)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=h))
            return {"logits": h, "loss": loss}

    m = Classifier()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def quadratic(path: Path, *, n: int = 6) -> Path:
    """``loss = 0.5 (x . w)^2 + 0.5 s |w|^2``: its Hessian w.r.t. the variable ``w`` (n,) is ``x x^T + s I``, of
    rank one for ``s = 0`` and ``s I`` for ``x = 0`` (repeated eigenvalues). Inputs ``x`` (n,), ``s`` () float64."""
    import tensorflow as tf

    class Quadratic(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(np.linspace(-1.0, 1.0, n), name="w")

        @tf.function(input_signature=[tf.TensorSpec([n], tf.float64, name="x"),
                                      tf.TensorSpec([], tf.float64, name="s")])
        def __call__(self, x, s):
            return {"loss": 0.5 * tf.reduce_sum(x * self.w) ** 2 + 0.5 * s * tf.reduce_sum(self.w ** 2)}

    m = Quadratic()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def linear(path: Path, *, n: int = 40) -> Path:
    """``y = a x``: J w.r.t. ``x`` (n,) is the input ``a`` (n, n), float64, so a test sets the singular values."""
    import tensorflow as tf

    class Linear(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([n], tf.float64, name="x"),
                                      tf.TensorSpec([n, n], tf.float64, name="a")])
        def __call__(self, x, a):
            return {"y": tf.linalg.matvec(a, x)}

    m = Linear()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def depthwise_small(path: Path) -> Path:
    """``tf.nn.depthwise_conv2d`` with a fixed filter, then tanh: ``image`` (None, 5, 5, 2) -> ``y`` (None, 3, 3, 4)
    and ``loss`` (); pfor needs ``worker.engine.pfor_patches`` to vectorize its JVPs and HVPs w.r.t. ``image``."""
    import tensorflow as tf

    rng = np.random.default_rng(0)

    class Depthwise(tf.Module):
        def __init__(self):
            super().__init__()
            self.filter = tf.Variable(rng.normal(size=(3, 3, 2, 2)).astype("float32"), name="filter")

        @tf.function(input_signature=[tf.TensorSpec([None, 5, 5, 2], tf.float32, name="image")])
        def __call__(self, image):
            y = tf.tanh(tf.nn.depthwise_conv2d(image, self.filter, strides=[1, 1, 1, 1], padding="VALID"))
            return {"y": y, "loss": 0.5 * tf.reduce_sum(y * y)}

    m = Depthwise()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def batch_interacting(path: Path) -> Path:
    """Examples interact: ``y = tanh(x - mean(x over the batch))``, ``x`` (None, 4)."""
    import tensorflow as tf

    class Interact(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
        def __call__(self, x):
            return {"y": tf.tanh(x - tf.reduce_mean(x, axis=0, keepdims=True))}

    m = Interact()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def variable_in_loop(path: Path) -> Path:
    """A loop body that reads a variable: on a persistent tape TensorFlow cannot differentiate the loaded
    model ('variable without handle data'); on a non-persistent one it can."""
    import tensorflow as tf

    class VarLoop(tf.Module):
        def __init__(self):
            super().__init__()
            self.v = tf.Variable(1.5, name="v")

        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x")])
        def __call__(self, x):
            _, h = tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, h * self.v), (0, x))
            return {"y": h}

    m = VarLoop()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def mobilenet_v3_small_keras():
    """MobileNetV3Small (``weights=None``) as a Keras model: ``image`` (None, 224, 224, 3) -> ``logits``."""
    keras = _keras()
    base = keras.applications.MobileNetV3Small(weights=None, input_shape=(224, 224, 3),
                                               include_preprocessing=False, classifier_activation=None)
    inp = keras.Input((224, 224, 3), name="image")
    return keras.Model(inp, {"logits": base(inp)})


def mobilenet_v3_small(path: Path, model=None) -> Path:
    """MobileNetV3Small exported as a SavedModel (``model`` if given, else a new one)."""
    (model or mobilenet_v3_small_keras()).export(str(path), verbose=False)
    return path


def grid(path: Path) -> Path:
    """An output of rank 3: ``x`` (None, 6) -> dense tanh -> ``grid`` (None, 4, 5)."""
    keras = _keras()
    inp = keras.Input((6,), name="x")
    h = keras.layers.Dense(20, activation="tanh", name="dense")(inp)
    keras.Model(inp, {"grid": keras.layers.Reshape((4, 5), name="grid")(h)}).export(str(path), verbose=False)
    return path


BUILDERS = {
    "mlp": mlp, "cnn": cnn, "multi_io": multi_io, "int_input": int_input, "rnn": rnn_unrolled,
    "control_flow": control_flow, "float64": float64_model, "interact": batch_interacting,
    "variable_in_loop": variable_in_loop, "depthwise": depthwise, "grid": grid,
}


def no_gradient(path: Path) -> Path:
    """Uses ``tf.linalg.lu``, which has no registered gradient: ``x`` (None, 3, 3) -> ``y``."""
    import tensorflow as tf

    class NoGrad(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 3, 3], tf.float32, name="x")])
        def __call__(self, x):
            lu, _ = tf.linalg.lu(x)
            return {"y": tf.reduce_sum(lu, axis=-1)}

    m = NoGrad()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


BUILDERS["no_gradient"] = no_gradient


API_MODELS = ("mlp", "multi_io", "int_input", "control_flow", "float64")


def build_models(base: Path, names: tuple[str, ...] = API_MODELS) -> Path:
    """Test SavedModels under ``base/models``, built once per session and shared by test modules."""
    root = base / "models"
    for name in names:
        if not (root / name / "saved_model.pb").exists():
            BUILDERS[name](root / name)
    return root


def quadratic_form(path: Path, *, n: int = 40, dtype: str = "float64") -> Path:
    """``loss = 0.5 x^T a x``: its Hessian w.r.t. ``x`` (n,) is ``(a + a^T) / 2`` for the input ``a`` (n, n), so a
    test sets its scaling and spectrum (a badly scaled one for preconditioning)."""
    import tensorflow as tf

    dt = tf.as_dtype(dtype)

    class QuadraticForm(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([n], dt, name="x"), tf.TensorSpec([n, n], dt, name="a")])
        def __call__(self, x, a):
            return {"loss": 0.5 * tf.tensordot(x, tf.linalg.matvec(a, x), 1)}

    m = QuadraticForm()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path
