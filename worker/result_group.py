"""A job's result as one Zarr v3 group (``{job}/result.zarr``): created with the request as its attributes
and one array per result (``jacobian`` for the dense kinds) whose axes carry ``dimension_names``; sealed
when complete (the plan and times added to its attributes, its metadata consolidated), so that
``xarray.open_zarr(uri)`` gives a labelled Dataset and ``dask.array.from_zarr(uri, component=...)`` a
lazy array without project code."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import numpy as np

from contracts import storage
from contracts.layout import COMMITTED_DIR, RESULT_GROUP, ResultLayout, job_url

# The result array's zstd level. A block of a dense float32 Jacobian barely compresses at any level (MobileNetV3Small's
# 33 MB blocks: 0.93 of their bytes at level 1, 1.00 at -5) and one with 90 % zeros compresses at any (0.14 at 1,
# 0.18 at -5); level 1 took 114 ms of a core a block, -5 38 ms. The compression runs beside the chunks on the same
# cores: on a 2-core AVX2 VM an 8-row MobileNetV3Small chunk took 0.22 s beside level 1, 0.19 s beside -5, and a
# cold 1000-row job's process 50-52 s against 46-47 s. A reader needs no setting: the frames are plain zstd.
BLOCK_ZSTD_LEVEL = -5

# Manifest fields also kept as group attributes when the result is sealed.
SEALED_FIELDS = ("plan", "created_at", "finished_at")


def create(group_url: str, *, attrs: dict[str, Any], array: str, shape: tuple[int, ...], chunks: tuple[int, ...],
           dtype: np.dtype) -> Any:
    """A new group at ``group_url`` (replacing one there) and in it the empty array ``array`` (fill 0,
    zstd level 1), both with ``attrs``; the array's axes are named by ``attrs["dimension_names"]``
    (``dim_0, ...`` when those do not fit the shape). Returns the array, open for writing."""
    import zarr
    from zarr.codecs import ZstdCodec

    group = zarr.create_group(store=storage.zarr_store(group_url, read_only=False), attributes=attrs,
                              overwrite=True)
    names = [str(n) for n in attrs.get("dimension_names") or []]
    if len(names) != len(shape):
        names = [f"dim_{i}" for i in range(len(shape))]
    # zstd at a fast level (BLOCK_ZSTD_LEVEL): dense Jacobians barely compress, block-diagonal and sparse ones a
    # lot, and the writer's thread compresses beside the compute on the same cores.
    return group.create_array(array, shape=shape, chunks=chunks, dtype=dtype, fill_value=0,
                              attributes=attrs, dimension_names=names, compressors=[ZstdCodec(level=BLOCK_ZSTD_LEVEL)],
                              overwrite=True)


def seal(group_url: str, fields: dict[str, Any]) -> None:
    """The complete result's group: ``fields`` added to its attributes, then its metadata consolidated
    (``zarr.consolidate_metadata``), so that a reader opens it with one request."""
    import zarr

    store = storage.zarr_store(group_url, read_only=False)
    group = zarr.open_group(store=store, mode="r+", use_consolidated=False)
    group.attrs.update(fields)
    with warnings.catch_warnings():  # "not part of the Zarr format 3 specification": zarr-python and xarray read it
        warnings.filterwarnings("ignore", message="Consolidated metadata", category=UserWarning)
        zarr.consolidate_metadata(store)


def uncommit_rows(results_url: str, job_id: str, layout: ResultLayout, ranges: list[tuple[int, int]], *,
                  block_bytes: int | None = None) -> list[int]:
    """Remove the commit markers of the storage blocks that hold any row of ``ranges`` (rows found wrong
    after they were stored), so that a resumed run computes those blocks again; returns their indices."""
    if block_bytes is not None:
        layout = replace(layout, block_bytes=block_bytes)
    base = storage.join(storage.normalize(job_url(results_url, job_id)), COMMITTED_DIR)
    hit = [b.index for b in layout.blocks() if any(a < b.row_stop and b.row_start < z for a, z in ranges)]
    for index in hit:
        storage.delete_prefix(storage.join(base, str(index)))
    return hit


def remove_partial_result(results_url: str, job_id: str) -> None:
    """Remove the job's result group and commit markers (a failed job's partial result); its inputs and
    any other file of the job folder stay. Nothing there is not an error; raises ``OSError`` when storage fails."""
    base = job_url(results_url, job_id)
    storage.delete_prefix(storage.join(base, RESULT_GROUP))
    storage.delete_prefix(storage.join(base, COMMITTED_DIR))


def remove_job_result(results_url: str, job_id: str) -> None:
    """Remove everything under the job's folder (array, markers, manifest, inputs), as cancel does.
    Nothing there is not an error; raises ``OSError`` when storage fails."""
    storage.delete_prefix(job_url(results_url, job_id))
