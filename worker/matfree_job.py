"""A matrix-free job to storage: kinds ``jvp``, ``vjp``, ``hvp``, ``ggn_vp``, ``fisher_vp`` (products of ``seeds``),
``svd``, ``hessian_eig``, ``hessian_trace``, ``ggn_eig``, ``ggn_trace``, ``hessian_diag``, ``spectral_density``,
``logdet`` (spectra) and ``ihvp`` (solves) computed by
``worker.engine.matfree``/``spectra``/``solve`` without forming the matrix, written as arrays of the job's result
group (``{job}/result.zarr``) with ``dimension_names``, the group sealed and ``manifest.json`` written last, as for
the dense kinds (``worker.pipeline``).

Arrays (DESIGN.md, "Storage"): ``products`` ``(seed,) + of`` (jvp) or ``(seed,) + wrt``; ``S (k,)``, ``U (k,) +
of``, ``V (k,) + wrt``; ``eigenvalues (k,)``, ``eigenvectors (k,) + wrt``; ``trace`` and ``stderr`` (0-d);
``solutions (seed,) + wrt``, ``residuals (seed,)``, ``iterations (seed,)`` (ihvp); ``diagonal`` and ``stderr``
(``wrt``); ``density`` and ``grid`` ``(grid,)``, ``nodes`` and ``weights`` ``(probe, step)``; ``logdet``. The
``wrt`` axes are ``wrt_0, ...`` for one source and one flat ``wrt`` axis for several (``wrt_slices`` in the
group's attributes says where each lies). Products are written block by block with commit markers (a retried
job computes only the blocks not committed); the spectra start over when retried.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from contracts import storage
from contracts.jobspec import MATRIX_FREE_KINDS
from contracts.kinds import FIELD_HELP, KINDS, Family, kind_spec
from contracts.layout import MAIN_ARRAYS, RESULT_GROUP, array_dimension_names, job_url
from contracts.records import iso_time
from worker import result_group
from worker.storage import jsonable, write_manifest

log = logging.getLogger(__name__)

BLOCK_BYTES = 32 << 20
HELD_BYTES = 256 << 20   # products held in memory at once: runs of whole storage blocks up to this (at least one)


def dimension_names(op: Any, kind: str) -> dict[str, list[str]]:
    """Each of the kind's arrays' axis names (its ``KindSpec.dims``): ``seed`` or ``k`` first, then ``of_i`` or
    the wrt axes (``wrt_i``; ``wrt`` when several sources are concatenated)."""
    wrt_names = None if len(op.axis.names) == 1 else ["wrt"]
    return {array: array_dimension_names(kind, array, tuple(op.of_shape), tuple(op.axis.shape), wrt_names=wrt_names)
            for array in kind_spec(kind).arrays}


@dataclass
class MatFreeRun:
    """One matrix-free run into ``{results_url}/{job_id}/``: the kind's arguments (``seeds``, ``rank``, ``tol``,
    ``max_iterations``, ``allow_unconverged``, ``samples``, ``probes``, ...), ``chunk_rows`` (None: planned from
    memory), ``on_progress(done, total)`` (seeds or iterations), ``should_stop``, what the manifest adds,
    ``block_bytes`` (the products' storage blocks, default 32 MiB: the unit a retried job resumes from) and, for a
    shard, its seeds ``rows`` written into the existing array."""

    results_url: str
    job_id: str
    seeds: np.ndarray | None = None
    rank: int | None = None
    tol: float | None = None
    samples: int | None = None
    loss: str | None = None
    labels: str | None = None
    damping: float | None = None
    curvature: str | None = None
    precondition: str | None = None
    max_iterations: int | None = None
    allow_unconverged: bool = False
    probes: int | None = None
    steps: int | None = None
    sigma: float | None = None
    chunk_rows: int | None = None
    on_progress: Callable[[int, int | None], None] | None = None
    should_stop: Callable[[], bool] | None = None
    manifest_fields: dict[str, Any] | None = None
    created_at: float | None = None
    block_bytes: int | None = None
    rows: tuple[int, int] | None = None
    create: bool = True


def compute_matfree_to_storage(op: Any, kind: str, *, results_url: str, job_id: str, **options: Any) -> dict[str, Any]:
    """Run ``kind`` on ``op`` (``worker.engine.matfree.build_operator``) and store it; returns the manifest.
    ``options``: the fields of ``MatFreeRun``. Raises ``EngineError`` (``Stopped`` on cancel, ``InvalidRequest``
    naming ``seeds``, ``rank``, ``tol``, ``samples``)."""
    from worker.engine import spectra

    run = MatFreeRun(results_url=results_url, job_id=job_id, **options)
    chunk_rows = run.chunk_rows
    on_progress, should_stop = run.on_progress, run.should_stop
    base = storage.normalize(job_url(results_url, job_id))
    group_url = storage.join(base, RESULT_GROUP)
    spec = KINDS.get(str(getattr(kind, "value", kind)))
    if spec is None or not spec.matrix_free:
        from worker.engine.errors import InvalidRequest

        raise InvalidRequest(f"kind: {kind!r} is not a matrix-free kind; use one of "
                             f"{', '.join(MATRIX_FREE_KINDS)}", field="kind")
    dims = dimension_names(op, kind)
    t0 = time.monotonic()
    if spec.family is Family.products:
        if run.seeds is None:
            raise _missing("seeds", kind)
        result, stored = _products(op, kind, run)
    else:   # a spectrum or a solve: the kind's own fields (rank, tol; samples; damping, ...), the required ones given
        storage.delete_prefix(group_url)
        stored = {}
        args = {f: _required(getattr(run, f), f, kind) if f in spec.required else getattr(run, f)
                for f in spec.fields}
        if spec.seeds is not None:
            args["seeds"] = _required(run.seeds, "seeds", kind)
        result = spectra.spectral(op, kind, **args, chunk_rows=chunk_rows, progress=on_progress,
                                  should_stop=should_stop)
        _write_small(group_url, op, kind, result, dims)
    seconds = time.monotonic() - t0
    shapes = {name: list(np.shape(a)) for name, a in result.arrays.items()} | stored
    finished = iso_time(time.time())
    created = iso_time(run.created_at or time.time())
    plan = {"kind": kind, "method": result.method, "iterations": result.iterations, "products": result.products,
            "converged": result.converged, "run_seconds": round(seconds, 3), "labels": dict(op.labels),
            "oom_retries": op.oom_retries}
    result_group.seal(group_url, {"plan": plan, **result.attributes(), "created_at": created, "finished_at": finished})
    main = MAIN_ARRAYS[kind]
    manifest = {"id": job_id, "uri": group_url, "format": "zarr-v3", "array": main, "kind": kind,
                "shape": shapes.get(main, []), "dtype": str(np.dtype(op.dtype)), "arrays": shapes, "plan": plan,
                "of": op.of, "wrt": list(op.axis.names), "wrt_slices": op.axis.slices,
                "model": {"path": op.model.path, "signature": op.model.signature},
                "created_at": created, "finished_at": finished,
                **{k: v for k, v in (run.manifest_fields or {}).items() if v is not None}}
    if result.residuals is not None:
        manifest["residuals"] = [float(r) for r in np.asarray(result.residuals, np.float64)]
    if spec.family is not Family.products:
        manifest["converged"] = bool(result.converged)
        if "warning" in result.attrs:
            manifest["warning"] = str(result.attrs["warning"])
    write_manifest(base, manifest)
    return manifest


def products_writer(op: Any, kind: str, k: int, results_url: str, job_id: str, *, block_bytes: int | None = None,
                    rows: tuple[int, int] | None = None, create: bool = True) -> Any:
    """The ``ResultWriter`` of the ``products`` array of ``k`` seeds (``create``: make the group and array, keeping
    blocks committed before; else open them, as a shard does); ``rows``: a shard's seeds."""
    from contracts.layout import ResultLayout
    from worker.storage import ResultWriter

    row_shape = tuple(op.of_shape) if kind_spec(kind).product_axes == "of" else tuple(op.axis.shape)
    dtype = np.dtype(op.dtype)
    layout = ResultLayout(shape=(k,) + row_shape, iter_start=0, iter_stop=1, itemsize=dtype.itemsize,
                          block_bytes=block_bytes or BLOCK_BYTES)
    attrs = {**_attrs(op, kind), "dimension_names": dimension_names(op, kind)["products"], "seeds": k}
    return ResultWriter(results_url, job_id, layout=layout, dtype=dtype, attrs=attrs, array="products",
                        block_bytes=block_bytes or BLOCK_BYTES, rows=rows, create=create)


def _products(op: Any, kind: str, run: MatFreeRun) -> Any:
    """Products streamed into the ``products`` array by a ``ResultWriter`` (one commit marker per storage block
    of seeds): a retried job computes only the seeds of blocks not committed yet. ``run.rows``/``run.create``: a
    shard's seeds, written into the array its planner made."""
    from worker.engine.errors import Stopped
    from worker.engine.matfree import run_products

    seeds = np.asarray(run.seeds)
    on_progress, should_stop, chunk_rows = run.on_progress, run.should_stop, run.chunk_rows
    k = int(seeds.shape[0]) if seeds.ndim else 0
    dtype = np.dtype(op.dtype)
    writer = products_writer(op, kind, k, run.results_url, run.job_id, block_bytes=run.block_bytes, rows=run.rows,
                             create=run.create)
    row_shape = writer.layout.row_shape
    result, spent = None, dict.fromkeys(("jvp", "vjp", "hvp", "checks"), 0)
    try:
        done = writer.rows_committed
        if on_progress is not None:   # the resume point first, so a caller counting deltas counts this attempt's
            on_progress(done, writer.rows_total)
        for start, stop in _runs(writer, HELD_BYTES):
            def keep(offset: int, rows: np.ndarray, start: int = start) -> None:
                writer.write_rows(start + offset, np.asarray(rows, dtype).reshape((len(rows),) + row_shape))

            def progress(seeds_done: int, _total: int | None, before: int = done) -> None:
                if on_progress is not None:
                    on_progress(before + seeds_done, writer.rows_total)

            result = run_products(op, kind, seeds[start:stop], chunk_rows=chunk_rows, progress=progress,
                                  should_stop=should_stop, on_chunk=keep)
            spent = {name: spent.get(name, 0) + count for name, count in result.products.items()}
            done += stop - start
        writer.close()
    except Stopped:  # canceled: the whole blocks computed so far are right, keep them for a resumed job
        with contextlib.suppress(ValueError):  # the block half filled at the stop is dropped
            writer.close()
        raise
    except BaseException:
        writer.abort()
        raise
    if result is None:  # every block committed by an earlier attempt
        from worker.engine.matfree import MatFreeResult

        result = MatFreeResult(kind=kind, method="resumed: every block stored before", arrays={}, products={},
                               iterations=0, attrs={"seeds": k})
    result.products = spent
    result.arrays = {}  # stored already, block by block
    return result, {"products": [k, *row_shape]}


def _runs(writer: Any, held_bytes: int) -> list[tuple[int, int]]:
    """The pending seeds as runs of adjacent whole blocks of at most ``held_bytes`` of products each."""
    row_bytes = max(1, writer.layout.row_bytes)
    out: list[tuple[int, int]] = []
    for b in writer.pending_blocks():
        if out and out[-1][1] == b.row_start and (b.row_stop - out[-1][0]) * row_bytes <= held_bytes:
            out[-1] = (out[-1][0], b.row_stop)
        else:
            out.append((b.row_start, b.row_stop))
    return out


def _write_small(group_url: str, op: Any, kind: str, result: Any, dims: dict[str, list[str]]) -> None:
    """The spectra's arrays (a few vectors, a diagonal, a density): written whole, flat ``of`` and ``wrt`` axes in
    their tensors' shapes (the kind's ``dims``)."""
    import zarr

    attrs = jsonable({**_attrs(op, kind), **result.attributes()})
    stderr = result.arrays.get("stderr")
    if stderr is not None and np.ndim(stderr) == 0:  # a 0-d value's standard error, for readers of its array alone
        attrs["stderr_value"] = float(np.asarray(stderr))
    group = zarr.create_group(store=storage.zarr_store(group_url, read_only=False), attributes=attrs, overwrite=True)
    words = kind_spec(kind)
    for name, value in result.arrays.items():
        data = _shaped(np.asarray(value), words.dims_of(name) if name in words.arrays else (), op)
        names = dims.get(name) or [f"{name}_{i}" for i in range(data.ndim)]
        if len(names) != data.ndim:
            names = [f"{name}_{i}" for i in range(data.ndim)]
        array = group.create_array(name, shape=data.shape, dtype=data.dtype, fill_value=0, dimension_names=names,
                                   attributes=attrs)
        array[...] = data


def _shaped(data: np.ndarray, words: tuple[str, ...], op: Any) -> np.ndarray:
    """``data`` with its trailing flat ``of`` or ``wrt`` axis in that tensor's shape (``words``: the array's
    ``KindSpec.dims``, the other axes leading, e.g. ``("k", "wrt")``)."""
    tail = {"of": tuple(op.of_shape), "wrt": tuple(op.axis.shape)}
    if not words or words[-1] not in tail or data.ndim != len(words):
        return data
    return data.reshape(data.shape[:-1] + tail[words[-1]])


def _attrs(op: Any, kind: str) -> dict[str, Any]:
    return jsonable({**op.attrs(), "kind": kind})


def _required(value: Any, field: str, kind: str) -> Any:
    if value is None:
        raise _missing(field, kind)
    return value


def _missing(field: str, kind: str) -> Exception:
    from worker.engine.errors import InvalidRequest

    what = {"seeds": "the vectors to multiply, shape (k,) + wrt.shape (jvp, hvp) or (k,) + of.shape (vjp)",
            "rank": "how many singular values or eigenpairs, e.g. 5"}.get(field) \
        or FIELD_HELP.get(field, "see its docs")
    return InvalidRequest(f"{field}: kind {kind!r} needs {field}: {what}", field=field)


def compute_products_shard(op: Any, kind: str, seeds: np.ndarray, *, results_url: str, job_id: str,
                           rows: tuple[int, int], **options: Any) -> dict[str, int]:
    """One shard of a sharded product job: seeds ``rows`` into the ``products`` array its planner created
    (``products_writer(create=True)``), resuming from the committed blocks; returns the products spent.
    ``options``: ``block_bytes``, ``chunk_rows``, ``on_progress``, ``should_stop`` (``MatFreeRun``)."""
    run = MatFreeRun(results_url=results_url, job_id=job_id, seeds=np.asarray(seeds), rows=rows, create=False,
                     **options)
    result, _ = _products(op, kind, run)
    return dict(result.products)


def finish_products(writer: Any, *, plan: dict[str, Any], created_at: float | None = None,
                    manifest_fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """The finalizer's part for a sharded product job, on its ``ResultWriter`` of the ``products`` array
    (``ResultWriter.open_existing``): every block committed (else ``RuntimeError``), the group sealed with
    ``plan``, ``manifest.json`` last; returns the manifest. Needs no model."""
    writer.close()
    missing = writer.missing_blocks()
    if missing:
        raise RuntimeError(f"manifest: blocks {[b.index for b in missing][:10]} are not committed")
    attrs = writer.attrs
    finished, created = iso_time(time.time()), iso_time(created_at or time.time())
    shape = list(writer.layout.shape)
    spent: dict[str, int] = {}
    for shard in plan.get("shard_plans") or []:
        for name, count in (shard.get("products") or {}).items():
            spent[name] = spent.get(name, 0) + int(count)
    plan = {**plan, "kind": attrs.get("kind"), "products": spent}
    result_group.seal(writer.group_url, {"plan": jsonable(plan), "created_at": created, "finished_at": finished,
                                         "method": "products in shards", "products": spent,
                                         "seeds": shape[0] if shape else 0})
    manifest = {"id": writer.job_id, "uri": writer.group_url, "format": "zarr-v3", "array": "products",
                "kind": attrs.get("kind"), "shape": shape, "dtype": writer.dtype.name, "arrays": {"products": shape},
                "plan": plan, "of": attrs.get("of"), "wrt": attrs.get("wrt"), "wrt_slices": attrs.get("wrt_slices"),
                "model": {"path": attrs.get("model"), "signature": attrs.get("signature")},
                "created_at": created, "finished_at": finished,
                **{k: v for k, v in (manifest_fields or {}).items() if v is not None}}
    write_manifest(writer.job_url, manifest)
    return manifest
