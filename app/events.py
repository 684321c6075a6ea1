"""Server-Sent Events of one job: its record read every ``event_poll_s``, one event per change of status or rows.

An event is ``id: <event id>``, ``event: status | progress | end`` and ``data:`` the ``GET /v1/jobs/{id}``
body. The event id is made of the record itself, ``<started_ms>.<phase>.<rows_done>`` (phase 0 queued,
1 running, 2 ended), so that it orders a job's events on every API process alike and ``Last-Event-ID``
resumes with only what came later, with no event log to keep. A terminal status is sent as ``end`` and
closes the stream; a comment line every ``event_heartbeat_s`` keeps proxies from closing a quiet one.
Each read borrows a pooled Redis connection for one round trip: a stream holds none between reads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.errors import TooManyStreams
from app.metrics import EVENT_STREAMS
from contracts.jobspec import JobStatus
from contracts.jobstore import JobNotFound, JobRecord, JobStore

log = logging.getLogger(__name__)
EVENT_MEDIA_TYPE = "text/event-stream"
RECONNECT_MS = 2000  # the ``retry:`` an EventSource waits before it reconnects
EventKey = tuple[int, int, int]


def event_key(record: JobRecord) -> EventKey:
    """Where ``record`` stands in its job's life: (start time in ms, phase, rows done); later is greater.

    A job queued again for a retry keeps its last start time and phase 0: it reads as earlier than its run
    and is told when it runs again (a new start time)."""
    phase = 2 if record.status.is_terminal else int(record.status == JobStatus.running)
    started_ms = int((record.started_at or 0.0) * 1000)
    return started_ms, phase, record.progress.rows_done


def format_key(key: EventKey) -> str:
    return ".".join(str(part) for part in key)


def parse_key(text: str | None) -> EventKey | None:
    """A ``Last-Event-ID`` as sent back by a client; None (start from now) for anything else."""
    parts = (text or "").strip().split(".")
    if len(parts) != 3 or not all(p.isdigit() and len(p) <= 20 for p in parts):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2])


def format_event(kind: str, key: EventKey, body: dict[str, Any]) -> str:
    """One SSE message: ``id``, ``event``, ``data`` (one JSON line) and the blank line that ends it."""
    return f"id: {format_key(key)}\nevent: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


async def job_events(store: JobStore, first: JobRecord, *, last_event_id: str | None, poll_s: float,
                     heartbeat_s: float) -> AsyncIterator[str]:
    """The event stream of ``first``'s job, from ``first`` on (or after ``last_event_id``), until it ends.

    ``status`` when the status differs from the last one sent (or on the first event), ``progress`` when
    only the rows moved, ``end`` for a terminal status (then the stream stops). A record that expires or
    is deleted while followed ends the stream without an ``end`` event.
    """
    resume = parse_key(last_event_id)
    sent_key: EventKey | None = None
    sent_status: JobStatus | None = None if resume is None else (
        JobStatus.running if resume[1] == 1 else JobStatus.queued if resume[1] == 0 else None)
    last_write = time.monotonic()
    record: JobRecord | None = first
    yield f"retry: {RECONNECT_MS}\n\n"
    while record is not None:
        key = event_key(record)
        if key != sent_key and (resume is None or key > resume):
            kind = "end" if record.status.is_terminal else "status" if record.status != sent_status else "progress"
            yield format_event(kind, key, record.to_public())
            sent_key, sent_status, resume, last_write = key, record.status, None, time.monotonic()
        if record.status.is_terminal:
            return
        await asyncio.sleep(poll_s)
        if time.monotonic() - last_write >= heartbeat_s:
            yield ": keep-alive\n\n"
            last_write = time.monotonic()
        try:
            record = await run_in_threadpool(store.get, record.id)
        except JobNotFound:
            log.info("job %s: its record is gone; the event stream ends", first.id)
            record = None


class StreamSlots:
    """At most ``limit`` open event streams in this process (``acquire`` raises ``TooManyStreams`` beyond)."""

    def __init__(self) -> None:
        self.open = 0

    def acquire(self, limit: int) -> None:
        if self.open >= limit:
            raise TooManyStreams(f"events: this API process already serves {self.open} event streams "
                                 f"(JACOBIAN_MAX_EVENT_STREAMS={limit}); retry after {TooManyStreams.retry_after_s} "
                                 "s, or poll GET /v1/jobs/{id}")
        self.open += 1
        EVENT_STREAMS.inc()

    def release(self) -> None:
        self.open -= 1
        EVENT_STREAMS.dec()


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` answer that gives its slot back however it ends: the last event sent, the
    client gone (Starlette cancels the body on ``http.disconnect``), or never started at all."""

    def __init__(self, content: AsyncIterator[str], slots: StreamSlots) -> None:
        super().__init__(content, media_type=EVENT_MEDIA_TYPE,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.slots = slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slots.release()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
