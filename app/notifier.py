"""``jacobian notifier``: the process that turns job states into webhook deliveries and makes them.

Two steps in one loop, every ``JACOBIAN_NOTIFIER_POLL_S``: ``scan`` reads each watched job's record (as
``GET /v1/jobs/{id}`` shows it) and emits the events due (its end, or ``progress`` at most every
``JACOBIAN_WEBHOOK_PROGRESS_S``) into the Redis outbox (``contracts.outbox``); ``dispatch`` claims the
deliveries due and POSTs each on a thread of a small pool, signed (``contracts.webhooks``), to the address
the allowlist accepted after DNS resolution (``contracts.webhook_allow``). A failed attempt is retried with
exponential backoff and jitter until ``JACOBIAN_WEBHOOK_RETRY_WINDOW_S`` (24 h) after the delivery was due.

A process of its own rather than a thread of the worker: it never shares a GIL or a core with job compute,
it runs where egress to receivers is allowed (the API image: no TensorFlow), and any number of them may run
(emitting and claiming are atomic in Redis). Everything it knows is in Redis: a restart loses nothing, and a
delivery a crashed notifier had claimed is taken over when its lease ends.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from redis import Redis, RedisError

from contracts.jobspec import JobStatus
from contracts.jobstore import JobNotFound, JobRecord, JobStore
from contracts.logs import configure_logging
from contracts.outbox import Outbox, new_delivery_id
from contracts.records import iso_time
from contracts.settings import Settings, get_settings
from contracts.webhook_allow import WebhookAllow, WebhookRefused, resolve_host
from contracts.webhooks import NotifyDelivery, parse_secret, retry_delay_s, signed_headers

log = logging.getLogger("app.notifier")
USER_AGENT = "jacobian-webhooks/1"
LEASE_MARGIN_S = 30.0  # a claimed delivery is someone else's this long after its attempt's timeout
WATCH_BATCH = 500  # watched jobs read per scan
KEEP_AFTER_WINDOW_S = 24 * 3600  # a delivery's record outlives its retry window by this much
ERROR_CHARS = 300


class SecretMissing(RuntimeError):
    """The API key that submitted the job has no webhook secret (any more)."""


def due_event(record: JobRecord, seen: dict[str, Any], events: set[str], *, now: float,
              progress_s: float) -> tuple[str | None, dict[str, Any], bool] | None:
    """What to emit for ``record`` after ``seen`` (the last emitted ``status``, ``rows``, ``at``): None for
    nothing yet, else ``(event or None, the new seen, terminal)``. A terminal status is emitted once (its
    event when asked for, else nothing, ending the watch); ``progress`` when rows grew and ``progress_s``
    passed since the last one."""
    rows = int(record.progress.rows_done or 0)
    new_seen = {"status": record.status.value, "rows": rows, "at": now}
    if record.status.is_terminal:
        return (record.status.value if record.status.value in events else None), new_seen, True
    if ("progress" in events and record.status == JobStatus.running and rows > int(seen.get("rows", 0))
            and now - float(seen.get("at", 0.0)) >= progress_s):
        return "progress", new_seen, False
    return None


def payload(record: JobRecord, event: str, now: float) -> bytes:
    """The body of a delivery: ``{"type": "job.<event>", "timestamp", "data": <the GET /v1/jobs/{id} body>}``."""
    data = record.to_public()
    data.pop("notify", None)
    return json.dumps({"type": f"job.{event}", "timestamp": iso_time(now), "data": data},
                      separators=(",", ":")).encode()


class Notifier:
    """Scans watched jobs into the outbox and delivers what is due (see the module's docstring)."""

    def __init__(self, connection: Redis, settings: Settings, *, transport: httpx.BaseTransport | None = None) -> None:
        self.settings = settings
        self.store = JobStore(connection, ttl_s=settings.result_ttl_s)
        self.outbox = Outbox(connection)
        self.allow = WebhookAllow.parse(settings.webhook_allow)
        self.secrets = {k.name: parse_secret(k.webhook_secret, field=k.name)
                        for k in settings.api_keys if k.webhook_secret}
        self.default_secret = (parse_secret(settings.webhook_secret, field="JACOBIAN_WEBHOOK_SECRET")
                               if settings.webhook_secret and not settings.api_keys else None)
        self.http = httpx.Client(timeout=settings.webhook_timeout_s, follow_redirects=False, trust_env=False,
                                 headers={"user-agent": USER_AGENT}, transport=transport)
        self.pool = ThreadPoolExecutor(settings.notifier_concurrency, thread_name_prefix="webhook")
        self.in_flight: set[Future[str]] = set()

    # -- events ------------------------------------------------------------------------------------

    def scan(self, now: float | None = None) -> int:
        """Emit the events due of the watched jobs due now; returns how many deliveries were queued."""
        now = time.time() if now is None else now
        queued = 0
        for job_id in self.outbox.due_jobs(now, next_at=now + self.settings.notifier_poll_s, limit=WATCH_BATCH):
            try:
                queued += self._scan_job(job_id, now)
            except RedisError:
                raise
            except Exception:  # noqa: BLE001 - one bad record must not stop the others' webhooks
                log.exception("job %s: webhook events not read; trying again at the next scan", job_id)
        return queued

    def _scan_job(self, job_id: str, now: float) -> int:
        """Emit what is due for one watched job; 1 when a delivery was queued."""
        try:
            record = self.store.get(job_id)
        except JobNotFound:
            self.outbox.unwatch(job_id)
            return 0
        notify = record.spec.get("notify")
        if not notify:
            self.outbox.unwatch(job_id)
            return 0
        raw_seen = self.outbox.seen(job_id)
        due = due_event(record, json.loads(raw_seen) if raw_seen else {}, set(notify.get("events") or ()),
                        now=now, progress_s=self.settings.webhook_progress_s)
        if due is None:
            return 0
        event, new_seen, terminal = due
        delivery = self._delivery(record, notify["url"], event, now) if event else None
        done = self.outbox.emit(job_id, expected_seen=raw_seen, new_seen=json.dumps(new_seen), delivery=delivery,
                                terminal=terminal, now=now,
                                ttl_s=int(self.settings.webhook_retry_window_s + KEEP_AFTER_WINDOW_S))
        if done != 1 or delivery is None:
            return 0
        log.info("job %s: webhook %s queued as %s", job_id, event, delivery["id"],
                 extra={"event": "webhook_queued", "job_id": job_id})
        return 1

    def _delivery(self, record: JobRecord, url: str, event: str, now: float) -> dict[str, Any]:
        earlier = record.notify.deliveries.get(event) if record.notify is not None else None
        delivery_id = new_delivery_id()
        block = NotifyDelivery(id=delivery_id, delivered=False, attempts=0, next_attempt_at=iso_time(now),
                               count=(earlier.count if earlier is not None else 0) + 1)
        return {"id": delivery_id, "event": event, "body": payload(record, event, now), "url": url,
                "key": record.spec.get("api_key") or "", "block": block.model_dump(mode="json")}

    # -- deliveries --------------------------------------------------------------------------------

    def dispatch(self, now: float | None = None) -> int:
        """Claim the deliveries due (as many as free threads) and start their attempts; returns how many."""
        now = time.time() if now is None else now
        self.in_flight = {f for f in self.in_flight if not f.done()}
        free = self.settings.notifier_concurrency - len(self.in_flight)
        if free <= 0:
            return 0
        lease_until = now + self.settings.webhook_timeout_s + LEASE_MARGIN_S
        claimed = self.outbox.claim(now, lease_until=lease_until, limit=free)
        for delivery_id in claimed:
            self.in_flight.add(self.pool.submit(self.attempt, delivery_id))
        return len(claimed)

    def attempt(self, delivery_id: str) -> str:
        """One attempt of a claimed delivery, recorded; returns its outcome (``contracts.outbox.OUTCOMES``)."""
        try:
            delivery = self.outbox.delivery(delivery_id)
            if delivery is None:
                self.outbox.drop(delivery_id)
                return "gave_up"
            error: str | None = None
            try:
                status = self.post(delivery)
                if 300 <= status < 400:
                    error = f"HTTP {status}: redirects are not followed; give the final URL as notify.url"
                elif not 200 <= status < 300:
                    error = f"HTTP {status} from the receiver"
                outcome = "failed" if error else "delivered"
            except WebhookRefused as exc:
                outcome, error = "refused", str(exc)
            except (SecretMissing, httpx.HTTPError, OSError) as exc:
                outcome, error = "failed", f"{type(exc).__name__}: {exc}"
            return self._record(delivery, outcome, error)
        except Exception:  # its lease ends and another attempt follows; the loop goes on
            log.exception("webhook %s: attempt not recorded", delivery_id)
            return "failed"

    def _record(self, delivery: dict[str, Any], outcome: str, error: str | None) -> str:
        now = time.time()
        next_at: float | None = None
        if outcome != "delivered":
            if now - delivery["created_at"] >= self.settings.webhook_retry_window_s:
                outcome = "gave_up"
            else:
                next_at = now + retry_delay_s(delivery["attempts"] + 1, base_s=self.settings.webhook_retry_base_s,
                                              max_s=self.settings.webhook_retry_max_s)
        attempts = self.outbox.record(delivery, outcome=outcome, next_at=next_at,
                                      next_at_iso=iso_time(next_at) if next_at else None,
                                      error=error[:ERROR_CHARS] if error else None)
        log.log(logging.INFO if outcome == "delivered" else logging.WARNING,
                "job %s: webhook %s (%s) attempt %d: %s%s", delivery["job"], delivery["event"], delivery["id"],
                attempts, outcome, f" ({error})" if error else "",
                extra={"event": "webhook_attempt", "job_id": delivery["job"], "outcome": outcome})
        return outcome

    def secret_for(self, key_name: str) -> bytes:
        """The HMAC key of the API key named ``key_name`` (``JACOBIAN_WEBHOOK_SECRET`` without keys)."""
        if not self.settings.api_keys:
            if self.default_secret is None:
                raise SecretMissing("JACOBIAN_WEBHOOK_SECRET is not set in the notifier's environment")
            return self.default_secret
        if key_name not in self.secrets:
            raise SecretMissing(f"the API key {key_name!r} that submitted the job has no webhook_secret in "
                                "JACOBIAN_API_KEYS (any more)")
        return self.secrets[key_name]

    def post(self, delivery: dict[str, Any]) -> int:
        """POST the delivery, signed now, to the first address of its host once every address passed the
        allowlist; the status code. Raises ``WebhookRefused``, ``SecretMissing``, ``httpx.HTTPError``,
        ``OSError`` (no DNS answer)."""
        key = self.secret_for(delivery["key"])
        parts = urlsplit(delivery["url"])
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        addresses = resolve_host(host, port)
        self.allow.check_addresses(host, addresses)
        pinned = f"[{addresses[0]}]" if addresses[0].version == 6 else str(addresses[0])
        target = urlunsplit((parts.scheme, f"{pinned}:{port}", parts.path or "/", parts.query, ""))
        headers = signed_headers(key, delivery["id"], int(time.time()), delivery["body"]) | {"host": parts.netloc}
        extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
        with self.http.stream("POST", target, content=delivery["body"], headers=headers,
                              extensions=extensions) as response:
            return response.status_code

    # -- the loop ----------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """``scan`` and ``dispatch`` until ``stop`` is set; Redis errors are logged and waited out."""
        if self.allow.is_empty:
            log.warning("JACOBIAN_WEBHOOK_ALLOW is empty: webhooks are off, jobs cannot ask for notify")
        while not stop.is_set():
            try:
                busy = self.scan() + self.dispatch()
            except RedisError as exc:
                log.warning("notifier: Redis unavailable (%s); retrying in 1 s", exc)
                stop.wait(1.0)
                continue
            except Exception:  # noqa: BLE001 - a bug logged, not a notifier gone: deliveries wait in Redis
                log.exception("notifier: loop failed; going on in 1 s")
                stop.wait(1.0)
                continue
            stop.wait(0.01 if busy else self.settings.notifier_poll_s)

    def close(self) -> None:
        """Wait for the attempts in flight (each within ``JACOBIAN_WEBHOOK_TIMEOUT_S``), then close."""
        self.pool.shutdown(wait=True)
        self.http.close()


def run_notifier() -> None:
    """The ``jacobian notifier`` process: a ``Notifier`` on the configured Redis until SIGTERM or SIGINT."""
    settings = get_settings()
    configure_logging("notifier", fmt=settings.log_format, level=settings.log_level)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    connection = Redis.from_url(settings.redis_url, socket_connect_timeout=10, socket_timeout=10)
    notifier = Notifier(connection, settings)
    log.info("notifier started (allow: %s)", ", ".join(settings.webhook_allow) or "none: webhooks off")
    try:
        notifier.run(stop)
    finally:
        notifier.close()
        connection.close()
