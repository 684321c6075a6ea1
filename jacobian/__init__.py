"""The Jacobian service as users import and run it: the Python client, the result readers, the ``jacobian`` command.

    from jacobian import Client

    with Client("http://127.0.0.1:8000") as client:
        job_id = client.submit("mlp", {"x": x})
        client.wait(job_id)
        J = client.result(job_id)          # lazy zarr array straight from storage

    J = jacobian.open_zarr(uri)            # a result read by its URI (``result.uri``), no API needed

``Client`` is ``jacobian.client.JacobianClient``; the readers are those of ``jacobian.results``. The names
below are loaded on first use (PEP 562), so ``import jacobian`` and the ``jacobian`` command's ``--help``
import neither httpx nor numpy; nothing here imports TensorFlow, the server stack (``app``) or ``worker``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jacobian.client import DEFAULT_API_URL, TERMINAL, JacobianClient, JacobianError, JobCanceled, JobFailed
    from jacobian.client import JacobianClient as Client
    from jacobian.results import coo_of, open_coo, open_xarray, open_zarr, s3_storage_options

# public name -> (module, attribute)
_EXPORTS = {
    "Client": ("jacobian.client", "JacobianClient"),
    "JacobianClient": ("jacobian.client", "JacobianClient"),
    "JacobianError": ("jacobian.client", "JacobianError"),
    "JobFailed": ("jacobian.client", "JobFailed"),
    "JobCanceled": ("jacobian.client", "JobCanceled"),
    "DEFAULT_API_URL": ("jacobian.client", "DEFAULT_API_URL"),
    "TERMINAL": ("jacobian.client", "TERMINAL"),
    "open_zarr": ("jacobian.results", "open_zarr"),
    "open_xarray": ("jacobian.results", "open_xarray"),
    "open_coo": ("jacobian.results", "open_coo"),
    "coo_of": ("jacobian.results", "coo_of"),
    "s3_storage_options": ("jacobian.results", "s3_storage_options"),
}

__all__ = ["Client", "JacobianClient", "JacobianError", "JobFailed", "JobCanceled", "DEFAULT_API_URL", "TERMINAL",
           "open_zarr", "open_xarray", "open_coo", "coo_of", "s3_storage_options"]


def __getattr__(name: str) -> Any:
    """Module attribute ``name`` of ``_EXPORTS``, imported on first access and cached in the module."""
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'jacobian' has no attribute {name!r}; the public names are "
                             f"{', '.join(__all__)}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
