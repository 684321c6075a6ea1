"""TensorFlow's import as a script does it and as the engine does (``worker/engine/tf_import.py``), each in a fresh
process: ``plain`` is ``import tensorflow`` as any script does it; ``eager_api`` imports ``worker.engine`` first with
``JACOBIAN_TF_EAGER_API=1`` (Keras and JAX deferred while TensorFlow initialises, the API's namespaces all run);
``engine`` as the engine imports it by default (the namespaces lazy too). Then each loads the SavedModel of
``--model`` as the engine does (``load_model``; ``plain`` with ``tf.saved_model.load``) and calls its signature
once. Per process: seconds of the import and of the load, peak RSS after each, whether Keras and JAX were imported
and how many modules; the modes alternate, medians per mode and their ratios to plain.

Run: .venv/bin/python -m bench.bench_tf_import [--model mobilenet_softmax] [--rounds 3] [--out bench/results]
(``--one MODE MODEL_DIR``: one measurement, what each child process runs.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import emit
from tests.procs import base_env

MODES = ("plain", "eager_api", "engine")


def one(mode: str, model_dir: str) -> dict:
    import time

    def rss_mib() -> int:
        """This process's peak RSS (``VmHWM``: ``ru_maxrss`` keeps the forking parent's peak across exec)."""
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) // 1024

    t0 = time.perf_counter()
    if mode != "plain":
        os.environ["JACOBIAN_TF_EAGER_API"] = "1" if mode == "eager_api" else "0"
        import worker.engine  # installs the deferral before TensorFlow's import
    import tensorflow as tf

    t1, rss_import = time.perf_counter(), rss_mib()
    if mode == "plain":
        fn = tf.saved_model.load(model_dir).signatures["serving_default"]
    else:
        fn = worker.engine.load_model(model_dir).fn
    fn(**{name: tf.zeros([1 if d is None else d for d in spec.shape.as_list()], spec.dtype)
          for name, spec in fn.structured_input_signature[1].items()})
    return {"mode": mode, "import_s": round(t1 - t0, 3), "load_s": round(time.perf_counter() - t1, 3),
            "rss_import_MiB": rss_import, "rss_load_MiB": rss_mib(),
            "keras": "keras" in sys.modules, "jax": "jax" in sys.modules, "modules": len(sys.modules)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mobilenet_softmax")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", nargs=2, metavar=("MODE", "MODEL_DIR"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)), flush=True)
        return
    from bench.bench_cold import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_model(args.model, Path(tmp))[0])
        rows = []
        for _ in range(args.rounds):
            for mode in MODES:
                done = subprocess.run([sys.executable, "-m", "bench.bench_tf_import", "--one", mode, model_dir],
                                      env=base_env(), capture_output=True, text=True, check=True)
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    med = {mode: {key: statistics.median(r[key] for r in rows if r["mode"] == mode)
                  for key in ("import_s", "load_s", "rss_import_MiB", "rss_load_MiB")} for mode in MODES}
    for key in med["plain"]:
        rows.append({"median": key, **{mode: med[mode][key] for mode in MODES},
                     **{f"{mode}/plain": round(med[mode][key] / med["plain"][key], 3) for mode in MODES[1:]}})
    emit(f"tf_import_{args.model}", rows, args.out)


if __name__ == "__main__":
    main()
