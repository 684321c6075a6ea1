"""Sparse Jacobians through the HTTP API against a real redis-server, the worker simulated: the ``sparsity``
option at ``POST /v1/jobs`` (JSON and ``.npz`` query; refusals naming the field), and a sparse result (a COO
group written here as the format contract says) read as dense rows, as a preview and by the Python client."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from contracts.jobspec import JobStatus
from contracts.jobstore import JobStore
from contracts.records import PlanInfo, ResultInfo
from contracts.settings import get_settings
from jacobian.client import JacobianClient
from tests.sparse_group import random_matrix, write_sparse_group

pytestmark = pytest.mark.integration
NPZ = {"Content-Type": "application/x-npz"}


def mlp_body(**extra) -> dict:
    return {"model": {"path": "mlp"}, "inputs": {"x": {"shape": [2, 8], "data": np.linspace(-1, 1, 16).tolist()}},
            **extra}


def multi_io_body(**extra) -> dict:
    return {"model": {"path": "multi_io"}, "inputs": {"a": {"shape": [1, 4], "data": [1, 2, 3, 4]},
                                                      "b": {"shape": [1, 3], "data": [1, 2, 3]}}, **extra}


def npz_body() -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8))
    return buf.getvalue()


def spec_of(store: JobStore, job_id: str) -> dict:
    return store.get(job_id).spec


def refused(r, field: str, *texts: str) -> str:
    assert r.status_code == 422, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{field}: "), message
    assert all(t in message for t in texts), message
    return message


def succeed(redis_conn, job_id: str, result: dict | None = None) -> None:
    store = JobStore(redis_conn)
    store.transition(job_id, JobStatus.running)
    result = result or {"uri": "/nowhere", "shape": [8, 16], "dtype": "float32"}
    store.transition(job_id, JobStatus.succeeded, finished_at=time.time(), result=ResultInfo.model_validate(result))


def test_sparsity_travels_in_the_spec_from_json_and_from_the_npz_query(client, redis_conn):
    store = JobStore(redis_conn)
    r = client.post("/v1/jobs", json=mlp_body(sparsity="auto"))
    assert r.status_code == 202, r.text
    assert spec_of(store, r.json()["id"])["sparsity"] == "auto"
    r = client.post("/v1/jobs", content=npz_body(), headers=NPZ, params={"model_path": "mlp", "sparsity": "auto"})
    assert r.status_code == 202, r.text
    earlier = r.json()["id"]
    assert spec_of(store, earlier)["sparsity"] == "auto"
    assert spec_of(store, client.post("/v1/jobs", json=mlp_body()).json()["id"])["sparsity"] is None

    succeed(redis_conn, earlier)
    for query in (f"pattern_from:{earlier}", json.dumps({"pattern_from": earlier})):
        r = client.post("/v1/jobs", content=npz_body(), headers=NPZ, params={"model_path": "mlp", "sparsity": query})
        assert r.status_code == 202, r.text
        assert spec_of(store, r.json()["id"])["sparsity"] == {"pattern_from": earlier}


def test_sparsity_refused_where_it_does_not_apply(client):
    refused(client.post("/v1/jobs", json=mlp_body(sparsity="auto", kind="hessian_diag", reduce="sum")),
            "sparsity",
            "only for kind 'jacobian' or 'hessian'", "remove sparsity")
    refused(client.post("/v1/jobs", json=mlp_body(sparsity="auto", wrt="variables/d0/kernel")), "sparsity",
            "one signature input")
    refused(client.post("/v1/jobs", json=mlp_body(sparsity="dense")), "sparsity", "use one of null, 'auto'")
    refused(client.post("/v1/jobs", json=mlp_body(sparsity={"pattern_uri": "p.npz", "x": 1})), "sparsity")
    r = client.post("/v1/jobs", content=npz_body(), headers=NPZ,
                    params={"model_path": "mlp", "sparsity": "auto", "kind": "batch_jacobian"})
    refused(r, "sparsity", "only for kind 'jacobian' or 'hessian'")


def test_pattern_from_names_a_succeeded_job_of_the_same_jacobian(client, redis_conn):
    unknown = "f" * 32
    refused(client.post("/v1/jobs", json=mlp_body(sparsity={"pattern_from": unknown})), "sparsity.pattern_from",
            f"no job {unknown!r}")
    queued = client.post("/v1/jobs", json=mlp_body()).json()["id"]
    refused(client.post("/v1/jobs", json=mlp_body(sparsity={"pattern_from": queued})), "sparsity.pattern_from",
            "is queued", "once its status is 'succeeded'")
    succeed(redis_conn, queued)
    r = client.post("/v1/jobs", json=mlp_body(sparsity={"pattern_from": queued}))
    assert r.status_code == 202, r.text

    u_of_a = client.post("/v1/jobs", json=multi_io_body(of="u", wrt="a")).json()["id"]
    succeed(redis_conn, u_of_a)
    assert client.post("/v1/jobs", json=multi_io_body(of="u", wrt="a", sparsity={"pattern_from": u_of_a})
                       ).status_code == 202
    refused(client.post("/v1/jobs", json=multi_io_body(of="v", wrt="a", sparsity={"pattern_from": u_of_a})),
            "sparsity.pattern_from", "computed another matrix: of 'u' (this job: 'v')")
    refused(client.post("/v1/jobs", json=mlp_body(sparsity={"pattern_from": u_of_a})), "sparsity.pattern_from",
            "model ", "multi_io", "same model, signature, of and wrt")


def test_pattern_uri_is_a_rows_and_cols_npz_under_the_results(client, results, redis_conn, tmp_path):
    results.mkdir(parents=True, exist_ok=True)

    def npz_at(path: Path, **arrays) -> str:
        np.savez(path, **arrays)
        return str(path)

    good = npz_at(results / "pattern.npz", rows=np.array([0, 1, 9]), cols=np.array([0, 1, 9]))
    r = client.post("/v1/jobs", json=mlp_body(sparsity={"pattern_uri": good}))
    assert r.status_code == 202, r.text
    assert spec_of(JobStore(redis_conn), r.json()["id"])["sparsity"] == {"pattern_uri": good}
    r = client.post("/v1/jobs", content=npz_body(), headers=NPZ,
                    params={"model_path": "mlp", "sparsity": f"pattern_uri:{good}"})
    assert r.status_code == 202, r.text

    outside = npz_at(tmp_path / "elsewhere.npz", rows=np.array([0]), cols=np.array([0]))
    for uri, texts in (
        (outside, ("is not under the results storage", "or use sparsity='auto'")),
        (str(results / "missing.npz"), ("nothing at",)),
        (npz_at(results / "nocols.npz", rows=np.array([0])), ("has no array 'cols'",)),
        (npz_at(results / "flat.npz", rows=np.zeros((2, 2), int), cols=np.zeros(4, int)), ("not a 1-d integer",)),
        (npz_at(results / "float.npz", rows=np.zeros(2), cols=np.zeros(2, int)), ("'rows' is float64",)),
        (npz_at(results / "ragged.npz", rows=np.zeros(2, int), cols=np.zeros(3, int)), ("one row and one column",)),
    ):
        refused(client.post("/v1/jobs", json=mlp_body(sparsity={"pattern_uri": uri})), "sparsity.pattern_uri", *texts)
    (results / "junk.npz").write_bytes(b"not a zip")
    refused(client.post("/v1/jobs", json=mlp_body(sparsity={"pattern_uri": str(results / "junk.npz")})),
            "sparsity.pattern_uri", "not a readable .npz")


# -- a sparse result --------------------------------------------------------------------------------------


def block_diagonal(seed: int = 0):
    """J of mlp on 2 examples, (2*4) x (2*8): each example's outputs depend on its own inputs only."""
    import scipy.sparse as sps

    blocks = [random_matrix(4, 8, 0.5, seed=seed + i).toarray() for i in range(2)]
    return sps.csr_array(sps.block_diag(blocks)).astype(np.float32)


def make_sparse_job(client, redis_conn, results, *, described: bool = True):
    """A job whose result is a sparse Jacobian; ``(job id, matrix)``. ``described``: its record's result
    has ``format`` and ``dense_shape`` (else only ``plan.sparsity`` says it is sparse)."""
    job_id = client.post("/v1/jobs", json=mlp_body(sparsity="auto")).json()["id"]
    matrix = block_diagonal()
    uri = f"{results}/{job_id}/result.zarr"
    manifest = write_sparse_group(uri, matrix, of_shape=(2, 4), wrt_shape=(2, 8), chunk=5)
    result = {"uri": uri, "shape": manifest["shape"], "dtype": "float32"}
    if described:
        result |= {"format": "coo", "dense_shape": manifest["dense_shape"]}
    store = JobStore(redis_conn)
    store.transition(job_id, JobStatus.running)
    store.transition(job_id, JobStatus.succeeded, finished_at=time.time(),
                     plan=PlanInfo.model_validate(manifest["plan"]), result=ResultInfo.model_validate(result))
    return job_id, matrix


@pytest.fixture
def sparse_job(client, redis_conn, results):
    return make_sparse_job(client, redis_conn, results)


def test_rows_of_a_sparse_result_are_dense_rows_of_the_matrix(client, sparse_job):
    job_id, matrix = sparse_job
    dense = matrix.toarray().reshape(8, 2, 8)
    for rows, want in ((None, dense), ("0:8", dense), ("3:6", dense[3:6]), ("7", dense[7:]), (":2", dense[:2]),
                       ("5:", dense[5:])):
        r = client.get(f"/v1/jobs/{job_id}/result", params={} if rows is None else {"rows": rows})
        assert r.status_code == 200, (rows, r.text)
        assert r.headers["x-rows-total"] == "8" and json.loads(r.headers["x-row-shape"]) == [2, 8]
        assert r.headers["x-result-format"] == "coo" and int(r.headers["content-length"]) == len(r.content)
        got = np.load(io.BytesIO(r.content), allow_pickle=False)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)
    assert client.get(f"/v1/jobs/{job_id}/result", params={"rows": "0:9"}).status_code == 416
    refused(client.get(f"/v1/jobs/{job_id}/result", params={"rows": "4:2"}), "rows", "is empty")

    public = client.get(f"/v1/jobs/{job_id}").json()
    assert public["plan"]["sparsity"]["colors"] == 3 and public["plan"]["sparsity"]["verified"] is True
    assert public["result"]["format"] == "coo" and public["result"]["dense_shape"] == [8, 16]


def test_rows_of_a_sparse_result_keep_to_the_response_limit(env, sparse_job, monkeypatch):
    job_id, matrix = sparse_job
    monkeypatch.setenv("JACOBIAN_MAX_BODY_BYTES", "200")  # 3 rows of 64 bytes
    get_settings.cache_clear()
    with TestClient(create_app()) as small:
        message = refused(small.get(f"/v1/jobs/{job_id}/result", params={"rows": "0:8"}), "rows")
        assert "ask for at most 3 rows at a time, e.g. rows=0:3" in message
        r = small.get(f"/v1/jobs/{job_id}/result", params={"rows": "2:5"})
        np.testing.assert_array_equal(np.load(io.BytesIO(r.content)).reshape(3, 16), matrix.toarray()[2:5])


def test_preview_of_a_sparse_result_is_its_pattern(client, sparse_job):
    job_id, matrix = sparse_job
    r = client.get(f"/v1/jobs/{job_id}/preview.png", params={"size": 16})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png" and r.content.startswith(b"\x89PNG")
    assert r.headers["x-preview-nnz"] == str(matrix.nnz) and r.headers["x-preview-matrix"] == "8x16"


def test_client_returns_a_coo_array_and_dense_rows(client, sparse_job, redis_conn, results):
    from scipy.sparse import coo_array

    job_id, matrix = sparse_job
    with JacobianClient("http://testserver", transport=client._transport) as jc:
        coo = jc.result(job_id)
        assert isinstance(coo, coo_array) and coo.shape == (8, 16) and coo.dtype == np.float32
        np.testing.assert_array_equal(coo.toarray(), matrix.toarray())
        np.testing.assert_array_equal(jc.result(job_id, rows=slice(2, 5)).reshape(3, 16), matrix.toarray()[2:5])
        assert jc.open_result(job_id).shape == (matrix.nnz,)  # the main array: values
        assert jc.row_geometry(job_id) == (8, 64)
        pages = list(jc.iter_rows(job_id, page_bytes=130))
        assert [p.shape for p in pages] == [(2, 2, 8)] * 4
        # a record that says only plan.sparsity (no result.format): the geometry comes from the API
        job_id, matrix = make_sparse_job(client, redis_conn, results, described=False)
        assert jc.row_geometry(job_id) == (8, 64)
        pages = list(jc.iter_rows(job_id, page_bytes=130))
        assert [p.shape[0] for p in pages] == [2] * 4
        np.testing.assert_array_equal(np.concatenate(pages).reshape(8, 16), matrix.toarray())
        assert isinstance(jc.result(job_id), coo_array)
