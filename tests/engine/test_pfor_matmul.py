"""pfor of a batched matmul with a fixed matrix (``worker.engine.pfor_patches._install_matmul``).

TensorFlow 2.21's converter broadcasts the fixed matrix against the loop and batch dimensions, and oneDNN's
batched matmul then kills the process (SIGSEGV) on a VJP through Keras' ``MultiHeadAttention`` or
``EinsumDense``: a transformer encoder crashed ``jacobian compute``. Each case runs in its own process, so
that a crash fails the test instead of ending pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    import keras
    from worker.engine import pfor_patches
    pfor_patches.install()
    layers = keras.layers
    keras.utils.set_random_seed(0)
    x_in = keras.Input((32, 64))   # the shapes that crashed (smaller ones may not)
    case = sys.argv[1]
    if case == "attention":
        y = layers.MultiHeadAttention(num_heads=4, key_dim=16)(x_in, x_in)
    elif case == "left":      # a fixed matrix times a varying one, adjoints on both sides
        w = tf.constant(np.random.default_rng(1).standard_normal((32, 16)), tf.float32)
        w2 = tf.constant(np.random.default_rng(2).standard_normal((24, 64)), tf.float32)
        y = layers.Lambda(lambda t: tf.matmul(tf.matmul(w, tf.tanh(t), adjoint_a=True), w2, adjoint_b=True),
                          output_shape=(16, 24))(x_in)
    else:                     # a varying operand times a fixed matrix
        w = tf.constant(np.random.default_rng(1).standard_normal((64, 48)), tf.float32)
        y = layers.Lambda(lambda t: tf.matmul(tf.tanh(t), w))(x_in)
    model = keras.Model(x_in, y)
    x = tf.constant(np.random.default_rng(0).standard_normal((1, 32, 64)), tf.float32)
    n = int(np.prod(model(x).shape))

    @tf.function
    def rows(x, ct):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x)
        return tf.vectorized_map(lambda c: tape.gradient(y, x, output_gradients=tf.reshape(c, tf.shape(y))), ct)

    seeds = tf.eye(n)[:8]
    got = rows(x, seeds).numpy().reshape(8, -1)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = model(x)
    want = np.stack([tape.gradient(y, x, output_gradients=tf.reshape(c, tf.shape(y))).numpy().ravel()
                     for c in seeds])
    np.save(sys.argv[2], np.stack([got, want]))
""")


@pytest.mark.parametrize("case", ["attention", "right", "left"])
def test_vectorized_vjp_through_a_fixed_matrix_matches_the_loop(tmp_path, case):
    out = tmp_path / "rows.npy"
    done = subprocess.run([sys.executable, "-c", SCRIPT, case, str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=240, env={"PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "2",
                                            "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, f"exit {done.returncode} (-11: SIGSEGV)\n{done.stderr[-3000:]}"
    got, want = np.load(out)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
