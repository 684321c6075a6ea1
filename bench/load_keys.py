"""Load with API keys, quotas, SSE followers and webhooks (issue 29): ``bench.bench_load --mode keys``.

The stack of ``bench/bench_load.py`` (a private redis-server, ``jacobian serve --workers A``, W workers) plus the
webhook notifier and a webhook receiver process (``bench/load_receiver.py``) on 127.0.0.1. ``--keys`` API keys
(``JACOBIAN_API_KEYS``), each with a webhook secret and quotas: ``max_queued`` jobs waiting for a worker and a
request rate (token bucket). For ``--duration-s``, all at once, on one asyncio loop:

- submitters: each key sends its share of ``--jobs`` (the MLP job of ``bench_load``, each with ``notify`` to the
  receiver) in bursts of ``--burst`` spread over the first ``--submit-share`` of the run; a burst larger than
  ``max_queued`` draws 429s, and a refused job is sent again (same Idempotency-Key) after its ``Retry-After``;
- ``--rate`` status polls per second (open loop, ``--connections`` keep-alive connections) over the jobs accepted
  so far, each with the next key;
- ``--followers`` SSE followers: each follows a job not known to have ended to its ``end`` event, then another;
  ``--drop-rate`` of the follows hang up after the first event and resume with ``Last-Event-ID``.

Then every job is polled until terminal and the receiver's record read until each job's terminal event is there.
Goals: no 5xx anywhere; every job accepted and terminal; every webhook delivered (each job's terminal event
accepted by the receiver under one delivery id, signature verified, and every delivery a job's status lists
received); every follow ended with ``end``, events in order across resumptions; the poll rate held; API, Redis
and storage agree. Reported: the API's peak RSS (its processes together), latencies, 429s, SSE events.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.bench_load import (
    TERMINAL,
    Conn,
    Stack,
    agreement,
    api_counts,
    records_when_terminal,
    redis_counts,
    storage_counts,
)
from bench.load_clients import Key, Shared, follower, poller, submitter, summary_of
from bench.load_receiver import read_calls
from tests.procs import REPO, Proc, base_env, free_port, wait_for


@dataclass
class Plan:
    """The run's figures (the defaults: issue 29's)."""

    jobs: int = 1000
    keys: int = 20
    followers: int = 200
    rate: float = 500.0
    duration_s: float = 300.0
    connections: int = 32
    api_workers: int = 2
    workers: int = 2
    burst: int = 8
    max_queued: int = 5
    requests_per_s: float = 100.0
    submit_share: float = 0.6
    drop_rate: float = 0.3
    hook_fail_rate: float = 0.1
    settle_s: float = 600.0


def make_keys(n: int) -> list[Key]:
    return [Key(token=f"load-{i:02d}-{secrets.token_hex(12)}", name=f"k{i:02d}",
                secret="whsec_" + base64.b64encode(os.urandom(32)).decode()) for i in range(n)]


def service_env(plan: Plan, keys: list[Key]) -> dict[str, str]:
    quotas = {"max_queued": plan.max_queued, "requests_per_s": plan.requests_per_s,
              "burst": int(2 * plan.requests_per_s)}
    return {"JACOBIAN_API_KEYS": json.dumps([{"key": k.token, "name": k.name, "webhook_secret": k.secret,
                                              "quotas": quotas} for k in keys]),
            "JACOBIAN_WEBHOOK_ALLOW": "127.0.0.1", "JACOBIAN_WEBHOOK_RETRY_BASE_S": "1",
            "JACOBIAN_WEBHOOK_RETRY_MAX_S": "5",
            # one process may get every stream (the kernel, not uvicorn, spreads connections): room for all
            "JACOBIAN_MAX_EVENT_STREAMS": str(max(100, plan.followers + 20))}


class RssSampler(threading.Thread):
    """The resident memory of a process and its descendants (the uvicorn master and its workers), every 0.5 s:
    the peak of their sum and each one's peak, in MiB."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.stop = pid, threading.Event()
        self.peak_total_mib = 0.0
        self.peak_each_mib: dict[int, float] = {}

    @staticmethod
    def _rss_mib(pid: int) -> float:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def _tree(self) -> list[int]:
        children = defaultdict(list)
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    stat = Path(f"/proc/{entry.name}/stat").read_text()
                except OSError:
                    continue
                children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry.name))
        tree, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo += children.get(pid, [])
        return tree

    def run(self) -> None:
        while not self.stop.is_set():
            sizes = {pid: self._rss_mib(pid) for pid in self._tree()}
            self.peak_total_mib = max(self.peak_total_mib, sum(sizes.values()))
            for pid, mib in sizes.items():
                self.peak_each_mib[pid] = max(self.peak_each_mib.get(pid, 0.0), mib)
            self.stop.wait(0.5)


async def clients(shared: Shared, plan: Plan) -> None:
    """Submitters, poller and followers together for the run's duration (submitters may go on longer)."""
    start = time.monotonic()
    until = start + plan.duration_s
    seeds = list(range(plan.jobs))
    per_key = [seeds[k::plan.keys] for k in range(plan.keys)]
    give_up_at = until + plan.settle_s
    tasks = [submitter(shared, k, per_key[k], burst=plan.burst, window_s=plan.submit_share * plan.duration_s,
                       give_up_at=give_up_at) for k in range(plan.keys)]
    tasks.append(poller(shared, rate=plan.rate, duration_s=plan.duration_s, connections=plan.connections))
    tasks += [follower(shared, f, until=until, drop_rate=plan.drop_rate) for f in range(plan.followers)]
    await asyncio.gather(*tasks)


async def settle(shared: Shared, *, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Each job's record once terminal (or the last one read when ``timeout_s`` ran out); each key in turn, so no
    key's request rate is exceeded (a 429 is counted and waited out)."""
    async def counted(conn: Conn, code: int, payload: bytes) -> None:
        shared.count_status("GET /v1/jobs/{id}", code, payload, conn.last_headers)
        if code == 429:
            await asyncio.sleep(1.0)

    return await records_when_terminal(shared.host, shared.port, list(shared.ids), timeout_s=timeout_s,
                                       headers_for=lambda n: shared.keys[n % len(shared.keys)].headers,
                                       on_answer=counted)


def webhook_check(ids: list[str], records: dict[str, dict[str, Any]], calls: list[dict[str, Any]]) -> dict[str, Any]:
    """What the receiver got against what each job's status says was sent."""
    accepted = [c for c in calls if c["status"] == 204]
    accepted_ids = Counter(c["id"] for c in accepted)
    by_job_event: dict[tuple[str, str], set[str]] = defaultdict(set)
    for c in accepted:
        by_job_event[(c["job"], str(c["type"]).removeprefix("job."))].add(c["id"])
    missing_terminal = [i for i in ids if not by_job_event.get((i, records.get(i, {}).get("status", "?")))]
    listed = [(i, event, d) for i in ids for event, d in ((records.get(i, {}).get("notify") or {}).get(
        "deliveries") or {}).items()]
    not_received = [(i, e, d["id"]) for i, e, d in listed if d["id"] not in accepted_ids]
    not_delivered = [(i, e, d["id"]) for i, e, d in listed if not d.get("delivered")]
    terminal_ids_twice = [(i, e) for (i, e), s in by_job_event.items() if e in TERMINAL and len(s) > 1]
    return {"calls": len(calls), "accepted": len(accepted),
            "answered_500_first": sum(c["status"] == 500 for c in calls),
            "unverified": sum(not c["verified"] for c in calls), "delivery_ids": len(accepted_ids),
            "duplicate_accepted": sum(n - 1 for n in accepted_ids.values()),
            "by_event": dict(Counter(e for (_, e) in by_job_event)),
            "jobs_without_terminal_delivery": missing_terminal, "listed_in_status": len(listed),
            "listed_not_received": not_received, "listed_not_delivered": not_delivered,
            "terminal_event_under_two_ids": terminal_ids_twice}


def goals(plan: Plan, s: dict[str, Any]) -> dict[str, tuple[bool, str]]:
    """Each goal: (met, the figures)."""
    hooks, sse, poll = s["webhooks"], s["sse"], s["poll"]
    rate_share = (poll["rate_per_s"] or 0) / plan.rate
    return {
        "no 5xx": (not s["http_5xx"], f"5xx: {s['http_5xx'] or 0}"),
        "every job accepted and terminal": (
            s["accepted"] == plan.jobs and sum(s["final"].get(t, 0) for t in TERMINAL) == plan.jobs,
            f"{s['accepted']}/{plan.jobs} accepted, final {s['final']}"),
        "every webhook delivered": (
            not (hooks["jobs_without_terminal_delivery"] or hooks["listed_not_received"] or hooks["unverified"]
                 or hooks["listed_not_delivered"] or hooks["terminal_event_under_two_ids"]),
            f"{hooks['delivery_ids']} delivery ids accepted for {s['accepted']} jobs ({hooks['by_event']}), "
            f"{len(hooks['jobs_without_terminal_delivery'])} jobs without their terminal event, "
            f"{len(hooks['listed_not_received'])} listed in a status but not received, {hooks['unverified']} "
            f"unverified, {hooks['duplicate_accepted']} duplicates"),
        "SSE followers": (
            not sse.get("problems") and s["sse_follows_open_peak"] >= min(plan.followers, plan.jobs)
            and sse.get("ends", 0) == sse.get("follows", 0),
            f"{sse.get('follows', 0)} follows, {sse.get('ends', 0)} ended with 'end', {sse.get('events', 0)} events, "
            f"{sse.get('resumed', 0)} resumed with Last-Event-ID, peak {s['sse_follows_open_peak']} open, "
            f"{sse.get('problems', 0)} problems"),
        "status polls at the rate": (rate_share >= 0.95 and not poll.get("first_errors"),
                                     f"{poll['sent']} polls at {poll['rate_per_s']}/s ({rate_share:.2f} of the "
                                     f"goal), p50 {poll['latency_ms']['p50']} ms, p99 {poll['latency_ms']['p99']} ms"),
        "API, Redis and storage agree": (not s["agreement_problems"], "; ".join(s["agreement_problems"]) or "agree"),
    }


def run_keys(work: Path, plan: Plan) -> dict[str, Any]:
    """The whole run in ``work``; the summary, with ``goals`` and ``problems`` (empty when every goal held)."""
    keys = make_keys(plan.keys)
    hook_port = free_port()
    (work / "secrets.json").write_text(json.dumps({k.name: k.secret for k in keys}))
    receiver = Proc("receiver", [sys.executable, "-m", "bench.load_receiver", "--port", str(hook_port), "--secrets",
                                 str(work / "secrets.json"), "--out", str(work / "calls.jsonl"), "--fail-rate",
                                 str(plan.hook_fail_rate)], base_env(PYTHONPATH=str(REPO)), work / "receiver.log")
    stack = Stack(work, api_workers=plan.api_workers, workers=plan.workers, notifier=True,
                  extra_env=service_env(plan, keys))
    shared = Shared("127.0.0.1", stack.port, keys, f"http://127.0.0.1:{hook_port}/hooks")
    rss = RssSampler(stack.api_pid)
    try:
        stack.wait_ready()
        wait_for(lambda: "receiver on" in receiver.tail(), 30, "the webhook receiver", report=receiver.report)
        rss.start()
        t_start = time.perf_counter()
        asyncio.run(clients(shared, plan))
        print(f"clients done after {time.perf_counter() - t_start:.1f} s: {len(shared.ids)} accepted", flush=True)
        stack.check_alive()
        records = asyncio.run(settle(shared, timeout_s=plan.settle_s))
        terminal_s = time.perf_counter() - t_start
        deadline = time.monotonic() + plan.settle_s
        while True:  # the last deliveries (and their retries) after the last job ended
            hooks = webhook_check(shared.ids, records, read_calls(work / "calls.jsonl"))
            if not hooks["jobs_without_terminal_delivery"] or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        records = asyncio.run(settle(shared, timeout_s=5))  # the statuses' delivery blocks, now recorded
        hooks = webhook_check(shared.ids, records, read_calls(work / "calls.jsonl"))
        rss.stop.set()
        final = {i: r["status"] for i, r in records.items()}
        api = api_counts("127.0.0.1", stack.port, keys[0].headers)
        redis = redis_counts(stack.redis_url, stack.queue_name)
        storage = storage_counts(stack.results)
        api_log = (work / "api.log").read_text(errors="replace")
        summary = {"plan": asdict(plan), **summary_of(shared), "accepted": len(shared.ids),
                   "final": dict(Counter(final.values())), "all_terminal_after_s": round(terminal_s, 1),
                   "webhooks": {k: (v[:5] if isinstance(v, list) else v) for k, v in hooks.items()},
                   "api_peak_rss_mib": round(rss.peak_total_mib, 1),
                   "api_peak_rss_each_mib": sorted(round(v, 1) for v in rss.peak_each_mib.values()),
                   "api_log_tracebacks": api_log.count("Traceback"),
                   "agreement_problems": agreement(shared.ids, final, api, redis, storage),
                   "counts": {"api": api[0], "redis": redis["by_status"], "rq": redis["rq"],
                              "storage_manifests": storage["manifests"]},
                   "load_average": os.getloadavg()}
        met = goals(plan, summary)
        summary["goals"] = {name: {"met": ok, "figures": text} for name, (ok, text) in met.items()}
        summary["problems"] = [f"{name}: {text}" for name, (ok, text) in met.items() if not ok]
        return summary
    except BaseException:
        print(stack.logs(), receiver.report(), sep="\n", file=sys.stderr)
        raise
    finally:
        rss.stop.set()
        stack.stop()
        receiver.stop()


def report(summary: dict[str, Any]) -> str:
    lines = [f"{'PASS' if g['met'] else 'FAIL'}  {name}: {g['figures']}" for name, g in summary["goals"].items()]
    sub, poll = summary["submit"], summary["poll"]
    lines.append(f"submits: {sub['sent']} POSTs ({sub['outcomes']}), p50 {sub['latency_ms']['p50']} ms, p99 "
                 f"{sub['latency_ms']['p99']} ms; 429s {summary['http_429']}; jobs accepted after a 429: "
                 f"{summary['jobs_accepted_after_a_429']}")
    lines.append(f"polls: p50 {poll['latency_ms']['p50']} ms, p99 {poll['latency_ms']['p99']} ms, max "
                 f"{poll['latency_ms']['max']} ms; lateness {poll.get('late_ms')}")
    lines.append(f"API peak RSS {summary['api_peak_rss_mib']} MiB (processes: {summary['api_peak_rss_each_mib']}); "
                 f"all terminal {summary['all_terminal_after_s']} s after the start; load average "
                 f"{[round(x, 2) for x in summary['load_average']]}")
    return "\n".join(lines)
