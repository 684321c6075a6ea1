"""One Jacobian across several workers: row-range shards over rq, finished by a finalizer.

Two kinds of tests:
- two real worker processes (``tests/integration/shard_worker.py``) on a private redis-server:
  sharded results bitwise equal to unsharded ones, and a worker SIGKILLed mid-shard whose shard rq's
  abandoned-job handling re-runs while the other shards keep their committed blocks;
- an in-process burst worker (cheap): a transient shard failure retried alone, a shard failing for
  good, a shard lost without a trace (the finalizer refuses to claim success), cancel, the GET.
"""

from __future__ import annotations

import io
import json
import os
import signal
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
from contracts.jobspec import (
    JobStatus,
    ModelRef,
    QueuedJob,
    finalizer_job_id,
    shard_job_id,
)
from contracts.jobstore import JobRecord, JobStore
from contracts.records import dump
from contracts.settings import get_settings
from tests import models
from tests.conftest import RedisServer, work_burst
from tests.integration.shard_worker import DELAY_KEY
from tests.procs import stop_all

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BLOCK_BYTES = 2 * 3 * 8 * 4  # the MLP with batch 3: two rows per block, 6 blocks for its 12 rows
TWO_WORKER_QUEUE = "jacobian-shards-test"


def mlp_x(batch: int = 3) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(batch, 8)).astype(np.float32)


def cnn_x() -> np.ndarray:
    return np.random.default_rng(1).normal(size=(2, 8, 8, 3)).astype(np.float32)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    models.mlp(root / "mlp")
    models.cnn(root / "cnn")
    return root


def submit(conn, results: Path, model_root: Path, inputs: dict[str, np.ndarray], *, model: str = "mlp",
           retries: int = 2, queue_name: str | None = None, **options) -> str:
    """What the API does: inputs .npz in storage, a JobRecord, ``run_job`` on the queue by dotted path."""
    job_id = uuid.uuid4().hex
    buf = io.BytesIO()
    np.savez(buf, **inputs)
    inputs_uri = storage.join(str(results), job_id, "inputs.npz")
    storage.write_bytes(inputs_uri, buf.getvalue())
    spec = QueuedJob(id=job_id, model=ModelRef(path=str(model_root / model)), inputs_uri=inputs_uri,
                     results_url=str(results), **options).model_dump(mode="json")
    JobStore(conn).create(JobRecord(id=job_id, status=JobStatus.queued, spec=spec, created_at=time.time()))
    queue = Queue(queue_name or get_settings().queue_name, connection=conn, serializer=JSONSerializer)
    queue.enqueue("worker.tasks.run_job", spec, job_id=job_id, retry=Retry(max=retries) if retries else None,
                  job_timeout=600)
    return job_id


def tape_jacobian(model_dir: Path, x: np.ndarray) -> np.ndarray:
    """d y / d x of the MLP by ``tf.GradientTape.jacobian``."""
    import tensorflow as tf

    loaded = tf.saved_model.load(str(model_dir))  # keep it alive: the signature needs its variables
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = loaded.signatures["serving_default"](x=xt)["y"]
    return tape.jacobian(y, xt).numpy()


def result_bytes(rec: JobRecord) -> bytes:
    arr = zarr.open_array(rec.result.uri + "/jacobian", mode="r")[:]
    return np.ascontiguousarray(arr).tobytes()


def rq_job(conn, rq_id: str) -> Job:
    return Job.fetch(rq_id, connection=conn, serializer=JSONSerializer)


def test_live_workers_are_those_with_a_recent_heartbeat(redis_conn, monkeypatch):
    """A killed worker's key lives on for a minute or more (its TTL); its heartbeat stops. Only workers
    that beat recently count for the shard rule (a resumed job was split over a dead worker before)."""
    from datetime import timedelta

    from rq import Worker
    from rq.utils import now, utcformat

    from worker.sharding import live_workers

    monkeypatch.setenv("JACOBIAN_WORKER_HEARTBEAT_S", "10")
    monkeypatch.setenv("JACOBIAN_WORKER_MAINTENANCE_S", "15")
    get_settings.cache_clear()
    queue = Queue("live-workers", connection=redis_conn, serializer=JSONSerializer)
    up, killed = (Worker([queue], connection=redis_conn, name=name) for name in ("up", "killed"))
    up.register_birth()
    killed.register_birth()
    redis_conn.hset(killed.key, "last_heartbeat", utcformat(now() - timedelta(seconds=65)))  # its last beat
    assert redis_conn.ttl(killed.key) > 0  # still registered
    assert live_workers(redis_conn, queue) == 1  # default window: 2 x max(heartbeat 10 s, maintenance 15 s)
    assert live_workers(redis_conn, queue, recent_s=70) == 2
    redis_conn.hset(up.key, "last_heartbeat", "not a time")
    assert live_workers(redis_conn, queue, recent_s=70) == 1
    get_settings.cache_clear()


# -- two worker processes ---------------------------------------------------------------------------


class WorkerPool:
    """Two ``shard_worker`` processes on a private redis-server; results on local disk."""

    def __init__(self, tmp: Path, model_root: Path) -> None:
        import redis

        (tmp / "redis").mkdir()
        self.redis = RedisServer(tmp / "redis", appendonly=False)
        self.conn = redis.Redis.from_url(self.redis.url)
        self.results = tmp / "results"
        self.model_root = model_root
        self.env = {**os.environ, "JACOBIAN_REDIS_URL": self.redis.url, "JACOBIAN_RESULTS_URL": str(self.results),
                    "JACOBIAN_MODEL_ROOTS": str(model_root), "JACOBIAN_BLOCK_BYTES": str(BLOCK_BYTES),
                    "JACOBIAN_QUEUE_NAME": TWO_WORKER_QUEUE, "JACOBIAN_WORKER_HEARTBEAT_S": "1",
                    "JACOBIAN_SHARD_MIN_SECONDS": "0", "JACOBIAN_TRY_XLA": "0", "JACOBIAN_LOG_FORMAT": "text",
                    "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)}
        self.logs = [open(tmp / f"worker{i}.log", "wb") for i in range(2)]
        self.procs = [subprocess.Popen([sys.executable, "-m", "tests.integration.shard_worker"], cwd=REPO,
                                       env=self.env, stdout=log, stderr=subprocess.STDOUT) for log in self.logs]
        self.tmp = tmp
        self.wait(lambda: self.live() == 2, timeout_s=120, what="two workers registered")

    def live(self) -> int:
        from worker.sharding import live_workers

        return live_workers(self.conn, self.queue)

    @property
    def queue(self) -> Queue:
        return Queue(TWO_WORKER_QUEUE, connection=self.conn, serializer=JSONSerializer)

    def store(self) -> JobStore:
        return JobStore(self.conn)

    def submit(self, inputs: dict[str, np.ndarray], **options) -> str:
        return submit(self.conn, self.results, self.model_root, inputs, queue_name=TWO_WORKER_QUEUE, **options)

    def wait(self, cond, *, timeout_s: float = 180, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            for p in self.procs:
                if p.poll() is not None and p.returncode not in (-signal.SIGKILL,):
                    pytest.fail(f"a worker exited with {p.returncode} while waiting for {what}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}\n{self.log_tail()}")
            time.sleep(0.02)

    def wait_terminal(self, *ids: str, timeout_s: float = 180) -> list[JobRecord]:
        store = self.store()
        self.wait(lambda: all(store.get(i).status.is_terminal for i in ids), timeout_s=timeout_s,
                  what=f"jobs {ids} to end")
        return [store.get(i) for i in ids]

    def log_tail(self) -> str:
        out = []
        for i in range(2):
            self.logs[i].flush()
            out.append(f"--- worker {i}\n" + (self.tmp / f"worker{i}.log").read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def close(self) -> None:
        stop_all(self.procs, timeout_s=30)
        for log in self.logs:
            log.close()
        self.conn.close()
        self.redis.stop()


@pytest.fixture(scope="module")
def pool(tmp_path_factory, model_root):
    p = WorkerPool(tmp_path_factory.mktemp("two-workers"), model_root)
    yield p
    p.close()


def test_sharded_results_equal_unsharded_bitwise_with_two_workers(pool):
    x, image = mlp_x(), cnn_x()
    jobs = {
        "mlp2": pool.submit({"x": x}, shards=2, chunk_rows=2),
        "mlp3": pool.submit({"x": x}, shards=3, chunk_rows=2),
        "mlp_auto": pool.submit({"x": x}, chunk_rows=2),  # shards null: 2 live workers, 6 blocks -> 2
        "cnn3": pool.submit({"image": image}, model="cnn", shards=3, chunk_rows=2),
    }
    recs = dict(zip(jobs, pool.wait_terminal(*jobs.values())))
    for name, rec in recs.items():
        assert rec.status == JobStatus.succeeded, (name, rec.error, pool.log_tail())
    assert {name: rec.plan.shards for name, rec in recs.items()} == {"mlp2": 2, "mlp3": 3, "mlp_auto": 2,
                                                                       "cnn3": 3}
    store = pool.store()
    workers_seen = set()
    for rec in recs.values():
        n = rec.plan.shards
        plan = store.shard_plan(rec.id)
        assert plan["rows_total"] == rec.progress.rows_total == rec.progress.rows_done
        assert rec.progress.fraction == 1.0 and rec.error is None
        assert set(rec.to_public()) >= {"id", "status", "progress", "plan", "result", "error", "created_at",
                                        "started_at", "finished_at"}
        shard_strategies = set()
        for i in range(n):
            job = rq_job(pool.conn, shard_job_id(rec.id, i))
            assert job.get_status() == RqStatus.FINISHED
            workers_seen.add(job.worker_name)
            shard_strategies.add(job.args[0]["strategy"])
            start, stop = plan["ranges"][i]
            assert store.shard_progress(rec.id)[i]["rows_computed"] == stop - start  # each row computed once
        assert shard_strategies == {plan["strategy"]}  # pinned by the planner for every shard
        assert rq_job(pool.conn, finalizer_job_id(rec.id)).get_status() == RqStatus.FINISHED
        manifest = json.loads((pool.results / rec.id / "manifest.json").read_text())
        assert manifest["rows"] == [0, plan["rows_total"]] and manifest["plan"]["shards"] == n
        # the finalizer's precision estimate over the whole result (float64 probes), as a job in one piece has
        assert manifest["precision_probes"] == 3 and 0 <= manifest["precision_error"] < 1e-5, manifest
        assert rec.result.precision_error == manifest["precision_error"]
        assert len(os.listdir(pool.results / rec.id / "committed")) == manifest["blocks"] >= n
    assert len(workers_seen) == 2, workers_seen  # both workers computed shards

    # The same jobs in one piece, with the strategy their shards used and the same chunk: bitwise equal.
    # (Each planner pins the strategy its own timed trial picked; tiled and vectorized rows of this
    # MLP differ in the last bit, so the reference takes the same one.)
    inputs = {"mlp": {"x": x}, "cnn": {"image": image}}
    wanted = {(name[:3], rec.plan.strategy) for name, rec in recs.items()}
    refs = {key: pool.submit(inputs[key[0]], model=key[0], shards=1, chunk_rows=2, strategy=key[1])
            for key in sorted(wanted)}
    ref_recs = dict(zip(refs, pool.wait_terminal(*refs.values())))
    for rec in ref_recs.values():
        assert rec.status == JobStatus.succeeded and rec.plan.shards == 1, rec.error
        assert not Job.exists(finalizer_job_id(rec.id), connection=pool.conn)  # one piece: no finalizer
    for name, rec in recs.items():
        assert result_bytes(rec) == result_bytes(ref_recs[(name[:3], rec.plan.strategy)]), name
    np.testing.assert_allclose(zarr.open_array(recs["mlp2"].result.uri + "/jacobian", mode="r")[:],
                               tape_jacobian(pool.model_root / "mlp", x), rtol=1e-5, atol=1e-6)


def test_worker_killed_mid_shard_only_that_shard_reruns(pool):
    """SIGKILL the worker computing shard 2 after it committed some blocks; rq's abandoned-job
    handling requeues that shard alone, the other worker resumes it from its committed blocks."""
    from rq.registry import StartedJobRegistry

    x = mlp_x(batch=6)  # rows (6, 4): one row is (6, 8) float32 = one 192-byte block: 24 blocks
    pool.conn.set(DELAY_KEY, "0.15")
    try:
        job_id = pool.submit({"x": x}, shards=2, chunk_rows=2)
        store = pool.store()

        def shard_committed(i: int) -> int:
            plan = store.shard_plan(job_id)
            if not plan:
                return 0
            start, stop = plan["ranges"][i]
            names = storage.list_names(str(pool.results / job_id / "committed"))
            return sum(1 for n in names if start <= int(n) < stop)

        pool.wait(lambda: shard_committed(1) >= 3, what="shard 2 to commit three blocks")
        victim_name = rq_job(pool.conn, shard_job_id(job_id, 1)).worker_name
        victim = next(p for p in pool.procs if str(p.pid) in victim_name.split("."))
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        plan = store.shard_plan(job_id)
        (a0, b0), (a1, b1) = plan["ranges"]
        committed_at_kill = {n: os.stat(pool.results / job_id / "committed" / n).st_mtime_ns
                             for n in os.listdir(pool.results / job_id / "committed")}
        in_shard2 = [n for n in committed_at_kill if a1 <= int(n) < b1]
        computed_at_kill = store.shard_progress(job_id)[1]["rows_computed"]
        assert 3 <= len(in_shard2) < b1 - a1, "the kill came too late: shard 2 was complete"
        assert store.get(job_id).status == JobStatus.running
        pool.conn.delete(DELAY_KEY)
        # The survivor finishes shard 1; the finalizer waits for shard 2, 'started' by a dead worker
        # until rq's maintenance (in the surviving worker) finds its heartbeat expired and requeues it.
        pool.wait(lambda: rq_job(pool.conn, shard_job_id(job_id, 0)).get_status() == RqStatus.FINISHED,
                  what="shard 1 to finish")

        def held_by_victim() -> bool:
            job = rq_job(pool.conn, shard_job_id(job_id, 1))
            return job.get_status() == RqStatus.STARTED and job.worker_name == victim_name

        deadline = time.monotonic() + 60
        while held_by_victim() and time.monotonic() < deadline:
            time.sleep(0.1)
        if held_by_victim():  # maintenance runs less often than this test waits (rq's default: 10 min):
            StartedJobRegistry(queue=pool.queue).cleanup(timestamp=time.time() + 3600)  # run it now
        (rec,) = pool.wait_terminal(job_id)
    finally:
        pool.conn.delete(DELAY_KEY)
    assert rec.status == JobStatus.succeeded, (rec.error, pool.log_tail())
    shard2 = rq_job(pool.conn, shard_job_id(job_id, 1))
    assert shard2.get_status() == RqStatus.FINISHED and shard2.retries_left == 1  # retried once, by rq
    after = {n: os.stat(pool.results / job_id / "committed" / n).st_mtime_ns
             for n in os.listdir(pool.results / job_id / "committed")}
    assert len(after) == 24
    assert all(after[n] == t for n, t in committed_at_kill.items())  # committed blocks were not rewritten
    progress = store.shard_progress(job_id)
    assert progress[0]["rows_computed"] == b0 - a0  # the other shard kept its work: computed once
    rows_per_block = 1
    assert progress[1]["rows_computed"] == computed_at_kill + (b1 - a1) - len(in_shard2) * rows_per_block
    # the result is the one an uninterrupted run gives, bit for bit
    ref = pool.submit({"x": x}, shards=1, chunk_rows=2, strategy=rec.plan.strategy)
    (ref_rec,) = pool.wait_terminal(ref)
    assert ref_rec.status == JobStatus.succeeded
    assert result_bytes(rec) == result_bytes(ref_rec)


# -- one in-process worker --------------------------------------------------------------------------


@pytest.fixture
def env(worker_env):
    """JACOBIAN_* variables for this test; the results directory."""
    return worker_env(BLOCK_BYTES)


@pytest.fixture
def spy(monkeypatch):
    """Records (rq job id, ranges) of every run_problem call."""
    from rq import get_current_job

    import worker.engine

    real_run = worker.engine.run_problem
    calls: list[tuple[str, list]] = []

    def spy_run(problem, **kwargs):
        calls.append((get_current_job().id, list(kwargs["ranges"])))
        return real_run(problem, **kwargs)

    monkeypatch.setattr(worker.engine, "run_problem", spy_run)
    return calls


def test_transient_shard_failure_is_retried_alone(env, redis_conn, model_root, monkeypatch, spy):
    from fastapi.testclient import TestClient

    from app.main import create_app
    from worker.storage import ResultWriter, RetryPolicy

    monkeypatch.setattr(ResultWriter, "default_retry", RetryPolicy(attempts=2, first_delay_s=0.01))
    real_write = storage.write_bytes
    failures = {"left": 2}

    def flaky_write(url, data):  # block 5 (rows 10:12, the second block of shard 3) fails one attempt
        if url.endswith("/committed/5") and failures["left"] > 0:
            failures["left"] -= 1
            raise OSError("connection reset by storage")
        real_write(url, data)

    monkeypatch.setattr(storage, "write_bytes", flaky_write)
    x = mlp_x()
    job_id = submit(redis_conn, env, model_root, {"x": x}, shards=3, chunk_rows=2)
    work_burst(redis_conn)
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.succeeded, rec.error
    s = [shard_job_id(job_id, i) for i in range(3)]
    assert spy == [(s[0], [(0, 4)]), (s[1], [(4, 8)]), (s[2], [(8, 12)]), (s[2], [(10, 12)])]
    assert rq_job(redis_conn, s[2]).retries_left == 1 and rq_job(redis_conn, s[0]).retries_left == 2
    # shard 3 computed its 4 rows, then only the 2 rows of the block that was not committed
    assert [p["rows_computed"] for p in JobStore(redis_conn).shard_progress(job_id).values()] == [4, 4, 6]
    np.testing.assert_allclose(zarr.open_array(rec.result.uri + "/jacobian", mode="r")[:],
                               tape_jacobian(model_root / "mlp", x), rtol=1e-5, atol=1e-6)
    with TestClient(create_app()) as client:
        body = client.get(f"/v1/jobs/{job_id}").json()
    assert body["status"] == "succeeded" and body["plan"]["shards"] == 3
    assert body["progress"]["rows_done"] == body["progress"]["rows_total"] == 12
    assert body["result"]["shape"] == [3, 4, 3, 8]


def test_progress_is_summed_over_shards_while_running(env, redis_conn, model_root, monkeypatch):
    import worker.engine

    real_run = worker.engine.run_problem
    seen = []

    def spy_run(problem, **kwargs):
        seen.append(JobStore(redis_conn).get(job_id).to_public()["progress"])
        return real_run(problem, **kwargs)

    monkeypatch.setattr(worker.engine, "run_problem", spy_run)
    job_id = submit(redis_conn, env, model_root, {"x": mlp_x()}, shards=3, chunk_rows=2)
    work_burst(redis_conn)
    assert [p["rows_done"] for p in seen] == [0, 4, 8]  # as each shard starts, the others' rows count
    assert all(p["rows_total"] == 12 for p in seen)
    assert JobStore(redis_conn).get(job_id).progress.rows_done == 12


def test_shard_failing_for_good_fails_the_job(env, redis_conn, model_root, monkeypatch):
    from worker.storage import ResultWriter, RetryPolicy

    monkeypatch.setenv("JACOBIAN_JOB_RETRIES", "0")
    get_settings.cache_clear()
    monkeypatch.setattr(ResultWriter, "default_retry", RetryPolicy(attempts=2, first_delay_s=0.01))
    real_write = storage.write_bytes
    monkeypatch.setattr(storage, "write_bytes", lambda url, data: (_ for _ in ()).throw(OSError("down"))
                        if url.endswith("/committed/2") else real_write(url, data))
    job_id = submit(redis_conn, env, model_root, {"x": mlp_x()}, shards=3, chunk_rows=2, retries=0)
    work_burst(redis_conn)
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.failed and rec.result is None
    assert rec.error.type == "ResultWriteError"
    assert rec.error.message.startswith("shard 2 of 3 (rows 4:8): ") and "after 2 attempts" in rec.error.message
    assert rq_job(redis_conn, shard_job_id(job_id, 1)).get_status() == RqStatus.FAILED
    final = rq_job(redis_conn, finalizer_job_id(job_id))
    assert final.get_status() == RqStatus.FINISHED  # ran despite the failed dependency, claimed nothing
    assert final.return_value()["status"] == "failed"
    assert not (env / job_id / "manifest.json").exists() and not (env / job_id / "result.zarr").exists()


def test_shard_lost_without_a_trace_fails_the_job_in_the_finalizer(env, redis_conn, model_root):
    """A shard abandoned with no retries left is failed by rq itself (no code of ours runs): the
    finalizer (allow_failure) finds its blocks missing and fails the job, naming the shard."""
    from rq.job_lifecycle import record_job_failure

    job_id = submit(redis_conn, env, model_root, {"x": mlp_x()}, shards=3, chunk_rows=2, retries=0)
    queue = Queue(get_settings().queue_name, connection=redis_conn, serializer=JSONSerializer)
    from worker.main import JacobianWorker

    JacobianWorker([queue], connection=redis_conn, serializer=JSONSerializer).work(burst=True, max_jobs=1)
    assert JobStore(redis_conn).get(job_id).status == JobStatus.running  # split; shards queued
    lost = rq_job(redis_conn, shard_job_id(job_id, 1))
    queue.remove(lost)
    with redis_conn.pipeline() as pipe:  # what StartedJobRegistry.cleanup does to an abandoned job
        record_job_failure(lost, "Moved to FailedJobRegistry, due to AbandonedJobError", pipe)
        pipe.execute()
    queue.enqueue_dependents(lost)
    work_burst(redis_conn)
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.failed and rec.error.type == "ShardFailed"
    assert rec.error.message.startswith("shard 2 of 3 (rows 4:8) did not finish (2 blocks missing; rq: failed")
    assert not (env / job_id / "manifest.json").exists()


def test_cancel_reaches_every_shard(env, redis_conn, model_root, monkeypatch, spy):
    real_set_fields = JobStore.set_fields

    def set_fields(self, job_id, **fields):  # a client cancels once the planner has split the job
        written = real_set_fields(self, job_id, **fields)
        plan = dump(fields.get("plan")) or {}
        if plan.get("shards") == 3 and "chunk_rows" not in plan:
            real_set_fields(self, job_id, cancel_requested=True)
        return written

    monkeypatch.setattr(JobStore, "set_fields", set_fields)
    job_id = submit(redis_conn, env, model_root, {"x": mlp_x()}, shards=3, chunk_rows=2)
    work_burst(redis_conn)
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.canceled and rec.result is None
    assert spy == []  # every shard saw the flag before computing
    assert [rq_job(redis_conn, shard_job_id(job_id, i)).return_value()["status"] for i in range(3)] == ["stopped"] * 3
    assert not (env / job_id).exists()


def test_cancel_stops_running_shards_between_chunks(env, redis_conn, model_root, monkeypatch, spy):
    real_update = JobStore.update_shard_progress

    def update(self, job_id, index, progress, **kw):  # cancel once shard 1 reported its first chunk
        real_update(self, job_id, index, progress, **kw)
        if progress.rows_done >= 2:
            self.set_fields(job_id, cancel_requested=True)

    monkeypatch.setattr(JobStore, "update_shard_progress", update)
    job_id = submit(redis_conn, env, model_root, {"x": mlp_x()}, shards=2, chunk_rows=2)
    work_burst(redis_conn)
    rec = JobStore(redis_conn).get(job_id)
    assert rec.status == JobStatus.canceled
    assert [c[0] for c in spy] == [shard_job_id(job_id, 0)]  # shard 2 never computed
    assert 2 <= JobStore(redis_conn).shard_progress(job_id)[0]["rows_computed"] < 6
    assert not (env / job_id).exists()
