"""Per-key quotas counted in Redis: jobs queued and running, result bytes per UTC day, the request rate.

Jobs are not counted up and down: a key's jobs in flight are a sorted set of job ids (``jacobian:quota:{name}:jobs``,
scored by admission time), and what they are is read from their records when counted. So whatever ends a job (the
worker's success or failure, a cancel, a dead worker failed by maintenance, a record that expired) frees its slot
with no release step to forget: the set is only an index of which records to read. An admission checks and adds in
one Lua script, so concurrent POSTs never pass a limit together. A succeeded job's result bytes are added to its
UTC day's counter when the set is next read (``settle``: at every POST, ``GET /v1/usage`` and metrics scrape),
exactly once (the id's removal from the set and the addition are one Lua step).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pydantic import ValidationError
from redis import Redis

from app.errors import QuotaExceeded
from app.metrics import QUOTA_REJECTIONS
from contracts.jobspec import JobStatus
from contracts.jobstore import JobStore
from contracts.quotas import (
    ANONYMOUS,
    CONCURRENT,
    QUEUED,
    REQUESTS,
    RESULT_BYTES,
    Bucket,
    LimitUsage,
    QuotaLimits,
    QuotaUsage,
    result_bytes,
    seconds_to_utc_midnight,
    utc_day,
)
from contracts.records import Progress, ResultInfo
from contracts.settings import ApiKey, Settings

log = logging.getLogger(__name__)

PENDING_S = 900.0
"""An admitted job whose record is not written yet (its inputs are being stored) counts as queued for this long;
after it, an id without a record is dropped (an API process that died between admission and record)."""
JOB_SLOT_RETRY_AFTER_S = 30
"""Retry-After of a job-count refusal when no running job of the key has an ETA and none of its jobs has ended
lately (else the key's recent job time, at most this)."""
JOB_TIME_WEIGHT = 0.3
"""Weight of an ended job's running time in the key's moving average of job times."""
_DAY_KEY_TTL_S = 3 * 86400

# KEYS: the key's jobs set, its bytes counter of today. ARGV: job id, now, pending_s, max_concurrent, max_queued,
# max_result_bytes_per_day (-1: none), the job hash key prefix. Returns {limit refused or '', usage, max}.
_ADMIT_LUA = """
local now, pending = tonumber(ARGV[2]), tonumber(ARGV[3])
local max_c, max_q, max_b = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if max_b >= 0 then
  local used = tonumber(redis.call('GET', KEYS[2]) or '0')
  if used >= max_b then return {'result_bytes_per_day', used, max_b} end
end
if max_c >= 0 or max_q >= 0 then
  local queued, running = 0, 0
  local members = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  for i = 1, #members, 2 do
    local status = redis.call('HGET', ARGV[7] .. members[i], 'status')
    if status == 'running' then running = running + 1
    elseif status == 'queued' or (not status and tonumber(members[i + 1]) > now - pending) then queued = queued + 1 end
  end
  if max_c >= 0 and queued + running >= max_c then return {'concurrent', queued + running, max_c} end
  if max_q >= 0 and queued >= max_q then return {'queued', queued, max_q} end
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
return {'', 0, 0}
"""
# KEYS: the jobs set, the bytes counter of the job's day. ARGV: job id, its result bytes, the counter's TTL.
_SETTLE_LUA = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 and tonumber(ARGV[2]) > 0 then
  redis.call('INCRBY', KEYS[2], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
end
return 1
"""
# KEYS: the bucket hash. ARGV: now, rate per second, size, TTL. Returns {1 taken or 0, tokens left or retry-after
# in seconds, as strings}: contracts.quotas.take_token, step for step.
_TAKE_LUA = """
local now, rate, size = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = size
if state[1] then
  tokens = math.min(size, tonumber(state[1]) + math.max(0, now - tonumber(state[2])) * rate)
end
local taken = 0
if tokens >= 1 then tokens = tokens - 1; taken = 1 end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 'at', string.format('%.17g', now))
redis.call('EXPIRE', KEYS[1], ARGV[4])
if taken == 1 then return {1, string.format('%.17g', tokens)} end
return {0, string.format('%.17g', (1 - tokens) / rate)}
"""


def quota_name(api_key: ApiKey | None) -> str:
    """Whose quotas a request uses: its key's name, or ``anonymous`` without API keys."""
    return api_key.name if api_key is not None else ANONYMOUS


@dataclass
class JobCounts:
    """A key's jobs in flight as their records say: queued (or admitted, record not written yet), running, and
    the ETAs (seconds) the running ones report."""

    queued: int = 0
    running: int = 0
    etas_s: list[float] = field(default_factory=list)
    job_s: float | None = None   # the key's recent job running time (moving average), None before one ended

    def retry_after_s(self) -> int:
        """When a job slot should be free: the shortest ETA of a running job, else the key's recent job time (at
        most ``JOB_SLOT_RETRY_AFTER_S``: 0.2 s jobs do not make a client wait 30 s), else that default."""
        if self.etas_s:
            return max(1, min(3600, math.ceil(min(self.etas_s))))
        if self.job_s is not None:
            return max(1, min(JOB_SLOT_RETRY_AFTER_S, math.ceil(self.job_s)))
        return JOB_SLOT_RETRY_AFTER_S


class Quotas:
    """The quota counters of every key in one Redis; every method may raise ``redis.RedisError``."""

    jobs_key_template = "jacobian:quota:{name}:jobs"
    bytes_key_template = "jacobian:quota:{name}:bytes:{day}"
    bucket_key_template = "jacobian:quota:{name}:bucket"
    job_s_key_template = "jacobian:quota:{name}:job_s"

    def __init__(self, connection: Redis, *, clock: Callable[[], float] = time.time) -> None:
        self.connection = connection
        self.clock = clock
        self._admit = connection.register_script(_ADMIT_LUA)
        self._settle = connection.register_script(_SETTLE_LUA)
        self._take = connection.register_script(_TAKE_LUA)

    def settle(self, name: str) -> JobCounts:
        """Read the key's jobs in flight from their records: drop the ended ones (adding a success's result bytes
        to its day) and ids without a record older than ``PENDING_S``; count the rest."""
        now = self.clock()
        jobs_key = self.jobs_key_template.format(name=name)
        members = self.connection.zrange(jobs_key, 0, -1, withscores=True)
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id, _ in members:
                pipe.hmget(JobStore.job_key_template.format(id=job_id.decode()),
                           ["status", "result", "finished_at", "progress", "started_at"])
            pipe.get(self.job_s_key_template.format(name=name))
            *rows, job_s = pipe.execute()
        counts = JobCounts(job_s=float(job_s) if job_s else None)
        known_job_s = counts.job_s
        ended = self.connection.pipeline(transaction=False)
        for (job_id, admitted_at), (status, result, finished_at, progress, started_at) in zip(members, rows):
            if (status is None and admitted_at > now - PENDING_S) or status == b"queued":
                counts.queued += 1
                continue
            if status == b"running":
                counts.running += 1
                eta = Progress.model_validate_json(progress).eta_seconds if progress else None
                if eta:
                    counts.etas_s.append(eta)
                continue
            size = 0
            if status == JobStatus.succeeded.value.encode() and result and result != b"null":
                try:
                    size = result_bytes(ResultInfo.model_validate_json(result))
                except ValidationError as exc:  # a bug of the record's writer: counted as 0, said once
                    log.warning("job %s: result record unreadable, its bytes not counted: %s", job_id.decode(), exc)
            if started_at and finished_at and float(finished_at) >= float(started_at):
                took = float(finished_at) - float(started_at)
                counts.job_s = took if counts.job_s is None else (
                    JOB_TIME_WEIGHT * took + (1 - JOB_TIME_WEIGHT) * counts.job_s)
            day = utc_day(float(finished_at) if finished_at else now)
            self._settle(keys=[jobs_key, self.bytes_key_template.format(name=name, day=day)],
                         args=[job_id, size, _DAY_KEY_TTL_S], client=ended)
        if counts.job_s != known_job_s:   # the moving average over the jobs that ended since: one write
            ended.set(self.job_s_key_template.format(name=name), repr(counts.job_s), ex=_DAY_KEY_TTL_S)
        with ended:
            ended.execute()
        return counts

    def admit(self, name: str, job_id: str, limits: QuotaLimits) -> None:
        """Count ``job_id`` as the key's queued job, or raise ``QuotaExceeded`` (nothing counted) when the key's
        result bytes today, jobs queued or running, or jobs queued are at their limit (checked in that order)."""
        counts = self.settle(name)
        now = self.clock()
        raw = self._admit(keys=[self.jobs_key_template.format(name=name),
                                self.bytes_key_template.format(name=name, day=utc_day(now))],
                          args=[job_id, repr(now), PENDING_S, *(_or_none(v) for v in (
                              limits.max_concurrent, limits.max_queued, limits.max_result_bytes_per_day)),
                                JobStore.job_key_template.format(id="")])
        limit, usage, max_ = raw[0].decode(), int(raw[1]), int(raw[2])
        if not limit:
            return
        if limit == RESULT_BYTES:
            why = (f"the results of the key's jobs that succeeded today (UTC) hold {usage} bytes, its limit is "
                   f"{max_} (JACOBIAN_QUOTA_MAX_RESULT_BYTES_PER_DAY or the key's quotas.max_result_bytes_per_day); "
                   "retry after UTC midnight")
            retry_s = seconds_to_utc_midnight(now)
        else:
            what = "queued or running" if limit == CONCURRENT else "waiting for a worker"
            setting = "MAX_CONCURRENT" if limit == CONCURRENT else "MAX_QUEUED"
            retry_s = counts.retry_after_s()
            why = (f"the key has {usage} jobs {what}, its limit is {max_} (JACOBIAN_QUOTA_{setting} or the key's "
                   f"quotas.max_{limit}); wait for one to end (or cancel one) and retry")
        raise self._refused(name, limit, usage, max_, retry_s, why)

    def release(self, name: str, job_id: str) -> None:
        """Uncount an admitted job that was not queued after all (its submission failed)."""
        self.connection.zrem(self.jobs_key_template.format(name=name), job_id)

    def take_request(self, name: str, limits: QuotaLimits) -> None:
        """One request of the key through its token bucket; ``QuotaExceeded`` when the bucket is empty."""
        if limits.requests_per_s is None:
            return
        rate, size = limits.requests_per_s, limits.bucket_size
        ttl_s = math.ceil(size / rate) + 1  # a bucket left alone that long is full again: no state needed
        taken, value = self._take(keys=[self.bucket_key_template.format(name=name)],
                                  args=[repr(self.clock()), repr(rate), size, ttl_s])
        if int(taken) == 1:
            return
        retry_s = max(1, math.ceil(float(value)))
        raise self._refused(name, REQUESTS, size, size, retry_s,
                            f"the key sent its {size} requests of burst; they refill at {rate:g} per second "
                            "(JACOBIAN_QUOTA_REQUESTS_PER_S, JACOBIAN_QUOTA_BURST or the key's quotas); slow down")

    def bucket(self, name: str) -> Bucket | None:
        """The key's token bucket as last written (None: full)."""
        tokens, at = self.connection.hmget(self.bucket_key_template.format(name=name), ["tokens", "at"])
        return None if tokens is None else Bucket(float(tokens), float(at))

    def usage(self, name: str, limits: QuotaLimits) -> QuotaUsage:
        """The key's usage now (after ``settle``) and its limits."""
        counts = self.settle(name)
        now = self.clock()
        day = utc_day(now)
        used_bytes = int(self.connection.get(self.bytes_key_template.format(name=name, day=day)) or 0)
        rows = [LimitUsage(name=CONCURRENT, used=counts.queued + counts.running, max=limits.max_concurrent),
                LimitUsage(name=QUEUED, used=counts.queued, max=limits.max_queued),
                LimitUsage(name=RESULT_BYTES, used=used_bytes, max=limits.max_result_bytes_per_day)]
        if limits.requests_per_s is not None:
            state = self.bucket(name)
            size = limits.bucket_size
            tokens = size if state is None else min(size, state.tokens + max(0.0, now - state.at_s)
                                                    * limits.requests_per_s)
            rows.append(LimitUsage(name=REQUESTS, used=round(size - tokens, 3), max=size,
                                   rate_per_s=limits.requests_per_s))
        else:
            rows.append(LimitUsage(name=REQUESTS, used=0, max=None))
        return QuotaUsage(key=name, day=day, queued=counts.queued, running=counts.running,
                          result_bytes_today=used_bytes, limits=rows)

    @staticmethod
    def _refused(name: str, limit: str, usage: float, max_: float, retry_s: int, why: str) -> QuotaExceeded:
        QUOTA_REJECTIONS.labels(name, limit).inc()
        return QuotaExceeded(f"quota {limit}: {why} (Retry-After: {retry_s} s)", limit=limit, key=name, usage=usage,
                             max_=max_, retry_after_s=retry_s)


def _or_none(value: int | None) -> int:
    return -1 if value is None else value


@contextmanager
def admitted(connection: Redis, name: str, job_id: str, limits: QuotaLimits) -> Iterator[None]:
    """``job_id`` counted against the key's quotas for the block (``QuotaExceeded`` before it when over one);
    uncounted again when the block raises (the job was not queued)."""
    quotas = Quotas(connection)
    quotas.admit(name, job_id, limits)
    try:
        yield
    except BaseException:
        try:
            quotas.release(name, job_id)
        except Exception as exc:  # noqa: BLE001 - the original error is the one to answer; PENDING_S frees it
            log.warning("job %s: not queued, and its quota slot could not be released: %s", job_id, exc)
        raise


def usage_of_every_key(connection: Redis, settings: Settings) -> list[QuotaUsage]:
    """The usage of every configured key (the anonymous bucket without keys), for the metrics."""
    quotas = Quotas(connection)
    keys: list[ApiKey | None] = list(settings.api_keys) or [None]
    return [quotas.usage(quota_name(k), settings.quota_limits(k)) for k in keys]
