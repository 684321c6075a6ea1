"""A sparse Jacobian to storage (option ``sparsity``): pattern, colouring, compressed products, verification,
then the entries streamed as COO into the job's result group (DESIGN.md, "Sparse Jacobians").

``compute_sparse_to_storage`` returns the manifest, or a ``DenseInstead`` (the pattern too dense to pay, not
found, or the result failing verification) whose ``sparsity`` summary the caller puts in the dense job's plan.
Never a silently wrong sparse matrix: the entries are written only after ``u^T J`` of random ``u`` agreed with
direct VJPs. The group holds ``rows``, ``cols`` (int64, row-major), ``values`` and ``indptr`` (CSR row
pointer, ``n_of + 1``: rows ``a:b`` are entries ``indptr[a]:indptr[b]``), attributes ``format: "coo"`` and
the dense ``shape`` ``[n_of, n_wrt]``; ``manifest.json`` last. A retried job starts over (the products live
in memory); a cached pattern makes that cheap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from contracts import storage
from contracts.layout import RESULT_GROUP, job_url
from contracts.records import iso_time
from worker import result_group
from worker.storage import jsonable, write_manifest

log = logging.getLogger(__name__)

ENTRIES_PER_CHUNK = 1 << 22          # storage chunk of rows/cols/values: 4 Mi entries (32 MiB of int64)
HOST_CALL_BYTES = 1 << 30            # default peak of one compressed call on a CPU (see docs/BENCHMARKS.md)


@dataclass
class DenseInstead:
    """The sparse path was not taken: compute densely and report ``sparsity`` (``fallback`` says why)."""

    sparsity: dict[str, Any]


@dataclass
class SparseRun:
    """What the sparse path did, for the plan: seconds per stage and the counts."""

    seconds: dict[str, float] = field(default_factory=dict)

    def timed(self, stage: str, started: float) -> None:
        self.seconds[stage] = round(time.monotonic() - started, 3)


def source_of(sparsity: Any) -> str:
    if isinstance(sparsity, dict):
        return next(iter(sparsity))
    return str(sparsity)


def compute_sparse_to_storage(model: Any, inputs: dict[str, Any], *, of: str | None, wrt: str | None,
                              sparsity: Any, results_url: str, job_id: str, probe: Any = None,
                              budget_bytes: int | None = None, chunk_size: int | None = None,
                              cache_dir: str | None = None, output_dtype: str | None = None,
                              on_progress: Callable[[int, int], None] | None = None,
                              should_stop: Callable[[], bool] | None = None,
                              previous: Callable[[str], Any] | None = None,
                              shared_cache: Any = None, created_at: float | None = None,
                              manifest_fields: dict[str, Any] | None = None) -> dict[str, Any] | DenseInstead:
    """The sparse Jacobian of ``of`` w.r.t. the input ``wrt``; ``previous(job_id)`` gives an earlier job's
    result group URL (``pattern_from``); ``shared_cache``: detected patterns shared by the workers
    (``patterns.SharedBlobs``). Raises ``EngineError`` (``InvalidRequest`` naming ``sparsity``)."""
    from worker.engine.matfree import build_operator
    from worker.engine.sparsity import compressed
    from worker.engine.sparsity.patterns import cache_key

    if hasattr(sparsity, "model_dump"):   # contracts.jobspec.PatternUri / PatternFrom
        sparsity = sparsity.model_dump()
    source = source_of(sparsity)
    run = SparseRun()
    op = build_operator(model, inputs, of=of, wrt=wrt, output_dtype=output_dtype)
    _check_wrt(op)
    wrt_name = op.axis.names[0]
    n_of, n_wrt = op.n_of, op.n_wrt
    t0 = time.monotonic()
    cache = _cache(cache_dir, shared_cache)
    arrays = {n: np.asarray(v) for n, v in inputs.items()}
    key = cache_key(model, arrays, of=op.of, wrt=wrt_name) if source == "auto" else ""
    pattern, colouring, reason = _pattern(model, op, arrays, sparsity, source, (n_of, n_wrt), cache, key, previous,
                                          wrt_name)
    run.timed("pattern", t0)
    if pattern is None:
        return DenseInstead({"source": source, "nnz": None, "density": None, "colors": None, "verified": False,
                             "fallback": reason, "seconds": run.seconds})
    t0 = time.monotonic()
    sp_plan = compressed.plan(pattern, colouring)
    run.timed("colouring", t0)
    if source == "auto" and colouring is None and sp_plan.colouring is not None:
        cache.put(key, pattern, tuple(op.of_shape), sp_plan.colouring)
    summary = sp_plan.summary(source)
    if not sp_plan.sparse:
        return DenseInstead({**summary, "seconds": run.seconds})
    held = sp_plan.colouring.count * (n_of + n_wrt) * np.dtype(op.compute_dtype).itemsize
    host = _host_free(probe)
    if host is not None and held > host // 4:
        summary["fallback"] = (f"dense: the compressed products and seeds would hold {held >> 20} MiB of host "
                               f"memory, over a quarter of the {host >> 20} MiB free")
        return DenseInstead({**summary, "seconds": run.seconds})
    pattern = compressed.sorted_pattern(pattern)
    if probe is not None:
        if budget_bytes is None and not getattr(probe, "is_gpu", False):
            budget_bytes = HOST_CALL_BYTES
        op.plan_memory(probe, budget_bytes)
    t0 = time.monotonic()
    products = compressed.compute(op, sp_plan.colouring, chunk_size=chunk_size, should_stop=should_stop,
                                  progress=on_progress)
    run.timed("products", t0)
    t0 = time.monotonic()
    ok, worst = compressed.verify(op, pattern, sp_plan.colouring, products)
    run.timed("verify", t0)
    summary.update(verified=ok, verify_difference=float(f"{worst:.3g}"), seconds=run.seconds,
                   products=int(sp_plan.colouring.count), label=op.labels.get("jvp") or op.labels.get("vjp"))
    if not ok:
        log.warning("job %s: the sparse result failed verification (relative difference %.3g): computing densely",
                    job_id, worst)
        summary["fallback"] = (f"dense: u^T J from the sparse result differs from direct VJPs by {worst:.3g} of "
                               "its largest: the pattern misses entries")
        return DenseInstead(summary)
    manifest = _write(op, pattern, sp_plan.colouring, products, summary, results_url=results_url, job_id=job_id,
                      created_at=created_at, manifest_fields=manifest_fields, run=run)
    return manifest


def _host_free(probe: Any) -> int | None:
    try:
        return int(probe.host_free_bytes()) if probe is not None else None
    except Exception:  # noqa: BLE001 - no reading: no bound
        return None


def _check_wrt(op: Any) -> None:
    from worker.engine.errors import InvalidRequest

    if len(op.axis.names) != 1 or op.axis.variables:
        raise InvalidRequest("sparsity: works with respect to one signature input; give wrt one input name, "
                             "not variables or a list", field="sparsity")


def _cache(cache_dir: str | None, shared: Any = None) -> Any:
    from worker.engine.sparsity.patterns import PatternCache

    return PatternCache(cache_dir, shared)


def _pattern(model: Any, op: Any, arrays: dict[str, np.ndarray], sparsity: Any, source: str,
             shape: tuple[int, int], cache: Any, key: str, previous: Callable[[str], Any] | None,
             wrt: str) -> tuple[Any, Any, str]:
    """``(pattern, colouring or None, "")``, or ``(None, None, why)`` when detection could not find it;
    ``key``: the cache key of an ``auto`` pattern."""
    from worker.engine.sparsity import patterns, walk

    if source == "auto":
        hit = cache.get(key)
        if hit is not None and hit[0].shape == shape:
            return hit[0], hit[2], ""
        try:
            pattern, _, _ = walk.detect(model, arrays, of=op.of, wrt=wrt)
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


def _write(op: Any, pattern: Any, colouring: Any, products: np.ndarray, summary: dict[str, Any], *,
           results_url: str, job_id: str, created_at: float | None, manifest_fields: dict[str, Any] | None,
           run: SparseRun) -> dict[str, Any]:
    """The COO arrays written chunk by chunk (entries computed per storage chunk), the group sealed, the
    manifest last."""
    import zarr
    from zarr.codecs import ZstdCodec

    from worker.engine.sparsity.compressed import entries

    t0 = time.monotonic()
    base = storage.normalize(job_url(results_url, job_id))
    group_url = storage.join(base, RESULT_GROUP)
    dtype = np.dtype(op.dtype)
    n_of, n_wrt = pattern.shape
    nnz = int(pattern.nnz)
    attrs = jsonable({**op.attrs(), "wrt": op.axis.names[0], "kind": "jacobian", "format": "coo",
                      "shape": [n_of, n_wrt], "of_shape": list(op.of_shape), "wrt_shape": list(op.axis.shape),
                      "sparsity": summary})
    group = zarr.create_group(store=storage.zarr_store(group_url, read_only=False), attributes=attrs, overwrite=True)
    chunk = max(1, min(ENTRIES_PER_CHUNK, nnz))
    made = {}
    for name, kind in (("rows", np.int64), ("cols", np.int64), ("values", dtype)):
        made[name] = group.create_array(name, shape=(nnz,), chunks=(chunk,), dtype=kind, fill_value=0,
                                        dimension_names=["nnz"], compressors=[ZstdCodec(level=1)], attributes={})
    indptr = group.create_array("indptr", shape=(n_of + 1,), chunks=(min(n_of + 1, ENTRIES_PER_CHUNK),),
                                dtype=np.int64, fill_value=0, dimension_names=["row_ptr"],
                                compressors=[ZstdCodec(level=1)], attributes={})
    indptr[...] = pattern.indptr.astype(np.int64)
    for lo in range(0, nnz, chunk):
        hi = min(nnz, lo + chunk)
        first = int(np.searchsorted(pattern.indptr, lo, side="right")) - 1
        last = int(np.searchsorted(pattern.indptr, hi, side="left"))
        rows, cols, values = entries(pattern, colouring, products, first, last, dtype)
        cut = slice(lo - int(pattern.indptr[first]), hi - int(pattern.indptr[first]))
        made["rows"][lo:hi] = rows[cut]
        made["cols"][lo:hi] = cols[cut]
        made["values"][lo:hi] = values[cut]
    run.timed("write", t0)
    finished, created = iso_time(time.time()), iso_time(created_at or time.time())
    plan = {"kind": "jacobian", "strategy": "sparse", "mode": colouring.mode, "shards": 1,
            "labels": dict(op.labels), "oom_retries": op.oom_retries, "sparsity": summary}
    result_group.seal(group_url, {"plan": jsonable(plan), "created_at": created, "finished_at": finished})
    manifest = {"id": job_id, "uri": group_url, "format": "coo", "array": "values", "kind": "jacobian",
                "shape": [nnz], "dense_shape": [n_of, n_wrt], "dtype": str(dtype), "of": op.of,
                "wrt": op.axis.names[0], "of_shape": list(op.of_shape), "wrt_shape": list(op.axis.shape),
                "sparsity": summary, "plan": plan,
                "arrays": {"rows": [nnz], "cols": [nnz], "values": [nnz], "indptr": [n_of + 1]},
                "model": {"path": op.model.path, "signature": op.model.signature},
                "created_at": created, "finished_at": finished,
                **{k: v for k, v in (manifest_fields or {}).items() if v is not None}}
    write_manifest(base, manifest)
    return manifest
