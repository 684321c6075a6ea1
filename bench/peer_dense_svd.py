"""The dense route, as a user writes it: load the SavedModel, ``tape.jacobian`` (the while_loop: with pfor,
TensorFlow 2.21 fails on MobileNet-like models), then ``numpy.linalg.svd`` of the matrix; the ``rank`` largest
singular values saved.

Run as its own process by bench/bench_matfree_cold.py (whole-process wall time and peak RSS):
    python bench/peer_dense_svd.py MODEL_DIR INPUTS.npz OUT.npy --rank 10 [--of logits] [--wrt image]
Prints one JSON line of timings.
"""

import json
import sys
import time

T0 = time.perf_counter()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main() -> None:
    model_dir, inputs_path, out_path = sys.argv[1:4]
    rank = int(sys.argv[sys.argv.index("--rank") + 1])
    of = sys.argv[sys.argv.index("--of") + 1] if "--of" in sys.argv else None
    wrt = sys.argv[sys.argv.index("--wrt") + 1] if "--wrt" in sys.argv else None
    loaded = tf.saved_model.load(model_dir)   # kept: the signature needs its variables alive
    fn = loaded.signatures["serving_default"]
    inputs = {k: tf.constant(v) for k, v in np.load(inputs_path).items()}
    of = of or next(iter(fn.structured_outputs))
    wrt = wrt or next(iter(inputs))
    t_loaded = time.perf_counter()
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(inputs[wrt])
        y = fn(**inputs)[of]
    jac = tape.jacobian(y, inputs[wrt], parallel_iterations=64, experimental_use_pfor=False).numpy()
    t_jac = time.perf_counter()
    s = np.linalg.svd(jac.reshape(int(np.prod(y.shape)), -1), compute_uv=False)[:rank]
    np.save(out_path, s)
    print(json.dumps({"load_s": round(t_loaded - T0, 3), "jacobian_s": round(t_jac - t_loaded, 3),
                      "svd_s": round(time.perf_counter() - t_jac, 3), "total_s": round(time.perf_counter() - T0, 3)}),
          flush=True)


if __name__ == "__main__":
    main()
