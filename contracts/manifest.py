"""``manifest.json``, the last file of every result (its presence means complete), as one model for every
family: dense (``format`` ``zarr-v3``, ``array`` ``jacobian``), sparse (``coo``: ``dense_shape``,
``sparsity``), products and spectra (``arrays``, ``residuals``). ``worker.storage.write_manifest`` is the one
function that writes it, through ``Manifest``; readers (``jacobian.results``, the worker's job status) may
parse it back with ``Manifest.model_validate``.

Keys beyond the named ones are kept (``extra="allow"``), and a manifest is dumped with ``exclude_unset``:
a key is in the file exactly when the family set it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Manifest(BaseModel):
    """The manifest of one job's result (shard plans and timings live in ``plan``)."""

    model_config = ConfigDict(extra="allow")

    id: str
    uri: str = Field(description="the result group (Zarr v3)")
    format: Literal["zarr-v3", "coo"]
    array: str = Field(description="the main array of the group: jacobian, values, products, S, eigenvalues, trace")
    shape: list[int] = Field(description="the main array's shape")
    dtype: str
    kind: str | None = None
    plan: dict[str, Any] = Field(default_factory=dict)
    arrays: dict[str, list[int]] | None = Field(None, description="every array of the group and its shape")
    dense_shape: list[int] | None = Field(None, description="format 'coo': the matrix's shape [n_of, n_wrt]")
    of: str | None = None
    wrt: str | list[str] | None = None
    wrt_slices: dict[str, Any] | None = None
    model: dict[str, Any] | None = None
    created_at: str | None = None
    finished_at: str | None = None

    @model_validator(mode="after")
    def _coo_has_its_matrix(self) -> Manifest:
        if self.format == "coo" and self.dense_shape is None:
            raise ValueError("dense_shape: a 'coo' manifest names the matrix's shape")
        if any(n < 0 for n in self.shape):
            raise ValueError(f"shape: {self.shape} has a negative dimension")
        return self

    def dump(self) -> dict[str, Any]:
        """The JSON of ``manifest.json``: what was set, nothing added."""
        return self.model_dump(mode="json", exclude_unset=True)
