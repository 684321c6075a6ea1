"""Webhooks of a job: the request's ``notify`` block, Standard Webhooks signatures, the retry schedule.

A delivery is one HTTP POST of a JSON body to ``notify.url`` with the headers of the Standard Webhooks
convention (https://www.standardwebhooks.com): ``webhook-id`` (the delivery id, the same on every retry:
receivers de-duplicate on it), ``webhook-timestamp`` (Unix seconds of this attempt) and
``webhook-signature: v1,<base64 of HMAC-SHA256(secret, "{id}.{timestamp}.{body}")>``. Secrets are written
``whsec_<base64>``; the HMAC key is the decoded bytes (as the Standard Webhooks libraries read them).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import random
from enum import Enum
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

SECRET_PREFIX = "whsec_"
SECRET_MIN_BYTES = 24
SECRET_MAX_BYTES = 64
MAX_URL_CHARS = 2048
MAKE_SECRET = "python -c \"import base64, os; print('whsec_' + base64.b64encode(os.urandom(32)).decode())\""


class NotifyEvent(str, Enum):
    """What a job's webhook tells: its end (``succeeded``, ``failed``, ``canceled``) or ``progress``."""

    succeeded = "succeeded"
    failed = "failed"
    canceled = "canceled"
    progress = "progress"


DEFAULT_EVENTS = [NotifyEvent.succeeded, NotifyEvent.failed, NotifyEvent.canceled]


class Notify(BaseModel):
    """The request's ``notify``: POST a signed JSON body to ``url`` on each of ``events``."""

    model_config = ConfigDict(extra="forbid")
    url: str = Field(min_length=1, max_length=MAX_URL_CHARS, description="http(s) URL the service POSTs each "
                     "event to; its host must be allowed by the operator (JACOBIAN_WEBHOOK_ALLOW: hosts and "
                     "networks); never a link-local or cloud metadata address. See README 'Webhooks'")
    events: list[NotifyEvent] = Field(default_factory=lambda: list(DEFAULT_EVENTS), min_length=1, max_length=4,
                                      description="which of 'succeeded', 'failed', 'canceled' (the job's end) and "
                                      "'progress' (rows done, at most one every JACOBIAN_WEBHOOK_PROGRESS_S) to "
                                      "deliver; default the three ends")

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url[:80]!r} is not an http(s) URL with a host; give e.g. "
                             "'https://hooks.example.com/jacobian'")
        if parts.username is not None or parts.password is not None:
            raise ValueError("has user:password@; the deliveries are signed instead, drop the credentials")
        if parts.fragment:
            raise ValueError("has a #fragment, which is never sent; drop it")
        try:
            parts.port  # noqa: B018 - raises on a port outside 0..65535
        except ValueError:
            raise ValueError(f"{url[:80]!r} has an invalid port; give one of 1 to 65535") from None
        return url

    @field_validator("events")
    @classmethod
    def _unique(cls, events: list[NotifyEvent]) -> list[NotifyEvent]:
        if len(set(events)) != len(events):
            raise ValueError("lists an event twice; name each once")
        return events


class NotifyDelivery(BaseModel):
    """The last delivery of one event of a job, as ``GET /v1/jobs/{id}`` shows it under ``notify.deliveries``."""

    id: str = Field(description="the webhook-id of the delivery (receivers de-duplicate on it)")
    delivered: bool = Field(description="true once the receiver answered 2xx")
    attempts: int = Field(description="attempts made so far")
    gave_up: bool = Field(False, description="true when no attempt succeeded within JACOBIAN_WEBHOOK_RETRY_WINDOW_S")
    last_error: str | None = Field(None, description="why the last attempt failed (status code or error); null "
                                   "once delivered")
    next_attempt_at: str | None = Field(None, description="when the next attempt is due (ISO 8601 UTC); null when "
                                        "delivered or given up")
    count: int = Field(1, description="deliveries of this event made for the job so far (progress: several)")


class NotifyStatus(BaseModel):
    """The ``notify`` block of a job's status: where and what it delivers, and each event's last delivery."""

    url: str
    events: list[NotifyEvent]
    deliveries: dict[str, NotifyDelivery] = Field(default_factory=dict, description="by event: its last "
                                                  "delivery; an event not reached yet is absent")


def parse_secret(secret: str, *, field: str) -> bytes:
    """The HMAC key of a ``whsec_<base64>`` secret; ``ValueError`` naming ``field`` and the fix otherwise."""
    fix = f"write it as 'whsec_' and the base64 of {SECRET_MIN_BYTES} to {SECRET_MAX_BYTES} random bytes: {MAKE_SECRET}"
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"{field}: does not start with {SECRET_PREFIX!r}; {fix}")
    try:
        key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field}: is not valid base64 after {SECRET_PREFIX!r}; {fix}") from None
    if not SECRET_MIN_BYTES <= len(key) <= SECRET_MAX_BYTES:
        raise ValueError(f"{field}: decodes to {len(key)} bytes; {fix}")
    return key


def signature(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: ``v1,`` and the base64 HMAC-SHA256 of ``{id}.{timestamp}.{body}``."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def signed_headers(key: bytes, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The headers of one delivery attempt (Standard Webhooks) with the body's content type."""
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(key, msg_id, timestamp, body), "content-type": "application/json"}


def retry_delay_s(attempts: int, *, base_s: float, max_s: float, rng: random.Random | None = None) -> float:
    """Seconds to wait after the ``attempts``-th failed attempt: exponential, ``base_s * 2**(attempts - 1)``
    capped at ``max_s``, with equal jitter (a uniform draw from the upper half: ``[d/2, d]``), so that
    deliveries failed together do not retry together. E.g. base 5 s, max 3600 s: about 5, 10, 20, 40 s, ...,
    then hourly."""
    delay = min(max_s, base_s * 2 ** max(0, attempts - 1))
    return delay / 2 + (rng or random).uniform(0, delay / 2)
