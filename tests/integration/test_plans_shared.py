"""Plans shared by workers through Redis: a worker that never saw a model (its own cache folder, as on
another machine) runs a request another worker planned with that plan, and keeps it in its folder."""

from __future__ import annotations

import io
import json
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from contracts import storage
from contracts.jobspec import JobStatus, ModelRef, QueuedJob
from contracts.jobstore import JobRecord, JobStore
from tests import models
from tests.procs import base_env, jacobian_exe

pytestmark = pytest.mark.integration

QUEUE = "jacobian-plans"


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    models.cnn(root / "cnn")
    return root


def submit(conn, results: Path, model_root: Path, image: np.ndarray) -> str:
    from rq import Queue
    from rq.serializers import JSONSerializer

    job_id = uuid.uuid4().hex
    buf = io.BytesIO()
    np.savez(buf, image=image)
    inputs_uri = storage.join(str(results), job_id, "inputs.npz")
    storage.write_bytes(inputs_uri, buf.getvalue())
    spec = QueuedJob(id=job_id, model=ModelRef(path=str(model_root / "cnn")), inputs_uri=inputs_uri,
                     results_url=str(results), of="logits", wrt="image").model_dump(mode="json")
    JobStore(conn).create(JobRecord(id=job_id, status=JobStatus.queued, spec=spec, created_at=time.time()))
    Queue(QUEUE, connection=conn, serializer=JSONSerializer).enqueue_call(
        "worker.tasks.run_job", args=(spec,), job_id=job_id)
    return job_id


def run_worker(env: dict[str, str], log: Path) -> None:
    """One ``jacobian worker --burst`` process: it works the queue until it is empty, then exits."""
    with open(log, "wb") as fh:
        proc = subprocess.run([*jacobian_exe(), "worker", "--burst"], env=env, stdout=fh, stderr=subprocess.STDOUT,
                              timeout=300)
    assert proc.returncode == 0, log.read_text(errors="replace")[-3000:]


def test_a_worker_that_never_saw_the_model_runs_with_the_plan_another_worker_made(
        redis_server, redis_conn, model_root, tmp_path):
    results = tmp_path / "results"
    common = {"JACOBIAN_REDIS_URL": redis_server.url, "JACOBIAN_RESULTS_URL": str(results),
              "JACOBIAN_MODEL_ROOTS": str(model_root), "JACOBIAN_QUEUE_NAME": QUEUE, "JACOBIAN_LOG_FORMAT": "text"}
    cache_a, cache_b = tmp_path / "cache-a", tmp_path / "cache-b"
    image = np.random.default_rng(0).standard_normal((4, 8, 8, 3)).astype(np.float32)
    store = JobStore(redis_conn)

    first = submit(redis_conn, results, model_root, image)
    run_worker(base_env(**common, JACOBIAN_CACHE_DIR=str(cache_a)), tmp_path / "a.log")
    rec_a = store.get(first)
    assert rec_a.status == JobStatus.succeeded, rec_a.error
    assert rec_a.plan.source == "default"
    keys = redis_conn.keys("jacobian:plan:*")
    assert len(keys) == 1, keys
    digest = keys[0].decode().rsplit(":", 1)[1]
    shared = json.loads(redis_conn.get(keys[0]))
    assert shared["jobs"] == 1 and shared["strategies"][shared["strategy"]]["verified_rows"]
    assert (cache_a / "plans" / f"{digest}.json").exists()

    second = submit(redis_conn, results, model_root, image * 0.5)  # same request, other values
    run_worker(base_env(**common, JACOBIAN_CACHE_DIR=str(cache_b)), tmp_path / "b.log")
    rec_b = store.get(second)
    assert rec_b.status == JobStatus.succeeded, rec_b.error
    assert rec_b.plan.source == "cache" and rec_b.plan.plan_key == rec_a.plan.plan_key
    # the shared plan's strategy, unless a trial of another one paid on this (timing-dependent) machine
    trial = rec_b.plan.model_extra.get("trial")
    assert rec_b.plan.strategy == shared["strategy"] or trial, (rec_b.plan.strategy, shared["strategy"])
    # worker B kept the plan in its own folder (the second level) and added its job to the shared one
    assert (cache_b / "plans" / f"{digest}.json").exists()
    assert json.loads(redis_conn.get(keys[0]))["jobs"] == 2
    # and ran at the planned chunk size from its first chunk: no calibration, no change of plan
    log_b = (tmp_path / "b.log").read_text(errors="replace")
    assert "plan chosen" in log_b and ("plan changed" not in log_b or trial), log_b[-3000:]
