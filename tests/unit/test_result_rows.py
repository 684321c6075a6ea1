"""Result rows read back (``app.rows``): only the storage chunks holding the rows asked are read."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from zarr.storage import WrapperStore

from app import rows as result_rows
from contracts import storage
from contracts.layout import ResultLayout
from worker.storage import ResultWriter, RetryPolicy


class ChunkReadCounter(WrapperStore[Any]):
    """A zarr store that records the chunk keys (``c/...``) read through it."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.chunk_reads: list[str] = []

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        if key.startswith("c/"):
            self.chunk_reads.append(key)
        return await self._store.get(key, prototype, byte_range)


def reference_rows(J: np.ndarray, iter_start: int, iter_stop: int) -> np.ndarray:
    """Rows of ``J``: the iterated axes first (C order), then the others in array order."""
    it = list(range(iter_start, iter_stop))
    rest = [a for a in range(J.ndim) if a not in it]
    n = int(np.prod(J.shape[iter_start:iter_stop]))
    return np.transpose(J, it + rest).reshape((n,) + tuple(J.shape[a] for a in rest))


def open_counted(uri: str) -> tuple[Any, ChunkReadCounter]:
    counter = ChunkReadCounter(storage.zarr_store(uri, read_only=True))
    return zarr.open_array(store=counter, mode="r"), counter


def test_rows_read_only_their_small_blocks(tmp_path: Path) -> None:
    """1024 rows of 5 float32 in 1-row blocks (block_bytes=20): rows 3:5 read 2 chunks, not 1024."""
    layout = ResultLayout(shape=(1024, 5), iter_start=0, iter_stop=1, itemsize=4, block_bytes=20)
    J = np.random.default_rng(0).normal(size=(1024, 5)).astype(np.float32)
    with ResultWriter(str(tmp_path), "j", layout=layout, dtype="float32",
                      retry=RetryPolicy(attempts=1)) as w:
        w.write_rows(0, J)
    array, counter = open_counted(w.array_url)
    got = np.concatenate(list(result_rows.iter_rows(array, result_rows.layout_of(array), 3, 5)))
    np.testing.assert_array_equal(got, J[3:5])
    assert sorted(counter.chunk_reads) == ["c/3/0", "c/4/0"]


@pytest.mark.parametrize("chunks,start,stop,max_reads", [
    ((1, 3, 3), 7, 12, 2),   # the worker's form: rows 7:12 lie in chunks (2, 3:6) and (3, 0:3)
    ((2, 3, 3), 7, 12, 2),   # not row-contiguous: each chunk is read per row-contiguous half
    ((4, 6, 1), 0, 24, 3),   # split across the non-iterated axis: every row block spans 3 chunks
])
def test_rows_of_any_chunk_shape_are_exact_and_read_few_chunks(tmp_path: Path, chunks, start, stop,
                                                               max_reads) -> None:
    """An array from another writer (no ``block_bytes`` attribute): the chunk shape stored with it rules."""
    J = np.random.default_rng(1).normal(size=(4, 6, 3)).astype(np.float32)
    uri = str(tmp_path / "a.zarr")
    arr = zarr.create_array(store=storage.zarr_store(uri, read_only=False), shape=J.shape, dtype=J.dtype,
                            chunks=chunks, attributes={"shape": list(J.shape), "iter_start": 0, "iter_stop": 2})
    arr[...] = J
    array, counter = open_counted(uri)
    layout = result_rows.layout_of(array)
    body = b"".join(bytes(part) for part in result_rows.iter_npy(array, layout, start, stop))
    assert len(body) == result_rows.npy_size(array.dtype, (stop - start, 3))
    np.testing.assert_array_equal(np.load(io.BytesIO(body)), reference_rows(J, 0, 2)[start:stop])
    assert len(counter.chunk_reads) <= max_reads
