"""Webhook deliveries survive a crash of everything but Redis, and a Redis restart: ``jacobian serve``,
``jacobian worker`` and ``jacobian notifier`` as processes on the session's redis-server (append-only file),
a real receiver on 127.0.0.1 that is down until they have all been killed (SIGKILL) and started again."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.procs import Proc, base_env, free_port, jacobian_exe, wait_for
from tests.webhook_receiver import Receiver, start, verify

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(down=True)
    server = start(r)
    yield r
    server.shutdown()
    server.server_close()


class Services:
    """The API, a worker and the notifier as processes; ``kill()`` is SIGKILL to each, as a crash."""

    def __init__(self, env: dict[str, str], log_dir, round_: int) -> None:
        self.env, self.log_dir, self.round = env, log_dir, round_
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[Proc] = []

    def start(self, *names: str) -> None:
        args = {"api": ["serve", "--port", str(self.port)], "worker": ["worker"], "notifier": ["notifier"]}
        for name in names:
            self.procs.append(Proc(f"{name}{self.round}", jacobian_exe() + args[name], self.env,
                                   self.log_dir / f"{name}{self.round}.log"))
        if "api" in names:
            wait_for(lambda: httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200, 60, "the API",
                     report=self.report)

    def report(self) -> str:
        return "\n".join(p.report() for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            p.proc.send_signal(signal.SIGKILL)
            p.proc.wait(timeout=10)
            p.stop()

    def job(self, job_id: str) -> dict:
        return httpx.get(f"{self.url}/v1/jobs/{job_id}", timeout=10).json()

    def submit(self, url: str) -> str:
        x = [[0.1 * i + 0.01 * j for j in range(8)] for i in range(2)]
        r = httpx.post(f"{self.url}/v1/jobs", timeout=30, json={
            "model": {"path": "mlp"}, "inputs": {"x": {"shape": [2, 8], "data": x}},
            "notify": {"url": url, "events": ["succeeded", "failed"]}})
        assert r.status_code == 202, r.text
        return r.json()["id"]


def test_deliveries_survive_an_api_worker_notifier_and_redis_restart(redis_server, redis_conn, model_root, tmp_path,
                                                                      receiver):
    env = base_env(JACOBIAN_REDIS_URL=redis_server.url, JACOBIAN_MODEL_ROOTS=str(model_root),
                   JACOBIAN_RESULTS_URL=str(tmp_path / "results"), JACOBIAN_LOG_FORMAT="text",
                   JACOBIAN_WEBHOOK_ALLOW="127.0.0.1", JACOBIAN_WEBHOOK_SECRET=SECRET,
                   JACOBIAN_WEBHOOK_RETRY_BASE_S="0.2", JACOBIAN_WEBHOOK_RETRY_MAX_S="0.5",
                   JACOBIAN_NOTIFIER_POLL_S="0.1", JACOBIAN_WEBHOOK_TIMEOUT_S="5")
    first = Services(env, tmp_path, 1)
    try:
        first.start("api", "worker", "notifier")
        job1 = first.submit(receiver.url)

        def failing() -> bool:
            block = first.job(job1).get("notify", {}).get("deliveries", {}).get("succeeded", {})
            return block.get("attempts", 0) >= 2 and not block["delivered"]

        wait_for(failing, 120, "job 1 done and its delivery refused twice", report=first.report)
    finally:
        first.kill()
    before = {c.id for c in receiver.snapshot()}
    assert len(before) == 1 and all(verify(SECRET, c.headers, c.body) for c in receiver.snapshot())
    redis_server.restart()  # the outbox is in its append-only file

    second = Services(env, tmp_path, 2)
    try:
        second.start("api", "worker")  # job 2 ends while no notifier runs
        job2 = second.submit(receiver.url)
        wait_for(lambda: second.job(job2)["status"] == "succeeded", 120, "job 2", report=second.report)
        receiver.down = False
        second.start("notifier")
        for job_id in (job1, job2):
            wait_for(lambda j=job_id: second.job(j)["notify"]["deliveries"]["succeeded"]["delivered"], 60,
                     f"job {job_id} delivered", report=second.report)
        time.sleep(1.0)  # a duplicate would come within this
        statuses = {j: second.job(j) for j in (job1, job2)}
    finally:
        second.kill()
    calls = receiver.snapshot()
    assert all(verify(SECRET, c.headers, c.body) for c in calls)
    accepted = receiver.accepted()
    assert sorted(c.json["data"]["id"] for c in accepted) == sorted([job1, job2])  # one each, no duplicate
    (again,) = [c for c in accepted if c.json["data"]["id"] == job1]
    assert again.id in before  # the same webhook-id as before the restart: receivers de-duplicate on it
    block = statuses[job1]["notify"]["deliveries"]["succeeded"]
    assert block["delivered"] and block["attempts"] == sum(1 for c in calls if c.id == again.id) >= 3
    assert statuses[job2]["notify"]["deliveries"]["succeeded"]["attempts"] == 1
