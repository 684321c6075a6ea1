"""The peer, as a user writes it: load the SavedModel, ``tape.jacobian(parallel_iterations=64)``, save.

Run as its own process by bench/bench_cold.py (whole-process wall time and peak RSS):
    python bench/peer_tape_jacobian.py MODEL_DIR INPUTS.npz OUT.npy [--of logits] [--wrt image] [--pfor]
Without ``--pfor`` it uses ``experimental_use_pfor=False`` (the while_loop): with pfor, TensorFlow 2.21
fails on MobileNet-like models ("Encountered an exception while vectorizing the jacobian computation"),
and its message tells users to turn pfor off. Prints one JSON line of timings.
"""

import json
import sys
import time

T0 = time.perf_counter()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main() -> None:
    model_dir, inputs_path, out_path = sys.argv[1:4]
    of = sys.argv[sys.argv.index("--of") + 1] if "--of" in sys.argv else None
    wrt = sys.argv[sys.argv.index("--wrt") + 1] if "--wrt" in sys.argv else None
    use_pfor = "--pfor" in sys.argv
    loaded = tf.saved_model.load(model_dir)
    fn = loaded.signatures["serving_default"]
    inputs = {k: tf.constant(v) for k, v in np.load(inputs_path).items()}
    of = of or next(iter(fn.structured_outputs))
    wrt = wrt or next(iter(inputs))
    t_loaded = time.perf_counter()
    with tf.GradientTape(persistent=not use_pfor) as tape:
        tape.watch(inputs[wrt])
        y = fn(**inputs)[of]
    jac = tape.jacobian(y, inputs[wrt], parallel_iterations=64, experimental_use_pfor=use_pfor)
    t_jac = time.perf_counter()
    np.save(out_path, jac.numpy())
    print(json.dumps({"load_s": round(t_loaded - T0, 3), "jacobian_s": round(t_jac - t_loaded, 3),
                      "rows": int(np.prod(y.shape)), "total_s": round(time.perf_counter() - T0, 3)}), flush=True)


if __name__ == "__main__":
    main()
