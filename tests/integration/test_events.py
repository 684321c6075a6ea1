"""``GET /v1/jobs/{id}/events`` under a live uvicorn and a real redis-server; progress written through the
``JobStore`` as workers write it; read by raw httpx, ``JacobianClient.follow`` and ``jacobian status --follow``."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from app.events import parse_key
from contracts.jobspec import JobStatus
from contracts.jobstore import JobRecord, JobStore
from contracts.records import ErrorInfo, Progress, ResultInfo
from jacobian.client import JacobianClient, JacobianError
from jacobian.events import JobEvent, parse_sse
from tests.conftest import free_port, wait_port
from tests.procs import REPO, base_env, jacobian_exe

pytestmark = pytest.mark.integration
MAX_STREAMS = 2
ROWS = 4


@pytest.fixture(scope="module")
def api(redis_server, model_root, tmp_path_factory) -> Iterator[str]:
    """A live uvicorn on this session's redis-server: the API's URL. Streams poll every 50 ms, send a
    heartbeat after 0.3 s of quiet, and at most ``MAX_STREAMS`` are open at once."""
    port = free_port()
    env = base_env(JACOBIAN_REDIS_URL=redis_server.url, JACOBIAN_MODEL_ROOTS=str(model_root),
                   JACOBIAN_RESULTS_URL=str(tmp_path_factory.mktemp("results")), JACOBIAN_LOG_FORMAT="none",
                   JACOBIAN_EVENT_POLL_S="0.05", JACOBIAN_EVENT_HEARTBEAT_S="0.3",
                   JACOBIAN_MAX_EVENT_STREAMS=str(MAX_STREAMS))
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(port),
                             "--log-level", "warning"], cwd=REPO, env=env)
    try:
        wait_port(port, timeout_s=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture
def store(redis_conn: redis.Redis) -> JobStore:
    return JobStore(redis_conn, ttl_s=3600)


def new_job(store: JobStore) -> str:
    job_id = uuid.uuid4().hex
    store.create(JobRecord(id=job_id, status=JobStatus.queued, spec={}, created_at=time.time()))
    return job_id


def run_step(store: JobStore, job_id: str, step: int) -> None:
    """Step ``step`` of a job's life as a worker writes it: running, then rows 1..ROWS, then succeeded."""
    if step == 0:
        assert store.transition(job_id, JobStatus.running, progress=Progress.of(0, ROWS, 0.0))
    elif step <= ROWS:
        assert store.set_fields(job_id, progress=Progress.of(step, ROWS, 2.0))
    else:
        assert store.transition(job_id, JobStatus.succeeded, progress=Progress.of(ROWS, ROWS, 2.0),
                                result=ResultInfo(uri="file:///r.zarr", shape=[ROWS, 1], dtype="float32"))


def open_streams(api: str) -> float:
    """The API process's ``jacobian_event_streams`` gauge."""
    for line in httpx.get(f"{api}/metrics", timeout=10).text.splitlines():
        if line.startswith("jacobian_event_streams "):
            return float(line.split()[1])
    raise AssertionError("jacobian_event_streams is not exposed")


def wait_streams(api: str, expected: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while open_streams(api) != expected:
        assert time.monotonic() < deadline, f"{open_streams(api)} event streams open, expected {expected}"
        time.sleep(0.05)


def test_client_follow_yields_every_step_in_order_then_ends(api, store):
    """Each write is made only once the event of the previous one arrived: no state is missed."""
    job_id = new_job(store)
    events: list[JobEvent] = []
    with JacobianClient(api) as client:
        for step, event in enumerate(client.follow(job_id)):
            events.append(event)
            assert step <= ROWS + 2, events
            if event.event != "end":
                run_step(store, job_id, step)
        final = client.status(job_id)
    assert [e.event for e in events] == ["status", "status"] + ["progress"] * ROWS + ["end"]
    assert [e.data["status"] for e in events] == ["queued"] + ["running"] * (ROWS + 1) + ["succeeded"]
    assert [e.data["progress"]["rows_done"] for e in events] == [0, 0, 1, 2, 3, 4, 4]
    assert events[3].data["progress"]["eta_seconds"] == 1.0  # 2 rows left at 2 rows/s
    keys = [parse_key(e.id) for e in events]
    assert None not in keys and keys == sorted(keys) and len(set(keys)) == len(keys)
    assert events[-1].data == final


def test_last_event_id_resumes_with_later_events_only(api, store):
    job_id = new_job(store)
    for step in range(3):  # running, rows 1, rows 2
        run_step(store, job_id, step)
    with JacobianClient(api) as client:
        first = next(iter(client.follow(job_id)))
        assert (first.event, first.data["progress"]["rows_done"]) == ("status", 2)
        stream = client.follow(job_id, last_event_id=first.id)  # nothing later yet: waits for the next write
        threading.Timer(0.5, run_step, (store, job_id, 3)).start()
        resumed = next(iter(stream))
    assert (resumed.event, resumed.data["progress"]["rows_done"]) == ("progress", 3)
    assert parse_key(resumed.id) > parse_key(first.id)


def test_raw_stream_format_and_terminal_event_closes(api, store):
    job_id = new_job(store)
    assert store.transition(job_id, JobStatus.failed, error=ErrorInfo(type="Boom", message="x: broke"))
    with httpx.Client(base_url=api, timeout=10) as http, http.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        lines = list(r.iter_lines())  # returns: the server closed the stream after the end event
    events = list(parse_sse(lines))
    assert [e.event for e in events] == ["end"]
    assert events[0].data == httpx.get(f"{api}/v1/jobs/{job_id}").json()
    assert events[0].data["error"]["type"] == "Boom"
    assert lines[0] == "retry: 2000" and [ln.split(":")[0] for ln in lines[2:5]] == ["id", "event", "data"]


def test_unknown_job_is_a_json_404(api):
    for job_id in (uuid.uuid4().hex, "not-an-id"):
        r = httpx.get(f"{api}/v1/jobs/{job_id}/events", timeout=10)
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "JobNotFound"
    with JacobianClient(api) as client, pytest.raises(JacobianError) as info:
        list(client.follow(uuid.uuid4().hex))
    assert info.value.status_code == 404


def test_heartbeat_limit_and_disconnect_frees_the_stream(api, store):
    job_id = new_job(store)
    run_step(store, job_id, 0)
    wait_streams(api, 0)
    with httpx.Client(base_url=api, timeout=10) as http:
        responses = [http.send(http.build_request("GET", f"/v1/jobs/{job_id}/events"), stream=True)
                     for _ in range(MAX_STREAMS)]
        lines = responses[0].iter_lines()
        seen = [next(lines) for _ in range(7)]  # retry, blank, id, event, data, blank, then a heartbeat
        assert seen[-1] == ": keep-alive", seen
        wait_streams(api, MAX_STREAMS)
        refused = http.get(f"/v1/jobs/{job_id}/events")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["type"] == "TooManyStreams"
        for response in responses:  # the client goes away while the job still runs
            response.close()
    wait_streams(api, 0)  # the server's stream tasks ended with their connections
    assert httpx.get(f"{api}/v1/jobs/{job_id}").json()["status"] == "running"


def test_cli_status_follow_prints_events_and_exits_with_the_job(api, store):
    job_id = new_job(store)

    def worker() -> None:
        wait_streams(api, 1, timeout_s=60)  # the command is following
        for step in range(ROWS + 2):
            time.sleep(0.4)
            run_step(store, job_id, step)

    thread = threading.Thread(target=worker)
    thread.start()
    done = subprocess.run([*jacobian_exe(), "status", job_id, "--follow", "--api", api], env=base_env(),
                          capture_output=True, text=True, timeout=120)
    thread.join()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("status  queued  rows 0/?"), lines
    assert lines[-1].startswith(f"end  succeeded  rows {ROWS}/{ROWS}  100.0%"), lines
    assert any(ln.startswith("progress  running") and "ETA" in ln for ln in lines), lines

    failed = new_job(store)
    assert store.transition(failed, JobStatus.failed, error=ErrorInfo(type="Boom", message="x: broke"))
    done = subprocess.run([*jacobian_exe(), "status", failed, "--follow", "--api", api], env=base_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "end  failed" in done.stdout and "Boom: x: broke" in done.stdout


def test_events_need_the_api_key_as_get_does(client, monkeypatch, store):
    from contracts.settings import get_settings

    job_id = new_job(store)
    monkeypatch.setenv("JACOBIAN_API_KEYS", "k1")
    get_settings.cache_clear()
    assert client.get(f"/v1/jobs/{job_id}/events").status_code == 401
    assert client.get(f"/v1/jobs/{job_id}").status_code == 401


def test_openapi_documents_the_event_stream(client):
    operation = client.get("/openapi.json").json()["paths"]["/v1/jobs/{job_id}/events"]["get"]
    assert operation["summary"].startswith("Follow a job: Server-Sent Events")
    assert "text/event-stream" in operation["responses"]["200"]["content"]
    assert {"404", "503"} <= set(operation["responses"])
    assert any(p["name"] == "Last-Event-ID" and p["in"] == "header" for p in operation["parameters"])


def http_count(api: str, route: str, status_code: str) -> float:
    """``jacobian_http_requests_total`` of GET ``route`` answered ``status_code`` in the API process."""
    head = f'jacobian_http_requests_total{{method="GET",route="{route}",status_code="{status_code}"}} '
    for line in httpx.get(f"{api}/metrics", timeout=10).text.splitlines():
        if line.startswith(head):
            return float(line.split()[-1])
    return 0.0


def page_dom(api: str, url: str, profile: Path, *, budget_ms: int = 3000) -> str:
    """``url`` of the API in headless Chromium after ``budget_ms`` of virtual time: its DOM."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed: run `bash scripts/setup.sh --with-chromium` (scripts/test.sh does)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
             "--disable-background-networking", f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}"]
    done = subprocess.run([exe, *flags, "--dump-dom", f"{api}{url}"], capture_output=True, timeout=90,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    return html.unescape(done.stdout.decode(errors="replace"))


def test_ui_job_view_follows_the_job_by_events(api, store, tmp_path):
    """The page opens the stream for the running job it shows and renders the events it gets."""
    job_id = new_job(store)
    run_step(store, job_id, 0)
    run_step(store, job_id, 1)
    wait_streams(api, 0)
    streamed = http_count(api, "/v1/jobs/{job_id}/events", "200")
    opened: list[bool] = []

    def worker() -> None:  # once the page follows the job: a chunk, then the job fails
        wait_streams(api, 1, timeout_s=60)
        opened.append(True)
        run_step(store, job_id, 3)
        time.sleep(0.3)
        store.transition(job_id, JobStatus.failed, progress=Progress.of(3, ROWS, 2.0),
                         error=ErrorInfo(type="Boom", message="x: broke"))

    thread = threading.Thread(target=worker)
    thread.start()
    dom = page_dom(api, f"/ui#job={job_id}", tmp_path / "profile")
    thread.join()
    assert opened, "the page never opened GET /v1/jobs/{id}/events"
    assert http_count(api, "/v1/jobs/{job_id}/events", "200") == streamed + 1
    view = re.search(r'<div id="job-view"[^>]*>', dom)
    assert view and f'data-job-id="{job_id}"' in view.group(0) and 'data-status="failed"' in view.group(0), dom[-3000:]
    assert f"rows 3 / {ROWS}" in dom, dom[-3000:]


def test_ui_job_view_polls_when_the_stream_is_refused(api, store, tmp_path):
    """Every stream slot taken: the page's EventSource gets 503, and the job view polls the job instead."""
    job_id = new_job(store)
    run_step(store, job_id, 0)
    run_step(store, job_id, 2)
    wait_streams(api, 0)
    refused = http_count(api, "/v1/jobs/{job_id}/events", "503")
    polled = http_count(api, "/v1/jobs/{job_id}", "200")
    with httpx.Client(base_url=api, timeout=10) as http:
        held = [http.send(http.build_request("GET", f"/v1/jobs/{job_id}/events"), stream=True)
                for _ in range(MAX_STREAMS)]
        wait_streams(api, MAX_STREAMS)
        dom = page_dom(api, f"/ui#job={job_id}", tmp_path / "profile", budget_ms=4000)
        for response in held:
            response.close()
    assert http_count(api, "/v1/jobs/{job_id}/events", "503") >= refused + 1
    assert http_count(api, "/v1/jobs/{job_id}", "200") >= polled + 2  # polled again after the refusal
    assert f"rows 2 / {ROWS}" in dom and 'data-status="running"' in dom, dom[-3000:]
    wait_streams(api, 0)
