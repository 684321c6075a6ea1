"""The FastAPI application: ``create_app()`` wires routers, the error handler and metrics; the
lifespan opens the Redis pool. Importing this module touches no network and never TensorFlow."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from redis import ConnectionPool, Redis

from app.errors import install_error_handler
from app.events import StreamSlots
from app.metrics import QUEUE_DEPTH, QUOTAS, WEBHOOKS, MetricsMiddleware
from app.quotas import usage_of_every_key
from app.routes import health, jobs, models, preview, ui, usage
from contracts.jobspec import JobCreate, is_job_id
from contracts.logs import configure_logging, job_context
from contracts.settings import get_settings

REDIS_SOCKET_TIMEOUT_S = 10.0
log = logging.getLogger("app.jobs")


class JobLogMiddleware:
    """Logs the API's part of a job's life with its ``job_id``: accepted (202 with ``Location``), and
    any line logged while serving ``/v1/jobs/{job_id}...`` carries the id of the path."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path != "/v1/jobs" and not path.startswith("/v1/jobs/"):
            await self.app(scope, receive, send)
            return
        parts = path.rstrip("/").split("/")
        job_id = parts[3] if len(parts) > 3 and is_job_id(parts[3]) else None  # never a client's made-up text

        async def send_wrapper(message: Any) -> None:
            if message["type"] == "http.response.start" and scope.get("method") == "POST" and len(parts) == 3 \
                    and message["status"] == 202:
                location = dict(message.get("headers") or []).get(b"location", b"").decode()
                accepted = location.rstrip("/").rsplit("/", 1)[-1] or None
                log.info("job %s accepted and queued", accepted, extra={"event": "job_accepted", "job_id": accepted})
            elif message["type"] == "http.response.start" and job_id and parts[-1] == "cancel":
                log.info("job %s: cancel requested (HTTP %d)", job_id, message["status"],
                         extra={"event": "job_cancel_requested", "status_code": message["status"]})
            await send(message)

        with job_context(job_id):
            await self.app(scope, receive, send_wrapper)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the Redis pool (connections are made lazily) and bind the queue-depth gauge; close on exit."""
    settings = get_settings()
    configure_logging("api", fmt=settings.log_format, level=settings.log_level)
    pool = ConnectionPool.from_url(settings.redis_url, socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
                                   socket_timeout=REDIS_SOCKET_TIMEOUT_S, health_check_interval=30)
    app.state.redis = Redis(connection_pool=pool)
    QUEUE_DEPTH.bind(app.state.redis, [settings.queue_name])
    WEBHOOKS.bind(app.state.redis)
    QUOTAS.bind(lambda conn=app.state.redis: usage_of_every_key(conn, settings))
    try:
        yield
    finally:
        QUEUE_DEPTH.bind(None, ())
        WEBHOOKS.bind(None)
        QUOTAS.bind(None)
        app.state.redis = None
        pool.disconnect()


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus ``JobCreate`` (the JSON body of ``POST /v1/jobs``, read by hand)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        body = JobCreate.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(body.pop("$defs", {}))
        components["JobCreate"] = body
        app.openapi_schema = schema
    return app.openapi_schema


def create_app() -> FastAPI:
    """A new application; settings are read per request (``get_settings``) and at lifespan start."""
    app = FastAPI(
        title="Jacobian service",
        version="1.0.0",
        description="Chunked, memory-bounded Jacobians, batch Jacobians and Hessians of TensorFlow SavedModels. "
                    "Errors: `{\"error\": {\"type\", \"message\"}}`.",
        lifespan=lifespan,
    )
    install_error_handler(app)
    app.state.event_streams = StreamSlots()
    app.add_middleware(JobLogMiddleware)
    app.add_middleware(MetricsMiddleware)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(models.router)
    app.include_router(preview.router)
    app.include_router(ui.router)
    app.include_router(usage.router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


app = create_app()
