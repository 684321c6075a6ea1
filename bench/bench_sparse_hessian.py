"""Sparse Hessians (issue 27), whole processes: ``jacobian compute --kind hessian --sparsity auto`` on a partially
separable function of 10^5 variables, ``f = sum_i (x_i^2 x_{i+1} + sin x_i)`` (a tf.Module SavedModel; H is
tridiagonal: 3 star colours), against our dense Hessian route (``jacobian compute --kind hessian``), which cannot
hold 10^5 x 10^5 (40 GB of float32): it runs on 10^4 variables (400 MB) and its rows' compute time is extrapolated
by n^2 (n HVPs of cost n each; the process start is not scaled, and writing 40 GB is not counted: a lower bound).
At 10^4 the sparse and the dense results are compared entry by entry.

Each process's wall time and peak RSS come from ``os.wait4`` (``bench.bench_sparse.timed_process``). Usage::

    python -m bench.bench_sparse_hessian --out bench/results
    python -m bench.bench_sparse_hessian --sizes 100000 --skip-dense
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_sparse import block_difference, timed_process
from bench.common import emit, machine


def build(root: Path, n: int) -> tuple[Path, Path]:
    from tests.sparse_hessian_models import separable

    model = separable(root / f"sep{n}", n=n)
    inputs = root / f"x{n}.npz"
    np.savez(inputs, x=np.random.default_rng(n).uniform(0.5, 1.5, n).astype("float32"))
    return model, inputs


def compare(sparse_uri: str, dense_uri: str, n: int) -> dict[str, Any]:
    """Largest difference between the COO Hessian and the dense one (row blocks), relative to the dense one's
    largest magnitude, and the dense non-zeros outside the sparse entries."""
    import zarr

    group = zarr.open_group(sparse_uri, mode="r")
    indptr = group["indptr"][...]
    dense = zarr.open_group(dense_uri, mode="r")["jacobian"]
    worst, scale, outside, step = 0.0, 0.0, 0, max(1, (64 << 20) // (4 * n))
    for a in range(0, n, step):
        b = min(n, a + step)
        diff, top, missed = block_difference(group, indptr, a, np.asarray(dense[a:b]).reshape(b - a, n))
        worst, scale, outside = max(worst, diff), max(scale, top), outside + missed
    return {"max_abs_diff": f"{worst:.3g}", "relative": f"{worst / (scale or 1):.3g}",
            "dense_nonzeros_outside_pattern": outside}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000", help="the sparse runs' n (comma-separated)")
    parser.add_argument("--dense-size", type=int, default=10000, help="the dense route's n (extrapolated by n^2)")
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    print(machine(), flush=True)
    jacobian = str(Path(sys.executable).with_name("jacobian"))
    rows: list[dict[str, Any]] = []
    sparse_s: dict[int, float] = {}
    uris: dict[int, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        def base(n: int, job: str) -> list[str]:
            model, inputs = build(root, n) if not (root / f"sep{n}").exists() else (root / f"sep{n}",
                                                                                       root / f"x{n}.npz")
            return [jacobian, "compute", "--model", str(model), "--input", str(inputs), "--out", str(root / "res"),
                    "--kind", "hessian", "--of", "f", "--wrt", "x", "--job-id", job]

        for n in (int(s) for s in args.sizes.split(",")):
            env = {**os.environ, "JACOBIAN_CACHE_DIR": str(root / f"cache{n}")}
            for label in ("cold", "warm"):
                result = timed_process(base(n, f"s{n}{label}") + ["--sparsity", "auto"], env)
                rows.append({"what": f"sparse hessian n={n}, {label}", **result})
                print(rows[-1], flush=True)
            sparse_s[n] = rows[-2]["s"]
            uris[n] = rows[-2]["uri"]
        if not args.skip_dense:
            n = args.dense_size
            env = {**os.environ, "JACOBIAN_CACHE_DIR": str(root / f"dense_cache{n}")}
            dense = timed_process(base(n, f"d{n}"), env)
            rows.append({"what": f"dense hessian n={n}, cold", **dense})
            print(rows[-1], flush=True)
            if n in uris:
                rows.append({"what": f"n={n}: sparse vs dense entries", **compare(uris[n], dense["uri"], n)})
                rows.append({"what": f"n={n}: dense / sparse (cold, whole processes)",
                             "ratio": round(dense["s"] / sparse_s[n], 1)})
            found = re.search(r"rows in ([0-9.]+) s", dense["note"])
            compute_s = float(found.group(1)) if found else dense["s"]
            for big in (m for m in sparse_s if m > n):
                # only the rows' compute grows as n^2 (n HVPs of cost n); the process start does not: a lower bound
                guess = dense["s"] - compute_s + compute_s * (big / n) ** 2
                rows.append({"what": f"n={big}: dense extrapolated from n={n} (its rows' compute by n^2)",
                             "dense_s_estimate": round(guess), "dense_GB": round(big * big * 4 / 1e9, 1),
                             "sparse_s": sparse_s[big], "ratio": round(guess / sparse_s[big], 1), "goal": ">= 10"})
            for r in rows[-3:]:
                print(r, flush=True)
    emit("sparse_hessian", rows, args.out)


if __name__ == "__main__":
    main()
