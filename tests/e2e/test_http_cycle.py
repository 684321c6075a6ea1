"""The whole stack over real HTTP: redis-server, ``jacobian serve`` and ``jacobian worker`` as subprocesses.

A job is POSTed with inline JSON tensors, polled until it succeeds, and its result is read back with
plain zarr (local disk, or S3 through zarr's fsspec store: no project code) and compared with
``tape.jacobian`` computed here; ``GET /v1/jobs/{id}/result?rows=0:3`` must equal the first rows.

One worker serves the whole module (TensorFlow is imported once): results go where the job spec says,
so the same worker writes to local disk and to S3. Each storage backend gets its own API process.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zarr

from tests import models
from tests.conftest import tensor
from tests.procs import REPO, Proc, base_env, free_port, jacobian_exe  # noqa: F401 (stack.py imports them here)

pytestmark = pytest.mark.e2e

JOB_TIMEOUT_S = 120.0
POLL_S = 0.2
S3_KEY = S3_SECRET = "testing"  # what the ``s3_env`` fixture sets
S3_REGION = "us-east-1"


# -- subprocesses -----------------------------------------------------------------------------------


def print_logs(request: pytest.FixtureRequest, procs: list[Proc]) -> None:
    """Write the log tails straight to the terminal (teardown output is otherwise swallowed)."""
    text = "\n".join(p.report() for p in procs)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        for line in text.splitlines():
            reporter.write_line(line)
    else:  # pragma: no cover
        print(text, file=sys.stderr)


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    models.mlp(root / "mlp")
    models.cnn(root / "cnn")
    return root


@pytest.fixture(scope="module")
def queue_name() -> str:
    return f"jacobian-e2e-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def worker(request, redis_server, s3_server, models_root, queue_name, tmp_path_factory):
    """One ``jacobian worker`` for the module, with the AWS_* variables of the moto server."""
    logs = tmp_path_factory.mktemp("worker-logs")
    env = base_env(JACOBIAN_REDIS_URL=redis_server.url, JACOBIAN_RESULTS_URL=str(logs / "unused-results"),
                   JACOBIAN_MODEL_ROOTS=str(models_root), JACOBIAN_QUEUE_NAME=queue_name,
                   AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET, AWS_REGION=S3_REGION,
                   AWS_ENDPOINT_URL=s3_server.endpoint)
    proc = Proc("worker", jacobian_exe() + ["worker"], env, logs / "worker.log")
    failed_before = request.session.testsfailed
    yield proc
    proc.stop()
    if request.session.testsfailed > failed_before:
        print_logs(request, [proc])


class Stack:
    """The API (one per test) in front of the module's worker."""

    def __init__(self, api: Proc, worker: Proc, url: str, results_url: str, queue_name: str,
                 redis_url: str, storage_options: dict[str, Any] | None) -> None:
        self.api, self.worker, self.url, self.results_url = api, worker, url, results_url
        self.queue_name, self.redis_url, self.storage_options = queue_name, redis_url, storage_options
        self.client = httpx.Client(base_url=url, timeout=30.0)
        self.backend = "local"

    def logs(self) -> str:
        return "\n".join(p.report() for p in (self.api, self.worker))

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.api.proc.poll() is not None:
                break
            try:
                r = self.client.get("/readyz")
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:500]}"
            except httpx.TransportError as err:
                last = repr(err)
            time.sleep(0.1)
        pytest.fail(f"API not ready at {self.url}/readyz: {last}\n{self.logs()}")

    def submit(self, body: dict[str, Any]) -> str:
        r = self.client.post("/v1/jobs", json=body)
        assert r.status_code == 202, f"{r.status_code} {r.text}\n{self.logs()}"
        job_id = r.json()["id"]
        assert r.json()["status"] == "queued"
        assert r.headers["location"] == f"/v1/jobs/{job_id}"
        return job_id

    def wait(self, job_id: str, timeout_s: float = JOB_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        record: dict[str, Any] = {}
        while time.monotonic() < deadline:
            r = self.client.get(f"/v1/jobs/{job_id}")
            assert r.status_code == 200, r.text
            record = r.json()
            if record["status"] in ("succeeded", "failed", "canceled"):
                break
            if self.worker.proc.poll() is not None:
                pytest.fail(f"the worker exited with {self.worker.proc.returncode}\n{self.logs()}")
            time.sleep(POLL_S)
        if record.get("status") != "succeeded":
            pytest.fail(f"job {job_id} did not succeed within {timeout_s:g} s: "
                        f"{json.dumps(record, indent=1)}\n{self.logs()}")
        return record

    def open_result(self, uri: str) -> zarr.Array:
        """The result with plain zarr (fsspec store for s3://)."""
        if self.storage_options is None:
            return zarr.open_array(uri + "/jacobian", mode="r")
        return zarr.open_array(uri + "/jacobian", mode="r", storage_options=self.storage_options)

    def read_manifest(self, job_id: str) -> dict[str, Any]:
        """``{results_url}/{id}/manifest.json`` with fsspec (no project code)."""
        import fsspec

        url = f"{self.results_url}/{job_id}/manifest.json"
        with fsspec.open(url, "rb", **(self.storage_options or {})) as fh:
            return json.loads(fh.read())


@pytest.fixture
def stack(request, worker, redis_server, s3_server, models_root, queue_name, tmp_path):
    """``jacobian serve`` on a free port, results on local disk (default) or in the ``s3_env`` bucket
    (``@pytest.mark.parametrize("stack", ["local", "s3"], indirect=True)``); ready."""
    backend = getattr(request, "param", "local")
    if backend == "s3":
        bucket = request.getfixturevalue("s3_env")
        results_url = f"s3://{bucket}/results"
        aws = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
                                          "AWS_ENDPOINT_URL")}
        assert aws["AWS_ENDPOINT_URL"] == s3_server.endpoint and aws["AWS_ACCESS_KEY_ID"] == S3_KEY
        options: dict[str, Any] | None = {"endpoint_url": aws["AWS_ENDPOINT_URL"], "key": aws["AWS_ACCESS_KEY_ID"],
                                          "secret": aws["AWS_SECRET_ACCESS_KEY"],
                                          "client_kwargs": {"region_name": aws["AWS_REGION"]}}
    else:
        results_url = str(tmp_path / "results")
        Path(results_url).mkdir()
        aws, options = {}, None
    port = free_port()
    env = base_env(JACOBIAN_REDIS_URL=redis_server.url, JACOBIAN_RESULTS_URL=results_url,
                   JACOBIAN_MODEL_ROOTS=str(models_root), JACOBIAN_QUEUE_NAME=queue_name, **aws)
    api = Proc("api", jacobian_exe() + ["serve", "--host", "127.0.0.1", "--port", str(port)], env,
               tmp_path / "api.log")
    s = Stack(api, worker, f"http://127.0.0.1:{port}", results_url, queue_name, redis_server.url, options)
    s.backend = backend
    failed_before = request.session.testsfailed
    try:
        s.wait_ready()
        yield s
    finally:
        s.client.close()
        api.stop()
        if request.session.testsfailed > failed_before:
            print_logs(request, [api, worker])


# -- references (TensorFlow in this process) --------------------------------------------------------


def tape_jacobian(model_dir: Path, inputs: dict[str, np.ndarray], of: str, wrt: str,
                  batch: bool = False) -> np.ndarray:
    import tensorflow as tf

    loaded = tf.saved_model.load(str(model_dir))  # keep it alive while its function runs
    fn = loaded.signatures["serving_default"]
    tensors = {k: tf.constant(v) for k, v in inputs.items()}
    with tf.GradientTape() as tape:
        tape.watch(tensors[wrt])
        out = fn(**tensors)[of]
    result = tape.batch_jacobian(out, tensors[wrt]) if batch else tape.jacobian(out, tensors[wrt])
    return result.numpy()


def as_rows(array: np.ndarray, iter_start: int, iter_stop: int) -> np.ndarray:
    """``array`` as ``(rows,) + row_shape``: the iterated axes first, flattened in C order."""
    iterated = list(range(iter_start, iter_stop))
    rest = [a for a in range(array.ndim) if a not in iterated]
    moved = np.transpose(array, iterated + rest)
    return moved.reshape((math.prod(array.shape[iter_start:iter_stop]),) + tuple(array.shape[a] for a in rest))



def check_progress_and_plan(record: dict[str, Any], rows_total: int) -> None:
    progress = record["progress"]
    assert progress["rows_done"] == progress["rows_total"] == rows_total, progress
    assert progress["fraction"] == 1.0, progress
    plan = record["plan"]
    for key in ("chunk_rows", "strategy", "mode", "free_bytes_at_start", "bytes_per_row", "oom_retries"):
        assert key in plan, f"plan lacks {key!r}: {plan}"
    assert isinstance(plan["chunk_rows"], int) and plan["chunk_rows"] >= 1, plan
    assert isinstance(plan["strategy"], str) and plan["strategy"], plan
    assert plan["mode"] in ("reverse", "forward"), plan
    assert isinstance(plan["free_bytes_at_start"], int) and plan["free_bytes_at_start"] > 0, plan
    assert isinstance(plan["bytes_per_row"], (int, float)) and plan["bytes_per_row"] >= 0, plan
    assert plan["oom_retries"] == 0, plan
    assert record["error"] is None
    assert record["created_at"] and record["started_at"] and record["finished_at"]


# -- tests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", ["local", "s3"], indirect=True)
def test_jacobian_job_over_http(stack: Stack, models_root: Path) -> None:
    x = np.random.default_rng(7).normal(size=(2, 8, 8, 3)).astype(np.float32)
    job_id = stack.submit({"model": {"path": "cnn", "signature": "serving_default"},
                           "inputs": {"image": tensor(x)}, "of": "logits", "wrt": "image",
                           "kind": "jacobian", "mode": "auto"})
    record = stack.wait(job_id)
    expected = tape_jacobian(models_root / "cnn", {"image": x}, "logits", "image")
    assert expected.shape == (2, 5, 2, 8, 8, 3)

    uri = record["result"]["uri"]
    assert uri == f"{stack.results_url}/{job_id}/result.zarr"
    assert record["result"]["shape"] == list(expected.shape) and record["result"]["dtype"] == "float32"
    J = stack.open_result(uri)
    got = J[:]
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    attrs = dict(J.attrs)
    assert attrs.get("of") == "logits" and attrs.get("wrt") == "image" and attrs.get("kind") == "jacobian"

    # rows: the output elements in reverse mode, the input elements in forward mode
    iter_start, iter_stop = int(attrs.get("iter_start", 0)), int(attrs.get("iter_stop", 1))
    rows = as_rows(got, iter_start, iter_stop)
    check_progress_and_plan(record, rows_total=rows.shape[0])
    assert record["plan"]["mode"] == attrs.get("mode", record["plan"]["mode"])
    assert (iter_start, iter_stop) == ((0, 2) if record["plan"]["mode"] == "reverse" else (2, 6))

    r = stack.client.get(f"/v1/jobs/{job_id}/result", params={"rows": "0:3"})
    assert r.status_code == 200, r.text
    first = np.load(io.BytesIO(r.content), allow_pickle=False)
    assert first.shape == (3,) + rows.shape[1:]
    np.testing.assert_array_equal(first, rows[:3])
    assert int(r.headers["x-rows-total"]) == rows.shape[0]

    manifest = stack.read_manifest(job_id)
    assert manifest["uri"] == uri and manifest["shape"] == list(expected.shape)
    if stack.backend == "local":
        assert (Path(stack.results_url) / job_id / "manifest.json").is_file()


def test_batch_jacobian_job_over_http(stack: Stack, models_root: Path) -> None:
    x = np.random.default_rng(8).normal(size=(4, 8)).astype(np.float32)
    job_id = stack.submit({"model": {"path": str(models_root / "mlp")}, "inputs": {"x": tensor(x)},
                           "kind": "batch_jacobian"})  # of, wrt, signature and mode by default
    record = stack.wait(job_id)
    expected = tape_jacobian(models_root / "mlp", {"x": x}, "y", "x", batch=True)
    assert expected.shape == (4, 4, 8)
    got = stack.open_result(record["result"]["uri"])[:]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    rows_total = record["progress"]["rows_total"]
    check_progress_and_plan(record, rows_total=rows_total)
    assert rows_total >= 1
    manifest = stack.read_manifest(job_id)
    assert manifest["shape"] == [4, 4, 8] and manifest["kind"] == "batch_jacobian"


def test_bad_request_is_422_and_queues_nothing(stack: Stack) -> None:
    import redis

    conn = redis.Redis.from_url(stack.redis_url)
    queue_key = f"rq:queue:{stack.queue_name}"

    def snapshot() -> tuple[int, int, list[str]]:
        return (conn.llen(queue_key), conn.zcard("jacobian:jobs"),
                sorted(p.name for p in Path(stack.results_url).iterdir()))

    before = snapshot()
    x = np.zeros((2, 7), np.float32)  # the model wants (None, 8)
    r = stack.client.post("/v1/jobs", json={"model": {"path": "mlp"}, "inputs": {"x": tensor(x)},
                                            "of": "y", "wrt": "x", "kind": "jacobian"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] and "x" in error["message"]
    good_x = tensor(np.zeros((2, 8), np.float32))
    r = stack.client.post("/v1/jobs", json={"model": {"path": "mlp"}, "inputs": {"x": good_x}, "of": "nope",
                                            "kind": "jacobian"})
    assert r.status_code == 422, r.text
    assert "nope" in r.json()["error"]["message"]
    assert snapshot() == before
    conn.close()
