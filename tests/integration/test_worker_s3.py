"""The result writer against a real S3 endpoint (moto's server), read back with plain zarr + s3fs."""

from __future__ import annotations

import io
import json
import os

import boto3
import numpy as np
import pytest
import zarr

from contracts import storage
from contracts.layout import ResultLayout
from tests import models
from worker.storage import ResultWriter

pytestmark = pytest.mark.integration


def plain_options() -> dict:
    """What any reader passes to zarr for this endpoint: no project code involved."""
    return {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "endpoint_url": os.environ["AWS_ENDPOINT_URL"], "client_kwargs": {"region_name": "us-east-1"}}


def test_storage_functions_on_s3(s3_env):
    base = f"s3://{s3_env}/jobs/j1"
    assert not storage.exists(base) and storage.list_names(base) == []
    storage.write_bytes(f"{base}/committed/0", b"{}")
    storage.write_bytes(f"{base}/manifest.json", b'{"a": 1}')
    assert storage.read_bytes(f"{base}/manifest.json") == b'{"a": 1}'
    assert storage.exists(f"{base}/manifest.json") and storage.exists(base)
    assert storage.list_names(base) == ["committed", "manifest.json"]
    assert storage.list_names(f"{base}/committed") == ["0"]
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(f"{base}/missing")
    storage.delete_prefix(base)
    assert not storage.exists(f"{base}/manifest.json") and storage.list_names(base) == []
    storage.delete_prefix(base)  # nothing there: not an error


def test_writer_on_s3_resumes_and_reads_back_with_plain_zarr(s3_env):
    layout = ResultLayout(shape=(4, 5, 3), iter_start=0, iter_stop=2, itemsize=4, block_bytes=3 * 4 * 6)  # 6 rows/block
    J = np.random.default_rng(3).normal(size=(4, 5, 3)).astype(np.float32)
    rows = J.reshape(20, 3)
    results = f"s3://{s3_env}/results"
    first = ResultWriter(results, "job-s3", layout=layout, dtype="float32", attrs={"kind": "jacobian"})
    first.write_rows(0, rows[:5])
    first.write_rows(5, rows[5:10])  # block 0 (rows 0-4) done, block 1 half filled
    first.abort()
    # block 0 may or may not have reached storage; a resumed writer computes what is missing
    second = ResultWriter(results, "job-s3", layout=layout, dtype="float32", attrs={"kind": "jacobian"})
    ranges = second.pending_ranges()
    assert ranges in ([(0, 20)], [(5, 20)])
    for start, stop in ranges:
        second.write_rows(start, rows[start:stop])
    second.write_manifest({"kind": "jacobian"})
    assert second.uri == f"s3://{s3_env}/results/job-s3/result.zarr"

    arr = zarr.open_array(second.uri + "/jacobian", mode="r", storage_options=plain_options())
    np.testing.assert_array_equal(arr[:], J)
    assert arr.chunks == tuple(layout.chunks)
    assert zarr.open_group(second.uri, mode="r", storage_options=plain_options()).attrs["kind"] == "jacobian"
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    manifest = json.loads(s3.get_object(Bucket=s3_env, Key="results/job-s3/manifest.json")["Body"].read())
    assert manifest["shape"] == [4, 5, 3] and manifest["uri"] == second.uri
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=s3_env, Prefix="results/job-s3/committed/")["Contents"]}
    assert keys == {f"results/job-s3/committed/{i}" for i in range(len(layout.blocks()))}


def test_compute_to_storage_on_s3_equals_tape_jacobian(s3_env, tmp_path):
    import tensorflow as tf

    from contracts.settings import get_settings
    from worker.engine import build_problem, load_model
    from worker.inputs import load_inputs
    from worker.pipeline import compute_to_storage

    path = models.cnn(tmp_path / "cnn")
    x = np.random.default_rng(1).normal(size=(2, 8, 8, 3)).astype(np.float32)
    buf = io.BytesIO()
    np.savez(buf, image=x)
    storage.write_bytes(f"s3://{s3_env}/in/x.npz", buf.getvalue())
    problem = build_problem(load_model(str(path)), load_inputs(f"s3://{s3_env}/in/x.npz", settings=get_settings()))
    manifest = compute_to_storage(problem, results_url=f"s3://{s3_env}/results", job_id="cnn1", chunk_rows=3)

    loaded = tf.saved_model.load(str(path))  # keep it alive: the signature needs its variables
    fn = loaded.signatures["serving_default"]
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = fn(image=xt)["logits"]
    expected = tape.jacobian(y, xt).numpy()
    got = zarr.open_array(manifest["uri"] + "/jacobian", mode="r", storage_options=plain_options())[:]
    assert got.shape == expected.shape == (2, 5, 2, 8, 8, 3)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert storage.exists(f"s3://{s3_env}/results/cnn1/manifest.json")


def test_result_removal_on_s3(s3_env):
    """``remove_partial_result`` keeps the job's inputs; ``remove_job_result`` empties its folder only."""
    from worker.result_group import remove_job_result, remove_partial_result

    results = f"s3://{s3_env}/results"
    layout = ResultLayout(shape=(6, 5), iter_start=0, iter_stop=1, itemsize=4, block_bytes=40)  # 3 blocks
    for job_id in ("a", "b"):
        storage.write_bytes(f"{results}/{job_id}/inputs.npz", b"npz")
        with ResultWriter(results, job_id, layout=layout, dtype="float32") as w:
            w.write_rows(0, np.ones((6, 5), np.float32))
        assert storage.list_names(f"{results}/{job_id}") == ["committed", "inputs.npz", "result.zarr"]
    remove_partial_result(results, "a")
    assert storage.list_names(f"{results}/a") == ["inputs.npz"]
    remove_partial_result(results, "a")  # nothing left to remove: not an error
    remove_job_result(results, "a")
    assert storage.list_names(results) == ["b"] and not storage.exists(f"{results}/a")
    assert storage.list_names(f"{results}/b") == ["committed", "inputs.npz", "result.zarr"]
    remove_job_result(results, "a")
