"""``worker.engine.keras_model``: a ``.keras`` file loaded as a ``LoadedModel`` (names, variables, fingerprint), its
Jacobian over a variable equal to GradientTape on the Keras model, the custom objects module (a ``CUSTOM_OBJECTS``
dict or the classes it registered), and refusals as ``InvalidRequest``."""

from __future__ import annotations

import numpy as np
import pytest

from tests import keras_models
from worker.engine import InvalidRequest, compute_in_memory, load_model
from worker.engine.keras_model import custom_objects

X = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)


@pytest.fixture
def setting(monkeypatch):
    from contracts.settings import get_settings

    def set_module(name: str | None) -> None:
        if name is None:
            monkeypatch.delenv("JACOBIAN_KERAS_CUSTOM_OBJECTS", raising=False)
        else:
            monkeypatch.setenv("JACOBIAN_KERAS_CUSTOM_OBJECTS", name)
        get_settings.cache_clear()

    yield set_module
    get_settings.cache_clear()


def test_custom_objects_from_a_dict_or_the_registered_classes():
    from tests.keras_custom import Scale, TwoLayer

    assert custom_objects("tests.keras_custom_dict") == {"jt>Scale": Scale}
    assert custom_objects("tests.keras_custom") == {"jt>Scale": Scale, "jt>TwoLayer": TwoLayer}
    assert custom_objects(None) == {}
    with pytest.raises(InvalidRequest, match="'no.such.module' .JACOBIAN_KERAS_CUSTOM_OBJECTS. cannot be imported"):
        custom_objects("no.such.module")


@pytest.mark.parametrize("module", ["tests.keras_custom_dict", "tests.keras_custom"])
def test_jacobian_over_a_custom_layer_variable(tmp_path, setting, module):
    import tensorflow as tf

    setting(module)
    keras_model = keras_models.custom_layer(tmp_path / "c.keras")
    model = load_model(str(tmp_path / "c.keras"))
    assert set(model.input_specs) == {"x"} and set(model.output_specs) == {"s"}
    assert set(model.variables) == {v.path for v in keras_model.trainable_variables} == {"h/kernel", "h/bias", "s/w"}
    got, _ = compute_in_memory(model, {"x": X}, of="s", wrt="variables/s/w")
    w = keras_model.get_layer("s").w
    with tf.GradientTape() as tape:
        y = keras_model(tf.constant(X))
    np.testing.assert_allclose(got, tape.jacobian(y, w.value).numpy(), rtol=2e-5, atol=2e-5)


def test_subclassed_model_and_its_refusals(tmp_path, setting):
    setting("tests.keras_custom")
    keras_models.subclassed(tmp_path / "sub.keras")
    model = load_model(str(tmp_path / "sub.keras"))
    assert model.input_specs["inputs"].shape.as_list() == [None, 3]
    assert model.output_specs["output_0"].shape.as_list() == [None, 4]
    with pytest.raises(InvalidRequest, match="model.signature: 'other' is not a signature") as err:
        load_model(str(tmp_path / "sub.keras"), "other")
    assert err.value.field == "model.signature"
    setting("tests.keras_custom_dict")   # defines Scale, not TwoLayer
    with pytest.raises(InvalidRequest, match="class 'jt>TwoLayer', which is not known") as err:
        load_model(str(tmp_path / "sub.keras"))
    assert err.value.field == "model.path" and "JACOBIAN_KERAS_CUSTOM_OBJECTS" in str(err.value)


def test_a_lambda_layer_is_refused_by_keras_safe_mode(tmp_path, setting):
    setting(None)
    keras_models.lambda_layer(tmp_path / "lam.keras")
    with pytest.raises(InvalidRequest, match="cannot load the .keras file .*safe_mode") as err:
        load_model(str(tmp_path / "lam.keras"))
    assert err.value.field == "model.path" and str(err.value).endswith("with JACOBIAN_KERAS_UNSAFE_ROOTS")
