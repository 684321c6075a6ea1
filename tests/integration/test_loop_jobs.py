"""A ``jvp`` job over HTTP on a model where TensorFlow's forward mode fails (issue 30): an RK4 integrator in a
float64 ``tf.while_loop`` (its second derivatives work since ``worker.engine.loop_handles``); the products equal
``J v`` from GradientTape's reverse mode, and the result's plan names the route that computed them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests import loop_models
from tests.conftest import finished_job
from worker.engine import load_model

pytestmark = pytest.mark.integration
X0 = np.random.default_rng(5).normal(size=4)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    loop_models.rk4(root / "rk4")
    return root


def tape_rows(fn, x0: np.ndarray) -> np.ndarray:
    """J (4 x 4) by GradientTape, eagerly, a tape per row: a persistent tape (``tape.jacobian``) fails on this loop."""
    import tensorflow as tf

    rows = []
    for i in range(4):
        x = tf.constant(x0)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x0=x)["x"]
        rows.append(tape.gradient(y, x, output_gradients=tf.one_hot(i, 4, dtype=tf.float64)).numpy())
    return np.stack(rows)


def test_jvp_job_on_the_rk4_integrator(worker_client, redis_conn, model_root):
    import xarray as xr

    tangents = np.random.default_rng(6).normal(size=(3, 4))
    r = worker_client.post("/v1/jobs", json={
        "model": {"path": "rk4"}, "inputs": {"x0": {"shape": [4], "dtype": "float64", "data": X0.tolist()}},
        "of": "x", "wrt": "x0", "kind": "jvp",
        "seeds": {"shape": [3, 4], "dtype": "float64", "data": tangents.ravel().tolist()}})
    assert r.status_code == 202, r.text
    record = finished_job(worker_client, redis_conn, r.json()["id"])
    assert record["status"] == "succeeded", record.get("error")
    ds = xr.open_zarr(record["result"]["uri"])
    model = load_model(str(model_root / "rk4"))   # kept: its function holds the variables weakly
    J = tape_rows(model.fn, X0)
    np.testing.assert_allclose(ds["products"].values.reshape(3, 4), tangents @ J.T, rtol=1e-9, atol=1e-12)
    # forward mode fails on this loop; the derivative of a VJP runs compiled since loop_handles restores the
    # loop's variable handle (before: J from VJPs, reverse/rows)
    assert ds.attrs["plan"]["labels"]["jvp"] == "reverse/loop", ds.attrs["plan"]
