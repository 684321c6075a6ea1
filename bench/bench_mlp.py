"""MLP 256-512-512-256, batch 64, per-example Jacobian: ours vs tape.batch_jacobian vs JAX.

Goals (issue 2): our time <= 0.25 of tape.batch_jacobian; <= 1.0x JAX jit(vmap(jacrev)).
Run: .venv/bin/python -m bench.bench_mlp [--repeats 10] [--out bench/results]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from bench.common import assert_same, emit, machine, median_seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import tensorflow as tf

    from tests import models
    from worker.engine import build_problem, compute_in_memory, load_model, run_problem

    path = models.mlp(Path(tempfile.mkdtemp()) / "mlp", sizes=(256, 512, 512, 256))
    model = load_model(str(path))
    x = np.random.default_rng(0).standard_normal((64, 256)).astype("float32")
    xt = tf.constant(x)

    # Ours: a whole call (validation + plan + compute) and the steady-state compute alone.
    ours, report = compute_in_memory(model, {"x": x}, kind="batch_jacobian")
    t_ours_call = median_seconds(lambda: compute_in_memory(model, {"x": x}, kind="batch_jacobian"),
                                 repeats=args.repeats)
    problem = build_problem(model, {"x": x}, kind="batch_jacobian")
    t_ours = median_seconds(lambda: run_problem(problem), repeats=args.repeats)

    def tape_eager():
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = model.fn(x=xt)["y"]
        return tape.batch_jacobian(y, xt)

    @tf.function
    def tape_fn(v):
        with tf.GradientTape() as tape:
            tape.watch(v)
            y = model.fn(x=v)["y"]
        return tape.batch_jacobian(y, v)

    ref = tape_fn(xt).numpy()
    assert_same(ours, ref, "ours vs tape.batch_jacobian")
    t_tape = median_seconds(lambda: tape_eager().numpy(), repeats=args.repeats)
    t_tape_fn = median_seconds(lambda: tape_fn(xt).numpy(), repeats=args.repeats)

    import jax
    import jax.numpy as jnp

    w = {v.name: v.numpy() for v in model.fn.variables}
    params = [(jnp.asarray(w[f"{n}/kernel:0"]), jnp.asarray(w[f"{n}/bias:0"])) for n in ("d0", "d1", "out")]

    def f(xi):
        h = xi
        for i, (k, b) in enumerate(params):
            h = h @ k + b
            if i < len(params) - 1:
                h = jnp.tanh(h)
        return h

    jac = jax.jit(jax.vmap(jax.jacrev(f)))
    xj = jnp.asarray(x)
    jref = np.asarray(jac(xj).block_until_ready())
    assert_same(ours, jref, "ours vs JAX")
    t_jax = median_seconds(lambda: jac(xj).block_until_ready(), repeats=args.repeats)

    rows = [
        {"method": "ours run_problem (steady state)", "ms": round(t_ours * 1e3, 1), "strategy": report.plan["strategy"],
         "chunk_rows": report.plan["chunk_rows"]},
        {"method": "ours compute_in_memory (validate+plan+run)", "ms": round(t_ours_call * 1e3, 1)},
        {"method": "tape.batch_jacobian (eager)", "ms": round(t_tape * 1e3, 1)},
        {"method": "tape.batch_jacobian (tf.function, warm)", "ms": round(t_tape_fn * 1e3, 1)},
        {"method": "jax jit(vmap(jacrev)) (warm)", "ms": round(t_jax * 1e3, 1)},
        {"ratio": "ours / tape.batch_jacobian eager", "value": round(t_ours / t_tape, 3), "goal": "<= 0.25"},
        {"ratio": "ours / tape.batch_jacobian tf.function", "value": round(t_ours / t_tape_fn, 3)},
        {"ratio": "ours / jax", "value": round(t_ours / t_jax, 3), "goal": "<= 1.0"},
        {"ratio": "ours (whole call) / jax", "value": round(t_ours_call / t_jax, 3)},
        {"trial_rows_per_second": report.plan["trial_rows_per_second"]},
    ]
    print(machine())
    emit("mlp_batch_jacobian", rows, args.out)


if __name__ == "__main__":
    main()
