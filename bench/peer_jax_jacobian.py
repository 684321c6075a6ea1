"""The JAX peer of issue 25, a whole process as a user writes it: Keras 3 on the JAX backend builds the same
architecture (``bench/archs.py``), loads the TensorFlow side's weights, and computes the Jacobian of ``y``
w.r.t. ``x`` as ``jit(vmap(vjp))`` over one-hot cotangents in chunks of 64 rows (the last chunk padded, so
one compile serves all), then saves it.

    KERAS_BACKEND=jax python bench/peer_jax_jacobian.py ARCH WEIGHTS.weights.h5 INPUTS.npz OUT.npy [--chunk 64]

Prints one JSON line of timings (build, compile + first chunk, total).
"""

import json
import os
import sys
import time

T0 = time.perf_counter()
os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from bench.archs import build  # noqa: E402


def main() -> None:
    arch, weights, inputs_path, out_path = sys.argv[1:5]
    chunk = int(sys.argv[sys.argv.index("--chunk") + 1]) if "--chunk" in sys.argv else 64
    model = build(arch, keras)
    model.load_weights(weights)
    x = jnp.asarray(np.load(inputs_path)["x"])
    trainable = [v.value for v in model.trainable_variables]
    frozen = [v.value for v in model.non_trainable_variables]

    def f(x: jax.Array) -> jax.Array:
        y, _ = model.stateless_call(trainable, frozen, x, training=False)
        return y["y"]

    y = f(x)
    rows = int(np.prod(y.shape))

    @jax.jit
    def rows_of(x: jax.Array, cotangents: jax.Array) -> jax.Array:
        _, vjp = jax.vjp(f, x)
        return jax.vmap(lambda ct: vjp(ct.reshape(y.shape))[0])(cotangents)

    t_built = time.perf_counter()
    out = np.empty((rows,) + tuple(x.shape), np.float32)
    first = None
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        seeds = np.zeros((chunk, rows), np.float32)
        seeds[np.arange(n), np.arange(start, start + n)] = 1.0
        out[start:start + n] = np.asarray(rows_of(x, jnp.asarray(seeds)))[:n]
        first = first or time.perf_counter() - t_built
    np.save(out_path, out.reshape(tuple(y.shape) + tuple(x.shape)))
    print(json.dumps({"build_s": round(t_built - T0, 3), "first_chunk_s": round(first or 0.0, 3),
                      "jacobian_s": round(time.perf_counter() - t_built, 3), "rows": rows,
                      "total_s": round(time.perf_counter() - T0, 3)}), flush=True)


if __name__ == "__main__":
    main()
