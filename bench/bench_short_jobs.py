"""One request of short jobs, as a worker runs them: does the chunk grow to what the jobs' size allows?

A per-example Jacobian of a narrow MLP (256-16-256 by default, batch 4: 256 rows a job, a call about a millisecond
at any size up to 64 rows) stands on the CPU for what an H100 showed with the 256-512-512-256 MLP (docs/BENCHMARKS.md,
"GPU again"): calls so short that the per-call overhead is most of the time, where every doubling of the
chunk pays and a job is over before a comparison begun mid-job can finish. Jobs run one after another, each with
the plan the last one learnt, ``--jobs`` of them, as a worker runs a request's jobs; printed: the seconds they
took, each change of (strategy, chunk) on the way, and then ours (the plan the last job learnt) against
``tape.batch_jacobian`` in a ``tf.function`` in interleaved blocks (``interleaved_medians``), rows compared.

Run: .venv/bin/python -m bench.bench_short_jobs [--sizes 256,16,256] [--batch 4] [--jobs 1500] [--repeats 30]
         [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.bench_mlp import compiled_batch_jacobian
from bench.common import assert_same, emit, interleaved_medians, machine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256,16,256", help="the MLP's layer widths, input first")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=1500, help="jobs of the request run one after another, then timed")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import tensorflow as tf

    from tests import models
    from worker.engine import build_problem, compute_in_memory, load_model, run_problem

    sizes = tuple(int(s) for s in args.sizes.split(","))
    model = load_model(str(models.mlp(Path(tempfile.mkdtemp(prefix="bench-short-")) / "mlp", sizes=sizes)))
    x = np.random.default_rng(0).standard_normal((args.batch, sizes[0])).astype("float32")
    changes: list[dict] = []
    problem = build_problem(model, {"x": x}, kind="batch_jacobian")
    plan, t0 = None, time.perf_counter()
    for job in range(1, args.jobs + 1):
        report = run_problem(problem, plan=plan)
        plan = report.learned
        _note(changes, job, report)
    seconds = time.perf_counter() - t0
    ours, report = compute_in_memory(model, {"x": x}, kind="batch_jacobian", plan=plan)
    tape_fn, xt = compiled_batch_jacobian(model), tf.constant(x)
    assert_same(ours, tape_fn(xt).numpy(), "ours vs tape.batch_jacobian")
    t = interleaved_medians({"ours": lambda: run_problem(problem, plan=plan), "tape": lambda: tape_fn(xt).numpy()},
                            repeats=args.repeats)
    rows = [*changes,
            {"method": "ours: a job, plan settled", "ms": round(t["ours"] * 1e3, 2), "strategy": plan.strategy,
             "chunk_rows": report.plan["chunk_rows"], "rows_a_job": problem.rows_total, "after_jobs": args.jobs,
             "seconds_of_those_jobs": round(seconds, 2), "refined": plan.refined},
            {"method": "tape.batch_jacobian in a tf.function", "ms": round(t["tape"] * 1e3, 2)},
            {"ratio": "ours / tape.batch_jacobian (a job, steady)", "value": round(t["ours"] / t["tape"], 3)}]
    print(machine())
    emit(f"short_jobs_{'-'.join(map(str, sizes))}_b{args.batch}", rows, args.out)


def _note(changes: list[dict], job: int, report: object) -> None:
    """A row for each job whose (strategy, chunk) differs from the last one noted."""
    now = (report.plan["strategy"], report.plan["chunk_rows"])
    if not changes or (changes[-1]["strategy"], changes[-1]["chunk_rows"]) != now:
        changes.append({"job": job, "strategy": now[0], "chunk_rows": now[1]})


if __name__ == "__main__":
    main()
