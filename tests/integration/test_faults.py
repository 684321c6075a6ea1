"""Nothing lost (issue 5): worker kills, Redis restarts, storage outages, timeouts, result retention.

Real components only: a private ``redis-server`` (append-only file on), ``jacobian worker``
processes (``tests.integration.shard_worker``, whose storage writes can be slowed down through a
Redis key), moto's S3 server behind a TCP proxy that the tests cut and restore, and in-process
``JacobianWorker`` s for the timeout and retention tests. Measured figures are printed (``-s``).
"""

from __future__ import annotations

import io
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import boto3
import numpy as np
import pytest
import zarr
from rq import Queue, Retry
from rq.job import Job
from rq.job import JobStatus as RqStatus
from rq.serializers import JSONSerializer

from contracts import storage
from contracts.jobspec import JobStatus, ModelRef, QueuedJob
from contracts.jobstore import JobNotFound, JobRecord, JobStore
from contracts.settings import get_settings
from tests import models, sparse_models
from tests.conftest import RedisServer, free_port, work_burst
from tests.integration.shard_worker import DELAY_KEY
from tests.procs import stop_all

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
QUEUE = "jacobian-faults"
SIZES = (8, 16, 64)  # MLP 8-16-64
BATCH = 8  # x (8, 8): the Jacobian (8, 64, 8, 8) has 512 rows of (8, 8) float32 = 256 bytes
ROW_BYTES = BATCH * 8 * 4
ROWS_PER_BLOCK = 4
BLOCK_BYTES = ROWS_PER_BLOCK * ROW_BYTES  # 128 storage blocks
CHUNK_ROWS = 4
STRATEGY = "vectorized"  # pinned, so that every run computes rows alike (bitwise comparisons)
# Short on purpose (the defaults are 10 s and 15 s: a dead worker is found within 45 s); set
# FAULTS_HEARTBEAT_S / FAULTS_MAINTENANCE_S to measure other settings.
HEARTBEAT_S = int(os.environ.get("FAULTS_HEARTBEAT_S", "1"))
MAINTENANCE_S = int(os.environ.get("FAULTS_MAINTENANCE_S", "2"))


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fault-models")
    models.mlp(root / "mlp", sizes=SIZES)
    sparse_models.conv_net(root / "conv", size=20, channels=(3, 2))
    return root


def x_input() -> np.ndarray:
    return np.random.default_rng(5).normal(size=(BATCH, SIZES[0])).astype(np.float32)


def submit(conn, results_url: str, model_root: Path, *, retry: Retry | None = None, job_timeout: int = 600,
           queue_name: str = QUEUE, **options) -> str:
    """What the API does: inputs .npz in storage, a JobRecord, ``run_job`` on the queue (JSON). ``job_timeout``:
    rq's limit; ``options``: request fields (``timeout_s`` among them)."""
    job_id = uuid.uuid4().hex
    buf = io.BytesIO()
    np.savez(buf, x=x_input())
    inputs_uri = storage.join(results_url, job_id, "inputs.npz")
    storage.write_bytes(inputs_uri, buf.getvalue())
    spec = QueuedJob(id=job_id, model=ModelRef(path=str(model_root / "mlp")), inputs_uri=inputs_uri,
                     results_url=results_url, of="y", wrt="x", mode="reverse", chunk_rows=CHUNK_ROWS, strategy=STRATEGY,
                     shards=1, **options).model_dump(mode="json")
    JobStore(conn).create(JobRecord(id=job_id, status=JobStatus.queued, spec=spec, created_at=time.time()))
    Queue(queue_name, connection=conn, serializer=JSONSerializer).enqueue(
        "worker.tasks.run_job", spec, job_id=job_id, retry=retry, job_timeout=job_timeout)
    return job_id


# -- a TCP proxy in front of moto, to cut storage off and restore it on the same port ---------------


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``target``; ``cut()`` closes the listener and every connection
    (clients then get connection refused), ``restore()`` listens again on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.restore()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._thread.start()

    def cut(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    close = cut

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                ready, _, _ = select.select([a, b], [], [], 1.0)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    (b if s is a else a).sendall(data)
        except (OSError, ValueError):
            return
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass


# -- two worker processes on a private redis-server -------------------------------------------------


class Pool:
    """Two ``jacobian worker`` processes (with the slow-storage hook) on a private redis-server."""

    def __init__(self, tmp: Path, model_root: Path, s3_endpoint: str) -> None:
        import redis

        (tmp / "redis").mkdir()
        self.redis = RedisServer(tmp / "redis", appendonly=True)
        self.conn = redis.Redis.from_url(self.redis.url)
        self.results = str(tmp / "results")
        self.model_root, self.tmp = model_root, tmp
        self.env = {**os.environ, "JACOBIAN_REDIS_URL": self.redis.url, "JACOBIAN_RESULTS_URL": self.results,
                    "JACOBIAN_MODEL_ROOTS": str(model_root), "JACOBIAN_BLOCK_BYTES": str(BLOCK_BYTES),
                    "JACOBIAN_QUEUE_NAME": QUEUE, "JACOBIAN_WORKER_HEARTBEAT_S": str(HEARTBEAT_S),
                    "JACOBIAN_WORKER_MAINTENANCE_S": str(MAINTENANCE_S), "JACOBIAN_TRY_XLA": "0",
                    "JACOBIAN_LOG_FORMAT": "text", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO),
                    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                    "AWS_ENDPOINT_URL": s3_endpoint}
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        for _ in range(2):
            self.start_worker()
        self.wait(lambda: self.live() == 2, timeout_s=120, what="two workers registered")

    def start_worker(self) -> subprocess.Popen:
        log_path = self.tmp / f"worker{len(self.procs)}.log"
        self.logs.append(log_path)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "tests.integration.shard_worker"], cwd=REPO,
                                    env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def registered(self, proc: subprocess.Popen) -> bool:
        """Whether this worker process has registered with rq (its worker key exists)."""
        from rq import worker_registration

        keys = worker_registration.get_keys(queue=Queue(QUEUE, connection=self.conn, serializer=JSONSerializer),
                                            connection=self.conn)
        return any(k.endswith(f".{proc.pid}") and self.conn.exists(k) for k in keys)

    def start_registered_worker(self) -> None:
        proc = self.start_worker()
        self.wait(lambda: self.registered(proc), timeout_s=120, what="a new worker registered")

    def live(self) -> int:
        from worker.sharding import live_workers

        return live_workers(self.conn, Queue(QUEUE, connection=self.conn, serializer=JSONSerializer))

    def store(self) -> JobStore:
        return JobStore(self.conn)

    def submit(self, results_url: str | None = None, **kw) -> str:
        return submit(self.conn, results_url or self.results, self.model_root, **kw)

    def rq_status(self, job_id: str) -> str:
        return Job.fetch(job_id, connection=self.conn, serializer=JSONSerializer).get_status(refresh=True)

    def wait(self, cond, *, timeout_s: float = 90, what: str = "condition", poll_s: float = 0.02) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if cond():
                    return
            except Exception:  # noqa: BLE001 - e.g. Redis restarting: ask again
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}\n{self.log_tail()}")
            time.sleep(poll_s)

    def wait_terminal(self, job_id: str, timeout_s: float = 120) -> JobRecord:
        store = self.store()
        self.wait(lambda: store.get(job_id).status.is_terminal, timeout_s=timeout_s, what=f"job {job_id} to end")
        return store.get(job_id)

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name} (rc {proc.poll()})\n" + p.read_text(errors="replace")[-4000:]
                         for p, proc in zip(self.logs, self.procs))

    def close(self) -> None:
        stop_all(self.procs, timeout_s=20)
        self.conn.close()
        self.redis.stop()


@pytest.fixture(scope="module")
def proxy(s3_server):
    p = TcpProxy(s3_server.port)
    yield p
    p.close()


@pytest.fixture(scope="module")
def pool(tmp_path_factory, model_root, proxy):
    p = Pool(tmp_path_factory.mktemp("faults"), model_root, proxy.endpoint)
    yield p
    p.close()


def result_bytes(rec: JobRecord, **storage_options) -> bytes:
    uri = rec.result.uri + "/jacobian"
    return zarr.open_array(uri, mode="r", storage_options=storage_options or None)[:].tobytes()


def committed(results_url: str, job_id: str) -> list[str]:
    return storage.list_names(storage.join(results_url, job_id, "committed"))


def submit_sparse(conn, results_url: str, model_root: Path, *, retry: Retry | None = None) -> str:
    """A sparse Jacobian job (``sparsity: "auto"``) of the conv net, as the API would queue it."""
    job_id = uuid.uuid4().hex
    buf = io.BytesIO()
    np.savez(buf, image=np.random.default_rng(3).standard_normal((1, 20, 20, 3)).astype("float32"))
    inputs_uri = storage.join(results_url, job_id, "inputs.npz")
    storage.write_bytes(inputs_uri, buf.getvalue())
    spec = QueuedJob(id=job_id, model=ModelRef(path=str(model_root / "conv")), inputs_uri=inputs_uri,
                     results_url=results_url, of="out", wrt="image", chunk_rows=CHUNK_ROWS, shards=1,
                     sparsity="auto").model_dump(mode="json")
    JobStore(conn).create(JobRecord(id=job_id, status=JobStatus.queued, spec=spec, created_at=time.time()))
    Queue(QUEUE, connection=conn, serializer=JSONSerializer).enqueue(
        "worker.tasks.run_job", spec, job_id=job_id, retry=retry, job_timeout=600)
    return job_id


# -- 1. a worker SIGKILLed mid-job ------------------------------------------------------------------


def test_worker_killed_mid_job_resumes_on_other_worker_bitwise_equal(pool):
    """SIGKILL the worker of a 128-block job; the other worker's maintenance finds the expired
    heartbeat, rq's retry (with an interval, as the API enqueues) requeues the job, the other worker
    resumes from the committed blocks; the result equals an uninterrupted run bit for bit."""
    pool.conn.set(DELAY_KEY, "0.04")  # 128 blocks: about 5 s of storage writes
    try:
        job_id = pool.submit(retry=Retry(max=2, interval=[1]))
        store = pool.store()
        pool.wait(lambda: len(committed(pool.results, job_id)) >= 20, what="20 committed blocks")
        victim_name = Job.fetch(job_id, connection=pool.conn, serializer=JSONSerializer).worker_name
        victim = next(p for p in pool.procs if victim_name.endswith(f".{p.pid}"))
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        victim.wait(timeout=30)
        at_kill = {n: os.stat(Path(pool.results) / job_id / "committed" / n).st_mtime_ns
                   for n in committed(pool.results, job_id)}
        handed_to_writer = store.get(job_id).progress.rows_done  # rows computed by the dead worker (reported)
        pool.conn.delete(DELAY_KEY)

        def held_by_victim() -> bool:  # 'started' by the dead worker: not found yet
            job = Job.fetch(job_id, connection=pool.conn, serializer=JSONSerializer)
            return job.get_status(refresh=False) == RqStatus.STARTED and job.worker_name == victim_name

        pool.wait(lambda: not held_by_victim(), timeout_s=60, poll_s=0.05, what="the abandoned job to be detected")
        detected_s = time.monotonic() - killed_at
        rec = pool.wait_terminal(job_id)
    finally:
        pool.conn.delete(DELAY_KEY)
    assert rec.status == JobStatus.succeeded, (rec.error, pool.log_tail())
    assert rec.progress.rows_done == rec.progress.rows_total == 512 and rec.progress.fraction == 1.0
    job = Job.fetch(job_id, connection=pool.conn, serializer=JSONSerializer)
    assert job.retries_left == 1 and job.worker_name != victim_name  # retried once, on the survivor
    after = {n: os.stat(Path(pool.results) / job_id / "committed" / n).st_mtime_ns
             for n in committed(pool.results, job_id)}
    assert len(after) == 128 and (Path(pool.results) / job_id / "manifest.json").exists()
    assert all(after[n] == t for n, t in at_kill.items())  # committed blocks were never rewritten
    committed_rows = len(at_kill) * ROWS_PER_BLOCK
    twice = handed_to_writer - committed_rows  # + the chunk in flight in the engine at the kill (<= CHUNK_ROWS)
    bound = CHUNK_ROWS + 4 * ROWS_PER_BLOCK  # the writer holds at most queue_blocks (2) + 2 blocks uncommitted
    print(f"\n[faults] worker kill: {len(at_kill)} of 128 blocks committed at the kill; rows computed twice: "
          f"{twice} reported + <= {CHUNK_ROWS} in flight (bound {bound}); dead worker detected after "
          f"{detected_s:.1f} s (heartbeat {HEARTBEAT_S} s x 3 + maintenance {MAINTENANCE_S} s)")
    assert 0 <= twice <= bound
    assert detected_s <= 3 * HEARTBEAT_S + MAINTENANCE_S + 5  # slack for a loaded 2-core machine
    # an uninterrupted run of the same job on the surviving worker: bitwise equal
    ref = pool.wait_terminal(pool.submit())
    assert ref.status == JobStatus.succeeded, ref.error
    assert result_bytes(rec) == result_bytes(ref)


def test_worker_killed_with_no_retries_left_fails_the_job_clearly(pool):
    """The same kill with no retries: the job ends failed (WorkerDied), never stuck in 'running'."""
    pool.start_registered_worker()  # the survivor of the test above and a new one
    pool.conn.set(DELAY_KEY, "0.04")
    try:
        job_id = pool.submit()  # no Retry
        pool.wait(lambda: len(committed(pool.results, job_id)) >= 5, what="5 committed blocks")
        victim_name = Job.fetch(job_id, connection=pool.conn, serializer=JSONSerializer).worker_name
        victim = next(p for p in pool.procs if victim_name.endswith(f".{p.pid}"))
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        rec = pool.wait_terminal(job_id, timeout_s=60)
    finally:
        pool.conn.delete(DELAY_KEY)
    assert rec.status == JobStatus.failed and rec.error.type == "WorkerDied", rec.error
    assert "resubmit" in rec.error.message
    assert pool.rq_status(job_id) == RqStatus.FAILED
    assert not (Path(pool.results) / job_id / "manifest.json").exists()
    pool.start_registered_worker()  # two live workers again, for the tests below


# -- 2. Redis restarted during a job ----------------------------------------------------------------


def test_redis_restart_during_job_worker_and_api_reconnect(pool, monkeypatch):
    from fastapi.testclient import TestClient

    from app.main import create_app

    monkeypatch.setenv("JACOBIAN_REDIS_URL", pool.redis.url)
    monkeypatch.setenv("JACOBIAN_RESULTS_URL", pool.results)
    monkeypatch.setenv("JACOBIAN_MODEL_ROOTS", str(pool.model_root))
    monkeypatch.setenv("JACOBIAN_QUEUE_NAME", QUEUE)
    get_settings.cache_clear()
    try:
        with TestClient(create_app()) as api:
            pool.conn.set(DELAY_KEY, "0.03")
            job_id = pool.submit(retry=Retry(max=2, interval=[1]))
            pool.wait(lambda: len(committed(pool.results, job_id)) >= 10, what="10 committed blocks")
            assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "running"
            pool.redis.restart()  # appendonly: the queue and the records survive
            restarted = time.monotonic()
            rec = pool.wait_terminal(job_id)
            print(f"\n[faults] redis restart: job ended {rec.status.value} {time.monotonic() - restarted:.1f} s later")
            assert rec.status == JobStatus.succeeded, (rec.error, pool.log_tail())
            # the worker's Redis client retried through the restart: the attempt was never interrupted
            assert Job.fetch(job_id, connection=pool.conn, serializer=JSONSerializer).retries_left == 2
            answer = api.get(f"/v1/jobs/{job_id}")  # the API's connection pool reconnects
            assert answer.status_code == 200
            body = answer.json()
            assert body["status"] == "succeeded" and body["error"] is None
            assert body["progress"]["rows_done"] == body["progress"]["rows_total"] == 512
            assert body["progress"]["fraction"] == 1.0
            assert api.get("/readyz").status_code == 200
            assert all(p.poll() is None for p in pool.procs if p.returncode != -signal.SIGKILL), pool.log_tail()
    finally:
        pool.conn.delete(DELAY_KEY)
        get_settings.cache_clear()
    # the workers are still serving: another job goes through
    again = pool.wait_terminal(pool.submit())
    assert again.status == JobStatus.succeeded, again.error


REDIS_OUTAGE_S = 20.0  # longer than the ~13 s for which the workers' Redis client retries one command


def test_redis_down_longer_than_the_client_retries_the_job_still_finishes(pool):
    """Redis away for 20 s mid-job: once the client's retries run out, the running attempt fails
    on a connection error (transient), the workers keep retrying their connection (they do not
    exit) and, once Redis answers again, rq schedules the job's retry, which resumes from its
    committed blocks. The job ends succeeded with a true record, bitwise equal to an uninterrupted
    run, one retry spent."""
    pool.conn.set(DELAY_KEY, "0.03")
    try:
        job_id = pool.submit(retry=Retry(max=2, interval=[1]))
        pool.wait(lambda: len(committed(pool.results, job_id)) >= 10, what="10 committed blocks")
        pool.redis.stop()
        down_at = time.monotonic()
        time.sleep(REDIS_OUTAGE_S)
        pool.redis.start()  # appendonly: the queue, the registries and the records come back
        pool.conn.delete(DELAY_KEY)
        rec = pool.wait_terminal(job_id, timeout_s=240)
        print(f"\n[faults] redis down {REDIS_OUTAGE_S:.0f} s: job ended {rec.status.value} "
              f"{time.monotonic() - down_at:.1f} s after Redis went away")
    finally:
        pool.conn.delete(DELAY_KEY)
    assert rec.status == JobStatus.succeeded, (rec.error, pool.log_tail())
    assert rec.error is None
    # the outage outlasted the client's retries: the attempt was interrupted and retried
    assert Job.fetch(job_id, connection=pool.conn, serializer=JSONSerializer).retries_left == 1
    assert rec.progress.rows_done == rec.progress.rows_total == 512 and rec.progress.fraction == 1.0
    assert len(committed(pool.results, job_id)) == 128 and (Path(pool.results) / job_id / "manifest.json").exists()
    assert all(p.poll() is None for p in pool.procs if p.returncode != -signal.SIGKILL), pool.log_tail()
    ref = pool.wait_terminal(pool.submit(), timeout_s=240)  # the workers serve again
    assert ref.status == JobStatus.succeeded, ref.error
    assert result_bytes(rec) == result_bytes(ref)


# -- 3. S3 unreachable during uploads -----------------------------------------------------------------


@pytest.fixture
def bucket(s3_server):
    name = f"faults-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_direct(s3_server, monkeypatch):
    """This process reads S3 straight from moto (not through the proxy)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    return {"key": "testing", "secret": "testing", "endpoint_url": s3_server.endpoint,
            "client_kwargs": {"region_name": "us-east-1"}}


def test_s3_outage_during_uploads_is_retried_and_the_job_finishes(pool, proxy, bucket, s3_direct):
    results = f"s3://{bucket}/results"
    pool.conn.set(DELAY_KEY, "0.02")
    try:
        job_id = pool.submit(results_url=results, retry=Retry(max=2, interval=[1]))
        pool.wait(lambda: len(committed(results, job_id)) >= 5, what="5 blocks committed on S3")
        proxy.cut()
        time.sleep(3)  # storage unreachable for 3 s
        proxy.restore()
        rec = pool.wait_terminal(job_id)
    finally:
        pool.conn.delete(DELAY_KEY)
        if proxy._listener is None:
            proxy.restore()
    assert rec.status == JobStatus.succeeded, (rec.error, pool.log_tail())
    assert len(committed(results, job_id)) == 128
    assert storage.exists(storage.join(results, job_id, "manifest.json"))
    ref = pool.wait_terminal(pool.submit())
    assert result_bytes(rec, **s3_direct) == result_bytes(ref)


def test_s3_unreachable_for_good_fails_clearly_without_manifest(pool, proxy, bucket, s3_direct):
    results = f"s3://{bucket}/results"
    pool.conn.set(DELAY_KEY, "0.02")
    try:
        job_id = pool.submit(results_url=results)  # no retries: the writer's own backoff is all there is
        pool.wait(lambda: len(committed(results, job_id)) >= 5, what="5 blocks committed on S3")
        proxy.cut()
        cut_at = time.monotonic()
        rec = pool.wait_terminal(job_id, timeout_s=150)
        failed_after = time.monotonic() - cut_at
    finally:
        pool.conn.delete(DELAY_KEY)
        proxy.restore()
    print(f"\n[faults] S3 gone for good: job failed {failed_after:.1f} s after the cut: {rec.error}")
    assert rec.status == JobStatus.failed
    assert rec.error.type == "ResultWriteError"
    assert "storage" in rec.error.message and "attempts" in rec.error.message
    assert rec.result is None
    assert not storage.exists(storage.join(results, job_id, "manifest.json"))
    assert len(committed(results, job_id)) < 128


# -- 5. timeouts and result retention (in-process worker) -------------------------------------------


@pytest.fixture
def local_env(worker_env):
    return str(worker_env(BLOCK_BYTES, TRY_XLA="0", RESULT_TTL_S="5"))


def test_job_over_its_timeout_fails_clearly_and_records_expire_after_the_ttl(local_env, redis_conn, model_root,
                                                                              monkeypatch):
    from worker import storage as worker_storage

    real = worker_storage.ResultWriter._write_block

    def slow(self, block, data):  # noqa: ANN001
        time.sleep(0.05)
        real(self, block, data)

    queue = get_settings().queue_name
    with monkeypatch.context() as patch:
        patch.setattr(worker_storage.ResultWriter, "_write_block", slow)  # 128 blocks: > 6 s
        late = submit(redis_conn, local_env, model_root, queue_name=queue, job_timeout=2,
                      retry=Retry(max=2))  # a timeout is not retried: more time would not help
        work_burst(redis_conn)
    store = JobStore(redis_conn)
    # read at once: the record expires JACOBIAN_RESULT_TTL_S (5 s) after the job failed, and the next job can
    # take longer than that on a slow machine (5.5 s on the 2-core AVX2 VM under a test run)
    timed_out, late_ttl = store.get(late), redis_conn.ttl(store.key(late))
    done = submit(redis_conn, local_env, model_root, queue_name=queue)
    work_burst(redis_conn)
    ok = store.get(done)
    assert ok.status == JobStatus.succeeded, ok.error
    assert timed_out.status == JobStatus.failed
    assert timed_out.error.type == "JobTimeout", timed_out.error
    assert "2 s" in timed_out.error.message and "JACOBIAN_JOB_TIMEOUT_S" in timed_out.error.message
    assert not (Path(local_env) / late / "manifest.json").exists()
    rq_late = Job.fetch(late, connection=redis_conn, serializer=JSONSerializer)
    assert rq_late.get_status() == RqStatus.FAILED
    # retention: both finished records expire after JACOBIAN_RESULT_TTL_S (5 s)
    assert 0 < redis_conn.ttl(store.key(done)) <= 5 and 0 < late_ttl <= 5
    time.sleep(5.5)
    for job_id in (done, late):
        with pytest.raises(JobNotFound):
            store.get(job_id)


def test_sparse_job_killed_mid_way_resumes_its_colour_blocks_on_the_other_worker(pool):
    """SIGKILL the worker of a sparse job half-way through its compressed products (one storage block per colour
    here); the other worker resumes from the committed colour blocks, says how many it reused in its log, computes
    at most the blocks that were in flight again, and the COO result equals an uninterrupted run's."""
    import re

    pool.conn.set(DELAY_KEY, "0.05")
    try:
        job_id = submit_sparse(pool.conn, pool.results, pool.model_root, retry=Retry(max=2, interval=[1]))
        pool.wait(lambda: len(committed(pool.results, job_id)) >= 10, timeout_s=180, what="10 committed colour blocks")
        victim_name = Job.fetch(job_id, connection=pool.conn, serializer=JSONSerializer).worker_name
        victim = next(p for p in pool.procs if victim_name.endswith(f".{p.pid}"))
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        at_kill = set(committed(pool.results, job_id))
        pool.conn.delete(DELAY_KEY)
        rec = pool.wait_terminal(job_id, timeout_s=180)
    finally:
        pool.conn.delete(DELAY_KEY)
    pool.start_registered_worker()   # two workers again for the tests after this one
    assert rec.status == JobStatus.succeeded, (rec.error, pool.log_tail())
    assert rec.plan.sparsity["verified"] is True and rec.progress.fraction == 1.0
    lines = [m for path in pool.logs for m in re.findall(
        rf"job {job_id}: sparse: (\d+) of (\d+) colour blocks reused", path.read_text(errors="replace"))]
    assert len(lines) == 2, lines           # the first attempt (0 reused) and the resumed one
    (first, blocks), (reused, _) = sorted((int(a), int(b)) for a, b in lines)
    # every block committed at the kill is reused; only the others (those in flight included) are computed again
    assert first == 0 and reused == len(at_kill) >= 10 and blocks > reused, (lines, len(at_kill))
    print(f"\n[faults] sparse kill: {len(at_kill)} of {blocks} colour blocks committed at the kill, {reused} reused, "
          f"{blocks - reused} computed by the second worker")
    ref = pool.wait_terminal(submit_sparse(pool.conn, pool.results, pool.model_root), timeout_s=180)
    assert ref.status == JobStatus.succeeded, ref.error
    got, want = (zarr.open_group(r.result.uri, mode="r") for r in (rec, ref))
    for name in ("rows", "cols"):
        np.testing.assert_array_equal(got[name][:], want[name][:])
    np.testing.assert_allclose(got["values"][:], want["values"][:], rtol=1e-5, atol=1e-6)
