"""``jacobian compute`` of the curvature kinds as a subprocess: ``--kind ggn_vp|fisher_vp|ihvp`` with ``--loss``,
``--labels`` (a member of the --input .npz), ``--damping``, ``--curvature``, ``--max-iterations``; results equal to
dense references, refusals and solver failures in the command line's words (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr

from tests import models
from tests.e2e.test_cli_compute import jacobian_cli
from tests.engine.reference import curvature_references, tape_jacobian

pytestmark = pytest.mark.e2e
X = np.random.default_rng(0).normal(size=(3, 5))
T = np.random.default_rng(1).normal(size=(3, 4))


@pytest.fixture(scope="module")
def f64(tmp_path_factory) -> Path:
    return models.float64_model(tmp_path_factory.mktemp("models") / "f64")


@pytest.fixture(scope="module")
def refs(f64):
    import tensorflow as tf

    from worker.engine import load_model

    model = load_model(str(f64))
    jac = tape_jacobian(model, {"x": X}, "y", "x").reshape(12, 15)
    g, f, _ = curvature_references(jac, np.asarray(model.fn(x=tf.constant(X))["y"]), "mse", T)
    return g, f


def test_compute_ggn_vp_fisher_vp_and_ihvp(f64: Path, refs, tmp_path: Path) -> None:
    ggn, fisher = refs
    seeds = np.random.default_rng(2).normal(size=(2, 3, 5))
    np.savez(tmp_path / "in.npz", x=X)
    np.savez(tmp_path / "labelled.npz", x=X, t=T)     # t: the labels, an input the signature does not take
    np.save(tmp_path / "seeds.npy", seeds)
    base = ("compute", "--model", str(f64), "--of", "y", "--wrt", "x", "--seeds", str(tmp_path / "seeds.npy"),
            "--loss", "mse", "--out", str(tmp_path / "out"))
    proc = jacobian_cli(*base, "--input", str(tmp_path / "labelled.npz"), "--kind", "ggn_vp")
    assert proc.returncode == 2 and "--input.t:" in proc.stderr, proc.stderr[-2000:]   # G takes no labels
    base += ("--input", str(tmp_path / "in.npz"))
    proc = jacobian_cli(*base, "--kind", "ggn_vp", "--job-id", "g")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = zarr.open_group(proc.stdout.strip(), mode="r")["products"][...]
    np.testing.assert_allclose(got.reshape(2, 15), seeds.reshape(2, 15) @ ggn, rtol=1e-9, atol=1e-12)
    assert "done: ggn_vp by J^T M J" in proc.stderr, proc.stderr[-2000:]

    proc = jacobian_cli(*base[:-2], "--input", str(tmp_path / "labelled.npz"), "--kind", "fisher_vp", "--labels",
                        "t", "--job-id", "f")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = zarr.open_group(proc.stdout.strip(), mode="r")["products"][...]
    np.testing.assert_allclose(got.reshape(2, 15), seeds.reshape(2, 15) @ fisher, rtol=1e-9, atol=1e-12)

    proc = jacobian_cli(*base, "--kind", "ihvp", "--curvature", "ggn", "--damping", "0.05", "--tol", "1e-10",
                        "--max-iterations", "200", "--job-id", "i")
    assert proc.returncode == 0, proc.stderr[-3000:]
    group = zarr.open_group(proc.stdout.strip(), mode="r")
    want = np.linalg.solve(ggn + 0.05 * np.eye(15), seeds.reshape(2, 15).T).T
    np.testing.assert_allclose(group["solutions"][...].reshape(2, 15), want, rtol=1e-8, atol=1e-10)
    manifest = json.loads((tmp_path / "out" / "i" / "manifest.json").read_text())
    assert manifest["kind"] == "ihvp" and max(manifest["residuals"]) <= 1e-10
    assert list(group["residuals"][...]) == manifest["residuals"]
    proc = jacobian_cli(*base, "--kind", "ihvp", "--curvature", "ggn", "--damping", "0.05", "--tol", "1e-10",
                        "--precondition", "diagonal", "--job-id", "p")   # Jacobi PCG: the exact diagonal (n = 15)
    assert proc.returncode == 0, proc.stderr[-3000:]
    group = zarr.open_group(proc.stdout.strip(), mode="r")
    np.testing.assert_allclose(group["solutions"][...].reshape(2, 15), want, rtol=1e-8, atol=1e-10)
    assert group.attrs["preconditioner_method"] == "exact" and group.attrs["preconditioner_products"] == 15


def test_compute_refusals_and_failures_speak_the_cli(f64: Path, tmp_path: Path) -> None:
    np.savez(tmp_path / "in.npz", x=X, t=T)
    np.save(tmp_path / "seeds.npy", np.ones((1, 3, 5)))
    base = ("compute", "--model", str(f64), "--input", str(tmp_path / "in.npz"), "--of", "y", "--wrt", "x",
            "--seeds", str(tmp_path / "seeds.npy"), "--out", str(tmp_path / "out"))
    proc = jacobian_cli(*base, "--kind", "ihvp", "--curvature", "ggn", "--loss", "mse")
    assert proc.returncode == 2 and "--damping:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = jacobian_cli(*base, "--kind", "fisher_vp", "--loss", "mse")
    assert proc.returncode == 2 and "--labels:" in proc.stderr, proc.stderr[-2000:]
    proc = jacobian_cli(*base, "--kind", "fisher_vp", "--loss", "mse", "--labels", "nope")
    assert proc.returncode == 2 and "--labels:" in proc.stderr, proc.stderr[-2000:]
    np.savez(tmp_path / "x.npz", x=X)
    proc = jacobian_cli(*base, "--input", str(tmp_path / "x.npz"), "--kind", "ihvp", "--curvature", "ggn", "--loss",
                        "mse", "--damping", "1e-3", "--max-iterations", "1", "--tol", "1e-12")
    assert proc.returncode == 2 and "--max-iterations:" in proc.stderr and "raise damping" in proc.stderr, \
        proc.stderr[-2000:]
