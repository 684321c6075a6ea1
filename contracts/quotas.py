"""Per-key quotas, the pure part: the limits, the token bucket of the request rate, a result's bytes, the usage
a key is shown. The counting in Redis is ``app/quotas.py``."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from contracts.records import ResultInfo

ANONYMOUS = "anonymous"  # the one bucket of a deployment without API keys
CONCURRENT, QUEUED, RESULT_BYTES, REQUESTS = "concurrent", "queued", "result_bytes_per_day", "requests_per_s"
LIMITS = (CONCURRENT, QUEUED, RESULT_BYTES, REQUESTS)
"""The limits' names, as a 429 body, ``GET /v1/usage`` and the metrics' ``limit`` label spell them."""

_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
             "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
             "complex128": 16}
_INDEX_BYTES = 8  # a sparse result's rows, cols and indptr are int64


class QuotaLimits(BaseModel):
    """One API key's limits; None: no limit. In ``JACOBIAN_API_KEYS`` a key's ``quotas`` object overrides the
    defaults (``JACOBIAN_QUOTA_*``) field by field: a field it leaves out keeps the default, ``null`` lifts it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_concurrent: int | None = Field(None, ge=0, description="jobs of the key queued or running at once: a "
                                       "job runs only once accepted, so no more of its jobs ever run at once")
    max_queued: int | None = Field(None, ge=0, description="jobs of the key waiting for a worker")
    max_result_bytes_per_day: int | None = Field(None, ge=0, description="bytes of the results of the key's "
                                                 "jobs that succeeded this UTC day")
    requests_per_s: float | None = Field(None, gt=0, description="requests of the key per second, as a token "
                                         "bucket refilled at this rate")
    burst: int | None = Field(None, ge=1, description="requests the bucket holds (default: requests_per_s "
                              "rounded up, at least 1)")

    def overridden(self, overrides: QuotaLimits | None) -> QuotaLimits:
        """These limits with the fields ``overrides`` was given (``null`` included) in their place."""
        if overrides is None:
            return self
        return self.model_copy(update={name: getattr(overrides, name) for name in overrides.model_fields_set})

    @property
    def bucket_size(self) -> int:
        """Requests the token bucket holds: ``burst``, else ``requests_per_s`` rounded up (at least 1)."""
        return self.burst or max(1, math.ceil(self.requests_per_s or 1))


@dataclass(frozen=True)
class Bucket:
    """A token bucket's state: ``tokens`` left at ``at_s`` (seconds since the epoch)."""

    tokens: float
    at_s: float


def take_token(bucket: Bucket | None, *, now_s: float, rate_per_s: float, size: int) -> tuple[Bucket, float]:
    """Take one token from ``bucket`` (None: a full one) refilled at ``rate_per_s`` up to ``size``; returns the
    new state and 0.0 when a token was taken, else the seconds until one will be there (nothing taken).

    ``app/quotas.py`` runs the same steps in one Lua script; a clock that went back refills nothing."""
    tokens = float(size) if bucket is None else min(float(size), bucket.tokens + max(0.0, now_s - bucket.at_s)
                                                    * rate_per_s)
    if tokens >= 1.0:
        return Bucket(tokens - 1.0, now_s), 0.0
    return Bucket(tokens, now_s), (1.0 - tokens) / rate_per_s


def result_bytes(result: ResultInfo) -> int:
    """Bytes of a succeeded job's result as its record describes it: the main array's elements times its dtype's
    size; a sparse one (format ``coo``, ``shape`` ``[nnz]``) adds its int64 ``rows``, ``cols`` and ``indptr``."""
    itemsize = _ITEMSIZE.get(result.dtype, 8)
    count = math.prod(result.shape)
    total = count * itemsize
    if result.format == "coo":
        n_of = result.dense_shape[0] if result.dense_shape else 0
        total += 2 * count * _INDEX_BYTES + (n_of + 1) * _INDEX_BYTES
    return int(total)


def utc_day(ts: float) -> str:
    """The UTC day of ``ts``, ``YYYY-MM-DD``: the result bytes' counting period."""
    return time.strftime("%Y-%m-%d", time.gmtime(ts))


def seconds_to_utc_midnight(now_s: float) -> int:
    """Whole seconds (at least 1) until the next UTC day, when the result bytes start again from 0."""
    return max(1, math.ceil(86400 - now_s % 86400))


class LimitUsage(BaseModel):
    """One limit of a key: its ``name``, what is ``used`` now and its ``max`` (None: no limit). For
    ``requests_per_s``: ``used`` is the requests the bucket has not refilled yet, ``max`` its size, refilled at
    ``rate_per_s``."""

    name: str
    used: float
    max: float | None
    rate_per_s: float | None = None


class QuotaUsage(BaseModel):
    """The body of ``GET /v1/usage``: the caller's key (its name; ``anonymous`` without API keys), its jobs
    queued and running now, its result bytes of the UTC ``day``, and each limit."""

    key: str
    day: str
    queued: int
    running: int
    result_bytes_today: int
    limits: list[LimitUsage]
