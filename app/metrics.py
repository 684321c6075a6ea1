"""Every metric of the API process, declared once; prefix ``jacobian_``, base units (seconds).

With ``PROMETHEUS_MULTIPROC_DIR`` set (several uvicorn/gunicorn workers), counters and
histograms go through prometheus_client's multiprocess files and ``render`` aggregates them;
the queue depth is read from Redis at scrape time either way. Labels never carry a job id or
a path: routes are templates (``/v1/jobs/{job_id}``), unmatched paths are ``"unmatched"``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis import Redis
from rq import Queue
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contracts.outbox import Outbox
from contracts.quotas import QuotaUsage

log = logging.getLogger(__name__)

JOBS_SUBMITTED = Counter("jacobian_jobs_submitted", "Jobs accepted by POST /v1/jobs and queued, by kind.", ["kind"])
JOBS_REJECTED = Counter("jacobian_jobs_rejected", "Job submissions refused with a 4xx, by error type.", ["reason"])
JOBS_CANCELED = Counter("jacobian_jobs_cancel_requests", "Cancel requests received, by the job status then.",
                        ["status"])
HTTP_REQUESTS = Counter("jacobian_http_requests", "HTTP requests answered, by route template, method and status code.",
                        ["route", "method", "status_code"])
HTTP_DURATION = Histogram("jacobian_http_request_duration_seconds",
                          "Time to answer an HTTP request, by route template, method and status code.",
                          ["route", "method", "status_code"],
                          buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
QUOTA_REJECTIONS = Counter("jacobian_quota_rejections", "Requests refused with 429 by a quota, by API key name "
                           "and limit.", ["key", "limit"])
EVENT_STREAMS = Gauge("jacobian_event_streams", "GET /v1/jobs/{id}/events streams open now.",
                      multiprocess_mode="livesum")


class QueueDepthCollector(Collector):
    """``jacobian_queue_depth{queue}``: jobs waiting in the rq queue, read from Redis at scrape time."""

    def __init__(self) -> None:
        self.connection: Redis | None = None
        self.queue_names: tuple[str, ...] = ()

    def bind(self, connection: Redis | None, queue_names: Iterable[str]) -> None:
        """Read depth through ``connection`` (set in the app lifespan; ``None`` unbinds)."""
        self.connection = connection
        self.queue_names = tuple(queue_names)

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily("jacobian_queue_depth", "Jobs waiting in the rq queue.", labels=["queue"])]

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily("jacobian_queue_depth", "Jobs waiting in the rq queue.", labels=["queue"])
        if self.connection is not None:
            for name in self.queue_names:
                try:
                    depth = self.connection.llen(f"{Queue.redis_queue_namespace_prefix}{name}")
                except Exception as exc:  # noqa: BLE001 - a scrape must not fail because Redis is down
                    log.warning("queue depth unavailable: %s", exc)
                    continue
                family.add_metric([name], float(depth))
        yield family


class WebhookCollector(Collector):
    """Webhooks, read from the Redis outbox at scrape time (every notifier process counts there):
    ``jacobian_webhook_deliveries_total{event, outcome}``, delivery attempts by outcome (``delivered``;
    ``failed`` or ``refused`` by the allowlist, both retried; ``gave_up``: the last one of a delivery that
    never succeeded), and ``jacobian_webhook_outbox``, deliveries waiting (due or for a retry)."""

    _ATTEMPTS = ("jacobian_webhook_deliveries", "Webhook delivery attempts, by event and outcome.")
    _OUTBOX = ("jacobian_webhook_outbox", "Webhook deliveries in the outbox (due, or waiting for a retry).")

    def __init__(self) -> None:
        self.connection: Redis | None = None

    def bind(self, connection: Redis | None) -> None:
        self.connection = connection

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(*self._ATTEMPTS, labels=["event", "outcome"]), GaugeMetricFamily(*self._OUTBOX)]

    def collect(self) -> Iterable[Metric]:
        attempts = CounterMetricFamily(*self._ATTEMPTS, labels=["event", "outcome"])
        pending = GaugeMetricFamily(*self._OUTBOX)
        if self.connection is not None:
            try:
                outbox = Outbox(self.connection)
                counts, waiting = outbox.counts(), outbox.pending()
            except Exception as exc:  # noqa: BLE001 - a scrape must not fail because Redis is down
                log.warning("webhook metrics unavailable: %s", exc)
            else:
                for (event, outcome), value in sorted(counts.items()):
                    attempts.add_metric([event, outcome], float(value))
                pending.add_metric([], float(waiting))
        yield attempts
        yield pending


class QuotaCollector(Collector):
    """``jacobian_quota_usage{key, limit}`` and ``jacobian_quota_limit{key, limit}`` (limits that are set), by API
    key name (never the key), read from Redis at scrape time through ``app.quotas.usage_of_every_key``."""

    _USAGE = ("jacobian_quota_usage", "Usage of each quota of each API key (jobs, bytes, requests not refilled).")
    _LIMIT = ("jacobian_quota_limit", "Each quota of each API key that has a limit.")

    def __init__(self) -> None:
        self.read: Callable[[], list[QuotaUsage]] | None = None

    def bind(self, read: Callable[[], list[QuotaUsage]] | None) -> None:
        self.read = read

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(*self._USAGE, labels=["key", "limit"]),
                GaugeMetricFamily(*self._LIMIT, labels=["key", "limit"])]

    def collect(self) -> Iterable[Metric]:
        usage = GaugeMetricFamily(*self._USAGE, labels=["key", "limit"])
        limit = GaugeMetricFamily(*self._LIMIT, labels=["key", "limit"])
        try:
            keys = self.read() if self.read is not None else []
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail because Redis is down
            log.warning("quota metrics unavailable: %s", exc)
            keys = []
        for key in keys:
            for row in key.limits:
                usage.add_metric([key.key, row.name], float(row.used))
                if row.max is not None:
                    limit.add_metric([key.key, row.name], float(row.max))
        yield usage
        yield limit


QUEUE_DEPTH = QueueDepthCollector()
WEBHOOKS = WebhookCollector()
QUOTAS = QuotaCollector()
_MULTIPROC = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
if not _MULTIPROC:
    REGISTRY.register(QUEUE_DEPTH)
    REGISTRY.register(WEBHOOKS)
    REGISTRY.register(QUOTAS)


def render() -> tuple[bytes, str]:
    """The exposition text of this process (all processes in multiprocess mode) and its content type."""
    if _MULTIPROC:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(QUEUE_DEPTH)
        registry.register(WEBHOOKS)
        registry.register(QUOTAS)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Counts and times every HTTP request under its route template and status code."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = _route_template(scope)
            labels = (route, scope.get("method", "GET"), str(status["code"]))
            HTTP_REQUESTS.labels(*labels).inc()
            HTTP_DURATION.labels(*labels).observe(time.perf_counter() - start)


def _route_template(scope: dict[str, Any]) -> str:
    """The matched route's path template; plain Starlette routes (``/docs``) are matched here."""
    path = getattr(scope.get("route"), "path", None)
    if isinstance(path, str):
        return path
    for route in getattr(scope.get("app"), "routes", ()):
        try:
            match, _ = route.matches(scope)
        except Exception:  # noqa: BLE001 - a route that cannot judge this scope is not it
            continue
        if match == Match.FULL and isinstance(getattr(route, "path", None), str):
            return str(route.path)
    return "unmatched"
