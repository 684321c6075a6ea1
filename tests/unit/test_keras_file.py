"""``contracts.keras_file`` on ``.keras`` zips written here (no Keras): the signature from ``config.json``, the
scan (Lambda layers, classes outside Keras, unsafe roots), unreadable files; the worker's fingerprint of a file."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest

from contracts.graph_scan import ModelRefused
from contracts.keras_file import KerasFileError, KerasRefused, read_keras_file, scan_keras_file
from contracts.savedmodel import SavedModelError, SignatureNotFound


def layer(name: str, class_name: str = "Dense", module: str = "keras.layers", **config) -> dict:
    return {"module": module, "class_name": class_name, "config": {"name": name, **config}, "registered_name": None,
            "name": name, "inbound_nodes": []}


def inp(name: str, shape: list, dtype: str = "float32") -> dict:
    return layer(name, "InputLayer", batch_shape=shape, dtype=dtype)


def functional(layers: list, inputs, outputs) -> dict:
    return {"module": "keras.src.models.functional", "class_name": "Functional", "registered_name": "Functional",
            "config": {"name": "m", "layers": layers, "input_layers": inputs, "output_layers": outputs}}


def write(path: Path, config: dict) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("config.json", json.dumps(config))
        zf.writestr("metadata.json", "{}")
    return path


def test_signature_of_dict_inputs_and_outputs(tmp_path):
    config = functional([inp("x", [None, 3]), inp("z", [None, 2], "float64"), layer("a"), layer("b")],
                        {"x": ["x", 0, 0], "z": ["z", 0, 0]}, {"out_a": ["a", 0, 0], "out_b": ["b", 0, 0]})
    described = read_keras_file(write(tmp_path / "m.keras", config)).describe("serving_default")
    assert described == {"inputs": {"x": {"dtype": "float32", "shape": [None, 3]},
                                    "z": {"dtype": "float64", "shape": [None, 2]}},
                         "outputs": {"out_a": {"dtype": "float32", "shape": None},
                                     "out_b": {"dtype": "float32", "shape": None}},
                         "variables": {}}


def test_signature_of_lists_and_of_one_output(tmp_path):
    listed = functional([inp("x", [None, 3]), inp("z", [4, 2]), layer("a"), layer("b")],
                        [["x", 0, 0], ["z", 0, 0]], [["a", 0, 0], ["b", 0, 0]])
    sig = read_keras_file(write(tmp_path / "l.keras", listed)).signature("serving_default")
    assert list(sig.inputs) == ["x", "z"] and sig.inputs["z"].shape == (4, 2) and list(sig.outputs) == ["a", "b"]
    single = functional([inp("x", [None, 3]), layer("y")], ["x", 0, 0], ["y", 0, 0])
    info = read_keras_file(write(tmp_path / "s.keras", single))
    assert list(info.signature("serving_default").outputs) == ["y"]
    with pytest.raises(SignatureNotFound):
        info.signature("other")


def test_subclassed_model_has_its_built_shape_with_any_batch(tmp_path):
    config = {"module": "mine", "class_name": "Net", "registered_name": "pkg>Net", "config": {"name": "net"},
              "build_config": {"input_shape": [1, 5]}}
    sig = read_keras_file(write(tmp_path / "sub.keras", config)).signature("serving_default")
    assert sig.inputs["inputs"].shape == (None, 5) and sig.outputs["output_0"].shape is None


def test_lambda_refused_unless_the_root_is_unsafe(tmp_path):
    config = functional([inp("x", [None, 3]), layer("double", "Lambda", function="...")], ["x", 0, 0],
                        ["double", 0, 0])
    path = write(tmp_path / "lam.keras", config)
    with pytest.raises(KerasRefused) as err:
        scan_keras_file(path, custom_objects=None, unsafe_roots=[], field="path")
    assert isinstance(err.value, ModelRefused) and err.value.field == "path"
    assert str(err.value).startswith("path: the model has a Lambda layer 'double'")
    assert "JACOBIAN_KERAS_UNSAFE_ROOTS" in str(err.value)
    scan_keras_file(path, custom_objects=None, unsafe_roots=[str(tmp_path)])
    with pytest.raises(KerasRefused):
        scan_keras_file(path, custom_objects=None, unsafe_roots=[str(tmp_path / "elsewhere")])


def test_a_class_outside_keras_needs_the_custom_objects_setting(tmp_path):
    custom = layer("s", "Scale", module="my.layers")
    custom["registered_name"] = "jt>Scale"
    path = write(tmp_path / "c.keras", functional([inp("x", [None, 3]), custom], ["x", 0, 0], ["s", 0, 0]))
    with pytest.raises(KerasRefused) as err:
        scan_keras_file(path, custom_objects=None, unsafe_roots=[])
    assert "'jt>Scale'" in str(err.value) and "JACOBIAN_KERAS_CUSTOM_OBJECTS" in str(err.value)
    scan_keras_file(path, custom_objects="my.layers", unsafe_roots=[])   # the worker checks the class is there


@pytest.mark.parametrize("content", [b"not a zip", None])
def test_unreadable_files_are_saved_model_errors(tmp_path, content):
    path = tmp_path / "bad.keras"
    if content is None:
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("metadata.json", "{}")
    else:
        path.write_bytes(content)
    for call in (lambda: read_keras_file(path), lambda: scan_keras_file(path, custom_objects=None, unsafe_roots=[])):
        with pytest.raises(KerasFileError) as err:
            call()
        assert isinstance(err.value, SavedModelError) and "not a readable .keras file" in str(err.value)
    with pytest.raises(KerasFileError, match="does not exist"):
        read_keras_file(tmp_path / "none.keras")


@pytest.mark.parametrize("config", [
    {"config": {"layers": ["x"], "input_layers": ["x", 0, 0], "output_layers": ["x", 0, 0]}},
    {"config": {"layers": [{"name": "x", "config": "text"}], "input_layers": ["x", 0, 0]}},
    {"config": "text", "build_config": "text"},
])
def test_a_config_of_another_form_is_a_saved_model_error(tmp_path, config):
    with pytest.raises(KerasFileError, match="not a readable .keras file"):
        read_keras_file(write(tmp_path / "odd.keras", config))


def test_fingerprint_is_the_file_hash(tmp_path):
    from worker.engine.model import model_fingerprint

    config = functional([inp("x", [None, 3]), layer("y")], ["x", 0, 0], ["y", 0, 0])
    first = write(tmp_path / "a.keras", config)
    shutil.copy(first, tmp_path / "b.keras")
    assert model_fingerprint(first) == model_fingerprint(tmp_path / "b.keras")
    write(tmp_path / "b.keras", {**config, "extra": 1})
    assert model_fingerprint(first) != model_fingerprint(tmp_path / "b.keras")
