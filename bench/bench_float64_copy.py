"""The precision guard's float64 side in a fresh process: the model's float64 copy and three one-hot float64 VJPs,
as ``precision.prepare`` computes them, with TensorFlow's default two grappler passes against the one pass the
guard now asks for (``worker.engine.float64.one_grappler_pass``). Every measurement is its own process (the
first call's graph optimisation is what differs), the two modes alternating; medians and peak RSS per mode.

Run: .venv/bin/python -m bench.bench_float64_copy [--model mobilenet_softmax] [--rounds 3] [--out bench/results]
(``--one MODE MODEL_DIR INPUTS``: one measurement, what each child process runs.)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from bench.common import emit
from tests.procs import base_env


def one(mode: str, model_dir: str, inputs: str) -> dict:
    import numpy as np
    import tensorflow as tf

    from worker.engine.float64 import float64_model, one_grappler_pass
    from worker.engine.model import load_model

    model = load_model(model_dir)
    (name,) = model.input_specs
    (of,) = model.output_specs
    x = tf.constant(np.load(inputs)[name].astype("float64"))
    with one_grappler_pass() if mode == "one" else nullcontext():
        t0 = time.perf_counter()
        model64 = float64_model(model)
        t1 = time.perf_counter()
        for i in range(3):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = model64.fn(**{name: x})[of]
            seed = np.zeros(y.shape)
            seed.flat[i * 97 % seed.size] = 1.0
            tape.gradient(y, x, output_gradients=tf.constant(seed)).numpy()
            if i == 0:
                t2 = time.perf_counter()
        t3 = time.perf_counter()
    return {"mode": mode, "copy_s": round(t1 - t0, 3), "first_vjp_s": round(t2 - t1, 3),
            "next_vjps_s": round(t3 - t2, 3), "total_s": round(t3 - t0, 3),
            "peak_rss_MiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_softmax")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", nargs=3, metavar=("MODE", "MODEL_DIR", "INPUTS"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    from bench.bench_cold import build_model

    work = Path(tempfile.mkdtemp(prefix="bench-float64-"))
    model_dir, _, _ = build_model(args.model, work)
    rows = []
    for _ in range(args.rounds):
        for mode in ("two", "one"):
            proc = subprocess.run([sys.executable, "-m", "bench.bench_float64_copy", "--one", mode, str(model_dir),
                                   str(work / "inputs.npz")], env=base_env(), capture_output=True, text=True,
                                  check=True)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    for mode in ("two", "one"):
        mine = [r for r in rows if r["mode"] == mode]
        print(f"{mode} pass(es): median total {statistics.median(r['total_s'] for r in mine):.2f} s, copy "
              f"{statistics.median(r['copy_s'] for r in mine):.2f} s, first VJP "
              f"{statistics.median(r['first_vjp_s'] for r in mine):.2f} s, peak RSS "
              f"{statistics.median(r['peak_rss_MiB'] for r in mine)} MiB")
    emit(f"float64_copy_{args.model}", [{**r, "model": args.model} for r in rows], args.out)


if __name__ == "__main__":
    main()
