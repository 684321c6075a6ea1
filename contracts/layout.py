"""Where results live and how Jacobian rows map onto a Zarr array in row-block storage chunks.

A job iterates over *rows*: output elements in reverse mode, input elements (columns) in forward
mode, output features for batch Jacobians. Each computed row has ``row_shape``; the array holds
all of them along ``iter_axes`` (a contiguous run of array axes). A storage block is a run of
consecutive rows that is one rectangular Zarr chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from contracts.kinds import KINDS, spec_or_jacobian

RESULT_GROUP = "result.zarr"   # the job's Zarr v3 group (consolidated metadata); ``result.uri`` points at it
JACOBIAN_ARRAY = "jacobian"    # the dense kinds' array in that group
RESULT_ARRAY = f"{RESULT_GROUP}/{JACOBIAN_ARRAY}"  # its path under the job folder
# The array rows are read from (GET .../result?rows=, preview.png), by kind; the dense kinds' is ``jacobian``.
MAIN_ARRAYS = {name: spec.main_array for name, spec in KINDS.items() if spec.matrix_free}


SPARSE_FORMAT = "coo"  # group attribute ``format`` of a sparse Jacobian: arrays rows, cols, values, indptr
SPARSE_MAIN_ARRAY = "values"


def main_array(kind: object, format: object = None) -> str:
    """The main array of a result group, for its ``kind`` and ``format`` attributes: ``values`` for a sparse
    Jacobian (``format`` ``"coo"``), else the kind's (``MAIN_ARRAYS``, ``jacobian`` for the dense kinds)."""
    if format == SPARSE_FORMAT:
        return SPARSE_MAIN_ARRAY
    return MAIN_ARRAYS.get(str(kind), JACOBIAN_ARRAY)
MANIFEST = "manifest.json"
INPUTS = "inputs.npz"
COMMITTED_DIR = "committed"
DEFAULT_BLOCK_BYTES = 32 * 1024 * 1024


def job_url(results_url: str, job_id: str) -> str:
    return f"{results_url.rstrip('/')}/{job_id}"


def dimension_names(kind: str, of_shape: tuple[int, ...], wrt_shape: tuple[int, ...]) -> list[str]:
    """Names of the result array's axes, for xarray: ``of_0, of_1, ...`` then ``wrt_0, ...`` (the
    Jacobian ``of.shape + wrt.shape``); ``batch`` for a batch Jacobian's first axis (its ``of`` and
    ``wrt`` axes keep their input numbering, ``of_1``, ``wrt_1``, ...); a Hessian's second copy of the
    ``wrt`` axes is ``wrt2_0, ...``."""
    return array_dimension_names(kind, spec_or_jacobian(kind).main_array, of_shape, wrt_shape)


def array_dimension_names(kind: str, array: str, of_shape: tuple[int, ...], wrt_shape: tuple[int, ...], *,
                          wrt_names: list[str] | None = None) -> list[str]:
    """Names of the axes of ``array`` of a ``kind`` result, its ``KindSpec.dims`` spelled out: ``of_i`` for
    ``of``'s axes, ``wrt_i`` for ``wrt``'s (or ``wrt_names``: ``["wrt"]`` for several sources concatenated),
    ``wrt2_i`` for a Hessian's second copy; a kind with a batch axis leaves axis 0 of each to ``batch``."""
    spec = spec_or_jacobian(kind)
    lead = 1 if spec.batch_axis else 0
    words = {"of": [f"of_{i}" for i in range(len(of_shape))][lead:],
             "wrt": (list(wrt_names) if wrt_names is not None else [f"wrt_{i}" for i in range(len(wrt_shape))])[lead:],
             "wrt2": [f"wrt2_{i}" for i in range(len(wrt_shape))][lead:]}
    return [name for word in spec.dims_of(array) for name in words.get(word, [word])]


@dataclass(frozen=True)
class Block:
    index: int
    row_start: int
    row_stop: int
    selection: tuple[slice, ...]
    shape: tuple[int, ...]  # the block's extent along the iterated axes

    @property
    def rows(self) -> int:
        """Rows in the block: ``row_stop - row_start``."""
        return self.row_stop - self.row_start


@dataclass(frozen=True)
class ResultLayout:
    """Array ``shape``; rows run over ``shape[iter_start:iter_stop]`` in C order.

    A writer sizes the Zarr chunks from ``block_bytes``; a reader passes ``chunk_shape``, the chunk
    shape stored with the array (``zarr.Array.chunks``), so that its blocks are the stored chunks.
    """

    shape: tuple[int, ...]
    iter_start: int
    iter_stop: int
    itemsize: int = 4
    block_bytes: int = DEFAULT_BLOCK_BYTES
    chunk_shape: tuple[int, ...] | None = None  # the stored chunks; None: derived from block_bytes

    @classmethod
    def of_array(cls, array: Any) -> ResultLayout:
        """The layout stored with a zarr array: its attributes ``shape``, ``iter_start``, ``iter_stop``,
        ``block_bytes`` (the worker writes them; without them rows run along axis 0) and its chunk shape."""
        attrs = dict(array.attrs)
        shape = tuple(int(d) for d in attrs.get("shape", array.shape))
        chunk_shape = tuple(int(c) for c in array.chunks) if tuple(array.shape) == shape else None
        return cls(shape=shape, iter_start=int(attrs.get("iter_start", 0)),
                   iter_stop=int(attrs.get("iter_stop", 1 if shape else 0)), itemsize=int(array.dtype.itemsize),
                   block_bytes=int(attrs.get("block_bytes", DEFAULT_BLOCK_BYTES)), chunk_shape=chunk_shape)

    @property
    def iter_shape(self) -> tuple[int, ...]:
        return self.shape[self.iter_start:self.iter_stop]

    @property
    def rows_total(self) -> int:
        return math.prod(self.iter_shape)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one computed row: the non-iterated axes in array order."""
        return self.shape[:self.iter_start] + self.shape[self.iter_stop:]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * self.itemsize

    @property
    def chunks(self) -> tuple[int, ...]:
        """Zarr chunk shape: ``chunk_shape`` when given, else whole rows, about ``block_bytes`` per chunk
        (at least one row): full along the trailing iterated axes, part of one, 1 along those before."""
        if self.chunk_shape is not None:
            return tuple(self.chunk_shape)
        target_rows = max(1, self.block_bytes // max(1, self.row_bytes))
        it = list(self.iter_shape)
        chunk_it = [1] * len(it)
        trailing = 1
        for axis in range(len(it) - 1, -1, -1):
            if trailing * it[axis] <= target_rows:
                chunk_it[axis] = it[axis]
                trailing *= it[axis]
            else:
                chunk_it[axis] = max(1, target_rows // trailing)
                break
        full = [max(1, d) for d in self.shape]
        return tuple(full[:self.iter_start] + chunk_it + full[self.iter_stop:])

    def _block_iter_shape(self) -> tuple[int, ...]:
        """A block's extent along the iterated axes: the chunks' own when ``chunks`` derives from
        ``block_bytes``; for a stored ``chunk_shape``, the largest run of consecutive rows inside one
        chunk (its extent on the last iterated axis it splits, 1 before that, full after)."""
        cit = self.chunks[self.iter_start:self.iter_stop]
        if self.chunk_shape is None:
            return cit
        out = list(self.iter_shape)
        for axis in range(len(out) - 1, -1, -1):
            if cit[axis] < out[axis]:
                out[axis] = max(1, cit[axis])
                out[:axis] = [1] * axis
                break
        return tuple(out)

    def blocks(self) -> list[Block]:
        """Storage blocks in row order; each is a contiguous row range inside one Zarr chunk along the
        iterated axes (the whole chunk for the writer's chunks, which are row-contiguous)."""
        it = self.iter_shape
        if not it:
            return [Block(0, 0, 1, tuple(slice(0, d) for d in self.shape), ())]
        cit = self._block_iter_shape()
        grid = [range(0, d, c) for d, c in zip(it, cit)]
        out: list[Block] = []
        for corner in np.ndindex(*[len(g) for g in grid]):
            starts = [grid[a][i] for a, i in enumerate(corner)]
            stops = [min(s + c, d) for s, c, d in zip(starts, cit, it)]
            row_start = int(np.ravel_multi_index(starts, it)) if it else 0
            shape = tuple(b - a for a, b in zip(starts, stops))
            sel = (tuple(slice(0, d) for d in self.shape[:self.iter_start])
                   + tuple(slice(a, b) for a, b in zip(starts, stops))
                   + tuple(slice(0, d) for d in self.shape[self.iter_stop:]))
            out.append(Block(len(out), row_start, row_start + math.prod(shape), sel, shape))
        return out

    def place(self, block: Block, rows: np.ndarray) -> np.ndarray:
        """Turn ``rows`` of shape ``(n,) + row_shape`` for ``block`` into the array's axis order."""
        pre = self.shape[:self.iter_start]
        post = self.shape[self.iter_stop:]
        data = rows.reshape(block.shape + pre + post)
        n_it, n_pre = len(block.shape), len(pre)
        order = list(range(n_it, n_it + n_pre)) + list(range(n_it)) + list(range(n_it + n_pre, data.ndim))
        return np.transpose(data, order)
