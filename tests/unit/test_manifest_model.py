"""One manifest model for every family (``contracts.manifest.Manifest``), written by one function."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from contracts.manifest import Manifest
from worker.storage import write_manifest

DENSE = {"id": "j1", "uri": "/r/j1/result.zarr", "format": "zarr-v3", "array": "jacobian", "shape": [4, 6],
         "dtype": "float32", "chunks": [4, 6], "plan": {"strategy": "tiled"}}
SPARSE = {"id": "j2", "uri": "/r/j2/result.zarr", "format": "coo", "array": "values", "kind": "jacobian",
          "shape": [10], "dense_shape": [4, 6], "dtype": "float32", "sparsity": {"nnz": 10}}
SPECTRAL = {"id": "j3", "uri": "/r/j3/result.zarr", "format": "zarr-v3", "array": "S", "kind": "svd", "shape": [3],
            "dtype": "float64", "arrays": {"S": [3], "U": [3, 4], "V": [3, 6]}, "residuals": [1e-7, 2e-7, 3e-7]}


@pytest.mark.parametrize("manifest", [DENSE, SPARSE, SPECTRAL], ids=["dense", "sparse", "spectral"])
def test_every_family_round_trips_unchanged(tmp_path, manifest):
    url = write_manifest(str(tmp_path), manifest)
    assert json.loads(open(url).read()) == manifest   # nothing added, nothing lost (extras kept)
    assert Manifest.model_validate(manifest).dump() == manifest


@pytest.mark.parametrize("broken, field", [
    ({**DENSE, "format": "parquet"}, "format"),
    ({k: v for k, v in DENSE.items() if k != "uri"}, "uri"),
    ({k: v for k, v in SPARSE.items() if k != "dense_shape"}, "dense_shape"),
    ({**DENSE, "shape": [4, -1]}, "shape"),
])
def test_a_malformed_manifest_is_never_written(tmp_path, broken, field):
    with pytest.raises(ValidationError, match=field):
        write_manifest(str(tmp_path), broken)
    assert not (tmp_path / "manifest.json").exists()
