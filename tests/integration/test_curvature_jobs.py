"""The curvature kinds (issue 27) through the service: POST (JSON with the labels as an input the signature does not
take, ``.npz`` bodies with ``__seeds__``, the Python client), a real rq worker in this process, the status, the
result group; values equal to dense references (GradientTape, numpy). Refusals at POST name the field; a solve that
does not converge, or meets a matrix that is not positive definite, fails the job naming what to change."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from tests import models
from tests.conftest import finished_job, tensor, work_burst
from tests.engine.reference import curvature_references, tape_hessian, tape_jacobian
from worker.engine import load_model

pytestmark = pytest.mark.integration
X = np.random.default_rng(0).normal(size=(3, 5))
T = np.random.default_rng(1).normal(size=(3, 4))


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    models.float64_model(root / "f64")
    return root


@pytest.fixture
def client(worker_client):
    return worker_client



def body(*, with_t: bool = False, **options) -> dict:
    inputs = {"x": tensor(X)} | ({"t": tensor(T)} if with_t else {})
    return {"model": {"path": "f64"}, "inputs": inputs, **options}


def references(model, wrt: list[str], loss: str = "mse") -> tuple[np.ndarray, np.ndarray]:
    """G and F of ``loss`` on ``y`` w.r.t. the sources ``wrt`` concatenated, labels ``T``."""
    jac = np.concatenate([tape_jacobian(model, {"x": X}, "y", w).reshape(12, -1) for w in wrt], axis=1)
    import tensorflow as tf

    y = np.asarray(model.fn(x=tf.constant(X))["y"])
    g, f, _ = curvature_references(jac, y, loss, T)
    return g, f


def test_fisher_vp_with_labels_as_an_input_over_every_variable(client, redis_conn, model_root):
    import xarray as xr

    model = load_model(str(model_root / "f64"))
    seeds = np.random.default_rng(2).normal(size=(3, 24))      # variables/*: w (5, 4) and b (4,)
    r = client.post("/v1/jobs", json=body(with_t=True, of="y", wrt="variables/*", kind="fisher_vp", loss="mse",
                                          labels="t", seeds=tensor(seeds)))
    assert r.status_code == 202, r.text
    record = finished_job(client, redis_conn, r.json()["id"])
    ds = xr.open_zarr(record["result"]["uri"])
    names = list(ds.attrs["wrt"])
    assert sorted(names) == ["variables/b", "variables/w"]
    _, fisher = references(model, names)
    np.testing.assert_allclose(ds["products"].values, seeds @ fisher, rtol=1e-9, atol=1e-12)
    assert record["plan"]["products"]["jvp"] >= 3 and record["plan"]["products"]["vjp"] >= 3, record["plan"]
    assert record["plan"]["products"]["hvp"] == 0 and record["result"]["shape"] == [3, 24]
    picture = client.get(f"/v1/jobs/{record['id']}/preview.png")
    assert picture.status_code == 200 and picture.content.startswith(b"\x89PNG")


@pytest.mark.parametrize("precondition", [None, "diagonal"])
def test_ihvp_of_the_gauss_newton_matrix_from_an_npz_body(client, redis_conn, model_root, precondition):
    import xarray as xr

    model = load_model(str(model_root / "f64"))
    seeds = np.random.default_rng(3).normal(size=(4, 15 + 20))
    buf = io.BytesIO()
    np.savez(buf, x=X, __seeds__=seeds)
    params = {"model_path": "f64", "of": "y", "wrt": "x,variables/w", "kind": "ihvp", "curvature": "ggn",
              "loss": "sigmoid_cross_entropy", "damping": "0.01", "tol": "1e-9"}
    if precondition:
        params["precondition"] = precondition
    r = client.post("/v1/jobs", content=buf.getvalue(), headers={"Content-Type": "application/x-npz"}, params=params)
    assert r.status_code == 202, r.text
    record = finished_job(client, redis_conn, r.json()["id"])
    ds = xr.open_zarr(record["result"]["uri"])
    ggn, _ = references(model, ["x", "variables/w"], "sigmoid_cross_entropy")
    a = ggn + 0.01 * np.eye(35)
    np.testing.assert_allclose(ds["solutions"].values, np.linalg.solve(a, seeds.T).T, rtol=1e-7, atol=1e-9)
    residuals = ds["residuals"].values
    assert residuals.shape == (4,) and np.all(residuals <= 1e-9), residuals
    true = np.linalg.norm(ds["solutions"].values @ a - seeds, axis=1) / np.linalg.norm(seeds, axis=1)
    assert np.all(true <= 1e-8), true
    assert np.all(ds["iterations"].values >= 1) and list(ds["solutions"].dims) == ["seed", "wrt"]
    assert record["result"]["shape"] == [4, 35]
    if precondition:   # the 35 unit-vector products of the exact diagonal, counted with the solve's
        assert ds.attrs["preconditioner_method"] == "exact" and ds.attrs["preconditioner_products"] == 35
        assert record["plan"]["products"]["ggn_vp"] >= 35 + int(ds["iterations"].values.sum())
    else:
        assert ds.attrs["preconditioner"] == "none"


def test_ggn_kinds_through_the_python_client(client, redis_conn, model_root):
    from jacobian.client import JacobianClient

    model = load_model(str(model_root / "f64"))
    seeds = np.random.default_rng(4).normal(size=(2, 3, 5))
    with JacobianClient("http://testserver", transport=client._transport) as jc:
        products = jc.submit("f64", {"x": X, "t": T}, of="y", wrt="x", kind="fisher_vp", loss="mse", labels="t",
                             seeds=seeds)
        eig = jc.submit("f64", {"x": X}, of="y", wrt="x", kind="ggn_eig", loss="mse", rank=3, tol=1e-9)
        work_burst(redis_conn)
        got = jc.result(products, as_xarray=True)["products"].values
        values = jc.result(eig, as_xarray=True)["eigenvalues"].values
    ggn, fisher = references(model, ["x"])
    np.testing.assert_allclose(got.reshape(2, 15), seeds.reshape(2, 15) @ fisher, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(values, sorted(np.linalg.eigvalsh(ggn), key=abs, reverse=True)[:3], rtol=1e-7)


def test_a_solve_that_fails_fails_the_job_naming_what_to_change(client, redis_conn, model_root):
    model = load_model(str(model_root / "f64"))
    h = tape_hessian(model, {"x": X}, "loss", "x").reshape(15, 15)
    assert np.linalg.eigvalsh(h).min() < -1e-3        # the loss' Hessian w.r.t. x is indefinite
    seeds = tensor(np.random.default_rng(5).normal(size=(2, 3, 5)))
    slow = client.post("/v1/jobs", json=body(of="loss", wrt="x", kind="ihvp", damping=1e3, max_iterations=1,
                                             tol=1e-12, seeds=seeds))
    indefinite = client.post("/v1/jobs", json=body(of="loss", wrt="x", kind="ihvp", damping=1e-3, seeds=seeds))
    assert slow.status_code == indefinite.status_code == 202, slow.text
    work_burst(redis_conn)
    slow, indefinite = (client.get(f"/v1/jobs/{r.json()['id']}").json() for r in (slow, indefinite))
    assert slow["status"] == "failed" and slow["error"]["type"] == "NotConverged", slow
    assert slow["error"]["message"].startswith("max_iterations:") and "seed 0:" in slow["error"]["message"]
    assert indefinite["status"] == "failed" and indefinite["error"]["type"] == "NotPositiveDefinite", indefinite
    assert indefinite["error"]["message"].startswith("damping:")
    assert "not positive definite" in indefinite["error"]["message"]


@pytest.mark.parametrize("options,field", [
    ({"of": "y", "kind": "ggn_vp", "seeds": tensor(np.ones((1, 3, 5)))}, "loss"),             # no loss
    ({"of": "y", "kind": "fisher_vp", "loss": "mse", "seeds": tensor(np.ones((1, 3, 5)))}, "labels"),
    ({"of": "y", "kind": "fisher_vp", "loss": "mse", "labels": "nope",
      "seeds": tensor(np.ones((1, 3, 5)))}, "labels"),                                       # no such input
    ({"of": "y", "kind": "fisher_vp", "loss": "softmax_cross_entropy", "labels": "t", "labels_as": np.ones(3),
      "seeds": tensor(np.ones((1, 3, 5)))}, "labels"),                                       # float class ids
    ({"of": "y", "kind": "fisher_vp", "loss": "mse", "labels": "t", "labels_as": np.ones((3, 5)),
      "seeds": tensor(np.ones((1, 3, 5)))}, "labels"),                                       # not of's shape
    ({"of": "y", "kind": "ggn_vp", "loss": "mse", "labels": "t",
      "seeds": tensor(np.ones((1, 3, 5)))}, "labels"),                                       # G takes no labels
    ({"of": "loss", "kind": "ggn_eig", "loss": "softmax_cross_entropy", "rank": 2}, "of"),   # no class axis
    ({"of": "y", "kind": "ggn_eig", "loss": "mse", "rank": 2, "reduce": "sum"}, "reduce"),
    ({"of": "y", "kind": "ggn_trace", "loss": "huber"}, "loss"),
    ({"of": "y", "kind": "ihvp", "seeds": tensor(np.ones((1, 3, 5)))}, "damping"),
    ({"of": "y", "kind": "ihvp", "damping": -1.0, "seeds": tensor(np.ones((1, 3, 5)))}, "damping"),
    ({"of": "y", "kind": "ihvp", "damping": 0.1, "seeds": tensor(np.ones((1, 3, 5)))}, "of"),   # H of a non-scalar
    ({"of": "y", "kind": "ihvp", "damping": 0.1, "curvature": "ggn",
      "seeds": tensor(np.ones((1, 3, 5)))}, "loss"),                                         # G needs a loss
    ({"of": "loss", "kind": "ihvp", "damping": 0.1, "loss": "mse",
      "seeds": tensor(np.ones((1, 3, 5)))}, "loss"),                                         # H takes none
    ({"of": "y", "kind": "ihvp", "damping": 0.1, "curvature": "ggn", "loss": "mse"}, "seeds"),
    ({"of": "y", "kind": "hvp", "damping": 0.1, "seeds": tensor(np.ones((1, 3, 5)))}, "damping"),
])
def test_refusals_at_post_name_the_field(client, redis_conn, options, field):
    options = dict(options)
    extra = options.pop("labels_as", None)
    request = body(with_t=extra is None and options.get("labels") == "t", **options)
    if extra is not None:
        request["inputs"]["t"] = tensor(extra)
    r = client.post("/v1/jobs", json=request)
    assert r.status_code in (400, 422), r.text
    assert r.json()["error"]["message"].startswith(field), r.json()
    assert redis_conn.llen("rq:queue:jacobian") == 0


def test_an_input_the_signature_lacks_is_refused_unless_labels_names_it(client, redis_conn):
    r = client.post("/v1/jobs", json=body(with_t=True, of="y", kind="ggn_trace", loss="mse"))
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("inputs.t:"), r.text
