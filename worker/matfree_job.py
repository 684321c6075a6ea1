"""A matrix-free job to storage: kinds ``jvp``, ``vjp``, ``hvp`` (products of ``seeds``), ``svd``, ``hessian_eig``
and ``hessian_trace`` (spectra) computed by ``worker.engine.matfree``/``spectra`` without forming the matrix,
written as arrays of the job's result group (``{job}/result.zarr``) with ``dimension_names``, the group sealed
and ``manifest.json`` written last, as for the dense kinds (``worker.pipeline``).

Arrays (DESIGN.md, "Storage"): ``products`` ``(seed,) + of`` (jvp) or ``(seed,) + wrt``; ``S (k,)``, ``U (k,) +
of``, ``V (k,) + wrt``; ``eigenvalues (k,)``, ``eigenvectors (k,) + wrt``; ``trace`` and ``stderr`` (0-d). The
``wrt`` axes are ``wrt_0, ...`` for one source and one flat ``wrt`` axis for several (``wrt_slices`` in the
group's attributes says where each lies). A run starts over when retried (products are not resumed by block).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from contracts import storage
from contracts.layout import MAIN_ARRAYS, MANIFEST, RESULT_GROUP, job_url
from contracts.records import iso_time
from worker import result_group

log = logging.getLogger(__name__)

MATFREE_KINDS = ("jvp", "vjp", "hvp", "svd", "hessian_eig", "hessian_trace")
BLOCK_BYTES = 32 << 20


def _names(prefix: str, shape: tuple[int, ...]) -> list[str]:
    return [f"{prefix}_{i}" for i in range(len(shape))]


def dimension_names(op: Any, kind: str) -> dict[str, list[str]]:
    """Each array's axis names: ``seed`` or ``k`` first, then ``of_i`` or the wrt axes (``wrt_i``; ``wrt``
    when several sources are concatenated)."""
    of = _names("of", tuple(op.of_shape))
    wrt = _names("wrt", tuple(op.axis.shape)) if len(op.axis.names) == 1 else ["wrt"]
    return {"products": ["seed"] + (of if kind == "jvp" else wrt), "S": ["k"], "U": ["k"] + of, "V": ["k"] + wrt,
            "eigenvalues": ["k"], "eigenvectors": ["k"] + wrt, "trace": [], "stderr": []}


def compute_matfree_to_storage(op: Any, kind: str, *, results_url: str, job_id: str, seeds: np.ndarray | None = None,
                               rank: int | None = None, tol: float | None = None, samples: int | None = None,
                               chunk_size: int | None = None,
                               on_progress: Callable[[int, int | None], None] | None = None,
                               should_stop: Callable[[], bool] | None = None,
                               manifest_fields: dict[str, Any] | None = None,
                               created_at: float | None = None) -> dict[str, Any]:
    """Run ``kind`` on ``op`` (``worker.engine.matfree.build_operator``) and store it; returns the manifest.
    ``on_progress(done, total)``: seeds done (products) or iterations (spectra). Raises ``EngineError``
    (``Stopped`` on cancel, ``InvalidRequest`` naming ``seeds``, ``rank``, ``tol``, ``samples``)."""
    from worker.engine import spectra
    from worker.engine.matfree import run_products

    base = storage.normalize(job_url(results_url, job_id))
    group_url = storage.join(base, RESULT_GROUP)
    storage.delete_prefix(group_url)
    dims = dimension_names(op, kind)
    t0 = time.monotonic()
    if kind in ("jvp", "vjp", "hvp"):
        if seeds is None:
            raise _missing("seeds", kind)
        result = _products(op, kind, np.asarray(seeds), group_url, dims, chunk_size, on_progress, should_stop,
                           run_products)
    else:
        if kind == "svd":
            result = spectra.svd(op, _required(rank, "rank", kind), tol=tol, chunk_size=chunk_size,
                                 progress=on_progress, should_stop=should_stop)
        elif kind == "hessian_eig":
            result = spectra.hessian_eig(op, _required(rank, "rank", kind), tol=tol, chunk_size=chunk_size,
                                         progress=on_progress, should_stop=should_stop)
        elif kind == "hessian_trace":
            result = spectra.hessian_trace(op, samples, chunk_size=chunk_size, progress=on_progress,
                                           should_stop=should_stop)
        else:
            from worker.engine.errors import InvalidRequest

            raise InvalidRequest(f"kind: {kind!r} is not a matrix-free kind; use one of {', '.join(MATFREE_KINDS)}",
                                 field="kind")
        _write_small(group_url, op, kind, result, dims)
    seconds = time.monotonic() - t0
    stored = result.attrs.pop("stored_shapes", {})
    shapes = {name: list(np.shape(a)) for name, a in result.arrays.items()} | stored
    finished = iso_time(time.time())
    created = iso_time(created_at or time.time())
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
                **{k: v for k, v in (manifest_fields or {}).items() if v is not None}}
    if result.residuals is not None:
        manifest["residuals"] = [float(r) for r in np.asarray(result.residuals, np.float64)]
    body = json.dumps(_jsonable(manifest), indent=2, sort_keys=True).encode()
    storage.write_bytes(storage.join(base, MANIFEST), body)
    return manifest


def _products(op: Any, kind: str, seeds: np.ndarray, group_url: str, dims: dict[str, list[str]],
              chunk_size: int | None, on_progress: Any, should_stop: Any, run_products: Any) -> Any:
    """Products streamed into the ``products`` array chunk by chunk (never all held twice)."""
    import zarr

    row_shape = tuple(op.of_shape) if kind == "jvp" else tuple(op.axis.shape)
    k = int(seeds.shape[0]) if seeds.ndim else 0
    group = zarr.create_group(store=storage.zarr_store(group_url, read_only=False), attributes=_attrs(op, kind),
                              overwrite=True)
    row_bytes = max(1, int(np.prod(row_shape)) * np.dtype(op.dtype).itemsize)
    block = max(1, min(max(k, 1), BLOCK_BYTES // row_bytes))
    array = group.create_array("products", shape=(k,) + row_shape, chunks=(block,) + row_shape, dtype=op.dtype,
                               fill_value=0, dimension_names=dims["products"],
                               attributes={**_attrs(op, kind), "seeds": k})

    def keep(start: int, rows: np.ndarray) -> None:
        array[start:start + len(rows)] = np.asarray(rows, op.dtype).reshape((len(rows),) + row_shape)

    result = run_products(op, kind, seeds, chunk_size=chunk_size, progress=on_progress, should_stop=should_stop,
                          on_chunk=keep)
    result.arrays = {}  # stored already, chunk by chunk
    result.attrs["stored_shapes"] = {"products": [k, *row_shape]}
    return result


def _write_small(group_url: str, op: Any, kind: str, result: Any, dims: dict[str, list[str]]) -> None:
    """The spectra's arrays (at most ``rank`` vectors): written whole, vectors in the axes' shapes."""
    import zarr

    attrs = _jsonable({**_attrs(op, kind), **result.attributes()})
    if "stderr" in result.arrays:  # the trace's standard error, for readers of the trace array alone
        attrs["stderr_value"] = float(np.asarray(result.arrays["stderr"]))
    group = zarr.create_group(store=storage.zarr_store(group_url, read_only=False), attributes=attrs, overwrite=True)
    for name, value in result.arrays.items():
        data = np.asarray(value)
        if name in ("V", "eigenvectors") and data.ndim == 2 and len(dims[name]) != 2:
            data = data.reshape((data.shape[0],) + tuple(op.axis.shape))
        if name == "U" and data.ndim == 2 and len(dims[name]) != 2:
            data = data.reshape((data.shape[0],) + tuple(op.of_shape))
        names = dims.get(name) or [f"{name}_{i}" for i in range(data.ndim)]
        if len(names) != data.ndim:
            names = [f"{name}_{i}" for i in range(data.ndim)]
        array = group.create_array(name, shape=data.shape, dtype=data.dtype, fill_value=0, dimension_names=names,
                                   attributes=attrs)
        array[...] = data


def _attrs(op: Any, kind: str) -> dict[str, Any]:
    return _jsonable({**op.attrs(), "kind": kind})


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def _required(value: int | None, field: str, kind: str) -> int:
    if value is None:
        raise _missing(field, kind)
    return int(value)


def _missing(field: str, kind: str) -> Exception:
    from worker.engine.errors import InvalidRequest

    what = {"seeds": "the vectors to multiply, shape (k,) + wrt.shape (jvp, hvp) or (k,) + of.shape (vjp)",
            "rank": "how many singular values or eigenpairs, e.g. 5"}[field]
    return InvalidRequest(f"{field}: kind {kind!r} needs {field}: {what}", field=field)
