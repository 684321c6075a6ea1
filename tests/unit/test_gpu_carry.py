"""``bench/gpu_carry.py``: the fatbin walk and the thinning that let TensorFlow travel to a lent GPU machine, on a
small ELF file built here with the layout of TensorFlow's libraries (a ``.nv_fatbin`` section of fatbins, each of
entries: a cubin per architecture and PTX)."""

from __future__ import annotations

import struct

from bench.gpu_carry import CUBIN, MAGIC, PTX, listing, thin

ENTRY_HEADER = 64


def fatbin(items: list[tuple[int, int, bytes]]) -> bytes:
    """A fatbin of ``(kind, sm, payload)`` entries."""
    body = b""
    for kind, sm, payload in items:
        header = bytearray(ENTRY_HEADER)
        struct.pack_into("<HHII", header, 0, kind, 0x101, ENTRY_HEADER, len(payload))
        struct.pack_into("<I", header, 28, sm)
        body += bytes(header) + payload
    return struct.pack("<IHHQ", MAGIC, 1, 16, len(body)) + body


def elf(sections: dict[str, bytes]) -> bytes:
    """An ELF64 file with ``sections`` (and the section-name table), laid out one after another."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in [*sections, ".shstrtab"])
    data, offsets = bytearray(64), []
    for payload in [*sections.values(), names]:
        offsets.append((len(data), len(payload)))
        data += payload + bytes(-len(payload) % 8)
    shoff = len(data)
    headers = [bytes(64)]
    for i, name in enumerate([*sections, ".shstrtab"]):
        header = bytearray(64)
        struct.pack_into("<I", header, 0, names.index(b"\0" + name.encode() + b"\0") + 1)
        struct.pack_into("<QQ", header, 0x18, *offsets[i])
        headers.append(bytes(header))
    data += b"".join(headers)
    data[:4], data[4] = b"\x7fELF", 2
    struct.pack_into("<Q", data, 0x28, shoff)
    struct.pack_into("<HHH", data, 0x3A, 64, len(headers), len(headers) - 1)
    return bytes(data)


def test_thin_keeps_the_cubins_of_one_architecture_and_zeroes_the_rest_in_place(tmp_path):
    one = fatbin([(CUBIN, 80, b"\x11" * 48), (CUBIN, 90, b"\x22" * 32), (PTX, 90, b"\x33" * 16)])
    two = fatbin([(CUBIN, 90, b"\x44" * 24), (CUBIN, 60, b"\x55" * 40)])
    section = one + bytes(-len(one) % 8) + two      # fatbins are 8-byte aligned, padding between
    lib = tmp_path / "libtest.so"
    lib.write_bytes(elf({".text": b"\x90" * 24, ".nv_fatbin": section}))
    before = lib.read_bytes()
    sizes = {"cubin sm_80": 48, "cubin sm_90": 56, "ptx compute_90": 16, "cubin sm_60": 40}
    assert listing(lib) == sizes

    assert thin(lib, 90) == {"kept": 56, "zeroed": 104}
    after = lib.read_bytes()
    assert len(after) == len(before)                      # every offset stays where it was
    assert b"\x22" * 32 in after and b"\x44" * 24 in after
    for gone in (b"\x11", b"\x33", b"\x55"):
        assert gone * 8 not in after
    assert after.count(b"\x90" * 24) == 1                 # other sections untouched
    assert listing(lib) == sizes                          # the headers are kept: the driver still walks them


def test_a_library_without_cuda_kernels_is_left_alone(tmp_path):
    lib = tmp_path / "libplain.so"
    lib.write_bytes(elf({".text": b"\x90" * 16}))
    before = lib.read_bytes()
    assert thin(lib, 90) == {}
    assert lib.read_bytes() == before
