"""Draw the README's preview images the way ``GET /v1/jobs/{id}/preview.png`` draws them, from the
quickstart model of the README (``x (None, 8) -> Dense(16, tanh) -> Dense(4) -> y``, seeded weights),
its two quickstart inputs and four more: the Jacobian ``(2, 4, 2, 8)`` by ``tf.GradientTape.jacobian``
and the batch Jacobian ``(6, 4, 8)`` by ``tape.batch_jacobian``, each stored as a Zarr array with the
attributes a worker writes and rendered by ``app.routes.preview.render_preview``.

    .venv/bin/python scripts/preview_examples.py docs   # docs/preview-example.png, docs/preview-batch-example.png
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import zarr  # noqa: E402

from app.routes.preview import render_preview  # noqa: E402

QUICKSTART_X = [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]]


def quickstart_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    x = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="tanh")(x)
    return keras.Model(x, {"y": keras.layers.Dense(4, name="out")(h)})


def jacobians(model: keras.Model, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(d y / d x, per-example d y[i] / d x[i])``: shapes ``(B, 4, B, 8)`` and ``(B, 4, 8)``."""
    xt = tf.constant(x)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(xt)
        y = model(xt)["y"]
    return tape.jacobian(y, xt).numpy(), tape.batch_jacobian(y, xt).numpy()


def stored(path: Path, a: np.ndarray, *, kind: str, of_shape: list[int], wrt_shape: list[int]) -> zarr.Array:
    attrs = {"model": "mlp", "signature": "serving_default", "of": "y", "wrt": "x", "kind": kind,
             "mode": "reverse", "of_shape": of_shape, "wrt_shape": wrt_shape, "shape": list(a.shape)}
    z = zarr.create_array(str(path), shape=a.shape, chunks=a.shape, dtype="float32", attributes=attrs)
    z[...] = a
    return z


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    out_dir = parser.parse_args().out_dir
    rng = np.random.default_rng(0)
    x = np.vstack([QUICKSTART_X, rng.uniform(-1, 1, size=(4, 8))]).astype(np.float32)
    model = quickstart_model()
    full, _ = jacobians(model, x[:2])
    _, per_example = jacobians(model, x)
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("preview-example.png", stored(Path(tmp, "j.zarr"), full, kind="jacobian", of_shape=[2, 4],
                                                 wrt_shape=[2, 8])),
                 ("preview-batch-example.png", stored(Path(tmp, "b.zarr"), per_example, kind="batch_jacobian",
                                                      of_shape=[6, 4], wrt_shape=[6, 8]))]
        for name, array in cases:
            job_id = uuid.uuid5(uuid.NAMESPACE_URL, f"jacobian-service/docs/{name}").hex
            t0 = time.perf_counter()
            png, headers = render_preview(array, kind=None, panels=4, size=512, job_id=job_id)
            (out_dir / name).write_bytes(png)
            print(f"{out_dir / name}: {len(png)} bytes, {time.perf_counter() - t0:.2f} s, {headers}")


if __name__ == "__main__":
    main()
