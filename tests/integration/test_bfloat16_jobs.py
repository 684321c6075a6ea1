"""bfloat16 inputs from POST to result: numpy and ``.npz`` have no bfloat16, so such an input travels as float32
(JSON numbers, or a float32 ``.npz`` member) and the engine rounds it to bfloat16; an ``.npz`` member written from
an ``ml_dtypes.bfloat16`` array (a 2-byte void to numpy) is refused at POST, naming the input and the fix."""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from contracts.jobstore import JobStore
from tests import models
from tests.conftest import work_burst

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    models.mlp(root / "mlp_bf16", dtype="bfloat16")
    return root


@pytest.fixture
def client(worker_env):
    results = worker_env(1 << 20, TRY_XLA="0")
    with TestClient(create_app()) as c:
        c.results = results
        yield c


def npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def x_values() -> np.ndarray:
    """float32 values that bfloat16 holds exactly: the request means the same tensor on either side."""
    import ml_dtypes

    return np.linspace(-1, 1, 16, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32).reshape(2, 8)


def tape_jacobian_bf16(model_dir: Path, x: np.ndarray) -> np.ndarray:
    import tensorflow as tf

    loaded = tf.saved_model.load(str(model_dir))
    xt = tf.cast(tf.constant(x), tf.bfloat16)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = loaded.signatures["serving_default"](x=xt)["y"]
    return tf.cast(tape.jacobian(y, xt), tf.float32).numpy()


def wait_done(client, redis_conn, job_id: str) -> dict:
    work_burst(redis_conn)
    for _ in range(100):
        body = client.get(f"/v1/jobs/{job_id}").json()
        if body["status"] in ("succeeded", "failed"):
            return body
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish: {body}")


@pytest.mark.parametrize("how", ["json dtype bfloat16", "json dtype omitted", "npz float32"])
def test_bfloat16_input_is_carried_to_the_worker(client, redis_conn, model_root, how):
    x = x_values()
    if how == "npz float32":
        r = client.post("/v1/jobs", content=npz(x=x), params={"model_path": "mlp_bf16"},
                        headers={"Content-Type": "application/x-npz"})
    else:
        tensor = {"shape": [2, 8], "data": x.ravel().tolist()}
        if how == "json dtype bfloat16":
            tensor["dtype"] = "bfloat16"
        r = client.post("/v1/jobs", json={"model": {"path": "mlp_bf16"}, "inputs": {"x": tensor}})
    assert r.status_code == 202, r.text
    body = wait_done(client, redis_conn, r.json()["id"])
    assert body["status"] == "succeeded", body
    assert body["result"]["dtype"] == "float32" and body["result"]["shape"] == [2, 4, 2, 8]
    record = JobStore(redis_conn).get(r.json()["id"])
    assert record is not None
    rows = client.get(f"/v1/jobs/{r.json()['id']}/result", params={"rows": "0:8"})
    assert rows.status_code == 200, rows.text
    got = np.load(io.BytesIO(rows.content)).reshape(2, 4, 2, 8)
    want = tape_jacobian_bf16(model_root / "mlp_bf16", x)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * float(np.abs(want).max()))


def test_npz_member_written_as_bfloat16_is_refused_naming_the_input_and_the_fix(client, redis_conn):
    import ml_dtypes

    body = npz(x=x_values().astype(ml_dtypes.bfloat16))
    r = client.post("/v1/jobs", content=body, params={"model_path": "mlp_bf16"},
                    headers={"Content-Type": "application/x-npz"})
    assert r.status_code == 422, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("inputs.x.dtype:") and "bfloat16" in message and "float32" in message, message


def test_float64_for_a_bfloat16_input_names_float32_as_the_fix(client):
    r = client.post("/v1/jobs", json={"model": {"path": "mlp_bf16"},
                                      "inputs": {"x": {"shape": [2, 8], "dtype": "float64",
                                                       "data": x_values().ravel().tolist()}}})
    assert r.status_code == 422, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("inputs.x") and "wants bfloat16" in message and "send float32" in message, message
