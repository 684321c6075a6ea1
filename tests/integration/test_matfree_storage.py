"""The matrix-free kinds stored as a job's result group (``worker.matfree_job``, and ``jacobian compute
--kind ...``): arrays with named dimensions that xarray opens, values equal to the dense route's (GradientTape,
numpy), the request and the method in the group's attributes, ``manifest.json`` last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import models
from tests.engine.reference import tape_hessian, tape_jacobian
from worker.engine import load_model
from worker.engine.matfree import build_operator
from worker.matfree_job import compute_matfree_to_storage

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def f64(tmp_path_factory):
    """float64 ``x`` (3, 5) -> ``y`` (3, 4) and a scalar ``loss``; variables ``w`` (5, 4), ``b`` (4,)."""
    path = models.float64_model(tmp_path_factory.mktemp("mf") / "f64")
    x = np.random.default_rng(0).normal(size=(3, 5))
    return path, load_model(str(path)), {"x": x}


def stored(tmp_path, model, inputs, kind, *, of, wrt="x", **options):
    import xarray as xr

    op = build_operator(model, inputs, of=of, wrt=wrt, kind=kind)
    manifest = compute_matfree_to_storage(op, kind, results_url=str(tmp_path), job_id=kind, **options)
    assert json.loads((tmp_path / kind / "manifest.json").read_text())["uri"] == manifest["uri"]
    return xr.open_zarr(manifest["uri"]), manifest


def test_svd_matches_numpy_on_the_dense_jacobian(f64, tmp_path):
    _, model, inputs = f64
    J = tape_jacobian(model, inputs, "y", "x").reshape(12, 15)
    ds, manifest = stored(tmp_path, model, inputs, "svd", of="y", rank=3, tol=1e-8)
    s_ref = np.linalg.svd(J, compute_uv=False)[:3]
    np.testing.assert_allclose(ds["S"].values, s_ref, rtol=1e-6)
    assert ds["U"].dims == ("k", "of_0", "of_1") and ds["V"].dims == ("k", "wrt_0", "wrt_1")
    u, v = ds["U"].values.reshape(3, 12), ds["V"].values.reshape(3, 15)
    np.testing.assert_allclose(np.abs(np.sum(u * (J @ v.T).T, axis=1)), s_ref, rtol=1e-6)  # u^T J v = s
    assert ds.attrs["kind"] == "svd" and ds.attrs["plan"]["products"]["vjp"] > 0
    assert manifest["array"] == "S" and manifest["arrays"]["U"] == [3, 3, 4] and len(manifest["residuals"]) == 3


def test_hessian_eig_and_trace_match_numpy(f64, tmp_path):
    _, model, inputs = f64
    H = tape_hessian(model, inputs, "loss", "x").reshape(15, 15)
    w = np.linalg.eigvalsh(H)
    top = w[np.argsort(-np.abs(w))][:2]
    ds, _ = stored(tmp_path, model, inputs, "hessian_eig", of="loss", rank=2, tol=1e-8)
    np.testing.assert_allclose(ds["eigenvalues"].values, top, rtol=1e-6)
    assert ds["eigenvectors"].dims == ("k", "wrt_0", "wrt_1")
    trace, _ = stored(tmp_path, model, inputs, "hessian_trace", of="loss", samples=15)  # n HVPs: exact
    np.testing.assert_allclose(float(trace["trace"]), np.trace(H), rtol=1e-9)
    assert float(trace["stderr"]) == 0.0 and trace.attrs["method"] == "exact"


def test_products_over_several_wrt_match_the_dense_jacobian(f64, tmp_path):
    _, model, inputs = f64
    seeds = np.random.default_rng(4).normal(size=(5, 3, 4))
    ds, manifest = stored(tmp_path, model, inputs, "vjp", of="y", wrt=["x", "variables/w"], seeds=seeds,
                          chunk_rows=2)
    Jx = tape_jacobian(model, inputs, "y", "x").reshape(12, 15)
    Jw = tape_jacobian(model, inputs, "y", "variables/w").reshape(12, 20)
    want = seeds.reshape(5, 12) @ np.concatenate([Jx, Jw], axis=1)
    assert ds["products"].dims == ("seed", "wrt") and ds["products"].shape == (5, 35)
    np.testing.assert_allclose(ds["products"].values, want, rtol=1e-10, atol=1e-12)
    slices = ds.attrs["wrt_slices"]
    assert (slices["x"]["start"], slices["x"]["stop"], slices["variables/w"]["stop"]) == (0, 15, 35)
    assert manifest["wrt"] == ["x", "variables/w"]


def test_jacobian_compute_runs_a_matrix_free_kind(f64, tmp_path):
    import xarray as xr

    path, _, inputs = f64
    np.savez(tmp_path / "in.npz", **inputs)
    seeds = np.random.default_rng(5).normal(size=(2, 3, 5))
    np.save(tmp_path / "seeds.npy", seeds)
    cmd = [sys.executable, "-m", "jacobian.cli", "compute", "--model", str(path), "--input", str(tmp_path / "in.npz"),
           "--of", "y", "--wrt", "x", "--kind", "jvp", "--seeds", str(tmp_path / "seeds.npy"), "--out",
           str(tmp_path / "out"), "--job-id", "cli-jvp"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    uri = proc.stdout.strip()
    assert uri == str(tmp_path / "out" / "cli-jvp" / "result.zarr") and "done: jvp" in proc.stderr
    J = tape_jacobian(load_model(str(path)), inputs, "y", "x").reshape(12, 15)
    got = xr.open_zarr(uri)["products"].values
    np.testing.assert_allclose(got.reshape(2, 12), seeds.reshape(2, 15) @ J.T, rtol=1e-10, atol=1e-12)
    missing = subprocess.run(cmd[:-6] + ["--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                             timeout=300)
    assert missing.returncode == 2 and "seeds: kind 'jvp' needs seeds" in missing.stderr


def test_a_stopped_products_job_resumes_from_its_committed_blocks(f64, tmp_path):
    """Six cotangents in blocks of one seed, two per call: stopped after the first call, the job computes
    only the four seeds left when run again, and the stored products equal the dense route's."""
    import xarray as xr

    from worker.engine.errors import Stopped

    _, model, inputs = f64
    seeds = np.random.default_rng(6).normal(size=(6, 3, 4))
    op = build_operator(model, inputs, of="y", wrt="x", kind="vjp")
    calls = {"n": 0}

    def stop_after_one_call() -> bool:
        calls["n"] += 1
        return calls["n"] > 1

    options = dict(results_url=str(tmp_path), job_id="resume", seeds=seeds, chunk_rows=2, block_bytes=15 * 8)
    with pytest.raises(Stopped):
        compute_matfree_to_storage(op, "vjp", should_stop=stop_after_one_call, **options)
    assert not (tmp_path / "resume" / "manifest.json").exists()
    assert sorted(p.name for p in (tmp_path / "resume" / "committed").iterdir()) == ["0", "1"]
    manifest = compute_matfree_to_storage(op, "vjp", **options)
    assert manifest["plan"]["products"]["vjp"] == 4, manifest["plan"]  # only the seeds not stored before
    J = tape_jacobian(model, inputs, "y", "x").reshape(12, 15)
    np.testing.assert_allclose(xr.open_zarr(manifest["uri"])["products"].values.reshape(6, 15),
                               seeds.reshape(6, 12) @ J, rtol=1e-10, atol=1e-12)
