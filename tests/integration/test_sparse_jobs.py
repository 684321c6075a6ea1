"""Sparse Jacobians through the service: POST with ``sparsity``, a real rq worker in this process on a real
redis-server, ``plan.sparsity`` in the status, dense rows over HTTP equal to GradientTape's, the result read
with scipy from the group alone; a dense pattern computed densely and saying why; ``pattern_from``."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from tests import sparse_hessian_models, sparse_models
from tests.conftest import finished_job, tensor
from worker.engine import load_model

pytestmark = pytest.mark.integration
IMAGE = np.random.default_rng(3).standard_normal((1, 20, 20, 3)).astype("float32")
X = np.random.default_rng(4).standard_normal((2, 6)).astype("float32")


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    sparse_models.conv_net(root / "conv", size=20, channels=(3, 2))
    sparse_models.mlp(root / "mlp")
    sparse_models.conv1d_net(root / "conv1d", length=64)
    sparse_models.no_rule(root / "no_rule")
    sparse_hessian_models.arrowhead(root / "arrow", n=24)
    return root


@pytest.fixture
def client(worker_client):
    return worker_client



def dense(model_root, name, inputs, of, wrt):
    import tensorflow as tf

    model = load_model(str(model_root / name))
    x = tf.constant(inputs[wrt])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = model.fn(**{wrt: x})[of]
    return tape.jacobian(y, x, experimental_use_pfor=False).numpy().reshape(int(np.prod(y.shape)), -1)


def test_sparse_job_over_http(client, redis_conn, model_root):
    import scipy.sparse as sp
    import zarr

    want = dense(model_root, "conv", {"image": IMAGE}, "out", "image")
    r = client.post("/v1/jobs", json={"model": {"path": "conv"}, "inputs": {"image": tensor(IMAGE)},
                                      "sparsity": "auto"})
    assert r.status_code == 202, r.text
    record = finished_job(client, redis_conn, r.json()["id"])
    info = record["plan"]["sparsity"]
    assert info["verified"] is True and info["source"] == "auto" and info["colors"] == 50
    assert record["plan"]["strategy"] == "sparse" and record["progress"]["fraction"] == 1.0
    assert record["result"]["format"] == "coo" and record["result"]["dense_shape"] == list(want.shape)
    group = zarr.open_group(record["result"]["uri"], mode="r")
    got = sp.coo_array((group["values"][...], (group["rows"][...], group["cols"][...])),
                       shape=tuple(group.attrs["shape"])).toarray()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    rows = client.get(f"/v1/jobs/{record['id']}/result", params={"rows": "100:140"})
    assert rows.status_code == 200, rows.text
    np.testing.assert_allclose(np.load(io.BytesIO(rows.content)).reshape(40, -1), want[100:140], rtol=1e-5,
                               atol=1e-6)
    picture = client.get(f"/v1/jobs/{record['id']}/preview.png")
    assert picture.status_code == 200 and picture.content.startswith(b"\x89PNG")

    again = client.post("/v1/jobs", json={"model": {"path": "conv"}, "inputs": {"image": tensor(IMAGE * 2)},
                                          "sparsity": {"pattern_from": record["id"]}})
    assert again.status_code == 202, again.text
    second = finished_job(client, redis_conn, again.json()["id"])
    assert second["plan"]["sparsity"]["source"] == "pattern_from" and second["plan"]["sparsity"]["verified"]


def test_a_dense_pattern_is_computed_densely_and_says_why(client, redis_conn, model_root):
    r = client.post("/v1/jobs", json={"model": {"path": "mlp"}, "inputs": {"x": tensor(X[:1])},
                                      "sparsity": "auto"})
    assert r.status_code == 202, r.text
    record = finished_job(client, redis_conn, r.json()["id"])
    info = record["plan"]["sparsity"]
    assert info["fallback"].startswith("dense: the pattern holds 100.0%") and info["verified"] is False
    assert record["result"].get("format") is None and record["result"]["shape"] == [1, 3, 1, 6]
    rows = client.get(f"/v1/jobs/{record['id']}/result", params={"rows": "0:3"})
    np.testing.assert_allclose(np.load(io.BytesIO(rows.content)).reshape(3, 6),
                               dense(model_root, "mlp", {"x": X[:1]}, "y", "x"), rtol=1e-5, atol=1e-6)


def test_a_keras_conv1d_job_is_computed_sparsely(client, redis_conn, model_root):
    """Keras Conv1D (ExpandDims, Conv2D, Squeeze; causal Pad; dilated SpaceToBatchND) is detected exactly and
    computed by compressed products, not handed back to the dense path (issue 30)."""
    import scipy.sparse as sp
    import zarr

    x = np.random.default_rng(5).standard_normal((2, 64, 2)).astype("float32")
    want = dense(model_root, "conv1d", {"x": x}, "y", "x")
    r = client.post("/v1/jobs", json={"model": {"path": "conv1d"}, "inputs": {"x": tensor(x)}, "sparsity": "auto"})
    assert r.status_code == 202, r.text
    record = finished_job(client, redis_conn, r.json()["id"])
    info = record["plan"]["sparsity"]
    assert record["plan"]["strategy"] == "sparse" and info["verified"] is True, info
    assert "fallback" not in info and "no_rule" not in info and info["nnz"] == int((want != 0).sum())
    assert info["colors"] < min(want.shape) // 2
    group = zarr.open_group(record["result"]["uri"], mode="r")
    got = sp.coo_array((group["values"][...], (group["rows"][...], group["cols"][...])),
                       shape=tuple(group.attrs["shape"])).toarray()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_op_without_a_rule_is_named_in_the_plan(client, redis_conn, model_root):
    x = np.random.default_rng(6).standard_normal((3, 4)).astype("float32")
    r = client.post("/v1/jobs", json={"model": {"path": "no_rule"}, "inputs": {"x": tensor(x)}, "sparsity": "auto"})
    assert r.status_code == 202, r.text
    record = finished_job(client, redis_conn, r.json()["id"])
    info = record["plan"]["sparsity"]
    assert list(info["no_rule"]) == ["TopKV2"]
    assert info["fallback"].startswith("dense: the pattern holds 100.0%") and "TopKV2 (" in info["fallback"]
    rows = client.get(f"/v1/jobs/{record['id']}/result", params={"rows": "0:12"})
    np.testing.assert_allclose(np.load(io.BytesIO(rows.content)).reshape(12, 12),
                               dense(model_root, "no_rule", {"x": x}, "y", "x"), rtol=1e-5, atol=1e-6)


def test_a_detected_pattern_is_shared_through_redis(worker_env, redis_conn, model_root, monkeypatch, tmp_path):
    """A second worker (its own empty cache folder) takes the pattern the first detected from Redis."""
    from app.main import create_app
    from worker.engine.sparsity import walk

    worker_env(1 << 20, CACHE_DIR=str(tmp_path / "first"))
    for key in redis_conn.scan_iter("jacobian:sparsity:*"):
        redis_conn.delete(key)
    body = {"model": {"path": "conv"}, "inputs": {"image": tensor(IMAGE * 3)}, "sparsity": "auto"}
    with TestClient(create_app()) as client:
        first = finished_job(client, redis_conn, client.post("/v1/jobs", json=body).json()["id"])
    assert list(redis_conn.scan_iter("jacobian:sparsity:*")), "the pattern was not shared"
    assert list((tmp_path / "first" / "sparsity").glob("*.npz"))

    def no_detect(*args, **kwargs):
        raise AssertionError("the shared pattern should have been used")

    monkeypatch.setattr(walk, "detect", no_detect)
    worker_env(1 << 20, CACHE_DIR=str(tmp_path / "second"))
    with TestClient(create_app()) as client:
        second = finished_job(client, redis_conn, client.post("/v1/jobs", json={**body, "inputs": {
            "image": tensor(IMAGE * 4)}}).json()["id"])
    assert second["plan"]["sparsity"]["nnz"] == first["plan"]["sparsity"]["nnz"]
    assert second["plan"]["sparsity"]["verified"] is True
    assert list((tmp_path / "second" / "sparsity").glob("*.npz"))   # kept in the second worker's folder too


def test_a_sparse_hessian_job_over_http(client, redis_conn, model_root):
    """Kind ``hessian`` with ``sparsity: "auto"`` (issue 27): star colouring of an arrowhead (2 HVPs), the COO group
    equal entry for entry to the tape Hessian, dense rows over HTTP, the status's ``plan.sparsity``."""
    import scipy.sparse as sp
    import zarr

    from tests.engine.reference import tape_hessian

    x = np.random.default_rng(8).uniform(0.5, 1.5, 24).astype("float32")
    want = tape_hessian(load_model(str(model_root / "arrow")), {"x": x}, "f", "x").reshape(24, 24)
    r = client.post("/v1/jobs", json={"model": {"path": "arrow"}, "inputs": {"x": tensor(x)}, "kind": "hessian",
                                      "of": "f", "wrt": "x", "sparsity": "auto"})
    assert r.status_code == 202, r.text
    record = finished_job(client, redis_conn, r.json()["id"])
    info = record["plan"]["sparsity"]
    assert record["plan"]["strategy"] == "sparse" and info["verified"] is True and info["colors"] == 2, info
    assert info["colouring"].startswith("star") and info["nnz"] == int((want != 0).sum())
    assert record["result"]["format"] == "coo" and record["result"]["dense_shape"] == [24, 24]
    group = zarr.open_group(record["result"]["uri"], mode="r")
    assert group.attrs["kind"] == "hessian"
    got = sp.coo_array((group["values"][...], (group["rows"][...], group["cols"][...])),
                       shape=tuple(group.attrs["shape"])).toarray()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    rows = client.get(f"/v1/jobs/{record['id']}/result", params={"rows": "0:3"})
    assert rows.status_code == 200, rows.text
    np.testing.assert_allclose(np.load(io.BytesIO(rows.content)).reshape(3, 24), want[:3], rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())
    again = client.post("/v1/jobs", json={"model": {"path": "arrow"}, "inputs": {"x": tensor(x * 2)}, "kind": "hessian",
                                          "of": "f", "wrt": "x", "sparsity": {"pattern_from": record["id"]}})
    assert again.status_code == 202, again.text
    second = finished_job(client, redis_conn, again.json()["id"])
    assert second["plan"]["sparsity"]["source"] == "pattern_from" and second["plan"]["sparsity"]["verified"]
    jacobian_from = client.post("/v1/jobs", json={"model": {"path": "arrow"}, "inputs": {"x": tensor(x)},
                                                  "of": "f", "wrt": "x", "sparsity": {"pattern_from": record["id"]}})
    assert jacobian_from.status_code == 422 and "computed another matrix: kind 'hessian'" in jacobian_from.text
