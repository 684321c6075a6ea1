"""Domain errors of the API and the one exception handler that turns them into HTTP answers.

Code inside the app raises the domain errors below (or those of ``contracts``); only
``handle_error`` knows HTTP status codes. Every answer has the body
``{"error": {"type": <class name>, "message": <names the field and the fix>}}``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from contracts.graph_scan import ModelRefused
from contracts.jobstore import JobNotFound
from contracts.savedmodel import SavedModelError, SignatureNotFound

log = logging.getLogger(__name__)


class ErrorDetail(BaseModel):
    type: str
    message: str
    limit: str | None = Field(None, description="429 only: the quota refused (concurrent, queued, "
                              "result_bytes_per_day, requests_per_s)")
    key: str | None = Field(None, description="429 only: the API key's name (anonymous without keys)")
    usage: float | None = Field(None, description="429 only: the limit's usage now")
    max: float | None = Field(None, description="429 only: the limit")


class ErrorBody(BaseModel):
    """Every error answer: ``{"error": {"type", "message"}}``."""

    error: ErrorDetail


_ERROR_DESCRIPTIONS = {400: "malformed request", 401: "missing or wrong API key",
                       403: "model path or webhook not allowed",
                       404: "unknown job or model", 408: "the request body stalled", 409: "the job has not succeeded",
                       413: "too large",
                       416: "rows outside the result", 422: "invalid request",
                       429: "over a quota of the API key: the body's error names the limit, its usage and max; "
                            "Retry-After says when to try again", 503: "not ready"}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these error status codes, with the error body's schema."""
    return {code: {"model": ErrorBody, "description": _ERROR_DESCRIPTIONS.get(code, "error")} for code in codes}


class ApiError(Exception):
    """Base of the API's domain errors; ``str(err)`` is the message a client sees."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return self.message


class MalformedBody(ApiError):
    """The body cannot be parsed at all (not JSON, not an .npz)."""


class InvalidRequest(ApiError):
    """The request parses but does not fit the model or the contract."""


class SignatureMismatch(InvalidRequest):
    """Inputs, ``of`` or ``wrt`` do not fit the model's signature."""


class NonFiniteInput(InvalidRequest):
    """An input holds NaN or Inf."""


class IdempotencyKeyReused(InvalidRequest):
    """The Idempotency-Key was used before with another body."""


class ModelPathNotAllowed(ApiError):
    """The model path resolves outside every allowed model root."""


class WebhookNotAllowed(ApiError):
    """``notify`` names a URL the webhook allowlist refuses, or no secret could sign its deliveries."""


class ModelNotFound(ApiError):
    """No SavedModel at an allowed path."""


class InvalidApiKey(ApiError):
    """Missing or unknown API key."""


class BodyTooLarge(ApiError):
    """The body or its tensors are over a configured limit."""


class BodyTimeout(ApiError):
    """The request body stalled for longer than ``body_read_timeout_s``."""


class ClientClosedRequest(ApiError):
    """The client went away before its request was read: no one reads the answer (499, nginx's code)."""


class UnsupportedMediaType(ApiError):
    """The Content-Type is neither JSON nor .npz."""


class JobNotFinished(ApiError):
    """The job's result is not readable yet (or never will be)."""


class RangeNotSatisfiable(ApiError):
    """A requested row range lies outside the result."""


class NotReady(ApiError):
    """A dependency (Redis, storage) is unreachable."""


class TooManyStreams(ApiError):
    """This API process already serves ``JACOBIAN_MAX_EVENT_STREAMS`` event streams; retry after ``retry_after_s``."""

    retry_after_s = 5


class QuotaExceeded(ApiError):
    """A request over one of its API key's quotas (``contracts.quotas.LIMITS``); nothing was queued."""

    def __init__(self, message: str, *, limit: str, key: str, usage: float, max_: float,
                 retry_after_s: int) -> None:
        super().__init__(message, field=limit)
        self.details = {"limit": limit, "key": key, "usage": usage, "max": max_}
        self.retry_after_s = retry_after_s


_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (MalformedBody, 400),
    (InvalidApiKey, 401),
    (ModelPathNotAllowed, 403),
    (WebhookNotAllowed, 403),
    (JobNotFound, 404),
    (BodyTimeout, 408),
    (JobNotFinished, 409),
    (BodyTooLarge, 413),
    (UnsupportedMediaType, 415),
    (RangeNotSatisfiable, 416),
    (ModelNotFound, 422),
    (ModelRefused, 422),
    (SignatureNotFound, 422),
    (SavedModelError, 422),
    (InvalidRequest, 422),
    (ValidationError, 422),
    (RequestValidationError, 422),
    (QuotaExceeded, 429),
    (ClientClosedRequest, 499),
    (NotReady, 503),
    (TooManyStreams, 503),
    (RedisConnectionError, 503),
    (RedisTimeoutError, 503),
)


def status_of(exc: BaseException) -> int:
    """The HTTP status for a domain error (500 for anything unexpected)."""
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return 500


_OWN_FIELD = re.compile(r"^[A-Za-z_][\w.]*: ")


_WHERE = ("body", "query", "path", "header", "cookie")


def _loc(loc: tuple[Any, ...] | list[Any], *, located: bool) -> str:
    """``("model", "path")`` -> ``"model.path"``; FastAPI's locations (``located``) start with where
    the value was, ``("query", "limit")``, which is dropped (a field may itself be named ``path``)."""
    parts = [str(p) for p in loc]
    if located and parts and parts[0] in _WHERE:
        parts = parts[1:]
    return ".".join(parts) or "body"


def validation_message(errors: list[Any], *, located: bool = False) -> str:
    """Pydantic errors as ``"field: what is wrong"`` lines joined by ``"; "``; ``located`` for FastAPI's
    request errors, whose locations start with ``body``, ``query``, ``path`` or ``header``."""
    out = []
    for err in errors:
        msg = str(err.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        field = _loc(err.get("loc", ()), located=located)
        if err.get("type") == "extra_forbidden":
            msg = "unknown field; remove it (see /docs for the accepted fields)"
        elif err.get("type") == "missing":
            msg = "required; add it"
        # Model validators report their own "field: ..." prefix: "inputs.x" + "shape: ..." -> "inputs.x.shape: ...".
        if _OWN_FIELD.match(msg):
            out.append(msg if field == "body" else f"{field}.{msg}")
        else:
            out.append(f"{field}: {msg}")
    return "; ".join(out)


def _message(exc: BaseException) -> str:
    if isinstance(exc, (ValidationError, RequestValidationError)):
        return validation_message(list(exc.errors()), located=isinstance(exc, RequestValidationError))
    if isinstance(exc, JobNotFound):
        return f"id: no job {str(exc.args[0])[:64]!r}; list jobs with GET /v1/jobs"
    if isinstance(exc, SignatureNotFound):
        return f"model.signature: {exc}"
    if isinstance(exc, ModelRefused):
        return exc.message
    if isinstance(exc, SavedModelError):
        return f"model.path: {exc}"
    if isinstance(exc, StarletteHTTPException):
        return str(exc.detail)
    if isinstance(exc, ApiError):
        return exc.message
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        return "redis: unreachable; retry later (see GET /readyz)"
    return "internal error; see the server log"


def _type(exc: BaseException) -> str:
    if isinstance(exc, (RequestValidationError, ValidationError)):
        return "InvalidRequest"
    if isinstance(exc, StarletteHTTPException):
        return {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, "HTTPError")
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        return "NotReady"
    if status_of(exc) == 500:
        return "InternalError"
    return type(exc).__name__


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _allowed_methods(request: Request) -> str:
    """Every method some route answers on this path (Starlette's own 405 names only the first route's)."""
    allowed = []
    for method in _METHODS:
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes):
            allowed.append(method)
    return ", ".join(allowed)


def _headers(request: Request, exc: BaseException) -> dict[str, str] | None:
    """WWW-Authenticate on a 401, Allow on a 405, Connection: close after a stalled body, Retry-After when
    there are too many event streams or a quota is exceeded."""
    if isinstance(exc, InvalidApiKey):
        return {"WWW-Authenticate": "Bearer"}
    if isinstance(exc, BodyTimeout):
        return {"Connection": "close"}  # the rest of the body may still arrive: not on this connection
    if isinstance(exc, (TooManyStreams, QuotaExceeded)):
        return {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, StarletteHTTPException) and exc.status_code == 405:
        return {"Allow": _allowed_methods(request)}
    if isinstance(exc, StarletteHTTPException) and exc.headers:
        return dict(exc.headers)
    return None


def _routing_message(request: Request, exc: BaseException, message: str) -> str:
    """Starlette's bare "Not Found" and "Method Not Allowed" said as the field and the fix."""
    if not isinstance(exc, StarletteHTTPException):
        return message
    if exc.status_code == 405 and message == "Method Not Allowed":
        return (f"method: {request.method[:20]} is not allowed on {request.url.path[:100]}; use "
                f"{_allowed_methods(request)}")
    if exc.status_code == 404 and message == "Not Found":
        return f"path: {request.url.path[:100]!r} does not exist; see /docs for the API's paths"
    return message


async def handle_error(request: Request, exc: Exception) -> JSONResponse:
    """The one exception handler: domain error -> status code and ``{"error": {type, message}}``."""
    status = status_of(exc)
    if status == 500:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    message = _routing_message(request, exc, _message(exc))
    # A message may quote the request (a field or input name); JSON answers are UTF-8, lone surrogates are not.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = {"error": {"type": _type(exc), "message": message, **getattr(exc, "details", {})}}
    return JSONResponse(body, status_code=status, headers=_headers(request, exc))


def install_error_handler(app: FastAPI) -> None:
    """Route every domain error, validation error and HTTP error through ``handle_error``."""
    for cls in (ApiError, JobNotFound, ModelRefused, SavedModelError, SignatureNotFound, ValidationError,
                RequestValidationError, StarletteHTTPException, RedisConnectionError, RedisTimeoutError, Exception):
        app.add_exception_handler(cls, handle_error)
