"""Jobs through a real redis-server: rq with the JSON serializer, JacobianWorker, JobStore, Zarr on disk."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import zarr
from rq import Queue, Retry
from rq.job import Job
from rq.job import JobStatus as RqStatus
from rq.serializers import JSONSerializer

from contracts import storage
from contracts.jobspec import JobStatus, ModelRef, QueuedJob
from contracts.jobstore import JobRecord, JobStore
from contracts.records import dump
from contracts.settings import get_settings
from tests import models
from tests.conftest import work_burst

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ROW_BYTES = 3 * 8 * 4  # mlp, batch 3: one Jacobian row is (3, 8) float32
BLOCK_BYTES = 2 * ROW_BYTES  # two rows per storage block: 6 blocks for 12 rows


def reference_jacobian(model_dir: Path, x: np.ndarray) -> np.ndarray:
    """d y / d x by ``tf.GradientTape.jacobian``: shape (3, 4, 3, 8)."""
    import tensorflow as tf

    loaded = tf.saved_model.load(str(model_dir))  # keep it alive: the signature needs its variables
    fn = loaded.signatures["serving_default"]
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = fn(x=xt)["y"]
    return tape.jacobian(y, xt).numpy()


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    models.mlp(root / "mlp")
    return root


@pytest.fixture
def x() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)


@pytest.fixture
def env(worker_env):
    """JACOBIAN_* variables for this test; the results directory."""
    return worker_env(BLOCK_BYTES)


def submit(conn, results: Path, model_root: Path, x: np.ndarray, *, retries: int = 2,
           cancel_requested: bool = False, **options) -> str:
    """What the API does: inputs .npz in storage, a JobRecord, an rq job by dotted path (JSON)."""
    job_id = uuid.uuid4().hex
    buf = io.BytesIO()
    np.savez(buf, x=x)
    inputs_uri = storage.join(str(results), job_id, "inputs.npz")
    storage.write_bytes(inputs_uri, buf.getvalue())
    spec = QueuedJob(id=job_id, model=ModelRef(path=str(model_root / "mlp")), inputs_uri=inputs_uri,
                     results_url=str(results), **{"of": "y", "wrt": "x", **options}).model_dump(mode="json")
    JobStore(conn).create(JobRecord(id=job_id, status=JobStatus.queued, spec=spec, created_at=time.time(),
                                    cancel_requested=cancel_requested))
    queue = Queue(get_settings().queue_name, connection=conn, serializer=JSONSerializer)
    queue.enqueue("worker.tasks.run_job", spec, job_id=job_id, retry=Retry(max=retries) if retries else None,
                  job_timeout=600)
    return job_id


def test_chunk_rows_beyond_the_job_is_clamped_to_its_rows(env, redis_conn, model_root, x):
    """A forced chunk of a million rows on a 12-row job computes 12 rows, not a million padded ones."""
    job_id = submit(redis_conn, env, model_root, x, chunk_rows=10**6)
    work_burst(redis_conn)
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.succeeded, rec.error
    assert rec.plan.chunk_rows == 12
    np.testing.assert_allclose(zarr.open_array(rec.result.uri + "/jacobian", mode="r")[...],
                               reference_jacobian(model_root / "mlp", x), rtol=1e-5, atol=1e-6)


def test_job_succeeds_with_progress_plan_manifest_and_exact_result(env, redis_conn, model_root, x):
    job_id = submit(redis_conn, env, model_root, x, chunk_rows=5)
    work_burst(redis_conn)
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.succeeded, rec.error
    assert rec.error is None and rec.started_at and rec.finished_at and rec.finished_at >= rec.started_at
    assert rec.progress.rows_done == rec.progress.rows_total == 12
    assert rec.progress.fraction == 1.0 and rec.progress.eta_seconds == 0.0
    assert rec.progress.rows_per_second > 0
    assert rec.plan.chunk_rows == 5 and rec.plan.strategy and rec.plan.mode == "reverse"
    result = dump(rec.result)
    guard = {k: result.pop(k) for k in ("precision_error", "precision_probes", "precision_method")}
    assert result == {"uri": str(env / job_id / "result.zarr"), "shape": [3, 4, 3, 8], "dtype": "float32"}
    assert 0 <= guard["precision_error"] < 1e-5 and guard["precision_probes"] == 3   # the float64 probes' estimate
    manifest = json.loads((env / job_id / "manifest.json").read_text())
    assert manifest["precision_error"] == guard["precision_error"]
    assert manifest["id"] == job_id and manifest["shape"] == [3, 4, 3, 8] and manifest["kind"] == "jacobian"
    assert manifest["of"] == "y" and manifest["wrt"] == "x" and manifest["plan"]["chunk_rows"] == 5
    assert manifest["model"]["path"] == str(model_root / "mlp")
    assert sorted(os.listdir(env / job_id / "committed")) == [str(i) for i in range(6)]
    arr = zarr.open_array(rec.result.uri + "/jacobian", mode="r")  # plain zarr, no project code
    assert arr.chunks == (1, 2, 3, 8)  # rows run over (3, 4); two rows per block
    np.testing.assert_allclose(arr[:], reference_jacobian(model_root / "mlp", x), rtol=1e-5, atol=1e-6)
    assert Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer).get_status() == RqStatus.FINISHED


def test_transient_storage_failure_is_retried_by_rq_and_resumes(env, redis_conn, model_root, x, monkeypatch):
    import worker.engine
    from worker.storage import ResultWriter, RetryPolicy

    monkeypatch.setattr(ResultWriter, "default_retry", RetryPolicy(attempts=2, first_delay_s=0.01))
    real_write = storage.write_bytes
    failures = {"left": 2}

    def flaky_write(url, data):  # the commit marker of block 3 fails twice: one whole attempt
        if url.endswith("/committed/3") and failures["left"] > 0:
            failures["left"] -= 1
            raise OSError("connection reset by storage")
        real_write(url, data)

    monkeypatch.setattr(storage, "write_bytes", flaky_write)
    real_run = worker.engine.run_problem
    calls = []

    def spy_run(problem, **kwargs):
        rec = JobStore(redis_conn).get(job_id)
        calls.append((kwargs["ranges"], rec.progress.rows_done, max(reported, default=0)))
        return real_run(problem, **kwargs)

    monkeypatch.setattr(worker.engine, "run_problem", spy_run)
    reported = []
    real_set_fields = JobStore.set_fields

    def spy_set_fields(self, job_id, **fields):
        progress = fields.get("progress")
        if progress is not None:
            reported.append(progress["rows_done"] if isinstance(progress, dict) else progress.rows_done)
        return real_set_fields(self, job_id, **fields)

    monkeypatch.setattr(JobStore, "set_fields", spy_set_fields)
    job_id = submit(redis_conn, env, model_root, x, retries=1, chunk_rows=4)
    work_burst(redis_conn)  # the retried job is requeued at once and taken by the same burst
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.succeeded and rec.error is None
    assert [c[0] for c in calls] == [[(0, 12)], [(6, 12)]]  # blocks 0-2 committed before the failure
    # The first attempt handed 8 to 12 rows to the writer before block 3's commit failed (the writer's thread
    # races the compute); the resumed one restarts from the 6 committed rows. Progress keeps what the first
    # attempt reported (it went back to 6 before) and never goes back.
    assert calls[1][1] == calls[1][2] >= 8 and reported == sorted(reported) and reported[-1] == 12, (calls, reported)
    np.testing.assert_allclose(zarr.open_array(rec.result.uri + "/jacobian", mode="r")[:],
                               reference_jacobian(model_root / "mlp", x), rtol=1e-5, atol=1e-6)


def test_transient_failure_without_retries_left_ends_failed(env, redis_conn, model_root, x, monkeypatch):
    from worker.storage import ResultWriter, RetryPolicy

    monkeypatch.setattr(ResultWriter, "default_retry", RetryPolicy(attempts=2, first_delay_s=0.01))
    real_write = storage.write_bytes
    monkeypatch.setattr(storage, "write_bytes", lambda url, data: (_ for _ in ()).throw(OSError("down"))
                        if "/committed/" in url else real_write(url, data))
    job_id = submit(redis_conn, env, model_root, x, retries=0)
    work_burst(redis_conn)
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.failed
    assert rec.error.type == "ResultWriteError" and "after 2 attempts" in rec.error.message
    assert Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer).get_status() == RqStatus.FAILED


def test_hostile_inputs_fail_the_job_before_anything_is_inflated(env, redis_conn, model_root, x):
    """The worker reads inputs.npz with the API's reader (contracts.npz): a member declaring a 64 MiB void
    dtype over 64 MiB of deflated zeros fails the job as InvalidInputs, from its header alone."""
    import zipfile

    job_id = submit(redis_conn, env, model_root, x, retries=2)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|V67108864", "fortran_order": False, "shape": (1,)})
    bomb = env / job_id / "inputs.npz"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zf, zf.open("x.npy", "w", force_zip64=True) as f:
        f.write(header.getvalue())
        for _ in range(64):
            f.write(bytes(1 << 20))
    assert bomb.stat().st_size < 1 << 20
    work_burst(redis_conn)
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.failed and rec.error.type == "InvalidInputs", rec.error
    assert "inputs.npz': input 'x': dtype '|V67108864' is not a number or boolean type" in rec.error.message
    assert Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer).retries_left == 2  # no retry


def test_engine_error_fails_with_clear_message_and_no_retry(env, redis_conn, model_root, x):
    job_id = submit(redis_conn, env, model_root, x, retries=2, wrt="nope")
    work_burst(redis_conn)
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.failed and rec.finished_at
    assert rec.error.type == "InvalidRequest"
    assert "wrt" in rec.error.message and "'x'" in rec.error.message  # names the field and the choice
    rq_job = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
    assert rq_job.get_status() == RqStatus.FINISHED and rq_job.retries_left == 2  # rq did not retry
    assert Queue(get_settings().queue_name, connection=redis_conn, serializer=JSONSerializer).count == 0
    assert not (env / job_id / "manifest.json").exists()


def test_cancel_between_chunks_removes_partial_data(env, redis_conn, model_root, x, monkeypatch):
    store_cls = JobStore
    real_set_fields = store_cls.set_fields

    def set_fields(self, job_id, **fields):  # a client cancels once the first chunk is reported
        written = real_set_fields(self, job_id, **fields)
        progress = fields.get("progress")
        if progress is not None and dump(progress).get("rows_done", 0) >= 2:
            real_set_fields(self, job_id, cancel_requested=True)
        return written

    monkeypatch.setattr(store_cls, "set_fields", set_fields)
    job_id = submit(redis_conn, env, model_root, x, chunk_rows=2)
    work_burst(redis_conn)
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.canceled and rec.finished_at and rec.result is None
    assert 2 <= rec.progress.rows_done < 12
    assert not (env / job_id).exists()


def test_job_canceled_while_queued_never_computes(env, redis_conn, model_root, x, monkeypatch):
    import worker.engine

    monkeypatch.setattr(worker.engine, "run_problem", lambda *a, **k: pytest.fail("computed a canceled job"))
    job_id = submit(redis_conn, env, model_root, x, cancel_requested=True)
    work_burst(redis_conn)
    assert JobStore(redis_conn).get(job_id).status == JobStatus.canceled


def test_model_outside_roots_fails(env, redis_conn, model_root, x, monkeypatch, tmp_path):
    monkeypatch.setenv("JACOBIAN_MODEL_ROOTS", str(tmp_path / "elsewhere"))
    get_settings.cache_clear()
    job_id = submit(redis_conn, env, model_root, x)
    work_burst(redis_conn)
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.failed and rec.error.type == "ModelPathNotAllowed"
    assert "model.path" in rec.error.message


def test_worker_heartbeats_while_a_job_runs(env, redis_conn, model_root, x, monkeypatch):
    from rq import Worker

    import worker.engine

    real_run = worker.engine.run_problem
    seen = {}

    def slow_run(problem, **kwargs):
        (w,) = Worker.all(connection=redis_conn, serializer=JSONSerializer)
        first = redis_conn.hget(w.key, "last_heartbeat")
        time.sleep(2.5)
        seen.update(first=first, later=redis_conn.hget(w.key, "last_heartbeat"), ttl=redis_conn.ttl(w.key))
        return real_run(problem, **kwargs)

    monkeypatch.setattr(worker.engine, "run_problem", slow_run)
    job_id = submit(redis_conn, env, model_root, x)
    work_burst(redis_conn)
    assert JobStore(redis_conn).get(job_id).status == JobStatus.succeeded
    assert seen["later"] != seen["first"]  # beats during the job, not only between jobs
    assert 0 < seen["ttl"] <= 61  # interval (1 s) + 60 s, not the 600 s job timeout


def test_worker_console_script_burst(env, redis_server, redis_conn, model_root, x):
    exe = shutil.which("jacobian", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "jacobian.cli"]
    job_id = submit(redis_conn, env, model_root, x, kind="batch_jacobian")
    out = subprocess.run(cmd + ["worker", "--burst"], env=os.environ.copy(), cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.succeeded, (rec.error, out.stderr[-3000:])
    full = reference_jacobian(model_root / "mlp", x)
    expected = np.stack([full[b, :, b, :] for b in range(3)])  # (3, 4, 8)
    got = zarr.open_array(rec.result.uri + "/jacobian", mode="r")[:]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_rerun_of_a_finished_job_computes_nothing(env, redis_conn, model_root, x, monkeypatch):
    import worker.engine

    job_id = submit(redis_conn, env, model_root, x)
    work_burst(redis_conn)
    manifest = (env / job_id / "manifest.json").read_bytes()
    # a worker died after the manifest but before the status update (the record says running); rq runs
    # the job again. No transition leads back from succeeded: the record is set as that worker left it.
    redis_conn.hset(JobStore(redis_conn).key(job_id), "status", JobStatus.running.value)
    spec = JobStore(redis_conn).get(job_id).spec
    monkeypatch.setattr(worker.engine, "run_problem", lambda *a, **k: pytest.fail("recomputed a finished job"))
    Queue(get_settings().queue_name, connection=redis_conn, serializer=JSONSerializer).enqueue(
        "worker.tasks.run_job", spec, job_id=job_id)
    work_burst(redis_conn)
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.succeeded and rec.result.shape == [3, 4, 3, 8]
    assert (env / job_id / "manifest.json").read_bytes() == manifest
