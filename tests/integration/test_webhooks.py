"""Webhooks end to end in this process: the API (TestClient), a worker (``work_burst``) and a ``Notifier`` on a
thread, a real redis-server, and a real HTTP receiver on 127.0.0.1 (``tests.webhook_receiver``) that checks
every signature with its own reference verification."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from app.notifier import Notifier
from contracts.jobspec import JobStatus
from contracts.jobstore import JobRecord, JobStore
from contracts.outbox import Outbox
from contracts.records import ErrorInfo, Progress
from contracts.settings import Settings, get_settings
from tests.conftest import work_burst
from tests.webhook_receiver import Receiver, start, verify

pytestmark = pytest.mark.integration

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
KEY_SECRET = "whsec_QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0NTY3ODk="
FAST = {"WEBHOOK_ALLOW": "127.0.0.1", "WEBHOOK_SECRET": SECRET, "WEBHOOK_RETRY_BASE_S": "0.05",
        "WEBHOOK_RETRY_MAX_S": "0.2", "WEBHOOK_PROGRESS_S": "0", "NOTIFIER_POLL_S": "0.02",
        "WEBHOOK_TIMEOUT_S": "5"}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    server = start(r)
    yield r
    server.shutdown()
    server.server_close()


@pytest.fixture
def hooks_env(worker_env, monkeypatch):
    """The worker's settings plus short webhook backoffs, 127.0.0.1 allowed, ``SECRET`` without API keys."""
    for name, value in FAST.items():
        monkeypatch.setenv(f"JACOBIAN_{name}", value)
    monkeypatch.delenv("JACOBIAN_API_KEYS", raising=False)
    worker_env(1 << 20)
    return get_settings


@pytest.fixture
def api(hooks_env):
    from fastapi.testclient import TestClient

    from app.main import create_app

    with TestClient(create_app()) as c:
        yield c


@contextmanager
def running_notifier(conn, settings: Settings | None = None) -> Iterator[Notifier]:
    """A ``Notifier`` looping on a thread of this process until the block ends."""
    notifier = Notifier(conn, settings or get_settings())
    stop = threading.Event()
    thread = threading.Thread(target=notifier.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield notifier
    finally:
        stop.set()
        thread.join(timeout=30)
        notifier.close()


def wait_until(check, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what}: not after {timeout_s} s")


def job_body(url: str, events: list[str], **extra) -> dict:
    x = [[0.1 * i + 0.01 * j for j in range(8)] for i in range(2)]
    return {"model": {"path": "mlp"}, "inputs": {"x": {"shape": [2, 8], "data": x}},
            "notify": {"url": url, "events": events}, **extra}


def metric(api, event: str, outcome: str) -> float:
    prefix = f'jacobian_webhook_deliveries_total{{event="{event}",outcome="{outcome}"}} '
    for line in api.get("/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line.removeprefix(prefix))
    return 0.0


def test_a_receiver_failing_3_times_then_succeeding_gets_one_accepted_signed_delivery_per_event(
        api, redis_conn, receiver):
    receiver.fail_first = 3
    r = api.post("/v1/jobs", json=job_body(receiver.url, ["succeeded", "progress"]))
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert api.get(f"/v1/jobs/{job_id}").json()["notify"] == {
        "url": receiver.url, "events": ["succeeded", "progress"], "deliveries": {}}
    with running_notifier(redis_conn):
        work_burst(redis_conn)
        status = wait_until(lambda: (s := api.get(f"/v1/jobs/{job_id}").json())["notify"]["deliveries"]
                            .get("succeeded", {}).get("delivered") and s, "the succeeded delivery")
    calls = receiver.snapshot()
    assert all(verify(SECRET, c.headers, c.body) for c in calls), "a delivery whose signature does not verify"
    assert {c.headers[":path"] for c in calls} == {"/hooks/jacobian?tenant=t1"}
    by_id: dict[str, list] = {}
    for c in calls:
        by_id.setdefault(c.id, []).append(c)
    for msg_id, attempts in by_id.items():  # each delivery: 3 refusals, then exactly one accepted
        assert [c.status for c in attempts] == [500, 500, 500, 204], (msg_id, [c.status for c in attempts])
        assert len({c.body for c in attempts}) == 1  # the same body on every retry; a new timestamp signed
        assert [int(c.headers["webhook-timestamp"]) for c in attempts] == sorted(
            int(c.headers["webhook-timestamp"]) for c in attempts)
    ends = [c for c in receiver.accepted() if c.type == "job.succeeded"]
    assert len(ends) == 1
    assert ends[0].json["data"] == {k: v for k, v in status.items() if k != "notify"}
    assert ends[0].json["data"]["status"] == "succeeded" and ends[0].json["data"]["result"]["uri"]
    block = status["notify"]["deliveries"]["succeeded"]
    assert block == {"id": ends[0].id, "delivered": True, "attempts": 4, "gave_up": False, "last_error": None,
                     "next_attempt_at": None, "count": 1}
    assert all(c.type in ("job.succeeded", "job.progress") for c in calls)
    assert metric(api, "succeeded", "delivered") == 1 and metric(api, "succeeded", "failed") == 3
    assert Outbox(redis_conn).pending() == 0 and Outbox(redis_conn).watched() == 0


def test_progress_and_end_events_as_a_worker_writes_them(hooks_env, redis_conn, receiver):
    """Each state written only after the notifier emitted the previous one: progress at each new row count,
    nothing for a state not asked for, one ``failed`` at the end, and nothing more."""
    store = JobStore(redis_conn, ttl_s=3600)
    job_id = uuid.uuid4().hex
    store.create(JobRecord(id=job_id, status=JobStatus.queued, created_at=time.time(), spec={
        "notify": {"url": receiver.url, "events": ["progress", "failed"]}}))
    outbox = Outbox(redis_conn)
    outbox.watch(job_id, at=0)
    notifier = Notifier(redis_conn, get_settings())
    clock = iter(range(1, 100))

    def scan() -> int:  # a clock a second later each time: every watched job is due again
        return notifier.scan(now=time.time() + next(clock))

    try:
        assert scan() == 0  # queued: nothing
        store.transition(job_id, JobStatus.running, progress=Progress.of(0, 4, 0.0))
        assert scan() == 0  # running, no rows yet
        for rows in (1, 3):
            store.set_fields(job_id, progress=Progress.of(rows, 4, 2.0))
            assert scan() == 1
        assert scan() == 0  # no new rows
        store.transition(job_id, JobStatus.failed, error=ErrorInfo(type="Boom", message="m"))
        assert scan() == 1
        assert scan() == 0 and outbox.watched() == 0
        wait_until(lambda: notifier.dispatch() == 0 and len(receiver.accepted()) == 3, "three deliveries")
    finally:
        notifier.close()
    calls = receiver.snapshot()
    assert sorted((c.type, c.json["data"]["progress"]["rows_done"]) for c in calls) == [
        ("job.failed", 3), ("job.progress", 1), ("job.progress", 3)]
    assert len({c.id for c in calls}) == 3 and all(verify(SECRET, c.headers, c.body) for c in calls)
    deliveries = store.get(job_id).public().notify.deliveries
    assert deliveries["progress"].count == 2 and deliveries["progress"].delivered
    assert deliveries["failed"].delivered and deliveries["failed"].attempts == 1


def test_a_canceled_queued_job_is_told_once(api, redis_conn, receiver):
    job_id = api.post("/v1/jobs", json=job_body(receiver.url, ["canceled", "succeeded"])).json()["id"]
    assert api.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "canceled"
    with running_notifier(redis_conn):
        wait_until(lambda: receiver.accepted(), "the canceled delivery")
        time.sleep(0.3)  # a second delivery would come within this
    (call,) = receiver.snapshot()
    assert call.type == "job.canceled" and call.json["data"]["error"]["type"] == "Canceled"


def test_notify_with_an_npz_body_is_the_query_parameter(api, redis_conn, receiver):
    import io

    import numpy as np

    buf = io.BytesIO()
    np.savez(buf, x=np.ones((2, 8), np.float32))
    notify = {"url": receiver.url, "events": ["canceled"]}
    r = api.post("/v1/jobs", content=buf.getvalue(), headers={"Content-Type": "application/x-npz"},
                 params={"model_path": "mlp", "notify": json.dumps(notify)})
    assert r.status_code == 202, r.text
    assert api.get(f"/v1/jobs/{r.json()['id']}").json()["notify"] == {**notify, "deliveries": {}}
    r = api.post("/v1/jobs", content=buf.getvalue(), headers={"Content-Type": "application/x-npz"},
                 params={"model_path": "mlp", "notify": "https://x"})
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("notify: 'https://x' is not a JSON object")


def test_a_key_signs_its_own_jobs_webhooks(hooks_env, monkeypatch, redis_conn, receiver):
    keys = [{"key": "k-signed", "name": "team-a", "webhook_secret": KEY_SECRET}, {"key": "k-plain"}]
    monkeypatch.setenv("JACOBIAN_API_KEYS", json.dumps(keys))
    get_settings.cache_clear()
    from fastapi.testclient import TestClient

    from app.main import create_app

    with TestClient(create_app()) as api:
        signed, plain = ({"Authorization": f"Bearer {k}"} for k in ("k-signed", "k-plain"))
        r = api.post("/v1/jobs", json=job_body(receiver.url, ["canceled"]), headers=plain)
        assert r.status_code == 403, r.text
        assert "API key 'key-" in r.json()["error"]["message"] and "webhook_secret" in r.json()["error"]["message"]
        r = api.post("/v1/jobs", json=job_body(receiver.url, ["canceled"]), headers=signed)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        assert JobStore(redis_conn).get(job_id).spec["api_key"] == "team-a"
        api.post(f"/v1/jobs/{job_id}/cancel", headers=signed)
        with running_notifier(redis_conn):
            wait_until(lambda: receiver.accepted(), "the delivery")
    (call,) = receiver.snapshot()
    assert verify(KEY_SECRET, call.headers, call.body) and not verify(SECRET, call.headers, call.body)


@pytest.mark.parametrize("allow, url, status, words", [
    ("", "http://127.0.0.1:9/", 403, "webhooks are off on this service (JACOBIAN_WEBHOOK_ALLOW is empty)"),
    ("127.0.0.1", "http://127.0.0.2:9/", 403, "notify.url: '127.0.0.2' is 127.0.0.2, outside the networks"),
    ("127.0.0.1", "https://hooks.example.invalid/", 403, "notify.url: host 'hooks.example.invalid' is not listed "
                                                         "in JACOBIAN_WEBHOOK_ALLOW"),
    ("0.0.0.0/0", "http://169.254.169.254/latest/meta-data/", 403, "link-local or metadata"),
    ("0.0.0.0/0", "http://[::ffff:169.254.169.254]/", 403, "link-local or metadata"),
    ("127.0.0.1", "file:///etc/passwd", 422, "notify.url: 'file:///etc/passwd' is not an http(s) URL"),
])
def test_urls_refused_at_post_name_the_field_and_nothing_is_queued(hooks_env, monkeypatch, redis_conn, allow, url,
                                                                    status, words):
    monkeypatch.setenv("JACOBIAN_WEBHOOK_ALLOW", allow)
    get_settings.cache_clear()
    from fastapi.testclient import TestClient

    from app.main import create_app

    with TestClient(create_app()) as api:
        for dry_run in (True, False):
            r = api.post("/v1/jobs", json=job_body(url, ["succeeded"]), params={"dry_run": "true"} if dry_run else {})
            assert r.status_code == status, r.text
            assert words in r.json()["error"]["message"], r.json()
        assert api.get("/v1/jobs").json()["jobs"] == []
    assert Outbox(redis_conn).watched() == 0


def test_no_secret_refuses_notify_naming_the_setting(hooks_env, monkeypatch):
    monkeypatch.delenv("JACOBIAN_WEBHOOK_SECRET")
    get_settings.cache_clear()
    from fastapi.testclient import TestClient

    from app.main import create_app

    with TestClient(create_app()) as api:
        r = api.post("/v1/jobs", json=job_body("http://127.0.0.1:9/", ["succeeded"]))
    assert r.status_code == 403 and "no JACOBIAN_WEBHOOK_SECRET is set" in r.json()["error"]["message"]


def test_the_address_is_checked_again_at_delivery_after_dns(api, redis_conn, receiver, monkeypatch):
    """A listed name resolving to a metadata address is never contacted; one resolving to the receiver is
    reached at the address checked (pinned), with the name as Host."""
    import app.notifier as notifier_module

    answers = {"hooks.example.com": "169.254.169.254"}
    monkeypatch.setattr(notifier_module, "resolve_host", lambda host, port: [
        __import__("ipaddress").ip_address(answers.get(host, host))])
    monkeypatch.setenv("JACOBIAN_WEBHOOK_ALLOW", "127.0.0.1,hooks.example.com")
    get_settings.cache_clear()
    url = f"http://hooks.example.com:{receiver.port}/x"
    job_id = api.post("/v1/jobs", json=job_body(url, ["canceled"])).json()["id"]
    api.post(f"/v1/jobs/{job_id}/cancel")
    with running_notifier(redis_conn):
        block = wait_until(lambda: api.get(f"/v1/jobs/{job_id}").json()["notify"]["deliveries"]
                           .get("canceled", {}).get("last_error"), "a refused attempt")
        assert "169.254.169.254, a link-local or metadata address" in block
        assert receiver.snapshot() == [] and metric(api, "canceled", "refused") >= 1
        answers["hooks.example.com"] = "127.0.0.1"
        wait_until(lambda: receiver.accepted(), "the delivery once the name resolves to an allowed address")
    (call,) = receiver.accepted()
    assert call.headers["host"] == f"hooks.example.com:{receiver.port}" and call.headers[":path"] == "/x"


def test_a_delivery_never_accepted_is_given_up_after_the_window(hooks_env, monkeypatch, api, redis_conn, receiver):
    receiver.down = True
    monkeypatch.setenv("JACOBIAN_WEBHOOK_RETRY_WINDOW_S", "0.5")
    get_settings.cache_clear()
    job_id = api.post("/v1/jobs", json=job_body(receiver.url, ["canceled"])).json()["id"]
    api.post(f"/v1/jobs/{job_id}/cancel")
    with running_notifier(redis_conn):
        block = wait_until(lambda: api.get(f"/v1/jobs/{job_id}").json()["notify"]["deliveries"]
                           .get("canceled", {}).get("gave_up") and
                           api.get(f"/v1/jobs/{job_id}").json()["notify"]["deliveries"]["canceled"], "giving up")
    assert block["delivered"] is False and block["next_attempt_at"] is None and block["last_error"] == \
        "HTTP 503 from the receiver"
    assert block["attempts"] == len(receiver.snapshot()) >= 2
    assert metric(api, "canceled", "gave_up") == 1 and Outbox(redis_conn).pending() == 0
