"""The composition matrix: every kind of the registry (``contracts.kinds``) x the capabilities (one ``wrt``, several
``wrt``, ``variables/*``, shards, progress, preview), each cell through the service (POST, a real rq worker in this
process, the status, the result group, preview.png) equal to GradientTape / numpy on a small float64 model, or
refused at POST with a 4xx naming the field: nothing accepted and then failing."""

from __future__ import annotations

import numpy as np
import pytest

from contracts.kinds import KINDS
from tests import models
from tests.conftest import finished_job
from tests.engine.reference import curvature_references, tape_jacobian
from worker.engine import load_model

pytestmark = pytest.mark.integration
X = np.random.default_rng(0).normal(size=(3, 5))
A = np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32)
B = np.random.default_rng(2).normal(size=(2, 3)).astype(np.float32)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    models.float64_model(root / "f64")
    models.multi_io(root / "multi")
    return root


@pytest.fixture
def client(worker_client):
    return worker_client


def f64_body(**options) -> dict:
    return {"model": {"path": "f64"}, "inputs": {"x": {"shape": [3, 5], "dtype": "float64",
                                                       "data": X.ravel().tolist()}}, **options}


def stacked_jacobian(model, inputs: dict, of: str, wrt: list[str]) -> np.ndarray:
    """d of / d (wrt sources flattened and concatenated): ``(n_of, n_wrt)`` by GradientTape."""
    parts = [tape_jacobian(model, inputs, of, w) for w in wrt]
    n_of = int(np.prod(model.fn(**{k: v for k, v in _tensors(inputs).items()})[of].shape))
    return np.concatenate([p.reshape(n_of, -1) for p in parts], axis=1)


def stacked_hessian(model, inputs: dict, of: str, variables: list[str]) -> np.ndarray:
    """The Hessian of ``of`` over the named variables concatenated (cross terms included), by nested tapes."""
    import tensorflow as tf

    targets = [model.variables[v] for v in variables]
    tensors = _tensors(inputs)
    with tf.GradientTape(persistent=True) as outer:
        with tf.GradientTape() as inner:
            y = model.fn(**tensors)[of]
        grads = inner.gradient(y, targets)
        flat = tf.concat([tf.reshape(g, [-1]) for g in grads], axis=0)
    rows = [tf.reshape(outer.jacobian(flat, t), [flat.shape[0], -1]) for t in targets]
    return np.concatenate([np.asarray(r) for r in rows], axis=1)


def _tensors(inputs: dict) -> dict:
    import tensorflow as tf

    return {k: tf.constant(v) for k, v in inputs.items()}


def _result(client, redis_conn, job_id: str) -> tuple[dict, object]:
    import xarray as xr

    record = finished_job(client, redis_conn, job_id)
    assert record["progress"]["fraction"] == 1.0, record["progress"]
    picture = client.get(f"/v1/jobs/{job_id}/preview.png")
    assert picture.status_code == 200 and picture.content.startswith(b"\x89PNG"), picture.text[:200]
    return record, xr.open_zarr(record["result"]["uri"])


# -- several wrt for the dense kinds ----------------------------------------------------------------


@pytest.mark.parametrize("shards", [None, 2])
def test_jacobian_over_an_input_and_a_variable(client, redis_conn, model_root, shards, monkeypatch):
    from contracts.settings import get_settings

    model = load_model(str(model_root / "f64"))
    monkeypatch.setenv("JACOBIAN_BLOCK_BYTES", str(4 * 35 * 8))   # 4 rows a storage block: 3 blocks of 12 rows
    get_settings.cache_clear()
    r = client.post("/v1/jobs", json=f64_body(of="y", wrt=["x", "variables/w"], kind="jacobian", shards=shards,
                                              chunk_rows=5))
    assert r.status_code == 202, r.text
    record, ds = _result(client, redis_conn, r.json()["id"])
    want = stacked_jacobian(model, {"x": X}, "y", ["x", "variables/w"])
    got = ds["jacobian"].values
    assert got.shape == (3, 4, 35) and record["result"]["shape"] == [3, 4, 35]
    np.testing.assert_allclose(got.reshape(12, 35), want, rtol=1e-9, atol=1e-12)
    assert ds.attrs["wrt_slices"]["variables/w"] == {"start": 15, "stop": 35, "shape": [5, 4]}
    assert list(ds["jacobian"].dims) == ["of_0", "of_1", "wrt"]
    assert record["plan"]["shards"] == (shards or 1)


@pytest.mark.parametrize("batch,route", [(6, "sparse"), (3, "dense")])
def test_sparsity_in_shards(client, redis_conn, model_root, monkeypatch, batch, route):
    """``sparsity`` x shards: 6 independent examples make J 1/6 dense (the sparse route, 4 row colours, split on
    colour blocks); 3 make it 1/3 dense, over what pays as COO (the dense route, split on rows)."""
    import scipy.sparse as sp

    from contracts.settings import get_settings

    model = load_model(str(model_root / "f64"))
    x = np.random.default_rng(5).normal(size=(batch, 5))
    monkeypatch.setenv("JACOBIAN_BLOCK_BYTES", str(2 * 30 * 8))   # 2 colours (or 4 rows of 3 examples) a block
    get_settings.cache_clear()
    body = {**f64_body(of="y", wrt="x", sparsity="auto", shards=2),
            "inputs": {"x": {"shape": [batch, 5], "dtype": "float64", "data": x.ravel().tolist()}}}
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    record = finished_job(client, redis_conn, r.json()["id"])
    want = tape_jacobian(model, {"x": x}, "y", "x").reshape(batch * 4, batch * 5)
    plan = record["plan"]
    assert plan["shards"] == 2 and (plan["strategy"] == "sparse") == (route == "sparse"), plan
    if route == "sparse":
        assert plan["sparsity"]["verified"] is True and plan["sparsity"]["colors"] == 4, plan
        group = zarr_group(record["result"]["uri"])
        got = sp.coo_array((group["values"][...], (group["rows"][...], group["cols"][...])),
                           shape=tuple(group.attrs["shape"])).toarray()
    else:
        assert plan["sparsity"]["fallback"].startswith("dense: the pattern holds 33.3%"), plan
        got = zarr_group(record["result"]["uri"])["jacobian"][...].reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def zarr_group(uri: str):
    import zarr

    return zarr.open_group(uri, mode="r")


def test_jacobian_forward_mode_over_several_sources(client, redis_conn, model_root):
    model = load_model(str(model_root / "f64"))
    r = client.post("/v1/jobs", json=f64_body(of="loss", wrt=["x", "variables/b"], kind="jacobian", mode="forward"))
    assert r.status_code == 202, r.text
    record, ds = _result(client, redis_conn, r.json()["id"])
    want = stacked_jacobian(model, {"x": X}, "loss", ["x", "variables/b"])
    np.testing.assert_allclose(ds["jacobian"].values.reshape(1, 19), want, rtol=1e-9, atol=1e-12)
    assert record["plan"]["mode"] == "forward"


def test_hessian_over_every_variable(client, redis_conn, model_root):
    model = load_model(str(model_root / "f64"))
    r = client.post("/v1/jobs", json=f64_body(of="loss", wrt="variables/*", kind="hessian"))
    assert r.status_code == 202, r.text
    record, ds = _result(client, redis_conn, r.json()["id"])
    names = [n.split("/", 1)[1] for n in ds.attrs["wrt"]]
    assert sorted(names) == ["b", "w"]
    want = stacked_hessian(model, {"x": X}, "loss", names)
    np.testing.assert_allclose(ds["jacobian"].values, want, rtol=1e-9, atol=1e-12)
    assert list(ds["jacobian"].dims) == ["wrt", "wrt2"]


def test_batch_jacobian_over_two_inputs(client, redis_conn, model_root):
    model = load_model(str(model_root / "multi"))
    inputs = {"a": {"shape": [2, 4], "dtype": "float32", "data": A.ravel().tolist()},
              "b": {"shape": [2, 3], "dtype": "float32", "data": B.ravel().tolist()}}
    r = client.post("/v1/jobs", json={"model": {"path": "multi"}, "inputs": inputs, "of": "v", "wrt": ["a", "b"],
                                      "kind": "batch_jacobian"})
    assert r.status_code == 202, r.text
    _, ds = _result(client, redis_conn, r.json()["id"])
    ja = tape_jacobian(model, {"a": A, "b": B}, "v", "a", batch=True)   # (2, 3, 4)
    jb = tape_jacobian(model, {"a": A, "b": B}, "v", "b", batch=True)   # (2, 3, 3)
    np.testing.assert_allclose(ds["jacobian"].values, np.concatenate([ja, jb], axis=2), rtol=2e-5, atol=2e-6)
    assert list(ds["jacobian"].dims) == ["batch", "of_1", "wrt"]


@pytest.mark.parametrize("options,field", [
    ({"kind": "batch_jacobian", "of": "y", "wrt": ["x", "variables/w"]}, "wrt"),   # a variable has no batch axis
    ({"kind": "hessian", "of": "y", "wrt": ["x", "variables/w"]}, "of"),            # a Hessian of a non-scalar
    ({"kind": "jacobian", "of": "y", "wrt": ["x", "x"]}, "wrt"),                    # a source named twice
    ({"kind": "jacobian", "of": "y", "wrt": ["x", "variables/nope"]}, "wrt"),       # an unknown variable
    ({"kind": "jacobian", "of": "y", "wrt": ["x", "variables/w"], "sparsity": "auto"}, "sparsity"),
])
def test_refused_at_post(client, redis_conn, model_root, options, field):
    r = client.post("/v1/jobs", json=f64_body(**options))
    assert r.status_code in (400, 422), r.text
    error = r.json()["error"]
    assert field in error["message"].split(":")[0] or error.get("field") == field, error
    assert redis_conn.llen("rq:queue:jacobian") == 0


# -- every kind of the registry ---------------------------------------------------------------------

SEEDS_WRT = np.random.default_rng(3).normal(size=(2, 3, 5))
SEEDS_OF = np.random.default_rng(4).normal(size=(2, 3, 4))
EVERY_KIND = {
    "jacobian": {"of": "y", "wrt": "x"},
    "batch_jacobian": {"of": "y", "wrt": "x"},
    "hessian": {"of": "loss", "wrt": "x"},
    "jvp": {"of": "y", "wrt": "x", "seeds": SEEDS_WRT},
    "vjp": {"of": "y", "wrt": "x", "seeds": SEEDS_OF},
    "hvp": {"of": "loss", "wrt": "x", "seeds": SEEDS_WRT},
    "svd": {"of": "y", "wrt": "x", "rank": 2, "tol": 1e-8},
    "hessian_eig": {"of": "loss", "wrt": "x", "rank": 2, "tol": 1e-8},
    "hessian_trace": {"of": "loss", "wrt": "x", "samples": 15},
    "ggn_vp": {"of": "y", "wrt": "x", "loss": "mse", "seeds": SEEDS_WRT},
    "fisher_vp": {"of": "y", "wrt": "x", "loss": "mse", "labels": "t", "seeds": SEEDS_WRT},
    "ggn_eig": {"of": "y", "wrt": "x", "loss": "sigmoid_cross_entropy", "rank": 2, "tol": 1e-8},
    "ggn_trace": {"of": "y", "wrt": "x", "loss": "softmax_cross_entropy", "samples": 15},
    "ihvp": {"of": "y", "wrt": "x", "curvature": "ggn", "loss": "mse", "damping": 0.1, "tol": 1e-10,
             "seeds": SEEDS_WRT},
    "hessian_diag": {"of": "loss", "wrt": "x", "probes": 15},
    "ggn_diag": {"of": "y", "wrt": "x", "loss": "mse", "probes": 15},
    "spectral_density": {"of": "loss", "wrt": "x", "probes": 15, "steps": 15},
    "logdet": {"of": "loss", "wrt": "x", "probes": 15, "steps": 15, "damping": 200.0},
}
T = np.random.default_rng(6).normal(size=(3, 4))   # fisher_vp's labels: the input "t", which the signature lacks


def test_the_matrix_covers_every_kind():
    assert set(EVERY_KIND) == set(KINDS)


@pytest.mark.parametrize("kind", sorted(EVERY_KIND))
def test_every_kind_succeeds_with_progress_plan_and_preview(client, redis_conn, model_root, kind):
    from tests.engine.reference import tape_hessian

    model = load_model(str(model_root / "f64"))
    options = dict(EVERY_KIND[kind])
    seeds = options.pop("seeds", None)
    if seeds is not None:
        options["seeds"] = {"shape": list(seeds.shape), "dtype": "float64", "data": seeds.ravel().tolist()}
    body = f64_body(kind=kind, **options)
    if "labels" in options:
        body["inputs"]["t"] = {"shape": [3, 4], "dtype": "float64", "data": T.ravel().tolist()}
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    record, ds = _result(client, redis_conn, r.json()["id"])
    assert record["plan"], record
    J = tape_jacobian(model, {"x": X}, "y", "x").reshape(12, 15)
    H = tape_hessian(model, {"x": X}, "loss", "x").reshape(15, 15)
    y = np.asarray(model.fn(x=_tensors({"x": X})["x"])["y"])
    loss = options.get("loss", "mse")
    labels = np.exp(T) / np.exp(T).sum(axis=1, keepdims=True) if loss == "softmax_cross_entropy" else T
    G, F, _ = curvature_references(J, y, loss, labels)   # G of these losses does not depend on the labels
    main = KINDS[kind].main_array
    got = np.asarray(ds[main].values)
    want = {"jacobian": J, "batch_jacobian": tape_jacobian(model, {"x": X}, "y", "x", batch=True), "hessian": H,
            "jvp": SEEDS_WRT.reshape(2, 15) @ J.T, "vjp": SEEDS_OF.reshape(2, 12) @ J,
            "hvp": SEEDS_WRT.reshape(2, 15) @ H, "svd": np.linalg.svd(J, compute_uv=False)[:2],
            "hessian_eig": sorted(np.linalg.eigvalsh(H), key=abs, reverse=True)[:2], "hessian_trace": np.trace(H),
            "ggn_vp": SEEDS_WRT.reshape(2, 15) @ G, "fisher_vp": SEEDS_WRT.reshape(2, 15) @ F,
            "ggn_eig": sorted(np.linalg.eigvalsh(G), key=abs, reverse=True)[:2], "ggn_trace": np.trace(G),
            "ihvp": np.linalg.solve(G + 0.1 * np.eye(15), SEEDS_WRT.reshape(2, 15).T).T,
            "hessian_diag": np.diag(H), "ggn_diag": np.diag(G), "logdet": np.linalg.slogdet(H + 200.0 * np.eye(15))[1],
            "spectral_density": None}[kind]
    if want is None:   # the density: the eigenvalues smoothed on the result's grid (unit start vectors: exact)
        grid, sigma = ds["grid"].values, ds.attrs["sigma"]
        z = (grid[:, None] - np.linalg.eigvalsh(H)[None]) / sigma
        want = np.exp(-0.5 * z * z).sum(axis=1) / (15 * sigma * np.sqrt(2 * np.pi))
    np.testing.assert_allclose(got.reshape(np.shape(want)), want, rtol=1e-7, atol=1e-10)
