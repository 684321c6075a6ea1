"""A sparse Jacobian to storage (option ``sparsity``): pattern, colouring, compressed products, verification,
then the entries streamed as COO into the job's result group (DESIGN.md, "Sparse Jacobians").

``compute_sparse_to_storage`` returns the manifest, or a ``DenseInstead`` (the pattern too dense to pay, not
found, or the result failing verification) whose ``sparsity`` summary the caller puts in the dense job's plan.
Never a silently wrong sparse matrix: the entries are written only after ``u^T J`` of random ``u`` agreed with
direct VJPs. The group holds ``rows``, ``cols`` (int64, row-major), ``values`` and ``indptr`` (CSR row
pointer, ``n_of + 1``: rows ``a:b`` are entries ``indptr[a]:indptr[b]``), attributes ``format: "coo"`` and
the dense ``shape`` ``[n_of, n_wrt]``; ``manifest.json`` last. The compressed products are stored by blocks of
colours as they come (the array ``compressed``, one commit marker a block): a retried job computes only the
blocks not committed, and a sharded job (``worker.execution.sparse``) splits them between its shards.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from contracts import storage
from contracts.layout import COMMITTED_DIR, RESULT_GROUP, job_url
from contracts.records import iso_time
from worker import result_group
from worker.sparse_pattern import find_pattern, no_rule_note, pattern_cache, source_of
from worker.storage import jsonable, write_manifest

if TYPE_CHECKING:
    from worker.execution.context import RunContext

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


def compute_sparse_to_storage(ctx: RunContext, *, shared_cache: Any = None,
                              setup: SparseSetup | DenseInstead | None = None) -> dict[str, Any] | DenseInstead:
    """The sparse Jacobian of ``ctx.job`` (``of`` w.r.t. one input ``wrt``, option ``sparsity``), with the loaders,
    budget and callbacks of ``ctx`` (``worker.execution.RunContext``); ``ctx.previous_result(job_id)`` gives an
    earlier job's result group URL (``pattern_from``); ``shared_cache``: detected patterns shared by the workers
    (``patterns.SharedBlobs``). The compressed products are stored block by block as they come: a retried job
    computes only the colour blocks not committed (``compressed_products``). Raises ``EngineError``
    (``InvalidRequest`` naming ``sparsity``). ``setup``: ``prepare_sparse``'s answer when the caller has it."""
    setup = setup if setup is not None else prepare_sparse(ctx, shared_cache=shared_cache)
    if isinstance(setup, DenseInstead):
        return setup
    t0 = time.monotonic()
    products, reused = compressed_products(ctx, setup)
    setup.run.timed("products", t0)
    setup.summary["colour_blocks_reused"] = reused
    return conclude_sparse(ctx, setup, products)


@dataclass
class SparseSetup:
    """The sparse route of a request, ready to compute: the memory-planned operator, the pattern (CSR, sorted
    indices), its colouring, ``plan.sparsity`` so far (``summary``) and the stage timings (``run``)."""

    op: Any
    pattern: Any
    colouring: Any
    summary: dict[str, Any]
    run: SparseRun
    hessian: bool = False   # a Hessian (kind with a scalar of): HVPs of the colours, H u to verify

    @property
    def product(self) -> str:
        """The product kind of a colour: ``hvp`` (a Hessian), ``jvp`` (columns coloured) or ``vjp`` (rows)."""
        if self.hessian:
            return "hvp"
        return "jvp" if self.colouring.mode == "forward" else "vjp"

    @property
    def width(self) -> int:
        """The length of one compressed product."""
        return self.op.n_wrt if self.hessian or self.colouring.mode != "forward" else self.op.n_of

    @property
    def stamp(self) -> str:
        """The colouring's fingerprint, stored with the compressed products (a shard checks it)."""
        return hashlib.sha256(np.ascontiguousarray(self.colouring.colours, np.int64).tobytes()).hexdigest()[:16]


def prepare_sparse(ctx: RunContext, *, shared_cache: Any = None, check_host: bool = True) -> SparseSetup | DenseInstead:
    """The pattern (cached per model and shapes) and its colouring, or a ``DenseInstead`` saying why the sparse
    route does not pay. ``check_host=False`` (a shard, which holds only its own colours) skips the bound on the
    host memory the products take. Raises ``EngineError`` (``InvalidRequest`` naming ``sparsity``)."""
    from contracts.kinds import kind_spec
    from worker.engine.matfree import build_operator
    from worker.engine.plan_cache import default_cache_dir
    from worker.engine.sparsity import compressed
    from worker.engine.sparsity.patterns import cache_key

    job, probe, budget_bytes = ctx.job, ctx.probe, ctx.budget_bytes
    hessian = kind_spec(job.kind).scalar_of
    sparsity = job.sparsity.model_dump() if hasattr(job.sparsity, "model_dump") else job.sparsity
    wrt = job.wrt if isinstance(job.wrt, str) or job.wrt is None else job.wrt[0]
    model, inputs = ctx.load_model(), ctx.load_inputs()
    source = source_of(sparsity)
    run = SparseRun()
    op = build_operator(model, inputs, of=job.of, wrt=wrt, output_dtype=job.output_dtype,
                        kind="hvp" if hessian else None, reduce=getattr(job, "reduce", None) if hessian else None)
    _check_wrt(op)
    wrt_name = op.axis.names[0]
    n_of, n_wrt = (op.n_wrt if hessian else op.n_of), op.n_wrt
    t0 = time.monotonic()
    cache = pattern_cache(ctx.cache_dir or str(default_cache_dir()), shared_cache)
    arrays = {n: np.asarray(v) for n, v in inputs.items()}
    key = cache_key(model, arrays, of=f"{op.of} (hessian)" if hessian else op.of, wrt=wrt_name) \
        if source == "auto" else ""
    no_rule: dict[str, str] = {}
    pattern, colouring, reason = find_pattern(model, op, arrays, sparsity, source, (n_of, n_wrt), cache, key,
                                          ctx.previous_result, wrt_name, no_rule, hessian=hessian)
    run.timed("pattern", t0)
    named = {"no_rule": no_rule} if no_rule else {}
    if pattern is None:
        return DenseInstead({"source": source, "nnz": None, "density": None, "colors": None, "verified": False,
                             "fallback": reason + no_rule_note(no_rule), **named, "seconds": run.seconds})
    t0 = time.monotonic()
    sp_plan = compressed.plan(pattern, colouring, symmetric=hessian)
    run.timed("colouring", t0)
    if source == "auto" and colouring is None and sp_plan.colouring is not None:
        cache.put(key, pattern, tuple(op.of_shape), sp_plan.colouring, no_rule)
    summary = {**sp_plan.summary(source), **named}
    if not sp_plan.sparse:
        summary["fallback"] += no_rule_note(no_rule)
        return DenseInstead({**summary, "seconds": run.seconds})
    held = sp_plan.colouring.count * (n_of + n_wrt) * np.dtype(op.compute_dtype).itemsize
    host = _host_free(probe) if check_host else None
    if host is not None and held > host // 4:
        summary["fallback"] = (f"dense: the compressed products and seeds would hold {held >> 20} MiB of host "
                               f"memory, over a quarter of the {host >> 20} MiB free")
        return DenseInstead({**summary, "seconds": run.seconds})
    if probe is not None:
        if budget_bytes is None and not getattr(probe, "is_gpu", False):
            budget_bytes = HOST_CALL_BYTES
        op.plan_memory(probe, budget_bytes)
    if hessian:
        summary["colouring"] = "star (symmetric recovery)" if sp_plan.colouring.mode == "star" else \
            "distance-2 of the columns (direct recovery)"
    return SparseSetup(op, compressed.sorted_pattern(pattern), sp_plan.colouring, summary, run, hessian)


def conclude_sparse(ctx: RunContext, setup: SparseSetup, products: np.ndarray, *,
                    plan: dict[str, Any] | None = None) -> dict[str, Any] | DenseInstead:
    """Verify the compressed ``products`` (``(colours, n)``) against direct VJPs, then write the COO entries and
    the manifest (returned; ``plan``: fields added to its plan, e.g. the shards); a ``DenseInstead`` when they
    disagree (the pattern misses entries)."""
    from worker.engine.sparsity import compressed

    job, op, colouring, summary = ctx.job, setup.op, setup.colouring, setup.summary
    t0 = time.monotonic()
    ok, worst = compressed.verify(op, setup.pattern, colouring, products,
                                  direct_kind="hvp" if setup.hessian else "vjp")
    setup.run.timed("verify", t0)
    summary.update(verified=ok, verify_difference=float(f"{worst:.3g}"), seconds=setup.run.seconds,
                   products=int(colouring.count), label=op.labels.get(setup.product))
    if not ok:
        log.warning("job %s: the sparse result failed verification (relative difference %.3g): computing densely",
                    job.id, worst)
        direct = "HVPs" if setup.hessian else "VJPs"
        summary["fallback"] = (f"dense: u^T J from the sparse result differs from direct {direct} by {worst:.3g} of "
                               "its largest: the pattern misses entries")
        return DenseInstead(summary)
    return _write(op, setup.pattern, colouring, products, summary, results_url=job.results_url, job_id=job.id,
                  created_at=ctx.created_at, manifest_fields={"model": ctx.model_ref(), **ctx.manifest_fields},
                  run=setup.run, plan_fields=plan, kind=_kind(job))


COMPRESSED_ARRAY = "compressed"   # the compressed products while they are computed; replaced by the COO arrays


def compressed_products(ctx: RunContext, setup: SparseSetup) -> tuple[np.ndarray, int]:
    """The compressed products ``(colours, n)`` of a job in one piece: stored as they come into the array
    ``compressed`` of the result group (``compressed_writer``, ``compute_compressed``) and read back whole.
    A retried job (another worker, after a kill) computes only the blocks not committed. Returns the products and
    the number of blocks reused."""
    writer = compressed_writer(ctx, setup)
    reused = compute_compressed(ctx, setup, writer)
    return read_compressed(ctx.job.results_url, ctx.job.id), reused


def compressed_writer(ctx: RunContext, setup: SparseSetup, *, rows: tuple[int, int] | None = None,
                      block_bytes: int | None = None, create: bool = True) -> Any:
    """The ``ResultWriter`` of the array ``compressed``: one row per colour, one commit marker per storage block
    of colours. ``create=True`` (the job, or the job splitting itself): resumes the blocks committed, a stored
    array of another colouring is started over. ``create=False`` (a shard: ``rows``, the shard's colours): the
    array the split created, which must hold this colouring (else ``ValueError``: never two colourings mixed)."""
    from contracts.layout import ResultLayout
    from worker.storage import ResultWriter

    job, op, colouring = ctx.job, setup.op, setup.colouring
    width = setup.width
    dtype = np.dtype(op.compute_dtype)
    layout = ResultLayout((colouring.count, width), 0, 1, dtype.itemsize)
    attrs = {"kind": _kind(job), "stage": "compressed products", "mode": colouring.mode, "colouring": setup.stamp}
    if create:
        _forget_other_colouring(job.results_url, job.id, setup.stamp)
    writer = ResultWriter(job.results_url, job.id, layout=layout, dtype=dtype, attrs=attrs, array=COMPRESSED_ARRAY,
                          block_bytes=block_bytes or ctx.block_bytes, rows=rows, create=create)
    if not create:
        stored = storage.open_group(writer.group_url, mode="r").attrs.get("colouring")
        if stored != setup.stamp:
            writer.abort()
            raise ValueError(f"sparse shard: the stored compressed products are of colouring {stored}, this shard "
                             f"coloured the pattern as {setup.stamp}; the pattern changed since the job was split "
                             "(resubmit the job)")
    return writer


def compute_compressed(ctx: RunContext, setup: SparseSetup, writer: Any,
                       ranges: list[tuple[int, int]] | None = None) -> int:
    """Compute the colour blocks of ``writer`` not committed yet (or only ``ranges``, colours on block
    boundaries) and close it; returns the number of its blocks an earlier attempt had committed."""
    from worker.engine.errors import Stopped

    job, op, colouring = ctx.job, setup.op, setup.colouring
    dtype, width = writer.dtype, writer.layout.row_shape
    mine = [b for b in writer.blocks if writer.rows[0] <= b.row_start and b.row_stop <= writer.rows[1]]
    reused = len(mine) - len(writer.pending_blocks())
    if ranges is None:
        ranges = writer.pending_ranges()
        log.info("job %s: sparse: %d of %d colour blocks reused from an earlier attempt, %d to compute", job.id,
                 reused, len(mine), len(mine) - reused,
                 extra={"event": "colour_blocks", "reused": reused, "blocks": len(mine)})
    report = ctx.counter(writer.rows_total)
    done = {"colours": writer.rows_committed}
    report(done["colours"])
    kind = setup.product
    seeds = colouring.seeds(op.compute_dtype)
    try:
        for start, stop in ranges:
            def keep(offset: int, rows: np.ndarray, start: int = start) -> None:
                writer.write_rows(start + offset, np.asarray(rows, dtype).reshape((len(rows),) + width))
                done["colours"] += len(rows)
                report(done["colours"])

            op.apply(kind, seeds[start:stop], chunk_rows=ctx.chunk_rows, should_stop=ctx.should_stop, on_chunk=keep,
                     keep=False)
        writer.close()
    except Stopped:
        writer.close()
        raise
    except BaseException:
        writer.abort()
        raise
    return reused


def read_compressed(results_url: str, job_id: str) -> np.ndarray:
    """The stored compressed products, whole: ``(colours, n)``."""
    group = storage.open_group(storage.join(storage.normalize(job_url(results_url, job_id)), RESULT_GROUP), mode="r")
    return np.asarray(group[COMPRESSED_ARRAY][...])


def _forget_other_colouring(results_url: str, job_id: str, stamp: str) -> None:
    """Remove stored compressed products (and their commit markers) of a colouring other than ``stamp``."""
    base = storage.normalize(job_url(results_url, job_id))
    try:
        stored = storage.open_group(storage.join(base, RESULT_GROUP), mode="r").attrs.get("colouring")
    except (FileNotFoundError, KeyError, ValueError, OSError):
        return
    if stored not in (None, stamp):
        log.warning("job %s: stored compressed products are of another colouring; starting over", job_id)
        storage.delete_prefix(storage.join(base, COMMITTED_DIR))
        storage.delete_prefix(storage.join(base, RESULT_GROUP))


def _kind(job: Any) -> str:
    """The job's kind name, as the result group and the manifest say it."""
    return str(getattr(job.kind, "value", job.kind))


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


def _write(op: Any, pattern: Any, colouring: Any, products: np.ndarray, summary: dict[str, Any], *,
           results_url: str, job_id: str, created_at: float | None, manifest_fields: dict[str, Any] | None,
           run: SparseRun, plan_fields: dict[str, Any] | None = None, kind: str = "jacobian") -> dict[str, Any]:
    """The COO arrays written chunk by chunk (entries computed per storage chunk), the group sealed, the
    manifest last; ``plan_fields`` added to the plan (a sharded job's ``shards``)."""
    import zarr
    from zarr.codecs import ZstdCodec

    from contracts.kinds import kind_spec
    from worker.engine.sparsity.compressed import entries

    t0 = time.monotonic()
    base = storage.normalize(job_url(results_url, job_id))
    group_url = storage.join(base, RESULT_GROUP)
    dtype = np.dtype(op.dtype)
    n_of, n_wrt = pattern.shape
    nnz = int(pattern.nnz)
    of_shape = list(op.axis.shape) if n_of == n_wrt and kind_spec(kind).scalar_of else list(op.of_shape)  # H's rows
    attrs = jsonable({**op.attrs(), "wrt": op.axis.names[0], "kind": kind, "format": "coo",
                      "shape": [n_of, n_wrt], "of_shape": of_shape, "wrt_shape": list(op.axis.shape),
                      "sparsity": summary})
    group = zarr.create_group(store=storage.zarr_store(group_url, read_only=False), attributes=attrs, overwrite=True)
    storage.delete_prefix(storage.join(base, COMMITTED_DIR))   # the compressed products' markers: replaced
    chunk = max(1, min(ENTRIES_PER_CHUNK, nnz))
    made = {}
    for name, of_type in (("rows", np.int64), ("cols", np.int64), ("values", dtype)):
        made[name] = group.create_array(name, shape=(nnz,), chunks=(chunk,), dtype=of_type, fill_value=0,
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
    plan = {"kind": kind, "strategy": "sparse", "mode": colouring.mode, "shards": 1,
            "labels": dict(op.labels), "oom_retries": op.oom_retries, "sparsity": summary, **(plan_fields or {})}
    result_group.seal(group_url, {"plan": jsonable(plan), "created_at": created, "finished_at": finished})
    manifest = {"id": job_id, "uri": group_url, "format": "coo", "array": "values", "kind": kind,
                "shape": [nnz], "dense_shape": [n_of, n_wrt], "dtype": str(dtype), "of": op.of,
                "wrt": op.axis.names[0], "of_shape": of_shape, "wrt_shape": list(op.axis.shape),
                "sparsity": summary, "plan": plan,
                "arrays": {"rows": [nnz], "cols": [nnz], "values": [nnz], "indptr": [n_of + 1]},
                "model": {"path": op.model.path, "signature": op.model.signature},
                "created_at": created, "finished_at": finished,
                **{k: v for k, v in (manifest_fields or {}).items() if v is not None}}
    write_manifest(base, manifest)
    return manifest
