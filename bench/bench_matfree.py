"""Matrix-free kinds (issue 14): spectra of matrices that are never formed.

1. The top 5 Hessian eigenvalues (Lanczos on HVPs) and the trace (Hutch++, and Hutchinson for
   comparison) of a classification loss (mean softmax cross-entropy with fixed labels, a batch of
   random images) over every trainable variable of an MLP 784-128-128-10 (118,282 parameters: its
   dense Hessian would have 1.4e10 entries, 56 GB in float32): time, HVP count, residuals.
2. The 10 largest singular values of MobileNetV3Small's Jacobian, 1000 logits w.r.t. one
   224x224x3 image (``weights=None``), matrix-free (randomized subspace iteration on batched JVPs and
   VJPs) against the dense route in the same run: ``tape.jacobian`` (the while_loop: with pfor,
   TensorFlow 2.21 fails on this model) then ``numpy.linalg.svd`` of the 1000 x 150528 matrix.
   The dense route runs first, on TensorFlow as shipped.

Run: .venv/bin/python -m bench.bench_matfree [--tol 1e-4] [--skip-mobilenet] [--out bench/results]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import emit, machine


def _round(values, digits=6):
    return [float(f"{float(v):.{digits}g}") for v in np.asarray(values).ravel()]


def hessian_rows(root: Path, *, batch: int, rank: int, samples: int, tol: float) -> list[dict]:
    from tests import models
    from worker.engine import load_model
    from worker.engine.matfree import build_operator
    from worker.engine.spectra import hessian_eig, hessian_trace

    path = models.softmax_mlp(root / "mlp784", sizes=(784, 128, 128, 10))
    model = load_model(str(path))
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((batch, 784)).astype("float32"),
              "labels": rng.integers(0, 10, batch).astype("int32")}
    op = build_operator(model, inputs, of="loss", wrt="variables/*", kind="hessian_eig")
    rows = [{"model": "MLP 784-128-128-10, loss over variables/*", "parameters": op.n_wrt, "batch": batch,
             "dense_hessian_entries": f"{float(op.n_wrt) ** 2:.3g}"}]
    print(rows[-1], flush=True)
    for label in ("first run (traces)", "again (traced)"):
        t0 = time.perf_counter()
        eig = hessian_eig(op, rank, tol=tol)
        seconds = time.perf_counter() - t0
        rows.append({"what": f"hessian_eig rank {rank}, tol {tol}, {label}", "s": round(seconds, 2),
                     "hvps": eig.products["hvp"], "checks": eig.products["checks"], "iterations": eig.iterations,
                     "converged": eig.converged, "eigenvalues": _round(eig.arrays["eigenvalues"]),
                     "residuals": _round(eig.residuals, 3),
                     "relative_residuals": _round(eig.residuals / np.abs(eig.arrays["eigenvalues"]), 3),
                     "route": op.labels.get("hvp")})
        print(rows[-1], flush=True)
    for method in ("auto", "hutch++", "hutchinson"):
        t0 = time.perf_counter()
        trace = hessian_trace(op, samples, method=method, seed=1)
        rows.append({"what": f"hessian_trace {method}, {samples} samples", "s": round(time.perf_counter() - t0, 2),
                     "hvps": trace.products["hvp"], "method": trace.method,
                     "trace": round(float(trace.arrays["trace"]), 5),
                     "stderr": round(float(trace.arrays["stderr"]), 5)})
        print(rows[-1], flush=True)
    return rows


def mobilenet_rows(root: Path, *, rank: int, tol: float) -> list[dict]:
    import tensorflow as tf

    from tests import models
    from worker.engine import load_model
    from worker.engine.matfree import build_operator
    from worker.engine.spectra import svd

    path = models.mobilenet_v3_small(root / "mobilenet")
    model = load_model(str(path))
    image = np.random.default_rng(0).standard_normal((1, 224, 224, 3)).astype("float32")
    x = tf.constant(image)
    rows: list[dict] = []

    t0 = time.perf_counter()
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = model.fn(image=x)["logits"]
    jac = tape.jacobian(y, x, parallel_iterations=64, experimental_use_pfor=False).numpy().reshape(1000, -1)
    t_jac = time.perf_counter() - t0
    del tape
    t0 = time.perf_counter()
    u_ref, s_ref, vt_ref = np.linalg.svd(jac, full_matrices=False)
    t_svd = time.perf_counter() - t0
    rows.append({"what": "dense: tape.jacobian (while_loop) + numpy svd", "s": round(t_jac + t_svd, 1),
                 "jacobian_s": round(t_jac, 1), "svd_s": round(t_svd, 1), "vjps": 1000,
                 "matrix_MB": round(jac.nbytes / 2**20), "S": _round(s_ref[:rank])})
    print(rows[-1], flush=True)
    del jac

    op = build_operator(model, {"image": image}, of="logits", wrt="image")
    for label in ("first run (traces, checks)", "again (traced)"):
        t0 = time.perf_counter()
        result = svd(op, rank, tol=tol)
        seconds = time.perf_counter() - t0
        s = result.arrays["S"].astype(np.float64)
        cos_v = np.abs(np.sum(result.arrays["V"].reshape(rank, -1) * vt_ref[:rank], axis=1))
        rows.append({"what": f"matrix-free svd rank {rank}, tol {tol}, {label}", "s": round(seconds, 1),
                     "jvps": result.products["jvp"], "vjps": result.products["vjp"],
                     "checks": result.products["checks"], "iterations": result.iterations,
                     "converged": result.converged, "routes": dict(op.labels),
                     "max_rel_error_S": f"{float(np.max(np.abs(s - s_ref[:rank]) / s_ref[:rank])):.2g}",
                     "min_abs_cos_V": round(float(cos_v.min()), 6),
                     "residuals": _round(result.residuals, 3), "S": _round(s)})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--samples", type=int, default=99)
    parser.add_argument("--skip-mobilenet", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    print(machine(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        emit("matfree_hessian", hessian_rows(root, batch=args.batch, rank=5, samples=args.samples, tol=args.tol),
             args.out)
        if not args.skip_mobilenet:
            emit("matfree_svd_mobilenet", mobilenet_rows(root, rank=10, tol=args.tol), args.out)


if __name__ == "__main__":
    main()
