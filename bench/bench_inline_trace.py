"""A strategy's first call through the SavedModel's call op against the same model's graph imported inline.

Through the call op, a chunk function differentiates ``model.fn(...)``: one ``StatefulPartitionedCall`` op in the
traced graph. Its gradient makes TensorFlow build a forward function that outputs its intermediates and a
backward function, and pfor (``vectorized``) converts that backward function's ops again. Imported inline (the
called function's ``FunctionDef`` as a ``GraphDef``, its resource arguments fed the captured variables), the
forward ops sit in the traced graph itself and ``tf.gradients`` differentiates them op by op.

For each variant (``call`` or ``inline``) and strategy (``tiled``: the inputs tiled ``rows`` times and one
gradient; ``vectorized``: one forward pass, pfor over the seeds' gradients) a fresh process loads the model and
times the trace (``get_concrete_function``), the first call and the median of five steady calls of ``rows`` rows;
the rows of the two variants must agree. ``inline`` imports the body as the engine does (``worker.engine.inline``,
with ``tf.gradients``; EfficientNetB0's swish overrides get the engine's silu gradient); a model the engine keeps as a
call (a loop in its body, another gradient override) is reported as not inlined.

Run: .venv/bin/python -m bench.bench_inline_trace [--model mobilenet_softmax] [--rows 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import emit

VARIANTS = ("call", "inline")
STRATEGIES = ("tiled", "vectorized")


def measure(path: str, inputs: str, variant: str, strategy: str, rows: int) -> dict[str, Any]:
    """In this process: trace, first call and steady seconds of ``strategy`` by ``variant``; the rows saved."""
    import tensorflow as tf

    from worker.engine import load_model, pfor_patches

    pfor_patches.install()
    model = load_model(path)
    fn = model.fn
    (name,) = model.input_specs
    (of,) = model.output_specs
    x0 = tf.constant(np.load(inputs)[name])
    if variant == "inline":
        from worker.engine import inline

        imported = inline.inlined(model)
        if imported is None:   # a signature that cannot be imported exactly: the engine keeps its call op
            raise SystemExit("NOT_INLINED: the engine keeps this model's call op (worker/engine/inline.py)")
        forward = lambda x: imported({name: x})[of]   # noqa: E731
    else:
        forward = lambda x: fn(**{name: x})[of]   # noqa: E731
    width = int(np.prod(model.output_specs[of].shape[1:]))

    def gradient(y: Any, x: Any, seeds: Any, tape: Any) -> Any:
        if variant == "inline":
            return tf.gradients(y, x, grad_ys=seeds)[0]
        return tape.gradient(y, x, output_gradients=seeds)

    def body(k: Any) -> Any:
        seeds = tf.one_hot(tf.range(k), width)
        if strategy == "tiled":
            x = tf.tile(x0, tf.concat([[k], tf.ones([tf.rank(x0) - 1], tf.int32)], 0))
            tape = tf.GradientTape()
            with tape:
                tape.watch(x)
                y = forward(x)
            return gradient(y, x, tf.reshape(seeds, tf.shape(y)), tape)
        x = tf.identity(x0)   # a tensor of the graph being traced (import_graph_def takes no eager input)
        tape = tf.GradientTape()
        with tape:
            tape.watch(x)
            y = forward(x)
        return tf.vectorized_map(lambda s: gradient(y, x, tf.reshape(s, tf.shape(y)), tape), seeds,
                                 fallback_to_while_loop=False)

    t0 = time.perf_counter()
    concrete = tf.function(body).get_concrete_function(tf.TensorSpec([], tf.int32))
    t1 = time.perf_counter()
    got = concrete(tf.constant(rows)).numpy()
    t2 = time.perf_counter()
    steady = []
    for _ in range(5):
        t = time.perf_counter()
        concrete(tf.constant(rows)).numpy()
        steady.append(time.perf_counter() - t)
    np.save(Path(path).parent / f"rows_{variant}_{strategy}.npy", got.reshape(rows, -1))
    return {"variant": variant, "strategy": strategy, "rows": rows, "trace_s": round(t1 - t0, 3),
            "first_call_s": round(t2 - t1, 3), "steady_s": round(float(np.median(steady)), 4),
            "graph_ops": len(concrete.graph.as_graph_def().node)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mobilenet_softmax")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", nargs=4, default=None, help=argparse.SUPPRESS)   # path inputs variant strategy
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one[:2], args.one[2], args.one[3], args.rows)))
        return
    from bench.bench_cold import build_model

    work = Path(tempfile.mkdtemp(prefix="bench-inline-"))
    path, _, _ = build_model(args.model, work)
    rows = []
    for strategy in STRATEGIES:
        for variant in VARIANTS:
            proc = subprocess.run([sys.executable, "-m", "bench.bench_inline_trace", "--rows", str(args.rows),
                                   "--one", str(path), str(work / "inputs.npz"), variant, strategy],
                                  capture_output=True, text=True)
            if "NOT_INLINED" in proc.stderr:
                print(f"{args.model}: not inlined: the engine keeps the call op (a body that calls functions or "
                      f"overrides a gradient other than silu's); nothing to compare", flush=True)
                emit("inline_trace", [{"model": args.model, "inlined": False}], args.out)
                return
            if proc.returncode != 0:
                raise SystemExit(f"{variant} {strategy} failed:\n{proc.stderr[-3000:]}")
            row = {"model": args.model, **json.loads(proc.stdout.strip().splitlines()[-1])}
            print(json.dumps(row), flush=True)
            rows.append(row)
        a, b = (np.load(path.parent / f"rows_{v}_{strategy}.npy") for v in VARIANTS)
        scale = float(np.abs(a).max())
        assert scale > 0 and float(np.abs(a - b).max()) <= 1e-4 * scale, f"{strategy}: the variants' rows differ"
    emit("inline_trace", rows, args.out)


if __name__ == "__main__":
    main()
