"""Sparse Jacobians (issue 15), whole processes: ``jacobian compute --sparsity auto`` against our dense path
(``jacobian compute``) on a 3-layer 3x3 conv net 128x128x3 -> 128x128x3 (a 49152 x 49152 Jacobian, 0.3 %
non-zero), cold (fresh cache folder) and warm (the pattern cached), values compared entry by entry; then the
256x256x3 version (196608 x 196608, 155 GB if dense) sparse only, with its peak RSS.

Each process's wall time and peak RSS come from ``os.wait4``. Usage::

    python -m bench.bench_sparse --out bench/results            # both sizes, dense once
    python -m bench.bench_sparse --sizes 256 --skip-dense        # the large one only
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import emit, machine

CHANNELS = (16, 16, 3)


def timed_process(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    """One process: wall seconds, its own peak RSS (GiB, ``os.wait4``), stdout's last line (the result's URI)
    and stderr's ``done:``/``sparsity:`` lines."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({code}):\n{stderr[-3000:]}")
    done = [line for line in stderr.splitlines() if line.startswith(("done:", "sparsity:"))]
    return {"s": round(seconds, 1), "rss_GiB": round(usage.ru_maxrss / 2**20, 2),
            "uri": stdout.strip().splitlines()[-1], "note": " | ".join(done)[:400]}


def block_difference(group: Any, indptr: np.ndarray, a: int, block: np.ndarray) -> tuple[float, float, int]:
    """For the dense rows ``block`` starting at row ``a`` of a COO result group (``indptr``, ``cols``,
    ``values``): the largest difference of the sparse rows from them, their largest magnitude, and how many of
    their non-zeros are not entries of the sparse result."""
    import scipy.sparse as sp

    b = a + len(block)
    lo, hi = int(indptr[a]), int(indptr[b])
    rows = np.repeat(np.arange(b - a), np.diff(indptr[a:b + 1]))
    cols = group["cols"][lo:hi]
    ours = sp.csr_array((group["values"][lo:hi], (rows, cols)), shape=block.shape).toarray()
    mask = sp.csr_array((np.ones(hi - lo, bool), (rows, cols)), shape=block.shape).toarray()
    return float(np.abs(ours - block).max()), float(np.abs(block).max()), int(np.count_nonzero(block[~mask]))


def compare(sparse_uri: str, dense_uri: str) -> dict[str, Any]:
    """Largest difference between the sparse result and the dense one, row block by row block, relative to the
    dense one's largest magnitude; and whether every non-zero of the dense result is an entry of the sparse."""
    import zarr

    group = zarr.open_group(sparse_uri, mode="r")
    n_of, n_wrt = group.attrs["shape"]
    of_shape = tuple(group.attrs["of_shape"])
    indptr = group["indptr"][...]
    dense = zarr.open_group(dense_uri, mode="r")["jacobian"]
    axis = 0   # slabs along the leading of axes of at most 256 MiB each
    while axis < len(of_shape) - 1 and int(np.prod(of_shape[axis + 1:])) * n_wrt * 4 > (256 << 20):
        axis += 1
    slab_rows = int(np.prod(of_shape[axis + 1:]))
    worst, scale, outside = 0.0, 0.0, 0
    for index in np.ndindex(*of_shape[:axis + 1]):
        block = np.asarray(dense[index]).reshape(-1, n_wrt)
        a = int(np.ravel_multi_index(index, of_shape[:axis + 1])) * slab_rows
        diff, top, missed = block_difference(group, indptr, a, block)
        worst, scale, outside = max(worst, diff), max(scale, top), outside + missed
    return {"max_abs_diff": f"{worst:.3g}", "max_abs": f"{scale:.3g}", "relative": f"{worst / (scale or 1):.3g}",
            "dense_nonzeros_outside_pattern": outside}


def build(root: Path, size: int) -> tuple[Path, Path]:
    from tests.sparse_models import conv_net

    model = conv_net(root / f"conv{size}", size=size, channels=CHANNELS)
    inputs = root / f"x{size}.npz"
    np.savez(inputs, image=np.random.default_rng(size).standard_normal((1, size, size, 3)).astype("float32"))
    return model, inputs


def threshold_rows(root: Path, sizes: tuple[int, ...] = (8, 10, 12, 16, 20, 24, 32)) -> list[dict[str, Any]]:
    """Where the sparse path stops paying: conv nets (4, 4, 3 channels) whose pattern's density falls with the
    image size (147 / (3 size^2)), in-process and warm (each timed on its second run): the dense engine's
    whole Jacobian against the sparse path forced (pattern, colouring, products, verification, entries)."""
    from tests.sparse_models import conv_net
    from worker.engine import compute_in_memory, load_model
    from worker.engine.matfree import build_operator
    from worker.engine.sparsity import compressed
    from worker.engine.sparsity.colouring import choose_mode, colour
    from worker.engine.sparsity.walk import detect

    rows = []
    for size in sizes:
        model = load_model(str(conv_net(root / f"t{size}", size=size, channels=(4, 4, 3))))
        x = {"image": np.random.default_rng(size).standard_normal((1, size, size, 3)).astype("float32")}

        def sparse(model: Any = model, x: dict[str, Any] = x) -> int:
            pattern, _, _ = detect(model, x, of="out", wrt="image")
            pattern = compressed.sorted_pattern(pattern)
            c = colour(pattern, choose_mode(pattern))
            op = build_operator(model, x, of="out", wrt="image")
            products = compressed.compute(op, c)
            assert compressed.verify(op, pattern, c, products)[0]
            compressed.entries(pattern, c, products, 0, pattern.shape[0])
            return c.count

        timings = {}
        def dense(model: Any = model, x: dict[str, Any] = x) -> Any:
            return compute_in_memory(model, x, of="out", wrt="image")

        for name, fn in (("dense", dense), ("sparse", sparse)):
            fn()
            t0 = time.perf_counter()
            fn()
            timings[name] = time.perf_counter() - t0
        n = size * size * 3
        rows.append({"what": f"conv {size}x{size}x3, warm, in-process", "n": n,
                     "density": round(147 / n if n > 147 else 1.0, 3), "dense_s": round(timings["dense"], 3),
                     "sparse_s": round(timings["sparse"], 3),
                     "sparse/dense": round(timings["sparse"] / timings["dense"], 2)})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="128,256")
    parser.add_argument("--skip-dense", action="store_true", help="no dense run (the 128 comparison needs it)")
    parser.add_argument("--threshold", action="store_true", help="only the density at which sparse stops paying")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threshold:
        with tempfile.TemporaryDirectory() as tmp:
            emit("sparse_threshold", threshold_rows(Path(tmp)), args.out)
        return
    print(machine(), flush=True)
    jacobian = str(Path(sys.executable).with_name("jacobian"))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for size in (int(s) for s in args.sizes.split(",")):
            model, inputs = build(root, size)
            env = {**os.environ, "JACOBIAN_CACHE_DIR": str(root / f"cache{size}")}
            base = [jacobian, "compute", "--model", str(model), "--input", str(inputs), "--out", str(root / "res")]
            n = size * size * 3
            results = {}
            for label in ("cold", "warm"):
                results[label] = timed_process(base + ["--sparsity", "auto", "--job-id", f"s{size}{label}"], env)
                rows.append({"what": f"sparse {size}x{size}x3 ({n}^2), {label}", **results[label]})
                print(rows[-1], flush=True)
            if size <= 128 and not args.skip_dense:
                dense_env = {**os.environ, "JACOBIAN_CACHE_DIR": str(root / f"dense_cache{size}")}
                dense = timed_process(base + ["--job-id", f"d{size}"], dense_env)
                rows.append({"what": f"dense {size}x{size}x3 ({n}^2), cold", **dense})
                print(rows[-1], flush=True)
                same = compare(results["cold"]["uri"], dense["uri"])
                rows.append({"what": f"{size}: dense / sparse, whole processes",
                             "cold": round(dense["s"] / results["cold"]["s"], 1),
                             "warm (sparse pattern cached)": round(dense["s"] / results["warm"]["s"], 1),
                             "goal": ">= 5", **same})
                print(rows[-1], flush=True)
                import shutil

                shutil.rmtree(Path(dense["uri"]).parent, ignore_errors=True)
    emit("sparse", rows, args.out)


if __name__ == "__main__":
    main()
