"""The worker process: an in-process rq worker (no fork) with its own heartbeat, one GPU per process."""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from redis import Redis
from rq import Queue, SimpleWorker
from rq.serializers import JSONSerializer
from rq.worker import WorkerStatus

from contracts.jobspec import FINALIZE_JOB_TASK, RUN_JOB_TASK, JobStatus
from contracts.jobstore import JobStore
from contracts.logs import configure_logging, job_context, start_thread_in_context
from contracts.records import ErrorInfo
from contracts.settings import Settings, get_settings
from worker.device_setup import configure_devices

log = logging.getLogger(__name__)


class JacobianWorker(SimpleWorker):
    """Runs jobs in this process, so TensorFlow and the model cache outlive a job.

    rq's ``SimpleWorker`` sends no heartbeat while a job runs and instead stretches every TTL to the
    job timeout (24 h here), so a worker killed mid-job would look alive for a day. This class keeps
    the job's heartbeat TTL at ``worker_heartbeat_ttl_factor`` (3) heartbeat intervals and refreshes
    the worker, execution and job heartbeats from a thread every ``worker_heartbeat_s`` seconds while
    a job runs.

    Dead workers are found by rq's maintenance (``StartedJobRegistry.cleanup``: an execution whose
    heartbeat expired is an abandoned job, retried while it has retries left). rq runs it every 10
    minutes and an idle worker only wakes from its blocking dequeue every ``worker_ttl - 15`` s; here
    both are ``worker_maintenance_s`` (15 s), so a job whose worker was killed is requeued at most
    ``ttl_factor * heartbeat_s + worker_maintenance_s`` (45 s by default) after the kill, by any other
    worker of the queue that is idle, and enqueued at once (its retry interval, meant for transient
    errors, is skipped). Maintenance also enqueues retries scheduled with an interval
    (``Retry(interval=...)``), so no separate rq scheduler process is needed, and marks a job failed
    whose worker died when it has no retries left.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings = get_settings()
        kwargs.setdefault("serializer", JSONSerializer)
        kwargs.setdefault("job_monitoring_interval", settings.worker_heartbeat_s)
        kwargs.setdefault("maintenance_interval", settings.worker_maintenance_s)
        kwargs.setdefault("worker_ttl", settings.worker_maintenance_s + 15)  # dequeue timeout = maintenance interval
        super().__init__(*args, **kwargs)
        self.heartbeat_ttl_factor = settings.worker_heartbeat_ttl_factor
        self._abandoned_ids: set[str] = set()
        self.push_exc_handler(self._on_abandoned)

    def get_heartbeat_ttl(self, job: Any, working_time: float = 0.0) -> int:
        """Seconds until the job is taken for abandoned unless a heartbeat arrives: factor x interval."""
        return max(int(self.heartbeat_ttl_factor * self.job_monitoring_interval), int(self.job_monitoring_interval) + 1)

    def run_maintenance_tasks(self) -> None:
        """rq's maintenance (requeue abandoned jobs, clean registries), then enqueue due scheduled retries."""
        self._abandoned_ids: set[str] = set()
        super().run_maintenance_tasks()
        try:
            self.enqueue_due_scheduled_jobs(now=self._abandoned_ids)
        except Exception as err:  # noqa: BLE001 - retried at the next maintenance
            log.warning("worker %s: enqueueing scheduled jobs failed: %s", self.name, err)

    def enqueue_due_scheduled_jobs(self, now: set[str] | None = None) -> int:
        """Move the scheduled jobs (retries with an interval) whose time has come to their queue, and
        those in ``now`` at once (jobs of dead workers: waiting would not help them)."""
        from rq.job import Job
        from rq.utils import current_timestamp

        moved = 0
        for queue in self.queues:
            registry = queue.scheduled_job_registry
            ids = list(registry.get_jobs_to_schedule(current_timestamp()))
            ids += [i for i in (now or ()) if i not in ids and self.connection.zscore(registry.key, i) is not None]
            if not ids:
                continue
            jobs = Job.fetch_many(ids, connection=self.connection, serializer=self.serializer)
            with self.connection.pipeline() as pipe:
                for job_id, job in zip(ids, jobs):
                    if job is not None:
                        queue._enqueue_job(job, pipeline=pipe, at_front=job.should_enqueue_at_front())
                        moved += 1
                    registry.remove(job_id, pipeline=pipe)
                pipe.execute()
        if moved:
            log.info("worker %s: enqueued %d scheduled job(s)", self.name, moved)
        return moved

    def _on_abandoned(self, job: Any, exc_type: Any, exc_value: Any, traceback: Any) -> bool:
        """Exception handler of rq's maintenance: a job whose worker died (``AbandonedJobError``) gets its
        record moved with ``record_abandoned``; when that fails the job for good (its worker died
        ``JACOBIAN_JOB_MAX_WORKER_DEATHS`` times), rq's retry is called off. Other exceptions go on to the
        next handler."""
        from rq.exceptions import AbandonedJobError

        from worker.supervisor import exit_cause_of

        if exc_type is not AbandonedJobError and not isinstance(exc_value, AbandonedJobError):
            return True
        retries_left = bool(job.retries_left and job.retries_left > 0)
        getattr(self, "_abandoned_ids", set()).add(job.id)
        log.warning("worker %s: job %s was abandoned (its worker %s died); %s", self.name, job.id, job.worker_name,
                    "rq retries it" if retries_left else "no retries left")
        spec = job.args[0] if job.args and isinstance(job.args[0], dict) else {}
        settings = get_settings()
        try:
            store = JobStore(self.connection, ttl_s=settings.result_ttl_s)
            failed = record_abandoned(store, job.func_name, spec, retries_left=retries_left,
                                      how=death_cause(job.worker_name, exit_cause_of(self.connection, job.worker_name)),
                                      max_deaths=settings.job_max_worker_deaths)
        except Exception as err:  # noqa: BLE001 - rq's own bookkeeping of the job goes on
            log.warning("worker %s: could not record abandoned job %s: %s", self.name, job.id, err)
            return True
        if failed and retries_left:
            job.retries_left = 0  # read by rq's cleanup right after this handler: to the failed registry
        return True

    def execute_job(self, job: Any, queue: Any) -> None:
        """Run ``job`` in this process with a heartbeat thread beside it; every log line carries its id."""
        with job_context(job.id):
            execution = self.prepare_execution(job)
            stop = threading.Event()
            beat = start_thread_in_context(self._beat, job, execution, stop, name="rq-heartbeat")
            try:
                self.perform_job(job, queue, execution)
            finally:
                stop.set()
                beat.join(timeout=5)
        self.set_state(WorkerStatus.IDLE)

    def _beat(self, job: Any, execution: Any, stop: threading.Event) -> None:
        while not stop.wait(self.job_monitoring_interval):
            try:
                self.maintain_heartbeats(job, execution)
            except Exception as err:  # noqa: BLE001 - a missed beat is retried next interval
                log.warning("worker %s: heartbeat failed: %s", self.name, err)


def death_cause(worker_name: str | None, exit_cause: str | None = None) -> str:
    """How a worker that stopped heartbeating died, as far as another worker can tell: its supervisor's note
    (``worker.supervisor``: ``"SIGKILL (exit -9)"``), else unknown (an in-process worker killed by a signal
    leaves its exit status to its parent alone)."""
    if exit_cause:
        return f"worker {worker_name or '?'} killed: {exit_cause}"
    return f"worker {worker_name or '?'} vanished (signal unknown: it stopped heartbeating)"


def record_abandoned(store: JobStore, task: str | None, spec: dict[str, Any], *, retries_left: bool,
                     how: str = "signal unknown", max_deaths: int = 2) -> bool:
    """Move the record of a job whose rq job was abandoned (its worker died); True when the job is ``failed``.

    - ``run_job`` of the job itself while ``running``: the death (``how``) is counted on the record
      (``JobStore.record_death``); at the ``max_deaths``-th it is ``failed`` as ``WorkerDied`` naming every
      death and the likely fix, whatever rq retries are left (a job that kills its worker would kill the
      next one: the queue goes on without it);
    - ``run_job`` of the job itself or its ``finalize_job`` (sharded) with no retries left: ``failed`` as
      ``WorkerDied``, with the record's TTL, so that it never stays ``running``;
    - ``run_job`` of the job itself with a retry left: ``queued`` again (a transient ``WorkerDied``
      error), as rq has requeued it; the next attempt moves it to ``running``;
    - a shard: nothing (its finalizer fails the job, naming the shard); a finalizer with a retry left:
      nothing (it runs again).

    A job that already ended is left as it is (``JobStore.transition`` refuses the move). Raises
    ``JobNotFound`` when the record is gone (expired), ``redis.RedisError``.
    """
    job_id = spec.get("id")
    if task not in (RUN_JOB_TASK, FINALIZE_JOB_TASK) or spec.get("shard") is not None or not job_id:
        return False
    what = "this job's finalizer" if task == FINALIZE_JOB_TASK else "this job"
    deaths: list[str] = []
    if task == RUN_JOB_TASK and store.get(job_id).status == JobStatus.running:
        deaths = store.record_death(job_id, how)
    if len(deaths) >= max_deaths:
        message = (f"the worker running this job died {len(deaths)} times while running it "
                   f"({'; '.join(deaths)}); it is not run again. A job that kills its worker most often runs "
                   "out of host or accelerator memory (the OOM killer sends SIGKILL) or crashes native code "
                   "(SIGSEGV): set a lower memory_budget_bytes, send smaller inputs or split the job "
                   "(\"shards\"), then resubmit")
        return store.transition(job_id, JobStatus.failed, error=ErrorInfo(type="WorkerDied", message=message))
    died = f"the worker running {what} died ({deaths[-1] if deaths else 'its heartbeat expired'})"
    if not retries_left:
        message = f"{died} and no retries were left; resubmit the job"
        return store.transition(job_id, JobStatus.failed, error=ErrorInfo(type="WorkerDied", message=message))
    if task == RUN_JOB_TASK:
        message = (f"{died}; rq runs it again on another worker (it fails when its worker dies {max_deaths} "
                   "times)")
        store.transition(job_id, JobStatus.queued, error=ErrorInfo(type="WorkerDied", message=message, transient=True))
    return False


def preload_engine() -> None:
    """Import TensorFlow and the engine now, before the worker takes a job, so that its first job costs what the
    model costs (loading, traces) and not TensorFlow's import too (3 s of a 2-core VM's CPU; the service's first
    job of a model took as long as a whole ``jacobian compute`` process). GPUs get memory growth and TF32 off as
    ``load_model`` gives them (``prepare_gpus``; ``configure_devices`` has pinned the GPU), and what is imported is
    put out of the cyclic collector's reach (``host_peak.freeze_imports``). A failure is logged:
    the job that needs TensorFlow reports it."""
    import time

    t0 = time.perf_counter()
    try:
        from worker.engine.host_peak import freeze_imports

        freeze_imports("worker.execution.dense")   # the dense family's modules, imported by the first job else
        from worker.engine.devices import prepare_gpus

        prepare_gpus()
    except Exception as err:  # noqa: BLE001 - the first job says what is wrong, in its own error
        log.warning("TensorFlow could not be prepared before the first job: %s: %s", type(err).__name__, err)
        return
    log.info("TensorFlow and the engine ready in %.1f s", time.perf_counter() - t0)


def worker_name(settings: Settings) -> str:
    gpu = settings.gpu
    return f"{socket.gethostname()}.{os.getpid()}" + (f".gpu{gpu}" if gpu is not None else "")


def redis_connection(url: str) -> Redis:
    """A Redis client that rides out a Redis restart of a few seconds: every command is retried on
    connection errors and timeouts, 10 times with a backoff of 0.1 s doubling up to 2 s (about 13 s)."""
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.retry import Retry

    return Redis.from_url(url, retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), 10),
                          retry_on_error=[RedisConnectionError, RedisTimeoutError])


def run_worker(burst: bool = False) -> bool:
    """Work the ``settings.queue_name`` queue until stopped (or until empty with ``burst``).

    Returns whether any job was processed. When Redis goes away (or the worker loop ends for any
    reason but a stop request), a fresh worker is started after a backoff of 1 s doubling up to 30 s,
    so a restarted Redis is reconnected to; with ``burst``, ``redis.RedisError`` is raised instead.
    """
    import time

    import redis

    settings = get_settings()
    configure_logging("worker", fmt=settings.log_format, level=settings.log_level)
    configure_devices(settings)
    preload_engine()
    if settings.worker_metrics_port is not None:
        from worker.metrics import start_metrics_server

        start_metrics_server(settings.worker_metrics_port)
    connection = redis_connection(settings.redis_url)
    queue = Queue(settings.queue_name, connection=connection, serializer=JSONSerializer)
    worked, attempt, delay_s = False, 0, 1.0
    while True:
        name = worker_name(settings) + (f".r{attempt}" if attempt else "")
        worker = JacobianWorker([queue], connection=connection, name=name)
        log.info("worker %s on %s, queue %r, results %s", worker.name, settings.redis_url, settings.queue_name,
                 settings.results_url)
        started = time.monotonic()
        try:
            worked = worker.work(burst=burst, logging_level="INFO") or worked
            if burst or worker._stop_requested or worker._shutdown_requested_date is not None:
                return worked
            log.warning("worker %s: work loop ended unexpectedly; starting again in %.1f s", worker.name, delay_s)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
            if burst:
                raise
            log.warning("worker %s: Redis unreachable (%s); reconnecting in %.1f s", worker.name, err, delay_s)
        if time.monotonic() - started > 60:
            delay_s = 1.0  # it ran for a while: start the backoff over
        if _interruptible_sleep(delay_s):
            return worked
        delay_s = min(delay_s * 2, 30.0)
        attempt += 1


def _interruptible_sleep(seconds: float) -> bool:
    """Sleep, returning True early when SIGTERM or SIGINT arrives (the worker should stop)."""
    import signal

    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return stop.wait(seconds)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
        signal.signal(s, lambda *_: stop.set())
    try:
        return stop.wait(seconds)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
