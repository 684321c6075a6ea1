"""Job records in Redis: one hash per job, an index by creation time, idempotency keys. The rq job (same id)
only carries execution; this record is the truth clients read."""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, Field, ValidationError
from redis import Redis

from contracts.jobspec import ALLOWED_MOVES, JobStatus
from contracts.outbox import notify_block
from contracts.records import ErrorInfo, JobPublic, PlanInfo, Progress, ResultInfo, dump, iso_time
from contracts.webhooks import NotifyStatus


class JobNotFound(KeyError):
    """No job with this id."""


class CorruptRecord(RuntimeError):
    """A stored job record that does not read as a ``JobRecord`` or ``JobPublic`` (a bug of whoever wrote it)."""


class JobRecord(BaseModel):
    """A job as stored: ``progress``, ``plan``, ``result``, ``error``, ``notify`` as their records, parsed once
    when read and dumped once when written (with the keys they were given: ``"plan": {}`` before a plan).
    ``spec`` is the queued job's JSON, kept a dict: a stored record stays readable whatever the request rules of
    the code reading it (``QueuedJob`` forbids unknown keys), and readers take a few keys (``kind``, ``model``)."""

    id: str
    status: JobStatus
    spec: dict[str, Any]
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    progress: Progress = Field(default_factory=Progress.not_started)
    plan: PlanInfo = Field(default_factory=PlanInfo)
    result: ResultInfo | None = None
    error: ErrorInfo | None = None
    cancel_requested: bool = False
    deaths: list[str] = Field(default_factory=list)  # how each worker that died running it died, oldest first
    notify: NotifyStatus | None = None  # webhooks (from the spec and the delivery fields), None without notify

    def public(self) -> JobPublic:
        """The ``GET /v1/jobs/{id}`` body; ``CorruptRecord`` when the spec's ``kind`` or ``model`` do not fit."""
        try:
            return JobPublic(
                id=self.id, status=self.status, progress=self.progress, plan=self.plan, result=self.result,
                error=self.error, created_at=_iso(self.created_at), started_at=_iso(self.started_at),
                finished_at=_iso(self.finished_at), kind=self.spec.get("kind"), model=self.spec.get("model"),
                **({"notify": self.notify} if self.notify is not None else {}),
            )
        except ValidationError as err:
            raise CorruptRecord(f"job {self.id}: the stored record is not a JobPublic: {err}") from err

    def to_public(self) -> dict[str, Any]:
        """``public()`` as the JSON the API serves."""
        return dump(self.public())


def _iso(ts: float | None) -> str | None:
    return None if ts is None else iso_time(ts)


_RECORDS: dict[str, type[BaseModel]] = {"progress": Progress, "plan": PlanInfo, "result": ResultInfo,
                                        "error": ErrorInfo}  # the record fields, and their models
_NULLABLE = frozenset({"result", "error"})
_TRANSITION_FIELDS = frozenset({"started_at", "finished_at", "progress", "plan", "result", "error"})

# KEYS: the job hash, its shards hash. ARGV: the new status, TTL seconds (0: none), n, the n statuses it
# may move from, then field, value pairs. Returns -1 (no record), 0 (move not allowed: nothing written), 1.
_TRANSITION_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local current = redis.call('HGET', KEYS[1], 'status') or 'queued'
local n = tonumber(ARGV[3])
local allowed = false
for i = 4, 3 + n do
  if ARGV[i] == current then allowed = true end
end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], unpack(ARGV, 4 + n))
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
end
return 1
"""
# KEYS: the job hash. ARGV: field, value pairs. Returns 0 (no record, or the job ended: nothing written) or 1.
_SET_FIELDS_LUA = """
local ended = {succeeded = true, failed = true, canceled = true}
if redis.call('EXISTS', KEYS[1]) == 0 or ended[redis.call('HGET', KEYS[1], 'status')] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

# KEYS: the job hash. ARGV: how the worker died. Appends to the JSON list 'deaths'; returns it (nil: no record).
_RECORD_DEATH_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local raw = redis.call('HGET', KEYS[1], 'deaths')
local deaths = {}
if raw and raw ~= '' then deaths = cjson.decode(raw) end
table.insert(deaths, ARGV[1])
local out = cjson.encode(deaths)
redis.call('HSET', KEYS[1], 'deaths', out)
return out
"""


def merge_shard_progress(plan: dict[str, Any], shards: dict[int, dict[str, Any]]) -> Progress:
    """The progress of a sharded job: rows summed over shards, the rate summed over unfinished ones.

    ``plan`` is the stored shard plan (``rows_total``, ``ranges``); ``shards`` maps a shard index to
    its last progress snapshot (shards not started yet are absent and count as zero rows done).
    Returns ``Progress.of(...)``.
    """
    ranges = plan.get("ranges") or []
    rows_total = int(plan.get("rows_total") or sum(b - a for a, b in ranges))
    done = 0
    rate = 0.0
    for snap in shards.values():
        shard_done = int(snap.get("rows_done") or 0)
        done += shard_done
        if shard_done < int(snap.get("rows_total") or 0):
            rate += float(snap.get("rows_per_second") or 0.0)
    return Progress.of(min(done, rows_total), rows_total, rate)


class JobStore:
    """Reads and writes job records; every method may raise ``redis.RedisError``.

    A sharded job keeps, beside its record, a hash ``jacobian:job:{id}:shards``: ``plan`` (the shard
    plan, JSON), ``p{i}`` (shard ``i``'s last progress snapshot, JSON) and ``c{i}`` (rows shard ``i``
    computed over all its attempts). ``get`` and ``list`` return the record with its progress summed
    over the shards, so ``to_public()`` keeps its shape.
    """

    job_key_template = "jacobian:job:{id}"
    shards_key_template = "jacobian:job:{id}:shards"
    index_key = "jacobian:jobs"
    idempotency_key_template = "jacobian:idem:{key}"

    def __init__(self, connection: Redis, *, ttl_s: int | None = None) -> None:
        self.connection = connection
        self.ttl_s = ttl_s
        self._transition = connection.register_script(_TRANSITION_LUA)
        self._set_fields = connection.register_script(_SET_FIELDS_LUA)
        self._record_death = connection.register_script(_RECORD_DEATH_LUA)

    def key(self, job_id: str) -> str:
        return self.job_key_template.format(id=job_id)

    def create(self, record: JobRecord) -> None:
        """Store a new record and index it by creation time (no TTL: the job has not ended)."""
        mapping = self._encode(record)
        with self.connection.pipeline() as pipe:
            pipe.hset(self.key(record.id), mapping=mapping)
            pipe.zadd(self.index_key, {record.id: record.created_at})
            pipe.execute()

    def shards_key(self, job_id: str) -> str:
        return self.shards_key_template.format(id=job_id)

    def get(self, job_id: str) -> JobRecord:
        with self.connection.pipeline() as pipe:
            pipe.hgetall(self.key(job_id))
            pipe.hgetall(self.shards_key(job_id))
            raw, raw_shards = pipe.execute()
        if not raw:
            raise JobNotFound(job_id)
        return self._with_shards(self._decode(job_id, raw), raw_shards)

    def exists(self, job_id: str) -> bool:
        return bool(self.connection.exists(self.key(job_id)))

    def transition(self, job_id: str, to: JobStatus, **fields: Any) -> bool:
        """Move the job to status ``to`` if ``ALLOWED_MOVES`` allows it from its current status, writing
        ``fields`` and, for a terminal ``to``, the TTL of the record and its shards hash, all in one
        atomic step (a Lua script). Returns False, writing nothing, when the move is not allowed (e.g. a
        shard failing a job that was canceled meanwhile, or ``running`` to ``running``).

        ``fields``: ``started_at``, ``finished_at`` (seconds since the epoch), ``progress`` (a ``Progress``),
        ``plan`` (a ``PlanInfo``), ``result`` (a ``ResultInfo`` or None), ``error`` (an ``ErrorInfo``, or None
        to clear it). ``started_at`` defaults to now on a move to ``running``, ``finished_at`` to now on a
        move to a terminal status. Raises ``JobNotFound`` (no record), ``TypeError`` (another field, or a
        record field that is not its model), ``redis.RedisError``.
        """
        to = JobStatus(to)
        unknown = set(fields) - _TRANSITION_FIELDS
        if unknown:
            raise TypeError(f"transition: {', '.join(sorted(unknown))} cannot be set with a status; "
                            f"use one of {', '.join(sorted(_TRANSITION_FIELDS))} (or set_fields)")
        if to == JobStatus.running:
            fields.setdefault("started_at", time.time())
        if to.is_terminal:
            fields.setdefault("finished_at", time.time())
        sources = [s.value for s, moves in ALLOWED_MOVES.items() if to in moves]
        pairs = [item for pair in _encode_fields(fields).items() for item in pair]
        ttl_s = self.ttl_s if to.is_terminal and self.ttl_s else 0
        moved = self._transition(keys=[self.key(job_id), self.shards_key(job_id)],
                                 args=[to.value, ttl_s, len(sources), *sources, *pairs])
        if moved == -1:
            raise JobNotFound(job_id)
        return moved == 1

    def set_fields(self, job_id: str, *, progress: Progress | None = None, plan: PlanInfo | None = None,
                   cancel_requested: bool | None = None) -> bool:
        """Set the fields given (None: leave as is) of an existing record, never its status (see
        ``transition``): one ``HSET`` of those fields, the rest of the record is not rewritten. Returns False,
        writing nothing, when there is no record (it expired) or the job ended (a late report of a worker cut off
        from Redis while another finished the job changes nothing). Raises ``TypeError`` (a record not its model),
        ``redis.RedisError``.
        """
        given = {"progress": progress, "plan": plan, "cancel_requested": cancel_requested}
        mapping = _encode_fields({name: value for name, value in given.items() if value is not None})
        if not mapping:
            return self.exists(job_id)
        pairs = [item for pair in mapping.items() for item in pair]
        return self._set_fields(keys=[self.key(job_id)], args=pairs) == 1

    def record_death(self, job_id: str, how: str) -> list[str]:
        """Count one more death of a worker running the job (``how`` it died), atomically; returns every death
        recorded so far, oldest first. Raises ``JobNotFound`` (no record), ``redis.RedisError``."""
        out = self._record_death(keys=[self.key(job_id)], args=[how])
        if out is None:
            raise JobNotFound(job_id)
        return [str(d) for d in json.loads(out)]

    def delete(self, job_id: str) -> bool:
        """Remove the job's record, its index entry and its shards hash (one transaction); True when a
        record was there. The job's files in storage are the caller's. Raises ``redis.RedisError``."""
        with self.connection.pipeline() as pipe:
            pipe.delete(self.key(job_id))
            pipe.zrem(self.index_key, job_id)
            pipe.delete(self.shards_key(job_id))
            deleted, _, _ = pipe.execute()
        return bool(deleted)

    def is_cancel_requested(self, job_id: str) -> bool:
        return self.connection.hget(self.key(job_id), "cancel_requested") == b"1"

    def should_stop(self, job_id: str) -> bool:
        """True when a cancel was requested or the job already ended (e.g. another shard failed it)."""
        cancel, status = self.connection.hmget(self.key(job_id), ["cancel_requested", "status"])
        if cancel == b"1":
            return True
        return status is not None and JobStatus(status.decode()).is_terminal

    # -- shards -----------------------------------------------------------------------------------

    def set_shard_plan(self, job_id: str, plan: dict[str, Any]) -> dict[str, Any]:
        """Store ``plan`` unless one is stored already; returns the stored plan (the first one wins)."""
        key = self.shards_key(job_id)
        self.connection.hsetnx(key, "plan", json.dumps(plan))
        return json.loads(self.connection.hget(key, "plan"))

    def shard_plan(self, job_id: str) -> dict[str, Any] | None:
        """The stored shard plan (``shards``, ``ranges``, ``rows_total``, ``strategy``), None when unsharded."""
        raw = self.connection.hget(self.shards_key(job_id), "plan")
        return json.loads(raw) if raw else None

    def update_shard_progress(self, job_id: str, index: int, progress: Progress, *, computed_rows: int = 0) -> None:
        """Shard ``index``'s progress snapshot (every key); ``computed_rows`` adds to its rows computed (all
        attempts)."""
        key = self.shards_key(job_id)
        with self.connection.pipeline() as pipe:
            pipe.hset(key, f"p{index}", json.dumps(progress.model_dump(mode="json")))
            if computed_rows:
                pipe.hincrby(key, f"c{index}", computed_rows)
            pipe.execute()

    def set_shard_run_plan(self, job_id: str, index: int, plan: PlanInfo | dict[str, Any]) -> None:
        """Shard ``index``'s own run plan (chunk rows, memory): kept beside the job's plan, never over it."""
        self.connection.hset(self.shards_key(job_id), f"q{index}", json.dumps(dump(plan)))

    def shard_progress(self, job_id: str) -> dict[int, dict[str, Any]]:
        """Per shard: its last progress snapshot plus ``rows_computed`` (over all its attempts) and
        ``plan`` (its run plan, None before it planned)."""
        raw = {k.decode(): v for k, v in self.connection.hgetall(self.shards_key(job_id)).items()}
        plan = json.loads(raw["plan"]) if "plan" in raw else {}
        out: dict[int, dict[str, Any]] = {}
        for i in range(int(plan.get("shards") or 0)):
            snap = json.loads(raw[f"p{i}"]) if f"p{i}" in raw else {}
            out[i] = {**snap, "rows_computed": int(raw.get(f"c{i}", b"0")),
                      "plan": json.loads(raw[f"q{i}"]) if f"q{i}" in raw else None}
        return out

    def _with_shards(self, record: JobRecord, raw_shards: dict[bytes, bytes]) -> JobRecord:
        """``record`` with its progress summed over its shards (unchanged when it has none)."""
        if not raw_shards or b"plan" not in raw_shards or record.status == JobStatus.succeeded:
            return record  # a succeeded job keeps the progress its finalizer wrote
        plan = json.loads(raw_shards[b"plan"])
        if int(plan.get("shards") or 1) < 2:
            return record
        snaps: dict[int, dict[str, Any]] = {}
        for name, value in raw_shards.items():
            key = name.decode()
            if key.startswith("p") and key[1:].isdigit():
                snaps[int(key[1:])] = json.loads(value)
        record.progress = merge_shard_progress(plan, snaps)
        return record

    def list(self, *, status: JobStatus | None = None, limit: int = 50,
             before: float | None = None, before_id: str | None = None) -> list[JobRecord]:
        """Newest first, ties in ``created_at`` by id descending (the index's own order).

        ``before`` and ``before_id`` are the ``created_at`` and id of the last record of the previous
        page: jobs created in the same instant on two API processes are neither skipped nor repeated.
        """
        out: list[JobRecord] = []
        if before is None:
            max_score: float | str = "+inf"
        else:
            max_score = before if before_id is not None else f"({before}"
        offset = 0
        batch = max(limit * 2, 50)
        while len(out) < limit:
            scored = self.connection.zrevrangebyscore(self.index_key, max_score, "-inf", start=offset, num=batch,
                                                      withscores=True)
            if not scored:
                break
            offset += len(scored)
            ids = [job_id for job_id, score in scored
                   if before_id is None or score != before or job_id.decode() < before_id]
            with self.connection.pipeline() as pipe:
                for job_id in ids:
                    pipe.hgetall(self.key(job_id.decode()))
                    pipe.hgetall(self.shards_key(job_id.decode()))
                replies = pipe.execute()
            for job_id, raw, raw_shards in zip(ids, replies[0::2], replies[1::2]):
                if not raw:
                    self.connection.zrem(self.index_key, job_id)
                    continue
                rec = self._with_shards(self._decode(job_id.decode(), raw), raw_shards)
                if status is None or rec.status == status:
                    out.append(rec)
                    if len(out) == limit:
                        break
        return out

    def claim_idempotency_key(self, key: str, *, job_id: str, body_hash: str, ttl_s: int) -> tuple[str, str]:
        """Record ``key -> (job_id, body_hash)`` unless present; returns what is stored."""
        rkey = self.idempotency_key_template.format(key=key)
        self.connection.set(rkey, json.dumps([job_id, body_hash]), nx=True, ex=ttl_s)
        stored = json.loads(self.connection.get(rkey) or json.dumps([job_id, body_hash]))
        return stored[0], stored[1]

    def release_idempotency_key(self, key: str) -> None:
        self.connection.delete(self.idempotency_key_template.format(key=key))

    @staticmethod
    def _encode(record: JobRecord) -> dict[str, str]:
        """The whole record as hash values (``create``); later writes set single fields (``_encode_fields``)."""
        return {
            "status": record.status.value,
            "spec": json.dumps(record.spec),
            "created_at": repr(record.created_at),
            "started_at": "" if record.started_at is None else repr(record.started_at),
            "finished_at": "" if record.finished_at is None else repr(record.finished_at),
            **{name: _record_json(name, getattr(record, name)) for name in _RECORDS},
            "cancel_requested": "1" if record.cancel_requested else "0",
            "deaths": json.dumps(record.deaths),
        }

    @staticmethod
    def _decode(job_id: str, raw: dict[bytes, bytes]) -> JobRecord:
        """The record from its hash, each record field parsed into its model; ``CorruptRecord`` when one does
        not fit (a field missing or empty, as in records older than it, reads as its default)."""
        d = {k.decode(): v.decode() for k, v in raw.items()}

        def parsed(name: str, parse: Any, default: Any) -> Any:
            try:
                return parse(d[name]) if d.get(name) else default
            except ValueError as err:
                raise CorruptRecord(f"job {job_id}: the stored {name} {d[name][:80]!r} does not parse: {err}") from err

        spec = parsed("spec", json.loads, {})
        try:
            return JobRecord(
                id=job_id, status=d.get("status", "queued"), spec=spec,
                created_at=parsed("created_at", float, 0.0), started_at=parsed("started_at", float, None),
                finished_at=parsed("finished_at", float, None), progress=parsed("progress", json.loads, {}),
                plan=parsed("plan", json.loads, {}), result=parsed("result", json.loads, None),
                error=parsed("error", json.loads, None), cancel_requested=d.get("cancel_requested") == "1",
                deaths=parsed("deaths", json.loads, []), notify=notify_block(spec, d),
            )
        except ValidationError as err:  # names the field
            raise CorruptRecord(f"job {job_id}: the stored record does not read as a JobRecord: {err}") from err


def _record_json(name: str, value: Any) -> str:
    """The hash value of record field ``name``: its model dumped with the keys it was given (``null`` for a
    ``result`` or ``error`` of None). ``TypeError`` for anything else, before anything is written."""
    model = _RECORDS[name]
    if isinstance(value, model) or (value is None and name in _NULLABLE):
        return json.dumps(dump(value))
    raise TypeError(f"{name}: give a contracts.records.{model.__name__}"
                    f"{' or None' if name in _NULLABLE else ''}, not {type(value).__name__} "
                    f"(a dict: {model.__name__}.model_validate(it))")


def _encode_fields(fields: dict[str, Any]) -> dict[str, str]:
    """Hash values of record fields: JSON for the records (``_record_json``), ``"1"``/``"0"`` for
    ``cancel_requested``, ``repr`` for times, ``""`` for None."""
    mapping: dict[str, str] = {}
    for name, value in fields.items():
        if name in _RECORDS:
            mapping[name] = _record_json(name, value)
        elif name == "status":
            mapping[name] = JobStatus(value).value
        elif name == "cancel_requested":
            mapping[name] = "1" if value else "0"
        elif value is None:
            mapping[name] = ""
        else:
            mapping[name] = str(value)
    return mapping
