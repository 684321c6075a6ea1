"""``GET /v1/usage``: the caller's quotas, what each is used and its limit."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from app.deps import ApiKeyDep, RedisDep, SettingsDep
from app.errors import error_responses
from app.quotas import Quotas, quota_name
from contracts.quotas import QuotaUsage

router = APIRouter(prefix="/v1/usage", tags=["usage"], responses=error_responses(401, 429, 503))


@router.get("", response_model=QuotaUsage, summary="The caller's quotas: usage and limits")
async def get_usage(api_key: ApiKeyDep, redis: RedisDep, settings: SettingsDep) -> QuotaUsage:
    """The quotas of the API key that asks (``anonymous``, one bucket shared by every caller, without API keys):
    its jobs queued and running, its result bytes of this UTC day, and per limit (``concurrent``: jobs queued or
    running; ``queued``; ``result_bytes_per_day``; ``requests_per_s``: requests the token bucket has not refilled
    yet, of its size) what is ``used`` and the ``max`` (null: no limit). A request over a limit is answered 429
    with ``Retry-After`` and an error naming the ``limit``, its ``usage`` and ``max``. This request counts
    against the request rate too."""
    return await run_in_threadpool(Quotas(redis).usage, quota_name(api_key), settings.quota_limits(api_key))
