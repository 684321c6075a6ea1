"""``contracts.npz``: every member's header is checked before its data is inflated, and data is read
up to the declared size only; hostile archives are refused with a message naming the member."""

from __future__ import annotations

import io
import struct
import tracemalloc
import zipfile

import numpy as np
import pytest

from contracts import npz

ZEROS = bytes(1 << 20)
LIMITS = {"max_bytes": 1 << 30, "max_elements": 1 << 28}


def npy_header(descr: str, shape: tuple[int, ...], *, fortran: bool = False) -> bytes:
    """A version 1.0 ``.npy`` header (magic included) for any descr and shape, however absurd."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": fortran, "shape": shape})
    return buf.getvalue()


def raw_header(text: bytes) -> bytes:
    """A version 1.0 ``.npy`` header around any text."""
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


def archive(members: dict[str, bytes | tuple[bytes, int]], *, method: int = zipfile.ZIP_DEFLATED) -> bytes:
    """A zip of ``name -> bytes`` or ``name -> (header, zero bytes after it)`` (deflated zeros: a bomb)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method, compresslevel=9 if method == zipfile.ZIP_DEFLATED else None) as zf:
        for name, content in members.items():
            with zf.open(name, "w", force_zip64=True) as f:
                if isinstance(content, bytes):
                    f.write(content)
                    continue
                header, zeros = content
                f.write(header)
                for start in range(0, zeros, len(ZEROS)):
                    f.write(ZEROS[:min(len(ZEROS), zeros - start)])
    return buf.getvalue()


def peak_bytes(fn, *args, **kwargs) -> tuple[object, int]:
    """``fn(...)``'s result (or the exception it raised) and the peak of memory allocated meanwhile."""
    tracemalloc.start()
    try:
        try:
            out: object = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - returned for the caller to check
            out = exc
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def savez(compressed: bool = False, **arrays) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


@pytest.mark.parametrize("compressed", [False, True])
def test_round_trip_equals_numpy(compressed):
    arrays = {"x": np.arange(24, dtype=np.float32).reshape(2, 3, 4), "ids": np.array([1, -2], np.int64),
              "mask": np.array([True, False]), "f": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
              "s": np.float64(3.5), "big_endian": np.arange(3, dtype=">f4"), "empty": np.zeros((0, 8), np.float32)}
    out = npz.load(savez(compressed, **arrays), **LIMITS)
    assert list(out) == list(arrays)
    for name, arr in arrays.items():
        assert out[name].dtype == arr.dtype and out[name].shape == np.shape(arr)
        np.testing.assert_array_equal(out[name], arr)


def test_reads_from_a_file(tmp_path):
    path = tmp_path / "in.npz"
    path.write_bytes(savez(x=np.ones((3, 2), np.float32)))
    with open(path, "rb") as f:
        assert npz.load(f, **LIMITS)["x"].tolist() == [[1, 1]] * 3


@pytest.mark.parametrize("descr", ["|V1073741824", "<U134217728", "|S1000000", "|O", "<M8[s]", "<m8[s]",
                                   [("a", "<f4"), ("b", "<i4")], ("<f4", (1000,))])
def test_non_numeric_dtype_refused_before_inflating(descr):
    """The issue's attack: a 1 GiB member with a huge-itemsize dtype, 1 MB compressed. The header
    alone refuses it; nothing near its size is ever allocated."""
    header = npy_header(np.lib.format.dtype_to_descr(np.dtype(descr)), (1,))
    body = archive({"x.npy": (header, 64 << 20)})
    assert len(body) < 200_000
    err, peak = peak_bytes(npz.load, body, **LIMITS)
    assert isinstance(err, npz.NpzDtypeRefused), err
    assert err.name == "x" and "is not a number or boolean type" in str(err)
    assert peak < 4 << 20, f"{peak} bytes allocated to read a header"


def test_declared_elements_over_the_limit_refused_before_inflating():
    body = archive({"x.npy": (npy_header("<f4", (16 << 20,)), 64 << 20)})
    err, peak = peak_bytes(npz.load, body, max_bytes=1 << 40, max_elements=1 << 20)
    assert isinstance(err, npz.NpzTooLarge) and "16777216 elements in total, over the limit of 1048576" in str(err)
    assert peak < 4 << 20


def test_declared_bytes_over_the_limit_refused_even_under_the_element_limit():
    body = archive({"x.npy": (npy_header("<f8", (1 << 20,)), 8 << 20), "y.npy": (npy_header("<f8", (1,)), 8)})
    err, peak = peak_bytes(npz.load, body, max_bytes=8 << 20, max_elements=1 << 30)
    assert isinstance(err, npz.NpzTooLarge) and "8388616 bytes of data in total, over the limit of 8388608" in str(err)
    assert peak < 4 << 20


def test_data_beyond_the_declared_size_is_never_inflated():
    """A small header over a deflate stream of 256 MiB: only the declared 16 bytes are read."""
    body = archive({"x.npy": (npy_header("<f4", (4,)), 256 << 20)})
    out, peak = peak_bytes(npz.load, body, **LIMITS)
    assert isinstance(out, dict) and out["x"].tolist() == [0.0] * 4
    assert peak < 4 << 20


def test_header_declaring_more_than_the_member_holds():
    body = archive({"x.npy": npy_header("<f4", (1000,)) + bytes(40)})
    with pytest.raises(npz.NpzError, match=r"member 'x.npy': holds \d+ bytes, fewer than its header declares"):
        npz.load(body, **LIMITS)


@pytest.mark.parametrize("shape,text", [((-1, 4), "none negative"), ((1,) * 33, "at most 32 dimensions")])
def test_invalid_shapes(shape, text):
    with pytest.raises(npz.NpzError, match=text):
        npz.load(archive({"x.npy": npy_header("<f4", shape)}), **LIMITS)


def test_too_many_members_refused_from_the_end_record():
    body = archive({f"a{i}.npy": npy_header("<f4", (0,)) for i in range(npz.MAX_MEMBERS + 1)},
                   method=zipfile.ZIP_STORED)
    with pytest.raises(npz.NpzError, match=f"{npz.MAX_MEMBERS + 1} members, more than {npz.MAX_MEMBERS}"):
        npz.load(body, **LIMITS)


def test_oversized_central_directory_refused():
    body = bytearray(savez(x=np.zeros(2, np.float32)))
    at = body.rfind(b"PK\x05\x06")
    body[at + 12:at + 16] = struct.pack("<I", npz.MAX_DIRECTORY_BYTES + 1)
    with pytest.raises(npz.NpzError, match="central directory of"):
        npz.load(bytes(body), **LIMITS)


def test_oversized_npy_header_refused():
    header = b"\x93NUMPY\x02\x00" + struct.pack("<I", npz.MAX_HEADER_BYTES + 1)
    with pytest.raises(npz.NpzError, match=".npy header of 16385 bytes"):
        npz.load(archive({"x.npy": (header, 1 << 20)}), **LIMITS)


def test_duplicate_member_refused():
    buf = io.BytesIO()
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("x.npy", npy_header("<f4", (0,)))
        zf.writestr("x.npy", npy_header("<f4", (0,)))
    with pytest.raises(npz.NpzError, match="appears twice"):
        npz.load(buf.getvalue(), **LIMITS)


@pytest.mark.parametrize("body,text", [
    (b"hello", "not a zip archive"),
    (b"", "not a zip archive"),
    (archive({"x.npy": b"not an array"}), "is not an .npy array"),
    (archive({"x.npy": b"\x93NUMPY\x03\x00"}), "format version"),
    (archive({"x.npy": raw_header(b"{'descr': (((((")}), "unreadable .npy header"),
    (archive({"x.npy": raw_header(b"{'shape': " + b"(" * 4990 + b")" * 4990 + b"}\n")}), "unreadable .npy header"),
    (archive({"x.npy": raw_header(b"{'descr': '<f4', 'fortran_order': False, 'shape': (" + b"9" * 5000 + b",)}")}),
     "unreadable .npy header"),
])
def test_unreadable(body, text):
    with pytest.raises(npz.NpzError, match=text):
        npz.load(body, **LIMITS)


def test_corrupt_data_refused():
    body = bytearray(savez(x=np.arange(1000, dtype=np.float32)))
    body[len(body) // 2] ^= 0xFF  # in the data: the CRC check fails at the end of the member
    with pytest.raises(npz.NpzError):
        npz.load(bytes(body), **LIMITS)
