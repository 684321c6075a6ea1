"""The client commands of ``jacobian`` and the Python client (``jacobian.client``) against the running stack.

One worker for the module and three APIs on the session's redis-server: ``local`` (results on local
disk), ``s3`` (results in a moto bucket; same queue, so the same worker serves it) and ``idle`` (its
own queue, which no worker serves: its jobs stay queued, so cancel is deterministic). Rows read
back over HTTP must equal the engine's result as stored in Zarr.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jacobian.client import JacobianClient, JacobianError, JobCanceled, JobFailed
from tests import models
from tests.e2e.stack import Api, Stack, as_rows, aws_env, print_logs, result_rows

pytestmark = pytest.mark.e2e

JOB_TIMEOUT_S = 180.0
HEX_ID = re.compile(r"^[0-9a-f]{32}$")


class Env:
    def __init__(self, stack: Stack, local: Api, s3: Api, idle: Api, bucket: str, endpoint: str) -> None:
        self.stack, self.local, self.s3, self.idle = stack, local, s3, idle
        self.bucket, self.endpoint = bucket, endpoint


@pytest.fixture(scope="module")
def models_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    models.mlp(root / "mlp")  # x (None, 8) -> y (None, 4)
    return root


@pytest.fixture(scope="module")
def env(request, redis_server, s3_server, models_root, tmp_path_factory):
    import boto3

    bucket = f"results-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    stack = Stack(redis_server.url, models_root, tmp_path_factory.mktemp("client-cli"),
                  aws=aws_env(s3_server.endpoint))
    failed_before = request.session.testsfailed
    try:
        stack.start_worker()
        local = stack.api("api-local")
        s3 = stack.api("api-s3", results_url=f"s3://{bucket}/results")
        idle = stack.api("api-idle", queue_name=f"nobody-{uuid.uuid4().hex[:8]}")
        yield Env(stack, local, s3, idle, bucket, s3_server.endpoint)
    finally:
        stack.stop()
        if request.session.testsfailed > failed_before:
            print_logs(request, stack.procs())


def _npz(path: Path, **arrays: np.ndarray) -> str:
    np.savez(path, **arrays)
    return str(path)


def _ok(result: Any, env: Env) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}\n" \
                                   f"{env.stack.logs()}"


# -- CLI -----------------------------------------------------------------------------------------------


def test_cli_submit_wait_status_fetch_list(env: Env, tmp_path: Path) -> None:
    x = np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32)
    inp = _npz(tmp_path / "x.npz", x=x)
    key = f"cli-{uuid.uuid4().hex}"
    r = env.stack.cli("submit", "--model", "mlp", "--input", inp, "--of", "y", "--wrt", "x", "--kind", "jacobian",
                      "--mode", "reverse", "--idempotency-key", key, "--wait", "--poll", "0.1",
                      timeout_s=JOB_TIMEOUT_S)
    _ok(r, env)
    job_id = r.stdout.strip()
    assert HEX_ID.match(job_id), r.stdout
    # stderr is a pipe, not a terminal: plain progress lines (no \r, no ANSI), the last one at 100 %
    assert "\r" not in r.stderr and "\x1b" not in r.stderr, r.stderr
    shown = [line for line in r.stderr.splitlines() if line.startswith("rows ")]
    assert shown and re.fullmatch(r"rows 16/16 \(100\.0%\), (?:[\d.]+|\?) rows/s, eta 00:00, elapsed [\d:]+, "
                                  r"succeeded(?:, strategy \S+)?", shown[-1]), r.stderr
    assert f"succeeded: {job_id}" in r.stderr

    # the same key and inputs: the same job
    again = env.stack.cli("submit", "--model", "mlp", "--input", inp, "--of", "y", "--wrt", "x", "--kind", "jacobian",
                          "--mode", "reverse", "--idempotency-key", key)
    _ok(again, env)
    assert again.stdout.strip() == job_id

    status = env.stack.cli("status", job_id)
    _ok(status, env)
    record = json.loads(status.stdout)
    assert record["id"] == job_id and record["status"] == "succeeded"
    assert record["result"]["shape"] == [4, 4, 4, 8] and record["progress"]["rows_total"] == 16
    full, rows = result_rows(record["result"]["uri"])
    assert rows.shape == (16, 4, 8)

    out = tmp_path / "rows.npy"
    fetched = env.stack.cli("fetch", job_id, "--rows", "3:11", "-o", str(out))
    _ok(fetched, env)
    got = np.load(out, allow_pickle=False)
    assert got.shape == (8, 4, 8) and got.dtype == np.float32
    np.testing.assert_array_equal(got, rows[3:11])
    assert f"wrote {out}: (8, 4, 8) float32" in fetched.stderr

    everything = tmp_path / "all.npy"
    paged = env.stack.cli("fetch", job_id, "-o", str(everything), "--page-bytes", "300")  # 2 rows per request
    _ok(paged, env)
    assert "\r" not in paged.stderr and "rows 16/16 (100.0%)" in paged.stderr, paged.stderr
    np.testing.assert_array_equal(np.load(everything), rows)
    # rows are dy[i, j]/dx: row 4 * i + j is full[i, j]
    np.testing.assert_array_equal(rows[5], full[1, 1])

    listed = env.stack.cli("list", "--limit", "200")
    _ok(listed, env)
    header, *lines = listed.stdout.splitlines()
    assert header.split()[:4] == ["ID", "STATUS", "KIND", "PROGRESS"]
    mine = [line.split() for line in lines if line.startswith(job_id)]
    assert mine and mine[0][1:4] == ["succeeded", "jacobian", "16/16"], listed.stdout
    as_json = env.stack.cli("list", "--json", "--status", "succeeded", "--limit", "200")
    _ok(as_json, env)
    assert job_id in {job["id"] for job in json.loads(as_json.stdout)}


def test_cli_cancel_and_errors(env: Env, tmp_path: Path) -> None:
    inp = _npz(tmp_path / "x.npz", x=np.zeros((2, 8), np.float32))
    r = env.stack.cli("submit", "--model", "mlp", "--input", inp, api=env.idle)
    _ok(r, env)
    job_id = r.stdout.strip()
    assert json.loads(env.stack.cli("status", job_id, api=env.idle).stdout)["status"] == "queued"

    not_yet = env.stack.cli("fetch", job_id, "-o", str(tmp_path / "no.npy"), api=env.idle)
    assert not_yet.returncode == 2
    assert not_yet.stderr.startswith("error: JobNotFinished: id: job"), not_yet.stderr
    assert not (tmp_path / "no.npy").exists()

    canceled = env.stack.cli("cancel", job_id, api=env.idle)
    _ok(canceled, env)
    record = json.loads(canceled.stdout)
    assert record["status"] == "canceled" and record["error"]["type"] == "Canceled"
    waited = env.stack.cli("status", job_id, "--wait", "--quiet", api=env.idle)
    assert waited.returncode == 1, waited.stderr
    assert waited.stderr.startswith("error: Canceled: canceled before it started"), waited.stderr
    assert json.loads(waited.stdout)["status"] == "canceled"

    # errors of the API: "error: <type>: <message>", exit code 2
    bad_shape = _npz(tmp_path / "bad.npz", x=np.zeros((2, 7), np.float32))
    r = env.stack.cli("submit", "--model", "mlp", "--input", bad_shape)
    assert r.returncode == 2 and r.stdout == ""
    assert re.match(r"^error: SignatureMismatch: --input\.x\.shape: .*\[None, 8\]", r.stderr), r.stderr   # CLI spelling
    r = env.stack.cli("submit", "--model", "../../etc", "--input", inp)
    assert r.returncode == 2 and re.match(r"^error: ModelPathNotAllowed: model_path: ", r.stderr), r.stderr
    r = env.stack.cli("submit", "--model", "mlp", "--input", inp, "--wrt", "nope")
    assert r.returncode == 2 and r.stderr.startswith("error: SignatureMismatch: ") and "nope" in r.stderr, r.stderr
    r = env.stack.cli("status", "0" * 32)
    assert r.returncode == 2 and r.stderr.startswith("error: JobNotFound: id: no job"), r.stderr
    r = env.stack.cli("fetch", job_id, "--rows", "x:y", "-o", str(tmp_path / "r.npy"))
    assert r.returncode == 2 and r.stderr.startswith("error: InvalidRequest: --rows"), r.stderr
    r = env.stack.cli("submit", "--model", "mlp", "--input", str(tmp_path / "missing.npz"))
    assert r.returncode == 2 and r.stderr.startswith("error: InvalidRequest: --input: cannot read"), r.stderr


# -- Python client -----------------------------------------------------------------------------------


def test_client_submit_wait_and_results(env: Env) -> None:
    import zarr

    x = np.random.default_rng(2).normal(size=(5, 8)).astype(np.float32)
    with JacobianClient(env.local.url) as client:
        job_id = client.submit("mlp", {"x": x}, kind="batch_jacobian", mode="reverse")
        assert HEX_ID.match(job_id)
        seen: list[dict[str, Any]] = []
        record = client.wait(job_id, on_progress=seen.append, poll_s=0.05, timeout_s=JOB_TIMEOUT_S)
        assert seen, "on_progress was never called"
        assert seen[-1] is record and record["status"] == "succeeded"
        assert all(r["id"] == job_id and "progress" in r for r in seen)
        assert record["progress"]["rows_done"] == record["progress"]["rows_total"]
        assert record["result"]["shape"] == [5, 4, 8]

        full, rows = result_rows(record["result"]["uri"])
        np.testing.assert_array_equal(client.result(job_id, rows=slice(1, 3)), rows[1:3])
        np.testing.assert_array_equal(client.result(job_id, rows=slice(-2, None)), rows[-2:])
        pages = list(client.iter_rows(job_id, page_bytes=1))  # one row per request
        assert len(pages) == rows.shape[0]
        np.testing.assert_array_equal(np.concatenate(pages), rows)

        lazy = client.result(job_id)
        assert isinstance(lazy, zarr.Array)
        assert lazy.shape == (5, 4, 8) and lazy.dtype == np.float32
        np.testing.assert_array_equal(lazy[2], full[2])  # reads only what it needs
        assert dict(lazy.attrs)["kind"] == "batch_jacobian"

        assert client.status(job_id)["status"] == "succeeded"
        assert job_id in {j["id"] for j in client.list(status="succeeded", limit=1000)}
        assert all(j["status"] == "succeeded" for j in client.list(status="succeeded", limit=5))

        with pytest.raises(JacobianError) as bad:
            client.submit("mlp", {"x": np.zeros((2, 7), np.float32)})
        assert bad.value.type == "SignatureMismatch" and bad.value.status_code == 422
        assert "inputs.x" in bad.value.message
        with pytest.raises(JacobianError) as missing:
            client.status("f" * 32)
        assert missing.value.type == "JobNotFound" and missing.value.status_code == 404


def test_client_cancel_raises_job_failed(env: Env) -> None:
    with JacobianClient(env.idle.url) as client:
        job_id = client.submit("mlp", {"x": np.ones((1, 8), np.float32)})
        with pytest.raises(TimeoutError):
            client.wait(job_id, timeout_s=0.3, poll_s=0.1)
        with pytest.raises(JacobianError) as early:
            client.result(job_id, rows=slice(0, 1))
        assert early.value.type == "JobNotFinished" and early.value.status_code == 409
        assert client.cancel(job_id)["status"] == "canceled"
        with pytest.raises(JobFailed) as failed:
            client.wait(job_id)
        assert isinstance(failed.value, JobCanceled)
        assert failed.value.type == "Canceled" and failed.value.message == "canceled before it started"
        assert failed.value.job_id == job_id and failed.value.record["status"] == "canceled"


def test_client_lazy_zarr_from_s3(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    import zarr

    for name, value in aws_env(env.endpoint).items():
        monkeypatch.setenv(name, value)
    x = np.random.default_rng(3).normal(size=(2, 8)).astype(np.float32)
    with JacobianClient(env.s3.url) as client:
        job_id = client.submit("mlp", {"x": x}, of="y", wrt="x")
        record = client.wait(job_id, poll_s=0.05, timeout_s=JOB_TIMEOUT_S)
        uri = record["result"]["uri"]
        assert uri == f"s3://{env.bucket}/results/{job_id}/result.zarr"
        lazy = client.result(job_id)  # storage_options from the AWS_* variables
        assert isinstance(lazy, zarr.Array) and lazy.shape == (2, 4, 2, 8)
        full = lazy[...]
        over_http = client.result(job_id, rows=slice(0, 8))
        attrs = dict(lazy.attrs)
        np.testing.assert_array_equal(over_http, as_rows(full, attrs["iter_start"], attrs["iter_stop"]))
