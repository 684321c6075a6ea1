"""A SavedModel's signatures and variables read from ``saved_model.pb`` without TensorFlow.

A tiny protobuf wire-format decoder walks only the fields needed: ``SavedModel.meta_graphs[0]``
-> ``MetaGraphDef.signature_def`` (inputs/outputs: ``TensorInfo`` name, dtype, shape) and
``MetaGraphDef.object_graph_def`` (``SavedObject.variable``: name, dtype, shape). The graph
itself (``graph_def``, usually the bulk of the file) is skipped, not parsed.

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
# SavedObjectGraph / SavedObject / SavedVariable
_OG_NODES = 1
_SO_VARIABLE = 7
_SV_DTYPE, _SV_SHAPE, _SV_NAME = 1, 2, 6

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

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": None if self.shape is None else list(self.shape)}


@dataclass(frozen=True)
class Signature:
    """A ``SignatureDef``: named inputs and outputs."""

    name: str
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    method_name: str = ""


@dataclass(frozen=True)
class SavedModelInfo:
    """What the API needs from a SavedModel: every signature and every variable (by name)."""

    signatures: dict[str, Signature]
    variables: dict[str, TensorSpec] = field(default_factory=dict)

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
            "variables": {k: v.to_dict() for k, v in self.variables.items()},
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


def _fields(buf: memoryview) -> Iterator[tuple[int, int, Any]]:
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
    for number, wire, value in _fields(buf):
        if number == _TS_UNKNOWN_RANK and wire == 0 and value:
            return None
        if number == _TS_DIM and wire == 2:
            size = 0  # proto3: an absent size is 0; unknown is -1 on the wire
            for n, w, v in _fields(value):
                if n == _DIM_SIZE and w == 0:
                    size = _int64(v)
            dims.append(None if size < 0 else size)
    return tuple(dims)


def _tensor_info(key: str, buf: memoryview) -> TensorSpec:
    name, dtype = "", 0
    shape: Shape = ()  # an absent tensor_shape is the default TensorShapeProto: a scalar, as TF reads it
    for number, wire, value in _fields(buf):
        if number == _TI_NAME and wire == 2:
            name = bytes(value).decode()
        elif number == _TI_DTYPE and wire == 0:
            dtype = value
        elif number == _TI_SHAPE and wire == 2:
            shape = _shape(value)
    return TensorSpec(name=name or key, dtype=_dtype(dtype), shape=shape)


def _map_entry(buf: memoryview) -> tuple[str, memoryview]:
    key, value = "", memoryview(b"")
    for number, wire, v in _fields(buf):
        if number == _MAP_KEY and wire == 2:
            key = bytes(v).decode()
        elif number == _MAP_VALUE and wire == 2:
            value = v
    return key, value


def _signature(name: str, buf: memoryview) -> Signature:
    inputs: dict[str, TensorSpec] = {}
    outputs: dict[str, TensorSpec] = {}
    method = ""
    for number, wire, value in _fields(buf):
        if number in (_SD_INPUTS, _SD_OUTPUTS) and wire == 2:
            key, info = _map_entry(value)
            (inputs if number == _SD_INPUTS else outputs)[key] = _tensor_info(key, info)
        elif number == _SD_METHOD_NAME and wire == 2:
            method = bytes(value).decode()
    return Signature(name=name, inputs=inputs, outputs=outputs, method_name=method)


def _variables(buf: memoryview) -> dict[str, TensorSpec]:
    out: dict[str, TensorSpec] = {}
    for number, wire, node in _fields(buf):
        if number != _OG_NODES or wire != 2:
            continue
        for n, w, var in _fields(node):
            if n != _SO_VARIABLE or w != 2:
                continue
            name, dtype, vshape = "", 0, ()
            for vn, vw, vv in _fields(var):
                if vn == _SV_DTYPE and vw == 0:
                    dtype = vv
                elif vn == _SV_SHAPE and vw == 2:
                    vshape = _shape(vv)
                elif vn == _SV_NAME and vw == 2:
                    name = bytes(vv).decode()
            name = strip_variable_suffix(name)
            if name and name not in out:  # one variable is often reachable from several nodes
                out[name] = TensorSpec(name=name, dtype=_dtype(dtype), shape=vshape)
    return out


def parse_saved_model(data: bytes) -> SavedModelInfo:
    """Decode the bytes of ``saved_model.pb``: signatures and variables of ``meta_graphs[0]``."""
    buf = memoryview(data)
    meta_graph = None
    for number, wire, value in _fields(buf):
        if number == _SM_META_GRAPHS and wire == 2:
            meta_graph = value
            break
    if meta_graph is None:
        raise SavedModelError("no meta graph in saved_model.pb")
    signatures: dict[str, Signature] = {}
    variables: dict[str, TensorSpec] = {}
    for number, wire, value in _fields(meta_graph):
        if number == _MG_SIGNATURE_DEF and wire == 2:
            key, sig = _map_entry(value)
            signatures[key] = _signature(key, sig)
        elif number == _MG_OBJECT_GRAPH_DEF and wire == 2:
            variables = _variables(value)
    return SavedModelInfo(signatures=signatures, variables=variables)


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
