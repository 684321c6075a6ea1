"""``.keras`` files for the tests, built with Keras 3 (saved by ``Model.save``): each builder returns the Keras
model it saved, for references computed on the model itself."""

from __future__ import annotations

from pathlib import Path

import keras


def functional(path: Path) -> keras.Model:
    """One input ``x`` (None, 3); a dict of outputs: ``y`` (None, 2) and the scalar ``loss`` (the sum of ``y**2``)."""
    keras.utils.set_random_seed(1)
    x = keras.Input((3,), name="x")
    h = keras.layers.Dense(5, activation="tanh", name="h")(x)
    y = keras.layers.Dense(2, activation="sigmoid", name="y")(h)
    model = keras.Model(x, {"y": y, "loss": keras.ops.sum(keras.ops.square(y))})
    model.save(path)
    return model


def multi(path: Path) -> keras.Model:
    """Inputs ``x`` (None, 3) and ``z`` (None, 2); outputs ``a`` (None, 2) and ``b`` (None, 2), as lists."""
    keras.utils.set_random_seed(2)
    x, z = keras.Input((3,), name="x"), keras.Input((2,), name="z")
    h = keras.layers.Dense(4, activation="tanh", name="h")(x)
    a = keras.layers.Dense(2, name="a")(h)
    b = keras.layers.Multiply(name="b")([keras.layers.Dense(2, activation="tanh", name="hz")(h), z])
    model = keras.Model([x, z], [a, b])
    model.save(path)
    return model


def custom_layer(path: Path) -> keras.Model:
    """A functional model with the registered layer ``tests.keras_custom.Scale``: ``x`` (None, 3) -> ``s``."""
    from tests.keras_custom import Scale

    keras.utils.set_random_seed(3)
    x = keras.Input((3,), name="x")
    model = keras.Model(x, Scale(name="s")(keras.layers.Dense(3, activation="tanh", name="h")(x)))
    model.save(path)
    return model


def subclassed(path: Path) -> keras.Model:
    """The subclassed ``tests.keras_custom.TwoLayer``, built on (None, 3): input ``inputs``, output ``output_0``."""
    from tests.keras_custom import TwoLayer

    keras.utils.set_random_seed(4)
    model = TwoLayer(4)
    model(keras.ops.zeros((1, 3)))
    model.save(path)
    return model


def lambda_layer(path: Path) -> keras.Model:
    """A Lambda layer (arbitrary Python code), which safe mode refuses."""
    x = keras.Input((3,), name="x")
    model = keras.Model(x, keras.layers.Lambda(lambda t: t * 2.0, name="double")(x))
    model.save(path)
    return model
