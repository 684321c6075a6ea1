"""Fixtures: a real redis-server and a real S3 endpoint (moto's standalone server) on free ports."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.procs import free_port

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Plans (worker.engine.plan_cache) of this test session live in a folder of their own, never in ~/.cache.
os.environ["JACOBIAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="jacobian-test-plans-")

# TensorFlow is imported in this process as the engine imports it (worker/engine/tf_import.py: without Keras and JAX,
# the API's namespaces lazy) whichever test imports it first, so every test in this process runs on that import.
import worker.engine  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]


def wait_port(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout_s}s")


class RedisServer:
    """A private redis-server; ``restart()`` keeps its append-only file. ``bind``: its addresses (space-separated;
    ``url`` is always the 127.0.0.1 one)."""

    def __init__(self, workdir: Path, *, appendonly: bool = True, bind: str = "127.0.0.1") -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed: run scripts/setup.sh (apt-get install redis-server)")
        self.exe = exe
        self.workdir = workdir
        self.appendonly = appendonly
        self.bind = bind.split()
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.exe, "--port", str(self.port), "--bind", *self.bind, "--save", "",
                "--protected-mode", "yes" if self.bind == ["127.0.0.1"] else "no",
                "--dir", str(self.workdir), "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "always"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


class S3Server:
    """moto's standalone S3 server in its own process."""

    def __init__(self) -> None:
        self.port = free_port()
        exe = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(exe, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, timeout_s=60)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_conn(redis_server):
    import redis

    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    yield conn
    conn.flushall()
    conn.close()


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Standard AWS_* variables pointing at the moto server, and a fresh bucket; yields the bucket."""
    import uuid

    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    bucket = f"results-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    yield bucket


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    """The API test SavedModels (tests/models.API_MODELS) under one allowed model root."""
    from tests import models

    return models.build_models(tmp_path_factory.getbasetemp())


# -- a worker in this process -------------------------------------------------------------------------


@pytest.fixture
def worker_env(redis_server, redis_conn, model_root, tmp_path, monkeypatch):
    """JACOBIAN_* settings for a worker run in this process (``work_burst``): call it with the storage
    block size and any other settings (``TRY_XLA="0"``); it returns the results directory. The
    environment's JACOBIAN_QUEUE_NAME is dropped (the default queue); the signal handlers that rq's
    worker installs are put back afterwards."""
    from contracts.settings import get_settings

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    monkeypatch.delenv("JACOBIAN_QUEUE_NAME", raising=False)

    def configure(block_bytes: int, **settings: str) -> Path:
        results = tmp_path / "results"
        values = {"REDIS_URL": redis_server.url, "RESULTS_URL": str(results), "MODEL_ROOTS": str(model_root),
                  "BLOCK_BYTES": str(block_bytes), "WORKER_HEARTBEAT_S": "1", **settings}
        for name, value in values.items():
            monkeypatch.setenv(f"JACOBIAN_{name}", value)
        get_settings.cache_clear()
        return results

    yield configure
    for s, h in handlers.items():
        signal.signal(s, h)
    get_settings.cache_clear()


def work_burst(conn) -> None:
    """A ``JacobianWorker`` in this process on the configured queue until it is empty."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from contracts.settings import get_settings
    from worker.main import JacobianWorker

    queue = Queue(get_settings().queue_name, connection=conn, serializer=JSONSerializer)
    JacobianWorker([queue], connection=conn, serializer=JSONSerializer).work(burst=True)


def finished_job(client, redis_conn, job_id: str) -> dict:
    """Run the queue dry with a worker in this process, then the job's status, which must be ``succeeded``."""
    work_burst(redis_conn)
    record = client.get(f"/v1/jobs/{job_id}").json()
    assert record["status"] == "succeeded", record
    return record


def tensor(array) -> dict:
    """An array as the API's inline tensor JSON: ``{"shape", "dtype", "data"}``."""
    return {"shape": list(array.shape), "dtype": str(array.dtype), "data": array.ravel().tolist()}
