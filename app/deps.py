"""FastAPI dependencies as named aliases: settings, Redis, the job store, the rq queue, the API key check."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis import Redis
from rq import Queue
from rq.serializers import JSONSerializer

from app.errors import NotReady
from app.quotas import Quotas, quota_name
from app.security import check_api_key
from contracts.jobspec import JOB_ID_PATTERN, is_job_id
from contracts.jobstore import JobNotFound, JobStore
from contracts.settings import ApiKey, Settings, get_settings

SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_redis(request: Request) -> Redis:
    """The process-wide Redis client opened by the app lifespan; raises ``NotReady`` outside it."""
    conn = getattr(request.app.state, "redis", None)
    if conn is None:
        raise NotReady("redis: no connection pool; the app lifespan has not started")
    return conn


RedisDep = Annotated[Redis, Depends(get_redis)]


def get_store(redis: RedisDep, settings: SettingsDep) -> JobStore:
    """Job records; terminal records expire after ``result_ttl_s``."""
    return JobStore(redis, ttl_s=settings.result_ttl_s)


StoreDep = Annotated[JobStore, Depends(get_store)]


def get_queue(redis: RedisDep, settings: SettingsDep) -> Queue:
    """The rq queue ``settings.queue_name`` with the JSON serializer (never pickle)."""
    return Queue(settings.queue_name, connection=redis, serializer=JSONSerializer)


QueueDep = Annotated[Queue, Depends(get_queue)]


def job_id_param(job_id: Annotated[str, Path(description="a job id as POST /v1/jobs issued it",
                                             json_schema_extra={"pattern": JOB_ID_PATTERN})]) -> str:
    """The path's ``{job_id}``; ``JobNotFound`` (404) before any Redis call unless it is shaped like an id
    the service issues, so that no other key (``{id}:shards``) can be read or written through it."""
    if not is_job_id(job_id):
        raise JobNotFound(job_id)
    return job_id


JobIdDep = Annotated[str, Depends(job_id_param)]


_bearer = HTTPBearer(auto_error=False, description="An API key of JACOBIAN_API_KEYS (when any is set).")


def require_api_key(request: Request, settings: SettingsDep,
                    _docs: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)] = None) -> ApiKey | None:
    """401 unless ``Authorization: Bearer <key>`` names a key of ``JACOBIAN_API_KEYS`` (none set: open);
    the key's settings (None when no keys are set). With a request rate quota, one request through the key's
    token bucket (429 ``QuotaExceeded`` when it is empty).

    ``_docs`` only declares the bearer scheme in the OpenAPI document; the raw header is checked.
    """
    matched = check_api_key(request.headers.get("authorization"), settings.api_key_values)
    key = next((k for k in settings.api_keys if k.key == matched), None) if matched is not None else None
    limits = settings.quota_limits(key)
    if limits.requests_per_s is not None:
        Quotas(get_redis(request)).take_request(quota_name(key), limits)
    return key


ApiKeyDep = Annotated[ApiKey | None, Depends(require_api_key)]
