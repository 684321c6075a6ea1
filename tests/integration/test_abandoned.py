"""A job whose worker died (rq's ``AbandonedJobError``), as the maintenance of a live ``JacobianWorker``
records it: real rq jobs on a real redis-server, found abandoned by rq's own registry cleanup."""

from __future__ import annotations

import time
import uuid

import pytest
from rq import Queue, Retry
from rq.job import JobStatus as RqStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from contracts.jobspec import FINALIZE_JOB_TASK, RUN_JOB_TASK, JobStatus, ModelRef, QueuedJob, finalizer_job_id
from contracts.jobstore import JobRecord, JobStore
from contracts.records import dump
from contracts.settings import get_settings

pytestmark = pytest.mark.integration

TTL_S = 60


@pytest.fixture
def settings(redis_server, redis_conn, monkeypatch):
    monkeypatch.setenv("JACOBIAN_REDIS_URL", redis_server.url)
    monkeypatch.setenv("JACOBIAN_RESULT_TTL_S", str(TTL_S))
    monkeypatch.setenv("JACOBIAN_QUEUE_NAME", "jacobian-abandoned")
    monkeypatch.setenv("JACOBIAN_WORKER_HEARTBEAT_S", "1")
    get_settings.cache_clear()
    yield get_settings()
    get_settings.cache_clear()


def job_spec(job_id: str, **fields) -> dict:
    return QueuedJob(id=job_id, model=ModelRef(path="/models/mlp"), inputs_uri=f"/results/{job_id}/inputs.npz",
                     results_url="/results", of="y", wrt="x", **fields).model_dump(mode="json")


def start_and_abandon(conn, settings, task: str, spec: dict, rq_id: str, *, retry: Retry | None = None) -> None:
    """Enqueue ``task(spec)``, let a worker take it (execution registered, rq status 'started'), then, as if
    that worker had died, run rq's cleanup of the started registry past its heartbeat with the handlers of
    a live ``JacobianWorker`` (what its maintenance does)."""
    from worker.main import JacobianWorker

    queue = Queue(settings.queue_name, connection=conn, serializer=JSONSerializer)
    job = queue.enqueue_call(task, args=(spec,), job_id=rq_id, retry=retry)
    queue.remove(job)
    dying = JacobianWorker([queue], connection=conn, name=f"dying-{uuid.uuid4().hex[:6]}")
    dying.prepare_execution(job)
    dying.prepare_job_execution(job)
    assert job.get_status(refresh=True) == RqStatus.STARTED
    survivor = JacobianWorker([queue], connection=conn, name=f"survivor-{uuid.uuid4().hex[:6]}")
    StartedJobRegistry(queue.name, connection=conn, serializer=JSONSerializer).cleanup(
        timestamp=time.time() + 3600, exception_handlers=survivor._exc_handlers)


def running_job(conn, **spec_fields) -> tuple[str, dict]:
    job_id = uuid.uuid4().hex
    spec = job_spec(job_id, **spec_fields)
    JobStore(conn).create(JobRecord(id=job_id, status=JobStatus.running, spec=spec, created_at=time.time(),
                                    started_at=time.time()))
    return job_id, spec


def test_finalizer_whose_worker_died_with_no_retries_fails_the_job_with_its_ttl(settings, redis_conn):
    job_id, spec = running_job(redis_conn, shards=2)
    store = JobStore(redis_conn)
    redis_conn.hset(store.shards_key(job_id), "plan", '{"shards": 2}')
    start_and_abandon(redis_conn, settings, FINALIZE_JOB_TASK, spec, finalizer_job_id(job_id))

    record = store.get(job_id)
    assert record.status == JobStatus.failed, record
    assert record.error.type == "WorkerDied" and "finalizer" in record.error.message
    assert "resubmit" in record.error.message and record.finished_at is not None
    assert 0 < redis_conn.ttl(store.key(job_id)) <= TTL_S
    assert 0 < redis_conn.ttl(store.shards_key(job_id)) <= TTL_S


def test_job_whose_worker_died_with_no_retries_fails_with_its_ttl(settings, redis_conn):
    job_id, spec = running_job(redis_conn)
    start_and_abandon(redis_conn, settings, RUN_JOB_TASK, spec, job_id)

    record = JobStore(redis_conn).get(job_id)
    assert record.status == JobStatus.failed and record.error.type == "WorkerDied", record
    assert 0 < redis_conn.ttl(JobStore(redis_conn).key(job_id)) <= TTL_S


def test_job_whose_worker_died_with_a_retry_left_is_queued_again(settings, redis_conn):
    """rq requeues it; the record says so (``queued``, a transient error), so that the next attempt's
    move to ``running`` is a move (``running`` to ``running`` is not)."""
    job_id, spec = running_job(redis_conn)
    start_and_abandon(redis_conn, settings, RUN_JOB_TASK, spec, job_id, retry=Retry(max=1))

    store = JobStore(redis_conn)
    record = store.get(job_id)
    assert record.status == JobStatus.queued, record
    assert dump(record.error) == {"type": "WorkerDied", "message": record.error.message, "transient": True}
    assert redis_conn.ttl(store.key(job_id)) == -1
    assert store.transition(job_id, JobStatus.running)


def test_shard_whose_worker_died_leaves_the_job_to_its_finalizer(settings, redis_conn):
    job_id, spec = running_job(redis_conn, shards=2)
    shard_spec = {**spec, "shard": 1, "rows": [4, 8]}
    store = JobStore(redis_conn)
    before = redis_conn.hgetall(store.key(job_id))
    start_and_abandon(redis_conn, settings, RUN_JOB_TASK, shard_spec, f"{job_id}-s1")

    assert redis_conn.hgetall(store.key(job_id)) == before
    assert redis_conn.ttl(store.key(job_id)) == -1


def test_a_job_that_already_ended_is_left_as_it_is(settings, redis_conn):
    job_id, spec = running_job(redis_conn, shards=2)
    store = JobStore(redis_conn, ttl_s=TTL_S)
    assert store.transition(job_id, JobStatus.canceled)
    before = redis_conn.hgetall(store.key(job_id))
    start_and_abandon(redis_conn, settings, FINALIZE_JOB_TASK, spec, finalizer_job_id(job_id))

    assert redis_conn.hgetall(store.key(job_id)) == before


def test_job_whose_worker_died_twice_fails_as_worker_died_with_retries_left(settings, redis_conn):
    """Each death is counted on the record; the second fails the job although rq has retries left, and rq's
    retry is called off (the rq job ends in the failed registry, not on the queue)."""
    from rq.job import Job

    job_id, spec = running_job(redis_conn)
    store = JobStore(redis_conn)
    start_and_abandon(redis_conn, settings, RUN_JOB_TASK, spec, job_id, retry=Retry(max=3))
    first = store.get(job_id)
    assert first.status == JobStatus.queued and len(first.deaths) == 1, first
    assert "signal unknown" in first.deaths[0] and first.deaths[0] in first.error.message
    queue = Queue(settings.queue_name, connection=redis_conn, serializer=JSONSerializer)
    assert job_id in queue.get_job_ids()  # rq requeued it
    queue.remove(job_id)  # the next attempt picks it up (start_and_abandon enqueues it again)
    assert store.transition(job_id, JobStatus.running)
    start_and_abandon(redis_conn, settings, RUN_JOB_TASK, spec, job_id, retry=Retry(max=3))

    record = store.get(job_id)
    assert record.status == JobStatus.failed and record.error.type == "WorkerDied", record
    assert len(record.deaths) == 2 and "died 2 times" in record.error.message
    assert all(d in record.error.message for d in record.deaths)
    assert "memory_budget_bytes" in record.error.message
    rq_job = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
    assert rq_job.get_status() == RqStatus.FAILED and rq_job.retries_left == 0
    assert job_id not in queue.get_job_ids()


def test_deaths_are_counted_atomically(settings, redis_conn):
    import threading

    job_id, _ = running_job(redis_conn)
    store = JobStore(redis_conn)
    threads = [threading.Thread(target=store.record_death, args=(job_id, f"death {i}")) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(store.get(job_id).deaths) == sorted(f"death {i}" for i in range(20))
