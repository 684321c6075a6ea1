"""``jacobian worker`` for tests/integration/test_shards.py, with storage that can be slowed down.

Run: ``python -m tests.integration.shard_worker`` with the usual ``JACOBIAN_*`` environment. Before
each storage block is written, the worker sleeps for the seconds stored in Redis under
``DELAY_KEY`` (absent: no delay), so that a test can stop a worker in the middle of a shard.
"""

from __future__ import annotations

import os
import time

DELAY_KEY = "shard-test:block-delay-s"


def main() -> None:
    import redis

    from worker import storage as worker_storage
    from worker.main import redis_connection, run_worker

    conn = redis_connection(os.environ["JACOBIAN_REDIS_URL"])  # rides out a Redis restart, as the worker's
    real_write_block = worker_storage.ResultWriter._write_block

    def slow_write_block(self, block, data):  # noqa: ANN001 - same signature as the real one
        try:
            delay = conn.get(DELAY_KEY)
        except redis.RedisError:  # the test hook must not be what fails a job
            delay = None
        if delay:
            time.sleep(float(delay))
        real_write_block(self, block, data)

    worker_storage.ResultWriter._write_block = slow_write_block
    run_worker(burst=False)


if __name__ == "__main__":
    main()
