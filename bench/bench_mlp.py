"""MLP 256-512-512-256, batch 64, per-example Jacobian: ours vs tape.batch_jacobian vs JAX.

Ours runs as a service runs repeated jobs: each job gets the plan the last one learnt, and a strategy
trial happens once the jobs' compute pays for it (worker.engine.tuning); the figures below are taken
once the plan is refined (every alternative tried or ruled out), with the number of jobs and seconds
that took. Goals (issue 10): our time <= 0.25 of tape.batch_jacobian (eager), <= 1.0x JAX
jit(vmap(jacrev)), in every one of ``--runs`` runs (each with a freshly loaded model and no plan).
Run: .venv/bin/python -m bench.bench_mlp [--runs 5] [--repeats 15] [--out bench/results]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import assert_same, emit, interleaved_medians, machine

MAX_JOBS = 2000


def compiled_batch_jacobian(model):
    """The compiled peer: ``tape.batch_jacobian`` of ``y`` w.r.t. ``x`` inside a ``tf.function``."""
    import tensorflow as tf

    @tf.function
    def tape_fn(v):
        with tf.GradientTape() as tape:
            tape.watch(v)
            y = model.fn(x=v)["y"]
        return tape.batch_jacobian(y, v)

    return tape_fn


SETTLED_JOBS = 5  # jobs in a row at one strategy and chunk size after refining: the plan a worker keeps running


def ours_until_refined(model, x) -> tuple[object, object, int, float]:
    """Repeated jobs, each with the last job's plan, until the plan is refined and its chunk has stopped growing
    (``SETTLED_JOBS`` jobs alike): (problem, plan, jobs, seconds). Stopping at refining measured a plan before
    its chunk grew (8 rows where a worker's later jobs run 64: docs/BENCHMARKS.md, "GPU: TensorFlow on an H100")."""
    from worker.engine import build_problem, run_problem

    problem = build_problem(model, {"x": x}, kind="batch_jacobian")
    plan, jobs, t0, alike, last = None, 0, time.perf_counter(), 0, None
    while jobs < MAX_JOBS:
        report = run_problem(problem, plan=plan)
        plan, jobs = report.learned, jobs + 1
        now = (report.plan["strategy"], report.plan["chunk_rows"])
        alike = alike + 1 if plan.refined and now == last else 0
        last = now
        if alike >= SETTLED_JOBS:
            break
    return problem, plan, jobs, time.perf_counter() - t0


def one_run(path: Path, x: np.ndarray, repeats: int, peers: dict) -> list[dict]:
    from worker.engine import compute_in_memory, load_model, run_problem

    model = load_model(str(path))
    problem, plan, jobs, t_refine = ours_until_refined(model, x)
    ours, report = compute_in_memory(model, {"x": x}, kind="batch_jacobian", plan=plan)
    for name, ref in peers["results"].items():
        assert_same(ours, ref, f"ours vs {name}")
    # Every method in blocks taken in turn (ours, JAX, tape, ours, ...; ``interleaved_medians``): a block
    # per method keeps each call clear of the other runtime's spinning thread pool (ours / JAX measured
    # 1.05 call by call, 0.98 in blocks), and the turns spread a shared machine's load over all methods.
    t = interleaved_medians({
        "ours": lambda: run_problem(problem, plan=plan),
        "ours_call": lambda: compute_in_memory(model, {"x": x}, kind="batch_jacobian", plan=plan),
        **peers["calls"]}, repeats=repeats)
    trials = {label: {"status": r.status, "rows_per_s": r.rates, "compile_s": r.compile_s}
              for label, r in plan.strategies.items()}
    t_ours = t["ours"]
    return [
        {"method": "ours run_problem (plan refined)", "ms": round(t_ours * 1e3, 1), "strategy": plan.strategy,
         "chunk_rows": report.plan["chunk_rows"], "jobs_until_refined": jobs,
         "seconds_until_refined": round(t_refine, 2)},
        {"method": "ours compute_in_memory (validate + run with the plan)", "ms": round(t["ours_call"] * 1e3, 1)},
        {"ratio": "ours / tape.batch_jacobian eager", "value": round(t_ours / t["tape"], 3), "goal": "<= 0.25"},
        {"ratio": "ours / tape.batch_jacobian tf.function", "value": round(t_ours / t["tape_fn"], 3)},
        {"ratio": "ours / jax", "value": round(t_ours / t["jax"], 3), "goal": "<= 1.0"},
        {"ratio": "ours (whole call) / jax", "value": round(t["ours_call"] / t["jax"], 3)},
        {"peers_ms": {name: round(t[name] * 1e3, 1) for name in peers["calls"]}},
        {"strategies": trials},
    ]


def measure_peers(model_path: Path, x: np.ndarray) -> dict:
    """The peers' results and calls (timed with ours in ``one_run``): eager and compiled
    ``tape.batch_jacobian``, and JAX ``jit(vmap(jacrev))`` on the same weights."""
    import jax
    import jax.numpy as jnp
    import tensorflow as tf

    from worker.engine import load_model

    model = load_model(str(model_path))
    xt = tf.constant(x)

    def tape_eager():
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = model.fn(x=xt)["y"]
        return tape.batch_jacobian(y, xt)

    tape_fn = compiled_batch_jacobian(model)

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
    results = {"tape.batch_jacobian": tape_fn(xt).numpy(), "jax": np.asarray(jac(xj).block_until_ready())}
    return {"results": results,
            "calls": {"tape": lambda: tape_eager().numpy(), "tape_fn": lambda: tape_fn(xt).numpy(),
                      "jax": lambda: jac(xj).block_until_ready()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tests import models

    work = Path(tempfile.mkdtemp(prefix="bench-mlp-"))
    path = models.mlp(work / "mlp", sizes=(256, 512, 512, 256))
    x = np.random.default_rng(0).standard_normal((64, 256)).astype("float32")
    rows: list[dict] = []
    met = 0
    for run in range(args.runs):
        copy = work / f"mlp{run}"
        shutil.copytree(path, copy)  # a fresh LoadedModel: nothing compiled, no plan
        peers = measure_peers(path, x)
        out = one_run(copy, x, args.repeats, peers)
        ok = out[2]["value"] <= 0.25 and out[4]["value"] <= 1.0  # eager batch_jacobian, JAX
        met += ok
        out.insert(0, {"run": run + 1, "goals_met": ok})
        for r in out:
            print(r, flush=True)
        rows += out
    rows.append({"summary": f"goals met in {met} of {args.runs} runs"})
    print(machine())
    emit("mlp_batch_jacobian", rows, args.out)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
