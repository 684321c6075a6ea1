"""``jacobian.client`` against a fake transport: bounded retries, the idempotency key, error answers."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest

from jacobian.client import JacobianClient, JacobianError, JobFailed


def job_record(job_id: str, status: str, **fields) -> dict:
    """A ``GET /v1/jobs/{id}`` body as the API serves it."""
    return {"id": job_id, "status": status, "progress": {}, "plan": {}, "result": None, "error": None,
            "created_at": "2026-01-01T00:00:00.000Z", "started_at": None, "finished_at": None, "kind": "jacobian",
            "model": {"path": "/models/mlp", "signature": "serving_default"}, **fields}


def test_submit_retries_connection_errors_with_the_same_idempotency_key():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) < 3:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(202, json={"id": "a" * 32, "status": "queued"})

    client = JacobianClient("http://api", transport=httpx.MockTransport(handler), backoff_s=0.0)
    job_id = client.submit("mlp", {"x": np.ones((2, 8), np.float32)}, kind="batch_jacobian", check_independence=True,
                           memory_budget_bytes=None)
    assert job_id == "a" * 32 and len(seen) == 3
    keys = {r.headers["idempotency-key"] for r in seen}
    assert len(keys) == 1 and keys.pop().startswith("client-")
    last = seen[-1]
    assert last.headers["content-type"] == "application/x-npz"
    assert dict(last.url.params) == {"model_path": "mlp", "signature": "serving_default", "kind": "batch_jacobian",
                                     "check_independence": "true"}
    assert np.load(io.BytesIO(last.content))["x"].shape == (2, 8)


def test_retries_are_bounded_and_errors_carry_type_and_message():
    calls = {"n": 0}

    def down(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        raise httpx.ConnectError("refused", request=request)

    client = JacobianClient("http://api", transport=httpx.MockTransport(down), retries=2, backoff_s=0.0)
    with pytest.raises(JacobianError) as err:
        client.status("x")
    assert calls["n"] == 3 and err.value.type == "ConnectionError"

    def answers(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/busy"):
            return httpx.Response(503, json={"error": {"type": "NotReady", "message": "redis: unreachable"}})
        if request.url.path.endswith("/gone"):
            return httpx.Response(404, json={"error": {"type": "JobNotFound", "message": "id: no job 'gone'"}})
        return httpx.Response(200, json=job_record("f", "failed", error={"type": "UnconnectedGradient",
                                                                          "message": "wrt: not connected"}))

    client = JacobianClient("http://api", transport=httpx.MockTransport(answers), retries=1, backoff_s=0.0)
    with pytest.raises(JacobianError) as err:
        client.status("gone")
    assert (err.value.type, err.value.message, err.value.status_code) == ("JobNotFound", "id: no job 'gone'", 404)
    with pytest.raises(JacobianError) as err:
        client.status("busy")
    assert err.value.type == "NotReady" and err.value.status_code == 503
    with pytest.raises(JobFailed) as failed:
        client.wait("f")
    assert failed.value.type == "UnconnectedGradient" and failed.value.message == "wrt: not connected"


def test_post_not_retried_after_it_may_have_arrived_without_a_key():
    calls = {"n": 0}

    def flaky(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        raise httpx.ReadError("reset", request=request)

    client = JacobianClient("http://api", transport=httpx.MockTransport(flaky), backoff_s=0.0)
    with pytest.raises(JacobianError):
        client._request("POST", "/v1/jobs/x/other")
    assert calls["n"] == 1


def test_job_records_are_checked_and_typed_and_served_json_is_kept():
    body = job_record("a" * 32, "succeeded", progress={"rows_done": 4, "rows_total": 4, "fraction": 1,
                                                       "rows_per_second": 2.5, "eta_seconds": 0},
                      plan={"chunk_rows": 4, "strategy": "vectorized", "xla": False},
                      result={"uri": "/r/a.zarr", "shape": [4, 8], "dtype": "float32"})
    answers = {"/v1/jobs/" + "a" * 32: body, "/v1/jobs/bad": {"id": "bad", "status": "finished"},
               "/v1/jobs": {"jobs": [body], "next_page_token": None}}
    client = JacobianClient("http://api", transport=httpx.MockTransport(
        lambda request: httpx.Response(200, json=answers[request.url.path])), backoff_s=0.0)
    assert client.status("a" * 32) == body  # the JSON as served, ints and extra plan keys untouched
    assert client.list() == [body]
    job = client.job("a" * 32)
    assert job.status.value == "succeeded" and job.result.shape == [4, 8] and job.plan.chunk_rows == 4
    assert job.progress.fraction == 1.0 and job.plan.model_extra == {"xla": False}
    with pytest.raises(JacobianError) as err:
        client.status("bad")
    assert err.value.type == "InvalidResponse" and "JobPublic" in err.value.message
