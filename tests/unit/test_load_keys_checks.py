"""The keyed load run's own parts (bench/load_clients.py, bench/load_keys.py, bench/load_receiver.py), without a
stack: the burst schedule, the SSE reader over a chunked body, the webhook accounting and the goals."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time

from bench.load_clients import Stream, burst_times, event_order, parse_event
from bench.load_keys import Plan, goals, webhook_check
from bench.load_receiver import Recorder, fails_first
from contracts.webhooks import signed_headers


def test_bursts_cover_every_job_once_within_the_window():
    times = burst_times(23, 5, 60.0, offset=0.5)
    assert [list(g) for _, g in times] == [list(range(i, min(23, i + 5))) for i in range(0, 23, 5)]
    assert [t for t, _ in times] == [6.0, 18.0, 30.0, 42.0, 54.0]


def chunked(*parts: str) -> bytes:
    return b"".join(f"{len(p.encode()):x}\r\n".encode() + p.encode() + b"\r\n" for p in parts) + b"0\r\n\r\n"


def test_the_sse_reader_splits_messages_across_chunks_and_skips_comments():
    async def read() -> list[dict[str, str]]:
        reader = asyncio.StreamReader()
        reader.feed_data(chunked("retry: 2000\n\n", "id: 1.0.0\nevent: status\ndata: {\"a\"", ":1}\n\n: keep-alive\n\n",
                                 "id: 1.2.4\nevent: end\ndata: {}\n\n"))
        reader.feed_eof()
        return [e async for e in Stream(reader).messages()]

    events = asyncio.run(read())
    assert events == [{"id": "1.0.0", "event": "status", "data": '{"a":1}'},
                      {"id": "1.2.4", "event": "end", "data": "{}"}]
    assert parse_event(": keep-alive") is None
    assert event_order("1795.1.10") > event_order("1795.1.9") > event_order("1795.0.99")


def call(delivery_id: str, job: str, type_: str, status: int = 204, verified: bool = True) -> dict:
    return {"id": delivery_id, "job": job, "type": f"job.{type_}", "status": status, "verified": verified}


def test_webhook_accounting_finds_missing_twice_emitted_and_unreceived_deliveries():
    records = {"a": {"status": "succeeded", "notify": {"deliveries": {"succeeded": {"id": "d1", "delivered": True}}}},
               "b": {"status": "failed", "notify": {"deliveries": {"failed": {"id": "d9", "delivered": False}}}},
               "c": {"status": "succeeded"}}
    calls = [call("d1", "a", "succeeded", 500), call("d1", "a", "succeeded"), call("d1", "a", "succeeded"),
             call("d2", "c", "succeeded"), call("d3", "c", "succeeded", verified=False)]
    hooks = webhook_check(["a", "b", "c"], records, calls)
    assert hooks["jobs_without_terminal_delivery"] == ["b"]
    assert hooks["duplicate_accepted"] == 1 and hooks["answered_500_first"] == 1 and hooks["unverified"] == 1
    assert hooks["listed_not_received"] == [("b", "failed", "d9")]
    assert hooks["listed_not_delivered"] == [("b", "failed", "d9")]
    assert hooks["terminal_event_under_two_ids"] == [("c", "succeeded")]


def summary(**over) -> dict:
    base = {"http_5xx": {}, "accepted": 10, "final": {"succeeded": 10}, "agreement_problems": [],
            "webhooks": {"jobs_without_terminal_delivery": [], "listed_not_received": [], "unverified": 0,
                         "listed_not_delivered": [], "terminal_event_under_two_ids": [], "delivery_ids": 10,
                         "by_event": {"succeeded": 10}, "duplicate_accepted": 0},
            "sse": {"follows": 5, "ends": 5, "events": 12, "resumed": 1}, "sse_follows_open_peak": 4,
            "poll": {"sent": 1000, "rate_per_s": 99.0, "latency_ms": {"p50": 1, "p99": 2}}}
    return base | over


def test_goals_pass_on_a_clean_run_and_fail_on_each_fault():
    plan = Plan(jobs=10, followers=4, rate=100.0)
    assert all(ok for ok, _ in goals(plan, summary()).values())
    failed = {name for name, (ok, _) in goals(plan, summary(http_5xx={"GET /v1/usage 503": 1})).items() if not ok}
    assert failed == {"no 5xx"}
    failed = {name for name, (ok, _) in goals(plan, summary(final={"succeeded": 9, "running": 1})).items() if not ok}
    assert failed == {"every job accepted and terminal"}
    slow = summary(poll={"sent": 500, "rate_per_s": 50.0, "latency_ms": {"p50": 1, "p99": 2}})
    assert not goals(plan, slow)["status polls at the rate"][0]
    assert not goals(plan, summary(sse={"follows": 5, "ends": 4}))["SSE followers"][0]


def test_the_receiver_verifies_signatures_and_fails_a_stable_share_of_first_attempts(tmp_path):
    secret = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    recorder = Recorder(tmp_path / "calls.jsonl", {"k00": secret}, fail_rate=0.5)
    ids = [f"msg_{i}" for i in range(200)]
    assert 60 < sum(fails_first(i, 0.5) for i in ids) < 140
    body = json.dumps({"type": "job.succeeded", "data": {"id": "j1", "status": "succeeded"}}).encode()
    fail_id = next(i for i in ids if fails_first(i, 0.5))
    headers = signed_headers(base64.b64decode(secret.removeprefix("whsec_")), fail_id, int(time.time()), body)
    assert recorder.answer("/hooks?key=k00", headers, body) == 500
    assert recorder.answer("/hooks?key=k00", headers, body) == 204
    assert recorder.answer("/hooks?key=k01", headers, body) == 401  # no secret for that key: unverified
    recorder.out.close()
    lines = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [(c["status"], c["verified"], c["job"]) for c in lines] == [(500, True, "j1"), (204, True, "j1"),
                                                                      (401, False, "j1")]
