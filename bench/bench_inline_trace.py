"""A strategy's first call through the SavedModel's call op against the same model's graph imported inline.

The engine differentiates ``model.fn(...)``: a call of the signature's function, one ``StatefulPartitionedCall`` op
in the traced graph. Its gradient makes TensorFlow build a forward function that outputs its intermediates and a
backward function, and pfor (``vectorized``) converts that backward function's ops again. Imported inline (the
called function's ``FunctionDef`` as a ``GraphDef``, its resource arguments fed the captured variables), the
forward ops sit in the traced graph itself and ``tf.gradients`` differentiates them op by op.

For each variant (``call`` or ``inline``) and strategy (``tiled``: the inputs tiled ``rows`` times and one
gradient; ``vectorized``: one forward pass, pfor over the seeds' gradients) a fresh process loads the model and
times the trace (``get_concrete_function``), the first call and the median of five steady calls of ``rows`` rows;
the rows of the two variants must agree. An experiment for the engine (not its code path): a gradient tape does
not see ops that ``import_graph_def`` creates, so the engine's strategies would need ``tf.gradients``.

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


def _inline(tf: Any, fn: Any) -> Any:
    """``x -> outputs`` of ``fn`` (a loaded signature function of one input) with its called function imported
    into the graph being traced."""
    from tensorflow.python.framework.function_def_to_graph import function_def_to_graph_def

    graph_def = fn.graph.as_graph_def()
    calls = [n for n in graph_def.node if n.op == "StatefulPartitionedCall"]
    if len(calls) != 1:
        raise SystemExit(f"the signature's graph has {len(calls)} call ops, not one: not inlined here")
    call = calls[0]
    fdef = next(f for f in graph_def.library.function if f.signature.name == call.attr["f"].func.name)
    body, _ = function_def_to_graph_def(fdef)
    captured = {internal.op.name: external for external, internal in fn.graph.captures}
    args = [a.name for a in fdef.signature.input_arg]
    ret = fdef.ret[fdef.signature.output_arg[0].name].split(":")

    def inline(x: Any) -> Any:
        graph = tf.compat.v1.get_default_graph()
        feeds = {}
        for arg, source in zip(args, call.input):
            source = source.split(":")[0].lstrip("^")
            feeds[f"{arg}:0"] = graph.capture(captured[source]) if source in captured else x
        return tf.graph_util.import_graph_def(body, input_map=feeds, return_elements=[f"{ret[0]}:{ret[-1]}"],
                                              name="inlined")[0]
    return inline


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
    forward = _inline(tf, fn) if variant == "inline" else (lambda x: fn(**{name: x})[of])
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
