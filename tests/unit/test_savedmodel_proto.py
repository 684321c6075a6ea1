"""contracts.savedmodel: the TensorFlow-free decoder agrees with what TensorFlow reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts.savedmodel import (
    SavedModelError,
    SignatureNotFound,
    parse_saved_model,
    read_saved_model,
    strip_variable_suffix,
)
from tests import models


def _tf_spec(spec):
    shape = None if spec.shape.rank is None else tuple(spec.shape.as_list())
    return spec.dtype.name, shape


@pytest.mark.parametrize("name", models.API_MODELS)
def test_signatures_match_tensorflow(model_root, name):
    import tensorflow as tf

    info = read_saved_model(model_root / name)
    loaded = tf.saved_model.load(str(model_root / name))
    assert set(loaded.signatures.keys()) <= set(info.signatures)
    for key, fn in loaded.signatures.items():
        sig = info.signature(key)
        tf_inputs = fn.structured_input_signature[1]
        assert {k: (v.dtype, v.shape) for k, v in sig.inputs.items()} == {k: _tf_spec(s) for k, s in tf_inputs.items()}
        assert {k: (v.dtype, v.shape) for k, v in sig.outputs.items()} == {
            k: _tf_spec(s) for k, s in fn.structured_outputs.items()}
        for var in fn.variables:
            mine = info.variables[strip_variable_suffix(var.name)]
            assert (mine.dtype, mine.shape) == (var.dtype.name, tuple(var.shape.as_list()))
        # the variables the signature reads (its function's bound inputs), as the engine knows them
        assert set(info.variables_of(key)) == {strip_variable_suffix(v.name) for v in fn.variables}


@pytest.mark.parametrize("name", models.API_MODELS)
def test_everything_matches_tensorflow_protobuf(model_root, name):
    """Every signature (including TF-internal ones) and every variable, against TF's own parser."""
    import tensorflow as tf
    from tensorflow.core.protobuf import saved_model_pb2

    data = (model_root / name / "saved_model.pb").read_bytes()
    proto = saved_model_pb2.SavedModel.FromString(data)
    meta = proto.meta_graphs[0]
    info = parse_saved_model(data)

    def shape(ts):
        return None if ts.unknown_rank else tuple(None if d.size < 0 else d.size for d in ts.dim)

    assert set(info.signatures) == set(meta.signature_def)
    for key, sd in meta.signature_def.items():
        for mine, theirs in ((info.signatures[key].inputs, sd.inputs), (info.signatures[key].outputs, sd.outputs)):
            assert set(mine) == set(theirs)
            for k, ti in theirs.items():
                assert mine[k].name == ti.name
                assert mine[k].shape == shape(ti.tensor_shape)
                if ti.dtype:
                    assert mine[k].dtype == tf.dtypes.as_dtype(ti.dtype).name
    expected = {}
    for node in meta.object_graph_def.nodes:
        if node.WhichOneof("kind") == "variable":
            expected.setdefault(node.variable.name, (tf.dtypes.as_dtype(node.variable.dtype).name,
                                                     shape(node.variable.shape)))
    assert {k: (v.dtype, v.shape) for k, v in info.variables.items()} == expected


def test_known_shapes_and_dtypes(model_root):
    info = read_saved_model(model_root / "float64")
    described = info.describe("serving_default")
    assert described["inputs"] == {"x": {"dtype": "float64", "shape": [None, 5]}}
    assert described["outputs"]["loss"] == {"dtype": "float64", "shape": []}
    assert described["variables"] == {"w": {"dtype": "float64", "shape": [5, 4], "trainable": True},
                                      "b": {"dtype": "float64", "shape": [4], "trainable": True}}
    ints = read_saved_model(model_root / "int_input").signature("serving_default")
    assert ints.inputs["ids"].dtype == "int32" and ints.inputs["ids"].shape == (None, 4)


def test_unknown_rank_ref_dtype_and_large_dims():
    """Hand-built protos: unknown rank -> None, DT_FLOAT_REF -> float32, int64 dims beyond 2**31."""
    from tensorflow.core.protobuf import saved_model_pb2

    sm = saved_model_pb2.SavedModel()
    mg = sm.meta_graphs.add()
    sd = mg.signature_def["s"]
    a = sd.inputs["a"]
    a.dtype = 101  # DT_FLOAT_REF
    a.tensor_shape.unknown_rank = True
    b = sd.outputs["b"]
    b.dtype = 9
    for size in (-1, 1 << 33, 0):
        b.tensor_shape.dim.add(size=size)
    c = sd.outputs["c"]  # no tensor_shape at all: a scalar, as TensorFlow reads it
    c.dtype = 19
    node = mg.object_graph_def.nodes.add()
    node.variable.name = "layer/w:0"
    node.variable.dtype = 14
    node.variable.shape.dim.add(size=3)
    info = parse_saved_model(sm.SerializeToString())
    sig = info.signature("s")
    assert (sig.inputs["a"].dtype, sig.inputs["a"].shape) == ("float32", None)
    assert (sig.outputs["b"].dtype, sig.outputs["b"].shape) == ("int64", (None, 1 << 33, 0))
    assert (sig.outputs["c"].dtype, sig.outputs["c"].shape) == ("float16", ())
    assert {k: (v.dtype, v.shape) for k, v in info.variables.items()} == {"layer/w": ("bfloat16", (3,))}


def test_missing_signature_lists_public_ones(model_root):
    info = read_saved_model(model_root / "mlp")
    with pytest.raises(SignatureNotFound) as err:
        info.signature("nope")
    assert "'serving_default'" in str(err.value) and "__saved_model_init_op" not in str(err.value)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(SavedModelError, match="no saved_model.pb"):
        read_saved_model(tmp_path)
    (tmp_path / "saved_model.pb").write_bytes(b"\x12\xff\xff\xff\x0f")  # field 2, length far past the end
    with pytest.raises(SavedModelError):
        read_saved_model(tmp_path)
    (tmp_path / "saved_model.pb").write_bytes(b"")
    with pytest.raises(SavedModelError, match="no meta graph"):
        read_saved_model(tmp_path)


def test_strip_variable_suffix():
    assert strip_variable_suffix("d1/kernel:0") == "d1/kernel"
    assert strip_variable_suffix("d1/kernel") == "d1/kernel"
    assert strip_variable_suffix("a:b") == "a:b"


def test_module_imports_no_tensorflow():
    import subprocess
    import sys

    code = "import contracts.savedmodel, sys; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_variables_that_share_a_name_are_named_by_object_path():
    from contracts.savedmodel import variable_names

    assert variable_names([("w", "a"), ("v", "c"), ("w", "layer.b")]) == ["w@a", "v", "w@layer.b"]


def test_non_trainable_variables_are_told_apart(tmp_path):
    """Batch norm's moving statistics are saved non-trainable: the signature endpoint says so (as the worker's
    ``variables/*`` leaves them out), read from ``SavedVariable.trainable`` without TensorFlow."""
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((4,), name="x")
    h = keras.layers.BatchNormalization(name="bn")(inp)
    keras.Model(inp, {"y": keras.layers.Dense(2, name="d")(h)}).export(str(tmp_path / "bn"), verbose=False)
    variables = read_saved_model(tmp_path / "bn").describe("serving_default")["variables"]
    assert {n: v["trainable"] for n, v in variables.items()} == {
        "bn/moving_mean": False, "bn/moving_variance": False, "bn/gamma": True, "bn/beta": True,
        "d/kernel": True, "d/bias": True}
