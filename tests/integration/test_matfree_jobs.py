"""The matrix-free kinds through the service: POST (JSON with ``seeds``, ``.npz`` with ``__seeds__``, ``wrt``
lists), a real rq worker in this process, the status, rows over HTTP and the result group read with xarray;
values equal to the dense route's (GradientTape, numpy). Refusals at POST name the field."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from tests import models
from tests.conftest import finished_job, work_burst
from tests.engine.reference import tape_hessian, tape_jacobian
from worker.engine import load_model

pytestmark = pytest.mark.integration
X = np.random.default_rng(0).normal(size=(3, 5))


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    models.float64_model(root / "f64")
    return root


@pytest.fixture
def client(worker_client):
    return worker_client


def body(**options) -> dict:
    return {"model": {"path": "f64"}, "inputs": {"x": {"shape": [3, 5], "dtype": "float64",
                                                       "data": X.ravel().tolist()}}, **options}


def test_svd_and_hessian_kinds_over_http(client, redis_conn, model_root):
    import xarray as xr

    model = load_model(str(model_root / "f64"))
    J = tape_jacobian(model, {"x": X}, "y", "x").reshape(12, 15)
    r = client.post("/v1/jobs", json=body(of="y", wrt="x", kind="svd", rank=2, tol=1e-8))
    assert r.status_code == 202, r.text
    record = finished_job(client, redis_conn, r.json()["id"])
    assert record["result"]["shape"] == [2] and record["progress"]["fraction"] == 1.0
    assert record["plan"]["strategy"] == "matrix-free" and record["plan"]["products"]["vjp"] > 0
    ds = xr.open_zarr(record["result"]["uri"])
    np.testing.assert_allclose(ds["S"].values, np.linalg.svd(J, compute_uv=False)[:2], rtol=1e-6)
    rows = client.get(f"/v1/jobs/{record['id']}/result", params={"rows": "0:2"})
    assert rows.status_code == 200, rows.text
    np.testing.assert_allclose(np.load(io.BytesIO(rows.content)), ds["S"].values)
    picture = client.get(f"/v1/jobs/{record['id']}/preview.png")  # the spectrum as a plot
    assert picture.status_code == 200 and picture.content.startswith(b"\x89PNG"), picture.text[:200]

    H = tape_hessian(model, {"x": X}, "loss", "x").reshape(15, 15)
    r = client.post("/v1/jobs", json=body(of="loss", wrt=["x"], kind="hessian_trace", samples=15))
    trace = xr.open_zarr(finished_job(client, redis_conn, r.json()["id"])["result"]["uri"])
    np.testing.assert_allclose(float(trace["trace"]), np.trace(H), rtol=1e-9)


def test_an_unconverged_svd_fails_loudly_unless_allowed(client, redis_conn, model_root):
    """Within 1 iteration svd cannot meet tol 1e-12: the job fails NotConverged naming the residuals and the fixes;
    with allow_unconverged it succeeds, and the status, the manifest and the group's attributes say unconverged."""
    import json

    import zarr

    r = client.post("/v1/jobs", json=body(of="y", wrt="x", kind="svd", rank=3, tol=1e-12, max_iterations=1))
    assert r.status_code == 202, r.text
    work_burst(redis_conn)
    record = client.get(f"/v1/jobs/{r.json()['id']}").json()
    assert record["status"] == "failed" and record["error"]["type"] == "NotConverged", record
    message = record["error"]["message"]
    assert "relative residuals [" in message and "max_iterations (now 1)" in message
    assert "allow_unconverged: true" in message and record["result"] is None

    r = client.post("/v1/jobs", json=body(of="y", wrt="x", kind="svd", rank=3, tol=1e-12, max_iterations=1,
                                          allow_unconverged=True))
    record = finished_job(client, redis_conn, r.json()["id"])
    result = record["result"]
    assert result["converged"] is False and result["warning"].startswith("not converged"), result
    group = zarr.open_group(result["uri"], mode="r")
    assert group.attrs["converged"] is False and group.attrs["allow_unconverged"] is True
    assert group.attrs["plan"]["converged"] is False
    manifest = json.loads((Path(result["uri"]).parent / "manifest.json").read_text())
    assert manifest["converged"] is False and "warning" in manifest

    converged = finished_job(client, redis_conn, client.post("/v1/jobs", json=body(
        of="y", wrt="x", kind="svd", rank=2, tol=1e-8)).json()["id"])
    assert converged["result"]["converged"] is True and converged["result"].get("warning") is None


def test_allow_unconverged_and_max_iterations_are_refused_for_other_kinds(client):
    for field, value in (("allow_unconverged", True), ("max_iterations", 10)):
        r = client.post("/v1/jobs", json=body(of="y", wrt="x", kind="jacobian", **{field: value}))
        assert r.status_code == 422 and f"{field}: only for kind 'svd' or 'hessian_eig'" in r.text, r.text


def test_products_with_seeds_in_json_and_in_an_npz_over_several_wrt(client, redis_conn, model_root):
    import xarray as xr

    model = load_model(str(model_root / "f64"))
    seeds = np.random.default_rng(1).normal(size=(4, 3, 4))
    r = client.post("/v1/jobs", json=body(of="y", wrt="x", kind="vjp", seeds={
        "shape": [4, 3, 4], "dtype": "float64", "data": seeds.ravel().tolist()}))
    assert r.status_code == 202, r.text
    ds = xr.open_zarr(finished_job(client, redis_conn, r.json()["id"])["result"]["uri"])
    J = tape_jacobian(model, {"x": X}, "y", "x").reshape(12, 15)
    np.testing.assert_allclose(ds["products"].values.reshape(4, 15), seeds.reshape(4, 12) @ J, rtol=1e-10)

    tangents = np.random.default_rng(2).normal(size=(3, 15 + 20))
    buf = io.BytesIO()
    np.savez(buf, x=X, __seeds__=tangents)
    r = client.post("/v1/jobs", content=buf.getvalue(), headers={"Content-Type": "application/x-npz"},
                    params={"model_path": "f64", "of": "y", "wrt": "x,variables/w", "kind": "jvp"})
    assert r.status_code == 202, r.text
    record = finished_job(client, redis_conn, r.json()["id"])
    ds = xr.open_zarr(record["result"]["uri"])
    Jw = tape_jacobian(model, {"x": X}, "y", "variables/w").reshape(12, 20)
    want = tangents @ np.concatenate([J, Jw], axis=1).T
    np.testing.assert_allclose(ds["products"].values.reshape(3, 12), want, rtol=1e-10, atol=1e-12)
    assert ds.attrs["wrt"] == ["x", "variables/w"] and ds.attrs["wrt_slices"]["variables/w"]["start"] == 15
    picture = client.get(f"/v1/jobs/{record['id']}/preview.png")  # products as a heatmap, seeds down
    assert picture.status_code == 200 and picture.headers["x-preview-matrix"] == "3x12", picture.headers


@pytest.mark.parametrize("options,field", [
    ({"of": "y", "kind": "jvp"}, "seeds"),                          # products need seeds
    ({"of": "y", "kind": "svd"}, "rank"),                           # svd needs a rank
    ({"of": "y", "kind": "hessian_eig", "rank": 2}, "of"),          # a Hessian of a non-scalar output
    ({"of": "loss", "kind": "hessian_trace", "wrt": ["x", "x"]}, "wrt"),
    ({"of": "loss", "kind": "hessian_trace", "wrt": ["nope"]}, "wrt"),
    ({"of": "y", "kind": "batch_jacobian", "wrt": ["x", "variables/w"]}, "wrt"),  # a variable has no batch axis
    ({"of": "y", "kind": "svd", "rank": 2, "samples": 5}, "samples"),
])
def test_refusals_at_post_name_the_field(client, redis_conn, options, field):
    r = client.post("/v1/jobs", json=body(**options))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"].startswith(f"{field}:"), r.json()


def test_a_bad_rank_found_by_the_worker_fails_the_job_naming_the_field(client, redis_conn):
    r = client.post("/v1/jobs", json=body(of="y", kind="svd", rank=50))  # min(12, 15) = 12
    assert r.status_code == 202, r.text
    work_burst(redis_conn)
    record = client.get(f"/v1/jobs/{r.json()['id']}").json()
    assert record["status"] == "failed" and record["error"]["message"].startswith("rank:"), record


def test_the_python_client_sends_seeds_and_several_wrt(client, redis_conn, model_root):
    from jacobian.client import JacobianClient

    model = load_model(str(model_root / "f64"))
    seeds = np.random.default_rng(3).normal(size=(2, 3, 4))
    with JacobianClient("http://testserver", transport=client._transport) as jc:
        job_id = jc.submit("f64", {"x": X}, of="y", wrt=["x", "variables/w"], kind="vjp", seeds=seeds)
        work_burst(redis_conn)
        assert jc.job(job_id).status.value == "succeeded"
        ds = jc.result(job_id, as_xarray=True)
        lazy = jc.result(job_id)  # the kind's main array, products
    J = np.concatenate([tape_jacobian(model, {"x": X}, "y", "x").reshape(12, 15),
                        tape_jacobian(model, {"x": X}, "y", "variables/w").reshape(12, 20)], axis=1)
    np.testing.assert_allclose(ds["products"].values, seeds.reshape(2, 12) @ J, rtol=1e-10, atol=1e-12)
    assert lazy.shape == (2, 35)


def test_products_split_into_shards_equal_the_unsharded_products(worker_env, redis_conn, model_root):
    """A vjp job of 50 seeds in blocks of 10 seeds, ``shards: 3``: three rq shards and a finalizer; the products
    equal the unsharded job's to rounding (a shard's calls hold other numbers of seeds, which moves the last
    bit), and each shard's plan is kept."""
    import xarray as xr

    from app.main import create_app

    worker_env(10 * 15 * 8)   # a seed's product: 15 float64
    seeds = np.random.default_rng(5).normal(size=(50, 3, 4))
    spec = {"shape": [50, 3, 4], "dtype": "float64", "data": seeds.ravel().tolist()}
    with TestClient(create_app()) as client:
        sharded = client.post("/v1/jobs", json=body(of="y", wrt="x", kind="vjp", seeds=spec, shards=3))
        whole = client.post("/v1/jobs", json=body(of="y", wrt="x", kind="vjp", seeds=spec, shards=1))
        assert sharded.status_code == whole.status_code == 202, sharded.text
        a = finished_job(client, redis_conn, sharded.json()["id"])
        b = finished_job(client, redis_conn, whole.json()["id"])
    assert a["plan"]["shards"] == 3 and len(a["plan"]["shard_plans"]) == 3, a["plan"]
    assert all(p["products"]["vjp"] >= 10 for p in a["plan"]["shard_plans"])
    assert a["plan"]["products"]["vjp"] >= 50 and a["plan"]["kind"] == "vjp"
    assert a["progress"]["rows_done"] == 50 and a["progress"]["rows_per_second"] > 0   # every shard's seeds counted
    assert a["result"]["shape"] == b["result"]["shape"] == [50, 3, 5]
    got, want = (xr.open_zarr(r["result"]["uri"])["products"].values for r in (a, b))
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-15)
    model = load_model(str(model_root / "f64"))
    J = tape_jacobian(model, {"x": X}, "y", "x").reshape(12, 15)
    np.testing.assert_allclose(got.reshape(50, 15), seeds.reshape(50, 12) @ J, rtol=1e-10)
