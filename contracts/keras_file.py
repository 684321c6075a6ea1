"""A Keras 3 ``.keras`` file (a zip of ``config.json``, ``metadata.json``, ``model.weights.h5``) read without
TensorFlow: its signature from ``config.json``, and the scan that refuses what it must not load.

The signature (one, called ``serving_default``) has the model's input and output names: a functional
model's input layers (``batch_shape``, ``dtype``) and output layers (the keys of a dict of outputs, else
the output layers' names). A model whose config gives no inputs (a subclassed model) has one input
``inputs`` of the shape its ``build_config`` records (any batch), and one output ``output_0`` of unknown shape; the
worker checks the rest once the model is loaded. Variables are known only to the worker.

The scan (``scan_keras_file``): a ``.keras`` file holds no graph but a config naming classes. A ``Lambda``
layer (arbitrary Python code) is refused, and so is a class outside Keras when no custom objects module is
configured (``JACOBIAN_KERAS_CUSTOM_OBJECTS``); an operator may turn safe mode off for a root
(``JACOBIAN_KERAS_UNSAFE_ROOTS``), which lets Lambda layers through.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

from contracts.graph_scan import ModelRefused
from contracts.savedmodel import SavedModelError, SavedModelInfo, Shape, Signature, TensorSpec
from contracts.storage import is_under

KERAS_SUFFIX = ".keras"
CONFIG_FILE = "config.json"
SIGNATURE = "serving_default"
CUSTOM_OBJECTS_SETTING = "JACOBIAN_KERAS_CUSTOM_OBJECTS"
UNSAFE_SETTING = "JACOBIAN_KERAS_UNSAFE_ROOTS"
READ_SETTING = "JACOBIAN_MAX_MODEL_READ_BYTES"
SUBCLASSED_INPUT = "inputs"
SUBCLASSED_OUTPUT = "output_0"
_CODE_LAYERS = frozenset({"Lambda", "TFOpLambda"})


class KerasFileError(SavedModelError):
    """The ``.keras`` file is not a zip with a readable ``config.json``."""


class KerasConfigTooLarge(KerasFileError):
    """The ``.keras`` file's ``config.json`` is larger than the service reads (``JACOBIAN_MAX_MODEL_READ_BYTES``)."""


class KerasRefused(ModelRefused):
    """The ``.keras`` file names a class that the service will not load (a ``Lambda`` layer, an unknown class)."""

    def __init__(self, message: str, *, field: str) -> None:
        ValueError.__init__(self, message)
        self.refusals, self.field, self.root, self._message = [], field, None, message

    @property
    def message(self) -> str:
        return self._message


def is_keras_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a ``.keras`` file (by its suffix)."""
    return str(path).endswith(KERAS_SUFFIX)


@lru_cache(maxsize=64)
def _config_cached(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    return zip_config(path, path)


def zip_config(file: str | BinaryIO, where: str, *, max_bytes: int | None = None) -> dict[str, Any]:
    """``config.json`` of the ``.keras`` zip ``file`` (a path, or a seekable file: zip reads its directory at the
    end, then the one member), named ``where`` in messages; raises ``KerasFileError``, ``KerasConfigTooLarge``
    when the member is over ``max_bytes``."""
    try:
        with zipfile.ZipFile(file) as zf:
            declared = zf.getinfo(CONFIG_FILE).file_size
            if max_bytes is not None and declared > max_bytes:
                raise KerasConfigTooLarge(f"{where!r}: its {CONFIG_FILE} is {declared} bytes, more than the "
                                          f"{max_bytes} this service reads ({READ_SETTING})")
            config = json.loads(zf.read(CONFIG_FILE))
    except (zipfile.BadZipFile, KeyError, ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, SavedModelError):   # over a size limit: says so itself
            raise
        raise KerasFileError(f"{where!r} is not a readable .keras file (a zip holding {CONFIG_FILE}): {exc}") from None
    if not isinstance(config, dict):
        raise KerasFileError(f"{where!r}: {CONFIG_FILE} is not a JSON object")
    return config


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of the ``.keras`` file at ``path`` (cached per mtime and size); raises ``KerasFileError``."""
    try:
        st = Path(path).stat()
    except OSError:
        raise KerasFileError(f"{str(path)!r} does not exist") from None
    if not Path(path).is_file():
        raise KerasFileError(f"{str(path)!r} is not a file")
    return _config_cached(str(path), st.st_mtime_ns, st.st_size)


def _shape(value: Any) -> Shape:
    if not isinstance(value, list):
        return None
    return tuple(d if isinstance(d, int) and d >= 0 else None for d in value)


def _dtype(value: Any) -> str:
    if isinstance(value, dict):   # a DTypePolicy
        value = value.get("config", {}).get("name")
    return value if isinstance(value, str) and value and "_" not in value else "float32"


def _refs(struct: Any) -> list[tuple[str | None, str]]:
    """``(key, layer name)`` of a functional model's ``input_layers``/``output_layers``: a dict, a list of
    ``[layer, node, index]``, or one of them."""
    if isinstance(struct, dict):
        return [(str(k), str(v[0])) for k, v in struct.items() if isinstance(v, list) and v]
    if isinstance(struct, list) and struct and isinstance(struct[0], str):
        return [(None, struct[0])]
    if isinstance(struct, list):
        return [ref for item in struct for ref in _refs(item)]
    return []


def _layers(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    layers = config.get("config", {}).get("layers", [])
    return {str(layer.get("name") or layer.get("config", {}).get("name")): layer
            for layer in layers if isinstance(layer, dict)}


def _layer(layers: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    layer = layers.get(name)
    if layer is None:
        raise KeyError(f"the layer {name!r} it names as an input or output is not among its layers")
    if not isinstance(layer.get("config", {}), dict):
        raise TypeError(f"the layer {name!r} has a config that is not an object")
    return {"config": {}, **layer}


def signature_of(config: dict[str, Any]) -> Signature:
    """The ``serving_default`` signature of a model's ``config.json``."""
    inner = config.get("config", {}) if isinstance(config.get("config"), dict) else {}
    layers = _layers(config)
    inputs: dict[str, TensorSpec] = {}
    for key, name in _refs(inner.get("input_layers")):
        cfg = _layer(layers, name)["config"]
        inputs[key or name] = TensorSpec(key or name, _dtype(cfg.get("dtype")), _shape(cfg.get("batch_shape")))
    outputs: dict[str, TensorSpec] = {}
    for key, name in _refs(inner.get("output_layers")):   # a layer's config keeps its input shape only
        dtype = _dtype(_layer(layers, name)["config"].get("dtype"))
        outputs[key or name] = TensorSpec(key or name, dtype, None)
    if not inputs:   # a subclassed model: what its build_config recorded
        built = (config.get("build_config") or {}).get("input_shape")
        shape = _shape(built) if isinstance(built, list) and all(not isinstance(d, list) for d in built) else None
        shape = None if not shape else (None, *shape[1:])   # the batch it was built on is not the model's
        inputs = {SUBCLASSED_INPUT: TensorSpec(SUBCLASSED_INPUT, _dtype(inner.get("dtype")), shape)}
        outputs = {SUBCLASSED_OUTPUT: TensorSpec(SUBCLASSED_OUTPUT, _dtype(inner.get("dtype")), None)}
    return Signature(name=SIGNATURE, inputs=inputs, outputs=outputs)


def read_keras_file(path: str | os.PathLike[str]) -> SavedModelInfo:
    """The ``.keras`` file's one signature (``serving_default``); no variables (the worker names them).
    Raises ``KerasFileError`` for a file that is not a ``.keras`` zip or whose config has another form."""
    return keras_info(read_config(path), path)


def keras_info(config: dict[str, Any], where: str | os.PathLike[str]) -> SavedModelInfo:
    """``read_keras_file`` of a config already read (from the ``.keras`` file at ``where``, a path or a URL)."""
    try:
        signature = signature_of(config)
    except (AttributeError, TypeError, KeyError, IndexError, ValueError) as exc:
        raise KerasFileError(f"{str(where)!r} is not a readable .keras file: its {CONFIG_FILE} is not a Keras "
                             f"model's config ({type(exc).__name__}: {exc})") from None
    return SavedModelInfo(signatures={SIGNATURE: signature})


def _objects(node: Any) -> Iterator[dict[str, Any]]:
    """Every serialized object (a dict with ``class_name``) in the config, depth first."""
    if isinstance(node, dict):
        if isinstance(node.get("class_name"), str):
            yield node
        for value in node.values():
            yield from _objects(value)
    elif isinstance(node, list):
        for value in node:
            yield from _objects(value)


def custom_classes(config: dict[str, Any]) -> list[str]:
    """The registered names of the classes outside Keras that ``config`` names, in order, once each."""
    found: dict[str, None] = {}
    for obj in _objects(config):
        module = obj.get("module")
        if isinstance(module, str) and module and module != "builtins" and module.split(".")[0] != "keras":
            found[str(obj.get("registered_name") or obj["class_name"])] = None
    return list(found)


def under(path: str | os.PathLike[str], folders: list[str]) -> bool:
    """Whether ``path`` lies in one of ``folders`` (local paths resolved; ``s3://`` URLs by prefix)."""
    return any(is_under(path, f) for f in folders)


def scan_keras_file(path: str | os.PathLike[str], *, custom_objects: str | None, unsafe_roots: list[str],
                    field: str = "model.path", origin: str | None = None) -> None:
    """Refuse (``KerasRefused`` naming ``field``) a ``Lambda`` layer unless ``path`` (or ``origin``, where the
    model was named when ``path`` is a local copy of it: an ``s3://`` URL) lies in one of ``unsafe_roots``, and
    a class outside Keras when no ``custom_objects`` module is configured; raises ``KerasFileError`` for a file
    that is not a readable ``.keras`` file."""
    scan_keras_config(read_config(path), origin or path, custom_objects=custom_objects, unsafe_roots=unsafe_roots,
                      field=field)


def scan_keras_config(config: dict[str, Any], where: str | os.PathLike[str], *, custom_objects: str | None,
                      unsafe_roots: list[str], field: str = "model.path") -> None:
    """``scan_keras_file`` of a config already read (from the ``.keras`` file at ``where``, a path or a URL)."""
    if not under(where, unsafe_roots):
        for obj in _objects(config):
            if obj["class_name"] in _CODE_LAYERS:
                name = (obj.get("config") or {}).get("name") if isinstance(obj.get("config"), dict) else None
                raise KerasRefused(
                    f"{field}: the model has a {obj['class_name']} layer {name!r}, which runs arbitrary Python "
                    "code; Keras refuses it in safe mode: rebuild the model with a layer class (registered with "
                    "keras.saving.register_keras_serializable), or ask the operator to turn safe mode off for "
                    f"this model root with {UNSAFE_SETTING}", field=field)
    if not custom_objects:
        unknown = custom_classes(config)
        if unknown:
            raise KerasRefused(
                f"{field}: the model uses class {unknown[0]!r}, which is not part of Keras"
                + (f" (and {len(unknown) - 1} more: {', '.join(unknown[1:])})" if len(unknown) > 1 else "")
                + f"; ask the operator to name the module that defines it in {CUSTOM_OBJECTS_SETTING}",
                field=field)
