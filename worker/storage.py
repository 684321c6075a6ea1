"""Streams computed Jacobian rows into a Zarr v3 array, one storage block at a time, off the compute thread.

Layout under ``{results_url}/{job_id}/``: ``result.zarr`` (the job's Zarr v3 group: the request and plan
as group attributes, the ``jacobian`` array with ``dimension_names``, metadata consolidated when the
result is complete), ``committed/{block}`` (one marker per block whose data is written; resumed jobs
skip those blocks) and ``manifest.json`` (written last; its presence means the result is complete). A
reader needs only zarr, xarray (``xarray.open_zarr``) or dask (``dask.array.from_zarr``).
``result_group.remove_partial_result`` and ``remove_job_result`` delete what a failed or canceled job leaves.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from contracts import storage
from contracts.layout import COMMITTED_DIR, JACOBIAN_ARRAY, MANIFEST, RESULT_GROUP, Block, ResultLayout, job_url
from worker import metrics, result_group

log = logging.getLogger(__name__)


class ResultWriteError(RuntimeError):
    """Storage kept failing for one block after every retry; the job may be retried later."""


class ProblemLike(Protocol):
    """What the writer needs from an engine problem."""

    layout: ResultLayout
    dtype: Any
    attrs: dict[str, Any]


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: ``attempts`` tries, sleeping ``first_delay_s * 2**i`` between them."""

    attempts: int = 5
    first_delay_s: float = 0.5


_STOP = object()


def jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def write_manifest(job_folder: str, manifest: dict[str, Any]) -> str:
    """``manifest.json`` (last: its presence means complete) as a ``contracts.manifest.Manifest``, for every
    family; returns its URL."""
    from contracts.manifest import Manifest
    checked = Manifest.model_validate(jsonable(manifest)).dump()
    url = storage.join(job_folder, MANIFEST)
    storage.write_bytes(url, json.dumps(checked, indent=2, sort_keys=True).encode())
    return url


class ResultWriter:
    """Buffers rows into storage blocks and writes them in a background thread (bounded queue).

    Rows arrive in ascending row order through ``write_rows``; each block is written with
    ``array[block.selection] = layout.place(block, rows)`` and then committed with a marker. Host
    memory is bounded by about ``queue_blocks + 2`` blocks. Raises ``ResultWriteError`` (from
    ``write_rows`` or ``close``) when storage keeps failing; ``OSError`` when opening fails.
    """

    default_retry = RetryPolicy()  # 5 tries, 0.5 s doubling: at most 7.5 s of sleep per block

    def __init__(self, results_url: str, job_id: str, *, layout: ResultLayout, dtype: Any,
                 attrs: dict[str, Any] | None = None, rows: tuple[int, int] | None = None,
                 block_bytes: int | None = None, retry: RetryPolicy | None = None,
                 queue_blocks: int = 2, create: bool = True, array: str = JACOBIAN_ARRAY) -> None:
        if block_bytes is not None:
            layout = replace(layout, block_bytes=block_bytes)
        self.layout = layout
        if str(dtype) == "bfloat16":
            raise ValueError("output_dtype: bfloat16 results cannot be stored in a Zarr v3 array; "
                             "use output_dtype='float32' (or float16)")
        self.dtype = np.dtype(dtype)
        self.job_id = job_id
        self.job_url = storage.normalize(job_url(results_url, job_id))
        self.group_url = storage.join(self.job_url, RESULT_GROUP)
        self.array_name = array  # in the group: ``jacobian``; ``products`` for the product kinds
        self.array_url = storage.join(self.group_url, array)
        self.committed_url = storage.join(self.job_url, COMMITTED_DIR)
        self.manifest_url = storage.join(self.job_url, MANIFEST)
        self.retry = retry or self.default_retry
        self.blocks = layout.blocks()
        self._starts = [b.row_start for b in self.blocks]
        self.rows = self._check_rows(rows)
        # The request (``attrs``) and the layout: the group's attributes and the array's (a reader of the
        # array alone, ``zarr.open_array``, sees them too).
        self.attrs = jsonable({**(attrs or {}), "shape": list(layout.shape), "iter_start": layout.iter_start,
                                "iter_stop": layout.iter_stop, "itemsize": self.dtype.itemsize,
                                "block_bytes": layout.block_bytes})
        self._lock = threading.Lock()
        self._committed = self.committed_blocks()
        self._array = self._open_or_create() if create else self._open_existing()
        self._buffer: np.ndarray | None = None
        self._buffer_block: Block | None = None
        self._filled = 0
        self._next_row: int | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_blocks)
        self.host_bytes = (queue_blocks + 2) * max((b.rows for b in self.blocks), default=0) * (
            self.layout.row_bytes // max(1, self.layout.itemsize) * self.dtype.itemsize)
        self._thread = threading.Thread(target=self._drain, name=f"result-writer-{job_id}", daemon=True)
        self._thread.start()

    @classmethod
    def for_problem(cls, results_url: str, job_id: str, problem: ProblemLike, **kwargs: Any) -> ResultWriter:
        """A writer shaped by ``problem.layout``, ``problem.dtype`` and ``problem.attrs``.

        ``create=False`` (shards of one job, several writers on one array) opens the array that must
        exist already and never deletes or recreates it; ``rows`` limits the writer to a shard's range.
        """
        return cls(results_url, job_id, layout=problem.layout, dtype=problem.dtype, attrs=problem.attrs, **kwargs)

    @classmethod
    def open_existing(cls, results_url: str, job_id: str, **kwargs: Any) -> ResultWriter:
        """A writer on the job's existing array, its layout read from the array's attributes.

        No engine or model needed (the finalizer of a sharded job uses it to check the commit markers
        and write the manifest). ``array``: ``products`` for a product job. Raises ``FileNotFoundError``
        when there is no array.
        """
        url = storage.join(storage.normalize(job_url(results_url, job_id)), RESULT_GROUP)
        try:
            group = storage.open_group(url, mode="r")
            arr = group[kwargs.get("array", JACOBIAN_ARRAY)]
        except (KeyError, ValueError) as err:
            raise FileNotFoundError(f"result: no readable result group at {url} ({err})") from err
        return cls(results_url, job_id, layout=ResultLayout.of_array(arr), dtype=arr.dtype, attrs=dict(group.attrs),
                   create=False, **kwargs)

    # -- what is done, what is left -------------------------------------------------------------

    @property
    def uri(self) -> str:
        """Where the result group lives (absolute local path or ``s3://`` URL)."""
        return self.group_url

    def committed_blocks(self) -> set[int]:
        """Indices of blocks whose data is in storage, read from the commit markers."""
        names = storage.list_names(self.committed_url)
        return {int(n) for n in names if n.isdigit() and int(n) < len(self.blocks)}

    def _in_rows(self, block: Block) -> bool:
        return self.rows[0] <= block.row_start and block.row_stop <= self.rows[1]

    def pending_blocks(self) -> list[Block]:
        """Blocks of this job's row range not yet committed, in row order."""
        with self._lock:
            done = set(self._committed)
        return [b for b in self.blocks if self._in_rows(b) and b.index not in done]

    def pending_ranges(self) -> list[tuple[int, int]]:
        """Row ranges ``[start, stop)`` left to compute: pending blocks, adjacent ones merged."""
        out: list[tuple[int, int]] = []
        for b in self.pending_blocks():
            if out and out[-1][1] == b.row_start:
                out[-1] = (out[-1][0], b.row_stop)
            else:
                out.append((b.row_start, b.row_stop))
        return out

    def missing_blocks(self) -> list[Block]:
        """Blocks of this writer's row range without a commit marker in storage now (read afresh)."""
        done = self.committed_blocks()
        return [b for b in self.blocks if self._in_rows(b) and b.index not in done]

    @property
    def rows_total(self) -> int:
        """Rows of this job (its shard range, or all rows)."""
        return self.rows[1] - self.rows[0]

    @property
    def rows_committed(self) -> int:
        """Rows of this job's range whose blocks are committed."""
        with self._lock:
            done = set(self._committed)
        return sum(b.row_stop - b.row_start for b in self.blocks if b.index in done and self._in_rows(b))

    # -- writing --------------------------------------------------------------------------------

    def write_rows(self, row_start: int, rows: np.ndarray) -> None:
        """Accept ``rows`` of shape ``(n,) + layout.row_shape`` starting at row ``row_start``.

        Rows come in ascending order; a gap is allowed only at a block boundary (skipped blocks).
        Blocks already committed are dropped. Blocks when the upload queue is full.
        """
        self._raise_if_failed()
        if self._closed:
            raise RuntimeError("write_rows: the writer is closed")
        rows = np.asarray(rows)
        if rows.shape[1:] != self.layout.row_shape:
            raise ValueError(f"rows: shape {rows.shape} does not match (n,) + row_shape {self.layout.row_shape}")
        pos, n = 0, rows.shape[0]
        while pos < n:
            row = row_start + pos
            block = self._block_at(row)
            if self._buffer_block is None or self._buffer_block.index != block.index:
                if self._buffer_block is not None:
                    raise ValueError(f"rows: block {self._buffer_block.index} is incomplete "
                                     f"({self._filled} of {self._buffer_block.rows} rows) "
                                     f"but row {row} arrived; rows must come in ascending order without gaps")
                if row != block.row_start:
                    raise ValueError(f"rows: row {row} is not at a block start ({block.row_start}); "
                                     f"row ranges must cover whole storage blocks")
                self._buffer_block = block
                self._buffer = np.empty((block.rows,) + self.layout.row_shape, self.dtype)
                self._filled = 0
            elif row != block.row_start + self._filled:
                raise ValueError(f"rows: expected row {block.row_start + self._filled}, got {row}")
            take = min(n - pos, block.row_stop - row)
            assert self._buffer is not None
            self._buffer[self._filled:self._filled + take] = rows[pos:pos + take]
            self._filled += take
            pos += take
            if self._filled == block.rows:
                self._submit(block, self._buffer)
                self._buffer_block, self._buffer, self._filled = None, None, 0

    def close(self) -> None:
        """Wait for every queued block to be written; raises ``ResultWriteError`` on failure.

        Raises ``ValueError`` when a block was left half filled.
        """
        if not self._closed:
            self._closed = True
            self._put(_STOP)
            self._thread.join()
        self._raise_if_failed()
        if self._buffer_block is not None:
            block = self._buffer_block
            raise ValueError(f"rows: block {block.index} got {self._filled} of {block.rows} rows")

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait, at most ``timeout_s``, until the blocks queued so far are written (or the writer has failed):
        a caller timing its own work (a chunk size compared with another) then times it without the block's
        compression and upload running beside it on the same cores. Raises nothing; ``close`` reports failures."""
        deadline, done = time.monotonic() + timeout_s, self._queue.all_tasks_done
        with done:
            while self._queue.unfinished_tasks and self._thread.is_alive() and time.monotonic() < deadline:
                done.wait(0.05)

    def abort(self) -> None:
        """Stop the writer thread, dropping queued blocks; never raises."""
        self._closed = True
        self._error = self._error or _Aborted()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_STOP)
        self._thread.join(timeout=30)

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def manifest_base(self) -> dict[str, Any]:
        """The manifest fields the writer knows: id, uri, shape, dtype, chunks, rows."""
        return {"id": self.job_id, "uri": self.uri, "format": "zarr-v3", "array": self.array_name,
                "shape": list(self.layout.shape),
                "dtype": self.dtype.name, "chunks": list(self.layout.chunks),
                "iter_axes": [self.layout.iter_start, self.layout.iter_stop],
                "rows": [self.rows[0], self.rows[1]], "rows_total": self.layout.rows_total,
                "blocks": len(self.blocks)}

    def write_manifest(self, fields: dict[str, Any]) -> str:
        """Write ``manifest.json`` (``manifest_base()`` updated with ``fields``) last, after sealing the group
        (``result_group.seal``: plan and times in its attributes, metadata consolidated); returns its URL.

        Raises ``RuntimeError`` when a block of this job's range is not committed.
        """
        self.close()
        missing = [b.index for b in self.missing_blocks()]  # one listing of the markers, not one per block
        if missing:
            raise RuntimeError(f"manifest: blocks {missing[:10]} are not committed; the result is incomplete")
        manifest = jsonable({**self.manifest_base(), **fields})
        result_group.seal(self.group_url, {k: v for k, v in manifest.items() if k in result_group.SEALED_FIELDS})
        return write_manifest(self.job_url, manifest)

    # -- internals ------------------------------------------------------------------------------

    def _check_rows(self, rows: tuple[int, int] | None) -> tuple[int, int]:
        total = self.layout.rows_total if self.blocks else 0
        if rows is None:
            return (0, total)
        start, stop = int(rows[0]), int(rows[1])
        stops = {b.row_stop for b in self.blocks}
        if not (0 <= start <= stop <= total) or (start < total and start not in self._starts) or (
                stop > 0 and stop not in stops and stop != start):
            raise ValueError(f"rows: shard range [{start}, {stop}) must lie in [0, {total}) on storage block "
                             f"boundaries (block starts: {self._starts[:8]}...)")
        return (start, stop)

    def _block_at(self, row: int) -> Block:
        i = bisect.bisect_right(self._starts, row) - 1
        if i < 0 or row >= self.blocks[i].row_stop:
            raise ValueError(f"rows: row {row} is outside the result's {self.layout.rows_total} rows")
        return self.blocks[i]

    def _open_or_create(self) -> Any:
        shape, chunks = tuple(self.layout.shape), tuple(self.layout.chunks)
        if self._committed:
            try:
                arr = storage.open_array(self.array_url, mode="r+")
                if tuple(arr.shape) == shape and tuple(arr.chunks) == chunks and arr.dtype == self.dtype:
                    log.info("job %s: resuming, %d of %d blocks committed", self.job_id,
                             len(self._committed), len(self.blocks))
                    return arr
                log.warning("job %s: stored array differs (shape/chunks/dtype); starting over", self.job_id)
            except (FileNotFoundError, KeyError, ValueError) as err:
                log.warning("job %s: commit markers without a readable array (%s); starting over", self.job_id, err)
        storage.delete_prefix(self.committed_url)
        storage.delete_prefix(self.group_url)
        self._committed = set()
        return result_group.create(self.group_url, attrs=self.attrs, array=self.array_name, shape=shape,
                                   chunks=chunks, dtype=self.dtype)

    def _open_existing(self) -> Any:
        """The array written by several writers at once (shards): opened, never deleted or recreated."""
        try:
            arr = storage.open_array(self.array_url, mode="r+")
        except (FileNotFoundError, KeyError, ValueError) as err:
            raise FileNotFoundError(f"result: the array {self.array_url} of a sharded job is missing ({err}); "
                                    "it is created when the job is split, and removed only by cancel") from err
        if tuple(arr.shape) != tuple(self.layout.shape) or tuple(arr.chunks) != tuple(self.layout.chunks) or (
                arr.dtype != self.dtype):
            raise ValueError(f"result: the stored array {self.array_url} has shape {arr.shape}, chunks "
                             f"{arr.chunks}, dtype {arr.dtype}; this writer expects {self.layout.shape}, "
                             f"{self.layout.chunks}, {self.dtype} (JACOBIAN_BLOCK_BYTES must be the same on "
                             "every worker)")
        return arr

    def _submit(self, block: Block, data: np.ndarray) -> None:
        with self._lock:
            done = block.index in self._committed
        if not done:
            self._put((block, data))

    def _put(self, item: Any) -> None:
        while True:
            if self._error is not None and item is not _STOP:
                self._raise_if_failed()
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                if not self._thread.is_alive():
                    self._raise_if_failed()
                    return

    def _raise_if_failed(self) -> None:
        if self._error is not None and not isinstance(self._error, _Aborted):
            raise self._error

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP or self._error is not None:
                return
            block, data = item
            try:
                self._write_block(block, data)
            except BaseException as err:  # noqa: BLE001 - surfaced by write_rows/close
                self._error = err
                return
            self._queue.task_done()

    def _write_block(self, block: Block, data: np.ndarray) -> None:
        placed = self.layout.place(block, data)
        marker = json.dumps({"rows": [block.row_start, block.row_stop]}).encode()
        for attempt in range(self.retry.attempts):
            try:
                self._array[block.selection] = placed
                storage.write_bytes(storage.join(self.committed_url, str(block.index)), marker)
                break
            except Exception as err:
                if attempt + 1 >= self.retry.attempts:
                    raise ResultWriteError(
                        f"storage: writing block {block.index} (rows {block.row_start}:{block.row_stop}) to "
                        f"{self.array_url} failed after {self.retry.attempts} attempts: "
                        f"{type(err).__name__}: {err}") from err
                delay_s = self.retry.first_delay_s * 2 ** attempt
                log.warning("job %s: block %d write failed (%s: %s); retry in %.1fs", self.job_id,
                            block.index, type(err).__name__, err, delay_s)
                metrics.STORAGE_RETRIES.labels("block_write").inc()
                time.sleep(delay_s)
        with self._lock:
            self._committed.add(block.index)


class _Aborted(Exception):
    """Internal: the writer was aborted; nothing to report."""
