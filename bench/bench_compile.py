"""How a strategy's first call (its trace, and XLA's compile) grows with the graph, against the plain trace.

For each model (``bench/archs.py`` names, or ``mlp``), exported once, and each strategy in a fresh process of
its own (after a warm-up that pays the process's own first-call costs): load the SavedModel, build the Jacobian
problem, and time the strategy's first call of a ``--rows`` chunk and a second call of the same size; the
first-call cost is their difference, as the engine measures a plan's ``compile_s``
(``worker.engine.chunk_run``). ``tiled`` (a plain batched gradient) is the base: the ratios are what
``worker.engine.tuning.compile_factor`` estimates from the graph's size (``graph_ops``).

Run: .venv/bin/python -m bench.bench_compile [--models conv1d,mobilenet_logits,efficientnet]
     [--labels tiled,vectorized,tiled+xla] [--rows 8] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import emit


def export(name: str, work: Path) -> Path:
    """``name``'s SavedModel under ``work``."""
    if name == "mlp":
        from tests import models

        return models.mlp(work / "mlp", sizes=(64, 256, 256, 64))
    import keras

    from bench import archs

    archs.build(name, keras).export(str(work / name), verbose=False)
    return work / name


def measure(name: str, path: str, labels: list[str], rows: int) -> dict:
    """In this process: ``graph_ops`` and, per label, first-call and steady seconds at ``rows`` rows."""
    from bench import archs
    from worker.engine import build_problem, load_model
    from worker.engine.strategies import chunk_function

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 64) if name == "mlp" else (1,) + archs.INPUT_SHAPES[name])
    model = load_model(path)
    problem = build_problem(model, {"x": x.astype("float32")}, of="y")
    # The process's own first-call costs (TensorFlow's runtime, the tracing machinery) are paid before any
    # strategy is timed: a forward call and a small traced gradient, so that no strategy carries them.
    import tensorflow as tf

    model.fn(**problem.inputs)
    v = tf.Variable(tf.ones((4, 4)))

    @tf.function
    def warm(a):
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(tf.tanh(a @ v))
        return tape.gradient(y, v)

    warm(tf.ones((2, 4)))
    out: dict = {"model": name, "graph_ops": model.graph_ops, "rows": rows, "labels": {}}
    for label in labels:
        fn = chunk_function(problem, label)
        t0 = time.perf_counter()
        np.asarray(fn(0, rows))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        np.asarray(fn(0, rows))
        steady = time.perf_counter() - t0
        out["labels"][label] = {"first_s": round(first, 3), "steady_s": round(steady, 3),
                                "compile_s": round(max(first - steady, 0.0), 3)}
        print(f"{name} {label}: first {first:.2f} s, steady {steady:.2f} s", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="conv1d,mobilenet_logits,efficientnet")
    ap.add_argument("--labels", default="tiled,vectorized,tiled+xla")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)    # a child process: one model ...
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)   # ... exported here
    args = ap.parse_args()
    labels = args.labels.split(",")
    if args.one and args.path is None:
        print(export(args.one, Path(tempfile.mkdtemp(prefix="bench-compile-"))))
        return
    if args.one:
        print(json.dumps(measure(args.one, args.path, labels, args.rows)))
        return

    def child(*argv: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "bench.bench_compile", *argv], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{argv} failed:\n{proc.stderr[-3000:]}")
        return proc.stdout.strip().splitlines()[-1]

    rows = []
    for name in args.models.split(","):
        path = child("--one", name)
        row: dict = {"model": name}
        for label in labels:   # each strategy's first call in a fresh process
            got = json.loads(child("--one", name, "--path", path, "--labels", label, "--rows", str(args.rows)))
            row["graph_ops"] = got["graph_ops"]
            row[f"{label}_compile_s"] = got["labels"][label]["compile_s"]
            print(json.dumps(got), flush=True)
        base = row.get("tiled_compile_s")
        for label in labels:
            if base and label != "tiled":
                row[f"{label}/tiled"] = round(row[f"{label}_compile_s"] / base, 2)
        rows.append(row)
    emit("compile", rows, args.out)


if __name__ == "__main__":
    main()
