"""Load: many jobs POSTed at once, then their status polled at a fixed rate, on this one machine.

The stack: a private redis-server (append-only, as in production), ``jacobian serve --workers A
--no-access-log`` and W ``jacobian worker`` processes, results on local disk. The jobs: the Jacobian
of a small Keras MLP 8-16-4 (``tests/models.mlp``) at a different random input each, so every job is
its own result.

1. Submit: ``--jobs`` POST /v1/jobs sent at once, each on its own connection, each with its own
   Idempotency-Key.
2. Poll: GET /v1/jobs/{id} over the job ids in turn at ``--rate`` requests/s for ``--duration-s``
   seconds: an open-loop schedule (request i is due at t0 + i/rate, whatever the answers before it
   took) over ``--connections`` keep-alive connections. A request that could not be sent on time is
   sent late, never dropped; the achieved rate and the lateness are reported.
3. Settle: poll until every job is terminal (``--settle-s`` at most).
4. Agree: the status counts as the API lists them (GET /v1/jobs?status=..., paged), as Redis holds
   them (job hashes, rq's registries, the queue), and as storage holds them (a manifest.json per
   succeeded job, naming that job, over all its rows) are the same, and every job is in each.

The client is plain asyncio over raw HTTP/1.1, lighter per request than a full client such as
httpx, so that the load generator takes as little as it can of the cores the service needs.

Goal (issue 5): no error, every job terminal, counts agree, at 200 jobs and 500 requests/s for 60 s.
Run: .venv/bin/python -m bench.bench_load [--jobs 200] [--rate 500] [--duration-s 60] [--out bench/results]
``--mode keys`` is the run of issue 29 (API keys with quotas, SSE followers, webhooks): see bench/load_keys.py.
``tests/integration/test_load.py`` runs the same at the same figures and asserts the checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tests.procs import Proc, base_env, free_port, jacobian_exe

TERMINAL = ("succeeded", "failed", "canceled")
STATUSES = ("queued", "running", "succeeded", "failed", "canceled")


# -- a lean HTTP/1.1 client ---------------------------------------------------------------------------


class HttpError(Exception):
    """A transport failure or a malformed answer (not an HTTP error status)."""


class Conn:
    """One keep-alive HTTP/1.1 connection; ``request`` reconnects when the server closed it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.last_headers: dict[str, str] = {}  # the last answer's headers, names lower-case

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        try:
            status_line = await self.reader.readline()
            if not status_line:
                raise HttpError(f"{method} {path}: connection closed before an answer")
            status = int(status_line.split()[1])
            length, close = None, False
            self.last_headers = {}
            while True:
                line = await self.reader.readline()
                if line in (b"\r\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                name = name.strip().lower()
                self.last_headers[name] = value.strip()
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and value.strip().lower() == "close":
                    close = True
                elif name == "transfer-encoding":
                    raise HttpError(f"{method} {path}: chunked answers are not expected here")
            if length is None:
                raise HttpError(f"{method} {path}: answer without Content-Length")
            payload = await self.reader.readexactly(length)
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as err:
            await self.close()
            raise HttpError(f"{method} {path}: {err!r}") from err
        if close:
            await self.close()
        return status, payload

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None


# -- the phases ------------------------------------------------------------------------------------


@dataclass
class Phase:
    """Answers of one phase: counts by outcome, latencies and lateness in seconds."""

    name: str
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)   # "200", "202", "error: ..."
    latencies: list[float] = field(default_factory=list)
    late: list[float] = field(default_factory=list)
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)      # the first few, in full

    def error(self, text: str) -> None:
        self.outcomes[f"error {text.split(':')[0][:60]}"] += 1
        if len(self.errors) < 10:
            self.errors.append(text[:500])

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(p: float) -> float | None:
            return round(1000 * lat[min(len(lat) - 1, int(p * len(lat)))], 2) if lat else None

        out = {"sent": self.sent, "answered": len(self.latencies), "outcomes": dict(self.outcomes),
               "seconds": round(self.seconds, 2),
               "rate_per_s": round(self.sent / self.seconds, 1) if self.seconds else None,
               "latency_ms": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": pct(1.0)}}
        if self.late:
            late = sorted(self.late)
            out["late_ms"] = {"p50": round(1000 * late[len(late) // 2], 2),
                              "p99": round(1000 * late[int(0.99 * len(late))], 2),
                              "max": round(1000 * late[-1], 2)}
        if self.errors:
            out["first_errors"] = self.errors
        return out


def job_body(seed: int) -> bytes:
    x = np.random.default_rng(seed).standard_normal((2, 8)).astype(np.float32)
    return json.dumps({"model": {"path": "mlp", "signature": "serving_default"},
                       "inputs": {"x": {"shape": [2, 8], "dtype": "float32", "data": x.ravel().tolist()}},
                       "kind": "jacobian"}).encode()


async def submit_all(host: str, port: int, n: int, headers: dict[str, str]) -> tuple[list[str], Phase]:
    """``n`` POSTs at once, each on its own connection; the ids of the jobs accepted."""
    phase = Phase("submit")
    ids: list[str | None] = [None] * n

    async def one(i: int) -> None:
        conn = Conn(host, port)
        t0 = time.perf_counter()
        phase.sent += 1
        try:
            status, payload = await conn.request("POST", "/v1/jobs", job_body(i), {
                **headers, "Content-Type": "application/json", "Idempotency-Key": f"load-{uuid.uuid4().hex}"})
        except HttpError as err:
            phase.error(str(err))
            return
        finally:
            await conn.close()
        phase.latencies.append(time.perf_counter() - t0)
        phase.outcomes[str(status)] += 1
        if status == 202:
            ids[i] = json.loads(payload)["id"]
        else:
            phase.error(f"POST /v1/jobs answered {status}: {payload[:300]!r}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    phase.seconds = time.perf_counter() - t0
    return [i for i in ids if i is not None], phase


async def open_loop(host: str, port: int, phase: Phase, *, rate: float, duration_s: float, connections: int,
                    target: Callable[[int], tuple[str, dict[str, str], Any]],
                    check: Callable[[Conn, Any, int, bytes], None]) -> None:
    """GETs on an open-loop schedule of ``rate`` per second for ``duration_s`` over ``connections`` keep-alive
    connections: the i-th goes to ``target(i)`` (path, headers, context), its answer to ``check(conn, context,
    status, payload)``; lateness, latencies, outcomes and the phase's seconds into ``phase``."""
    total = int(round(rate * duration_s))
    t0 = time.perf_counter() + 0.05

    async def lane(c: int) -> None:
        conn = Conn(host, port)
        try:
            for i in range(c, total, connections):
                due = t0 + i / rate
                wait = due - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                start = time.perf_counter()
                phase.late.append(max(0.0, start - due))
                path, headers, context = target(i)
                phase.sent += 1
                try:
                    status, payload = await conn.request("GET", path, headers=headers)
                except HttpError as err:
                    phase.error(str(err))
                    continue
                phase.latencies.append(time.perf_counter() - start)
                phase.outcomes[str(status)] += 1
                check(conn, context, status, payload)
        finally:
            await conn.close()

    await asyncio.gather(*(lane(c) for c in range(connections)))
    phase.seconds = time.perf_counter() - t0


async def poll(host: str, port: int, ids: list[str], *, rate: float, duration_s: float, connections: int,
               headers: dict[str, str]) -> tuple[Phase, dict[str, str]]:
    """GET /v1/jobs/{id} round-robin over ``ids`` on an open-loop schedule; the last status seen per id."""
    phase = Phase("poll")
    last: dict[str, str] = {}

    def target(i: int) -> tuple[str, dict[str, str], str]:
        job_id = ids[i % len(ids)]
        return f"/v1/jobs/{job_id}", headers, job_id

    def check(conn: Conn, job_id: str, status: int, payload: bytes) -> None:
        if status != 200:
            phase.error(f"GET /v1/jobs/{job_id} answered {status}: {payload[:300]!r}")
            return
        record = json.loads(payload)
        if record.get("id") != job_id or record.get("status") not in STATUSES:
            phase.error(f"GET /v1/jobs/{job_id}: unexpected body {payload[:300]!r}")
            return
        last[job_id] = record["status"]

    await open_loop(host, port, phase, rate=rate, duration_s=duration_s, connections=connections, target=target,
                    check=check)
    return phase, last


async def records_when_terminal(host: str, port: int, ids: list[str], *, timeout_s: float,
                                headers_for: Callable[[int], dict[str, str]],
                                on_answer: Callable[[Conn, int, bytes], Awaitable[None]] | None = None,
                                ) -> dict[str, dict[str, Any]]:
    """Poll (gently) until every job is terminal or ``timeout_s`` passed: each job's last record read (``{"status":
    "http <code>"}`` for an answer that is not 200). ``headers_for(n)``: the headers of the n-th poll of a round;
    ``on_answer(conn, code, payload)`` sees every answer."""
    conn = Conn(host, port)
    records: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        pending = list(ids)
        while pending:
            still = []
            for n, job_id in enumerate(pending):
                code, payload = await conn.request("GET", f"/v1/jobs/{job_id}", headers=headers_for(n))
                if on_answer is not None:
                    await on_answer(conn, code, payload)
                records[job_id] = json.loads(payload) if code == 200 else {"status": f"http {code}"}
                if records[job_id]["status"] not in TERMINAL:
                    still.append(job_id)
            pending = still
            if pending:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
    finally:
        await conn.close()
    return records


async def settle(host: str, port: int, ids: list[str], *, timeout_s: float, headers: dict[str, str]) -> dict[str, str]:
    """Poll (gently) until every job is terminal or ``timeout_s`` passed; the statuses then."""
    records = await records_when_terminal(host, port, ids, timeout_s=timeout_s, headers_for=lambda n: headers)
    return {job_id: record["status"] for job_id, record in records.items()}


# -- agreement -------------------------------------------------------------------------------------


def api_counts(host: str, port: int, headers: dict[str, str]) -> tuple[dict[str, int], set[str]]:
    """Jobs per status as GET /v1/jobs?status=S lists them, all pages; and every id listed."""
    import httpx

    counts, listed = {}, set()
    with httpx.Client(base_url=f"http://{host}:{port}", headers=headers, timeout=60.0) as client:
        for status in STATUSES:
            token, n = None, 0
            while True:
                params = {"status": status, "limit": 37, **({"page_token": token} if token else {})}
                page = client.get("/v1/jobs", params=params)
                page.raise_for_status()
                body = page.json()
                n += len(body["jobs"])
                listed |= {j["id"] for j in body["jobs"]}
                token = body["next_page_token"]
                if not token:
                    break
            counts[status] = n
    return counts, listed


def redis_counts(redis_url: str, queue_name: str) -> dict[str, Any]:
    """Job hashes per status, and rq's own view: queued, finished and failed registries."""
    from redis import Redis
    from rq import Queue
    from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry

    from contracts.jobstore import JobStore

    conn = Redis.from_url(redis_url)
    try:
        store = JobStore(conn)
        ids = [i.decode() for i in conn.zrange(store.index_key, 0, -1)]
        with conn.pipeline() as pipe:
            for job_id in ids:
                pipe.hmget(store.key(job_id), ["status", "created_at", "finished_at"])
            replies = pipe.execute()
        statuses = [s.decode() if s else "missing" for s, _, _ in replies]
        created = [float(c) for _, c, _ in replies if c]
        finished = [float(f) for _, _, f in replies if f]
        queue = Queue(queue_name, connection=conn)
        return {"index": len(ids), "by_status": dict(Counter(statuses)), "ids": set(ids),
                "first_created_to_last_finished_s": round(max(finished) - min(created), 2)
                if created and finished else None,
                "rq": {"queued": queue.count,
                       "started": StartedJobRegistry(queue=queue).count,
                       "finished": FinishedJobRegistry(queue=queue).count,
                       "failed": FailedJobRegistry(queue=queue).count}}
    finally:
        conn.close()


def storage_counts(results: Path) -> dict[str, Any]:
    """Manifests under the results folder: how many, whether each names its folder's job and covers
    all its rows, and the job folders without one."""
    manifests, bad, without = set(), [], []
    for job_dir in sorted(p for p in results.iterdir() if p.is_dir()):
        path = job_dir / "manifest.json"
        if not path.exists():
            without.append(job_dir.name)
            continue
        manifest = json.loads(path.read_text())
        if manifest.get("id") != job_dir.name or manifest.get("rows") != [0, manifest.get("rows_total")]:
            bad.append(job_dir.name)
        manifests.add(job_dir.name)
    return {"manifests": len(manifests), "ids": manifests, "bad": bad, "folders_without_manifest": without}


def agreement(ids: list[str], final: dict[str, str], api: tuple[dict[str, int], set[str]],
              redis: dict[str, Any], storage: dict[str, Any]) -> list[str]:
    """Every disagreement between the four views, as sentences (none: they agree)."""
    problems = []
    want = Counter(final[i] for i in ids)
    api_by, api_ids = api
    api_by = {k: v for k, v in api_by.items() if v}
    if api_by != dict(want):
        problems.append(f"API lists {api_by}, the jobs' own status says {dict(want)}")
    if api_ids != set(ids):
        problems.append(f"API lists {len(api_ids)} jobs, {len(ids)} were accepted")
    if redis["by_status"] != dict(want) or redis["ids"] != set(ids):
        problems.append(f"Redis holds {redis['index']} jobs {redis['by_status']}, want {dict(want)}")
    rq = redis["rq"]
    if rq["queued"] or rq["started"]:
        problems.append(f"rq still has work: {rq}")
    if rq["finished"] + rq["failed"] != len(ids):
        problems.append(f"rq registries hold {rq['finished']} finished + {rq['failed']} failed, want {len(ids)}")
    succeeded = {i for i in ids if final[i] == "succeeded"}
    if storage["ids"] != succeeded:
        problems.append(f"storage has {storage['manifests']} manifests, {len(succeeded)} jobs succeeded "
                        f"(extra {sorted(storage['ids'] - succeeded)[:5]}, "
                        f"missing {sorted(succeeded - storage['ids'])[:5]})")
    if storage["bad"]:
        problems.append(f"manifests not naming their job or not over all rows: {storage['bad'][:5]}")
    if storage["folders_without_manifest"]:
        problems.append(f"result folders without a manifest: {storage['folders_without_manifest'][:5]}")
    return problems


# -- the whole run ---------------------------------------------------------------------------------


class Stack:
    """redis-server, the API in ``api_workers`` processes and ``workers`` workers, on free ports; with ``notifier``
    the webhook notifier too; ``extra_env`` (JACOBIAN_* settings) goes to every service process."""

    def __init__(self, work: Path, *, api_workers: int, workers: int, notifier: bool = False,
                 extra_env: dict[str, str] | None = None) -> None:
        from tests import models

        redis_exe = shutil.which("redis-server")
        if redis_exe is None:
            raise SystemExit("redis-server is not installed: run scripts/setup.sh")
        self.work = work
        self.results = work / "results"
        self.results.mkdir()
        models_root = work / "models"
        models.mlp(models_root / "mlp")
        redis_port, self.port = free_port(), free_port()
        self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        self.queue_name = f"jacobian-load-{uuid.uuid4().hex[:8]}"
        env = base_env(JACOBIAN_REDIS_URL=self.redis_url, JACOBIAN_RESULTS_URL=str(self.results),
                       JACOBIAN_MODEL_ROOTS=str(models_root), JACOBIAN_QUEUE_NAME=self.queue_name,
                       **(extra_env or {}))
        (work / "metrics").mkdir()
        self.procs = [Proc("redis", [redis_exe, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "yes", "--dir", str(work)], env, work / "redis.log")]
        self.procs.append(Proc("api", jacobian_exe() + ["serve", "--port", str(self.port), "--workers",
                                                        str(api_workers), "--no-access-log"],
                               {**env, "PROMETHEUS_MULTIPROC_DIR": str(work / "metrics")}, work / "api.log"))
        self.procs += [Proc(f"worker-{i}", jacobian_exe() + ["worker"], env, work / f"worker-{i}.log")
                       for i in range(workers)]
        if notifier:
            self.procs.append(Proc("notifier", jacobian_exe() + ["notifier"], env, work / "notifier.log"))

    @property
    def api_pid(self) -> int:
        return next(p.proc.pid for p in self.procs if p.name == "api")

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"API not ready after {timeout_s:g} s\n{self.logs()}")

    def check_alive(self) -> None:
        dead = [p for p in self.procs if p.proc.poll() is not None]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited with {dead[0].proc.returncode}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(p.report() for p in self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def run_load(work: Path, *, jobs: int = 200, rate: float = 500.0, duration_s: float = 60.0, connections: int = 32,
             api_workers: int = 2, workers: int = 2, settle_s: float = 600.0) -> dict[str, Any]:
    """The whole run in ``work``; a summary with ``problems`` (empty when every check held)."""
    stack = Stack(work, api_workers=api_workers, workers=workers)
    headers: dict[str, str] = {}
    host = "127.0.0.1"
    try:
        stack.wait_ready()
        t_start = time.perf_counter()
        ids, submit = asyncio.run(submit_all(host, stack.port, jobs, headers))
        print(f"submit: {len(ids)}/{jobs} accepted in {submit.seconds:.2f} s", flush=True)
        polled, seen = asyncio.run(poll(host, stack.port, ids, rate=rate, duration_s=duration_s,
                                        connections=connections, headers=headers)) if ids else (Phase("poll"), {})
        during = Counter(seen.values())
        rate = polled.sent / max(polled.seconds, 1e-9)
        print(f"poll: {polled.sent} requests in {polled.seconds:.1f} s ({rate:.0f}/s), "
              f"outcomes {dict(polled.outcomes)}; last status seen {dict(during)}", flush=True)
        stack.check_alive()
        final = asyncio.run(settle(host, stack.port, ids, timeout_s=settle_s, headers=headers))
        all_terminal_s = time.perf_counter() - t_start
        final_counts = Counter(final.values())
        print(f"settled: {dict(final_counts)} {all_terminal_s:.1f} s after the first POST", flush=True)
        api = api_counts(host, stack.port, headers)
        redis = redis_counts(stack.redis_url, stack.queue_name)
        storage = storage_counts(stack.results)
        problems = []
        if len(ids) != jobs or submit.errors:
            problems.append(f"submit: {len(ids)}/{jobs} accepted; {submit.errors[:3]}")
        if polled.errors or polled.outcomes.get("200", 0) != polled.sent:
            problems.append(f"poll: {polled.sent} sent, outcomes {dict(polled.outcomes)}; {polled.errors[:3]}")
        not_terminal = [i for i in ids if final.get(i) not in TERMINAL]
        if not_terminal:
            problems.append(f"{len(not_terminal)} jobs not terminal after {settle_s:g} s: {not_terminal[:5]}")
        if final_counts.get("succeeded", 0) != len(ids):
            failed = [i for i in ids if final.get(i) != "succeeded"][:3]
            problems.append(f"not every job succeeded: {dict(final_counts)}, e.g. {failed}")
        problems += agreement(ids, final, api, redis, storage)
        return {
            "jobs": jobs, "accepted": len(ids), "rate_goal_per_s": rate, "duration_goal_s": duration_s,
            "connections": connections, "api_processes": api_workers, "workers": workers,
            "submit": submit.summary(), "poll": polled.summary(), "status_seen_at_end_of_polling": dict(during),
            "final": dict(final_counts), "all_terminal_after_s": round(all_terminal_s, 1),
            "first_created_to_last_finished_s": redis["first_created_to_last_finished_s"],
            "counts": {"api": api[0], "redis": redis["by_status"], "redis_index": redis["index"], "rq": redis["rq"],
                       "storage_manifests": storage["manifests"]},
            "problems": problems,
        }
    except BaseException:
        print(stack.logs(), file=sys.stderr)
        raise
    finally:
        stack.stop()


def main() -> None:
    from bench.common import machine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("plain", "keys"), default="plain",
                    help="plain: the run above; keys: API keys with quotas, SSE followers and webhooks "
                         "(bench/load_keys.py, issue 29), whose defaults are 1000 jobs, 20 keys, 300 s")
    ap.add_argument("--jobs", type=int, default=None, help="default 200 (plain), 1000 (keys)")
    ap.add_argument("--rate", type=float, default=500.0, help="status requests per second")
    ap.add_argument("--duration-s", "--duration", type=float, default=None, help="default 60 (plain), 300 (keys)")
    ap.add_argument("--connections", type=int, default=32, help="keep-alive connections for the polling")
    ap.add_argument("--api-workers", type=int, default=2, help="uvicorn processes")
    ap.add_argument("--workers", type=int, default=2, help="jacobian worker processes")
    keyed = ap.add_argument_group("--mode keys")
    keyed.add_argument("--keys", type=int, default=20, help="API keys, each with quotas and a webhook secret")
    keyed.add_argument("--followers", type=int, default=200, help="SSE followers at once")
    keyed.add_argument("--burst", type=int, default=8, help="jobs a key sends at once")
    keyed.add_argument("--max-queued", type=int, default=5, help="each key's quota of jobs waiting for a worker")
    keyed.add_argument("--requests-per-s", type=float, default=100.0, help="each key's request rate quota")
    keyed.add_argument("--hook-fail-rate", type=float, default=0.1,
                       help="share of deliveries whose first attempt the receiver answers 500")
    ap.add_argument("--out", default=None, help="folder for the JSON summary")
    args = ap.parse_args()
    if args.mode == "keys":
        keys_main(args, machine())
        return
    jobs = args.jobs or 200
    duration_s = args.duration_s or 60.0
    work = Path(tempfile.mkdtemp(prefix="bench-load-"))
    try:
        summary = run_load(work, jobs=jobs, rate=args.rate, duration_s=duration_s,
                           connections=args.connections, api_workers=args.api_workers, workers=args.workers)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary["machine"] = machine()
    poll_s = summary["poll"]
    print(f"\n== load: {summary['accepted']}/{summary['jobs']} jobs accepted; polling {poll_s['sent']} requests at "
          f"{poll_s['rate_per_s']}/s (goal {args.rate:g}/s) = {poll_s['rate_per_s'] / args.rate:.2f} of the goal, "
          f"p50 {poll_s['latency_ms']['p50']} ms, p99 {poll_s['latency_ms']['p99']} ms; final {summary['final']}, "
          f"the last job finished {summary['first_created_to_last_finished_s']} s after the first was created; "
          f"problems: {summary['problems'] or 'none'}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "load.json"), "w") as fh:
            json.dump(summary, fh, indent=2)
    print(json.dumps(summary))
    sys.exit(1 if summary["problems"] else 0)


def keys_main(args: argparse.Namespace, machine: dict[str, Any]) -> None:
    """``--mode keys``: ``bench.load_keys.run_keys`` with the arguments; PASS/FAIL per goal, JSON to
    ``--out``/load_keys.json; exit 1 when a goal failed."""
    from bench.load_keys import Plan, report, run_keys

    plan = Plan(jobs=args.jobs or 1000, keys=args.keys, followers=args.followers, rate=args.rate,
                duration_s=args.duration_s or 300.0, connections=args.connections, api_workers=args.api_workers,
                workers=args.workers, burst=args.burst, max_queued=args.max_queued,
                requests_per_s=args.requests_per_s, hook_fail_rate=args.hook_fail_rate)
    work = Path(tempfile.mkdtemp(prefix="bench-load-keys-"))
    try:
        summary = run_keys(work, plan)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary["machine"] = machine
    print("\n== load, keyed (issue 29)\n" + report(summary), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "load_keys.json"), "w") as fh:
            json.dump(summary, fh, indent=2)
    sys.exit(1 if summary["problems"] else 0)


if __name__ == "__main__":
    main()
