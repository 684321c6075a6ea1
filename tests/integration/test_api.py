"""The HTTP API against a real redis-server, local-disk and S3 results; the worker is simulated."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from app.main import create_app
from contracts import storage
from contracts.jobspec import JobStatus, QueuedJob
from contracts.jobstore import JobStore
from contracts.layout import ResultLayout
from contracts.records import ErrorInfo, PlanInfo, Progress, ResultInfo
from contracts.settings import get_settings

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
def mlp_body(batch: int = 2, **extra) -> dict:
    x = np.linspace(-1, 1, batch * 8).tolist()
    return {"model": {"path": "mlp"}, "inputs": {"x": {"shape": [batch, 8], "data": x}}, **extra}


def fetch_rq(redis_conn, job_id: str) -> Job:
    return Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)


def test_submit_json_stores_inputs_record_and_rq_job(client, redis_conn, results, model_root):
    r = client.post("/v1/jobs", json=mlp_body())
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert r.json() == {"id": job_id, "status": "queued"}
    assert r.headers["location"] == f"/v1/jobs/{job_id}"

    settings = get_settings()
    job = fetch_rq(redis_conn, job_id)
    assert job.func_name == "worker.tasks.run_job"
    assert job.origin == settings.queue_name == "jacobian"
    assert job.timeout == settings.job_timeout_s + 60   # the worker enforces the limit; rq's is the backstop
    assert job.result_ttl == settings.result_ttl_s and job.failure_ttl == settings.result_ttl_s
    assert job.retries_left == settings.job_retries and job.retry_intervals == [5, 30]
    assert Queue("jacobian", connection=redis_conn).job_ids == [job_id]
    (spec,) = job.args
    queued = QueuedJob.model_validate(spec)
    assert queued.id == job_id and queued.of == "y" and queued.wrt == "x"
    assert queued.model.path == str(model_root / "mlp") and queued.model.signature == "serving_default"
    assert queued.results_url == str(results) and queued.kind.value == "jacobian"
    assert queued.inputs_uri == f"{results}/{job_id}/inputs.npz"
    with np.load(queued.inputs_uri) as npz:
        np.testing.assert_array_equal(npz["x"], np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8))
        assert npz["x"].dtype == np.float32

    record = JobStore(redis_conn).get(job_id)
    assert record.status == JobStatus.queued and record.spec == spec
    public = client.get(f"/v1/jobs/{job_id}").json()
    assert public["status"] == "queued" and public["kind"] == "jacobian"
    assert public["progress"]["rows_done"] == 0 and public["created_at"].endswith("Z")


@pytest.mark.parametrize("body,of,wrt", [
    ({"model": {"path": "multi_io"}, "of": "v", "wrt": "b",
      "inputs": {"a": {"shape": [1, 4], "data": [1, 2, 3, 4]}, "b": {"shape": [1, 3], "data": [[1, 2, 3]]}}},
     "v", "b"),
    ({"model": {"path": "int_input"},
      "inputs": {"ids": {"shape": [1, 4], "dtype": "int32", "data": [1, 2, 3, 9]},
                 "x": {"shape": [1, 4], "data": [0] * 4}}},
     "y", "x"),
    ({"model": {"path": "float64"}, "of": "loss", "kind": "hessian",
      "inputs": {"x": {"shape": [3, 5], "data": [0.5] * 15}}}, "loss", "x"),
    ({"model": {"path": "float64"}, "of": "y", "kind": "hessian", "reduce": "sum",
      "inputs": {"x": {"shape": [3, 5], "dtype": "float64", "data": [0.5] * 15}}}, "y", "x"),
    (mlp_body(kind="batch_jacobian", mode="forward", check_independence=True), "y", "x"),
    (mlp_body(wrt="variables/d0/kernel"), "y", "variables/d0/kernel"),
    (mlp_body(wrt="variables/out/bias:0"), "y", "variables/out/bias"),
    ({"model": {"path": "control_flow"}, "inputs": {"x": {"shape": [3], "data": [0.1, 0.2, 0.3]}}}, "y", "x"),
])
def test_of_and_wrt_resolved(client, redis_conn, body, of, wrt):
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    spec = fetch_rq(redis_conn, r.json()["id"]).args[0]
    assert (spec["of"], spec["wrt"]) == (of, wrt)
    with np.load(spec["inputs_uri"]) as npz:  # an omitted dtype takes the signature's
        for name, t in body["inputs"].items():
            assert list(npz[name].shape) == t["shape"]
    if body["model"]["path"] == "float64":
        with np.load(spec["inputs_uri"]) as npz:
            assert npz["x"].dtype == np.float64


def test_submit_npz_body_with_query_options(client, redis_conn):
    a, b = np.ones((2, 4), np.float32), np.arange(6, dtype=np.float32).reshape(2, 3)
    buf = io.BytesIO()
    np.savez(buf, a=a, b=b)
    r = client.post("/v1/jobs", content=buf.getvalue(), headers={"Content-Type": "application/x-npz"},
                    params={"model_path": "multi_io", "of": "u", "wrt": "a", "kind": "batch_jacobian",
                            "memory_budget_bytes": "1000000", "check_independence": "true", "precision": "tf32"})
    assert r.status_code == 202, r.text
    spec = fetch_rq(redis_conn, r.json()["id"]).args[0]
    assert (spec["of"], spec["wrt"], spec["kind"]) == ("u", "a", "batch_jacobian")
    assert spec["memory_budget_bytes"] == 1000000 and spec["check_independence"] is True
    assert spec["precision"] == "tf32"
    bad = client.post("/v1/jobs", content=buf.getvalue(), headers={"Content-Type": "application/x-npz"},
                      params={"model_path": "multi_io", "precision": "fp16"})
    assert bad.status_code == 422 and "precision" in bad.json()["error"]["message"], bad.text
    with np.load(spec["inputs_uri"]) as npz:
        np.testing.assert_array_equal(npz["b"], b)


def test_submit_with_inputs_uri_under_results(client, redis_conn, results):
    results.mkdir(parents=True)
    buf = io.BytesIO()
    np.savez(buf, x=np.zeros((3, 8), np.float32))
    (results / "upload.npz").write_bytes(buf.getvalue())
    r = client.post("/v1/jobs", json={"model": {"path": "mlp"}, "inputs_uri": str(results / "upload.npz")})
    assert r.status_code == 202, r.text
    spec = fetch_rq(redis_conn, r.json()["id"]).args[0]
    assert spec["inputs_uri"].endswith(f"{r.json()['id']}/inputs.npz")
    r = client.post("/v1/jobs", json={"model": {"path": "mlp"}, "inputs_uri": "/etc/passwd"})
    assert r.status_code == 422 and "inputs_uri" in r.json()["error"]["message"]


def test_idempotency_key(client, redis_conn):
    h = {"Idempotency-Key": "abc-123"}
    first = client.post("/v1/jobs", json=mlp_body(), headers=h)
    again = client.post("/v1/jobs", json=mlp_body(), headers=h)
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"]
    assert Queue("jacobian", connection=redis_conn).count == 1
    reordered = json.dumps(dict(reversed(list(mlp_body().items()))), indent=2)  # same job, other bytes
    same = client.post("/v1/jobs", content=reordered, headers={**h, "Content-Type": "application/json"})
    assert same.status_code == 202 and same.json()["id"] == first.json()["id"]
    other = client.post("/v1/jobs", json=mlp_body(batch=3), headers=h)
    assert other.status_code == 422
    assert other.json()["error"]["message"].startswith("Idempotency-Key:")
    assert Queue("jacobian", connection=redis_conn).count == 1
    assert client.post("/v1/jobs", json=mlp_body(), headers={"Idempotency-Key": "x y"}).status_code == 422


def test_list_jobs_pages_and_filters(client, redis_conn):
    ids = [client.post("/v1/jobs", json=mlp_body()).json()["id"] for _ in range(3)]
    page = client.get("/v1/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in page["jobs"]] == ids[::-1][:2] and page["next_page_token"]
    rest = client.get("/v1/jobs", params={"limit": 2, "page_token": page["next_page_token"]}).json()
    assert [j["id"] for j in rest["jobs"]] == [ids[0]] and rest["next_page_token"] is None
    JobStore(redis_conn).transition(ids[1], JobStatus.running)
    running = client.get("/v1/jobs", params={"status": "running"}).json()["jobs"]
    assert [j["id"] for j in running] == [ids[1]]
    bad = client.get("/v1/jobs", params={"page_token": "!!"})
    assert bad.status_code == 422 and "page_token" in bad.json()["error"]["message"]
    assert client.get("/v1/jobs", params={"status": "bogus"}).status_code == 422


def test_list_pages_through_jobs_created_in_the_same_instant(client, redis_conn):
    """Two API processes can stamp two jobs with the same ``created_at``: a page boundary between
    them must neither skip nor repeat one (the token carries the last id as a tie-break)."""
    ids = [client.post("/v1/jobs", json=mlp_body()).json()["id"] for _ in range(5)]
    same = 1_800_000_000.25
    for job_id in ids:
        redis_conn.zadd(JobStore.index_key, {job_id: same})
        redis_conn.hset(JobStore(redis_conn).key(job_id), "created_at", repr(same))
    seen, token = [], None
    for _ in range(10):
        page = client.get("/v1/jobs", params={"limit": 2, **({"page_token": token} if token else {})}).json()
        seen += [j["id"] for j in page["jobs"]]
        token = page["next_page_token"]
        if token is None:
            break
    assert sorted(seen) == sorted(ids) and len(seen) == len(ids), seen
    assert seen == sorted(ids, reverse=True)


def test_unknown_job_is_404(client):
    for r in (client.get("/v1/jobs/nope"), client.post("/v1/jobs/nope/cancel"), client.get("/v1/jobs/nope/result")):
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "JobNotFound" and "nope" in r.json()["error"]["message"]


def test_only_issued_ids_reach_redis_or_the_log(client, redis_conn, caplog):
    """A path id that the service could not have issued is a 404 before Redis is asked, and is not logged
    as a job id (the shard hash of a real job is not reachable through '{id}:shards')."""
    job_id = client.post("/v1/jobs", json=mlp_body()).json()["id"]
    redis_conn.hset(f"jacobian:job:{job_id}:shards", "plan", json.dumps({"shards": 2}))
    before = redis_conn.hgetall(f"jacobian:job:{job_id}:shards")
    caplog.set_level("INFO")
    for bad in (f"{job_id}:shards", job_id.upper(), "x" * 300):
        assert client.get(f"/v1/jobs/{bad}").status_code == 404
        r = client.post(f"/v1/jobs/{bad}/cancel")
        assert r.status_code == 404 and r.json()["error"]["type"] == "JobNotFound"
    assert redis_conn.hgetall(f"jacobian:job:{job_id}:shards") == before
    assert not [r for r in caplog.records if getattr(r, "job_id", None) not in (None, job_id)]
    assert client.get(f"/v1/jobs/{job_id}").status_code == 200


def test_cancel_queued_running_and_finished(client, redis_conn, results):
    store = JobStore(redis_conn)
    queued = client.post("/v1/jobs", json=mlp_body()).json()["id"]
    assert (results / queued / "inputs.npz").is_file()
    body = client.post(f"/v1/jobs/{queued}/cancel").json()
    assert body["status"] == "canceled" and body["finished_at"]
    assert body["error"] == {"type": "Canceled", "message": "canceled before it started"}
    assert 0 < redis_conn.ttl(store.key(queued)) <= get_settings().result_ttl_s  # set with the status
    assert not (results / queued).exists()  # it will never run: its inputs are removed
    assert Queue("jacobian", connection=redis_conn).count == 0
    assert fetch_rq(redis_conn, queued).get_status() == "canceled"
    assert store.is_cancel_requested(queued)

    running = client.post("/v1/jobs", json=mlp_body()).json()["id"]
    Queue("jacobian", connection=redis_conn).remove(running)  # as if a worker had dequeued it
    fetch_rq(redis_conn, running).set_status("started")
    store.transition(running, JobStatus.running)
    assert client.post(f"/v1/jobs/{running}/cancel").json()["status"] == "running"
    assert store.is_cancel_requested(running)  # the worker stops between chunks (and removes its data)
    assert (results / running / "inputs.npz").is_file()

    store.transition(running, JobStatus.succeeded)
    assert client.post(f"/v1/jobs/{running}/cancel").json()["status"] == "succeeded"


def write_result(uri: str, full: np.ndarray, iter_start: int, iter_stop: int, block_bytes: int, *,
                 legacy: bool = False) -> None:
    """What the worker writes: a group ``uri`` holding the zarr v3 array ``jacobian`` in row blocks with the
    layout attributes; ``legacy``: the array alone at ``uri``, as results were stored before the group."""
    import zarr

    layout = ResultLayout(full.shape, iter_start, iter_stop, itemsize=full.itemsize, block_bytes=block_bytes)
    store = storage.zarr_store(uri, read_only=False)
    attrs = {"shape": list(full.shape), "iter_start": iter_start, "iter_stop": iter_stop}
    if legacy:
        arr = zarr.create_array(store=store, shape=full.shape, dtype=full.dtype, chunks=layout.chunks, attributes=attrs)
    else:
        arr = zarr.create_group(store=store).create_array("jacobian", shape=full.shape, dtype=full.dtype,
                                                          chunks=layout.chunks, attributes=attrs)
    arr[...] = full


def rows_of(full: np.ndarray, iter_start: int, iter_stop: int) -> np.ndarray:
    perm = list(range(iter_start, iter_stop)) + list(range(iter_start)) + list(range(iter_stop, full.ndim))
    n = int(np.prod(full.shape[iter_start:iter_stop]))
    return full.transpose(perm).reshape((n,) + full.shape[:iter_start] + full.shape[iter_stop:])


def succeed(redis_conn, job_id: str, uri: str, full: np.ndarray) -> None:
    JobStore(redis_conn).transition(job_id, JobStatus.running)
    JobStore(redis_conn).transition(job_id, JobStatus.succeeded, finished_at=time.time(),
                                    result=ResultInfo(uri=uri, shape=list(full.shape), dtype=full.dtype.name))


@pytest.mark.parametrize("iter_start,iter_stop,block_bytes", [(0, 2, 80), (1, 3, 100), (2, 4, 1 << 20), (0, 0, 64)])
def test_result_rows_local(client, redis_conn, results, iter_start, iter_stop, block_bytes):
    job_id = client.post("/v1/jobs", json=mlp_body()).json()["id"]
    assert client.get(f"/v1/jobs/{job_id}/result").status_code == 409
    full = np.random.default_rng(0).normal(size=(2, 4, 2, 8)).astype(np.float32)
    uri = f"{results}/{job_id}/result.zarr"
    write_result(uri, full, iter_start, iter_stop, block_bytes)
    succeed(redis_conn, job_id, uri, full)
    ref = rows_of(full, iter_start, iter_stop)
    total = ref.shape[0]
    for rows, want in ((None, ref), (f"0:{total}", ref), (f"{total - 1}:", ref[-1:]), ("0", ref[:1]),
                       (f":{min(3, total)}", ref[:3]), (f"1:{total}", ref[1:])):
        r = client.get(f"/v1/jobs/{job_id}/result", params={} if rows is None else {"rows": rows})
        if not want.size:
            continue
        assert r.status_code == 200, (rows, r.text)
        got = np.load(io.BytesIO(r.content), allow_pickle=False)
        np.testing.assert_array_equal(got, want)
        assert r.headers["x-rows-total"] == str(total)
    assert client.get(f"/v1/jobs/{job_id}/result", params={"rows": f"0:{total + 1}"}).status_code == 416
    assert client.get(f"/v1/jobs/{job_id}/result", params={"rows": f"{total}:"}).status_code == 416
    for bad in ("a:b", "0:0", "-1:2", "1:2:3", "1:x"):
        r = client.get(f"/v1/jobs/{job_id}/result", params={"rows": bad})
        assert r.status_code == 422 and r.json()["error"]["message"].startswith("rows:"), bad


def test_a_row_larger_than_the_response_limit_is_streamed(env, redis_conn, results, monkeypatch):
    """One row of 1600 bytes under a 1000-byte limit: served alone (streamed, Content-Length exact); a range
    of several rows over the limit says how many rows to ask for at a time."""
    monkeypatch.setenv("JACOBIAN_MAX_BODY_BYTES", "1000")
    get_settings.cache_clear()
    with TestClient(create_app()) as client:
        job_id = client.post("/v1/jobs", json=mlp_body(batch=1)).json()["id"]
        full = np.random.default_rng(1).normal(size=(3, 400)).astype(np.float32)
        uri = f"{results}/{job_id}/jacobian.zarr"  # a result stored before the group layout still reads
        write_result(uri, full, 0, 1, 1 << 20, legacy=True)
        succeed(redis_conn, job_id, uri, full)
        for rows in ("1", "2:3", "2:"):
            r = client.get(f"/v1/jobs/{job_id}/result", params={"rows": rows})
            assert r.status_code == 200, r.text
            assert int(r.headers["content-length"]) == len(r.content)
            start = int(rows.split(":")[0])
            np.testing.assert_array_equal(np.load(io.BytesIO(r.content), allow_pickle=False), full[start:start + 1])
        r = client.get(f"/v1/jobs/{job_id}/result", params={"rows": "0:2"})
        assert r.status_code == 422
        message = r.json()["error"]["message"]
        assert "ask for at most 1 rows at a time, e.g. rows=0:1 (one row is always served)" in message


def test_result_of_failed_job_is_409_with_reason(client, redis_conn):
    job_id = client.post("/v1/jobs", json=mlp_body()).json()["id"]
    JobStore(redis_conn).transition(job_id, JobStatus.failed, error=ErrorInfo(type="X", message="boom"))
    r = client.get(f"/v1/jobs/{job_id}/result")
    assert r.status_code == 409 and "failed" in r.json()["error"]["message"] and "boom" in r.json()["error"]["message"]


@pytest.fixture
def s3_client(env, s3_env, monkeypatch):
    monkeypatch.setenv("JACOBIAN_RESULTS_URL", f"s3://{s3_env}/results")
    get_settings.cache_clear()
    with TestClient(create_app()) as c:
        yield c, s3_env


def test_s3_results(s3_client, redis_conn):
    import boto3

    client, bucket = s3_client
    assert client.get("/readyz").status_code == 200
    r = client.post("/v1/jobs", json=mlp_body())
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    spec = fetch_rq(redis_conn, job_id).args[0]
    assert spec["inputs_uri"] == f"s3://{bucket}/results/{job_id}/inputs.npz"
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    obj = s3.get_object(Bucket=bucket, Key=f"results/{job_id}/inputs.npz")["Body"].read()
    with np.load(io.BytesIO(obj)) as npz:
        assert npz["x"].shape == (2, 8)

    full = np.arange(2 * 4 * 2 * 8, dtype=np.float32).reshape(2, 4, 2, 8)
    uri = f"s3://{bucket}/results/{job_id}/result.zarr"
    write_result(uri, full, 0, 2, 128)
    succeed(redis_conn, job_id, uri, full)
    r = client.get(f"/v1/jobs/{job_id}/result", params={"rows": "2:7"})
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(np.load(io.BytesIO(r.content)), rows_of(full, 0, 2)[2:7])


def test_model_signature_endpoint(client, model_root):
    r = client.get("/v1/models/signature", params={"path": "mlp"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["path"] == str(model_root / "mlp") and "serving_default" in body["signatures"]
    assert body["inputs"] == {"x": {"dtype": "float32", "shape": [None, 8]}}
    assert body["outputs"] == {"y": {"dtype": "float32", "shape": [None, 4]}}
    assert body["variables"]["d0/kernel"] == {"dtype": "float32", "shape": [8, 16], "trainable": True}
    r = client.get("/v1/models/signature", params={"path": "mlp", "signature": "nope"})
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("signature:")
    r = client.get("/v1/models/signature", params={"path": "/etc"})
    assert r.status_code == 403 and r.json()["error"]["message"].startswith("path:")
    assert client.get("/v1/models/signature").status_code == 422


def test_health_and_readiness(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json()["checks"] == {"redis": "ok", "storage": "ok"}


def test_not_ready_without_redis(env, monkeypatch):
    from tests.conftest import free_port

    port = free_port()
    monkeypatch.setenv("JACOBIAN_REDIS_URL", f"redis://127.0.0.1:{port}/0")
    get_settings.cache_clear()
    with TestClient(create_app()) as c:
        assert c.get("/healthz").status_code == 200
        r = c.get("/readyz")
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "NotReady" and message.startswith("redis: unreachable (ConnectionError)")
        assert "127.0.0.1" not in message and str(port) not in message  # /readyz needs no API key


def test_redis_down_and_storage_broken_are_503(env, redis_server, tmp_path, monkeypatch):
    from tests.conftest import free_port

    monkeypatch.setenv("JACOBIAN_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    get_settings.cache_clear()
    with TestClient(create_app()) as c:
        r = c.get("/v1/jobs/" + "0" * 32)  # shaped like an id: only then is Redis asked
        assert r.status_code == 503 and r.json()["error"]["message"].startswith("redis:")
    monkeypatch.setenv("JACOBIAN_REDIS_URL", redis_server.url)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("JACOBIAN_RESULTS_URL", str(blocker / "results"))
    get_settings.cache_clear()
    with TestClient(create_app()) as c:
        r = c.post("/v1/jobs", json=mlp_body())
        assert r.status_code == 503 and r.json()["error"]["message"].startswith("storage:")
        assert c.get("/readyz").status_code == 503


def test_result_gone_is_409_and_says_what_is_true(client, redis_conn, results):
    """Stored results are never deleted by the service (README): the message says it was removed from
    storage or the API reads other storage, and names the settings to check; not "results expire"."""
    job_id = client.post("/v1/jobs", json=mlp_body()).json()["id"]
    succeed(redis_conn, job_id, f"{results}/{job_id}/result.zarr", np.zeros((1,), np.float32))
    for path in (f"/v1/jobs/{job_id}/result", f"/v1/jobs/{job_id}/preview.png"):
        r = client.get(path)
        message = r.json()["error"]["message"]
        assert r.status_code == 409 and "gone" in message, (path, message)
        assert "expire" not in message and "never deleted" in message and "JACOBIAN_RESULTS_URL" in message


@pytest.mark.parametrize("failing", ["record", "queue"])
def test_a_job_that_cannot_be_queued_leaves_no_record_and_no_inputs(client, redis_conn, results, monkeypatch,
                                                                    failing):
    """Redis goes away after the inputs were stored: the answer is 503 and nothing of the job remains
    (its record, index entry, inputs.npz), so no job is listed that no worker will ever run."""
    import redis

    def down(*args, **kwargs):
        raise redis.exceptions.ConnectionError("Redis went away")

    monkeypatch.setattr(JobStore, "create", down) if failing == "record" else monkeypatch.setattr(
        Queue, "enqueue_call", down)
    r = client.post("/v1/jobs", json=mlp_body(), headers={"Idempotency-Key": "k-1"})
    assert r.status_code == 503, r.text
    assert redis_conn.keys("jacobian:job:*") == [] and redis_conn.zcard(JobStore.index_key) == 0
    assert not results.exists() or list(results.iterdir()) == []
    assert client.get("/v1/jobs").json()["jobs"] == []
    monkeypatch.undo()
    again = client.post("/v1/jobs", json=mlp_body(), headers={"Idempotency-Key": "k-1"})  # the key was released
    assert again.status_code == 202 and (results / again.json()["id"] / "inputs.npz").is_file()


def test_job_answers_keep_their_keys_and_values(client, redis_conn):
    """GET /v1/jobs/{id}, GET /v1/jobs and POST .../cancel answer the stored record: the keys of the
    HTTP contract, the engine's extra plan keys, an error's keys as written, no defaults filled in."""
    job_id = client.post("/v1/jobs", json=mlp_body()).json()["id"]
    queued = client.get(f"/v1/jobs/{job_id}").json()
    assert queued["plan"] == {} and queued["result"] is None and queued["error"] is None
    assert queued["progress"] == {"rows_done": 0, "rows_total": None, "fraction": 0.0, "rows_per_second": None,
                                  "eta_seconds": None}
    store = JobStore(redis_conn)
    plan = {"chunk_rows": 4, "strategy": "vectorized", "mode": "reverse", "free_bytes_at_start": 1 << 30,
            "bytes_per_row": 512, "fixed_bytes": None, "oom_retries": 0, "xla": False, "source": "default",
            "plan_key": None, "trial": None, "rows_per_second": {"4": 99.5}, "shards": 1}
    progress = {"rows_done": 4, "rows_total": 16, "fraction": 0.25, "rows_per_second": 99.5, "eta_seconds": 0.121}
    error = {"type": "ResultWriteError", "message": "storage: down", "transient": True}
    store.transition(job_id, JobStatus.running, started_at=1_800_000_000.5, plan=PlanInfo.model_validate(plan),
                     progress=Progress.model_validate(progress), error=ErrorInfo.model_validate(error))
    body = client.get(f"/v1/jobs/{job_id}").json()
    assert body == {"id": job_id, "status": "running", "progress": progress, "plan": plan, "result": None,
                    "error": error, "created_at": queued["created_at"], "started_at": "2027-01-15T08:00:00.500Z",
                    "finished_at": None, "kind": "jacobian", "model": queued["model"]}
    assert list(body) == ["id", "status", "progress", "plan", "result", "error", "created_at", "started_at",
                          "finished_at", "kind", "model"]
    assert client.get("/v1/jobs").json() == {"jobs": [body], "next_page_token": None}
    assert client.post(f"/v1/jobs/{job_id}/cancel").json() == body  # running: it stops at its next chunk


def test_api_keys(env, monkeypatch):
    monkeypatch.setenv("JACOBIAN_API_KEYS", "key-one, key-two")
    get_settings.cache_clear()
    with TestClient(create_app()) as c:
        r = c.post("/v1/jobs", json=mlp_body())
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["message"].startswith("Authorization:")
        assert c.get("/v1/jobs", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.get("/v1/models/signature", params={"path": "mlp"}).status_code == 401
        ok = c.post("/v1/jobs", json=mlp_body(), headers={"Authorization": "Bearer key-two"})
        assert ok.status_code == 202
        assert c.get(f"/v1/jobs/{ok.json()['id']}", headers={"Authorization": "Bearer key-one"}).status_code == 200
        assert c.get("/healthz").status_code == 200 and c.get("/metrics").status_code == 200


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics(client):
    before = _samples(client.get("/metrics").text)
    job_id = client.post("/v1/jobs", json=mlp_body()).json()["id"]
    client.get(f"/v1/jobs/{job_id}")
    client.post("/v1/jobs", json={"model": {"path": "/etc"}, "inputs": {}})
    after = _samples(client.get("/metrics").text)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("jacobian_jobs_submitted_total", kind="jacobian") == 1
    assert delta("jacobian_http_requests_total", route="/v1/jobs", method="POST", status_code="202") == 1
    assert delta("jacobian_http_requests_total", route="/v1/jobs/{job_id}", method="GET", status_code="200") == 1
    assert delta("jacobian_http_requests_total", route="/v1/jobs", method="POST", status_code="403") == 1
    assert delta("jacobian_http_request_duration_seconds_count", route="/v1/jobs", method="POST",
                 status_code="202") == 1
    assert after[("jacobian_queue_depth", (("queue", "jacobian"),))] == 1
    assert not any(job_id in str(key) for key in after)  # never a job id in a label


def test_metrics_multiprocess_mode(redis_server, tmp_path):
    code = """
from fastapi.testclient import TestClient
from app.main import create_app
with TestClient(create_app()) as c:
    c.get('/healthz')
    text = c.get('/metrics').text
assert 'jacobian_http_requests_total{' in text and 'route="/healthz"' in text, text
assert 'jacobian_queue_depth{queue="jacobian"} 0.0' in text, text
"""
    mp = tmp_path / "prom"
    mp.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp), "JACOBIAN_REDIS_URL": redis_server.url,
           "JACOBIAN_RESULTS_URL": str(tmp_path / "results")}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=120)
    assert any(mp.iterdir())  # values went through the multiprocess files


def test_metrics_pass_promtool(client):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    client.post("/v1/jobs", json=mlp_body())
    client.get("/docs")
    text = client.get("/metrics").text
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_under_uvicorn_streamed_body_limit(redis_server, model_root, tmp_path):
    """A real server: lifespan, readiness, a job, and a chunked oversized upload cut at the limit."""
    import httpx

    from tests.conftest import free_port, wait_port

    port = free_port()
    env = {**os.environ, "JACOBIAN_REDIS_URL": redis_server.url, "JACOBIAN_MODEL_ROOTS": str(model_root),
           "JACOBIAN_RESULTS_URL": str(tmp_path / "results"), "JACOBIAN_MAX_BODY_BYTES": "50000"}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(port),
                             "--log-level", "warning"], cwd=REPO, env=env)
    try:
        wait_port(port, timeout_s=60)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            assert http.get("/readyz").status_code == 200
            assert http.post("/v1/jobs", json=mlp_body()).status_code == 202

            def chunks():
                for _ in range(1000):
                    yield b" " * 1000

            try:
                r = http.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
                assert r.status_code == 413, r.text
            except httpx.WriteError:
                pass  # the server answered 413 and closed before the client finished sending
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_openapi_docs(client):
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    post = spec["paths"]["/v1/jobs"]["post"]
    assert set(post["requestBody"]["content"]) == {"application/json", "application/x-npz"}
    # the .npz options are described, not declared as query parameters (which a JSON body refuses); dry_run,
    # which either body takes, is the one declared, and its 200 answers the Quote
    assert [p["name"] for p in post.get("parameters", []) if p["in"] == "query"] == ["dry_run"]
    assert post["responses"]["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Quote"}
    assert "model_path required" in post["requestBody"]["description"]
    assert "JobCreate" in spec["components"]["schemas"] and "TensorIn" in spec["components"]["schemas"]
    timeout = spec["components"]["schemas"]["JobCreate"]["properties"]["timeout_s"]
    assert "JobTimeout" in timeout["description"] and "JACOBIAN_MAX_JOB_TIMEOUT_S" in timeout["description"]
    for path in ("/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel", "/v1/jobs/{job_id}/result",
                 "/v1/models/signature", "/healthz", "/readyz", "/metrics"):
        assert path in spec["paths"]


def test_api_process_never_imports_tensorflow(model_root):
    subprocess.run([sys.executable, "-c", "import app.main, sys; assert 'tensorflow' not in sys.modules"],
                   check=True, cwd=REPO, timeout=120)
    code = """
import sys
from fastapi.testclient import TestClient
from app.main import app
r = TestClient(app).get('/v1/models/signature', params={'path': 'int_input'})
assert r.status_code == 200, r.text
assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules
"""
    env = {**os.environ, "JACOBIAN_MODEL_ROOTS": str(model_root)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=120)


def test_unsupported_content_type(client, redis_conn):
    r = client.post("/v1/jobs", content=b"x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["message"].startswith("Content-Type:")
    assert json.loads(r.text)["error"]["type"] == "UnsupportedMediaType"
