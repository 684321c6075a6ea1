"""A real Prometheus scrapes the API (two uvicorn workers, multiprocess mode) and a worker while a job runs.

The job is submitted before any worker runs, so Prometheus first sees it waiting (queue depth 1),
then, once a worker has computed it, the finished-jobs counter at 1 and an empty queue; both are
read back through Prometheus's HTTP query API. Both /metrics endpoints pass ``promtool check
metrics``, every query of docs/grafana-dashboard.json evaluates, and the logs of the job's life are
JSON lines that carry its id. Needs Debian's ``prometheus`` package (scripts/test.sh installs it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests import models
from tests.conftest import free_port, wait_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCRAPE_INTERVAL_S = 1
BATCH = 3  # mlp: y (3, 4) w.r.t. x (3, 8): 12 Jacobian rows
CHUNK_ROWS = 4


def _exe(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        pytest.fail(f"{name} is not installed: run `bash scripts/setup.sh --with-prometheus` (Debian package "
                    "`prometheus`); `bash scripts/test.sh` does it")
    return exe


def _stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait(what: str, check: Callable[[], Any], timeout_s: float, logs: list[Path] = ()) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            last = exc
        time.sleep(0.25)
    tails = "\n".join(f"--- {p.name}:\n{p.read_text(errors='replace')[-4000:]}" for p in logs if p.exists())
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}; last: {last!r}\n{tails}")


def _json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


class Prom:
    """A Prometheus server on a free port scraping the given targets every second."""

    def __init__(self, workdir: Path, api_port: int, worker_port: int) -> None:
        self.port = free_port()
        self.log = workdir / "prometheus.log"
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S}s",
                       "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
            "scrape_configs": [
                {"job_name": "jacobian-api", "static_configs": [{"targets": [f"127.0.0.1:{api_port}"]}]},
                {"job_name": "jacobian-worker", "static_configs": [{"targets": [f"127.0.0.1:{worker_port}"]}]},
            ],
        }))
        subprocess.run([_exe("promtool"), "check", "config", str(config)], check=True, capture_output=True, timeout=60)
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen(
                [_exe("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=fh, stderr=subprocess.STDOUT, cwd=workdir)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)
        _wait("prometheus ready", lambda: self.http.get("/-/ready").status_code == 200, 60, [self.log])

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = self.http.get("/api/v1/query", params={"query": expr}).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The single sample of an instant query, None when it returns nothing."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None

    def close(self) -> None:
        self.http.close()
        _stop(self.proc)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prom-models")
    models.mlp(root / "mlp")
    return root


@pytest.fixture
def stack(redis_server, redis_conn, model_root, tmp_path) -> Iterator[dict[str, Any]]:
    """Prometheus and the API (uvicorn, two processes, multiprocess metrics); the worker is started by the test."""
    multiproc = tmp_path / "prom-multiproc"
    multiproc.mkdir()
    api_port, worker_port = free_port(), free_port()
    env = {**os.environ, "JACOBIAN_REDIS_URL": redis_server.url, "JACOBIAN_RESULTS_URL": str(tmp_path / "results"),
           "JACOBIAN_MODEL_ROOTS": str(model_root), "JACOBIAN_LOG_FORMAT": "json", "JACOBIAN_LOG_LEVEL": "INFO",
           "JACOBIAN_WORKER_METRICS_PORT": str(worker_port), "JACOBIAN_WORKER_HEARTBEAT_S": "2"}
    env.pop("JACOBIAN_API_KEYS", None)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    api_log = tmp_path / "api.log"
    with api_log.open("wb") as fh:
        api = subprocess.Popen([sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1", "--port",
                                str(api_port), "--workers", "2"],
                               cwd=REPO, env={**env, "PROMETHEUS_MULTIPROC_DIR": str(multiproc)},
                               stdout=fh, stderr=subprocess.STDOUT)
    prom = None
    try:
        wait_port(api_port, timeout_s=90)
        http = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=30)
        _wait("API ready", lambda: http.get("/readyz").status_code == 200, 90, [api_log])
        prom = Prom(tmp_path, api_port, worker_port)
        yield {"api": http, "prom": prom, "env": env, "api_log": api_log, "worker_port": worker_port,
               "multiproc": multiproc, "tmp": tmp_path}
        http.close()
    finally:
        if prom is not None:
            prom.close()
        _stop(api)


def _promtool_check(text: str, where: str) -> None:
    done = subprocess.run([_exe("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"promtool check metrics on {where}:\n{done.stdout}{done.stderr}"


def test_prometheus_scrapes_api_and_worker_through_a_job(stack):
    api, prom, env = stack["api"], stack["prom"], stack["env"]
    worker_log = stack["tmp"] / "worker.log"
    logs = [stack["api_log"], worker_log, prom.log]

    # /readyz reflects Redis and storage.
    ready = api.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"redis": "ok", "storage": "ok"}

    # Two uvicorn processes share one set of counters: requests on new connections reach both, and
    # every /metrics answer, whichever process gives it, counts all of them.
    base, close = str(api.base_url).rstrip("/"), {"Connection": "close"}
    sent = 0
    while sent < 20 or len({f.stem.rsplit("_", 1)[-1] for f in stack["multiproc"].iterdir()}) < 2:
        assert sent < 200, f"one uvicorn process answered all {sent} requests: {list(stack['multiproc'].iterdir())}"
        assert httpx.get(f"{base}/healthz", headers=close).status_code == 200
        sent += 1
    healthz = f'jacobian_http_requests_total{{method="GET",route="/healthz",status_code="200"}} {float(sent)}'
    for _ in range(6):
        assert healthz in httpx.get(f"{base}/metrics", headers=close).text

    # A job waits in the queue (no worker yet): Prometheus sees depth 1 and one submission.
    x = np.random.default_rng(0).normal(size=(BATCH, 8)).astype(np.float32)
    body = {"model": {"path": "mlp"}, "inputs": {"x": {"shape": [BATCH, 8], "data": x.ravel().tolist()}},
            "chunk_rows": CHUNK_ROWS}
    accepted = api.post("/v1/jobs", json=body)
    assert accepted.status_code == 202, accepted.text
    job_id = accepted.json()["id"]
    _wait("queue depth 1 in Prometheus",
          lambda: prom.value('jacobian_queue_depth{job="jacobian-api",queue="jacobian"}') == 1, 60, logs)
    assert prom.value('sum(jacobian_jobs_submitted_total{kind="jacobian"})') == 1
    assert prom.value('sum(jacobian_http_requests_total{route="/healthz",status_code="200"})') == sent

    # A worker takes it; Prometheus reads the finished counter from the worker and an empty queue.
    exe = shutil.which("jacobian", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "jacobian.cli"]
    with worker_log.open("wb") as fh:
        worker = subprocess.Popen(cmd + ["worker"], cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        _wait("job finished", lambda: api.get(f"/v1/jobs/{job_id}").json()["status"]
              in ("succeeded", "failed", "canceled"), 300, logs)
        record = api.get(f"/v1/jobs/{job_id}").json()
        assert record["status"] == "succeeded", record
        finished = 'jacobian_jobs_finished_total{job="jacobian-worker",kind="jacobian",status="succeeded"}'
        _wait("finished counter 1 in Prometheus", lambda: prom.value(finished) == 1, 60, logs)
        _wait("queue depth 0 in Prometheus",
              lambda: prom.value('jacobian_queue_depth{job="jacobian-api",queue="jacobian"}') == 0, 60, logs)
        assert prom.value('sum(jacobian_jobs_finished_total{status=~"failed|canceled"})') == 0
        _wait("compute series in Prometheus",
              lambda: prom.value('sum(jacobian_rows_computed_total{job="jacobian-worker"})') == BATCH * 4, 30, logs)
        assert prom.value("sum(jacobian_output_written_bytes_total)") == BATCH * 4 * BATCH * 8 * 4
        assert prom.value('sum(jacobian_chunk_duration_seconds_count{kind="jacobian"})') == 3
        assert prom.value("sum(jacobian_job_duration_seconds_count)") == 1
        assert prom.value("sum(jacobian_queue_wait_seconds_count)") == 1
        assert prom.value("sum(jacobian_chunk_rows_sum)") == CHUNK_ROWS
        assert prom.value("sum(jacobian_oom_retries_total)") == 0
        assert prom.value("jacobian_accelerator_free_bytes") > 0
        assert {r["metric"]["job"]: r["value"][1] for r in prom.query("up")} == {"jacobian-api": "1",
                                                                                  "jacobian-worker": "1"}
        assert not [s for s in prom.query('{__name__=~"jacobian_.+"}') if job_id in json.dumps(s["metric"])]

        # promtool accepts both expositions (now that every histogram has observations).
        _promtool_check(api.get("/metrics").text, "the API")
        worker_text = httpx.get(f"http://127.0.0.1:{stack['worker_port']}/metrics", timeout=10).text
        assert "jacobian_jobs_finished_total" in worker_text
        _promtool_check(worker_text, "the worker")

        # Every query of the Grafana dashboard evaluates; the main panels have data.
        dashboard = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
        exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        assert len(exprs) >= 15
        for expr in exprs:
            prom.query(expr.replace("$__rate_interval", "1m"))
        for expr in exprs:
            if "queue_depth" in expr or "jobs_running" in expr or "accelerator_free" in expr:
                assert prom.query(expr), expr
    finally:
        _stop(worker)

    # Logs: JSON lines; every line of the job's life in the worker carries its id; the plan is logged.
    lines = _json_lines(worker_log)
    assert lines, worker_log.read_text()[-3000:]
    assert all({"ts", "level", "logger", "message"} <= set(line) for line in lines)
    mine = [line for line in lines if line.get("job_id") == job_id]
    events = [line.get("event") for line in mine]
    assert {"job_started", "plan_chosen", "job_finished"} <= set(events), events
    plan = next(line for line in mine if line.get("event") == "plan_chosen")
    assert plan["chunk_rows"] == CHUNK_ROWS and plan["strategy"] and plan["free_bytes"] > 0
    assert plan["bytes_per_row"] >= 0 and plan["service"] == "worker"
    end = next(line for line in mine if line.get("event") == "job_finished")
    assert end["status"] == "succeeded" and end["duration_s"] > 0
    assert any(line["logger"].startswith("rq.") and "Job OK" in line["message"] for line in mine)
    untagged = [line for line in lines if job_id in line["message"] and line.get("job_id") != job_id
                and not line["logger"].startswith("rq.")]  # rq names the job when it dequeues it
    assert not untagged, untagged
    api_lines = _json_lines(stack["api_log"])
    assert any(line.get("event") == "job_accepted" and line.get("job_id") == job_id for line in api_lines)
