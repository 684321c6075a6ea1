"""A result opens with the readers scientists use, without project code: zarr, ``xarray.open_zarr`` (named
dimensions, the request as attributes) and ``dask.array.from_zarr``, from local disk and from S3 (moto's
server), with values equal to GradientTape's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from contracts import storage
from tests import models

pytestmark = pytest.mark.integration

# (model builder, inputs, request, dimension names, GradientTape reference)
CASES = {
    "jacobian": (models.cnn, {"image": (2, 8, 8, 3)}, {"of": "logits", "wrt": "image", "kind": "jacobian"},
                 ("of_0", "of_1", "wrt_0", "wrt_1", "wrt_2", "wrt_3")),
    "batch_jacobian": (models.mlp, {"x": (3, 8)}, {"of": "y", "wrt": "x", "kind": "batch_jacobian"},
                       ("batch", "of_1", "wrt_1")),
    "hessian": (models.float64_model, {"x": (2, 5)}, {"of": "loss", "wrt": "x", "kind": "hessian"},
                ("wrt_0", "wrt_1", "wrt2_0", "wrt2_1")),
}


def tape_reference(path: Path, inputs: dict[str, np.ndarray], of: str, wrt: str, kind: str) -> np.ndarray:
    import tensorflow as tf

    loaded = tf.saved_model.load(str(path))  # kept alive: the signature needs its variables
    fn = loaded.signatures["serving_default"]
    tensors = {k: tf.constant(v) for k, v in inputs.items()}
    with tf.GradientTape(persistent=True) as outer:
        outer.watch(tensors[wrt])
        with tf.GradientTape() as inner:
            inner.watch(tensors[wrt])
            y = fn(**tensors)[of]
        if kind == "hessian":
            g = inner.gradient(y, tensors[wrt])
    if kind == "hessian":
        return outer.jacobian(g, tensors[wrt]).numpy()
    if kind == "batch_jacobian":
        return outer.batch_jacobian(y, tensors[wrt]).numpy()
    return outer.jacobian(y, tensors[wrt]).numpy()


def reader_options(where: str) -> dict | None:
    """What any reader passes for this endpoint (fsspec/s3fs options): no project code involved."""
    if where == "local":
        return None
    return {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "endpoint_url": os.environ["AWS_ENDPOINT_URL"], "client_kwargs": {"region_name": "us-east-1"}}


@pytest.fixture(params=["local", "s3"])
def results_url(request, tmp_path):
    if request.param == "local":
        return request.param, str(tmp_path / "results")
    bucket = request.getfixturevalue("s3_env")
    return request.param, f"s3://{bucket}/results"


@pytest.mark.parametrize("case", sorted(CASES))
def test_result_opens_with_zarr_xarray_and_dask(case, results_url, tmp_path):
    import dask.array as da
    import xarray as xr
    import zarr

    from worker.engine import build_problem, load_model
    from worker.pipeline import compute_to_storage

    where, url = results_url
    build, shapes, request, dims = CASES[case]
    path = build(tmp_path / case)
    rng = np.random.default_rng(7)
    dtype = "float64" if case == "hessian" else "float32"
    inputs = {k: rng.normal(size=s).astype(dtype) for k, s in shapes.items()}
    problem = build_problem(load_model(str(path)), inputs, of=request["of"], wrt=request["wrt"],
                            kind=request["kind"])
    manifest = compute_to_storage(problem, results_url=url, job_id=f"read-{case}", chunk_rows=3)
    expected = tape_reference(path, inputs, **request)
    uri, options = manifest["uri"], reader_options(where)
    assert uri.endswith(f"read-{case}/result.zarr") and manifest["array"] == "jacobian"

    # zarr: a group with consolidated metadata, its attributes the request and the plan
    group = zarr.open_group(uri, mode="r", storage_options=options)
    assert group.metadata.consolidated_metadata is not None
    assert group.attrs["kind"] == request["kind"] and group.attrs["of"] == request["of"]
    assert group.attrs["wrt"] == request["wrt"] and group.attrs["plan"]["strategy"]
    assert tuple(group["jacobian"].metadata.dimension_names) == dims
    np.testing.assert_allclose(group["jacobian"][...], expected, rtol=1e-4, atol=1e-5)

    # xarray: a labelled Dataset
    ds = xr.open_zarr(uri, storage_options=options)
    assert ds["jacobian"].dims == dims and ds["jacobian"].shape == expected.shape
    assert ds["jacobian"].dtype == np.dtype(dtype) and ds.attrs["kind"] == request["kind"]
    np.testing.assert_allclose(ds["jacobian"].values, expected, rtol=1e-4, atol=1e-5)

    # dask: a lazy array over the stored chunks
    lazy = da.from_zarr(uri, component="jacobian", storage_options=options)
    assert lazy.chunksize == group["jacobian"].chunks
    np.testing.assert_allclose(lazy.compute(), expected, rtol=1e-4, atol=1e-5)

    # manifest.json beside the group, written last
    base = uri.rsplit("/", 1)[0]
    assert json.loads(storage.read_bytes(f"{base}/manifest.json"))["uri"] == uri


def test_a_resumed_job_reseals_the_group(tmp_path):
    """A job that stopped half way and resumed ends with one consolidated group holding every block."""
    import xarray as xr

    from worker.engine import build_problem, load_model
    from worker.engine.errors import Stopped
    from worker.pipeline import compute_to_storage

    path = models.mlp(tmp_path / "mlp")
    x = np.random.default_rng(1).normal(size=(4, 8)).astype("float32")
    problem = build_problem(load_model(str(path)), {"x": x})
    url = str(tmp_path / "results")
    calls = {"n": 0}

    def stop_after_first_chunk() -> bool:
        calls["n"] += 1
        return calls["n"] > 1

    with pytest.raises(Stopped):
        compute_to_storage(problem, results_url=url, job_id="resumed", chunk_rows=2, block_bytes=2 * 4 * 8 * 4,
                           should_stop=stop_after_first_chunk)
    assert not (tmp_path / "results" / "resumed" / "manifest.json").exists()
    manifest = compute_to_storage(problem, results_url=url, job_id="resumed", chunk_rows=2,
                                  block_bytes=2 * 4 * 8 * 4)
    ds = xr.open_zarr(manifest["uri"])
    expected = tape_reference(path, {"x": x}, "y", "x", "jacobian")
    np.testing.assert_allclose(ds["jacobian"].values, expected, rtol=1e-5, atol=1e-6)
    assert ds["jacobian"].dims == ("of_0", "of_1", "wrt_0", "wrt_1")


def test_old_results_still_read(tmp_path):
    """A result stored before the group layout (the array alone at ``{job}/jacobian.zarr``) is still read by
    the API's and client's openers."""
    import zarr

    from jacobian.client import open_zarr

    uri = str(tmp_path / "j" / "jacobian.zarr")
    zarr.create_array(store=uri, shape=(2, 3), dtype="float32")[...] = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(storage.open_result(uri)[...], np.ones((2, 3)))
    np.testing.assert_array_equal(open_zarr(uri)[...], np.ones((2, 3)))
