"""The architectures of issue 25's benchmark, written once in backend-agnostic Keras 3, so that the same
weights run under TensorFlow (a SavedModel for ``jacobian compute`` and the ``tape.jacobian`` script) and
under JAX (the ``jit(vmap(vjp))`` peer, ``bench/peer_jax_jacobian.py``).

Each builder takes the ``keras`` module and returns a functional model with one input ``x`` and one output
``y`` (a dict output, so that the SavedModel's output is named ``y`` under both backends), and ``input_shape``
gives one example's shape. Rows of the Jacobian: the size of ``y`` for one example.

| name | model | rows x columns (one example) |
| --- | --- | --- |
| ``mobilenet_softmax`` | MobileNetV3Small, Keras defaults (softmax head), 224x224x3 | 1000 x 150528 |
| ``mobilenet_logits`` | MobileNetV3Small, no activation on the head | 1000 x 150528 |
| ``efficientnet`` | EfficientNetB0 (``weights=None``), 224x224x3 | 1000 x 150528 |
| ``transformer`` | one encoder block: 4-head attention, FFN 128, layer norms; 32 tokens x 64 | 2048 x 2048 |
| ``lstm`` | LSTM(64) over 50 steps of 16 features (not unrolled), a dense head per step | 400 x 800 |
| ``conv1d`` | three Conv1D (32, 32, 8 channels, kernel 5, same) over 256 steps of 8 | 2048 x 2048 |
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "mobilenet_softmax": (224, 224, 3), "mobilenet_logits": (224, 224, 3), "efficientnet": (224, 224, 3),
    "transformer": (32, 64), "lstm": (50, 16), "conv1d": (256, 8),
}


def _mobilenet(keras: Any, activation: str | None) -> Any:
    base = keras.applications.MobileNetV3Small(weights=None, input_shape=(224, 224, 3),
                                               classifier_activation=activation)
    x = keras.Input((224, 224, 3), name="x")
    return keras.Model(x, {"y": base(x)})


def _efficientnet(keras: Any) -> Any:
    base = keras.applications.EfficientNetB0(weights=None, input_shape=(224, 224, 3))
    x = keras.Input((224, 224, 3), name="x")
    return keras.Model(x, {"y": base(x)})


def _transformer(keras: Any) -> Any:
    layers = keras.layers
    x = keras.Input((32, 64), name="x")
    h = layers.LayerNormalization()(x + layers.MultiHeadAttention(num_heads=4, key_dim=16)(x, x))
    f = layers.Dense(64)(layers.Dense(128, activation="gelu")(h))
    return keras.Model(x, {"y": layers.LayerNormalization()(h + f)})


def _lstm(keras: Any) -> Any:
    x = keras.Input((50, 16), name="x")
    h = keras.layers.LSTM(64, return_sequences=True, unroll=False)(x)
    return keras.Model(x, {"y": keras.layers.Dense(8)(h)})


def _conv1d(keras: Any) -> Any:
    layers = keras.layers
    x = keras.Input((256, 8), name="x")
    h = layers.Conv1D(32, 5, padding="same", activation="relu")(x)
    h = layers.Conv1D(32, 5, padding="same", activation="relu")(h)
    return keras.Model(x, {"y": layers.Conv1D(8, 5, padding="same")(h)})


BUILDERS: dict[str, Callable[[Any], Any]] = {
    "mobilenet_softmax": lambda keras: _mobilenet(keras, "softmax"),
    "mobilenet_logits": lambda keras: _mobilenet(keras, None),
    "efficientnet": _efficientnet,
    "transformer": _transformer,
    "lstm": _lstm,
    "conv1d": _conv1d,
}


def build(name: str, keras: Any, seed: int = 0) -> Any:
    """``name``'s model with weights from ``seed`` (the JAX peer loads the TensorFlow side's weights file)."""
    keras.utils.set_random_seed(seed)
    return BUILDERS[name](keras)
