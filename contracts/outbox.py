"""The webhook outbox in Redis: jobs watched for events, deliveries due by time, each delivery's state.

Keys (all survive an API, worker or notifier restart; Redis with its append-only file keeps them):

- ``jacobian:notify:watch``: sorted set of the ids of jobs with a ``notify`` whose events are not all
  emitted yet, scored by when a notifier reads the job next;
- ``jacobian:notify:outbox``: sorted set of delivery ids scored by when the next attempt is due (a claimed
  delivery is pushed ``lease_s`` ahead: one notifier has it, and another takes it over after a crash);
- ``jacobian:notify:delivery:{id}``: the delivery (job, event, url, API key name, the body as first built,
  when it was first due, attempts), expiring after the retry window and a day;
- ``jacobian:notify:counts``: attempts by ``{event}:{outcome}``, for the API's ``/metrics``;
- in the job's own hash: ``notify_seen`` (what was emitted last: status, rows, when) and ``notify:{event}``
  (the event's last delivery, ``contracts.webhooks.NotifyDelivery``), shown as the status's ``notify`` block.

Emitting an event is one Lua step that compares ``notify_seen`` first, so several notifiers never emit one
twice; recording an attempt is one Lua step too (attempts, outbox, the job's block and the counter).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from redis import Redis

from contracts.webhooks import NotifyStatus

WATCH_KEY = "jacobian:notify:watch"
OUTBOX_KEY = "jacobian:notify:outbox"
DELIVERY_KEY_TEMPLATE = "jacobian:notify:delivery:{id}"
COUNTS_KEY = "jacobian:notify:counts"
JOB_KEY_TEMPLATE = "jacobian:job:{id}"  # contracts.jobstore.JobStore.job_key_template
SEEN_FIELD = "notify_seen"
DELIVERY_FIELD_PREFIX = "notify:"
OUTCOMES = ("delivered", "failed", "refused", "gave_up")

# KEYS: job hash, outbox, delivery hash, watch. ARGV: job id, expected seen, new seen, delivery id ('' for
# none), event, body, url, key name, now, delivery TTL, the job's delivery block, terminal (1/0).
# Returns -1 (no job: unwatched), 0 (seen changed meanwhile: nothing written), 1.
_EMIT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('ZREM', KEYS[4], ARGV[1])
  return -1
end
local seen = redis.call('HGET', KEYS[1], 'notify_seen') or ''
if seen ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'notify_seen', ARGV[3])
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[3], 'job', ARGV[1], 'event', ARGV[5], 'body', ARGV[6], 'url', ARGV[7], 'key', ARGV[8],
             'created_at', ARGV[9], 'attempts', 0)
  redis.call('EXPIRE', KEYS[3], ARGV[10])
  redis.call('ZADD', KEYS[2], ARGV[9], ARGV[4])
  redis.call('HSET', KEYS[1], 'notify:' .. ARGV[5], ARGV[11])
end
if ARGV[12] == '1' then redis.call('ZREM', KEYS[4], ARGV[1]) end
return 1
"""

# KEYS: outbox. ARGV: now, lease until, how many. Returns the delivery ids claimed.
_CLAIM_LUA = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, id in ipairs(due) do redis.call('ZADD', KEYS[1], ARGV[2], id) end
return due
"""

# KEYS: delivery hash, outbox, job hash, counts. ARGV: delivery id, outcome, next attempt (epoch; '' for
# none), its ISO text, last error ('' for none). Returns the attempts made, or -1 (the delivery expired).
_RECORD_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return -1
end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
local event = redis.call('HGET', KEYS[1], 'event')
if ARGV[3] ~= '' then
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
else
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HSET', KEYS[1], 'done', ARGV[2])
end
redis.call('HINCRBY', KEYS[4], event .. ':' .. ARGV[2], 1)
local raw = redis.call('HGET', KEYS[3], 'notify:' .. event)
if raw then
  local block = cjson.decode(raw)
  if block['id'] == ARGV[1] then
    block['attempts'] = attempts
    block['delivered'] = ARGV[2] == 'delivered'
    block['gave_up'] = ARGV[2] == 'gave_up'
    if ARGV[5] ~= '' then block['last_error'] = ARGV[5] else block['last_error'] = cjson.null end
    if ARGV[4] ~= '' then block['next_attempt_at'] = ARGV[4] else block['next_attempt_at'] = cjson.null end
    redis.call('HSET', KEYS[3], 'notify:' .. event, cjson.encode(block))
  end
end
return attempts
"""


def new_delivery_id() -> str:
    """A delivery id (the ``webhook-id``): ``msg_`` and 32 hex digits."""
    return "msg_" + uuid.uuid4().hex


def notify_block(spec: dict[str, Any], fields: dict[str, str]) -> dict[str, Any] | None:
    """The status's ``notify`` block from the job's spec and its hash fields (decoded); None without notify."""
    notify = spec.get("notify")
    if not notify:
        return None
    deliveries = {name.removeprefix(DELIVERY_FIELD_PREFIX): json.loads(value) for name, value in fields.items()
                  if name.startswith(DELIVERY_FIELD_PREFIX) and value}
    return NotifyStatus(url=notify["url"], events=notify["events"], deliveries=deliveries).model_dump(mode="json")


class Outbox:
    """The outbox's Redis operations; every method may raise ``redis.RedisError``."""

    def __init__(self, connection: Redis) -> None:
        self.connection = connection
        self._emit = connection.register_script(_EMIT_LUA)
        self._claim = connection.register_script(_CLAIM_LUA)
        self._record = connection.register_script(_RECORD_LUA)

    def watch(self, job_id: str, *, at: float) -> None:
        """Have a notifier read job ``job_id`` from ``at`` on (at POST, after the record is created)."""
        self.connection.zadd(WATCH_KEY, {job_id: at})

    def due_jobs(self, now: float, *, next_at: float, limit: int) -> list[str]:
        """Up to ``limit`` watched jobs due at ``now``, each put off to ``next_at``."""
        ids = [i.decode() for i in self.connection.zrangebyscore(WATCH_KEY, "-inf", now, start=0, num=limit)]
        if ids:
            self.connection.zadd(WATCH_KEY, {i: next_at for i in ids}, xx=True)
        return ids

    def unwatch(self, job_id: str) -> None:
        self.connection.zrem(WATCH_KEY, job_id)

    def seen(self, job_id: str) -> str:
        """What was emitted last for the job (``notify_seen``, JSON; '' before the first event)."""
        raw = self.connection.hget(JOB_KEY_TEMPLATE.format(id=job_id), SEEN_FIELD)
        return raw.decode() if raw else ""

    def emit(self, job_id: str, *, expected_seen: str, new_seen: str, delivery: dict[str, Any] | None,
             terminal: bool, now: float, ttl_s: int) -> int:
        """Move ``notify_seen`` from ``expected_seen`` to ``new_seen`` and, with ``delivery`` (``id``, ``event``,
        ``body``, ``url``, ``key``, ``block``), queue it due now; ``terminal`` unwatches the job. All or nothing:
        -1 no job (unwatched), 0 someone emitted first, 1 done."""
        d = delivery or {}
        key = DELIVERY_KEY_TEMPLATE.format(id=d.get("id", "none"))
        return int(self._emit(
            keys=[JOB_KEY_TEMPLATE.format(id=job_id), OUTBOX_KEY, key, WATCH_KEY],
            args=[job_id, expected_seen, new_seen, d.get("id", ""), d.get("event", ""), d.get("body", b""),
                  d.get("url", ""), d.get("key", ""), repr(now), ttl_s, json.dumps(d.get("block", {})),
                  "1" if terminal else "0"]))

    def claim(self, now: float, *, lease_until: float, limit: int) -> list[str]:
        """Up to ``limit`` deliveries due at ``now``, each leased to the caller until ``lease_until``."""
        return [i.decode() for i in self._claim(keys=[OUTBOX_KEY], args=[repr(now), repr(lease_until), limit])]

    def drop(self, delivery_id: str) -> None:
        """Take a delivery out of the outbox (its record expired)."""
        self.connection.zrem(OUTBOX_KEY, delivery_id)

    def delivery(self, delivery_id: str) -> dict[str, Any] | None:
        """The stored delivery (``job``, ``event``, ``body`` bytes, ``url``, ``key``, ``created_at``,
        ``attempts``), None once it expired."""
        raw = self.connection.hgetall(DELIVERY_KEY_TEMPLATE.format(id=delivery_id))
        if not raw:
            return None
        d: dict[str, Any] = {k.decode(): v for k, v in raw.items()}
        return {"id": delivery_id, "job": d["job"].decode(), "event": d["event"].decode(), "body": d["body"],
                "url": d["url"].decode(), "key": d["key"].decode(), "created_at": float(d["created_at"]),
                "attempts": int(d["attempts"]), "done": d["done"].decode() if "done" in d else None}

    def record(self, delivery: dict[str, Any], *, outcome: str, next_at: float | None, next_at_iso: str | None,
               error: str | None) -> int:
        """One attempt of ``delivery``: ``outcome`` (of ``OUTCOMES``) counted, the next attempt due at
        ``next_at`` (None: none, the delivery is done) and the job's block updated; returns attempts made."""
        assert outcome in OUTCOMES, outcome
        return int(self._record(
            keys=[DELIVERY_KEY_TEMPLATE.format(id=delivery["id"]), OUTBOX_KEY,
                  JOB_KEY_TEMPLATE.format(id=delivery["job"]), COUNTS_KEY],
            args=[delivery["id"], outcome, "" if next_at is None else repr(next_at), next_at_iso or "",
                  error or ""]))

    def counts(self) -> dict[tuple[str, str], int]:
        """Attempts so far by ``(event, outcome)``."""
        out: dict[tuple[str, str], int] = {}
        for name, value in self.connection.hgetall(COUNTS_KEY).items():
            event, _, outcome = name.decode().partition(":")
            out[(event, outcome)] = int(value)
        return out

    def pending(self) -> int:
        """Deliveries in the outbox (due or waiting for a retry)."""
        return int(self.connection.zcard(OUTBOX_KEY))

    def watched(self) -> int:
        """Jobs watched for events."""
        return int(self.connection.zcard(WATCH_KEY))
