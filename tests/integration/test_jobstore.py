"""``JobStore`` against a real redis-server: status moves (``transition``), other fields (``set_fields``),
``delete``, and the old ``update`` kept for the worker until it moves to ``transition``."""

from __future__ import annotations

import itertools
import json
import time
import uuid

import pytest
import redis

from contracts.jobspec import JobStatus
from contracts.jobstore import JobNotFound, JobRecord, JobStore
from contracts.records import ErrorInfo, PlanInfo, Progress, ResultInfo, dump

pytestmark = pytest.mark.integration

TTL_S = 100
Q, R, S, F, C = JobStatus.queued, JobStatus.running, JobStatus.succeeded, JobStatus.failed, JobStatus.canceled
# Written out rather than read from ALLOWED_MOVES, so that a change of the table fails here.
ALLOWED = {(Q, R), (Q, C), (Q, F), (R, S), (R, F), (R, C), (R, Q)}


def new_job(store: JobStore, status: JobStatus = Q, *, sharded: bool = True) -> str:
    job_id = uuid.uuid4().hex
    store.create(JobRecord(id=job_id, status=status, spec={"kind": "jacobian"}, created_at=time.time()))
    if sharded:
        store.connection.hset(store.shards_key(job_id), "plan", json.dumps({"shards": 2}))
    return job_id


def stored(store: JobStore, job_id: str) -> JobRecord:
    """The record as stored (``get`` would sum a sharded job's progress over its shards)."""
    return JobStore._decode(job_id, store.connection.hgetall(store.key(job_id)))


def snapshot(conn, store: JobStore, job_id: str) -> tuple:
    return (conn.hgetall(store.key(job_id)), conn.hgetall(store.shards_key(job_id)),
            conn.ttl(store.key(job_id)), conn.ttl(store.shards_key(job_id)))


@pytest.mark.parametrize("source,target", list(itertools.product(JobStatus, JobStatus)),
                         ids=lambda s: s.value)
def test_every_move_of_the_table(redis_conn, source, target):
    store = JobStore(redis_conn, ttl_s=TTL_S)
    job_id = new_job(store, source)
    before = snapshot(redis_conn, store, job_id)
    progress = Progress.of(3, 4, 1.5)

    moved = store.transition(job_id, target, progress=progress)

    assert moved == ((source, target) in ALLOWED)
    assert source.can_move_to(target) == moved
    if not moved:
        assert snapshot(redis_conn, store, job_id) == before  # nothing written, no TTL
        return
    record = stored(store, job_id)
    assert record.status == target and record.progress == progress
    ttls = (redis_conn.ttl(store.key(job_id)), redis_conn.ttl(store.shards_key(job_id)))
    if target.is_terminal:
        assert all(0 < t <= TTL_S for t in ttls), ttls
        assert record.finished_at is not None
    else:
        assert ttls == (-1, -1)
        assert record.finished_at is None
    assert (record.started_at is not None) == (target == R)


def test_a_writer_that_dies_after_one_command_leaves_a_terminal_record_with_its_ttl(redis_conn, monkeypatch):
    """Status, fields and TTL go in one command: a process killed right after its first write to Redis
    cannot leave a finished job without TTL (it would stay in Redis forever)."""
    store = JobStore(redis_conn, ttl_s=TTL_S)
    job_id = new_job(store, R)
    real = redis_conn.execute_command
    sent: list[str] = []

    def dies_after_first_write(*args, **options):
        name = str(args[0]).upper()
        if sent and not name.startswith("SCRIPT"):
            raise redis.ConnectionError("killed")
        result = real(*args, **options)  # EVALSHA of an unknown script raises NoScriptError: not a write
        if not name.startswith("SCRIPT"):
            sent.append(name)
        return result

    monkeypatch.setattr(redis_conn, "execute_command", dies_after_first_write)
    result = ResultInfo(uri="/r/x.zarr", shape=[2, 3], dtype="float32")
    assert store.transition(job_id, S, result=result, error=None, finished_at=123.5)
    monkeypatch.undo()

    record = store.get(job_id)
    assert (record.status, record.result, record.error, record.finished_at) == (S, result, None, 123.5)
    assert dump(record.result) == {"uri": "/r/x.zarr", "shape": [2, 3], "dtype": "float32"}
    assert 0 < redis_conn.ttl(store.key(job_id)) <= TTL_S and 0 < redis_conn.ttl(store.shards_key(job_id)) <= TTL_S


def test_a_shard_cannot_fail_a_job_that_was_canceled(redis_conn):
    store = JobStore(redis_conn, ttl_s=TTL_S)
    job_id = new_job(store, R)
    assert store.transition(job_id, C, finished_at=1.0)
    before = snapshot(redis_conn, store, job_id)
    assert not store.transition(job_id, F, error=ErrorInfo(type="OOM", message="shard 2 of 2: out of memory"))
    assert snapshot(redis_conn, store, job_id) == before
    assert store.get(job_id).error is None


def test_transition_of_a_missing_job_raises_and_creates_nothing(redis_conn):
    store = JobStore(redis_conn, ttl_s=TTL_S)
    with pytest.raises(JobNotFound):
        store.transition("f" * 32, F, error=ErrorInfo(type="X", message="y"))
    assert redis_conn.keys("*") == []


@pytest.mark.parametrize("field", ["status", "cancel_requested", "spec", "bogus"])
def test_transition_refuses_other_fields(redis_conn, field):
    store = JobStore(redis_conn, ttl_s=TTL_S)
    job_id = new_job(store, Q)
    before = snapshot(redis_conn, store, job_id)
    with pytest.raises(TypeError, match=field):
        store.transition(job_id, R, **{field: "x"})
    assert snapshot(redis_conn, store, job_id) == before


def test_records_are_stored_with_the_keys_they_were_given(redis_conn):
    store = JobStore(redis_conn, ttl_s=TTL_S)
    job_id = new_job(store, R)
    assert store.transition(job_id, Q, error=ErrorInfo(type="ResultWriteError", message="s3: down", transient=True))
    assert dump(store.get(job_id).error) == {"type": "ResultWriteError", "message": "s3: down", "transient": True}
    assert store.transition(job_id, R)
    assert store.transition(job_id, F, error=ErrorInfo(type="OOM", message="no memory"))
    assert dump(store.get(job_id).error) == {"type": "OOM", "message": "no memory"}  # no "transient": null


@pytest.mark.parametrize("fields", [{"plan": {"chunk_rows": 8}}, {"progress": {"rows_done": 1}},
                                    {"error": {"type": "X", "message": "y"}}])
def test_records_are_written_as_their_models_only(redis_conn, fields):
    store = JobStore(redis_conn, ttl_s=TTL_S)
    job_id = new_job(store, R)
    before = snapshot(redis_conn, store, job_id)
    (name,) = fields
    with pytest.raises(TypeError, match=f"{name}: give a contracts.records"):
        if name == "error":
            store.transition(job_id, F, **fields)
        else:
            store.set_fields(job_id, **fields)
    assert snapshot(redis_conn, store, job_id) == before


def test_set_fields_writes_only_the_fields_given_and_never_a_missing_record(redis_conn):
    store = JobStore(redis_conn, ttl_s=TTL_S)
    job_id = new_job(store, R)
    plan = PlanInfo(chunk_rows=8, strategy="vectorized", shards=1, xla=False)
    assert store.set_fields(job_id, plan=plan)
    assert store.set_fields(job_id, progress=Progress.of(2, 8, 4.0), cancel_requested=True)
    record = stored(store, job_id)
    assert dump(record.plan) == {"chunk_rows": 8, "strategy": "vectorized", "shards": 1, "xla": False}
    assert (record.plan.chunk_rows, record.plan.model_extra) == (8, {"xla": False})
    assert dump(record.progress) == {"rows_done": 2, "rows_total": 8, "fraction": 0.25, "rows_per_second": 4.0,
                                     "eta_seconds": 1.5}
    assert record.cancel_requested and record.status == R
    assert redis_conn.ttl(store.key(job_id)) == -1

    sent = []  # a progress tick is one HSET of the progress field: the rest of the record is not rewritten
    set_fields = store._set_fields
    store._set_fields = lambda **call: sent.append(call["args"]) or set_fields(**call)
    assert store.set_fields(job_id, progress=Progress.of(3, 8, 4.0))
    assert sent == [["progress", json.dumps(dump(Progress.of(3, 8, 4.0)))]]
    assert stored(store, job_id).plan == plan

    gone = uuid.uuid4().hex  # e.g. a late progress report after the record expired
    assert not store.set_fields(gone, progress=Progress.of(1, 8, 1.0))
    assert not redis_conn.exists(store.key(gone))


def test_delete_removes_record_index_entry_and_shards(redis_conn):
    store = JobStore(redis_conn, ttl_s=TTL_S)
    job_id, other = new_job(store), new_job(store)
    store.update_shard_progress(job_id, 0, Progress.of(1, 4, 1.0), computed_rows=1)
    assert store.delete(job_id)
    assert not redis_conn.exists(store.key(job_id)) and not redis_conn.exists(store.shards_key(job_id))
    assert redis_conn.zscore(store.index_key, job_id) is None
    assert [r.id for r in store.list()] == [other]
    assert not store.delete(job_id)
