"""Where a sparse job's pattern comes from (``sparsity``): detected from the graph (``auto``, cached per model and
shapes with the ops that got the conservative rule), an uploaded ``.npz`` (``pattern_uri``) or an earlier job's
result (``pattern_from``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from contracts import storage

log = logging.getLogger(__name__)


def source_of(sparsity: Any) -> str:
    """``auto``, ``pattern_uri`` or ``pattern_from``: the form of the request's ``sparsity``."""
    if isinstance(sparsity, dict):
        return next(iter(sparsity))
    return str(sparsity)


def pattern_cache(cache_dir: str | None, shared: Any = None) -> Any:
    from worker.engine.sparsity.patterns import PatternCache

    return PatternCache(cache_dir, shared)


def no_rule_note(no_rule: dict[str, str]) -> str:
    """What the fallback reason adds about the ops that got the conservative rule."""
    if not no_rule:
        return ""
    named = ", ".join(f"{kind} ({name})" for kind, name in sorted(no_rule.items()))
    return (f"; ops without a sparsity rule, taken as dense (every output element reads every input element): "
            f"{named}")


def find_pattern(model: Any, op: Any, arrays: dict[str, np.ndarray], sparsity: Any, source: str,
                 shape: tuple[int, int], cache: Any, key: str, previous: Callable[[str], Any] | None,
                 wrt: str, no_rule: dict[str, str], *, hessian: bool = False) -> tuple[Any, Any, str]:
    """``(pattern, colouring or None, "")``, or ``(None, None, why)`` when detection could not find it;
    ``key``: the cache key of an ``auto`` pattern; ``no_rule`` is filled with the ops detection gave the
    conservative rule (``walk.detect``). ``hessian``: the pattern of the Hessian (``hessian.detect``: the walk of
    the gradient's graph, symmetrized); a given one is symmetrized too."""
    from worker.engine.sparsity import hessian as hessians
    from worker.engine.sparsity import walk

    if hessian:
        pattern, colouring, why = _find(model, op, arrays, sparsity, source, shape, cache, key, previous, wrt,
                                        no_rule, detect=lambda: hessians.detect(model, arrays, of=op.of, wrt=wrt,
                                                                               no_rule=no_rule))
        return (hessians.symmetrized(pattern) if pattern is not None and colouring is None else pattern), \
            colouring, why
    return _find(model, op, arrays, sparsity, source, shape, cache, key, previous, wrt, no_rule,
                 detect=lambda: walk.detect(model, arrays, of=op.of, wrt=wrt, no_rule=no_rule)[0])


def _find(model: Any, op: Any, arrays: dict[str, np.ndarray], sparsity: Any, source: str, shape: tuple[int, int],
          cache: Any, key: str, previous: Callable[[str], Any] | None, wrt: str, no_rule: dict[str, str], *,
          detect: Callable[[], Any]) -> tuple[Any, Any, str]:
    from worker.engine.sparsity import patterns, walk

    if source == "auto":
        hit = cache.get(key)
        if hit is not None and hit.pattern.shape == shape:
            no_rule.update(hit.no_rule)
            return hit.pattern, hit.colouring, ""
        try:
            pattern = detect()
        except walk.PatternUnknown as err:
            return None, None, f"dense: {err}"
        except MemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - detection failed in a way no rule foresaw: never a guess
            log.warning("sparsity: pattern detection failed: %s", err, exc_info=True)
            return None, None, f"dense: pattern detection failed ({type(err).__name__}: {str(err)[:200]})"
        if pattern.shape != shape:
            return None, None, f"dense: the detected pattern is {pattern.shape}, not {shape}"
        return pattern, None, ""
    if source == "pattern_uri":
        url = str(sparsity["pattern_uri"])
        try:
            raw = storage.read_bytes(url)
        except OSError as err:
            from worker.engine.errors import InvalidRequest

            raise InvalidRequest(f"sparsity.pattern_uri: cannot read {url!r}: {err}", field="sparsity.pattern_uri") \
                from err
        return patterns.read_npz(raw, shape, field="sparsity.pattern_uri"), None, ""
    if source == "pattern_from":
        return _pattern_from(str(sparsity["pattern_from"]), shape, previous), None, ""
    from worker.engine.errors import InvalidRequest

    raise InvalidRequest(f"sparsity: {sparsity!r} is not a sparsity; use 'auto', {{'pattern_uri': url}} or "
                         "{'pattern_from': job id}", field="sparsity")


def _pattern_from(job_id: str, shape: tuple[int, int], previous: Callable[[str], Any] | None) -> Any:
    """The entries of an earlier job's result: its ``rows``/``cols``, or the non-zeros of its ``jacobian``."""
    from worker.engine.errors import InvalidRequest
    from worker.engine.sparsity.patterns import from_entries

    field_name = "sparsity.pattern_from"
    url = previous(job_id) if previous is not None else None
    if url is None:
        raise InvalidRequest(f"{field_name}: job {job_id!r} has no stored result; give a complete job's id",
                             field=field_name)
    group = storage.open_group(url, mode="r")
    if group.attrs.get("format") == "coo":
        return from_entries(group["rows"][...], group["cols"][...], shape, field=field_name)
    array = group["jacobian"]
    if int(np.prod(array.shape)) != shape[0] * shape[1]:
        raise InvalidRequest(f"{field_name}: job {job_id!r}'s result has shape {list(array.shape)}, not this "
                             f"Jacobian's {shape[0]} x {shape[1]}", field=field_name)
    rows_parts, cols_parts = [], []
    lead = int(array.shape[0]) if array.ndim and shape[0] > 1 else 1
    per_lead = shape[0] // lead                        # flat rows of J in one step along the first axis
    step = max(1, (1 << 24) // max(1, per_lead * shape[1]))
    for start in range(0, lead, step):
        block = np.asarray(array[start:start + step] if lead > 1 else array[...]).reshape(-1, shape[1])
        r, c = np.nonzero(block)
        rows_parts.append(r + start * per_lead)
        cols_parts.append(c)
    return from_entries(np.concatenate(rows_parts), np.concatenate(cols_parts), shape, field=field_name)
