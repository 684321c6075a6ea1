"""The graph scan passes the models users bring: recurrent layers that are not unrolled, Conv1D, a transformer
encoder and a Keras application, exported both ways (``Model.export`` and ``tf.saved_model.save``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts.graph_ops import parse_graph_ops
from contracts.graph_scan import refused_ops


def _keras():
    import keras

    keras.utils.set_random_seed(0)
    return keras


def lstm_gru():
    keras = _keras()
    inp = keras.Input((7, 3), name="seq")
    h = keras.layers.GRU(5, return_sequences=True)(keras.layers.LSTM(4, return_sequences=True)(inp))
    return keras.Model(inp, keras.layers.Dense(2)(h[:, -1]))


def conv1d():
    keras = _keras()
    inp = keras.Input((16, 2), name="signal")
    h = keras.layers.Conv1D(4, 3, activation="relu", padding="causal", dilation_rate=2)(inp)
    h = keras.layers.MaxPooling1D(2)(keras.layers.BatchNormalization()(h))
    return keras.Model(inp, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))


def transformer():
    keras = _keras()
    inp = keras.Input((6, 8), name="tokens")
    att = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inp, inp)
    h = keras.layers.LayerNormalization()(inp + keras.layers.Dropout(0.1)(att))
    ff = keras.layers.Dense(8)(keras.layers.Dense(16, activation="gelu")(h))
    return keras.Model(inp, keras.layers.LayerNormalization()(h + ff))


def mobilenet():
    return _keras().applications.MobileNetV3Small(weights=None, input_shape=(32, 32, 3))


@pytest.mark.parametrize("how", ["export", "saved_model_save"])
@pytest.mark.parametrize("build", [lstm_gru, conv1d, transformer, mobilenet], ids=lambda f: f.__name__)
def test_users_models_pass_the_scan(tmp_path: Path, build, how):
    import tensorflow as tf

    model = build()
    if how == "export":
        model.export(str(tmp_path / "m"), verbose=False)
    else:
        tf.saved_model.save(model, str(tmp_path / "m"))
    graph = parse_graph_ops((tmp_path / "m" / "saved_model.pb").read_bytes())
    ops = {node.op for nodes in graph.functions.values() for node in nodes}
    assert {"SaveV2", "RestoreV2"} <= ops  # the saver's functions are scanned, and keep their checkpoint ops
    if build is lstm_gru:
        assert "While" in ops or "StatelessWhile" in ops  # a real loop, not unrolled
    assert refused_ops(graph) == []
