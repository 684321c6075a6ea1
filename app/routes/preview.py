"""``GET /v1/jobs/{id}/preview.png``: a downsampled heatmap of a succeeded job's Jacobian.

The result is seen as a matrix, output elements down and ``wrt`` elements across (the row and column
axes flattened in C order; a Hessian is ``wrt`` by ``wrt``), block-averaged to at most ``size`` cells
per side while the Zarr array is read one storage chunk at a time (never whole). A batch Jacobian
gives one panel per example, the first ``panels`` of them. Colours are diverging and centred on zero
(blue negative, white zero, red positive), symmetric at the largest absolute block mean, with a
colour bar. A sparse Jacobian (stored as COO) shows its sparsity pattern instead (``app.spy``). Drawn by
matplotlib's Agg renderer (``app.heatmap``, ``app.plots``); cached per job.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response

from app.deps import JobIdDep, StoreDep, require_api_key
from app.errors import error_responses
from app.heatmap import MatrixAxis, block_mean, render_heatmap
from app.job_storage import open_result_at, result_uri
from app.plots import placeholder
from app.sparse import SparseResult
from app.spectrum import render_spectrum
from app.spy import render_pattern
from contracts.kinds import Family, spec_or_jacobian

PNG_MEDIA_TYPE = "image/png"
CACHE_ENTRIES = 32
CONCURRENT_RENDERS = 2  # each reads a whole result, chunk by chunk

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(require_api_key)],
                   responses=error_responses(401, 429))

_cache: OrderedDict[tuple[Any, ...], tuple[bytes, dict[str, str]]] = OrderedDict()
_cache_lock = threading.Lock()
_render_slots = threading.BoundedSemaphore(CONCURRENT_RENDERS)


def matrix_axes(kind: str | None, shape: tuple[int, ...], attrs: dict[str, Any]) -> tuple[bool, int]:
    """``(batch, row_axes)``: whether axis 0 is the example axis, and how many axes after it are rows
    (the output's; the rest are the ``wrt`` columns)."""
    ndim = len(shape)
    spec = spec_or_jacobian(kind)
    if spec.preview == "products":  # products: one row per seed, the product's elements across
        return False, min(1, ndim)
    batch = spec.batch_axis and ndim >= 1
    lead = 1 if batch else 0
    wrt_shape = attrs.get("wrt_shape")
    of_shape = attrs.get("of_shape")
    if isinstance(wrt_shape, list):
        n_col = len(wrt_shape) - lead
    elif spec.family is Family.dense and not spec.scalar_of and not spec.batch_axis and isinstance(of_shape, list):
        n_col = ndim - len(of_shape)
    else:
        n_col = (ndim - lead) // 2
    return batch, min(max(0, ndim - lead - n_col), ndim - lead)


def _label(name: Any) -> str:
    text = str(name or "?")
    return text if len(text) <= 24 else "..." + text[-21:]


def _titles(kind: str, of: str, wrt: str, batch: bool) -> tuple[str, str, str, str]:
    """``(title, value label, row tensor, column tensor)`` for a result of ``kind``."""
    spec = spec_or_jacobian(kind)
    if spec.family is Family.dense and spec.scalar_of:
        return f"Hessian of {of} with respect to {wrt}", f"∂²{of}/∂{wrt}²", wrt, wrt
    if spec.preview == "products":
        across = of if spec.product_axes == "of" else wrt
        return f"Products {spec.symbol} of {of} w.r.t. {wrt}", spec.symbol, "seeds", across
    if batch:
        return f"Batch Jacobian ∂{of}[i]/∂{wrt}[i]", f"∂{of}[i]/∂{wrt}[i]", f"{of}[i]", f"{wrt}[i]"
    return f"Jacobian ∂{of}/∂{wrt}", f"∂{of}/∂{wrt}", of, wrt


def render_preview(array: Any, *, kind: str | None, panels: int, size: int,
                   job_id: str | None = None) -> tuple[bytes, dict[str, str]]:
    """PNG bytes of the heatmap of ``array`` and a few headers describing it."""
    attrs = dict(array.attrs)
    shape = tuple(int(d) for d in array.shape)
    kind = str(attrs.get("kind") or kind or "jacobian")
    if spec_or_jacobian(kind).spectrum is not None:   # previews "spectrum" and "density"
        stderr = attrs.get("stderr_value")
        return render_spectrum(np.asarray(array[...]), attrs, job_id=job_id, stderr=stderr, kind=kind), {}
    if isinstance(attrs.get("wrt"), list):
        attrs["wrt"] = ", ".join(map(str, attrs["wrt"]))
    batch, row_axes = matrix_axes(kind, shape, attrs)
    of, wrt = _label(attrs.get("of")), _label(attrs.get("wrt"))
    if 0 in shape:
        return placeholder(f"Empty result, shape {shape}: nothing to draw"), {}
    max_side = size if not batch or min(shape[0], panels) == 1 else max(16, size // 2)
    ds = block_mean(array, row_axes=row_axes, batch=batch, max_panels=panels, max_side=max_side)
    n_panels, height, width = ds.panels.shape
    lead = 1 if batch else 0
    title, value_label, row_name, col_name = _titles(kind, of, wrt, batch)
    notes = [f"job {job_id}"] if job_id else []
    notes.append(f"result {shape}: {ds.rows} × {ds.cols}" + (" per example" if batch else ""))
    if batch:
        notes.append(f"first {n_panels} of {ds.panels_total} examples" if ds.panels_total > n_panels
                     else f"{n_panels} example{'s' if n_panels > 1 else ''}")
    if (height, width) != (ds.rows, ds.cols):
        notes.append(f"means of {-(-ds.rows // height)} × {-(-ds.cols // width)} blocks")
        value_label = f"block mean of {value_label}"
    png = render_heatmap(
        ds, title=title, subtitle=",  ".join(notes), value_label=value_label,
        row_axis=MatrixAxis(row_name, shape[lead:lead + row_axes]),
        col_axis=MatrixAxis(col_name, shape[lead + row_axes:]),
        panel_titles=[f"example {i}" for i in range(n_panels)] if batch else None)
    headers = {"X-Preview-Matrix": f"{ds.rows}x{ds.cols}", "X-Preview-Cells": f"{height}x{width}",
               "X-Preview-Panels": f"{n_panels}/{ds.panels_total}"}
    return png, headers


@router.get("/{job_id}/preview.png", response_class=Response,
            responses={200: {"content": {PNG_MEDIA_TYPE: {}}, "description": "the heatmap as PNG"},
                       404: {"description": "unknown job"}, 409: {"description": "the job has not succeeded"}})
def get_preview(
    job_id: JobIdDep, store: StoreDep,
    panels: Annotated[int, Query(ge=1, le=16, description="batch Jacobians: examples shown, one panel each")] = 4,
    size: Annotated[int, Query(ge=16, le=1024, description="at most this many cells per side (block means)")] = 512,
) -> Response:
    """A heatmap of the Jacobian, the sparsity pattern of a sparse one (409 until the job has succeeded)."""
    record = store.get(job_id)
    uri = result_uri(record, use="its preview can be drawn")
    key = (job_id, uri, record.finished_at, panels, size)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
    if hit is None:
        result = open_result_at(job_id, uri, sparse=True)
        with _render_slots:
            if isinstance(result, SparseResult):
                hit = render_pattern(result, size=size, job_id=job_id)
            else:
                hit = render_preview(result, kind=record.spec.get("kind"), panels=panels, size=size, job_id=job_id)
        with _cache_lock:
            _cache[key] = hit
            while len(_cache) > CACHE_ENTRIES:
                _cache.popitem(last=False)
    png, headers = hit
    return Response(png, media_type=PNG_MEDIA_TYPE, headers={"Cache-Control": "private, max-age=3600", **headers})
