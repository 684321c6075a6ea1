"""Poison jobs cannot take the fleet down; every job has a wall-clock limit (issue 28).

A job whose worker dies twice while running it (the OOM killer's SIGKILL, here sent by the test: allocating
more than this machine has would take the test machine down with it) ends ``failed`` with ``WorkerDied``
naming the signals, and the jobs queued behind it run. Real worker processes (``tests.integration.shard_worker``)
under ``worker.supervisor`` on a private redis-server, as in test_faults.py. A job over its ``timeout_s`` ends
``failed`` with ``JobTimeout`` naming that limit, with nothing left that could pass for a result.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rq import Queue, Retry
from rq.job import Job
from rq.job import JobStatus as RqStatus
from rq.serializers import JSONSerializer

from contracts.jobspec import JobStatus
from contracts.jobstore import JobStore
from contracts.settings import get_settings
from tests import models
from tests.conftest import work_burst
from tests.integration.shard_worker import DELAY_KEY
from tests.integration.test_faults import BLOCK_BYTES, QUEUE, REPO, SIZES, Pool, committed, submit

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("poison-models")
    models.mlp(root / "mlp", sizes=SIZES)
    return root


class SupervisedPool(Pool):
    """``Pool``'s workers, each under ``worker.supervisor`` (as ``jacobian worker --supervise`` runs them): a killed
    worker is started again, and how it died is noted for the job's error."""

    def start_worker(self) -> subprocess.Popen:
        log_path = self.tmp / f"worker{len(self.procs)}.log"
        self.logs.append(log_path)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "worker.supervisor", sys.executable, "-m",
                                     "tests.integration.shard_worker"], cwd=REPO, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc


def rq_job(conn, job_id: str) -> Job:
    return Job.fetch(job_id, connection=conn, serializer=JSONSerializer)


def test_a_job_that_kills_its_worker_twice_fails_as_worker_died_and_the_queue_goes_on(tmp_path_factory, model_root):
    """SIGKILL whichever worker runs the job, twice (each comes back, restarted by its supervisor): the second
    death fails the job as ``WorkerDied`` naming both SIGKILLs, although rq has a retry left; it is never run a
    third time, and the jobs queued behind it and after it succeed."""
    pool = SupervisedPool(tmp_path_factory.mktemp("poison"), model_root, s3_endpoint="http://127.0.0.1:9")
    try:
        pool.conn.set(DELAY_KEY, "0.02")  # 128 blocks: about 3 s a job, long enough to be killed mid-run
        store = pool.store()
        poison = pool.submit(retry=Retry(max=2, interval=[1]))  # as the API enqueues: 2 retries
        behind = pool.submit()
        victims: list[str] = []
        for death in (1, 2):
            def running_on_a_live_worker() -> bool:
                job = rq_job(pool.conn, poison)
                return (job.get_status(refresh=False) == RqStatus.STARTED and job.worker_name not in victims
                        and store.get(poison).status == JobStatus.running)

            pool.wait(running_on_a_live_worker, timeout_s=60, poll_s=0.05, what=f"the job running (death {death})")
            name = rq_job(pool.conn, poison).worker_name
            os.kill(int(name.rsplit(".", 1)[1]), signal.SIGKILL)  # the worker, a child of its supervisor
            victims.append(name)
        rec = pool.wait_terminal(poison, timeout_s=90)
        print(f"\n[poison] {rec.error}")
        assert rec.status == JobStatus.failed and rec.error.type == "WorkerDied", (rec.error, pool.log_tail())
        assert rec.deaths == [f"worker {name} killed: SIGKILL (exit -9)" for name in victims], rec
        assert "died 2 times" in rec.error.message and all(d in rec.error.message for d in rec.deaths)
        assert "memory_budget_bytes" in rec.error.message
        job = rq_job(pool.conn, poison)
        assert job.get_status() == RqStatus.FAILED  # rq's last retry was called off: not queued nor scheduled
        queue = Queue(QUEUE, connection=pool.conn, serializer=JSONSerializer)
        assert poison not in queue.get_job_ids() and poison not in queue.scheduled_job_registry.get_job_ids()
        assert not (Path(pool.results) / poison / "manifest.json").exists()
        pool.conn.delete(DELAY_KEY)
        assert pool.wait_terminal(behind, timeout_s=60).status == JobStatus.succeeded, pool.log_tail()
        after = pool.wait_terminal(pool.submit(), timeout_s=60)
        assert after.status == JobStatus.succeeded, (after.error, pool.log_tail())
        assert rq_job(pool.conn, poison).worker_name == victims[1]  # never started a third time
        # both supervisors restarted theirs (a worker registers once TensorFlow is imported: seconds after its start)
        pool.wait(lambda: pool.live() == 2, timeout_s=60, what="both restarted workers registered")
        assert all(p.poll() is None for p in pool.procs)
    finally:
        pool.conn.delete(DELAY_KEY)
        pool.close()


def submit_with_timeout(conn, results_url: str, model_root: Path, *, timeout_s: int | None) -> str:
    """A job as the API queues it, with the request field ``timeout_s``; rq's own timeout (600 s) is far off."""
    return submit(conn, results_url, model_root, retry=Retry(max=2), job_timeout=600,
                  queue_name=get_settings().queue_name, timeout_s=timeout_s)


def test_a_job_over_its_timeout_s_fails_naming_that_limit_and_leaves_no_result(worker_env, redis_conn, model_root,
                                                                               monkeypatch):
    from worker import storage as worker_storage

    results = worker_env(BLOCK_BYTES, TRY_XLA="0")
    real = worker_storage.ResultWriter._write_block

    def slow(self, block, data):  # noqa: ANN001
        time.sleep(0.05)
        real(self, block, data)

    with monkeypatch.context() as patch:
        patch.setattr(worker_storage.ResultWriter, "_write_block", slow)  # 128 blocks: > 6 s
        late = submit_with_timeout(redis_conn, str(results), model_root, timeout_s=1)
        started = time.monotonic()
        work_burst(redis_conn)
        spent_s = time.monotonic() - started
    done = submit_with_timeout(redis_conn, str(results), model_root, timeout_s=None)
    work_burst(redis_conn)
    store = JobStore(redis_conn)
    assert store.get(done).status == JobStatus.succeeded, store.get(done).error
    rec = store.get(late)
    assert rec.status == JobStatus.failed and rec.error.type == "JobTimeout", rec.error
    message = rec.error.message
    assert "limit of 1 s (the request's timeout_s)" in message and "JACOBIAN_MAX_JOB_TIMEOUT_S" in message, message
    ran_s = float(re.search(r"the job ran ([0-9.]+) s", message).group(1))
    assert 1.0 <= ran_s < 5.0 and spent_s < 20, (ran_s, spent_s)  # the worker's check, not rq's 600 s backstop
    assert rq_job(redis_conn, late).get_status() == RqStatus.FAILED  # not retried: more time would not help
    job_dir = Path(results) / late
    assert not (job_dir / "manifest.json").exists() and not (job_dir / "result.zarr").exists()
    assert committed(str(results), late) == []
