"""How an attempt ends, through a real redis-server and an in-process worker: the outcomes that
``worker.runs.attempt.classify`` gives, carried out by the job, its shards and the finalizer."""

from __future__ import annotations

import io
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from rq import Queue
from rq.job import Job
from rq.job import JobStatus as RqStatus
from rq.serializers import JSONSerializer

from contracts import storage
from contracts.jobspec import JobStatus, ModelRef, QueuedJob, shard_job_id
from contracts.jobstore import JobRecord, JobStore
from contracts.records import dump
from contracts.settings import get_settings
from tests import models
from tests.conftest import work_burst

pytestmark = pytest.mark.integration

ROW_BYTES = 3 * 8 * 4  # mlp, batch 3: one Jacobian row is (3, 8) float32
BLOCK_BYTES = 2 * ROW_BYTES  # two rows per storage block: 6 blocks for 12 rows


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("attempt-models")
    models.mlp(root / "mlp")
    return root


def submit(conn, results_url: str, model_root: Path, *, timeout_s: int, **options) -> str:
    """What the API does: inputs .npz in storage, a JobRecord, ``run_job`` on the queue (JSON)."""
    job_id = uuid.uuid4().hex
    buf = io.BytesIO()
    np.savez(buf, x=np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32))
    inputs_uri = storage.join(results_url, job_id, "inputs.npz")
    storage.write_bytes(inputs_uri, buf.getvalue())
    spec = QueuedJob(id=job_id, model=ModelRef(path=str(model_root / "mlp")), inputs_uri=inputs_uri,
                     results_url=results_url, of="y", wrt="x", mode="reverse", chunk_rows=2,
                     strategy="tiled", **options).model_dump(mode="json")
    JobStore(conn).create(JobRecord(id=job_id, status=JobStatus.queued, spec=spec, created_at=time.time()))
    Queue(get_settings().queue_name, connection=conn, serializer=JSONSerializer).enqueue(
        "worker.tasks.run_job", spec, job_id=job_id, job_timeout=timeout_s)
    return job_id


def test_a_shard_over_the_job_timeout_fails_the_job_as_job_timeout(worker_env, redis_conn, model_root,
                                                                    monkeypatch):
    """A shard gets the job's timeout; running past it is the documented ``JobTimeout`` (not rq's
    ``JobTimeoutException`` logged as an unexpected error), naming the shard; the partial result goes."""
    from worker import storage as worker_storage

    results = str(worker_env(BLOCK_BYTES, TRY_XLA="0"))
    real = worker_storage.ResultWriter._write_block

    def slow(self, block, data):  # noqa: ANN001
        time.sleep(2.5)
        real(self, block, data)

    monkeypatch.setattr(worker_storage.ResultWriter, "_write_block", slow)  # 3 blocks a shard: 7.5 s > 4 s
    job_id = submit(redis_conn, results, model_root, timeout_s=4, shards=2)
    work_burst(redis_conn)

    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.failed, rec
    assert rec.error.type == "JobTimeout", rec.error
    assert rec.error.message.startswith("shard 1 of 2"), rec.error
    assert "4 s" in rec.error.message and "JACOBIAN_JOB_TIMEOUT_S" in rec.error.message
    shard = Job.fetch(shard_job_id(job_id, 0), connection=redis_conn, serializer=JSONSerializer)
    assert shard.get_status() == RqStatus.FAILED
    assert not (Path(results) / job_id / "manifest.json").exists()
    assert not (Path(results) / job_id / "result.zarr").exists()  # the finalizer removed the partial result


def test_shards_keep_their_own_plans_beside_the_jobs(worker_env, redis_conn, model_root):
    """Each shard's run plan is kept beside the planner's (no last writer wins); the manifest has
    exactly the job's final plan."""
    import json

    results = str(worker_env(BLOCK_BYTES, TRY_XLA="0"))
    job_id = submit(redis_conn, results, model_root, timeout_s=600, shards=3)
    work_burst(redis_conn)

    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.succeeded, rec.error
    plan = dump(rec.plan)  # as the manifest has it
    assert (plan["shards"], plan["strategy"], plan["mode"]) == (3, "tiled", "reverse")
    assert "chunk_rows" not in plan  # the planner's plan, not one shard's
    assert len(plan["shard_plans"]) == 3
    assert all(p["chunk_rows"] == 2 and p["strategy"] == "tiled" for p in plan["shard_plans"]), plan
    manifest = json.loads((Path(results) / job_id / "manifest.json").read_text())
    assert manifest["plan"] == plan
