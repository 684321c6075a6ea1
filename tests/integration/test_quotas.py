"""Per-key quotas against a real redis-server: each limit's 429 (Retry-After, the limit named, nothing queued),
slots freed by whatever ends a job, per-key overrides, ``GET /v1/usage``, metrics, the request rate, and
concurrent POSTs under a live uvicorn. The worker is simulated by writing records as it does."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from rq import Queue

from app.errors import QuotaExceeded
from app.main import create_app
from app.quotas import PENDING_S, Quotas, admitted
from contracts.jobspec import JobStatus
from contracts.jobstore import JobStore
from contracts.quotas import QuotaLimits, seconds_to_utc_midnight, take_token
from contracts.records import ErrorInfo, Progress, ResultInfo
from contracts.settings import get_settings
from tests.conftest import finished_job, free_port, wait_port
from tests.procs import REPO, base_env

pytestmark = pytest.mark.integration


def mlp_body() -> dict:
    return {"model": {"path": "mlp"}, "inputs": {"x": {"shape": [2, 8], "data": np.linspace(-1, 1, 16).tolist()}}}


@pytest.fixture
def make_client(env, monkeypatch) -> Iterator:
    """``make_client(QUOTA_MAX_QUEUED="2", ...)``: the API on these extra JACOBIAN_* settings."""
    clients = []

    def make(**settings: str) -> TestClient:
        for name, value in settings.items():
            monkeypatch.setenv(f"JACOBIAN_{name}", value)
        get_settings.cache_clear()
        client = TestClient(create_app())
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def post(client: TestClient, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post("/v1/jobs", json=mlp_body(), headers=headers)


def assert_refused(response, limit: str, usage: float, max_: float) -> dict:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == "QuotaExceeded" and error["limit"] == limit, error
    assert (error["usage"], error["max"]) == (usage, max_), error
    assert error["message"].startswith(f"quota {limit}: ")
    assert int(response.headers["retry-after"]) >= 1
    return error


def queued_ids(redis_conn) -> list[str]:
    return Queue(get_settings().queue_name, connection=redis_conn).job_ids


def succeed(store: JobStore, job_id: str, shape: list[int]) -> None:
    """The job's life as a worker writes it: running, then succeeded with a float32 result of ``shape``."""
    assert store.transition(job_id, JobStatus.running, progress=Progress.of(0, shape[0], 0.0))
    assert store.transition(job_id, JobStatus.succeeded, progress=Progress.of(shape[0], shape[0], 1.0),
                            result=ResultInfo(uri=f"file:///r/{job_id}", shape=shape, dtype="float32"))


def test_queued_limit_refuses_with_429_and_queues_nothing(make_client, redis_conn, results):
    client = make_client(QUOTA_MAX_QUEUED="2")
    ids = [post(client).json()["id"] for _ in range(2)]
    r = post(client)
    error = assert_refused(r, "queued", 2, 2)
    assert error["key"] == "anonymous" and "JACOBIAN_QUOTA_MAX_QUEUED" in error["message"]
    assert r.headers["retry-after"] == "30"  # no running job with an ETA to go by
    assert sorted(queued_ids(redis_conn)) == sorted(ids)
    assert sorted(p.name for p in results.iterdir()) == sorted(ids)  # no inputs stored for the refused one
    assert len(JobStore(redis_conn).list()) == 2


def test_retry_after_without_an_eta_is_the_keys_recent_job_time(make_client, redis_conn):
    """Short jobs and no running one to take an ETA from: Retry-After is the key's recent job running time (a
    moving average of its ended jobs'), not 30 s; never over 30 s."""
    client = make_client(QUOTA_MAX_QUEUED="1")
    store = JobStore(redis_conn, ttl_s=3600)
    first = post(client).json()["id"]
    now = time.time()
    assert store.transition(first, JobStatus.running, started_at=now - 4.2)
    assert store.transition(first, JobStatus.succeeded, finished_at=now,
                            result=ResultInfo(uri=f"file:///r/{first}", shape=[2, 8], dtype="float32"))
    second = post(client)
    assert second.status_code == 202, second.text   # the first ended: its slot is free, its 4.2 s remembered
    r = post(client)
    assert_refused(r, "queued", 1, 1)
    assert r.headers["retry-after"] == "5", r.headers   # ceil(4.2)
    assert store.transition(second.json()["id"], JobStatus.running, started_at=now - 100)
    assert store.transition(second.json()["id"], JobStatus.failed, finished_at=now,
                            error=ErrorInfo(type="X", message="x"))
    post(client)   # settles the failed one: 0.3 x 100 + 0.7 x 4.2 = 32.9 s, held to 30
    assert post(client).headers["retry-after"] == "30"


def test_concurrent_limit_counts_queued_and_running_and_ends_free_slots(make_client, redis_conn):
    client = make_client(QUOTA_MAX_CONCURRENT="3")
    store = JobStore(redis_conn, ttl_s=3600)
    a, b, c = (post(client).json()["id"] for _ in range(3))
    assert store.transition(a, JobStatus.running, progress=Progress.of(1, 10, 1.0))  # ETA 9 s
    r = assert_refused(post(client), "concurrent", 3, 3)
    assert "queued or running" in r["message"]
    assert post(client).headers["retry-after"] == "9"  # the running job's ETA
    # a failure (as a worker, or maintenance after a worker died, writes it) frees a slot
    assert store.transition(a, JobStatus.failed, error=ErrorInfo(type="WorkerDied", message="died twice"))
    d = post(client)
    assert d.status_code == 202
    assert_refused(post(client), "concurrent", 3, 3)
    # a cancel of a queued job frees one
    assert client.post(f"/v1/jobs/{b}/cancel").json()["status"] == "canceled"
    assert post(client).status_code == 202
    # a success too
    succeed(store, c, [2, 2])
    assert post(client).status_code == 202
    assert_refused(post(client), "concurrent", 3, 3)
    in_flight = [r for r in store.list() if not r.status.is_terminal]
    assert len(in_flight) == 3 and len(store.list()) == 6  # a, b, c ended; 3 refusals wrote nothing


def test_result_bytes_per_day_count_each_success_once(make_client, redis_conn):
    client = make_client(QUOTA_MAX_RESULT_BYTES_PER_DAY="200")
    store = JobStore(redis_conn, ttl_s=3600)
    first = post(client).json()["id"]
    succeed(store, first, [4, 8])  # 128 bytes
    usage = client.get("/v1/usage").json()
    assert usage["result_bytes_today"] == 128 and client.get("/v1/usage").json()["result_bytes_today"] == 128
    second = post(client).json()["id"]  # 128 < 200: accepted
    succeed(store, second, [4, 8])
    r = post(client)
    assert_refused(r, "result_bytes_per_day", 256, 200)
    assert abs(int(r.headers["retry-after"]) - seconds_to_utc_midnight(time.time())) <= 2
    assert len(JobStore(redis_conn).list()) == 2


def test_a_worker_run_jobs_result_bytes_are_counted_from_its_record(worker_env, redis_conn):
    import zarr

    worker_env(1 << 20, QUOTA_MAX_RESULT_BYTES_PER_DAY="512")
    with TestClient(create_app()) as client:
        record = finished_job(client, redis_conn, post(client).json()["id"])
        array = zarr.open_group(record["result"]["uri"], mode="r")["jacobian"]
        assert array.nbytes == 512  # (2, 4, 2, 8) float32
        assert client.get("/v1/usage").json()["result_bytes_today"] == 512
        assert_refused(post(client), "result_bytes_per_day", 512, 512)


def test_per_key_overrides_and_keys_counted_apart(make_client, redis_conn):
    keys = [{"key": "secret-a", "name": "team-a", "quotas": {"max_queued": 1}},
            {"key": "secret-b", "name": "team-b"},
            {"key": "secret-c", "name": "team-c", "quotas": {"max_queued": None}}]
    client = make_client(API_KEYS=json.dumps(keys), QUOTA_MAX_QUEUED="2")
    assert post(client, "secret-a").status_code == 202
    error = assert_refused(post(client, "secret-a"), "queued", 1, 1)
    assert error["key"] == "team-a" and "secret-a" not in json.dumps(error)
    assert [post(client, "secret-b").status_code for _ in range(3)] == [202, 202, 429]
    assert [post(client, "secret-c").status_code for _ in range(4)] == [202] * 4
    usage = client.get("/v1/usage", headers={"Authorization": "Bearer secret-b"}).json()
    assert usage["key"] == "team-b" and usage["queued"] == 2 and usage["running"] == 0
    assert {row["name"]: (row["used"], row["max"]) for row in usage["limits"]} == {
        "concurrent": (2, None), "queued": (2, 2), "result_bytes_per_day": (0, None), "requests_per_s": (0, None)}
    assert client.get("/v1/usage").status_code == 401

    text = client.get("/metrics").text
    assert "secret-" not in text
    samples = {(s.name, s.labels.get("key"), s.labels.get("limit")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("jacobian_quota_usage", "team-a", "queued")] == 1
    assert samples[("jacobian_quota_usage", "team-c", "queued")] == 4
    assert samples[("jacobian_quota_limit", "team-a", "queued")] == 1
    assert ("jacobian_quota_limit", "team-c", "queued") not in samples
    assert samples[("jacobian_quota_rejections_total", "team-b", "queued")] >= 1


def test_request_rate_refuses_past_the_burst_with_retry_after(make_client, redis_conn):
    client = make_client(QUOTA_REQUESTS_PER_S="0.05", QUOTA_BURST="3")  # a token per 20 s: no refill mid-test
    assert [client.get("/v1/usage").status_code for _ in range(3)] == [200, 200, 200]
    r = client.get("/v1/jobs")
    assert_refused(r, "requests_per_s", 3, 3)
    assert 15 <= int(r.headers["retry-after"]) <= 20
    assert client.get("/healthz").status_code == 200  # health and metrics are not rate limited


def test_the_lua_bucket_takes_tokens_as_the_pure_rule_does(redis_conn):
    clock = [1000.0]
    quotas = Quotas(redis_conn, clock=lambda: clock[0])
    limits = QuotaLimits(requests_per_s=2.0, burst=3)
    bucket = None
    for step in [0, 0, 0, 0, 0.25, 0.25, 1.7, 0, 0, 0, -5.0, 0, 100.0]:
        clock[0] += step
        bucket, wait = take_token(bucket, now_s=clock[0], rate_per_s=2.0, size=3)
        try:
            quotas.take_request("k", limits)
            taken = True
        except QuotaExceeded as exc:
            taken = False
            assert exc.details["limit"] == "requests_per_s"
        assert taken == (wait == 0.0), (clock[0], wait)
        assert quotas.bucket("k").tokens == pytest.approx(bucket.tokens)


def test_an_admitted_job_without_a_record_counts_until_pending_s_then_is_dropped(redis_conn):
    clock = [1000.0]
    quotas = Quotas(redis_conn, clock=lambda: clock[0])
    limits = QuotaLimits(max_queued=1)
    quotas.admit("k", "0" * 32, limits)  # as if the API died before writing the record
    with pytest.raises(QuotaExceeded):
        quotas.admit("k", "1" * 32, limits)
    clock[0] += PENDING_S + 1
    quotas.admit("k", "1" * 32, limits)
    assert quotas.usage("k", limits).queued == 1


def test_a_submission_that_fails_after_admission_gives_its_slot_back(redis_conn):
    limits = QuotaLimits(max_queued=1)
    with pytest.raises(OSError), admitted(redis_conn, "k", "2" * 32, limits):
        raise OSError("storage down")
    with admitted(redis_conn, "k", "3" * 32, limits):
        pass
    with pytest.raises(QuotaExceeded):
        Quotas(redis_conn).admit("k", "4" * 32, limits)


@pytest.fixture(scope="module")
def live_api(redis_server, model_root, tmp_path_factory) -> Iterator[str]:
    """A live uvicorn with ``JACOBIAN_QUOTA_MAX_QUEUED=3`` (POSTs run on its thread pool, in parallel)."""
    port = free_port()
    env = base_env(JACOBIAN_REDIS_URL=redis_server.url, JACOBIAN_MODEL_ROOTS=str(model_root),
                   JACOBIAN_RESULTS_URL=str(tmp_path_factory.mktemp("results")), JACOBIAN_LOG_FORMAT="none",
                   JACOBIAN_QUOTA_MAX_QUEUED="3")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(port),
                             "--log-level", "warning"], cwd=REPO, env=env)
    try:
        wait_port(port, timeout_s=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_concurrent_posts_accept_exactly_the_limit(live_api, redis_conn):
    n = 16
    barrier = threading.Barrier(n)
    codes: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        with httpx.Client(base_url=live_api, timeout=60) as http:
            barrier.wait()
            code = http.post("/v1/jobs", json=mlp_body()).status_code
        with lock:
            codes.append(code)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [202] * 3 + [429] * (n - 3)
    assert len(queued_ids(redis_conn)) == 3
    assert httpx.get(f"{live_api}/v1/usage").json()["queued"] == 3
