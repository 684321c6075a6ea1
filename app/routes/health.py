"""``/healthz`` (process up), ``/readyz`` (Redis and storage reachable) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from app.deps import SettingsDep
from app.errors import NotReady
from app.metrics import render
from contracts import storage

log = logging.getLogger(__name__)
router = APIRouter(tags=["health"])

READY_TIMEOUT_S = 5.0
READY_PROBE = ".readyz"


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """200 whenever the process answers; checks nothing else."""
    return {"status": "ok"}


def _ping_redis(request: Request) -> None:
    conn = getattr(request.app.state, "redis", None)
    if conn is None:
        raise RuntimeError("no connection pool (lifespan not started)")
    conn.ping()


def _probe_storage(results_url: str) -> None:
    storage.write_bytes(storage.join(results_url, READY_PROBE), b"ok")


async def _check(name: str, fn: Any, *args: Any) -> str:
    """``"ok"``, or what failed in words an unauthenticated caller may read (no host, port or path: those
    go to the log)."""
    try:
        await asyncio.wait_for(run_in_threadpool(fn, *args), timeout=READY_TIMEOUT_S)
    except TimeoutError:
        log.warning("readyz: %s timed out after %g s", name, READY_TIMEOUT_S)
        return f"timed out after {READY_TIMEOUT_S:g} s"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready; the log says what exactly
        log.warning("readyz: %s failed: %s: %s", name, type(exc).__name__, exc)
        return f"unreachable ({type(exc).__name__})"
    return "ok"


@router.get("/readyz", responses={503: {"description": "Redis or storage unreachable"}})
async def readyz(request: Request, settings: SettingsDep) -> dict[str, Any]:
    """200 ``{"status": "ready", "checks": {...}}`` when Redis answers PING and the results storage
    accepts a small write (``{results_url}/.readyz``); 503 naming what failed otherwise."""
    redis_state, storage_state = await asyncio.gather(_check("redis", _ping_redis, request),
                                                      _check("storage", _probe_storage, settings.results_url))
    checks = {"redis": redis_state, "storage": storage_state}
    failed = "; ".join(f"{k}: {v}" for k, v in checks.items() if v != "ok")
    if failed:
        raise NotReady(f"{failed}; check JACOBIAN_REDIS_URL, JACOBIAN_RESULTS_URL and the AWS_* settings")
    return {"status": "ready", "checks": checks}


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics() -> Response:
    """Prometheus exposition: API request metrics, jobs submitted, queue depth (read from Redis now)."""
    body, content_type = await run_in_threadpool(render)
    return Response(body, media_type=content_type)
