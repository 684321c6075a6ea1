"""Network faults (issue 29) with real network namespaces: partitions from Redis, slow lossy S3, the API cut off.

Each worker (and, in the last test, the API) runs in a network namespace of its own (``tests.netns``), joined
by a veth pair to the root namespace, where a private redis-server and moto's S3 server listen. A partition
is iptables DROP rules inside the namespace for the Redis port (silent drops: no RST, no ICMP; the veth end
goes down instead where iptables is unusable). Slow, lossy storage is ``tests.fault_proxy.FaultProxy``
(500 ms per request and answer, 5 % of chunks reset or stalled) between the worker and moto: a userspace
proxy because this machine's kernel has no ``sch_netem``; the ``tc netem delay 500ms loss 5%`` variant
runs where it exists and skips loudly here. Every finished job is compared bitwise with an undisturbed run.

Needs root (CAP_NET_ADMIN) and ``ip``; skips loudly, with the reason, where the kernel or permissions
forbid (``bash scripts/test.sh``, which runs them, then prints a warning). Figures are printed (``-s``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
import warnings
from pathlib import Path

import boto3
import httpx
import numpy as np
import pytest
from rq import Queue, Retry
from rq.job import Job
from rq.serializers import JSONSerializer

from contracts import storage
from contracts.jobspec import JobStatus
from contracts.jobstore import JobRecord, JobStore
from tests import models, netns
from tests.conftest import RedisServer
from tests.fault_proxy import FaultProxy
from tests.integration.shard_worker import DELAY_KEY
from tests.integration.test_faults import ROW_BYTES, SIZES, committed, result_bytes, submit
from tests.procs import free_port, stop_all

pytestmark = [pytest.mark.integration, pytest.mark.faults]

REPO = Path(__file__).resolve().parents[2]
QUEUE = "jacobian-netfaults"
ROWS_PER_BLOCK = 16
BLOCK_BYTES = ROWS_PER_BLOCK * ROW_BYTES  # 512 rows: 32 storage blocks
BLOCKS = 32
HEARTBEAT_S, MAINTENANCE_S = 1, 2  # a job's heartbeat expires after 3 s; idle workers clean up every 2 s
PARTITION_S = 30.0
S3_LATENCY_S, S3_FAULT_RATE = 0.5, 0.05


@pytest.fixture(scope="module")
def ns():
    reason = netns.unavailable_reason()
    if reason is not None:
        warnings.warn(f"network-fault tests skipped: {reason}", stacklevel=1)
        pytest.skip(f"network namespaces unavailable: {reason}")
    space = netns.Namespace()
    yield space
    space.close()


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("netfault-models")
    models.mlp(root / "mlp", sizes=SIZES)
    return root


class Cluster:
    """A redis-server listening on 127.0.0.1 and the veth address, and ``jacobian worker`` processes
    (``tests.integration.shard_worker``) started in the namespace or in the root namespace."""

    def __init__(self, tmp: Path, model_root: Path, ns: netns.Namespace) -> None:
        import redis

        (tmp / "redis").mkdir()
        self.ns, self.tmp, self.model_root = ns, tmp, model_root
        self.redis = RedisServer(tmp / "redis", appendonly=False, bind=f"127.0.0.1 {ns.host_ip}")
        self.conn = redis.Redis.from_url(self.redis.url)
        self.results = str(tmp / "results")
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def env(self, *, inside: bool, **extra: str) -> dict[str, str]:
        host = self.ns.host_ip if inside else "127.0.0.1"
        return {**os.environ, "JACOBIAN_REDIS_URL": f"redis://{host}:{self.redis.port}/0",
                "JACOBIAN_RESULTS_URL": self.results, "JACOBIAN_MODEL_ROOTS": str(self.model_root),
                "JACOBIAN_BLOCK_BYTES": str(BLOCK_BYTES), "JACOBIAN_QUEUE_NAME": QUEUE,
                "JACOBIAN_WORKER_HEARTBEAT_S": str(HEARTBEAT_S), "JACOBIAN_WORKER_MAINTENANCE_S": str(MAINTENANCE_S),
                "JACOBIAN_TRY_XLA": "0", "JACOBIAN_LOG_FORMAT": "text", "TF_CPP_MIN_LOG_LEVEL": "2",
                "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1", **extra}

    def start(self, argv: list[str], *, inside: bool, name: str, **extra: str) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(self.ns.exec_args(argv) if inside else argv, cwd=REPO,
                                    env=self.env(inside=inside, **extra), stdout=out, stderr=subprocess.STDOUT)
        self.procs.append((proc, log))
        return proc

    def start_worker(self, *, inside: bool, **extra: str) -> subprocess.Popen:
        proc = self.start([sys.executable, "-m", "tests.integration.shard_worker"], inside=inside,
                          name=f"worker{len(self.procs)}{'-ns' if inside else ''}", **extra)
        self.wait(lambda: self.registered(proc), timeout_s=120, what=f"worker {proc.pid} registered")
        return proc

    def registered(self, proc: subprocess.Popen) -> bool:
        from rq import worker_registration

        keys = worker_registration.get_keys(queue=Queue(QUEUE, connection=self.conn, serializer=JSONSerializer),
                                            connection=self.conn)
        return any(k.endswith(f".{proc.pid}") and self.conn.exists(k) for k in keys)

    def rq_job(self, job_id: str) -> Job:
        return Job.fetch(job_id, connection=self.conn, serializer=JSONSerializer)

    def held_by(self, job_id: str, proc: subprocess.Popen) -> bool:
        name = self.rq_job(job_id).worker_name or ""
        return name.endswith(f".{proc.pid}") or f".{proc.pid}." in name

    def submit(self, results_url: str | None = None, **kw) -> str:
        return submit(self.conn, results_url or self.results, self.model_root, queue_name=QUEUE, **kw)

    def store(self) -> JobStore:
        return JobStore(self.conn)

    def wait(self, cond, *, timeout_s: float = 90, what: str = "condition", poll_s: float = 0.05) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if cond():
                    return
            except Exception:  # noqa: BLE001 - not yet (e.g. no record yet)
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}\n{self.log_tail()}")
            time.sleep(poll_s)

    def wait_terminal(self, job_id: str, timeout_s: float = 180) -> JobRecord:
        self.wait(lambda: self.store().get(job_id).status.is_terminal, timeout_s=timeout_s, what=f"job {job_id}")
        return self.store().get(job_id)

    def log_tail(self) -> str:
        return "\n".join(f"--- {log.name} (rc {p.poll()})\n" + log.read_text(errors="replace")[-3000:]
                         for p, log in self.procs)

    def log_of(self, proc: subprocess.Popen) -> str:
        return next(log for p, log in self.procs if p is proc).read_text(errors="replace")

    def close(self) -> None:
        self.ns.heal()
        stop_all([p for p, _ in self.procs], timeout_s=20)
        self.conn.close()
        self.redis.stop()


@pytest.fixture
def cluster(tmp_path, model_root, ns):
    c = Cluster(tmp_path, model_root, ns)
    yield c
    c.close()


def started_count(log: str, job_id: str) -> int:
    return len(re.findall(rf"job {job_id} started", log))


# -- 1. a worker partitioned from Redis --------------------------------------------------------------


def test_worker_partitioned_from_redis_for_30s_then_healed_finishes_the_job_once(cluster, ns):
    """The worker's Redis commands hang in TCP retransmission for 30 s (its heartbeat expires, no other
    worker is there to take the job); once healed they complete and the same attempt finishes the job:
    no retry, no block written twice, none lost, the result bitwise equal to an undisturbed run."""
    worker = cluster.start_worker(inside=True)
    cluster.conn.set(DELAY_KEY, "0.2")
    job_id = cluster.submit(retry=Retry(max=2, interval=[1]))
    cluster.wait(lambda: len(committed(cluster.results, job_id)) >= 6, what="6 committed blocks")
    how = ns.partition(cluster.redis.port)
    at_cut = {n: os.stat(Path(cluster.results) / job_id / "committed" / n).st_mtime_ns
              for n in committed(cluster.results, job_id)}
    time.sleep(PARTITION_S)
    ns.heal()
    healed = time.monotonic()
    rec = cluster.wait_terminal(job_id)
    print(f"\n[netfaults] partition ({how}) {PARTITION_S:.0f} s at {len(at_cut)} of {BLOCKS} blocks: job "
          f"{rec.status.value} {time.monotonic() - healed:.1f} s after the heal")
    cluster.conn.delete(DELAY_KEY)
    assert rec.status == JobStatus.succeeded, (rec.error, cluster.log_tail())
    assert cluster.rq_job(job_id).retries_left == 2  # the attempt was never interrupted
    assert started_count(cluster.log_of(worker), job_id) == 1
    assert rec.progress.rows_done == rec.progress.rows_total == 512
    after = {n: os.stat(Path(cluster.results) / job_id / "committed" / n).st_mtime_ns
             for n in committed(cluster.results, job_id)}
    assert len(after) == BLOCKS and (Path(cluster.results) / job_id / "manifest.json").exists()
    assert all(after[n] == t for n, t in at_cut.items())  # blocks committed before the cut never rewritten
    ref = cluster.wait_terminal(cluster.submit())
    assert ref.status == JobStatus.succeeded, ref.error
    assert result_bytes(rec) == result_bytes(ref)
    assert worker.poll() is None, cluster.log_tail()


def test_job_of_a_worker_that_stays_partitioned_is_taken_over_and_its_return_changes_nothing(cluster, ns):
    """The worker in the namespace stays cut off from Redis: its job's heartbeat expires (3 x 1 s) and a
    worker in the root namespace takes the job over, resumes from the committed blocks and finishes it.
    When the partition heals, the cut-off worker's attempt finds the job ended and stops: the record, the
    manifest and the result stay as the other worker left them."""
    zombie = cluster.start_worker(inside=True)
    cluster.conn.set(DELAY_KEY, "0.2")
    job_id = cluster.submit(retry=Retry(max=2, interval=[1]))
    cluster.wait(lambda: len(committed(cluster.results, job_id)) >= 6 and cluster.held_by(job_id, zombie),
                 what="6 committed blocks")
    ns.partition(cluster.redis.port)
    cut = time.monotonic()
    other = cluster.start_worker(inside=False)
    cluster.wait(lambda: cluster.held_by(job_id, other), timeout_s=60, what="the job taken over")
    taken_s = time.monotonic() - cut
    cluster.conn.delete(DELAY_KEY)
    rec = cluster.wait_terminal(job_id)
    assert rec.status == JobStatus.succeeded, (rec.error, cluster.log_tail())
    assert cluster.rq_job(job_id).retries_left == 1
    assert len(committed(cluster.results, job_id)) == BLOCKS
    manifest = (Path(cluster.results) / job_id / "manifest.json").read_bytes()
    got = result_bytes(rec)
    print(f"\n[netfaults] worker cut off for good: job taken over {taken_s:.1f} s after the cut "
          f"(heartbeat {HEARTBEAT_S} s x 3 + maintenance {MAINTENANCE_S} s + a new worker's start)")
    ns.heal()
    healed = time.monotonic()
    cluster.wait(lambda: f"job {job_id} is already succeeded" in cluster.log_of(zombie), timeout_s=150,
                 what="the cut-off worker to come back and stop")
    print(f"[netfaults] the cut-off worker came back {time.monotonic() - healed:.1f} s after the heal and stopped")
    again = cluster.store().get(job_id)
    assert (again.status, again.finished_at, again.progress, again.result) == (
        rec.status, rec.finished_at, rec.progress, rec.result)
    assert (Path(cluster.results) / job_id / "manifest.json").read_bytes() == manifest
    assert result_bytes(again) == got
    ref = cluster.wait_terminal(cluster.submit())
    assert ref.status == JobStatus.succeeded, ref.error
    assert got == result_bytes(ref)


# -- 2. slow, lossy storage ---------------------------------------------------------------------------


@pytest.fixture
def bucket(s3_server, monkeypatch):
    """A fresh bucket; this process reads and writes S3 straight from moto."""
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_REGION", "us-east-1"), ("AWS_ENDPOINT_URL", s3_server.endpoint)):
        monkeypatch.setenv(name, value)
    name = f"netfaults-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


def scrape(port: int, host: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) ([0-9.e+-]+)$", text, re.M)}


def vm_kib(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1))


def run_slow_storage_job(cluster: Cluster, ns: netns.Namespace, bucket: str, endpoint: str, what: str) -> dict:
    """One job to ``s3://bucket`` through ``endpoint`` by a worker in the namespace: checks it succeeds, bitwise
    equal to an undisturbed local run by the same worker, within bounded memory; returns its metrics."""
    port = free_port()
    worker = cluster.start_worker(inside=True, AWS_ENDPOINT_URL=endpoint, JACOBIAN_WORKER_METRICS_PORT=str(port))
    ref = cluster.wait_terminal(cluster.submit())  # undisturbed, local storage (TF and the model warm)
    assert ref.status == JobStatus.succeeded, ref.error
    rss_before_kib = vm_kib(worker.pid, "VmRSS")
    results = f"s3://{bucket}/results"
    started = time.monotonic()
    job_id = cluster.submit(results_url=results, retry=Retry(max=2, interval=[1]))
    peak_kib = rss_before_kib
    while not cluster.store().get(job_id).status.is_terminal:
        peak_kib = max(peak_kib, vm_kib(worker.pid, "VmRSS"))
        assert time.monotonic() - started < 300, f"{what}: job not done after 300 s\n{cluster.log_tail()}"
        time.sleep(0.2)
    rec = cluster.store().get(job_id)
    seconds = time.monotonic() - started
    assert rec.status == JobStatus.succeeded, (rec.error, cluster.log_tail())
    assert len(committed(results, job_id)) == BLOCKS
    assert storage.exists(storage.join(results, job_id, "manifest.json"))
    assert result_bytes(rec, key="testing", secret="testing", endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                        client_kwargs={"region_name": "us-east-1"}) == result_bytes(ref)
    metrics = scrape(port, ns.ns_ip)
    growth_mib = (peak_kib - rss_before_kib) / 1024
    s3_retries = metrics['jacobian_storage_retries_total{source="s3_request"}']
    block_retries = metrics['jacobian_storage_retries_total{source="block_write"}']
    print(f"\n[netfaults] {what}: job {seconds:.1f} s, retries s3_request {s3_retries:.0f}, block_write "
          f"{block_retries:.0f}, rq retries "
          f"{2 - (cluster.rq_job(job_id).retries_left or 0)}; worker RSS {rss_before_kib / 1024:.0f} MiB before, "
          f"peak {peak_kib / 1024:.0f} MiB (+{growth_mib:.1f} MiB)")
    assert growth_mib < 128, f"{what}: the worker grew by {growth_mib:.1f} MiB during the job"
    return metrics


def test_s3_with_latency_and_faults_through_a_proxy_finishes_with_retries_counted(cluster, ns, s3_server, bucket):
    """netem is missing here: ``FaultProxy`` (500 ms per request and answer, 5 % of chunks reset or stalled)
    between the worker in the namespace and moto."""
    proxy = FaultProxy(("127.0.0.1", s3_server.port), listen_host=ns.host_ip, latency_s=S3_LATENCY_S,
                       fault_rate=S3_FAULT_RATE, stall_s=1.0, seed=29)
    try:
        metrics = run_slow_storage_job(cluster, ns, bucket, proxy.endpoint, "S3 via fault proxy")
    finally:
        proxy.close()
    injected = proxy.counters()
    print(f"[netfaults] fault proxy: {injected}")
    assert injected["resets"] > 0 and injected["stalls"] > 0
    retries = sum(v for k, v in metrics.items() if k.startswith("jacobian_storage_retries_total"))
    assert retries >= 1, "the resets the proxy injected must show in jacobian_storage_retries_total"


def test_s3_with_netem_delay_and_loss_finishes(cluster, ns, s3_server, bucket):
    """``tc netem delay 500ms loss 5%`` on the veth pair, where the kernel has netem (skips loudly elsewhere)."""
    reason = netns.netem_unavailable_reason()
    if reason is not None:
        warnings.warn(f"netem variant skipped: {reason}; the fault-proxy variant ran instead", stacklevel=1)
        pytest.skip(f"tc netem unavailable: {reason} (test_s3_with_latency_and_faults_through_a_proxy covers it)")
    forward = FaultProxy(("127.0.0.1", s3_server.port), listen_host=ns.host_ip)  # moto listens on 127.0.0.1
    ns.netem(delay_ms=int(S3_LATENCY_S * 1000), loss_pct=S3_FAULT_RATE * 100)
    try:
        run_slow_storage_job(cluster, ns, bucket, forward.endpoint, "S3 over netem")
    finally:
        forward.close()


# -- 3. the API partitioned from Redis -----------------------------------------------------------------


def test_api_partitioned_from_redis_answers_503_and_writes_nothing(cluster, ns, tmp_path):
    """The API (``jacobian serve``) in the namespace: while Redis is cut off, reads and submissions answer 503
    naming Redis, within the API's socket timeouts; nothing of a refused submission is left (no record, no
    queue entry, no inputs file), and after the heal the API answers again and a retried submission with
    the same Idempotency-Key is accepted once."""
    port = free_port()
    from tests.procs import jacobian_exe

    api = cluster.start(jacobian_exe() + ["serve", "--host", "0.0.0.0", "--port", str(port)], inside=True,
                        name="api")
    base = f"http://{ns.ns_ip}:{port}"
    cluster.wait(lambda: httpx.get(f"{base}/readyz", timeout=5).status_code == 200, timeout_s=60, what="API up")
    body = {"model": {"path": "mlp"}, "inputs": {"x": {"shape": [2, 8], "data": np.linspace(-1, 1, 16).tolist()}}}
    with httpx.Client(base_url=base, timeout=120) as http:
        first = http.post("/v1/jobs", json=body)
        assert first.status_code == 202, first.text
        job_id = first.json()["id"]
        ns.partition(cluster.redis.port)
        answers, seconds = {}, {}
        for name, call in (("get", lambda: http.get(f"/v1/jobs/{job_id}")),
                           ("post", lambda: http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "nf-1"})),
                           ("readyz", lambda: http.get("/readyz"))):
            t0 = time.monotonic()
            answers[name] = call()
            seconds[name] = time.monotonic() - t0
        ns.heal()
        print("\n[netfaults] API cut off from Redis: " + ", ".join(
            f"{n} {a.status_code} in {seconds[n]:.1f} s" for n, a in answers.items()))
        for name, answer in answers.items():
            assert answer.status_code == 503, (name, answer.status_code, answer.text)
        assert "redis" in answers["get"].json()["error"]["message"]
        assert "redis" in answers["post"].json()["error"]["message"]
        cluster.wait(lambda: http.get("/readyz").status_code == 200, timeout_s=60, what="API ready again")
        assert http.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
        assert [k for k in os.listdir(cluster.results) if not k.startswith(".")] == [job_id]  # no refused inputs
        store = cluster.store()
        assert [r.id for r in store.list()] == [job_id]
        assert Queue(QUEUE, connection=cluster.conn, serializer=JSONSerializer).job_ids == [job_id]
        again = http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "nf-1"})
        assert again.status_code == 202, again.text
        assert sorted(r.id for r in store.list()) == sorted([job_id, again.json()["id"]])
    api.send_signal(signal.SIGTERM)
