"""Page tokens of ``GET /v1/jobs``: the ``created_at`` and id of a page's last job, opaque to clients."""

from __future__ import annotations

import base64
import json
import math

from app.errors import InvalidRequest
from contracts.jobspec import is_job_id

MAX_TOKEN_CHARS = 256


def encode_token(created_at: float, job_id: str) -> str:
    """The ``next_page_token`` after the job created at ``created_at`` with id ``job_id``."""
    raw = json.dumps({"before": created_at, "id": job_id}).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_token(token: str) -> tuple[float, str | None]:
    """``(created_at, id)`` of a token this service issued; anything else is a 422 naming ``page_token``."""
    error = InvalidRequest("page_token: not a token from a previous page; omit it to start from the newest job",
                           field="page_token")
    if len(token) > MAX_TOKEN_CHARS:
        raise error
    try:
        raw = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (ValueError, RecursionError):  # binascii.Error, UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise error from None
    if not isinstance(raw, dict) or set(raw) - {"before", "id"}:
        raise error
    before, job_id = raw.get("before"), raw.get("id")
    if isinstance(before, bool) or not isinstance(before, (int, float)) or not math.isfinite(before) or before < 0:
        raise error
    if job_id is not None and not (isinstance(job_id, str) and is_job_id(job_id)):
        raise error
    return float(before), job_id
