"""A sparse Jacobian's result group written as the worker writes it (the format contract of issue 15): Zarr v3,
consolidated, the 1-d arrays ``rows``, ``cols``, ``values`` (dimension ``nnz``) and ``indptr`` (``row_ptr``,
``n_of + 1`` entries), the group attributes ``format: "coo"``, ``shape: [n_of, n_wrt]`` and ``sparsity``,
and ``manifest.json`` beside the group, written last. Only zarr, numpy and scipy: no project code."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np


def random_matrix(n_of: int, n_wrt: int, density: float, *, seed: int = 0, dtype: str = "float32") -> Any:
    """A random ``scipy.sparse.csr_array`` of ``(n_of, n_wrt)``, non-zero values, sorted indices."""
    import scipy.sparse as sps

    rng = np.random.default_rng(seed)
    m = sps.random_array((n_of, n_wrt), density=density, format="csr", dtype=np.float64, rng=rng)
    m.data = (m.data + 0.5).astype(dtype)  # no stored zero
    m.sort_indices()
    return m


def write_sparse_group(uri: str | Path, matrix: Any, *, of_shape: tuple[int, ...], wrt_shape: tuple[int, ...],
                       chunk: int = 7, of: str = "y", wrt: str = "x", colors: int = 3,
                       model: str = "/models/m") -> dict[str, Any]:
    """``matrix`` (anything ``scipy.sparse.csr_array`` takes, ``(prod(of_shape), prod(wrt_shape))``) stored as
    a COO result group at ``uri`` in chunks of ``chunk`` entries; returns the manifest written beside it."""
    import scipy.sparse as sps
    import zarr

    csr = sps.csr_array(matrix)
    csr.sum_duplicates()
    csr.sort_indices()
    n_of, n_wrt = csr.shape
    assert (n_of, n_wrt) == (math.prod(of_shape), math.prod(wrt_shape))
    coo = csr.tocoo()
    rows, cols = (np.asarray(c, dtype=np.int64) for c in coo.coords)
    values, indptr = np.asarray(coo.data), np.asarray(csr.indptr, dtype=np.int64)
    nnz = int(values.shape[0])
    sparsity = {"source": "auto", "nnz": nnz, "density": nnz / max(1, n_of * n_wrt), "colors": colors,
                "verified": True, "mode": "forward"}
    plan = {"chunk_rows": colors, "strategy": "vectorized", "mode": "forward", "sparsity": sparsity}
    attrs = {"model": {"path": model, "signature": "serving_default"}, "signature": "serving_default", "of": of,
             "wrt": wrt, "kind": "jacobian", "mode": "forward", "of_shape": list(of_shape),
             "wrt_shape": list(wrt_shape), "dtype": values.dtype.name, "format": "coo", "shape": [n_of, n_wrt],
             "sparsity": sparsity, "plan": plan, "created_at": "2026-11-24T00:00:00.000Z",
             "finished_at": "2026-11-24T00:00:01.000Z"}
    group = zarr.open_group(str(uri), mode="w", zarr_format=3, attributes=attrs)
    for name, data, dim in (("rows", rows, "nnz"), ("cols", cols, "nnz"), ("values", values, "nnz"),
                            ("indptr", indptr, "row_ptr")):
        arr = group.create_array(name, shape=data.shape, dtype=data.dtype, chunks=(max(1, chunk),),
                                 dimension_names=[dim])
        arr[...] = data
    with warnings.catch_warnings():  # "not part of the Zarr format 3 specification": zarr and xarray read it
        warnings.filterwarnings("ignore", message="Consolidated metadata", category=UserWarning)
        zarr.consolidate_metadata(str(uri))
    manifest = {"id": Path(str(uri)).parent.name, "uri": str(uri), "array": "values", "format": "coo",
                "shape": [nnz], "dense_shape": [n_of, n_wrt], "dtype": values.dtype.name, "of_shape": list(of_shape),
                "wrt_shape": list(wrt_shape), "sparsity": sparsity, "plan": plan}
    (Path(str(uri)).parent / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest
