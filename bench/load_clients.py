"""The clients of the keyed load run (``bench/load_keys.py``): submitters per API key that honour a 429's
``Retry-After``, the open-loop status poller over the jobs accepted so far, and SSE followers that resume with
``Last-Event-ID``. Plain asyncio over raw HTTP/1.1 (``bench.bench_load.Conn``), one event loop for all."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.bench_load import STATUSES, TERMINAL, Conn, HttpError, Phase, job_body, open_loop

NOTIFY_EVENTS = ["succeeded", "failed", "canceled", "progress"]
READ_TIMEOUT_S = 60.0  # an event stream silent this long (no event, no keep-alive comment) is a failure
RECENT = 60  # followers pick among the last this many jobs accepted that are not known to have ended


@dataclass
class Key:
    """One API key of the run: its bearer token, name (in records and the webhook URL) and secret."""

    token: str
    name: str
    secret: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@dataclass
class Shared:
    """What the clients learn and count, read by the checks at the end."""

    host: str
    port: int
    keys: list[Key]
    hook_url: str
    ids: list[str] = field(default_factory=list)                 # accepted, in order
    key_of: dict[str, str] = field(default_factory=dict)         # job id -> key name
    ended: set[str] = field(default_factory=set)                 # seen terminal by a poll or a stream
    http_5xx: Counter = field(default_factory=Counter)           # "METHOD route status" -> count
    http_429: Counter = field(default_factory=Counter)           # "route limit" -> count
    retried_jobs: int = 0                                        # jobs accepted only after a 429
    submit: Phase = field(default_factory=lambda: Phase("submit"))
    poll: Phase = field(default_factory=lambda: Phase("poll"))
    sse: Counter = field(default_factory=Counter)                # streams, events, ends, reconnects...
    sse_problems: list[str] = field(default_factory=list)
    follows_open: int = 0
    follows_open_peak: int = 0

    def count_status(self, route: str, status: int, payload: bytes, headers: dict[str, str]) -> None:
        if status >= 500:
            self.http_5xx[f"{route} {status}"] += 1
        elif status == 429:
            try:
                limit = json.loads(payload)["error"].get("limit", "?")
            except (ValueError, KeyError, AttributeError, TypeError):
                limit = "?"
            self.http_429[f"{route} {limit}"] += 1

    def sse_problem(self, text: str) -> None:
        self.sse["problems"] += 1
        if len(self.sse_problems) < 20:
            self.sse_problems.append(text[:400])


def retry_after_s(headers: dict[str, str], default: float = 1.0) -> float:
    try:
        return max(0.0, float(headers.get("retry-after", default)))
    except ValueError:
        return default


# -- submitters ------------------------------------------------------------------------------------


def burst_times(n_jobs: int, burst: int, window_s: float, offset: float) -> list[tuple[float, range]]:
    """``(seconds after the start, the job indices)`` of a key's bursts of ``burst`` jobs spread evenly over
    ``window_s``, shifted by ``offset`` (a share of one interval) so that the keys do not all send together."""
    groups = [range(i, min(n_jobs, i + burst)) for i in range(0, n_jobs, burst)]
    step = window_s / max(1, len(groups))
    return [(step * (g + offset), group) for g, group in enumerate(groups)]


async def submit_one(shared: Shared, key: Key, seed: int, *, give_up_at: float) -> None:
    """POST one job (with ``notify``) until it is accepted, sleeping ``Retry-After`` after each 429 (the same
    Idempotency-Key every time: a refused job left nothing behind); 5xx and transport errors are counted and
    retried after a second, until ``give_up_at``."""
    body = json.loads(job_body(seed))
    body["notify"] = {"url": f"{shared.hook_url}?key={key.name}", "events": NOTIFY_EVENTS}
    raw = json.dumps(body).encode()
    headers = {**key.headers, "Content-Type": "application/json", "Idempotency-Key": f"load-{key.name}-{seed}"}
    refused = False
    phase = shared.submit
    while time.monotonic() < give_up_at:
        conn = Conn(shared.host, shared.port)
        t0 = time.perf_counter()
        phase.sent += 1
        try:
            status, payload = await conn.request("POST", "/v1/jobs", raw, headers)
        except HttpError as err:
            phase.error(str(err))
            await asyncio.sleep(1.0)
            continue
        finally:
            await conn.close()
        phase.latencies.append(time.perf_counter() - t0)
        phase.outcomes[str(status)] += 1
        shared.count_status("POST /v1/jobs", status, payload, conn.last_headers)
        if status == 202:
            job_id = json.loads(payload)["id"]
            shared.ids.append(job_id)
            shared.key_of[job_id] = key.name
            shared.retried_jobs += refused
            return
        if status == 429:
            refused = True
            await asyncio.sleep(retry_after_s(conn.last_headers))
            continue
        phase.error(f"POST /v1/jobs ({key.name}) answered {status}: {payload[:300]!r}")
        await asyncio.sleep(1.0)
    phase.error(f"job {key.name}-{seed}: not accepted before the run's end")


async def submitter(shared: Shared, k: int, seeds: list[int], *, burst: int, window_s: float,
                    give_up_at: float) -> None:
    """Key ``k``'s jobs in bursts over ``window_s`` (each burst sent at once)."""
    t0 = time.monotonic()
    for at, group in burst_times(len(seeds), burst, window_s, offset=k / len(shared.keys)):
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        await asyncio.gather(*(submit_one(shared, shared.keys[k], seeds[i], give_up_at=give_up_at)
                               for i in group))
    shared.submit.seconds = max(shared.submit.seconds, time.monotonic() - t0)  # the last key's end


# -- the status poller -----------------------------------------------------------------------------


async def poller(shared: Shared, *, rate: float, duration_s: float, connections: int) -> None:
    """GET /v1/jobs/{id} round-robin over the jobs accepted so far (GET /v1/usage before the first), each
    request with the next key, on an open-loop schedule of ``rate`` per second for ``duration_s``."""
    phase = shared.poll

    def target(i: int) -> tuple[str, dict[str, str], str | None]:
        ids = shared.ids
        job_id = ids[i % len(ids)] if ids else None
        return f"/v1/jobs/{job_id}" if job_id else "/v1/usage", shared.keys[i % len(shared.keys)].headers, job_id

    def check(conn: Conn, job_id: str | None, status: int, payload: bytes) -> None:
        route = "GET /v1/jobs/{id}" if job_id else "GET /v1/usage"
        shared.count_status(route, status, payload, conn.last_headers)
        if status != 200:
            if status != 429:
                phase.error(f"{route} answered {status}: {payload[:300]!r}")
            return
        if job_id is not None:
            record = json.loads(payload)
            if record.get("id") != job_id or record.get("status") not in STATUSES:
                phase.error(f"GET /v1/jobs/{job_id}: unexpected body {payload[:300]!r}")
            elif record["status"] in TERMINAL:
                shared.ended.add(job_id)

    await open_loop(shared.host, shared.port, phase, rate=rate, duration_s=duration_s, connections=connections,
                    target=target, check=check)


# -- SSE followers ---------------------------------------------------------------------------------


def parse_event(block: str) -> dict[str, str] | None:
    """One SSE message (the text between blank lines) as its fields; None for a comment or ``retry:`` only."""
    fields: dict[str, str] = {}
    for line in block.split("\n"):
        if not line or line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        fields[name] = value[1:] if value.startswith(" ") else value
    return fields if "event" in fields or "data" in fields else None


def event_order(event_id: str) -> tuple[int, ...]:
    return tuple(int(p) for p in event_id.split("."))


class Stream:
    """One GET /v1/jobs/{id}/events answer read as it comes: chunked transfer decoded, split into messages."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.buffer = ""
        self.done = False

    async def _chunk(self) -> str:
        size_line = await asyncio.wait_for(self.reader.readline(), READ_TIMEOUT_S)
        if not size_line:
            raise HttpError("event stream closed inside the chunked body")
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await self.reader.readline()
            self.done = True
            return ""
        data = await asyncio.wait_for(self.reader.readexactly(size + 2), READ_TIMEOUT_S)
        return data[:-2].decode()

    async def messages(self):  # noqa: ANN201 - an async generator of dicts
        while True:
            while "\n\n" not in self.buffer:
                if self.done:
                    return
                self.buffer += await self._chunk()
            block, _, self.buffer = self.buffer.partition("\n\n")
            event = parse_event(block)
            if event is not None:
                yield event


async def open_stream(shared: Shared, job_id: str, key: Key, last_event_id: str | None
                      ) -> tuple[int, dict[str, str], bytes, asyncio.StreamWriter | None, Stream | None]:
    """Send the GET; ``(status, headers, error body, writer, stream)``: a stream for a 200, else the body."""
    reader, writer = await asyncio.open_connection(shared.host, shared.port)
    head = [f"GET /v1/jobs/{job_id}/events HTTP/1.1", f"Host: {shared.host}:{shared.port}",
            "Accept: text/event-stream", f"Authorization: Bearer {key.token}"]
    if last_event_id:
        head.append(f"Last-Event-ID: {last_event_id}")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
    status_line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
    if not status_line:
        writer.close()
        raise HttpError("events: connection closed before an answer")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while True:
        line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
        if line in (b"\r\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if status == 200:
        return status, headers, b"", writer, Stream(reader)
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    writer.close()
    return status, headers, body, None, None


async def follow(shared: Shared, job_id: str, key: Key, *, drop_first: bool) -> None:
    """Follow one job's events to its ``end``: with ``drop_first``, hang up after the first event and come back
    with ``Last-Event-ID`` (as a client whose network dropped); a stream closed early is resumed the same way.
    Every event must come after the one before (by id), across reconnections."""
    last_id: str | None = None
    for attempt in range(30):
        writer = None
        try:
            status, headers, body, writer, stream = await open_stream(shared, job_id, key, last_id)
            shared.sse["requests"] += 1
            shared.count_status("GET /v1/jobs/{id}/events", status, body, headers)
            if stream is None:
                shared.sse[f"answered {status}"] += 1
                if status not in (429, 503):
                    shared.sse_problem(f"events of {job_id} answered {status}: {body[:200]!r}")
                    return
                await asyncio.sleep(retry_after_s(headers))
                continue
            async for event in stream.messages():
                shared.sse["events"] += 1
                event_id = event.get("id", "")
                if last_id is not None and event_order(event_id) <= event_order(last_id):
                    shared.sse_problem(f"job {job_id}: event {event_id} after {last_id} (resumed: {attempt > 0})")
                last_id = event_id
                if event.get("event") == "end":
                    shared.sse["ends"] += 1
                    shared.ended.add(job_id)
                    return
                if drop_first and attempt == 0:
                    shared.sse["dropped_on_purpose"] += 1
                    break
            else:
                shared.sse["closed_before_end"] += 1
        except (TimeoutError, HttpError, OSError, asyncio.IncompleteReadError, ValueError) as err:
            shared.sse_problem(f"events of {job_id}: {err!r}")
        finally:
            if writer is not None:
                writer.close()
        shared.sse["resumed"] += 1
        await asyncio.sleep(0.2)
    shared.sse_problem(f"events of {job_id}: no end after 30 connections")


async def follower(shared: Shared, f: int, *, until: float, drop_rate: float) -> None:
    """Follow jobs one after another until ``until`` (monotonic): each time one of the last jobs accepted
    that is not known to have ended (a running or queued one), with the follower's key."""
    rng = random.Random(f)
    key = shared.keys[f % len(shared.keys)]
    while time.monotonic() < until:
        live = [i for i in shared.ids[-RECENT:] if i not in shared.ended]
        if not live:
            await asyncio.sleep(0.2)
            continue
        shared.follows_open += 1
        shared.follows_open_peak = max(shared.follows_open_peak, shared.follows_open)
        shared.sse["follows"] += 1
        try:
            await follow(shared, rng.choice(live), key, drop_first=rng.random() < drop_rate)
        finally:
            shared.follows_open -= 1
        await asyncio.sleep(rng.uniform(0.1, 0.5))


def pct_ms(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, math.floor(p * len(ordered)))], 2)


def summary_of(shared: Shared) -> dict[str, Any]:
    return {"submit": shared.submit.summary(), "poll": shared.poll.summary(), "http_5xx": dict(shared.http_5xx),
            "http_429": dict(shared.http_429), "jobs_accepted_after_a_429": shared.retried_jobs,
            "sse": dict(shared.sse), "sse_follows_open_peak": shared.follows_open_peak,
            "sse_problems": shared.sse_problems}
