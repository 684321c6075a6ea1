"""Server-Sent Events of ``GET /v1/jobs/{id}/events`` read as ``JobEvent``s, resumed after a dropped connection."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import httpx

END = "end"
RETRY_STATUSES = (502, 503, 504)


class JobEvent(NamedTuple):
    """One event of a job: ``id`` (send back as ``Last-Event-ID`` to resume), ``event`` (``status``,
    ``progress`` or ``end``) and ``data``, the job's record as ``GET /v1/jobs/{id}`` serves it."""

    id: str
    event: str
    data: dict[str, Any]


def parse_sse(lines: Iterable[str]) -> Iterator[JobEvent]:
    """The events of SSE text lines (comments and ``retry:`` skipped; ``data`` lines joined, read as JSON)."""
    event_id, kind, data = "", "message", []
    for line in lines:
        if not line:
            if data:
                yield JobEvent(event_id, kind, json.loads("\n".join(data)))
            kind, data = "message", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "id":
            event_id = value
        elif name == "event":
            kind = value
        elif name == "data":
            data.append(value)


def follow_events(http: httpx.Client, path: str, *, checked: Callable[[httpx.Response], httpx.Response],
                  last_event_id: str | None = None, retries: int = 5, backoff_s: float = 0.25,
                  max_backoff_s: float = 5.0) -> Iterator[JobEvent]:
    """Events of ``path`` until the ``end`` event; a connection that drops (or a 502/503/504) is opened again
    with ``Last-Event-ID`` up to ``retries`` times in a row (an event received resets the count).

    ``checked(response)`` raises for any other error answer (e.g. ``JacobianError`` for a 404). A stream
    that the server closes without ``end`` (the record expired) ends the iteration.
    """
    failures = 0
    while True:
        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        try:
            with http.stream("GET", path, headers=headers) as response:
                if not response.is_success:
                    response.read()
                if response.status_code not in RETRY_STATUSES or failures >= retries:
                    checked(response)
                    for event in parse_sse(response.iter_lines()):
                        failures = 0
                        last_event_id = event.id or last_event_id
                        yield event
                        if event.event == END:
                            return
                    return
        except httpx.TransportError:
            if failures >= retries:
                raise
        time.sleep(min(max_backoff_s, backoff_s * 2 ** failures))
        failures += 1
