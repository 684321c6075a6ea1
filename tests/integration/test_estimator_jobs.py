"""``hessian_diag``, ``spectral_density`` and ``logdet`` through the service: POST, a real rq worker in this process,
the status, the result group read with xarray and the Python client; values against the dense Hessian (GradientTape,
numpy). Refusals at POST, and a damped Hessian that is not positive definite failing the job, name the field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests import models
from tests.conftest import finished_job, work_burst
from tests.engine.reference import tape_hessian
from worker.engine import load_model

pytestmark = pytest.mark.integration
X = np.random.default_rng(0).normal(size=(3, 5))
XS = np.random.default_rng(1).normal(size=(4, 6))
LABELS = np.array([0, 2, 1, 2], dtype="int32")


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    models.float64_model(root / "f64")
    models.softmax_mlp(root / "softmax64", dtype="float64")
    return root


@pytest.fixture
def client(worker_client):
    return worker_client


def body(**options) -> dict:
    return {"model": {"path": "f64"}, "inputs": {"x": {"shape": [3, 5], "dtype": "float64",
                                                       "data": X.ravel().tolist()}}, **options}


def every_variable_hessian(model_root: Path) -> tuple[np.ndarray, list[str]]:
    """The softmax classifier's loss Hessian over ``variables/*`` (83 parameters) by GradientTape, and the order."""
    from tests.engine.test_matfree import dense
    from worker.engine.matfree import build_operator

    op = build_operator(load_model(str(model_root / "softmax64")), {"x": XS, "labels": LABELS}, of="loss",
                        wrt="variables/*")
    return dense(op)[1], list(op.axis.names)


def test_the_diagonal_by_hutchinson_over_every_variable_with_the_python_client(client, redis_conn, model_root):
    from jacobian.client import JacobianClient

    H, names = every_variable_hessian(model_root)
    with JacobianClient("http://testserver", transport=client._transport) as jc:
        job_id = jc.submit("softmax64", {"x": XS, "labels": LABELS}, of="loss", wrt="variables/*",
                           kind="hessian_diag", probes=60)
        work_burst(redis_conn)
        record = jc.job(job_id)
        assert record.status.value == "succeeded"
        ds = jc.result(job_id, as_xarray=True)
    assert ds.attrs["method"] == "hutchinson" and ds.attrs["probes"] == 60 and ds.attrs["wrt"] == names
    d, se = ds["diagonal"].values, ds["stderr"].values
    assert d.shape == se.shape == (83,) and list(ds["diagonal"].dims) == ["wrt"] and (se > 0).all()
    assert np.all(np.abs(d - np.diag(H)) <= 4 * se), np.max(np.abs(d - np.diag(H)) / se)
    assert record.plan.model_extra["products"]["hvp"] == 60 and record.progress.fraction == 1.0


def test_density_and_logdet_over_http(client, redis_conn, model_root):
    import xarray as xr

    H = tape_hessian(load_model(str(model_root / "f64")), {"x": X}, "loss", "x").reshape(15, 15)
    lam = np.linalg.eigvalsh(H)
    r = client.post("/v1/jobs", json=body(of="loss", wrt="x", kind="spectral_density", probes=4, steps=10, sigma=2.0))
    assert r.status_code == 202, r.text
    record = finished_job(client, redis_conn, r.json()["id"])
    ds = xr.open_zarr(record["result"]["uri"])
    assert record["result"]["shape"] == [512] and ds.attrs["sigma"] == 2.0
    assert ds["nodes"].shape == (4, 10) and list(ds["nodes"].dims) == ["probe", "step"]
    assert "grid" in ds["density"].coords   # the grid is the density's coordinate
    assert float(ds["density"].integrate("grid")) == pytest.approx(1.0, abs=1e-3)
    assert lam.min() - 1e-9 <= np.nanmin(ds["nodes"].values) <= np.nanmax(ds["nodes"].values) <= lam.max() + 1e-9
    picture = client.get(f"/v1/jobs/{record['id']}/preview.png")
    assert picture.status_code == 200 and picture.content.startswith(b"\x89PNG")

    damping = 1.0 - lam.min()
    r = client.post("/v1/jobs", json=body(of="loss", wrt="x", kind="logdet", probes=12, steps=15, damping=damping))
    record = finished_job(client, redis_conn, r.json()["id"])
    ds = xr.open_zarr(record["result"]["uri"])
    value, stderr = float(ds["logdet"]), float(ds["stderr"])
    want = np.linalg.slogdet(H + damping * np.eye(15))[1]
    assert stderr > 0 and abs(value - want) <= 4 * stderr, (value, stderr, want)
    assert ds.attrs["damping"] == damping and ds["logdet"].attrs["stderr_value"] == pytest.approx(stderr)


def test_a_damped_hessian_that_is_not_positive_definite_fails_the_job_naming_damping(client, redis_conn):
    r = client.post("/v1/jobs", json=body(of="loss", wrt="x", kind="logdet", probes=15, steps=15, damping=1.0))
    assert r.status_code == 202, r.text
    work_burst(redis_conn)
    record = client.get(f"/v1/jobs/{r.json()['id']}").json()
    assert record["status"] == "failed" and record["error"]["message"].startswith("damping: H + damping·I is not "
                                                                                 "positive definite"), record


@pytest.mark.parametrize("options,field", [
    ({"of": "y", "kind": "hessian_diag"}, "of"),                                 # a Hessian of a non-scalar output
    ({"of": "loss", "kind": "hessian_diag", "steps": 5}, "steps"),               # steps: the quadrature kinds only
    ({"of": "loss", "kind": "logdet", "sigma": 1.0}, "sigma"),                   # sigma: spectral_density only
    ({"of": "loss", "kind": "spectral_density", "damping": 1.0}, "damping"),     # damping: logdet only
    ({"of": "y", "kind": "svd", "rank": 2, "probes": 5}, "probes"),
    ({"of": "loss", "kind": "logdet", "probes": 1}, "probes"),                   # a standard error needs 2
    ({"of": "loss", "kind": "logdet", "steps": 0}, "steps"),
    ({"of": "loss", "kind": "spectral_density", "sigma": -1.0}, "sigma"),
    ({"of": "loss", "kind": "logdet", "wrt": ["x", "x"]}, "wrt"),
])
def test_refusals_at_post_name_the_field(client, redis_conn, options, field):
    r = client.post("/v1/jobs", json=body(**options))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"].startswith(f"{field}:"), r.json()
    assert redis_conn.llen("rq:queue:jacobian") == 0
