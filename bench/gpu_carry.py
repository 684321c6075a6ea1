"""TensorFlow for a lent GPU machine that reaches no package index and takes 64 MiB a call.

TensorFlow 2.21's wheel for Python 3.12 is 546 MiB (1.8 GiB unpacked) and its CUDA 12 libraries 2.7 GiB more;
``bench/gpu_tf_checks.sh`` runs it there anyway:

1. Download the TensorFlow wheel, the CUDA 12 runtime (3.5 MB) and the pure-Python or small wheels that machine
   lacks, all for cp312 (``pip download --no-deps``).
2. Unpack TensorFlow without ``include/`` (headers); strip every shared object's symbol tables
   (``strip --strip-all``: the dynamic symbols stay); replace the profiler plugin (90 MB, imported by
   ``tf.profiler`` only for its client) by an empty module.
3. Thin the CUDA kernels: a TensorFlow library's ``.nv_fatbin`` section holds, for each compiled unit, a cubin per
   architecture (sm_60, sm_70, sm_80, sm_89, sm_90) and PTX for compute_90. The driver loads the cubin of the
   device's architecture, so for an H100 or H200 (sm_90) the other entries' payloads are zeroed in place: the
   file keeps its layout and every offset, and the zeros compress to nothing (``thin``).
4. ``tar | xz -6``: 155 MiB, split into parts of 55 MiB, one per call (``.gpucarry/p1`` ...), the wheels
   (36 MB) in ``.gpucarry/whl`` for the call that runs.

The CUDA libraries are the machine's own (CUDA 13, from PyTorch's wheels), opened under the names TensorFlow asks
for (``gpu_tf_checks.sh`` links ``libcublas.so.12`` to ``libcublas.so.13`` and so on): TensorFlow finds each
function by name when it first calls it.

Run (here, with network): python -m bench.gpu_carry [--sm 90] [--work /tmp/gpu-carry] [--dest .gpucarry]
List a library's kernels: python -m bench.gpu_carry --list PATH
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import shutil
import struct
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

MAGIC = 0xBA55ED50  # a fatbin's header
PTX, CUBIN = 1, 2
PART_BYTES = 55 << 20
PY = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:", "--no-deps",
      *[arg for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                      "manylinux2014_x86_64") for arg in ("--platform", p)]]
# What the machine's Python (PyTorch's image) lacks or has in another version, at uv.lock's versions.
WHEELS = ["tensorflow==2.21.0", "nvidia-cuda-runtime-cu12==12.9.79", "numpy==2.4.6", "keras==3.15.1",
          "namex==0.1.0", "optree==0.20.0", "ml-dtypes==0.6.0", "protobuf==7.36.2", "gast==0.7.0",
          "astunparse==1.6.3", "google-pasta==0.2.0", "termcolor==3.3.0", "pydantic==2.14.3",
          "pydantic-core==2.50.4", "annotated-types==0.8.0", "typing-inspection==0.4.5", "pydantic-settings==2.16.3",
          "python-dotenv==1.2.4", "zarr==3.1.6", "numcodecs==0.16.6", "donfig==0.8.1.post1", "google-crc32c==1.9.0",
          "redis==8.1.0", "rq==3.0.0", "croniter==7.0.0"]


def section(data: bytes | bytearray, name: str) -> tuple[int, int]:
    """(offset, size) of the ELF64 section ``name``; KeyError when there is none."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise KeyError(name)
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    names = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)[0]
    for i in range(shnum):
        base = shoff + i * shentsize
        start = names + struct.unpack_from("<I", data, base)[0]
        if bytes(data[start:data.index(b"\0", start)]) == name.encode():
            return struct.unpack_from("<QQ", data, base + 0x18)
    raise KeyError(name)


def entries(data: bytes | bytearray, off: int, size: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(entry offset, kind, sm, header size, payload size) of every entry of every fatbin in [off, off + size).
    A fatbin: magic, version (u16), header size (u16), size of its entries (u64); an entry: kind (u16: 1 PTX,
    2 cubin), version (u16), header size (u32), padded payload size (u32, then 4 bytes), ..., sm (u32 at 28)."""
    pos, end = off, off + size
    while pos + 16 <= end:
        magic, _, header, fat = struct.unpack_from("<IHHQ", data, pos)
        if magic != MAGIC:
            pos += 8  # fatbins are 8-byte aligned; padding between them
            continue
        entry, stop = pos + header, pos + header + fat
        while entry < stop:
            kind, _, ehs, padded = struct.unpack_from("<HHII", data, entry)
            sm, = struct.unpack_from("<I", data, entry + 28)
            yield entry, kind, sm, ehs, padded
            entry += ehs + padded
        pos = stop


def thin(path: Path, keep_sm: int) -> dict[str, int]:
    """Zero, in place, every fatbin payload of ``path`` but the cubins for ``keep_sm``: {"kept": bytes,
    "zeroed": bytes}; {} for a file without CUDA kernels."""
    data = bytearray(path.read_bytes())
    try:
        off, size = section(data, ".nv_fatbin")
    except KeyError:
        return {}
    kept = zeroed = 0
    for entry, kind, sm, ehs, padded in entries(data, off, size):
        if kind == CUBIN and sm == keep_sm:
            kept += padded
        else:
            data[entry + ehs:entry + ehs + padded] = bytes(padded)
            zeroed += padded
    path.write_bytes(data)
    return {"kept": kept, "zeroed": zeroed}


def listing(path: Path) -> dict[str, int]:
    """Bytes of kernels per kind and architecture ("cubin sm_90", "ptx compute_90")."""
    data = path.read_bytes()
    off, size = section(data, ".nv_fatbin")
    out: dict[str, int] = collections.Counter()
    for _, kind, sm, _, padded in entries(data, off, size):
        out[f"cubin sm_{sm}" if kind == CUBIN else f"ptx compute_{sm}"] += padded
    return dict(out)


def prepare(work: Path, dest: Path, keep_sm: int) -> None:
    wheels = work / "wheels"
    # The project's uv environment has no pip: any Python with pip downloads for another platform alike.
    pip = [sys.executable, "-m", "pip"] if importlib.util.find_spec("pip") else [shutil.which("python3") or "python3",
                                                                                 "-m", "pip"]
    subprocess.run([*pip, "download", "-q", *PY, "-d", str(wheels), *WHEELS], check=True)
    stage = work / "stage"
    shutil.rmtree(stage, ignore_errors=True)
    with zipfile.ZipFile(next(wheels.glob("tensorflow-*.whl"))) as whl:
        whl.extractall(stage, [n for n in whl.namelist() if not n.startswith("tensorflow/include/")])
    plugin = stage / "tensorflow/python/profiler/internal/_pywrap_profiler_plugin.so"
    plugin.unlink()
    plugin.with_suffix(".py").write_text('"""Left out of the GPU carry: only the profiler client imports it."""\n')
    for lib in stage.rglob("*.so*"):
        subprocess.run(["strip", "--strip-all", str(lib)], check=False, capture_output=True)
        figures = thin(lib, keep_sm)
        if figures:
            print(f"{lib.relative_to(stage)}: kept {figures['kept'] >> 20} MiB, zeroed {figures['zeroed'] >> 20} MiB")
    archive = work / "tf.tar.xz"
    subprocess.run(f"tar cf - -C {stage} . | xz -6 -T0 > {archive}", shell=True, check=True)
    shutil.rmtree(dest, ignore_errors=True)
    blob = archive.read_bytes()
    for i in range(0, len(blob), PART_BYTES):
        part = dest / f"p{i // PART_BYTES + 1}"
        part.mkdir(parents=True)
        (part / f"tfpart.{i // PART_BYTES}").write_bytes(blob[i:i + PART_BYTES])
    (dest / "whl").mkdir()
    for whl in wheels.glob("*.whl"):
        if not whl.name.startswith("tensorflow-"):
            shutil.copy(whl, dest / "whl")
    print(f"{archive.stat().st_size >> 20} MiB in {len(list(dest.glob('p*')))} parts under {dest}; wheels in "
          f"{dest / 'whl'}. Carry each part in a call of its own: see bench/gpu_tf_checks.sh")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sm", type=int, default=90, help="the GPU's architecture: 90 for the H100 and the H200")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-carry"))
    ap.add_argument("--dest", type=Path, default=Path(".gpucarry"))
    ap.add_argument("--list", type=Path, default=None, metavar="LIB")
    args = ap.parse_args()
    if args.list:
        for what, size in sorted(listing(args.list).items()):
            print(f"{what}: {size / 1e6:.1f} MB")
        return
    prepare(args.work, args.dest, args.sm)


if __name__ == "__main__":
    main()
