"""``jacobian compute --kind jvp`` and ``--kind svd`` on a Keras GRU that is not unrolled (issue 30): where
TensorFlow's forward mode and second derivatives fail, the products come from VJPs and equal GradientTape's; stderr
holds the engine's lines, one per route that failed, and none of TensorFlow's own error dumps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from tests import loop_models
from tests.e2e.test_cli_compute import jacobian_cli

pytestmark = pytest.mark.e2e
SEQ = np.random.default_rng(0).standard_normal((2, 5, 3)).astype("float32")
DUMPS = ("Got error while pfor", "Created at:", "ERROR:tensorflow", "Traceback")


@pytest.fixture(scope="module")
def gru(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """The model and J (4 x 30) by GradientTape."""
    import tensorflow as tf

    path = loop_models.gru(tmp_path_factory.mktemp("models") / "gru")
    loaded = tf.saved_model.load(str(path))   # kept: the signature holds its variables weakly
    fn = loaded.signatures["serving_default"]
    seq = tf.constant(SEQ)
    rows = []
    for i in range(4):   # eagerly, a tape per row: tape.jacobian and persistent tapes fail on this loop
        with tf.GradientTape() as tape:
            tape.watch(seq)
            y = tf.reshape(fn(seq=seq)["y"], [-1])
        rows.append(tape.gradient(y, seq, output_gradients=tf.one_hot(i, 4)).numpy().ravel())
    return path, np.stack(rows).astype(np.float64)


def test_jvp_and_svd_on_a_gru_from_the_cli(gru, tmp_path):
    path, jac = gru
    np.savez(tmp_path / "in.npz", seq=SEQ)
    tangents = np.random.default_rng(1).standard_normal((3, 2, 5, 3)).astype("float32")
    np.save(tmp_path / "seeds.npy", tangents)
    base = ("compute", "--model", str(path), "--input", str(tmp_path / "in.npz"), "--of", "y", "--wrt", "seq",
            "--out", str(tmp_path / "out"))
    proc = jacobian_cli(*base, "--kind", "jvp", "--seeds", str(tmp_path / "seeds.npy"), "--job-id", "g1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [d for d in DUMPS if d in proc.stderr], proc.stderr[-5000:]
    assert len(proc.stderr.splitlines()) < 30, proc.stderr[-5000:]
    got = zarr.open_group(proc.stdout.strip(), mode="r")["products"][:]
    want = tangents.reshape(3, 30).astype(np.float64) @ jac.T
    np.testing.assert_allclose(got.reshape(3, 4), want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))

    proc = jacobian_cli(*base, "--kind", "svd", "--rank", "2", "--job-id", "g2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [d for d in DUMPS if d in proc.stderr], proc.stderr[-5000:]
    s = zarr.open_group(proc.stdout.strip(), mode="r")["S"][:]
    np.testing.assert_allclose(s, np.linalg.svd(jac, compute_uv=False)[:2], rtol=1e-4)


def test_pfor_error_dumps_stay_out_of_stderr(tmp_path):
    """An RK4 loop over a tensor read before it: pfor fails on the loop's second derivative (forward/ and
    reverse/vectorized) and TensorFlow logs thousands of lines about it before raising (on main: 4,500 lines of
    stderr); here reverse/loop computes J v and stderr has the progress and the done line."""
    import tensorflow as tf

    path = loop_models.rk4(tmp_path / "rk4", read_in_loop=False)
    x0 = np.random.default_rng(2).standard_normal(4)
    tangents = np.random.default_rng(3).standard_normal((3, 4))
    np.savez(tmp_path / "in.npz", x0=x0)
    np.save(tmp_path / "seeds.npy", tangents)
    proc = jacobian_cli("compute", "--model", str(path), "--input", str(tmp_path / "in.npz"), "--of", "x", "--wrt",
                        "x0", "--kind", "jvp", "--seeds", str(tmp_path / "seeds.npy"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [d for d in DUMPS if d in proc.stderr], proc.stderr[-5000:]
    assert len(proc.stderr.splitlines()) < 30, proc.stderr[-5000:]

    loaded = tf.saved_model.load(str(path))
    x = tf.constant(x0)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = loaded.signatures["serving_default"](x0=x)["x"]
    jac = tape.jacobian(y, x).numpy()
    got = zarr.open_group(proc.stdout.strip(), mode="r")["products"][:]
    np.testing.assert_allclose(got, tangents @ jac.T, rtol=1e-9, atol=1e-12)
