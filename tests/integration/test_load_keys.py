"""The keyed load run (issue 29) at a small scale against the real stack (redis-server, ``jacobian serve
--workers 2``, two workers, the notifier, a webhook receiver process): 4 API keys whose bursts exceed their
``max_queued`` quota (so some submits get 429 and are sent again after ``Retry-After``), 16 SSE followers some
of which hang up and resume with ``Last-Event-ID``, 100 status polls/s for 20 s. Every goal of
``bench/load_keys.py`` must hold; the full-size run (1000 jobs, 20 keys, 200 followers, 500 polls/s, 5 minutes)
is ``python -m bench.bench_load --mode keys``, recorded in docs/BENCHMARKS.md."""

from __future__ import annotations

import json

import pytest

from bench.load_keys import Plan, report, run_keys

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_keyed_load_no_5xx_every_job_terminal_every_webhook_delivered(tmp_path):
    plan = Plan(jobs=40, keys=4, followers=16, rate=100.0, duration_s=20.0, connections=8, burst=5, max_queued=3,
                requests_per_s=50.0, drop_rate=0.5, hook_fail_rate=0.2, settle_s=180.0)
    summary = run_keys(tmp_path, plan)
    print(report(summary))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("goals", "problems")}, indent=1, default=str))
    assert summary["problems"] == [], summary["problems"]
    assert summary["final"] == {"succeeded": plan.jobs}
    assert sum(n for route, n in summary["http_429"].items() if route.startswith("POST")) > 0, summary["http_429"]
    assert summary["jobs_accepted_after_a_429"] > 0
    assert summary["webhooks"]["answered_500_first"] > 0  # the notifier had to retry some, and did
    assert summary["sse"].get("dropped_on_purpose", 0) > 0 and summary["sse"]["resumed"] > 0
    assert summary["api_peak_rss_mib"] > 0
