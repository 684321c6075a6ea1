"""The other kinds on a GPU against the same job on the CPU, and a real out-of-memory on the GPU.

Each case runs ``jacobian compute`` twice as whole processes: once as it comes (on the GPU) and once with
``CUDA_VISIBLE_DEVICES=-1`` (the CPU), and compares the two results (largest difference over the largest entry):

- ``sparse``: a block-diagonal Jacobian (an MLP over 16 examples w.r.t. the whole batch), ``--sparsity auto``;
- ``svd``: a matrix-free top-4 singular values of the same Jacobian;
- ``hessian``: the dense Hessian of a classifier's loss w.r.t. its input;
- ``hessian_eig``: matrix-free top-3 eigenvalues of the loss's Hessian over every variable.

Then ``oom``: MobileNetV3Small (softmax head, ``bench_cold``'s) on the GPU alone, and again with ``--chunk-rows
512`` forced while another process (PyTorch, a plain ``cudaMalloc``) holds ``--hold`` of the free GPU memory: the
forced chunk runs out of memory for real, the engine halves it and goes on, and the rows equal the first run's.

Run: python -m bench.bench_gpu_kinds [--hold 0.97] [--skip-oom] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import max_error

REPO = Path(__file__).resolve().parents[1]


def compute(work: Path, model: Path, inputs: Path, args: list[str], job: str, *, cpu: bool) -> dict:
    """One ``jacobian compute`` process: its wall time, the result (dense numpy) and the manifest's plan."""
    from jacobian.results import coo_of, is_coo, main_array_of, open_node
    from tests.procs import base_env, jacobian_exe

    env = base_env(JACOBIAN_CACHE_DIR=str(work / ("cache-cpu" if cpu else "cache-gpu")))
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = "-1"
    t0 = time.perf_counter()
    p = subprocess.run([*jacobian_exe(), "compute", "--model", str(model), "--input", str(inputs), *args,
                        "--out", str(work / "out"), "--job-id", job], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        return {"rc": p.returncode, "wall_s": round(wall, 2), "err": p.stderr.strip().splitlines()[-4:]}
    node = open_node(p.stdout.strip().splitlines()[-1])  # the result URI the CLI prints
    if is_coo(node):  # a sparse result, made dense to compare
        result = coo_of(node).toarray().astype(np.float64)
    else:
        result = np.asarray(main_array_of(node)[...], np.float64)
    manifest = json.loads((work / "out" / job / "manifest.json").read_text())
    plan = manifest.get("plan") or {}
    return {"rc": 0, "wall_s": round(wall, 2), "result": result,
            "plan": {k: plan.get(k) for k in ("strategy", "chunk_rows", "oom_retries", "budget_halvings", "device",
                                              "free_bytes_at_start", "peak_bytes") if k in plan}}


def rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference over ``want``'s largest magnitude (``bench.common.max_error``)."""
    err, scale = max_error(got, want)
    return err / max(scale, 1e-30)


def kinds(work: Path) -> list[dict]:
    from tests import models

    mlp = models.mlp(work / "mlp", sizes=(32, 64, 8))
    np.savez(work / "mlp.npz", x=np.random.default_rng(0).standard_normal((16, 32)).astype("float32"))
    clf = models.softmax_mlp(work / "clf", sizes=(12, 16, 5))
    rng = np.random.default_rng(1)
    np.savez(work / "clf.npz", x=rng.standard_normal((6, 12)).astype("float32"),
             labels=rng.integers(0, 5, 6).astype("int32"))
    cases = [
        ("sparse", mlp, "mlp.npz", ["--of", "y", "--wrt", "x", "--sparsity", "auto"]),
        ("svd", mlp, "mlp.npz", ["--of", "y", "--wrt", "x", "--kind", "svd", "--rank", "4"]),
        ("hessian", clf, "clf.npz", ["--of", "loss", "--wrt", "x", "--kind", "hessian"]),
        ("hessian_eig", clf, "clf.npz", ["--of", "loss", "--wrt", "variables/*", "--kind", "hessian_eig",
                                         "--rank", "3"]),
    ]
    rows = []
    for name, model, inputs, args in cases:
        gpu = compute(work, model, work / inputs, args, f"{name}-gpu", cpu=False)
        cpu = compute(work, model, work / inputs, args, f"{name}-cpu", cpu=True)
        row = {"case": name, "gpu_s": gpu["wall_s"], "cpu_s": cpu["wall_s"], "gpu_plan": gpu.get("plan"),
               "cpu_plan": cpu.get("plan")}
        if gpu["rc"] or cpu["rc"]:
            row["failed"] = {"gpu": gpu.get("err"), "cpu": cpu.get("err")}
        else:
            row["shape"] = list(gpu["result"].shape)
            row["max_diff_over_max"] = rel_diff(gpu["result"], cpu["result"])
            row["within_1e-4"] = row["max_diff_over_max"] <= 1e-4
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def oom(work: Path, hold: float) -> list[dict]:
    from bench.bench_cold import build_model
    from bench.bench_gpu import other_tenant
    from bench.bench_gpu_nvml import HOG as TORCH_HOG  # a plain cudaMalloc of the share, through PyTorch

    mdir = work / "mnv3"
    mdir.mkdir()
    model, of, wrt = build_model("mobilenet_softmax", mdir)
    args = ["--of", of, "--wrt", wrt]
    alone = compute(work, model, mdir / "inputs.npz", args, "mnv3-alone", cpu=False)
    rows = [{"case": "mobilenet alone", "s": alone["wall_s"], "plan": alone.get("plan"), "err": alone.get("err")}]
    with other_tenant(hold, TORCH_HOG) as (held, free_after):
        forced = compute(work, model, mdir / "inputs.npz", [*args, "--chunk-rows", "512"], "mnv3-oom", cpu=False)
    row = {"case": f"mobilenet, --chunk-rows 512, another process holding {held / 2**30:.1f} GiB",
           "free_after_hold_GiB": round(free_after / 2**30, 2), "s": forced["wall_s"], "plan": forced.get("plan"),
           "err": forced.get("err")}
    if alone["rc"] == 0 and forced["rc"] == 0:
        row["max_diff_over_max"] = rel_diff(forced["result"], alone["result"])
    rows.append(row)
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold", type=float, default=0.97)
    ap.add_argument("--skip-oom", action="store_true")
    ap.add_argument("--skip-kinds", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-kinds-"))
    os.chdir(REPO)
    rows = [] if args.skip_kinds else kinds(work)
    if not args.skip_oom:
        rows += oom(work, args.hold)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_kinds.json").write_text(json.dumps(rows, indent=1, default=str))
    bad = [r for r in rows if r.get("failed") or r.get("err") or r.get("within_1e-4") is False]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
