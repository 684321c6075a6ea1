"""Every metric of a worker process, declared once; prefix ``jacobian_``, base units (seconds, bytes).

A worker is one process (rq ``SimpleWorker``, no fork), so its metrics live in their own registry,
``REGISTRY`` here, served by ``start_metrics_server(port)`` on ``JACOBIAN_WORKER_METRICS_PORT``;
Prometheus scrapes every worker and sums. Labels never carry a job id or a path: ``kind`` is one of
the registry's kinds (``contracts.kinds``), ``status`` one of the terminal job statuses. "Rows" are the
kind's units of work: Jacobian rows, seeds of a product kind, colours of a sparse job, iterations or
samples of a spectral kind. Queue depth and submissions are
the API's (``app/metrics.py``); jobs finished are counted here, where they finish.

Do not set ``PROMETHEUS_MULTIPROC_DIR`` for workers (it is for several uvicorn processes of the API).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from contracts import storage
from contracts.kinds import KINDS as KIND_SPECS

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

KINDS = tuple(KIND_SPECS)   # the kind label's values: every kind of the registry (anything else: "other")
FINISHED_STATUSES = ("succeeded", "failed", "canceled")
_SECONDS_LONG = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200,
                 86400)
_SECONDS_CHUNK = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_ROWS = tuple(float(2 ** i) for i in range(0, 21, 2))  # 1, 4, 16, ... 1 048 576 rows per chunk

JOBS_FINISHED = Counter("jacobian_jobs_finished", "Jobs that reached a terminal status, by kind and status.",
                        ["kind", "status"], registry=REGISTRY)
JOB_RETRIES = Counter("jacobian_job_retries", "Job attempts that ended in a transient error and were handed "
                      "back to rq for a retry, by kind.", ["kind"], registry=REGISTRY)
JOB_DURATION = Histogram("jacobian_job_duration_seconds", "Wall time of a job attempt in the worker, from dequeue "
                         "to its terminal status, by kind and status.", ["kind", "status"], buckets=_SECONDS_LONG,
                         registry=REGISTRY)
QUEUE_WAIT = Histogram("jacobian_queue_wait_seconds", "Time a job waited in the queue: rq start time minus "
                       "(re-)enqueue time.", buckets=_SECONDS_LONG, registry=REGISTRY)
JOBS_RUNNING = Gauge("jacobian_jobs_running", "Jobs this worker is running now (0 or 1).", registry=REGISTRY)
CHUNK_DURATION = Histogram("jacobian_chunk_duration_seconds", "Compute time of one chunk of Jacobian rows, by kind.",
                           ["kind"], buckets=_SECONDS_CHUNK, registry=REGISTRY)
ROWS_COMPUTED = Counter("jacobian_rows_computed", "Jacobian rows computed, by kind.", ["kind"], registry=REGISTRY)
OUTPUT_BYTES = Counter("jacobian_output_written_bytes", "Result bytes (uncompressed, in the stored dtype) handed "
                       "to the result writer, by kind.", ["kind"], registry=REGISTRY)
CHUNK_ROWS = Histogram("jacobian_chunk_rows", "Rows per chunk chosen by the planner (again after every halving).",
                       buckets=_ROWS, registry=REGISTRY)
OOM_RETRIES = Counter("jacobian_oom_retries", "Chunks that ran out of accelerator memory and were retried at half "
                      "the rows.", registry=REGISTRY)
FREE_BYTES = Gauge("jacobian_accelerator_free_bytes", "Accelerator memory free to this worker (host memory on a "
                   "CPU worker) when it last planned a job, in bytes.", registry=REGISTRY)
MODEL_DOWNLOADS = Counter("jacobian_model_downloads", "Models under S3 model roots that jobs loaded, by whether this "
                          "worker downloaded them (downloaded) or found their current bytes in its local cache "
                          "(cached).", ["result"], registry=REGISTRY)
MODEL_DOWNLOAD_BYTES = Counter("jacobian_model_download_bytes", "Bytes of models downloaded from S3 model roots.",
                               registry=REGISTRY)
STORAGE_RETRIES = Counter("jacobian_storage_retries", "Storage operations that failed and were tried again, by "
                          "source: s3_request, an S3 request attempt that failed (connection reset or error, "
                          "timeout, 5xx or 429; the S3 client tries it again); block_write, a result block whose "
                          "write failed after those and that the result writer writes again.", ["source"],
                          registry=REGISTRY)
for _source in ("s3_request", "block_write"):
    STORAGE_RETRIES.labels(_source)
storage.S3_RETRY_HOOKS.append(STORAGE_RETRIES.labels("s3_request").inc)

for _result in ("downloaded", "cached"):
    MODEL_DOWNLOADS.labels(_result)
for _kind in KINDS:  # every counter series exists from the start, so rate() and increase() see the first job
    for _status in FINISHED_STATUSES:
        JOBS_FINISHED.labels(_kind, _status)
    JOB_RETRIES.labels(_kind)
    ROWS_COMPUTED.labels(_kind)
    OUTPUT_BYTES.labels(_kind)

_server_lock = threading.Lock()
_server: Any = None


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> Any:
    """Serve ``REGISTRY`` at ``http://{addr}:{port}/metrics`` from a daemon thread; once per process.

    Returns the server (its ``server_port`` is the bound port, useful with ``port=0``).
    """
    global _server
    with _server_lock:
        if _server is None:
            _server, _thread = start_http_server(int(port), addr=addr, registry=REGISTRY)
            log.info("worker metrics on http://%s:%d/metrics", addr, _server.server_port)
        return _server


def kind_label(kind: Any) -> str:
    """``kind`` as a label value, from a closed set."""
    value = str(getattr(kind, "value", kind))
    return value if value in KINDS else "other"


def observe_plan(plan: dict[str, Any], previous: dict[str, Any] | None) -> None:
    """A plan was chosen (``previous`` None) or changed: chunk rows, OOM retries since, free bytes."""
    rows = plan.get("chunk_rows")
    if isinstance(rows, (int, float)) and (previous is None or rows != previous.get("chunk_rows")):
        CHUNK_ROWS.observe(rows)
    retries = int(plan.get("oom_retries") or 0) - int((previous or {}).get("oom_retries") or 0)
    if retries > 0:
        OOM_RETRIES.inc(retries)
    free = plan.get("free_bytes_at_start")
    if isinstance(free, (int, float)) and previous is None:
        FREE_BYTES.set(free)


def observe_chunk(kind: str, rows: int, nbytes: int, seconds: float) -> None:
    """One chunk computed and handed to the writer."""
    label = kind_label(kind)
    CHUNK_DURATION.labels(label).observe(max(seconds, 0.0))
    ROWS_COMPUTED.labels(label).inc(rows)
    OUTPUT_BYTES.labels(label).inc(nbytes)


def observe_job_end(kind: str, status: str, seconds: float) -> None:
    """A job attempt ended: terminal ``status`` counts as finished, ``"retrying"`` as a retry."""
    label = kind_label(kind)
    if status in FINISHED_STATUSES:
        JOBS_FINISHED.labels(label, status).inc()
        JOB_DURATION.labels(label, status).observe(max(seconds, 0.0))
    elif status == "retrying":
        JOB_RETRIES.labels(label).inc()


def queue_wait_seconds(rq_job: Any) -> float | None:
    """``started_at - enqueued_at`` of an rq job (now when not started), None when unknown."""
    enqueued = getattr(rq_job, "enqueued_at", None)
    if not isinstance(enqueued, dt.datetime):
        return None
    started = getattr(rq_job, "started_at", None)
    if not isinstance(started, dt.datetime):
        started = dt.datetime.now(dt.UTC)
    if enqueued.tzinfo is None:
        enqueued = enqueued.replace(tzinfo=dt.UTC)
    if started.tzinfo is None:
        started = started.replace(tzinfo=dt.UTC)
    return max((started - enqueued).total_seconds(), 0.0)
