"""A SavedModel's signatures and variables read from ``saved_model.pb`` without TensorFlow.

A tiny protobuf wire-format decoder walks only the fields needed: ``SavedModel.meta_graphs[0]``
-> ``MetaGraphDef.signature_def`` (inputs/outputs: ``TensorInfo`` name, dtype, shape) and
``MetaGraphDef.object_graph_def`` (``SavedObject.variable``: name, dtype, shape; the children of
each object, for object paths; the variables each signature's function captures, its
``bound_inputs``). The graph itself (``graph_def``, usually the bulk of the file) is skipped.

A signature's variables are named as requests name them (``variable_names``): by their name, or,
where several variables the signature reads share a name, ``<name>@<object path>`` (the path of
attributes from the root, ``a.w``, first in breadth-first order), which the engine gives them too.

Field numbers are those of ``tensorflow/core/protobuf/{saved_model,meta_graph,
saved_object_graph}.proto`` and ``tensorflow/core/framework/{tensor_shape,types}.proto``.
Shapes use ``None`` for an unknown dimension (``-1`` on the wire); an unknown rank is a shape
of ``None``. Variable names drop TensorFlow's ``:0`` suffix (``"d1/kernel"``); requests name
them as ``wrt: "variables/d1/kernel"``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

SAVED_MODEL_FILE = "saved_model.pb"
VARIABLE_PREFIX = "variables/"

# SavedModel
_SM_META_GRAPHS = 2
# MetaGraphDef
_MG_SIGNATURE_DEF = 5
_MG_OBJECT_GRAPH_DEF = 7
# map<string, V> entries
_MAP_KEY, _MAP_VALUE = 1, 2
# SignatureDef
_SD_INPUTS, _SD_OUTPUTS, _SD_METHOD_NAME = 1, 2, 3
# TensorInfo
_TI_NAME, _TI_DTYPE, _TI_SHAPE = 1, 2, 3
# TensorShapeProto / Dim
_TS_DIM, _TS_UNKNOWN_RANK = 2, 3
_DIM_SIZE = 1
# SavedObjectGraph / SavedObject / ObjectReference / SavedVariable / SavedBareConcreteFunction / SavedConcreteFunction
_OG_NODES, _OG_CONCRETE_FUNCTIONS = 1, 2
_SO_CHILDREN, _SO_VARIABLE, _SO_BARE_CONCRETE_FUNCTION = 1, 7, 8
_OR_NODE_ID, _OR_LOCAL_NAME = 1, 2
_SV_DTYPE, _SV_SHAPE, _SV_TRAINABLE, _SV_NAME = 1, 2, 3, 6
_SBCF_NAME = 1
_SCF_BOUND_INPUTS = 2
_SIGNATURES_CHILD = "signatures"

# tensorflow.DataType -> numpy dtype name (reference types DT_*_REF are these + 100).
DTYPES: dict[int, str] = {
    1: "float32", 2: "float64", 3: "int32", 4: "uint8", 5: "int16", 6: "int8", 7: "string",
    8: "complex64", 9: "int64", 10: "bool", 11: "qint8", 12: "quint8", 13: "qint32",
    14: "bfloat16", 15: "qint16", 16: "quint16", 17: "uint16", 18: "complex128", 19: "float16",
    20: "resource", 21: "variant", 22: "uint32", 23: "uint64", 24: "float8_e5m2",
    25: "float8_e4m3fn", 29: "int4", 30: "uint4",
}

Shape = tuple[int | None, ...] | None


class SavedModelError(ValueError):
    """``saved_model.pb`` is missing or cannot be decoded."""


class SignatureNotFound(KeyError):
    """The SavedModel has no signature of this name; ``available`` lists those it has."""

    def __init__(self, signature: str, available: list[str]) -> None:
        super().__init__(signature)
        self.signature = signature
        self.available = available

    def __str__(self) -> str:
        names = ", ".join(repr(s) for s in self.available) or "none"
        return f"signature {self.signature!r} is not in the SavedModel; choose one of: {names}"


@dataclass(frozen=True)
class TensorSpec:
    """One signature tensor: numpy dtype name and shape (``None`` dims unknown)."""

    name: str
    dtype: str
    shape: Shape
    trainable: bool | None = None   # variables only: SavedVariable.trainable

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": None if self.shape is None else list(self.shape)}
        if self.trainable is not None:
            out["trainable"] = self.trainable
        return out


@dataclass(frozen=True)
class Signature:
    """A ``SignatureDef``: named inputs and outputs."""

    name: str
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    method_name: str = ""


@dataclass(frozen=True)
class SavedModelInfo:
    """What the API needs from a SavedModel: every signature, every variable (by name, the first of a name),
    and per signature the variables it reads (``variable_names``), where ``bound_inputs`` tell them."""

    signatures: dict[str, Signature]
    variables: dict[str, TensorSpec] = field(default_factory=dict)
    signature_variables: dict[str, dict[str, TensorSpec]] = field(default_factory=dict)

    def variables_of(self, signature: str) -> dict[str, TensorSpec]:
        """The variables ``signature`` reads, as requests name them; every variable when that is not known."""
        return self.signature_variables.get(signature, self.variables)

    def signature(self, name: str) -> Signature:
        """The signature ``name``; raises ``SignatureNotFound`` (listing the public ones)."""
        try:
            return self.signatures[name]
        except KeyError:
            public = [s for s in self.signatures if not s.startswith("__")]
            raise SignatureNotFound(name, public) from None

    def describe(self, name: str) -> dict[str, Any]:
        """``{"inputs", "outputs", "variables"}`` of one signature, each ``{name: {dtype, shape}}``."""
        sig = self.signature(name)
        return {
            "inputs": {k: v.to_dict() for k, v in sig.inputs.items()},
            "outputs": {k: v.to_dict() for k, v in sig.outputs.items()},
            "variables": {k: v.to_dict() for k, v in self.variables_of(name).items()},
        }


# ---------------------------------------------------------------- wire format

def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise SavedModelError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise SavedModelError("varint longer than 10 bytes")


def proto_fields(buf: memoryview) -> Iterator[tuple[int, int, Any]]:
    """``(field_number, wire_type, value)``: ints for varint/fixed, a memoryview for bytes."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = int.from_bytes(buf[pos:pos + 8], "little"), pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > end:
                raise SavedModelError(f"field {number}: length {length} runs past the message end")
            value, pos = buf[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = int.from_bytes(buf[pos:pos + 4], "little"), pos + 4
        else:
            raise SavedModelError(f"field {number}: unsupported wire type {wire}")
        if pos > end:
            raise SavedModelError(f"field {number}: truncated")
        yield number, wire, value


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _dtype(value: int) -> str:
    return DTYPES.get(value % 100 if value > 100 else value, f"dtype_enum_{value}")


def _shape(buf: memoryview) -> Shape:
    dims: list[int | None] = []
    for number, wire, value in proto_fields(buf):
        if number == _TS_UNKNOWN_RANK and wire == 0 and value:
            return None
        if number == _TS_DIM and wire == 2:
            size = 0  # proto3: an absent size is 0; unknown is -1 on the wire
            for n, w, v in proto_fields(value):
                if n == _DIM_SIZE and w == 0:
                    size = _int64(v)
            dims.append(None if size < 0 else size)
    return tuple(dims)


def _tensor_info(key: str, buf: memoryview) -> TensorSpec:
    name, dtype = "", 0
    shape: Shape = ()  # an absent tensor_shape is the default TensorShapeProto: a scalar, as TF reads it
    for number, wire, value in proto_fields(buf):
        if number == _TI_NAME and wire == 2:
            name = bytes(value).decode()
        elif number == _TI_DTYPE and wire == 0:
            dtype = value
        elif number == _TI_SHAPE and wire == 2:
            shape = _shape(value)
    return TensorSpec(name=name or key, dtype=_dtype(dtype), shape=shape)


def map_entry(buf: memoryview) -> tuple[str, memoryview]:
    key, value = "", memoryview(b"")
    for number, wire, v in proto_fields(buf):
        if number == _MAP_KEY and wire == 2:
            key = bytes(v).decode()
        elif number == _MAP_VALUE and wire == 2:
            value = v
    return key, value


def _signature(name: str, buf: memoryview) -> Signature:
    inputs: dict[str, TensorSpec] = {}
    outputs: dict[str, TensorSpec] = {}
    method = ""
    for number, wire, value in proto_fields(buf):
        if number in (_SD_INPUTS, _SD_OUTPUTS) and wire == 2:
            key, info = map_entry(value)
            (inputs if number == _SD_INPUTS else outputs)[key] = _tensor_info(key, info)
        elif number == _SD_METHOD_NAME and wire == 2:
            method = bytes(value).decode()
    return Signature(name=name, inputs=inputs, outputs=outputs, method_name=method)


def variable_names(variables: list[tuple[str, str]]) -> list[str]:
    """How requests name each of ``(name, object path)``: ``name``, or ``name@path`` where names repeat."""
    counts: dict[str, int] = {}
    for name, _ in variables:
        counts[name] = counts.get(name, 0) + 1
    return [name if counts[name] == 1 else f"{name}@{path}" for name, path in variables]


def _ints(wire: int, value: Any) -> list[int]:
    """A repeated int32 field: one varint, or a packed run of them."""
    if wire == 0:
        return [value]
    out, pos = [], 0
    while pos < len(value):
        v, pos = _varint(value, pos)
        out.append(v)
    return out


def _variable(buf: memoryview) -> TensorSpec:
    name, dtype, vshape, trainable = "", 0, (), False   # proto3: an absent bool is false
    for vn, vw, vv in proto_fields(buf):
        if vn == _SV_DTYPE and vw == 0:
            dtype = vv
        elif vn == _SV_TRAINABLE and vw == 0:
            trainable = bool(vv)
        elif vn == _SV_SHAPE and vw == 2:
            vshape = _shape(vv)
        elif vn == _SV_NAME and vw == 2:
            name = strip_variable_suffix(bytes(vv).decode())
    return TensorSpec(name=name, dtype=_dtype(dtype), shape=vshape, trainable=trainable)


def _object_graph(buf: memoryview) -> tuple[dict[str, TensorSpec], dict[str, dict[str, TensorSpec]]]:
    """Every variable by name (the first of a name), and per signature the variables its function captures."""
    nodes: list[tuple[list[tuple[str, int]], TensorSpec | None, str | None]] = []  # children, variable, function
    bound: dict[str, list[int]] = {}
    for number, wire, value in proto_fields(buf):
        if number == _OG_CONCRETE_FUNCTIONS and wire == 2:
            key, fn = map_entry(value)
            bound[key] = [i for n, w, v in proto_fields(fn) if n == _SCF_BOUND_INPUTS for i in _ints(w, v)]
        if number != _OG_NODES or wire != 2:
            continue
        children, variable, function = [], None, None
        for n, w, v in proto_fields(value):
            if n == _SO_CHILDREN and w == 2:
                ref = {rn: rv for rn, rw, rv in proto_fields(v)}
                children.append((bytes(ref.get(_OR_LOCAL_NAME, b"")).decode(), int(ref.get(_OR_NODE_ID, 0))))
            elif n == _SO_VARIABLE and w == 2:
                variable = _variable(v)
            elif n == _SO_BARE_CONCRETE_FUNCTION and w == 2:
                function = next((bytes(fv).decode() for fn_, fw, fv in proto_fields(v) if fn_ == _SBCF_NAME), None)
        nodes.append((children, variable, function))
    everything: dict[str, TensorSpec] = {}
    for _, variable, _ in nodes:  # one variable is often saved twice (Keras: 'variables', '_all_variables')
        if variable is not None and variable.name and variable.name not in everything:
            everything[variable.name] = variable
    paths = _object_paths(nodes)
    per_signature: dict[str, dict[str, TensorSpec]] = {}
    signatures = dict(nodes[0][0]).get(_SIGNATURES_CHILD) if nodes else None
    for key, node_id in (nodes[signatures][0] if signatures is not None and signatures < len(nodes) else []):
        function = nodes[node_id][2] if node_id < len(nodes) else None
        if function is None or function not in bound:
            continue
        read = [(nodes[i][1], paths.get(i, str(i))) for i in dict.fromkeys(bound[function])
                if i < len(nodes) and nodes[i][1] is not None]
        names = variable_names([(v.name, path) for v, path in read])
        per_signature[key] = {name: TensorSpec(name=name, dtype=v.dtype, shape=v.shape, trainable=v.trainable)
                              for name, (v, _) in zip(names, read)}
    return everything, per_signature


def _object_paths(nodes: list[tuple[list[tuple[str, int]], Any, Any]]) -> dict[int, str]:
    """Each node's object path from the root (node 0): local names joined by ``.``, the first path found
    breadth-first with children in their saved order."""
    paths: dict[int, str] = {0: ""} if nodes else {}
    queue = [0] if nodes else []
    for node in queue:
        for local, child in nodes[node][0]:
            if child not in paths and 0 <= child < len(nodes):
                paths[child] = f"{paths[node]}.{local}" if paths[node] else local
                queue.append(child)
    return paths


def parse_saved_model(data: bytes) -> SavedModelInfo:
    """Decode the bytes of ``saved_model.pb``: signatures and variables of ``meta_graphs[0]``."""
    buf = memoryview(data)
    meta_graph = None
    for number, wire, value in proto_fields(buf):
        if number == _SM_META_GRAPHS and wire == 2:
            meta_graph = value
            break
    if meta_graph is None:
        raise SavedModelError("no meta graph in saved_model.pb")
    signatures: dict[str, Signature] = {}
    variables: dict[str, TensorSpec] = {}
    per_signature: dict[str, dict[str, TensorSpec]] = {}
    for number, wire, value in proto_fields(meta_graph):
        if number == _MG_SIGNATURE_DEF and wire == 2:
            key, sig = map_entry(value)
            signatures[key] = _signature(key, sig)
        elif number == _MG_OBJECT_GRAPH_DEF and wire == 2:
            variables, per_signature = _object_graph(value)
    return SavedModelInfo(signatures=signatures, variables=variables, signature_variables=per_signature)


def strip_variable_suffix(name: str) -> str:
    """``"d1/kernel:0"`` -> ``"d1/kernel"``."""
    head, sep, tail = name.rpartition(":")
    return head if sep and tail.isdigit() else name


@lru_cache(maxsize=64)
def _read_cached(path: str, mtime_ns: int, size: int) -> SavedModelInfo:
    with open(path, "rb") as f:
        return parse_saved_model(f.read())


def read_saved_model(model_dir: str | os.PathLike[str]) -> SavedModelInfo:
    """Signatures and variables of the SavedModel in ``model_dir`` (cached per file mtime and size).

    Raises ``SavedModelError`` when there is no ``saved_model.pb`` or it cannot be decoded.
    """
    pb = Path(model_dir) / SAVED_MODEL_FILE
    try:
        st = pb.stat()
    except OSError:
        raise SavedModelError(f"no {SAVED_MODEL_FILE} in {str(model_dir)!r}") from None
    if not pb.is_file():
        raise SavedModelError(f"{str(pb)!r} is not a file")
    try:
        return _read_cached(str(pb), st.st_mtime_ns, st.st_size)
    except (SavedModelError, UnicodeDecodeError) as exc:
        raise SavedModelError(f"{str(pb)!r} is not a readable SavedModel: {exc}") from None
