"""Rows of a result array: ``rows=a:b`` ranges, the array's row layout, and rows streamed as ``.npy``."""

from __future__ import annotations

import io
import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from app.errors import InvalidRequest, RangeNotSatisfiable
from contracts.layout import Block, ResultLayout


def layout_of(array: Any) -> ResultLayout:
    """The ``ResultLayout`` stored with the result array (``ResultLayout.of_array``: its attributes and
    chunk shape), so that reading rows ``a:b`` reads only the storage chunks that hold them."""
    return ResultLayout.of_array(array)


def parse_rows(rows: str | None, rows_total: int) -> tuple[int, int]:
    """``"a:b"``, ``"a:"``, ``":b"`` or ``"a"`` (ASCII digits) -> ``(start, stop)`` within ``0:rows_total``."""
    fix = f"use rows=a:b with 0 <= a < b <= {rows_total}"
    if rows is None or rows.strip() in ("", ":"):
        return 0, rows_total
    shown = rows if len(rows) <= 40 else rows[:40] + "..."
    m = _ROWS.fullmatch(rows)
    if not m or (not m.group(2) and (not m.group(1) or m.group(3))):
        raise InvalidRequest(f"rows: {shown!r} is not a row range; {fix}", field="rows")
    if max(len(m.group(1)), len(m.group(3))) > _ROW_DIGITS:  # past any result (and int()'s digit limit)
        raise RangeNotSatisfiable(f"rows: {shown!r} is outside the result's rows 0:{rows_total}; {fix}",
                                  field="rows")
    start = int(m.group(1) or 0)
    stop = (int(m.group(3)) if m.group(3) else rows_total) if m.group(2) else start + 1
    if start >= rows_total or stop > rows_total:
        raise RangeNotSatisfiable(f"rows: {shown!r} is outside the result's rows 0:{rows_total}; {fix}",
                                  field="rows")
    if start >= stop:
        raise InvalidRequest(f"rows: {shown!r} is empty; {fix}", field="rows")
    return start, stop


_ROWS = re.compile(r"[ \t]*([0-9]*)[ \t]*(:?)[ \t]*([0-9]*)[ \t]*")
_ROW_DIGITS = 18


def _block_rows(layout: ResultLayout, block: Block, data: np.ndarray) -> np.ndarray:
    """A block read in array axis order -> ``(n_rows,) + row_shape`` in row order (inverse of ``place``)."""
    n_pre, n_it = layout.iter_start, len(block.shape)
    order = list(range(n_pre, n_pre + n_it)) + list(range(n_pre)) + list(range(n_pre + n_it, data.ndim))
    return np.transpose(data, order).reshape((math.prod(block.shape),) + layout.row_shape)


def iter_rows(array: Any, layout: ResultLayout, start: int, stop: int) -> Iterator[np.ndarray]:
    """Rows ``start:stop`` of the result, one storage block's worth at a time, reading only those blocks."""
    for block in layout.blocks():
        if block.row_stop <= start or block.row_start >= stop:
            continue
        rows = _block_rows(layout, block, np.asarray(array[block.selection]))
        yield rows[max(start, block.row_start) - block.row_start:min(stop, block.row_stop) - block.row_start]


def _npy_header(dtype: np.dtype[Any], shape: tuple[int, ...]) -> bytes:
    buf = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    try:
        np.lib.format.write_array_header_1_0(buf, header)
    except ValueError:  # a header over 64 KiB needs format 2.0
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, header)
    return buf.getvalue()


def npy_size(dtype: np.dtype[Any], shape: tuple[int, ...]) -> int:
    """Bytes of the ``.npy`` that ``iter_npy`` writes for this dtype and shape."""
    return len(_npy_header(dtype, shape)) + math.prod(shape) * dtype.itemsize


def npy_stream(dtype: np.dtype[Any], shape: tuple[int, ...],
               parts: Iterator[np.ndarray]) -> Iterator[bytes | memoryview]:
    """The bytes of one ``.npy`` of ``dtype`` and ``shape``: its header, then ``parts`` (arrays of ``dtype``
    that together fill ``shape`` in C order) one at a time."""
    yield _npy_header(dtype, shape)
    for part in parts:
        yield memoryview(np.ascontiguousarray(part)).cast("B")


def iter_npy(array: Any, layout: ResultLayout, start: int, stop: int) -> Iterator[bytes | memoryview]:
    """Rows ``start:stop`` as the bytes of one ``.npy``, ``(stop - start,) + row_shape``: the header,
    then each storage block's rows, so memory holds one block at a time, however many rows are asked."""
    return npy_stream(array.dtype, (stop - start,) + layout.row_shape, iter_rows(array, layout, start, stop))
