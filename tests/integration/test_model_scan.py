"""The graph scan at the edges: a model that writes or reads files or calls Python is refused by
``GET /v1/models/signature`` and ``POST /v1/jobs`` (422 ``ModelRefused``, nothing queued or written), and by
the worker when the model directory is replaced after POST (the job fails for good, the file is not written)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from contracts.jobspec import JobStatus
from contracts.jobstore import JobStore
from tests import hostile_models
from tests.conftest import work_burst

pytestmark = pytest.mark.integration

# (model directory, the op the scan must name)
FAMILIES = [("writes", "WriteFile"), ("reads", "ReadFile"), ("python", "EagerPyFunc")]


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """Outside every model root: the file the hostile models write, and the one they read."""
    folder = tmp_path_factory.mktemp("outside")
    (folder / "secret.txt").write_text("not for models")
    return folder


@pytest.fixture(scope="module")
def model_root(tmp_path_factory, outside) -> Path:
    """This module's model root: the hostile models, and ``clean`` (same signature, only math)."""
    root = tmp_path_factory.mktemp("scan-models")
    hostile_models.writes_file(root / "writes", outside / "written.txt")
    hostile_models.reads_file(root / "reads", outside / "secret.txt")
    hostile_models.calls_python(root / "python")
    hostile_models.clean(root / "clean")
    return root


def body(path: str) -> dict:
    return {"model": {"path": path}, "inputs": {"x": {"shape": [2, 3], "data": [0.5] * 6}}, "of": "y", "wrt": "x"}


def assert_refused(r, op: str, field: str) -> None:
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "ModelRefused", error
    message = error["message"]
    assert message.startswith(f"{field}: the model uses op '{op}' (node '{op}' in function '__inference___call__")
    assert "JACOBIAN_MODEL_OP_ALLOW=" in message and f'["{op}"]' in message


def assert_nothing_queued(redis_conn, results: Path) -> None:
    assert Queue("jacobian", connection=redis_conn).count == 0
    assert redis_conn.keys("rq:job:*") == [] and redis_conn.keys("jacobian:job:*") == []
    assert not results.exists() or not any(p.is_file() for p in results.rglob("*"))


@pytest.mark.parametrize(("name", "op"), FAMILIES)
def test_signature_endpoint_refuses(client, name, op):
    assert_refused(client.get("/v1/models/signature", params={"path": name}), op, "path")


@pytest.mark.parametrize(("name", "op"), FAMILIES)
def test_post_refuses_and_queues_nothing(client, redis_conn, results, outside, name, op):
    assert_refused(client.post("/v1/jobs", json=body(name)), op, "model.path")
    assert_nothing_queued(redis_conn, results)
    assert not (outside / "written.txt").exists()


def test_clean_model_is_accepted(client):
    r = client.get("/v1/models/signature", params={"path": "clean"})
    assert r.status_code == 200, r.text
    assert set(r.json()["inputs"]) == {"x"}


def test_operator_allows_an_op_for_one_root(client, model_root, monkeypatch):
    from contracts.settings import get_settings

    monkeypatch.setenv("JACOBIAN_MODEL_OP_ALLOW", json.dumps({str(model_root / "reads"): ["ReadFile"]}))
    get_settings.cache_clear()
    assert client.get("/v1/models/signature", params={"path": "reads"}).status_code == 200
    assert_refused(client.get("/v1/models/signature", params={"path": "writes"}), "WriteFile", "path")


def test_worker_refuses_a_model_replaced_after_post(worker_client, redis_conn, model_root, outside):
    """POST accepts ``swapped`` (a clean model); the directory is then replaced by the one that writes a file.
    The worker scans before loading: the job fails for good as ModelRefused, nothing is written or retried."""
    swapped = model_root / "swapped"
    shutil.copytree(model_root / "clean", swapped)
    r = worker_client.post("/v1/jobs", json=body("swapped"))
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    shutil.rmtree(swapped)
    shutil.copytree(model_root / "writes", swapped, copy_function=shutil.copy)  # a new mtime
    work_burst(redis_conn)
    record = JobStore(redis_conn).get(job_id)
    assert record.status == JobStatus.failed, record
    assert record.error.type == "ModelRefused", record.error
    assert record.error.message.startswith("model.path: the model uses op 'WriteFile'")
    assert not (outside / "written.txt").exists()
    rq_job = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
    assert rq_job.retries_left == 2  # failed for good: rq did not retry
