"""Job records in Redis: one hash per job, an index by creation time, idempotency keys.

The rq job (same id) only carries execution; this record is the truth clients read.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from redis import Redis

from contracts.jobspec import JobStatus


class JobNotFound(KeyError):
    """No job with this id."""


@dataclass
class JobRecord:
    id: str
    status: JobStatus
    spec: dict[str, Any]
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    progress: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    cancel_requested: bool = False

    def to_public(self) -> dict[str, Any]:
        """The ``GET /v1/jobs/{id}`` body."""
        return {
            "id": self.id, "status": self.status.value, "progress": self.progress, "plan": self.plan,
            "result": self.result, "error": self.error, "created_at": _iso(self.created_at),
            "started_at": _iso(self.started_at), "finished_at": _iso(self.finished_at),
            "kind": self.spec.get("kind"), "model": self.spec.get("model"),
        }


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int((ts % 1) * 1000):03d}Z"


_JSON_FIELDS = ("spec", "progress", "plan", "result", "error")
_FLOAT_FIELDS = ("created_at", "started_at", "finished_at")


def merge_shard_progress(plan: dict[str, Any], shards: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The progress of a sharded job: rows summed over shards, the rate summed over unfinished ones.

    ``plan`` is the stored shard plan (``rows_total``, ``ranges``); ``shards`` maps a shard index to
    its last progress snapshot (shards not started yet are absent and count as zero rows done).
    """
    ranges = plan.get("ranges") or []
    rows_total = int(plan.get("rows_total") or sum(b - a for a, b in ranges))
    done = 0
    rate = 0.0
    for index, snap in shards.items():
        shard_done = int(snap.get("rows_done") or 0)
        done += shard_done
        if shard_done < int(snap.get("rows_total") or 0):
            rate += float(snap.get("rows_per_second") or 0.0)
    done = min(done, rows_total)
    left = rows_total - done
    return {"rows_done": done, "rows_total": rows_total,
            "fraction": 1.0 if rows_total == 0 else round(done / rows_total, 6),
            "rows_per_second": round(rate, 3),
            "eta_seconds": 0.0 if left == 0 else (round(left / rate, 3) if rate > 0 else None)}


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

    def key(self, job_id: str) -> str:
        return self.job_key_template.format(id=job_id)

    def create(self, record: JobRecord) -> None:
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

    def update(self, job_id: str, **fields: Any) -> None:
        """Set some fields (JSON-encoded where structured); status given as ``JobStatus``."""
        mapping: dict[str, str] = {}
        for name, value in fields.items():
            if name in _JSON_FIELDS:
                mapping[name] = json.dumps(value)
            elif name == "status":
                mapping[name] = JobStatus(value).value
            elif name == "cancel_requested":
                mapping[name] = "1" if value else "0"
            elif value is None:
                mapping[name] = ""
            else:
                mapping[name] = str(value)
        if mapping:
            self.connection.hset(self.key(job_id), mapping=mapping)
        if self.ttl_s and fields.get("status") and JobStatus(fields["status"]).is_terminal:
            self.connection.expire(self.key(job_id), self.ttl_s)
            self.connection.expire(self.shards_key(job_id), self.ttl_s)

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

    def update_shard_progress(self, job_id: str, index: int, progress: dict[str, Any], *,
                              computed_rows: int = 0) -> None:
        """Shard ``index``'s progress snapshot; ``computed_rows`` adds to its rows computed (all attempts)."""
        key = self.shards_key(job_id)
        with self.connection.pipeline() as pipe:
            pipe.hset(key, f"p{index}", json.dumps(progress))
            if computed_rows:
                pipe.hincrby(key, f"c{index}", computed_rows)
            pipe.execute()

    def shard_progress(self, job_id: str) -> dict[int, dict[str, Any]]:
        """Per shard: its last progress snapshot plus ``rows_computed`` (over all its attempts)."""
        raw = {k.decode(): v for k, v in self.connection.hgetall(self.shards_key(job_id)).items()}
        plan = json.loads(raw["plan"]) if "plan" in raw else {}
        out: dict[int, dict[str, Any]] = {}
        for i in range(int(plan.get("shards") or 0)):
            snap = json.loads(raw[f"p{i}"]) if f"p{i}" in raw else {}
            out[i] = {**snap, "rows_computed": int(raw.get(f"c{i}", b"0"))}
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
        return {
            "status": record.status.value,
            "spec": json.dumps(record.spec),
            "created_at": repr(record.created_at),
            "started_at": "" if record.started_at is None else repr(record.started_at),
            "finished_at": "" if record.finished_at is None else repr(record.finished_at),
            "progress": json.dumps(record.progress),
            "plan": json.dumps(record.plan),
            "result": json.dumps(record.result),
            "error": json.dumps(record.error),
            "cancel_requested": "1" if record.cancel_requested else "0",
        }

    @staticmethod
    def _decode(job_id: str, raw: dict[bytes, bytes]) -> JobRecord:
        d = {k.decode(): v.decode() for k, v in raw.items()}

        def f(name: str) -> float | None:
            return float(d[name]) if d.get(name) else None

        def j(name: str, default: Any) -> Any:
            return json.loads(d[name]) if d.get(name) else default

        return JobRecord(
            id=job_id, status=JobStatus(d.get("status", "queued")), spec=j("spec", {}),
            created_at=f("created_at") or 0.0, started_at=f("started_at"), finished_at=f("finished_at"),
            progress=j("progress", {}), plan=j("plan", {}), result=j("result", None), error=j("error", None),
            cancel_requested=d.get("cancel_requested") == "1",
        )
