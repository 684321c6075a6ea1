"""Custom Keras objects for the ``.keras`` tests, named through ``JACOBIAN_KERAS_CUSTOM_OBJECTS=tests.keras_custom``:
a registered layer (``jt>Scale``) and a registered subclassed model (``jt>TwoLayer``)."""

from __future__ import annotations

import keras


@keras.saving.register_keras_serializable(package="jt")
class Scale(keras.layers.Layer):
    """``x * w + sin(x)``, ``w`` one trainable weight per feature."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="random_normal", name="w")

    def call(self, x):
        return x * self.w + keras.ops.sin(x)


@keras.saving.register_keras_serializable(package="jt")
class TwoLayer(keras.Model):
    """A subclassed model: ``Dense(tanh)`` then ``Scale``."""

    def __init__(self, units: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = keras.layers.Dense(units, activation="tanh")
        self.scale = Scale()

    def call(self, inputs):
        return self.scale(self.dense(inputs))

    def get_config(self):
        return {**super().get_config(), "units": self.units}
