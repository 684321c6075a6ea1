"""Matrix-free operators reused across jobs and processes: the route each product kind chose (its trial against
the eager reference) is kept per request, so the next job on the same model, ``of``, ``wrt`` and input shapes
starts with the chosen route and spends no reference products, probe rows or failed traces on choosing again.

Two levels: this process (``model.compiled.choices``: with them the compiled functions, which live on the
loaded model and cannot leave the process) and the cache folder (``<cache_dir>/operators/<digest>.json``,
written when a choice is made; a later process, or another worker on the same folder, starts from it).
The chosen functions' traced graphs are kept beside the choices (``worker.engine.trace_cache``: a GraphDef bound
to the new process's variables, 0.3 s against a 3 s trace of MobileNetV3Small's JVP; a SavedModel of the
functions was measured and did not pay), and so are ``svd``'s last converged singular vectors, its warm start.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from contracts.files import write_atomically
from contracts.kinds import Family, kind_spec, kinds_where

log = logging.getLogger(__name__)

STRATEGIES = ("tiled", "vectorized", "loop", "eager", "rows")


def request_key(op: Any) -> tuple[Any, ...]:
    """What makes two operators the same for their choices: model, signature, of, wrt, reduce, dtype, shapes."""
    shapes = tuple(sorted((n, tuple(int(d) for d in t.shape), t.dtype.name) for n, t in op.inputs.items()))
    return ("operator-choices", op.model.fingerprint, op.model.signature, op.of, op.axis.names, op.reduce,
            op.compute_dtype, shapes, tuple(sorted(op.routes.items())))


def _path(cache_dir: str, key: tuple[Any, ...]) -> Path:
    return Path(cache_dir) / "operators" / (hashlib.sha256(repr(key).encode()).hexdigest()[:32] + ".json")


def _stored(cache_dir: str | None, key: tuple[Any, ...]) -> dict[str, str]:
    """The labels stored for ``key`` (only well-formed ones; anything unreadable is a miss)."""
    if not cache_dir or not key[1]:   # no fingerprint: the model cannot be recognised again
        return {}
    path = _path(cache_dir, key)
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("operator cache %s is not readable (%s): choosing routes again", path, err)
        return {}
    if not isinstance(raw, dict) or raw.get("key") != repr(key) or not isinstance(raw.get("labels"), dict):
        return {}

    def valid(kind: object, label: object) -> bool:
        if kind not in kinds_where(family=Family.products) or not isinstance(label, str) or label.count("/") != 1:
            return False
        route, strategy = label.split("/")
        return route in kind_spec(str(kind)).routes and strategy in STRATEGIES

    return {k: v for k, v in raw["labels"].items() if valid(k, v)}


def _store(cache_dir: str | None, key: tuple[Any, ...], labels: dict[str, str]) -> None:
    if not cache_dir or not key[1]:
        return
    try:
        write_atomically(_path(cache_dir, key), json.dumps({"key": repr(key), "labels": labels}).encode())
    except OSError as err:   # a full or read-only disk costs the next process a trial, nothing more
        log.warning("operator cache %s is not writable (%s)", cache_dir, err)


def cached_operator(model: Any, inputs: dict[str, Any], *, cache_dir: str | None = None, **options: Any) -> Any:
    """``worker.engine.matfree.build_operator(model, inputs, **options)`` whose chosen routes (``labels``) are shared
    with every operator of the same request in this process and, through ``cache_dir``, with later processes."""
    from worker.engine.matfree import build_operator

    op = build_operator(model, inputs, **options)
    key = request_key(op)
    labels = model.compiled.choices.get(key)
    if labels is None:
        labels = model.compiled.choices[key] = _stored(cache_dir, key)
    op.labels, op.trace_dir = labels, cache_dir
    op.on_choice = lambda: _store(cache_dir, key, dict(labels))
    return op
