"""One Jacobian across two workers (row shards, issue 6) against one worker, on the same job.

Workers are ``JacobianWorker`` subprocesses on a private ``redis-server``, results on local disk,
each limited to one CPU thread (``taskset -c i`` and ``TF_NUM_INTRAOP_THREADS=1``,
``TF_NUM_INTEROP_THREADS=1``) and to ``--memory-budget`` bytes per chunk plan (2 GiB; the machine
is shared). TensorFlow is imported before a worker registers, as in a long-running worker; the
model load and the strategy trial are part of the first (cold) job.

The job: the per-example (batch) Jacobian of a Keras MLP 256-2048-2048-2048-512 (``tests/models.mlp``),
result ``(batch, 512, 256)``; mode ``auto`` resolves to forward (256 input features < 512 outputs),
so 256 rows (JVPs) of ``(batch, 512)``, in 32 storage blocks of 8 rows; the batch is sized so that a warm
worker needs about ``--target-s`` seconds (calibrated at start: the whole job at batch 16, warm, on
one thread; or ``--batch N``). Each job leaves ``shards`` null: the automatic rule picks 1 with one
live worker and 2 with two. Both configurations use the same chunk strategy (``--strategy``,
``vectorized`` by default, set in the queued spec as a planner pins it for its shards), so that the
comparison is about the split, not about two timed trials that a busy machine can make disagree.

Per configuration (1 worker, then 2 workers): start the workers, submit the job once cold (the
workers have never seen the model) and ``--warm-runs`` times warm (model, trial and compiled
functions cached), stop the workers. Times are from enqueue to ``succeeded`` seen by polling every
0.05 s; the ratio is taken on the median warm times, and on the best ones (another process can
only slow a run down), and on the cold ones for information.
Each run also shows ``cpu_share``, the CPU time the workers got over ``workers x wall time`` (below
about 0.95 the workers were waiting for a core another process held), and when each rq job ran
(planner, shards, finalizer: seconds from the planner's start, @ the worker's CPU).

Goal: time(1 worker) / time(2 workers) >= 1.7 (warm).
Run: .venv/bin/python -m bench.bench_shards [--target-s 35 | --batch N] [--warm-runs 2] [--repeats 1]
     [--strategy vectorized|tiled|...|auto] [--memory-budget BYTES] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import emit, machine
from tests.procs import free_port, stop_all

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = Path(__file__).resolve().parents[1]
SIZES = (256, 2048, 2048, 2048, 512)
KIND = "batch_jacobian"
ROWS = SIZES[0]             # forward mode: a row per input feature
BLOCK_ROWS = 8              # 32 storage blocks
CALIBRATION_BATCH = 16
POLL_S = 0.05
QUEUE = "jacobian-bench-shards"
WORKER_CODE = ("import tensorflow, sys; from redis import Redis; from rq import Queue; "
               "from rq.serializers import JSONSerializer; from worker.main import JacobianWorker, configure_devices; "
               "from contracts.logs import configure_logging; from contracts.settings import get_settings; "
               "s = get_settings(); configure_logging('worker', fmt=s.log_format, level=s.log_level); "
               "configure_devices(s); c = Redis.from_url(s.redis_url); "
               "JacobianWorker([Queue(s.queue_name, connection=c, serializer=JSONSerializer)], connection=c, "
               "name=sys.argv[1]).work(logging_level='WARNING')")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_thread_env() -> dict[str, str]:
    return {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "OMP_NUM_THREADS": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2"}


def calibrate_batch(model_path: str, target_s: float, budget: int) -> tuple[int, float]:
    """A batch whose whole job takes about ``target_s`` on one warm thread, from the whole job at
    batch 16 (this process, pinned to CPU 0, one TensorFlow thread); and that job's seconds."""
    os.sched_setaffinity(0, {0})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from worker.engine import RunOptions, build_problem, load_model, run_problem

    batch0 = CALIBRATION_BATCH
    model = load_model(model_path)
    x = np.random.default_rng(0).standard_normal((batch0, SIZES[0])).astype("float32")
    problem = build_problem(model, {"x": x}, kind=KIND)
    run_problem(problem, options=RunOptions(memory_budget_bytes=budget))  # trial, compile
    t0 = time.perf_counter()
    run_problem(problem, options=RunOptions(memory_budget_bytes=budget))
    seconds = time.perf_counter() - t0
    return max(1, int(round(target_s / seconds * batch0))), seconds


class Stack:
    """A private redis-server; workers come and go per configuration."""

    def __init__(self, tmp: Path, model_root: Path, row_bytes: int, budget: int) -> None:
        self.tmp = tmp
        self.port = free_port()
        exe = shutil.which("redis-server")
        if exe is None:
            sys.exit("redis-server is not installed: run scripts/setup.sh")
        self.redis = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(tmp)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.results = tmp / "results"
        self.env = {**os.environ, **one_thread_env(), "JACOBIAN_REDIS_URL": f"redis://127.0.0.1:{self.port}/0",
                    "JACOBIAN_RESULTS_URL": str(self.results), "JACOBIAN_MODEL_ROOTS": str(model_root),
                    "JACOBIAN_QUEUE_NAME": QUEUE, "JACOBIAN_BLOCK_BYTES": str(BLOCK_ROWS * row_bytes),
                    "JACOBIAN_MEMORY_BUDGET_BYTES": str(budget), "JACOBIAN_LOG_FORMAT": "text",
                    "JACOBIAN_LOG_LEVEL": "WARNING", "PYTHONPATH": str(REPO)}
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("JACOBIAN_")})
        from contracts.settings import get_settings

        get_settings.cache_clear()
        import redis

        self.conn = redis.Redis.from_url(self.env["JACOBIAN_REDIS_URL"])
        deadline = time.monotonic() + 20
        while True:
            try:
                self.conn.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.workers: list[subprocess.Popen] = []

    def start_workers(self, n: int) -> None:
        from rq import Queue
        from rq.serializers import JSONSerializer

        from worker.sharding import live_workers

        for i in range(n):
            log = open(self.tmp / f"worker-{len(self.workers)}.log", "wb")
            cmd = ["taskset", "-c", str(i % (os.cpu_count() or 1)), sys.executable, "-c", WORKER_CODE,
                   f"bench-{uuid.uuid4().hex[:6]}-cpu{i}"]
            self.workers.append(subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT))
        queue = Queue(QUEUE, connection=self.conn, serializer=JSONSerializer)
        deadline = time.monotonic() + 180
        while live_workers(self.conn, queue) < n:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.workers):
                sys.exit(f"workers did not start; see {self.tmp}/worker-*.log")
            time.sleep(0.1)

    def stop_workers(self) -> None:
        stop_all(self.workers, timeout_s=60)
        self.workers = []  # a worker stopped by SIGTERM unregisters itself

    def run_job(self, model_path: str, x: np.ndarray, strategy: str | None) -> tuple[float, dict[str, Any]]:
        """Enqueue the job as the API does; seconds until it has succeeded, and its record."""
        from rq import Queue
        from rq.serializers import JSONSerializer

        from app.routes.jobs import enqueue
        from contracts.jobspec import JobStatus, ModelRef, QueuedJob
        from contracts.jobstore import JobStore
        from contracts.records import dump
        from contracts.settings import get_settings

        settings = get_settings()
        store = JobStore(self.conn, ttl_s=settings.result_ttl_s)
        queued = QueuedJob(id="", model=ModelRef(path=model_path), inputs_uri="", results_url=str(self.results),
                           kind=KIND, of="y", wrt="x", strategy=strategy)
        job_id = uuid.uuid4().hex
        cpu0 = [cpu_seconds(p.pid) for p in self.workers]
        t0 = time.perf_counter()
        enqueue(job_id, queued, {"x": x}, settings=settings, store=store,
                queue=Queue(QUEUE, connection=self.conn, serializer=JSONSerializer))
        while True:
            rec = store.get(job_id)
            if rec.status.is_terminal:
                break
            dead = [p.args[-1] for p in self.workers if p.poll() is not None]
            if dead:
                sys.exit(f"worker {dead} exited with {[p.returncode for p in self.workers]} during job {job_id}; "
                         f"see {self.tmp}/worker-*.log (out of memory? lower --memory-budget)")
            time.sleep(POLL_S)
        seconds = time.perf_counter() - t0
        cpu = sum(cpu_seconds(p.pid) - c for p, c in zip(self.workers, cpu0))
        if rec.status != JobStatus.succeeded:
            sys.exit(f"job {job_id} {rec.status.value}: {rec.error}; logs in {self.tmp}")
        return seconds, {"id": job_id, "plan": dump(rec.plan), "uri": rec.result.uri if rec.result else None,
                         "compute_s": (rec.finished_at or 0) - (rec.started_at or 0),
                         "cpu_share": cpu / (seconds * len(self.workers)), "parts": self.parts(job_id)}

    def parts(self, job_id: str) -> str:
        """When each rq job of the job ran, in seconds from the planner's start: ``planner 0-1.2 s0 ...``."""
        from rq.job import Job
        from rq.serializers import JSONSerializer

        from contracts.jobspec import finalizer_job_id, shard_job_id

        out, t0 = [], None
        names = [("planner", job_id)] + [(f"s{i}", shard_job_id(job_id, i)) for i in range(64)] + [
            ("final", finalizer_job_id(job_id))]
        for name, rq_id in names:
            if not Job.exists(rq_id, connection=self.conn):
                continue
            job = Job.fetch(rq_id, connection=self.conn, serializer=JSONSerializer)
            if job.started_at is None or job.ended_at is None:
                continue
            t0 = t0 or job.started_at
            out.append(f"{name}:{(job.started_at - t0).total_seconds():.1f}-{(job.ended_at - t0).total_seconds():.1f}"
                       f"@{(job.worker_name or '?').rsplit('-', 1)[-1]}")
        return " ".join(out)

    def close(self) -> None:
        if self.workers:
            self.stop_workers()
        self.redis.terminate()
        self.redis.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-s", type=float, default=35.0, help="one warm worker's time to size the job for")
    ap.add_argument("--warm-runs", type=int, default=2, help="warm jobs per configuration")
    ap.add_argument("--batch", type=int, default=None, help="skip calibration and use this batch")
    ap.add_argument("--strategy", default="vectorized",
                    help="chunk strategy of both configurations ('auto': each job's timed trial picks, which "
                         "on a busy machine may pick differently for the two)")
    ap.add_argument("--memory-budget", type=int, default=2 << 30,
                    help="JACOBIAN_MEMORY_BUDGET_BYTES of each worker (the machine is shared)")
    ap.add_argument("--repeats", type=int, default=1, help="times the whole comparison is run")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, results)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tests import models

    tmp = Path(tempfile.mkdtemp(prefix="bench-shards-"))
    model_root = tmp / "models"
    model_path = str(models.mlp(model_root / "mlp", sizes=SIZES))
    if args.batch:
        batch, est_s = args.batch, float("nan")
    else:
        # in a child process: this one must not pin itself or start TensorFlow's thread pools
        out = subprocess.run([sys.executable, "-c", f"from bench.bench_shards import calibrate_batch; "
                              f"print(*calibrate_batch({model_path!r}, {args.target_s}, {args.memory_budget}))"],
                             cwd=REPO, env={**os.environ, **one_thread_env(), "PYTHONPATH": str(REPO)},
                             capture_output=True, text=True, check=True)
        batch_s, est = out.stdout.split()[-2:]
        batch, est_s = int(batch_s), float(est) * int(batch_s) / CALIBRATION_BATCH
    x = np.random.default_rng(0).standard_normal((batch, SIZES[0])).astype("float32")
    row_bytes = batch * SIZES[-1] * 4  # one row: d y / d x[:, j], shape (batch, 512)
    print(f"job: {KIND} of MLP {'-'.join(map(str, SIZES))}, batch {batch}: {ROWS} rows of {row_bytes} bytes, "
          f"{ROWS // BLOCK_ROWS} storage blocks" + ("" if args.batch else f"; estimated {est_s:.1f} s on one thread"),
          flush=True)

    strategy = None if args.strategy == "auto" else args.strategy
    stack = Stack(tmp, model_root, row_bytes, args.memory_budget)
    rows: list[dict[str, Any]] = []
    try:
        for rep in range(args.repeats):
            times: dict[tuple[int, str], list[float]] = {}
            uris: dict[int, str] = {}
            for workers in (1, 2):
                stack.start_workers(workers)
                for run in ["cold"] + ["warm"] * args.warm_runs:
                    seconds, info = stack.run_job(model_path, x, strategy)
                    times.setdefault((workers, run), []).append(seconds)
                    uris[workers] = info["uri"]
                    row = {"repeat": rep + 1, "workers": workers, "run": run, "shards": info["plan"].get("shards"),
                           "mode": info["plan"].get("mode"), "strategy": info["plan"].get("strategy"),
                           "seconds": round(seconds, 2),
                           "cpu_share": round(info["cpu_share"], 2), "rq_jobs": info["parts"]}
                    print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                    rows.append(row)
                stack.stop_workers()
            import zarr

            one, two = (zarr.open_array(uris[w], mode="r")[:] for w in (1, 2))
            same = bool(np.array_equal(one, two))
            close = bool(np.allclose(one, two, rtol=1e-5, atol=1e-6))
            for run in ("cold", "warm"):
                if (1, run) not in times:
                    continue
                rows.append({"repeat": rep + 1, "ratio": f"1 worker / 2 workers ({run}, median)",
                             "value": round(statistics.median(times[(1, run)])
                                            / statistics.median(times[(2, run)]), 3),
                             "goal": ">= 1.7" if run == "warm" else "-"})
                if len(times[(1, run)]) > 1:  # other processes only ever slow a run down: best of N too
                    rows.append({"repeat": rep + 1, "ratio": f"1 worker / 2 workers ({run}, best)",
                                 "value": round(min(times[(1, run)]) / min(times[(2, run)]), 3)})
            rows.append({"repeat": rep + 1, "results_equal_bitwise": same, "results_allclose": close})
    finally:
        stack.close()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(machine())
    emit("shards_two_workers_vs_one", rows, args.out)


if __name__ == "__main__":
    main()
