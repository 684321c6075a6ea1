"""``.keras`` files as model paths through the service: the signature endpoint reads their config (no
TensorFlow in the API), every kind of the registry on them (POST, a real rq worker in this process) equals
GradientTape on the Keras model itself, a class that is not known is a 4xx naming it, a Lambda layer is refused."""

from __future__ import annotations

import numpy as np
import pytest

from tests import keras_models
from tests.conftest import finished_job, tensor
from tests.engine.reference import curvature_references

pytestmark = pytest.mark.integration
X = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
Z = np.random.default_rng(1).normal(size=(4, 2)).astype(np.float32)
SEEDS = np.random.default_rng(2).normal(size=(2, 4, 3)).astype(np.float32)
TOL = {"rtol": 2e-5, "atol": 2e-5}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("keras-models")
    models = {name: getattr(keras_models, name)(root / f"{name}.keras")
              for name in ("functional", "multi", "custom_layer", "lambda_layer")}
    return root, models


@pytest.fixture(scope="module")
def model_root(built):
    return built[0]


@pytest.fixture
def keras_model(built):
    return built[1]



def tape(model, inputs: dict, of: str, wrt: str, how: str) -> np.ndarray:
    """d of / d wrt on the Keras model itself: ``jacobian``, ``batch_jacobian`` or ``hessian``."""
    import tensorflow as tf

    tensors = {k: tf.constant(v) for k, v in inputs.items()}

    def call() -> dict:   # the model as Keras calls it, its outputs by name
        out = model([tensors["x"], tensors["z"]] if "z" in tensors else tensors["x"])
        return out if isinstance(out, dict) else dict(zip(model.output_names, tf.nest.flatten(out)))

    if how == "hessian":
        with tf.GradientTape() as outer:
            outer.watch(tensors[wrt])
            with tf.GradientTape() as inner:
                inner.watch(tensors[wrt])
                y = call()[of]
            g = inner.gradient(y, tensors[wrt])
        return outer.jacobian(g, tensors[wrt]).numpy()
    with tf.GradientTape(persistent=True) as t:
        t.watch(tensors[wrt])
        y = call()[of]
    return (t.batch_jacobian if how == "batch_jacobian" else t.jacobian)(y, tensors[wrt]).numpy()


def tape_value(model, x: np.ndarray, of: str) -> np.ndarray:
    out = model(x)
    return np.asarray((out if isinstance(out, dict) else dict(zip(model.output_names, [out])))[of])


def test_signature_lists_inputs_and_outputs(client):
    r = client.get("/v1/models/signature", params={"path": "multi.keras"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["inputs"] == {"x": {"dtype": "float32", "shape": [None, 3]},
                              "z": {"dtype": "float32", "shape": [None, 2]}}
    assert set(body["outputs"]) == {"a", "b"} and body["signatures"] == ["serving_default"]
    functional = client.get("/v1/models/signature", params={"path": "functional.keras"}).json()
    assert set(functional["inputs"]) == {"x"} and set(functional["outputs"]) == {"y", "loss"}


def test_lambda_layer_refused(client, redis_conn):
    for r in (client.get("/v1/models/signature", params={"path": "lambda_layer.keras"}),
              client.post("/v1/jobs", json={"model": {"path": "lambda_layer.keras"}, "inputs": {"x": tensor(X)}})):
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert "Lambda layer 'double'" in error["message"] and "JACOBIAN_KERAS_UNSAFE_ROOTS" in error["message"]
    assert redis_conn.llen("rq:queue:jacobian") == 0


def test_missing_custom_class_refused_at_post(client, redis_conn):
    r = client.post("/v1/jobs", json={"model": {"path": "custom_layer.keras"}, "inputs": {"x": tensor(X)}})
    assert r.status_code == 422, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("model.path: ") and "'jt>Scale'" in message and "JACOBIAN_KERAS_CUSTOM_OBJECTS" in message
    assert redis_conn.llen("rq:queue:jacobian") == 0


CASES = {   # kind: (model, inputs, options)
    "jacobian": ("functional", {"x": X}, {"of": "y", "wrt": "x"}),
    "batch_jacobian": ("functional", {"x": X}, {"of": "y", "wrt": "x"}),
    "hessian": ("functional", {"x": X}, {"of": "loss", "wrt": "x"}),
    "jvp": ("functional", {"x": X}, {"of": "y", "wrt": "x", "seeds": tensor(SEEDS)}),
    "sparsity": ("functional", {"x": X}, {"of": "y", "wrt": "x", "sparsity": "auto"}),
    "multi": ("multi", {"x": X, "z": Z}, {"of": "b", "wrt": "z"}),
}


SEEDS_OF = np.random.default_rng(3).normal(size=(2, 4, 2)).astype(np.float32)
LABELS = np.random.default_rng(4).normal(size=(4, 2)).astype(np.float32)   # fisher_vp's labels, y's shape
MORE = {   # the other kinds of the registry on functional.keras
    "vjp": {"of": "y", "wrt": "x", "seeds": tensor(SEEDS_OF)},
    "hvp": {"of": "loss", "wrt": "x", "seeds": tensor(SEEDS)},
    "svd": {"of": "y", "wrt": "x", "rank": 2, "tol": 1e-6},
    "hessian_eig": {"of": "loss", "wrt": "x", "rank": 2, "tol": 1e-6},
    "hessian_trace": {"of": "loss", "wrt": "x", "samples": 40},
    "hessian_diag": {"of": "loss", "wrt": "x", "probes": 12},
    "spectral_density": {"of": "loss", "wrt": "x", "probes": 12, "steps": 12},
    "logdet": {"of": "loss", "wrt": "x", "probes": 12, "steps": 12, "damping": 100.0},
    "ggn_vp": {"of": "y", "wrt": "x", "loss": "mse", "seeds": tensor(SEEDS)},
    "fisher_vp": {"of": "y", "wrt": "x", "loss": "mse", "labels": "t", "seeds": tensor(SEEDS),
                  "inputs": {"x": tensor(X), "t": tensor(LABELS)}},
    "ggn_eig": {"of": "y", "wrt": "x", "loss": "mse", "rank": 2, "tol": 1e-6},
    "ggn_trace": {"of": "y", "wrt": "x", "loss": "mse", "samples": 40},
    "ggn_diag": {"of": "y", "wrt": "x", "loss": "mse", "probes": 12},
    "ihvp": {"of": "loss", "wrt": "x", "damping": 100.0, "seeds": tensor(SEEDS), "tol": 1e-6},
}


def test_every_kind_is_covered():
    from contracts.kinds import KINDS

    assert set(KINDS) == {"jacobian", "batch_jacobian", "hessian", "jvp"} | set(MORE)


@pytest.mark.parametrize("kind", sorted(MORE))
def test_other_kinds_equal_gradient_tape(worker_client, redis_conn, keras_model, kind):
    import xarray as xr

    from contracts.kinds import KINDS

    r = worker_client.post("/v1/jobs", json={"model": {"path": "functional.keras"}, "kind": kind,
                                             "inputs": {"x": tensor(X)}, **MORE[kind]})   # fisher_vp: its inputs
    assert r.status_code == 202, r.text
    record = finished_job(worker_client, redis_conn, r.json()["id"])
    ds = xr.open_zarr(record["result"]["uri"])
    got = np.asarray(ds[KINDS[kind].main_array].values)
    model = keras_model["functional"]
    J = tape(model, {"x": X}, "y", "x", "jacobian").reshape(8, 12)
    H = tape(model, {"x": X}, "loss", "x", "hessian").reshape(12, 12)
    G, F, _ = curvature_references(J, tape_value(model, X, "y"), "mse", LABELS)
    want = {"vjp": SEEDS_OF.reshape(2, 8) @ J, "hvp": SEEDS.reshape(2, 12) @ H,
            "ggn_vp": SEEDS.reshape(2, 12) @ G, "fisher_vp": SEEDS.reshape(2, 12) @ F,
            "ggn_eig": sorted(np.linalg.eigvalsh(G), key=abs, reverse=True)[:2], "ggn_trace": np.trace(G),
            "ggn_diag": np.diag(G), "ihvp": np.linalg.solve(H + 100.0 * np.eye(12), SEEDS.reshape(2, 12).T).T,
            "svd": np.linalg.svd(J, compute_uv=False)[:2],
            "hessian_eig": sorted(np.linalg.eigvalsh(H), key=abs, reverse=True)[:2],
            "hessian_trace": np.trace(H), "hessian_diag": np.diag(H),
            "logdet": np.linalg.slogdet(H + 100.0 * np.eye(12))[1], "spectral_density": None}[kind]
    if want is None:   # the eigenvalues smoothed on the result's grid (unit start vectors: exact)
        z = (ds["grid"].values[:, None] - np.linalg.eigvalsh(H)[None]) / ds.attrs["sigma"]
        want = np.exp(-0.5 * z * z).sum(axis=1) / (12 * ds.attrs["sigma"] * np.sqrt(2 * np.pi))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * want.max())   # float32 Ritz values
        return
    np.testing.assert_allclose(got.reshape(np.shape(want)), want, **TOL)


@pytest.mark.parametrize("case", sorted(CASES))
def test_kinds_equal_gradient_tape_on_the_keras_model(worker_client, redis_conn, keras_model, case):
    import xarray as xr

    name, inputs, options = CASES[case]
    kind = case if case in ("batch_jacobian", "hessian", "jvp") else "jacobian"
    r = worker_client.post("/v1/jobs", json={"model": {"path": f"{name}.keras"}, "kind": kind,
                                             "inputs": {k: tensor(v) for k, v in inputs.items()}, **options})
    assert r.status_code == 202, r.text
    record = finished_job(worker_client, redis_conn, r.json()["id"])
    ds = xr.open_zarr(record["result"]["uri"])
    model = keras_model[name]
    if kind == "jvp":
        J = tape(model, inputs, "y", "x", "jacobian").reshape(8, 12)
        want = SEEDS.reshape(2, 12) @ J.T
        got = np.asarray(ds["products"].values).reshape(want.shape)
    else:
        want = tape(model, inputs, options["of"], options["wrt"], kind)
        got = np.asarray(ds["jacobian"].values).reshape(want.shape)
    np.testing.assert_allclose(got, want, **TOL)
    if case == "sparsity":
        assert record["plan"]["sparsity"]["nnz"] == 4 * 2 * 3, record["plan"]   # one row of x per row of y


def test_custom_layer_through_the_setting(worker_env, redis_conn, keras_model, monkeypatch):
    """With JACOBIAN_KERAS_CUSTOM_OBJECTS naming tests.keras_custom, POST accepts the model and the worker loads it."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    worker_env(1 << 20, KERAS_CUSTOM_OBJECTS="tests.keras_custom")
    with TestClient(create_app()) as client:
        r = client.post("/v1/jobs", json={"model": {"path": "custom_layer.keras"}, "inputs": {"x": tensor(X)},
                                          "of": "s", "wrt": "x"})
        assert r.status_code == 202, r.text
        record = finished_job(client, redis_conn, r.json()["id"])
    import xarray as xr

    got = np.asarray(xr.open_zarr(record["result"]["uri"])["jacobian"].values)
    want = tape(keras_model["custom_layer"], {"x": X}, "s", "x", "jacobian")
    np.testing.assert_allclose(got.reshape(want.shape), want, **TOL)


def test_missing_custom_class_refused_at_the_worker(worker_env, redis_conn, monkeypatch):
    """POST accepts the model (a custom objects module is set), the worker's module lacks the class: the job
    fails as InvalidRequest naming the class and the setting."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from contracts.jobstore import JobStore
    from tests.conftest import work_burst
    from worker.model_cache import get_model_cache

    get_model_cache().clear()   # loaded by an earlier test under another setting
    worker_env(1 << 20, KERAS_CUSTOM_OBJECTS="tests.keras_models")   # defines no custom class
    with TestClient(create_app()) as client:
        r = client.post("/v1/jobs", json={"model": {"path": "custom_layer.keras"}, "inputs": {"x": tensor(X)},
                                          "of": "s", "wrt": "x"})
        assert r.status_code == 202, r.text
        work_burst(redis_conn)
        record = JobStore(redis_conn).get(r.json()["id"])
    assert record.status.value == "failed", record
    assert record.error.type == "InvalidRequest", record.error
    assert "'jt>Scale'" in record.error.message and "JACOBIAN_KERAS_CUSTOM_OBJECTS" in record.error.message


def test_lambda_layer_runs_where_the_operator_turned_safe_mode_off(worker_env, redis_conn, model_root):
    from fastapi.testclient import TestClient

    from app.main import create_app

    worker_env(1 << 20, KERAS_UNSAFE_ROOTS=str(model_root))
    with TestClient(create_app()) as client:
        r = client.post("/v1/jobs", json={"model": {"path": "lambda_layer.keras"}, "inputs": {"x": tensor(X)}})
        assert r.status_code == 202, r.text
        record = finished_job(client, redis_conn, r.json()["id"])
    import xarray as xr

    got = np.asarray(xr.open_zarr(record["result"]["uri"])["jacobian"].values).reshape(12, 12)
    np.testing.assert_allclose(got, 2.0 * np.eye(12), **TOL)


@pytest.mark.parametrize("content", [b"not a zip", b"PK\x05\x06" + bytes(18)])
def test_a_file_that_is_not_a_keras_zip_is_a_4xx(client, model_root, content):
    (model_root / "broken.keras").write_bytes(content)
    for r in (client.get("/v1/models/signature", params={"path": "broken.keras"}),
              client.post("/v1/jobs", json={"model": {"path": "broken.keras"}, "inputs": {"x": tensor(X)}})):
        assert r.status_code == 422, r.text
        assert "not a readable .keras file" in r.json()["error"]["message"], r.text
