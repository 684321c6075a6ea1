"""Sparse Jacobians to storage (``worker.sparse_job``): the COO group read back with zarr and scipy alone,
the dense fallback and its reason, patterns from a URI and from an earlier job, and the pattern cache."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from tests import sparse_models
from tests.engine.conftest import rand


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from worker.engine import load_model

    root = tmp_path_factory.mktemp("sparse_storage_models")
    return {"conv": load_model(str(sparse_models.conv_net(root / "conv", size=20, channels=(3, 2)))),
            "mlp": load_model(str(sparse_models.mlp(root / "mlp")))}


def dense(model, inputs, of, wrt):
    import tensorflow as tf

    x = tf.constant(inputs[wrt])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = model.fn(**{wrt: x})[of]
    return tape.jacobian(y, x, experimental_use_pfor=False).numpy().reshape(int(np.prod(y.shape)), -1)


def read_coo(uri):
    """What a reader without project code does: zarr and scipy."""
    import scipy.sparse as sp
    import zarr

    group = zarr.open_group(uri, mode="r")
    shape = tuple(group.attrs["shape"])
    coo = sp.coo_array((group["values"][...], (group["rows"][...], group["cols"][...])), shape=shape)
    return group, coo


def run(model, inputs, tmp_path, job_id, **options):
    from worker.engine import TFMemoryProbe
    from worker.execution.local import local_context
    from worker.sparse_job import compute_sparse_to_storage

    options.setdefault("sparsity", "auto")
    options.setdefault("cache_dir", str(tmp_path / "cache"))
    progress = options.pop("on_progress", None)
    if progress is not None:
        options["on_progress"] = lambda p: progress(p.rows_done, p.rows_total)
    if "previous" in options:
        options["previous_result"] = options.pop("previous")
    shared = options.pop("shared_cache", None)
    wrt = "image" if "image" in inputs else "x"
    ctx = local_context(model, inputs, wrt=wrt, results_url=str(tmp_path / "results"), job_id=job_id,
                        probe=TFMemoryProbe(), **options)
    return compute_sparse_to_storage(ctx, shared_cache=shared)


def test_auto_sparse_result_is_the_jacobian(models, tmp_path):
    inputs = {"image": rand((2, 20, 20, 3), seed=11)}
    seen = []
    manifest = run(models["conv"], inputs, tmp_path, "j1", on_progress=lambda d, t: seen.append((d, t)))
    assert manifest["format"] == "coo" and manifest["array"] == "values"
    group, coo = read_coo(manifest["uri"])
    want = dense(models["conv"], inputs, "out", "image")
    np.testing.assert_allclose(coo.toarray(), want, rtol=1e-5, atol=1e-6)
    rows, cols = group["rows"][...], group["cols"][...]
    assert np.all(np.diff(rows) >= 0) and rows.dtype == cols.dtype == np.int64
    indptr = group["indptr"][...]
    assert indptr[-1] == coo.nnz and len(indptr) == want.shape[0] + 1
    info = manifest["plan"]["sparsity"]
    assert info["source"] == "auto" and info["verified"] is True and info["nnz"] == coo.nnz
    # a row reads 5 x 5 x 3 inputs, an input reaches 5 x 5 x 2 outputs: rows coloured, 50 VJPs
    assert info["colors"] == 50 and info["mode"] == "reverse"
    assert 0 < info["density"] < 0.1
    assert seen and seen[-1] == (50, 50)
    assert group.attrs["format"] == "coo" and group.attrs["sparsity"]["verified"] is True
    assert json.loads((tmp_path / "results" / "j1" / "manifest.json").read_text())["dense_shape"] == list(want.shape)


def test_a_dense_pattern_takes_the_dense_path_and_says_why(models, tmp_path):
    from worker.sparse_job import DenseInstead

    outcome = run(models["mlp"], {"x": rand((1, 6))}, tmp_path, "j2")
    assert isinstance(outcome, DenseInstead)
    assert outcome.sparsity["fallback"].startswith("dense: the pattern holds 100.0%")
    assert outcome.sparsity["verified"] is False and outcome.sparsity["nnz"] == 18
    assert not (tmp_path / "results" / "j2" / "manifest.json").exists()


def test_a_wrong_pattern_uri_is_caught_and_computed_densely(models, tmp_path):
    from worker.sparse_job import DenseInstead

    n = 20 * 20 * 2
    buf = io.BytesIO()
    np.savez(buf, rows=np.arange(n), cols=np.arange(n))             # the diagonal only: misses the stencil
    (tmp_path / "p.npz").write_bytes(buf.getvalue())
    outcome = run(models["conv"], {"image": rand((1, 20, 20, 3))}, tmp_path, "j3",
                  sparsity={"pattern_uri": str(tmp_path / "p.npz")})
    assert isinstance(outcome, DenseInstead)
    assert outcome.sparsity["source"] == "pattern_uri" and outcome.sparsity["verified"] is False
    assert "misses entries" in outcome.sparsity["fallback"]


def test_pattern_uri_outside_the_matrix_names_the_field(models, tmp_path):
    from worker.engine.errors import InvalidRequest

    buf = io.BytesIO()
    np.savez(buf, rows=np.array([0, 10_000]), cols=np.array([0, 1]))
    (tmp_path / "p.npz").write_bytes(buf.getvalue())
    with pytest.raises(InvalidRequest) as err:
        run(models["conv"], {"image": rand((1, 20, 20, 3))}, tmp_path, "j4",
            sparsity={"pattern_uri": str(tmp_path / "p.npz")})
    assert err.value.field == "sparsity.pattern_uri" and "outside" in str(err.value)


def test_pattern_from_an_earlier_sparse_job_and_the_cache(models, tmp_path, monkeypatch):
    from worker.engine.sparsity import walk

    inputs = {"image": rand((1, 20, 20, 3), seed=3)}
    first = run(models["conv"], inputs, tmp_path, "a")
    assert list((tmp_path / "cache" / "sparsity").glob("*.npz"))

    def no_detect(*args, **kwargs):
        raise AssertionError("the cached pattern should have been used")

    monkeypatch.setattr(walk, "detect", no_detect)
    other = {"image": rand((1, 20, 20, 3), seed=4)}            # new values, same shapes: the cached pattern
    again = run(models["conv"], other, tmp_path, "b")
    assert again["sparsity"]["nnz"] == first["sparsity"]["nnz"]
    earlier = "a" * 32   # pattern_from names a job id as the service issues them
    urls = {earlier: first["uri"]}
    third = run(models["conv"], other, tmp_path, "c", sparsity={"pattern_from": earlier}, previous=urls.get)
    assert third["sparsity"]["source"] == "pattern_from" and third["sparsity"]["verified"]
    np.testing.assert_allclose(read_coo(third["uri"])[1].toarray(), dense(models["conv"], other, "out", "image"),
                               rtol=1e-5, atol=1e-6)
