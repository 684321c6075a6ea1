"""``.npz`` files read safely: every member's ``.npy`` header is checked before any data is inflated.

An ``.npz`` is a zip archive of ``.npy`` members. A hostile one can declare a dtype with a huge
itemsize (``|V1073741824``), a shape of billions of elements, thousands of members, or a small
header over a deflate stream that inflates to gigabytes. ``read_headers`` reads the zip end record,
the central directory and the first bytes of each member only (at most ``MAX_HEADER_BYTES`` inflated
per member); ``check_limits`` refuses what is over the byte or element limit (bytes are
``itemsize * prod(shape)``); ``read_arrays`` then inflates each member into an array allocated from
its header, never reading more than the declared size. Only bool and numeric dtypes are accepted.
Used by the API (``.npz`` bodies, ``inputs_uri``) and by the worker (``load_inputs``).
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from contracts.jobspec import MAX_INPUTS, MAX_RANK

MAX_MEMBERS = MAX_INPUTS
MAX_DIRECTORY_BYTES = 1 << 20
MAX_HEADER_BYTES = 16384
READ_CHUNK_BYTES = 1 << 20
NUMERIC_KINDS = "biufc"
_MAGIC = b"\x93NUMPY"
_END_RECORD = b"PK\x05\x06"
_END_RECORD_BYTES = 22
_MAX_COMMENT_BYTES = 65535


class NpzError(ValueError):
    """The bytes are not a readable ``.npz``; the message says what is wrong, naming the member."""


class NpzTooLarge(NpzError):
    """The members' headers declare more bytes or elements than the limits allow."""


class NpzDtypeRefused(NpzError):
    """A member's dtype is not bool or numeric (void, string, object, datetime, structured)."""

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class Member:
    """One ``.npy`` member as its header declares it; ``name`` drops the ``.npy`` suffix (as ``np.load``)."""

    name: str
    info: zipfile.ZipInfo
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    fortran_order: bool
    data_offset: int  # bytes of magic and header before the data, in the inflated member

    @property
    def size(self) -> int:
        """Elements, ``prod(shape)``."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the data: ``itemsize * prod(shape)``."""
        return self.dtype.itemsize * self.size


def open_zip(source: bytes | IO[bytes]) -> zipfile.ZipFile:
    """A ``ZipFile`` over ``source`` once its end record promises at most ``MAX_MEMBERS`` members and a
    central directory of at most ``MAX_DIRECTORY_BYTES`` (``zipfile`` would read and parse all of it)."""
    fp = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
    fp.seek(0, io.SEEK_END)
    size = fp.tell()
    tail_bytes = min(size, _END_RECORD_BYTES + _MAX_COMMENT_BYTES)
    fp.seek(size - tail_bytes)
    tail = fp.read(tail_bytes)
    at = tail.rfind(_END_RECORD)
    if at < 0 or len(tail) - at < _END_RECORD_BYTES:
        raise NpzError("not a zip archive (no end of central directory record)")
    entries, directory_bytes = struct.unpack("<HI", tail[at + 10:at + 16])
    if entries > MAX_MEMBERS:
        raise NpzError(f"{entries} members, more than {MAX_MEMBERS}; send one array per model input")
    if directory_bytes > MAX_DIRECTORY_BYTES:
        raise NpzError(f"central directory of {directory_bytes} bytes, more than {MAX_DIRECTORY_BYTES}")
    fp.seek(0)
    try:
        return zipfile.ZipFile(fp)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, struct.error) as exc:
        raise NpzError(f"not a readable zip archive ({exc})") from None


def _read_exactly(f: IO[bytes], n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise NpzError(f"{what}: ends after {len(data)} of {n} bytes")
    return data


def _header(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> Member:
    """The member's ``.npy`` header, inflating at most ``MAX_HEADER_BYTES`` of it."""
    label = f"member {info.filename!r}"
    if info.flag_bits & 0x1:
        raise NpzError(f"{label} is encrypted")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise NpzError(f"{label} uses compression method {info.compress_type}; write it with numpy.savez "
                       "or numpy.savez_compressed")
    with zf.open(info) as f:
        magic = _read_exactly(f, len(_MAGIC) + 2, label)
        if magic[:len(_MAGIC)] != _MAGIC:
            raise NpzError(f"{label} is not an .npy array")
        version = (magic[-2], magic[-1])
        if version not in ((1, 0), (2, 0)):
            raise NpzError(f"{label}: .npy format version {version} is not supported; use 1.0 or 2.0")
        length_format = "<H" if version == (1, 0) else "<I"
        length_bytes = _read_exactly(f, struct.calcsize(length_format), label)
        (header_bytes,) = struct.unpack(length_format, length_bytes)
        if header_bytes > MAX_HEADER_BYTES:
            raise NpzError(f"{label}: .npy header of {header_bytes} bytes, more than {MAX_HEADER_BYTES}")
        text = _read_exactly(f, header_bytes, label)
    parse = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    try:
        shape, fortran_order, dtype = parse(io.BytesIO(length_bytes + text), max_header_size=MAX_HEADER_BYTES)
    except Exception as exc:  # noqa: BLE001 - numpy's parser raises many kinds (tokenize.TokenError too)
        raise NpzError(f"{label}: unreadable .npy header ({str(exc)[:200]})") from None
    name = info.filename.removesuffix(".npy")
    if dtype.kind == "V" and dtype.itemsize == 2 and dtype.fields is None:
        raise NpzDtypeRefused(f"dtype {dtype.str!r} is 2 bytes without a type, what numpy writes for a bfloat16 "
                              "array (ml_dtypes), which an .npz cannot name; send bfloat16 inputs as float32 "
                              "(the worker rounds them to bfloat16)", name=name)
    if dtype.kind not in NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise NpzDtypeRefused(f"dtype {dtype.str!r} is not a number or boolean type; send bool, int, uint or "
                              "float arrays", name=name)
    if len(shape) > MAX_RANK or any(d < 0 for d in shape):
        raise NpzError(f"{label}: shape {list(shape)} is not valid (at most {MAX_RANK} dimensions, none negative)")
    return Member(name=name, info=info, shape=tuple(shape), dtype=dtype, fortran_order=fortran_order,
                  data_offset=len(magic) + len(length_bytes) + header_bytes)


def read_headers(zf: zipfile.ZipFile) -> list[Member]:
    """Every member's header, in archive order; raises ``NpzError`` (``NpzDtypeRefused`` for a dtype)."""
    members: list[Member] = []
    seen: set[str] = set()
    try:
        for info in zf.infolist():
            if info.is_dir():
                continue
            member = _header(zf, info)
            if member.name in seen:
                raise NpzError(f"member {info.filename!r} appears twice")
            seen.add(member.name)
            members.append(member)
    except NpzError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error, RuntimeError) as exc:
        raise NpzError(f"not a readable zip archive ({exc})") from None
    return members


def check_limits(members: list[Member], *, max_bytes: int, max_elements: int) -> None:
    """Refuse (``NpzTooLarge``) members whose declared data, all together, passes either limit."""
    elements = sum(m.size for m in members)
    nbytes = sum(m.nbytes for m in members)
    if elements > max_elements:
        raise NpzTooLarge(f"{elements} elements in total, over the limit of {max_elements} "
                          "(JACOBIAN_MAX_INPUT_ELEMENTS)")
    if nbytes > max_bytes:
        raise NpzTooLarge(f"{nbytes} bytes of data in total, over the limit of {max_bytes} "
                          "(JACOBIAN_MAX_INPUT_BYTES)")


def read_array(zf: zipfile.ZipFile, member: Member) -> np.ndarray:
    """The member's data as declared by its header, inflated in chunks into one preallocated array."""
    label = f"member {member.info.filename!r}"
    if member.info.file_size < member.data_offset + member.nbytes:
        raise NpzError(f"{label}: holds {member.info.file_size} bytes, fewer than its header declares "
                       f"({member.data_offset + member.nbytes})")
    flat = np.empty(member.size, dtype=member.dtype)
    view = memoryview(flat.view(np.uint8)) if member.nbytes else memoryview(b"")
    with zf.open(member.info) as f:
        _read_exactly(f, member.data_offset, label)
        done = 0
        while done < member.nbytes:
            chunk = f.read(min(READ_CHUNK_BYTES, member.nbytes - done))
            if not chunk:
                raise NpzError(f"{label}: data ends after {done} of {member.nbytes} bytes")
            view[done:done + len(chunk)] = chunk
            done += len(chunk)
    if member.fortran_order:
        return flat.reshape(member.shape[::-1]).transpose()
    return flat.reshape(member.shape)


def read_arrays(zf: zipfile.ZipFile, members: list[Member]) -> dict[str, np.ndarray]:
    """``{name: array}`` of ``members`` (checked with ``check_limits`` first); raises ``NpzError``."""
    try:
        return {m.name: read_array(zf, m) for m in members}
    except NpzError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error, RuntimeError) as exc:
        raise NpzError(f"not a readable zip archive ({exc})") from None


def load(source: bytes | IO[bytes], *, max_bytes: int, max_elements: int) -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` in ``source`` by name: headers, then limits, then data."""
    with open_zip(source) as zf:
        members = read_headers(zf)
        check_limits(members, max_bytes=max_bytes, max_elements=max_elements)
        return read_arrays(zf, members)


def update_digest(digest: Any, arrays: Any) -> None:
    """Feed named arrays to a ``hashlib`` digest, by name order: each one's name, dtype and shape, then its bytes
    (the request's fingerprint at POST, the precision guard's kept rows' key)."""
    import json

    for name in sorted(arrays):
        arr = np.ascontiguousarray(arrays[name])
        digest.update(json.dumps([name, arr.dtype.str, list(arr.shape)]).encode())
        digest.update(arr.tobytes())
