"""What the API and the CLI know of the worker's persisted plans, without TensorFlow.

A worker keys a plan (``worker.engine.plan.PlanKey``) by the model's fingerprint, the request, the input
shapes, the device kind and the TensorFlow version. The API knows neither of the last two, so every stored
plan is also kept under its *request digest*, the key without them (``request_digest``): the plan the last
worker of any device made for this request. ``jacobian:plan-request:{digest}`` in Redis, and
``plans/request-{digest}.json`` in a cache folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

PLAN_FORMAT = 3  # bump when the meaning of a stored plan changes: older plans become misses
# 3: the memory line is a bound over measured peaks (2: a line through two of them), peaks are kept
DEVICE_FIELDS = ("device", "tensorflow")   # the PlanKey fields a request digest leaves out
REQUEST_KEY_TEMPLATE = "jacobian:plan-request:{digest}"


def bucket_rows(rows: int) -> int:
    """The power-of-two bucket that holds ``rows`` (1 -> 1, 5 -> 8)."""
    return 1 << max(0, math.ceil(math.log2(max(1, rows))))


def digest(obj: Any) -> str:
    """The 32 hex characters that name a plan key (or a request) in a cache."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


def request_digest(key_json: dict[str, Any]) -> str:
    """The digest of a plan key's JSON (``PlanKey.to_json()``) without its device and TensorFlow version."""
    return digest({k: v for k, v in key_json.items() if k not in DEVICE_FIELDS})


def request_key_json(*, model: str, signature: str, of: str, wrt: Any, kind: str, mode: str, reduce: str | None,
                     inputs: list[tuple[str, tuple[int, ...], str]], batch_axis: bool) -> dict[str, Any]:
    """A plan key's JSON as the worker writes it, less the device fields: ``inputs`` are (name, shape, dtype)
    of every model input, sorted here; a per-example kind's batch size is bucketed, as the worker does."""
    rows = []
    for name, shape, dtype in sorted(inputs):
        shape = (bucket_rows(shape[0]),) + tuple(shape[1:]) if batch_axis and shape else tuple(shape)
        rows.append([name, [int(d) for d in shape], dtype])
    return {"model": model, "signature": signature, "of": of, "wrt": wrt, "kind": kind, "mode": mode,
            "reduce": reduce, "inputs": rows, "format": PLAN_FORMAT}


def plan_request(queued: Any, shapes: Mapping[str, tuple[tuple[int, ...], str]]) -> str | None:
    """The request digest of a validated job's plan (``queued``: a ``QueuedJob``, ``of`` and ``wrt`` resolved;
    ``shapes``: each input's shape and dtype): dense kinds without sparsity only, which are the planned ones."""
    from contracts.jobspec import SEEDS_MEMBER
    from contracts.kinds import Family, kind_spec

    kind = kind_spec(queued.kind)
    if kind.family is not Family.dense or queued.sparsity is not None:
        return None
    inputs = [(n, s, d) for n, (s, d) in shapes.items() if n != SEEDS_MEMBER]
    key = request_key_json(model=model_fingerprint(queued.model.path), signature=queued.model.signature,
                           of=queued.of or "", wrt=queued.wrt, kind=kind.name, mode=queued.mode.value,
                           reduce=queued.reduce, inputs=inputs, batch_axis=kind.batch_axis)
    return request_digest(key)


def default_cache_dir() -> Path:
    """``JACOBIAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/jacobian``, else ``~/.cache/jacobian``."""
    explicit = os.environ.get("JACOBIAN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jacobian"


FINGERPRINT_FILES = ("saved_model.pb", "variables/variables.index")   # what a SavedModel's fingerprint hashes


def model_fingerprint(path: str | os.PathLike[str]) -> str:
    """SHA-256 of ``saved_model.pb`` and ``variables/variables.index`` (hex, 32 characters); of a ``.keras``
    file, SHA-256 of the file. A model under an S3 root (an ``s3://`` URL): the same, from the bucket
    (``contracts.remote_models.remote_fingerprint``; ``""`` when an object is over
    ``JACOBIAN_MAX_MODEL_READ_BYTES``: no plan is found for it).

    A re-exported model (new graph or new weights) has another fingerprint, so its plans are misses.
    """
    if str(path).startswith(("s3://", "s3a://")):
        from contracts.remote_models import remote_fingerprint
        from contracts.settings import get_settings

        return remote_fingerprint(str(path), max_bytes=get_settings().max_model_read_bytes)
    root = Path(path)
    if root.is_file():
        st = root.stat()
        return keras_fingerprint(_file_sha256(str(root), st.st_mtime_ns, st.st_size))
    hashes: dict[str, str | None] = {}
    for rel in FINGERPRINT_FILES:
        f = root / rel
        try:
            st = f.stat()
        except OSError:
            hashes[rel] = None
            continue
        hashes[rel] = _file_sha256(str(f), st.st_mtime_ns, st.st_size)
    return saved_model_fingerprint(hashes)


def keras_fingerprint(file_sha256: str) -> str:
    """A ``.keras`` file's fingerprint from the SHA-256 (hex) of its bytes."""
    return hashlib.sha256(f"keras:{file_sha256}".encode()).hexdigest()[:32]


def saved_model_fingerprint(hashes: Mapping[str, str | None]) -> str:
    """A SavedModel's fingerprint from the SHA-256 (hex) of each of ``FINGERPRINT_FILES`` (None: absent)."""
    parts = [f"{rel}:{hashes.get(rel) or 'absent'}" for rel in FINGERPRINT_FILES]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


@lru_cache(maxsize=256)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_plan(raw: str | bytes | None, request: str) -> dict[str, Any] | None:
    """A stored plan's JSON when it is of this format and for this request digest; None otherwise."""
    if raw is None:
        return None
    try:
        plan = json.loads(raw)
        key = plan["key"]
        if plan.get("format") != PLAN_FORMAT or request_digest(key) != request:
            return None
    except (ValueError, KeyError, TypeError):
        return None
    return plan if isinstance(plan, dict) else None


def redis_plan(connection: Any, request: str) -> dict[str, Any] | None:
    """The plan a worker stored in Redis for this request digest (any device), or None (Redis errors too)."""
    import redis

    try:
        raw = connection.get(REQUEST_KEY_TEMPLATE.format(digest=request))
    except redis.RedisError:
        return None
    return read_plan(raw, request)


def disk_plan(root: str | os.PathLike[str], request: str) -> dict[str, Any] | None:
    """The plan a cache folder (``DiskPlanCache``'s) keeps for this request digest, or None."""
    try:
        raw = (Path(root) / "plans" / f"request-{request}.json").read_bytes()
    except OSError:
        return None
    return read_plan(raw, request)
