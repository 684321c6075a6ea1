"""A sparse Jacobian's result group (COO, written here exactly as the format contract says) read by the
service: dense rows from the ``indptr`` slice only, the sparsity pattern on a pixel grid, the main array
``values``; and by the readers scientists use without project code: scipy, zarr, xarray, dask."""

from __future__ import annotations

import io

import numpy as np
import pytest

from app.sparse import SparseResult, is_sparse
from contracts import storage
from tests.sparse_group import random_matrix, write_sparse_group

OF_SHAPE, WRT_SHAPE = (3, 7), (4, 5)  # a 21 x 20 matrix


@pytest.fixture
def stored(tmp_path):
    import scipy.sparse as sps

    keep = np.ones(21, np.float32)
    keep[[4, 5]] = 0  # two empty rows
    matrix = sps.csr_array(sps.diags_array(keep) @ random_matrix(21, 20, 0.2, seed=3))
    matrix.eliminate_zeros()
    matrix.sort_indices()
    uri = str(tmp_path / "job" / "result.zarr")
    write_sparse_group(uri, matrix, of_shape=OF_SHAPE, wrt_shape=WRT_SHAPE, chunk=5)
    return uri, matrix


class Recording:
    """A zarr array's stand-in that records the slices read from it."""

    def __init__(self, array, log: list, name: str) -> None:
        self.array, self.log, self.name = array, log, name
        self.dtype, self.shape = array.dtype, array.shape

    def __getitem__(self, sel):
        self.log.append((self.name, sel.start, sel.stop))
        return self.array[sel]


def test_dense_rows_read_only_the_entries_of_those_rows(stored):
    uri, matrix = stored
    node = storage.open_result_node(uri)
    assert is_sparse(node)
    sp = SparseResult.of_group(node)
    assert (sp.shape, sp.of_shape, sp.wrt_shape, sp.nnz) == ((21, 20), OF_SHAPE, WRT_SHAPE, matrix.nnz)
    assert sp.row_shape == WRT_SHAPE and sp.rows_total == 21 and sp.row_bytes == 20 * 4
    dense, indptr = matrix.toarray(), matrix.indptr
    log: list = []
    arrays = {name: Recording(a, log, name) for name, a in sp.arrays.items()}
    sp = SparseResult(sp.group, sp.shape, sp.of_shape, sp.wrt_shape, arrays)
    for start, stop, block in ((0, 21, 1 << 20), (3, 9, 80), (4, 6, 80), (20, 21, 1), (2, 17, 3 * 80)):
        log.clear()
        parts = list(sp.iter_rows(start, stop, block_bytes=block))
        assert all(p.shape[1:] == WRT_SHAPE and p.dtype == np.float32 for p in parts)
        assert max(p.shape[0] for p in parts) == min(stop - start, max(1, block // 80))
        got = np.concatenate(parts)
        np.testing.assert_array_equal(got.reshape(stop - start, 20), dense[start:stop])
        for name, a, b in log:  # indptr[start:stop + 1], and of cols and values only indptr[start]:indptr[stop]
            low, high = (start, stop + 1) if name == "indptr" else (indptr[start], indptr[stop])
            assert low <= a < b <= high and name != "rows", (name, a, b, start, stop)


def test_duplicate_entries_add_up_as_in_scipy(tmp_path):
    import scipy.sparse as sps
    import zarr

    uri = str(tmp_path / "dup" / "result.zarr")
    write_sparse_group(uri, sps.csr_array(np.eye(3, dtype=np.float32)), of_shape=(3,), wrt_shape=(3,))
    group = zarr.open_group(uri, mode="r+")
    group["indptr"][...] = np.array([0, 2, 2, 3])  # row 0 holds (0, 0) twice, row 1 nothing
    group["rows"][...] = np.array([0, 0, 2])
    group["cols"][...] = np.array([0, 0, 2])
    sp = SparseResult.of_group(storage.open_result_node(uri))
    want = sps.coo_array((group["values"][:], (group["rows"][:], group["cols"][:])), shape=(3, 3)).toarray()
    np.testing.assert_array_equal(want, [[2, 0, 0], [0, 0, 0], [0, 0, 1]])
    np.testing.assert_array_equal(sp.dense_rows(0, 3), want)


def test_a_group_without_its_arrays_or_shape_is_refused(tmp_path):
    import zarr

    uri = str(tmp_path / "bad" / "result.zarr")
    write_sparse_group(uri, np.eye(3, dtype=np.float32), of_shape=(3,), wrt_shape=(3,))
    group = zarr.open_group(uri, mode="r+", use_consolidated=False)
    group.attrs["shape"] = [4, 3]  # indptr has 4 entries: 3 rows
    with pytest.raises(KeyError, match="indptr of n_of \\+ 1 entries"):
        SparseResult.of_group(zarr.open_group(uri, mode="r", use_consolidated=False))


def test_pattern_counts_match_a_histogram_of_all_entries(stored):
    uri, matrix = stored
    sp = SparseResult.of_group(storage.open_result_node(uri))
    coo = matrix.tocoo()
    for height, width, entries in ((21, 20, 1 << 20), (5, 7, 4), (1, 1, 3)):
        counts, cells = sp.pattern_counts(height, width, entries=entries)
        r_bin = (coo.coords[0] * height) // 21
        c_bin = (coo.coords[1] * width) // 20
        want = np.zeros((height, width), np.int64)
        np.add.at(want, (r_bin, c_bin), 1)
        np.testing.assert_array_equal(counts, want)
        assert cells.sum() == 21 * 20 and (counts <= cells).all()


def test_preview_draws_the_pattern(stored):
    from app.spy import render_pattern

    uri, matrix = stored
    sp = SparseResult.of_group(storage.open_result_node(uri))
    png, headers = render_pattern(sp, size=8, job_id="a" * 32)
    assert png.startswith(b"\x89PNG")
    assert headers == {"X-Preview-Matrix": "21x20", "X-Preview-Cells": "8x8", "X-Preview-Panels": "1/1",
                       "X-Preview-Nnz": str(matrix.nnz)}
    from matplotlib.image import imread

    assert imread(io.BytesIO(png)).shape[2] == 4


def test_main_array_is_values_for_the_service_and_the_client(stored):
    from jacobian.client import open_coo, open_zarr

    uri, matrix = stored
    np.testing.assert_array_equal(storage.open_result(uri)[...], matrix.tocoo().data)
    np.testing.assert_array_equal(open_zarr(uri)[...], matrix.tocoo().data)
    coo = open_coo(uri)
    assert type(coo).__name__ == "coo_array" and coo.shape == (21, 20)
    np.testing.assert_array_equal(coo.toarray(), matrix.toarray())
    import zarr

    dense_uri = uri.replace("job", "dense")
    zarr.create_group(store=dense_uri).create_array("jacobian", shape=(2, 2), dtype="float32")
    with pytest.raises(ValueError, match="not a sparse result"):
        open_coo(dense_uri)


def test_readers_without_project_code(stored):
    """scipy from the zarr arrays, ``xarray.open_zarr`` (the arrays share the dimension ``nnz``, ``indptr``
    has ``row_ptr``), ``dask.array.from_zarr``."""
    import dask.array as da
    import scipy.sparse as sps
    import xarray as xr
    import zarr

    uri, matrix = stored
    group = zarr.open_group(uri, mode="r")
    assert group.metadata.consolidated_metadata is not None and group.attrs["format"] == "coo"
    coo = sps.coo_array((group["values"][:], (group["rows"][:], group["cols"][:])), shape=group.attrs["shape"])
    np.testing.assert_array_equal(coo.toarray(), matrix.toarray())
    csr = sps.csr_array((group["values"][:], group["cols"][:], group["indptr"][:]), shape=group.attrs["shape"])
    np.testing.assert_array_equal(csr.toarray(), matrix.toarray())

    ds = xr.open_zarr(uri)
    assert {name: ds[name].dims for name in ds.data_vars} == {
        "rows": ("nnz",), "cols": ("nnz",), "values": ("nnz",), "indptr": ("row_ptr",)}
    assert ds.sizes == {"nnz": matrix.nnz, "row_ptr": 22} and ds.attrs["shape"] == [21, 20]
    np.testing.assert_array_equal(ds["values"].values, matrix.tocoo().data)

    lazy = da.from_zarr(uri, component="values")
    np.testing.assert_array_equal(lazy.compute(), matrix.tocoo().data)
