"""The curvature kinds (issue 27) against dense references on models small enough to form them: ``ggn_vp``,
``fisher_vp``, ``ggn_eig``, ``ggn_trace`` and ``ihvp`` (Hessian and Gauss-Newton), float32 and float64, ``wrt`` an
input, a variable, a list and ``variables/*``.

The references share nothing with the engine's formulas: J by ``GradientTape.jacobian`` over the same sources
(concatenated by the test), the loss' Hessian w.r.t. the outputs by nested tapes over TensorFlow's own losses
(``tf.nn.*_cross_entropy_with_logits``, the squared error) reduced as Keras reduces them (checked against the Keras
loss objects), the per-example gradients by a tape Jacobian of the per-example losses, H by nested tapes, then
numpy's ``eigh``, ``trace`` and ``solve``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from tests import models
from tests.engine.conftest import loader
from tests.engine.reference import curvature_references

RNG = np.random.default_rng(11)
X6 = RNG.standard_normal((4, 6)).astype("float32")
IDS = np.array([0, 2, 1, 2], dtype="int32")
XF64 = RNG.standard_normal((3, 5))
X8 = RNG.standard_normal((3, 8)).astype("float32")


@dataclass(frozen=True)
class Case:
    model: str
    of: str
    wrt: object
    loss: str
    labels: str   # how the labels are given: "ids" (class ids), "onehot", "probs", "targets"

    @property
    def id(self) -> str:
        wrt = "+".join(self.wrt) if isinstance(self.wrt, list) else self.wrt
        return f"{self.model}-{wrt}-{self.loss}-{self.labels}"


CASES = [
    Case("softmax32", "logits", "x", "softmax_cross_entropy", "ids"),                    # float32, an input
    Case("softmax64", "logits", "variables/w0", "softmax_cross_entropy", "onehot"),     # float64, a variable
    Case("softmax32", "logits", "variables/*", "sigmoid_cross_entropy", "probs"),       # float32, every variable
    Case("float64", "y", ["x", "variables/w"], "mse", "targets"),                       # float64, input + variable
    Case("mlp", "y", "variables/*", "mse", "targets"),                                  # float32 Keras, every variable
    Case("softmax64", "logits", "variables/*", "softmax_cross_entropy", "probs"),       # float64, soft labels
]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("curvature")
    paths = {"softmax32": models.softmax_mlp(root / "softmax32"),
             "softmax64": models.softmax_mlp(root / "softmax64", dtype="float64"),
             "float64": models.float64_model(root / "float64"), "mlp": models.mlp(root / "mlp")}
    return loader(paths)


def inputs_of(name: str) -> dict[str, np.ndarray]:
    return {"softmax32": {"x": X6, "labels": IDS}, "softmax64": {"x": X6.astype("float64"), "labels": IDS},
            "float64": {"x": XF64}, "mlp": {"x": X8}}[name]


def labels_of(case: Case, y_shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(3)
    if case.labels == "ids":
        return IDS
    if case.labels == "onehot":
        return np.eye(y_shape[-1])[IDS]
    if case.labels == "probs":
        p = rng.uniform(0.05, 1.0, size=y_shape)
        return p / p.sum(axis=-1, keepdims=True) if case.loss == "softmax_cross_entropy" else p
    return rng.standard_normal(y_shape)


def keras_loss(loss: str, labels: np.ndarray):
    import keras

    if loss == "mse":
        return keras.losses.MeanSquaredError()
    if loss == "sigmoid_cross_entropy":
        return keras.losses.BinaryCrossentropy(from_logits=True)
    if labels.dtype.kind in "iu":
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return keras.losses.CategoricalCrossentropy(from_logits=True)


@dataclass
class Dense:
    op: object
    labels: np.ndarray
    ggn: np.ndarray      # (n_wrt, n_wrt)
    fisher: np.ndarray   # (n_wrt, n_wrt)


def dense(op, case: Case) -> Dense:
    import tensorflow as tf

    targets = op.axis.targets(op.model, op.inputs)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(targets)
        y = op.model.fn(**op.inputs)[op.of]
        flat = tf.reshape(y, [-1])
    jac = np.concatenate([np.asarray(j, np.float64).reshape(op.n_of, -1)
                          for j in tape.jacobian(flat, targets, unconnected_gradients="zero")], axis=1)
    labels = labels_of(case, tuple(y.shape))
    ggn, fisher, total = curvature_references(jac, np.asarray(y), case.loss, labels)
    t = labels if labels.dtype.kind in "iu" else labels.astype(np.float64)
    keras_value = float(keras_loss(case.loss, labels)(t, np.asarray(y, np.float64)))
    np.testing.assert_allclose(total, keras_value, rtol=1e-6)                 # the losses are Keras'
    return Dense(op, labels, ggn, fisher)


@pytest.fixture(scope="module")
def built(loaded):
    from worker.engine.curvature import loss_curvature, middles
    from worker.engine.matfree import build_operator

    cache: dict[str, Dense] = {}

    def get(case: Case) -> Dense:
        if case.id not in cache:
            op = build_operator(loaded(case.model), inputs_of(case.model), of=case.of, wrt=case.wrt)
            ref = dense(op, case)
            op.middles = middles(loss_curvature(op, case.loss, ref.labels))
            cache[case.id] = ref
        return cache[case.id]
    return get


def rtol(op) -> float:
    return 1e-5 if op.compute_dtype == "float32" else 1e-10


def rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("kind", ["ggn_vp", "fisher_vp"])
def test_products_equal_the_dense_matrix_times_the_seeds(built, case, kind):
    from worker.engine.matfree import run_products

    ref = built(case)
    op = ref.op
    seeds = np.random.default_rng(5).standard_normal((3, op.n_wrt)).astype(op.compute_dtype)
    before = dict(op.counts)
    result = run_products(op, kind, seeds)
    want = seeds.astype(np.float64) @ (ref.ggn if kind == "ggn_vp" else ref.fisher)
    got = np.asarray(result.arrays["products"], np.float64).reshape(3, -1)
    assert result.arrays["products"].dtype == np.dtype(op.dtype)
    assert rel(got, want) < rtol(op), (rel(got, want), case.id)
    assert op.counts[kind] - before.get(kind, 0) == 3
    assert op.counts["jvp"] - before["jvp"] >= 3 and op.counts["vjp"] - before["vjp"] >= 3   # one JVP, one VJP each
    assert op.counts["hvp"] == before["hvp"]    # never a second backward pass over the model


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.id)
def test_ggn_eig_finds_the_largest_eigenpairs(built, case):
    from worker.engine import spectra

    ref = built(case)
    op = ref.op
    result = spectra.spectral(op, "ggn_eig", rank=3, tol=1e-6, loss=case.loss)
    values = np.linalg.eigvalsh(ref.ggn)
    want = np.array(sorted(values, key=abs, reverse=True)[:3])
    got = np.asarray(result.arrays["eigenvalues"], np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4 if op.compute_dtype == "float32" else 1e-8,
                               atol=1e-6 * abs(want[0]))
    vectors = np.asarray(result.arrays["eigenvectors"], np.float64)
    assert np.linalg.norm(vectors @ ref.ggn - vectors * got[:, None], axis=1).max() < 1e-3 * abs(want[0])
    assert result.kind == "ggn_eig" and result.converged
    assert result.products["ggn_vp"] > 0 and result.products["hvp"] == 0


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.id)
def test_ggn_trace_exact_and_estimated(built, case):
    from worker.engine import spectra

    ref = built(case)
    op = ref.op
    exact = spectra.spectral(op, "ggn_trace", samples=op.n_wrt, loss=case.loss)
    assert exact.method == "exact" and float(exact.arrays["stderr"]) == 0.0
    np.testing.assert_allclose(float(exact.arrays["trace"]), np.trace(ref.ggn), rtol=1e-5)
    estimate = spectra.spectral(op, "ggn_trace", samples=60, loss=case.loss, seed=1, method="hutchinson")
    err = abs(float(estimate.arrays["trace"]) - np.trace(ref.ggn))
    assert err <= 4 * float(estimate.arrays["stderr"]) + 1e-5 * abs(np.trace(ref.ggn)), (err, estimate.attrs)


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.id)
def test_ggn_diag_exact_and_estimated(built, case):
    """``ggn_diag``: diag(G) exact by unit-vector G v products, Hutchinson's within 4 standard errors."""
    from worker.engine import spectra

    ref = built(case)
    op = ref.op
    want = np.diag(ref.ggn)
    exact = spectra.spectral(op, "ggn_diag", probes=op.n_wrt, loss=case.loss)
    assert exact.method == "exact" and not np.any(exact.arrays["stderr"])
    assert exact.products["ggn_vp"] > 0 and exact.products["hvp"] == 0
    np.testing.assert_allclose(np.asarray(exact.arrays["diagonal"], np.float64).ravel(), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())
    estimate = spectra.spectral(op, "ggn_diag", probes=80, loss=case.loss, seed=2, method="hutchinson")
    got = np.asarray(estimate.arrays["diagonal"], np.float64).ravel()
    stderr = np.asarray(estimate.arrays["stderr"], np.float64).ravel()
    assert estimate.method == "hutchinson" and np.all(stderr > 0)
    assert np.all(np.abs(got - want) <= 4 * stderr + 1e-5 * np.abs(want).max()), (got - want, stderr)


@pytest.mark.parametrize("case", CASES[:5], ids=lambda c: c.id)
def test_ihvp_of_the_gauss_newton_matrix_solves_the_damped_system(built, case):
    from worker.engine import spectra

    ref = built(case)
    op = ref.op
    seeds = np.random.default_rng(9).standard_normal((4, op.n_wrt))
    seeds[2] = 0.0                                    # a zero seed: solved by zero, residual 0
    damping, tol = 0.05, 1e-5 if op.compute_dtype == "float32" else 1e-9
    result = spectra.spectral(op, "ihvp", seeds=seeds, damping=damping, curvature="ggn", loss=case.loss, tol=tol)
    a = ref.ggn + damping * np.eye(op.n_wrt)
    want = np.linalg.solve(a, seeds.T).T
    got = np.asarray(result.arrays["solutions"], np.float64)
    true = np.linalg.norm(got @ a - seeds, axis=1) / np.maximum(np.linalg.norm(seeds, axis=1), 1e-300)
    assert np.all(result.arrays["residuals"] <= tol) and np.all(true[[0, 1, 3]] <= 10 * tol), true
    assert rel(got, want) < (1e-4 if op.compute_dtype == "float32" else 1e-7)
    assert result.arrays["iterations"][2] == 0 and np.all(got[2] == 0)
    assert result.products["ggn_vp"] > 0 and result.products["hvp"] == 0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_ihvp_of_the_hessian(loaded, dtype):
    """H of the classifier's mean loss over every variable, damped past its most negative eigenvalue."""
    from worker.engine import spectra
    from worker.engine.matfree import build_operator

    name = "softmax32" if dtype == "float32" else "softmax64"
    op = build_operator(loaded(name), inputs_of(name), of="loss", wrt="variables/*")
    eye = np.eye(op.n_wrt)
    h = np.asarray(op.hvp(eye.astype(op.compute_dtype)), np.float64)
    h = (h + h.T) / 2
    damping = abs(min(np.linalg.eigvalsh(h).min(), 0.0)) + 0.1
    seeds = np.random.default_rng(2).standard_normal((3, op.n_wrt))
    tol = 1e-5 if dtype == "float32" else 1e-10
    result = spectra.spectral(op, "ihvp", seeds=seeds, damping=damping, tol=tol)
    want = np.linalg.solve(h + damping * eye, seeds.T).T
    assert rel(np.asarray(result.arrays["solutions"], np.float64), want) < (1e-4 if dtype == "float32" else 1e-8)
    assert np.all(result.residuals <= tol)
    assert result.attrs["curvature"] == "hvp" and result.products["hvp"] > 0


def test_ihvp_fails_loudly(loaded):
    """Too few iterations: NotConverged naming max_iterations and the residuals; an indefinite H with a small
    damping: NotPositiveDefinite naming damping."""
    from worker.engine import spectra
    from worker.engine.errors import NotConverged, NotPositiveDefinite
    from worker.engine.matfree import build_operator

    op = build_operator(loaded("softmax64"), inputs_of("softmax64"), of="loss", wrt="variables/*")
    seeds = np.random.default_rng(2).standard_normal((2, op.n_wrt))
    with pytest.raises(NotConverged) as err:
        spectra.spectral(op, "ihvp", seeds=seeds, damping=10.0, max_iterations=2, tol=1e-10)
    assert err.value.field == "max_iterations" and "seed 0:" in str(err.value) and "raise damping" in str(err.value)
    with pytest.raises(NotPositiveDefinite) as err:
        spectra.spectral(op, "ihvp", seeds=seeds, damping=1e-6, max_iterations=500)
    assert err.value.field == "damping" and "not positive definite" in str(err.value)


def test_labels_are_checked_on_the_concrete_tensors(loaded):
    from worker.engine.curvature import loss_curvature
    from worker.engine.errors import InvalidRequest
    from worker.engine.matfree import build_operator

    op = build_operator(loaded("softmax32"), inputs_of("softmax32"), of="logits", wrt="x")
    with pytest.raises(InvalidRequest, match="class id 3") as err:
        loss_curvature(op, "softmax_cross_entropy", np.array([0, 1, 3, 2], "int32")).fisher(np.ones((1, 12)))
    assert err.value.field == "labels"
    with pytest.raises(InvalidRequest, match="shape") as err:
        loss_curvature(op, "mse", np.zeros((4, 2)))
    assert err.value.field == "labels"
    loss_op = build_operator(loaded("softmax32"), inputs_of("softmax32"), of="loss", wrt="x")
    with pytest.raises(InvalidRequest, match="class axis") as err:
        loss_curvature(loss_op, "softmax_cross_entropy")
    assert err.value.field == "of"
