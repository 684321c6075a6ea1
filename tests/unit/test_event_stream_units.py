"""Event ids, the SSE reader and the ``status --follow`` line, without services."""

from __future__ import annotations

from app.events import event_key, format_event, format_key, parse_key
from contracts.jobspec import JobStatus
from contracts.jobstore import JobRecord
from contracts.records import Progress
from jacobian.cli_client import event_line
from jacobian.events import JobEvent, parse_sse


def record(status: JobStatus, rows_done: int = 0, started_at: float | None = None) -> JobRecord:
    return JobRecord(id="a" * 32, status=status, spec={}, created_at=1.0, started_at=started_at,
                     progress=Progress.of(rows_done, 8, 2.0).model_dump())


def test_event_keys_grow_over_a_job_life_and_a_retried_run():
    life = [record(JobStatus.queued), record(JobStatus.running, 0, 10.0), record(JobStatus.running, 3, 10.0),
            record(JobStatus.running, 3, 20.5), record(JobStatus.succeeded, 8, 20.5)]
    keys = [event_key(r) for r in life]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert keys[2] == (10000, 1, 3) and keys[-1] == (20500, 2, 8)
    assert event_key(record(JobStatus.queued, 3, 10.0)) < keys[2]  # queued again: told when it runs again


def test_last_event_id_is_parsed_back_or_ignored():
    assert parse_key(format_key((10000, 1, 3))) == (10000, 1, 3)
    for text in (None, "", "1.2", "a.b.c", "1.2.3.4", "-1.0.0", "1" * 21 + ".0.0"):
        assert parse_key(text) is None


def test_sse_text_reads_back_as_events():
    text = ("retry: 2000\n\n" + format_event("status", (1, 1, 0), {"status": "running"}) + ": keep-alive\n\n"
            + format_event("end", (1, 2, 8), {"status": "succeeded"}))
    events = list(parse_sse(text.split("\n")))
    assert events == [JobEvent("1.1.0", "status", {"status": "running"}),
                      JobEvent("1.2.8", "end", {"status": "succeeded"})]


def test_follow_line_shows_rows_rate_eta_and_error():
    running = record(JobStatus.running, 2, 1.0).to_public()
    assert event_line(JobEvent("x", "progress", running)) == "progress  running  rows 2/8  25.0%  2 rows/s  ETA 3 s"
    queued = {"status": "queued", "progress": {"rows_done": 0, "rows_total": None, "fraction": 0.0}}
    assert event_line(JobEvent("x", "status", queued)) == "status  queued  rows 0/?  0.0%"
    failed = {**running, "status": "failed", "error": {"type": "Boom", "message": "x: broke"}}
    assert event_line(JobEvent("x", "end", failed)).endswith("Boom: x: broke")
