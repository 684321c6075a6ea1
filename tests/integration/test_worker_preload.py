"""A worker imports TensorFlow and the engine before it takes a job: a deployed worker's first job of a model costs
the model (loading, traces), not TensorFlow's import too (the service's first job had cost as much as a whole
``jacobian compute`` process, docs/BENCHMARKS.md, eighth session)."""

from __future__ import annotations

import uuid

import redis

from tests.procs import Proc, base_env, jacobian_exe, wait_for


def test_the_worker_is_ready_with_tensorflow_before_it_registers_for_jobs(redis_server, tmp_path):
    queue = f"preload-{uuid.uuid4().hex[:8]}"
    env = base_env(JACOBIAN_REDIS_URL=redis_server.url, JACOBIAN_RESULTS_URL=str(tmp_path / "results"),
                   JACOBIAN_QUEUE_NAME=queue, JACOBIAN_LOG_FORMAT="text")
    proc = Proc("worker", [*jacobian_exe(), "worker"], env, tmp_path / "worker.log")
    conn = redis.Redis.from_url(redis_server.url)
    try:
        def registered() -> bool:   # rq:workers holds each worker's key, whose hash names its queues
            return any(queue.encode() in (conn.hget(key, "queues") or b"") for key in conn.smembers("rq:workers"))

        wait_for(registered, 120, "the worker registered", report=proc.report)
        log = proc.tail(100_000)
        ready, registered = log.find("TensorFlow and the engine ready in"), log.find(f"queue '{queue}'")
        assert ready >= 0, log[-3000:]
        assert 0 <= ready < registered, log[-3000:]
    finally:
        proc.stop()
        conn.close()
