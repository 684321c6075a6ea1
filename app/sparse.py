"""Sparse Jacobians as the API reads them: a result group of ``format`` ``"coo"`` (``rows``, ``cols``,
``values`` along ``nnz``, the CSR row pointer ``indptr`` of ``n_of + 1`` entries; the group attribute
``shape`` is the matrix's ``[n_of, n_wrt]``), read in bounded memory: dense rows ``a:b`` built from
``indptr[a:b + 1]`` and the entries it points at, a block of rows at a time; the pattern counted on a
pixel grid reading ``rows`` and ``cols`` a slice at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from contracts.layout import SPARSE_FORMAT

ROW_BLOCK_BYTES = 8 * 1024 * 1024   # dense rows built at a time (at least one row)
ENTRIES_PER_READ = 1 << 20          # entries of rows/cols read at a time for the pattern


def is_sparse(node: Any) -> bool:
    """True for a result group of format ``coo`` (a zarr group whose attribute ``format`` is ``"coo"``)."""
    import zarr

    return isinstance(node, zarr.Group) and node.attrs.get("format") == SPARSE_FORMAT


def _shape_attr(value: Any, size: int) -> tuple[int, ...]:
    """A tensor shape from the group's attributes (``of_shape``, ``wrt_shape``), ``(size,)`` when it is
    missing or does not hold ``size`` elements."""
    if isinstance(value, list) and all(isinstance(d, int) for d in value) and math.prod(value) == size:
        return tuple(value)
    return (size,)


@dataclass(frozen=True)
class SparseResult:
    """A sparse Jacobian's group, seen as the ``(n_of, n_wrt)`` matrix ``shape`` whose row ``i`` is the
    gradient of ``of``'s flat element ``i``, shaped ``wrt_shape``. Nothing is read until asked."""

    group: Any
    shape: tuple[int, int]
    of_shape: tuple[int, ...]
    wrt_shape: tuple[int, ...]
    arrays: dict[str, Any]  # rows, cols, values, indptr: zarr arrays, opened (their metadata read) only

    @classmethod
    def of_group(cls, group: Any) -> SparseResult:
        """The ``SparseResult`` of a group of format ``coo`` (its ``shape``, ``of_shape`` and ``wrt_shape``
        attributes). Raises ``KeyError`` when an array is missing or ``shape`` is not ``[n_of, n_wrt]`` with
        ``indptr`` of ``n_of + 1`` entries."""
        attrs = dict(group.attrs)
        arrays = {name: group[name] for name in ("rows", "cols", "values", "indptr")}
        shape = attrs.get("shape")
        if not (isinstance(shape, list) and len(shape) == 2 and arrays["indptr"].shape == (int(shape[0]) + 1,)):
            raise KeyError(f"a sparse result needs the attribute shape [n_of, n_wrt] and indptr of n_of + 1 "
                           f"entries; it has shape {shape!r} and indptr {list(arrays['indptr'].shape)}")
        n_of, n_wrt = int(shape[0]), int(shape[1])
        return cls(group, (n_of, n_wrt), _shape_attr(attrs.get("of_shape"), n_of),
                   _shape_attr(attrs.get("wrt_shape"), n_wrt), arrays)

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.group.attrs)

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(self.arrays["values"].dtype)

    @property
    def nnz(self) -> int:
        return int(self.arrays["values"].shape[0])

    @property
    def rows_total(self) -> int:
        """Rows of the matrix: ``n_of`` (``GET .../result?rows=`` counts these)."""
        return self.shape[0]

    @property
    def row_shape(self) -> tuple[int, ...]:
        """A dense row as served: ``wrt_shape``, as the dense Jacobian's rows in reverse mode."""
        return self.wrt_shape

    @property
    def row_bytes(self) -> int:
        return self.shape[1] * self.dtype.itemsize

    @property
    def density(self) -> float:
        cells = self.shape[0] * self.shape[1]
        return self.nnz / cells if cells else 0.0

    def dense_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` as a dense ``(stop - start, n_wrt)`` array: ``indptr[start:stop + 1]``, then the
        columns and values it points at (duplicate entries add up, as in ``scipy.sparse``)."""
        ptr = np.asarray(self.arrays["indptr"][start:stop + 1], dtype=np.int64)
        out = np.zeros((stop - start, self.shape[1]), dtype=self.dtype)
        first, last = int(ptr[0]), int(ptr[-1])
        if last > first:
            cols = np.asarray(self.arrays["cols"][first:last], dtype=np.int64)
            values = np.asarray(self.arrays["values"][first:last])
            local = np.repeat(np.arange(stop - start), np.diff(ptr))
            np.add.at(out, (local, cols), values)
        return out

    def iter_rows(self, start: int, stop: int, *, block_bytes: int = ROW_BLOCK_BYTES) -> Iterator[np.ndarray]:
        """Dense rows ``start:stop``, ``(n,) + row_shape`` each, about ``block_bytes`` at a time (at least a row)."""
        per = max(1, block_bytes // max(1, self.row_bytes))
        for a in range(start, stop, per):
            b = min(stop, a + per)
            yield self.dense_rows(a, b).reshape((b - a,) + self.row_shape)

    def pattern_counts(self, height: int, width: int, *,
                       entries: int = ENTRIES_PER_READ) -> tuple[np.ndarray, np.ndarray]:
        """``(counts, cells)``: the stored entries falling in each cell of a ``height x width`` grid over the
        matrix (``numpy.histogram2d`` of ``rows`` and ``cols``, read ``entries`` at a time), and how many
        matrix entries each cell covers."""
        n_of, n_wrt = self.shape
        row_edges = np.linspace(0, n_of, height + 1)
        col_edges = np.linspace(0, n_wrt, width + 1)
        counts = np.zeros((height, width), dtype=np.int64)
        rows, cols = self.arrays["rows"], self.arrays["cols"]
        for a in range(0, self.nnz, entries):
            b = min(self.nnz, a + entries)
            part, _, _ = np.histogram2d(np.asarray(rows[a:b]), np.asarray(cols[a:b]), bins=[row_edges, col_edges])
            counts += part.astype(np.int64)
        # integers i in [edge_k, edge_k+1): ceil(edge_k+1) - ceil(edge_k), as histogram2d assigns them
        cells = np.outer(np.diff(np.ceil(row_edges)), np.diff(np.ceil(col_edges))).astype(np.int64)
        return counts, cells
