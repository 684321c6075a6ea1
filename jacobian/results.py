"""A job's result read straight from its storage (local path or ``s3://``), as the Python client returns it
without ``rows``: the group's main array, lazy (``open_zarr``), the group as an ``xarray.Dataset``
(``open_xarray``), or a sparse Jacobian as a ``scipy.sparse.coo_array`` (``open_coo``). zarr and numpy
only (xarray and scipy when those readers are used); ``s3://`` credentials and endpoint from ``AWS_*``.
"""

from __future__ import annotations

from typing import Any


def s3_storage_options() -> dict[str, Any]:
    """fsspec/s3fs options from the standard ``AWS_*`` variables."""
    from contracts.storage import s3_options_from_env

    return s3_options_from_env()


def _store_args(uri: str) -> tuple[str, dict[str, Any] | None]:
    """``uri`` as zarr and xarray take it, and fsspec options for ``s3://`` (``s3_storage_options()``)."""
    if uri.startswith(("s3://", "s3a://")):
        return uri.replace("s3a://", "s3://", 1), s3_storage_options()
    return uri.removeprefix("file://"), None


def open_node(uri: str) -> Any:
    """The zarr group (or legacy array) at ``uri``, read-only; ``s3://`` through fsspec."""
    import zarr

    path, options = _store_args(uri)
    return zarr.open(path, mode="r", storage_options=options)


def is_coo(node: Any) -> bool:
    """True for a sparse Jacobian's group (attribute ``format`` is ``"coo"``)."""
    import zarr

    return isinstance(node, zarr.Group) and node.attrs.get("format") == "coo"


def main_array_of(node: Any, name: str | None = None) -> Any:
    """The array ``name`` of a result group (default: its main array, ``contracts.layout.main_array``); an
    array ``node`` as it is."""
    import zarr

    from contracts.layout import main_array

    if not isinstance(node, zarr.Group):
        return node
    return node[name or main_array(node.attrs.get("kind"), node.attrs.get("format"))]


def open_zarr(uri: str, name: str | None = None) -> Any:
    """The array ``name`` (default: the main array: ``jacobian``, ``products``, ``S``, ..., ``values`` of a
    sparse Jacobian) of the result group at ``uri`` (``result.uri``), read-only and lazy; an array at ``uri``
    itself (results stored before the group layout) as it is. ``s3://`` through fsspec."""
    return main_array_of(open_node(uri), name)


def coo_of(group: Any) -> Any:
    """A sparse Jacobian's group (format ``coo``) as ``scipy.sparse.coo_array((values, (rows, cols)),
    shape=shape)``, read whole. Needs scipy."""
    try:
        from scipy.sparse import coo_array
    except ImportError as exc:
        raise ImportError("scipy: a sparse Jacobian is returned as a scipy.sparse.coo_array (pip install scipy); "
                          "or read its arrays rows, cols and values with zarr, or rows a:b with "
                          "result(job_id, rows=slice(a, b))") from exc
    shape = tuple(int(d) for d in group.attrs["shape"])
    return coo_array((group["values"][...], (group["rows"][...], group["cols"][...])), shape=shape)


def open_coo(uri: str) -> Any:
    """The sparse Jacobian at ``uri`` (``result.uri`` of a job with ``sparsity``) as a
    ``scipy.sparse.coo_array`` (``coo_of``); ``ValueError`` when the result there is dense."""
    node = open_node(uri)
    if not is_coo(node):
        raise ValueError(f"{uri}: not a sparse result (no group attribute format='coo'); read it with open_zarr")
    return coo_of(node)


def open_xarray(uri: str) -> Any:
    """The result group at ``uri`` as a lazy ``xarray.Dataset`` (``xarray.open_zarr``; needs xarray and dask)."""
    try:
        import xarray as xr
    except ImportError as exc:
        raise ImportError("xarray: reading a result as a Dataset needs xarray and dask "
                          "(pip install xarray 'dask[array]')") from exc
    path, options = _store_args(uri)
    return xr.open_zarr(path, storage_options=options, consolidated=True)
