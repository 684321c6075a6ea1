"""Matrix-free kinds (issue 14) against the dense matrix on models small enough to form it.

Every kind (jvp, vjp, hvp, svd, hessian_eig, hessian_trace) on each case: float32 and float64,
``wrt`` an input, a variable, a list (input + variable) and ``"variables/*"``. The references are
TensorGradientTape's own ``jacobian`` (J, and H as the Jacobian of the gradient) over the same
sources, concatenated by the test, and numpy's ``svd``/``eigh``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

from tests import models
from tests.engine.conftest import loader

RNG = np.random.default_rng(7)
X32 = RNG.standard_normal((4, 6)).astype("float32")
LABELS = np.array([0, 2, 1, 2], dtype="int32")
XF64 = RNG.standard_normal((3, 5))


@dataclass(frozen=True)
class Case:
    model: str
    of: str
    wrt: object
    reduce: str | None = "sum"

    @property
    def id(self) -> str:
        wrt = "+".join(self.wrt) if isinstance(self.wrt, list) else self.wrt
        return f"{self.model}-{self.of}-{wrt}"


CASES = [
    Case("softmax32", "logits", "x"),                            # float32, an input
    Case("softmax64", "logits", "variables/w0"),                 # float64, a variable
    Case("softmax32", "logits", ["x", "variables/b0"]),          # float32, a list: input + variable
    Case("softmax64", "logits", "variables/*"),                  # float64, every variable
    Case("softmax32", "loss", "variables/*", reduce=None),       # float32, a classification loss, every variable
    Case("float64", "y", ["variables/w", "x"]),                  # float64 tf.Module, variable + input
    Case("mlp", "y", "variables/*"),                             # float32 Keras model, every variable
]
KINDS = ("jvp", "vjp", "hvp", "svd", "hessian_eig", "hessian_trace")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("matfree")
    return {"softmax32": models.softmax_mlp(root / "softmax32"),
            "softmax64": models.softmax_mlp(root / "softmax64", dtype="float64"),
            "float64": models.float64_model(root / "float64"),
            "mlp": models.mlp(root / "mlp")}


@pytest.fixture(scope="module")
def loaded(paths):
    return loader(paths)


def inputs_of(name: str) -> dict[str, np.ndarray]:
    if name == "softmax32":
        return {"x": X32, "labels": LABELS}
    if name == "softmax64":
        return {"x": X32.astype("float64"), "labels": LABELS}
    if name == "float64":
        return {"x": XF64}
    return {"x": RNG.standard_normal((3, 8)).astype("float32")}


@dataclass
class Built:
    op: object
    jac: np.ndarray     # (n_of, n_wrt)
    hess: np.ndarray    # (n_wrt, n_wrt), of sum(of)


def dense(op) -> tuple[np.ndarray, np.ndarray]:
    """J and H over the operator's sources, by GradientTape alone, concatenated in the axis' order."""
    import tensorflow as tf

    targets = op.axis.targets(op.model, op.inputs)
    with tf.GradientTape(persistent=True) as outer:
        outer.watch(targets)
        with tf.GradientTape(persistent=True) as inner:
            inner.watch(targets)
            y = op.model.fn(**op.inputs)[op.of]
            flat_y = tf.reshape(y, [-1])
            s = tf.reduce_sum(y)
        grads = inner.gradient(s, targets, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        flat_g = tf.concat([tf.reshape(tf.cast(g, tf.float64), [-1]) for g in grads], 0)
    jac = np.concatenate([np.asarray(j, np.float64).reshape(op.n_of, -1)
                          for j in inner.jacobian(flat_y, targets, unconnected_gradients="zero")], axis=1)
    hess = np.concatenate([np.asarray(h, np.float64).reshape(op.n_wrt, -1)
                           for h in outer.jacobian(flat_g, targets, unconnected_gradients="zero")], axis=1)
    return jac, hess


@pytest.fixture(scope="module")
def built(loaded):
    from worker.engine.matfree import build_operator

    cache: dict[str, Built] = {}

    def get(case: Case) -> Built:
        if case.id not in cache:
            op = build_operator(loaded(case.model), inputs_of(case.model), of=case.of, wrt=case.wrt,
                                reduce=case.reduce)
            cache[case.id] = Built(op, *dense(op))
        return cache[case.id]
    return get


def product_tol(op) -> float:
    return 1e-10 if op.compute_dtype == "float64" else 2e-5


def assert_products(got: np.ndarray, want: np.ndarray, op) -> None:
    scale = max(float(np.abs(want).max()), 1e-30)
    assert got.dtype == np.dtype(op.dtype)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=product_tol(op) * scale)


def assert_vectors(got: np.ndarray, want: np.ndarray, values: np.ndarray) -> None:
    """Rows of ``got`` and ``want`` equal up to sign where the value is well separated from the others."""
    for i in range(len(got)):
        gap = np.min(np.abs(np.delete(values, i) - values[i])) / abs(values[i]) if len(values) > 1 else 1.0
        if gap > 1e-2:
            cos = abs(float(np.dot(got[i], want[i]))) / (np.linalg.norm(got[i]) * np.linalg.norm(want[i]))
            assert cos == pytest.approx(1.0, abs=1e-3), (i, cos)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_against_the_dense_matrix(built, case, kind):
    from worker.engine.spectra import hessian_eig, hessian_trace, svd

    b = built(case)
    op, jac, hess = b.op, b.jac, b.hess
    assert op.dtype == ("float64" if case.model in ("softmax64", "float64") else "float32")
    rng = np.random.default_rng(3)
    if kind == "jvp":
        seeds = rng.standard_normal((5, op.n_wrt))
        assert_products(op.jvp(seeds).reshape(5, -1), seeds @ jac.T, op)
    elif kind == "vjp":
        seeds = rng.standard_normal((5,) + op.of_shape)
        assert_products(op.vjp(seeds), seeds.reshape(5, -1) @ jac, op)
    elif kind == "hvp":
        seeds = rng.standard_normal((5, op.n_wrt))
        assert_products(op.hvp(seeds), seeds @ hess.T, op)
    elif kind == "svd":
        rank = min(3, op.n_of)
        tol = 1e-4 if op.compute_dtype == "float32" else 1e-6
        result = svd(op, rank, tol=tol)
        u_ref, s_ref, vt_ref = np.linalg.svd(jac)
        np.testing.assert_allclose(result.arrays["S"], s_ref[:rank], rtol=tol)
        assert result.arrays["U"].shape == (rank,) + op.of_shape and result.arrays["V"].shape == (rank, op.n_wrt)
        assert_vectors(result.arrays["V"], vt_ref[:rank], s_ref[:rank])
        assert_vectors(result.arrays["U"].reshape(rank, -1), u_ref[:, :rank].T, s_ref[:rank])
        assert result.converged and np.all(result.residuals <= 10 * tol)
        assert result.products["jvp"] > 0 and result.products["vjp"] > 0 and result.products["hvp"] == 0
    elif kind == "hessian_eig":
        tol = 1e-4 if op.compute_dtype == "float32" else 1e-6
        values, vectors = np.linalg.eigh(hess)
        order = np.argsort(-np.abs(values))[:3]
        result = hessian_eig(op, 3, tol=tol)
        np.testing.assert_allclose(result.arrays["eigenvalues"], values[order], rtol=tol,
                                   atol=tol * abs(values[order[0]]))
        assert_vectors(result.arrays["eigenvectors"], vectors[:, order].T, values[order])
        assert result.converged and result.products["hvp"] == result.iterations + 3
        assert np.all(result.residuals <= 10 * tol * np.abs(values[order[0]]))
    else:
        exact = float(np.trace(hess))
        scale = np.linalg.norm(hess)
        hutchinson = hessian_trace(op, 60, method="hutchinson", seed=1)
        trace, stderr = float(hutchinson.arrays["trace"]), float(hutchinson.arrays["stderr"])
        assert hutchinson.method == "hutchinson" and hutchinson.products["hvp"] == 60
        assert stderr > 0 and abs(trace - exact) <= 4 * stderr + 1e-5 * scale
        plus = hessian_trace(op, op.n_wrt, method="hutch++", seed=1)
        trace, stderr = float(plus.arrays["trace"]), float(plus.arrays["stderr"])
        assert abs(trace - exact) <= 4 * stderr + 1e-5 * scale
        assert abs(trace - exact) <= 0.25 * scale
        both = hessian_trace(op, max(6, op.n_wrt // 2), seed=2)     # auto, fewer samples than n
        assert both.method in ("hutch++", "hutchinson") and set(both.attrs["estimates"]) == {"hutch++", "hutchinson"}
        for estimate in both.attrs["estimates"].values():
            assert abs(estimate["trace"] - exact) <= 4 * estimate["stderr"] + 1e-5 * scale
        assert float(both.arrays["stderr"]) == pytest.approx(min(e["stderr"] for e in both.attrs["estimates"].values()))
        auto = hessian_trace(op, op.n_wrt)
        assert auto.method == "exact" and float(auto.arrays["stderr"]) == 0
        assert float(auto.arrays["trace"]) == pytest.approx(exact, abs=product_tol(op) * 10 * scale)


@pytest.mark.parametrize("x, s, want", [
    (np.arange(1.0, 7.0), 0.0, [91.0, 0.0, 0.0]),     # x x^T: rank one, |x|^2 = 91, then zeros
    (np.zeros(6), 2.0, [2.0, 2.0, 2.0]),              # 2 I: one eigenvalue six times
    (np.arange(1.0, 7.0), 2.0, [93.0, 2.0, 2.0]),     # x x^T + 2 I
])
def test_hessian_eig_finds_repeated_and_zero_eigenvalues(tmp_path_factory, x, s, want):
    """Where Lanczos reaches an invariant subspace (to rounding) it starts again from a fresh orthogonal
    direction, until the values found are the largest: repeated eigenvalues come out as often as asked."""
    from worker.engine import load_model
    from worker.engine.matfree import build_operator
    from worker.engine.spectra import hessian_eig

    model = load_model(str(models.quadratic(tmp_path_factory.mktemp("quadratic") / "q")))
    op = build_operator(model, {"x": x, "s": np.float64(s)}, of="loss", wrt="variables/w")
    result = hessian_eig(op, 3, tol=1e-8)
    np.testing.assert_allclose(result.arrays["eigenvalues"], want, atol=1e-9 * want[0])
    assert result.converged and np.all(result.residuals <= 1e-8 * want[0])
    vectors = result.arrays["eigenvectors"]
    np.testing.assert_allclose(vectors @ vectors.T, np.eye(3), atol=1e-9)
    assert result.iterations <= 6


# -- the wrt axis ------------------------------------------------------------------------------------


def test_the_wrt_axis_concatenates_sources_in_order(loaded, paths):
    from contracts.savedmodel import read_saved_model
    from worker.engine.matfree import build_operator

    model = loaded("softmax32")
    op = build_operator(model, inputs_of("softmax32"), of="logits", wrt=["x", "variables/*"])
    assert op.axis.names == ("x", "variables/w0", "variables/b0", "variables/w1", "variables/b1")
    signature_order = list(read_saved_model(paths["softmax32"]).describe("serving_default")["variables"])
    assert [n.removeprefix("variables/") for n in op.axis.names[1:]] == signature_order
    assert op.axis.slices == {"x": {"start": 0, "stop": 24, "shape": [4, 6]},
                              "variables/w0": {"start": 24, "stop": 72, "shape": [6, 8]},
                              "variables/b0": {"start": 72, "stop": 80, "shape": [8]},
                              "variables/w1": {"start": 80, "stop": 104, "shape": [8, 3]},
                              "variables/b1": {"start": 104, "stop": 107, "shape": [3]}}
    assert op.n_wrt == 107 and op.axis.shape == (107,)
    parts = op.axis.split(np.arange(107.0)[None])
    assert parts["variables/w1"].shape == (1, 8, 3) and parts["variables/w1"][0, 0, 0] == 80
    json.dumps(op.attrs())
    one = build_operator(model, inputs_of("softmax32"), of="logits", wrt="variables/w0")
    assert one.axis.shape == (6, 8) and one.axis.unflatten(np.zeros((2, 48))).shape == (2, 6, 8)


@pytest.mark.parametrize("wrt, words", [
    ([], "empty list"),
    (["x", "x"], "named twice"),
    (["variables/w0", "variables/*"], "named twice"),
    (["variables/nope"], "no variable"),
    (["labels"], "cannot be differentiated"),
    ([3], "a string"),
])
def test_bad_wrt_names_the_field(loaded, wrt, words):
    from worker.engine import InvalidRequest
    from worker.engine.matfree import build_operator

    with pytest.raises(InvalidRequest, match=words) as err:
        build_operator(loaded("softmax32"), inputs_of("softmax32"), of="logits", wrt=wrt)
    assert err.value.field == "wrt" and str(err.value).startswith("wrt:")


def test_variables_star_with_no_variables_names_the_field(tmp_path):
    from worker.engine import InvalidRequest, load_model
    from worker.engine.matfree import build_operator

    model = load_model(str(models.batch_interacting(tmp_path / "novars")))
    with pytest.raises(InvalidRequest, match="names no variable") as err:
        build_operator(model, {"x": np.ones((2, 4), "float32")}, wrt="variables/*")
    assert err.value.field == "wrt"


def test_a_source_of_does_not_read_gets_zeros(tmp_path):
    """``variables/*`` of a two-headed model: the slices of the other head's variables are zero (TensorFlow's
    gradient through a loaded function gives zeros, not None, for them: named explicitly, zeros too)."""
    from worker.engine import load_model
    from worker.engine.matfree import build_operator

    model = load_model(str(models.multi_io(tmp_path / "multi_io")))
    inputs = {"a": np.ones((2, 4), "float32"), "b": np.ones((2, 3), "float32")}
    op = build_operator(model, inputs, of="u", wrt="variables/*")
    parts = op.axis.split(op.vjp(np.ones((1, 2, 2))))
    assert not parts["variables/bproj/kernel"].any() and parts["variables/u/kernel"].any()
    tangent = np.zeros((1, op.n_wrt))
    for name in ("variables/bproj/kernel", "variables/bproj/bias"):
        tangent[0, op.axis.slices[name]["start"]:op.axis.slices[name]["stop"]] = 1.0
    assert not op.jvp(tangent).any()


# -- products: chunks, traces, routes ---------------------------------------------------------------


def test_products_chunk_over_seeds_without_retracing(built):
    b = built(CASES[0])
    op = b.op
    seeds = np.random.default_rng(5).standard_normal((7, op.n_wrt))
    seen = []
    whole = op.jvp(seeds)
    chunked = op.jvp(seeds, chunk_rows=3, on_chunk=lambda start, rows: seen.append((start, len(rows))))
    assert seen == [(0, 3), (3, 3), (6, 1)]
    np.testing.assert_array_equal(whole, chunked)
    for k in (1, 2, 5):
        op.jvp(seeds[:k])
    counts = {key.label: n for key, n in op.model.compiled.tracing_counts().items()
              if getattr(key, "kind", None) == "jvp" and key.wrt == op.axis.names}
    assert counts == {"forward/vectorized": 1}


def test_out_of_memory_halves_the_chunk(built, monkeypatch):
    import tensorflow as tf

    from worker.engine import MemoryBudgetTooSmall

    op = built(CASES[0]).op
    op.vjp(np.ones((1,) + op.of_shape))   # the route is chosen
    real = op._run

    def small_only(kind, label, seeds):
        if len(seeds) > 2:
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")
        return real(kind, label, seeds)

    monkeypatch.setattr(op, "_run", small_only)
    seeds = np.random.default_rng(1).standard_normal((6,) + op.of_shape)
    before = op.oom_retries
    np.testing.assert_allclose(op.vjp(seeds, chunk_rows=8), seeds.reshape(6, -1) @ built(CASES[0]).jac,
                               atol=1e-4)
    assert op.oom_retries - before == 2   # 6 -> 3 -> 1
    monkeypatch.setattr(op, "_run", lambda *a: (_ for _ in ()).throw(tf.errors.ResourceExhaustedError(None, None,
                                                                                                       "OOM")))
    with pytest.raises(MemoryBudgetTooSmall):
        op.vjp(seeds[:1])


@pytest.mark.parametrize("kind", ["jvp", "hvp"])
def test_both_routes_agree_with_the_dense_matrix(loaded, built, kind):
    """Forward mode (JVP; forward over reverse) and the reverse route (a VJP's derivative; reverse over
    reverse) give the same products on an input."""
    from worker.engine.matfree import build_operator

    b = built(CASES[0])
    seeds = np.random.default_rng(2).standard_normal((3, b.op.n_wrt))
    want = seeds @ (b.jac if kind == "jvp" else b.hess).T
    for route in ("forward", "reverse"):
        op = build_operator(loaded("softmax32"), inputs_of("softmax32"), of="logits", wrt="x", reduce="sum",
                            routes={kind: route})
        got = getattr(op, kind)(seeds).reshape(3, -1)
        assert op.labels[kind] == f"{route}/vectorized"
        np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("route", ["forward", "reverse"])
def test_depthwise_convolutions_vectorize(tmp_path_factory, route):
    """JVPs and HVPs through a depthwise convolution w.r.t. its input, vectorized over seeds: pfor needs the
    DepthwiseConv2dNative converter of ``worker.engine.pfor_patches`` for a fixed filter (MobileNet)."""
    from worker.engine import load_model
    from worker.engine.matfree import build_operator

    model = load_model(str(models.depthwise_small(tmp_path_factory.mktemp("depthwise") / "dw")))
    image = np.random.default_rng(0).standard_normal((2, 5, 5, 2)).astype("float32")
    op = build_operator(model, {"image": image}, of="y", wrt="image", reduce="sum", routes={"jvp": route, "hvp": route})
    jac, hess = dense(op)
    seeds = np.random.default_rng(1).standard_normal((3, op.n_wrt))
    assert_products(op.jvp(seeds).reshape(3, -1), seeds @ jac.T, op)
    assert_products(op.hvp(seeds), seeds @ hess.T, op)
    assert op.labels == {"jvp": f"{route}/vectorized", "hvp": f"{route}/vectorized"}, op.failures


def test_forward_mode_wrt_a_variable_is_caught(loaded):
    """TensorFlow's compiled JVP w.r.t. a variable of a loaded function is silently zero: the reference
    check refuses it when forward mode is forced, and ``auto`` never tries it there."""
    from worker.engine import NotDifferentiable
    from worker.engine.matfree import build_operator

    model, inputs = loaded("softmax32"), inputs_of("softmax32")
    forced = build_operator(model, inputs, of="logits", wrt="variables/w0", routes={"jvp": "forward"})
    with pytest.raises(NotDifferentiable, match="disagrees with the eager") as err:
        forced.jvp(np.ones((1, 6, 8)))
    assert err.value.field == "mode" and "use mode 'auto' or 'reverse'" in str(err.value)   # the fix, named
    auto = build_operator(model, inputs, of="logits", wrt="variables/w0")
    assert auto.candidates("jvp")[0] == "reverse/vectorized"
    assert auto.candidates("hvp")[0] == "reverse/vectorized"


def test_a_failing_label_falls_back(built, loaded, monkeypatch):
    """A label that fails (pfor cannot convert an op) gives way to the next one; why is kept."""
    from worker.engine.matfree import build_operator

    op = build_operator(loaded("softmax32"), inputs_of("softmax32"), of="logits", wrt="x", reduce="sum")
    real = op._run

    def broken(kind, label, seeds):
        if label.endswith("vectorized"):
            raise ValueError("pfor cannot convert this op")
        return real(kind, label, seeds)

    monkeypatch.setattr(op, "_run", broken)
    seeds = np.random.default_rng(4).standard_normal((2, op.n_wrt))
    got = op.hvp(seeds)
    assert op.labels["hvp"] == "reverse/loop"
    assert "pfor cannot convert" in op.failures["forward/vectorized"]
    np.testing.assert_allclose(got, seeds @ built(CASES[0]).hess.T, atol=2e-5 * np.abs(got).max())


def test_run_products_result(built):
    from worker.engine.matfree import run_products

    op = built(CASES[1]).op   # wrt variables/w0: (6, 8)
    calls, chunks = [], []
    result = run_products(op, "vjp", np.ones((3,) + op.of_shape), chunk_rows=2,
                          progress=lambda i, total: calls.append((i, total)),
                          on_chunk=lambda start, rows: chunks.append((start, rows)))
    assert result.arrays == {} and calls == [(2, 3), (3, 3)]   # streamed to on_chunk: none held here
    assert [(s, r.shape, r.dtype) for s, r in chunks] == [(0, (2, 6, 8), np.float64), (2, (1, 6, 8), np.float64)]
    kept = run_products(op, "vjp", np.ones((3,) + op.of_shape), chunk_rows=2)
    assert kept.arrays["products"].shape == (3, 6, 8)
    np.testing.assert_array_equal(np.concatenate([r for _, r in chunks]), kept.arrays["products"])
    assert result.products["vjp"] == 3 and result.method == "reverse/vectorized"
    json.dumps(result.attributes())


# -- spectra: cancel, progress, seeds ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["svd", "hessian_eig", "hessian_trace"])
def test_should_stop_cancels_between_iterations(built, kind):
    from worker.engine import Stopped
    from worker.engine.spectra import spectral

    op = built(CASES[3]).op
    calls = []
    stop_after = 3

    def should_stop() -> bool:
        return len(calls) >= stop_after

    options = {"samples": 30, "chunk_rows": 5} if kind == "hessian_trace" else {"rank": 2, "tol": 1e-12}
    before = dict(op.counts)
    with pytest.raises(Stopped):
        spectral(op, kind, progress=lambda i, total: calls.append((i, total)), should_stop=should_stop, **options)
    assert len(calls) == stop_after
    assert [i for i, _ in calls] == ([5, 10, 15] if kind == "hessian_trace" else [1, 2, 3])
    assert {t for _, t in calls} == ({30} if kind == "hessian_trace" else {None})
    used = sum(op.counts[k] - before[k] for k in ("jvp", "vjp", "hvp"))
    block = min(2 + 5, op.n_of)     # rank + oversampling
    assert used == {"svd": block + 3 * 2 * block, "hessian_eig": 3, "hessian_trace": 15}[kind]


def test_seeded_runs_are_reproducible(built):
    from worker.engine.spectra import hessian_eig, hessian_trace, svd

    op = built(CASES[3]).op
    for run in (lambda s: svd(op, 2, seed=s).arrays["V"], lambda s: hessian_eig(op, 2, seed=s).arrays["eigenvectors"],
                lambda s: hessian_trace(op, 20, seed=s).arrays["trace"]):
        np.testing.assert_array_equal(run(11), run(11))
    assert float(hessian_trace(op, 20, seed=1).arrays["trace"]) != float(hessian_trace(op, 20, seed=2).arrays["trace"])


# -- validation: errors name the field ---------------------------------------------------------------


def _invalid(field: str, fn, *args, **kwargs):
    from worker.engine import InvalidRequest

    with pytest.raises(InvalidRequest) as err:
        fn(*args, **kwargs)
    assert err.value.field == field and str(err.value).startswith(f"{field}:"), str(err.value)
    return str(err.value)


def test_validation_names_the_field(built, loaded):
    from worker.engine.matfree import build_operator
    from worker.engine.spectra import hessian_eig, hessian_trace, svd

    op = built(CASES[3]).op     # logits (4, 3) w.r.t. 83 parameters
    assert "at most 12" in _invalid("rank", svd, op, 13)
    for bad in (0, -1, 2.5, True, None):
        _invalid("rank", svd, op, bad)
    assert "at most 83" in _invalid("rank", hessian_eig, op, 84)
    for bad in (0, 0.5, -1e-3, float("nan"), "1e-4"):
        _invalid("tol", svd, op, 2, tol=bad)
    _invalid("samples", hessian_trace, op, 1)
    assert "at least 6" in _invalid("samples", hessian_trace, op, 5, method="hutch++")
    _invalid("method", hessian_trace, op, 10, method="girard")
    _invalid("seeds", op.jvp, np.ones((2, 82)))
    _invalid("seeds", op.jvp, np.ones((0, 83)))
    _invalid("seeds", op.vjp, np.ones((2, 3, 4)))
    _invalid("seeds", op.vjp, np.full((1, 4, 3), np.nan))
    _invalid("seeds", op.hvp, np.ones(83))
    op.vjp(np.ones((1, 12)))     # flat (k, size) is accepted too
    vector = build_operator(loaded("softmax32"), inputs_of("softmax32"), of="logits", wrt="x")
    for call in (lambda: vector.hvp(np.ones((1, 4, 6))), lambda: hessian_eig(vector, 1),
                 lambda: hessian_trace(vector, 10)):
        assert "reduce='sum'" in _invalid("of", call)
    assert "reduce='sum'" in _invalid("of", build_operator, loaded("softmax32"), inputs_of("softmax32"), of="logits",
                                      wrt="x", kind="hessian_trace")
    _invalid("kind", build_operator, loaded("softmax32"), inputs_of("softmax32"), kind="hessian")
    _invalid("reduce", build_operator, loaded("softmax32"), inputs_of("softmax32"), of="logits", reduce="mean")
    _invalid("of", build_operator, loaded("softmax32"), inputs_of("softmax32"), of="nope")
    _invalid("inputs.labels", build_operator, loaded("softmax32"), {"x": X32}, of="logits")


def test_pure_rules_need_no_tensorflow():
    """The rules module is plain Python (to move into contracts.rules for the API's POST checks)."""
    import ast
    from pathlib import Path

    from contracts.rules import RuleViolation
    from worker.engine import matfree_rules

    tree = ast.parse(Path(matfree_rules.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "math", "numbers", "collections.abc", "contracts.rules",
                        "contracts.kinds", "contracts"}   # contracts: ``from contracts import estimators``
    assert matfree_rules.check_rank("svd", 3, of_size=3, wrt_size=10) == 3
    assert matfree_rules.check_rank("hessian_eig", np.int64(4), of_size=1, wrt_size=10) == 4
    assert matfree_rules.check_tol(np.float32(1e-3)) == pytest.approx(1e-3)
    assert matfree_rules.check_seeds("jvp", (2, 10), of_shape=(3,), wrt_shape=(2, 5)) == 2
    with pytest.raises(RuleViolation):
        matfree_rules.check_rank("svd", 4, of_size=3, wrt_size=10)


# -- tiled: all seeds through one pass over inputs tiled on the batch axis -----------------------


@pytest.fixture(scope="module")
def multi_io_model(tmp_path_factory):
    from worker.engine import load_model

    return load_model(str(models.multi_io(tmp_path_factory.mktemp("multi_io") / "m")))


@pytest.mark.parametrize("kind", ["jvp", "vjp"])
def test_tiled_products_agree_with_gradient_tape(multi_io_model, kind):
    """``tiled`` over two input sources (one concatenated axis) gives GradientTape's products."""
    from worker.engine.matfree import build_operator
    from worker.engine.products import tiled_route

    rng = np.random.default_rng(3)
    inputs = {"a": rng.standard_normal((2, 4)).astype("float32"), "b": rng.standard_normal((2, 3)).astype("float32")}
    op = build_operator(multi_io_model, inputs, of="v", wrt=["a", "b"])
    jac, _ = dense(op)
    seeds = rng.standard_normal((5, op.n_wrt if kind == "jvp" else op.n_of))
    got = op._run(kind, f"{tiled_route(kind)}/tiled", seeds.astype("float32"))
    want = seeds @ jac.T if kind == "jvp" else seeds @ jac
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_tiled_comes_first_on_a_large_graph_and_never_for_variables(loaded, monkeypatch):
    from worker.engine import tuning
    from worker.engine.matfree import build_operator

    model = loaded("softmax32")
    op = build_operator(model, inputs_of("softmax32"), of="logits", wrt="x")
    assert op.candidates("jvp")[:2] == ["forward/vectorized", "forward/tiled"]   # a small graph: pfor's trace is cheap
    assert op.candidates("vjp")[:2] == ["reverse/vectorized", "reverse/tiled"]
    monkeypatch.setattr(model, "graph_ops", tuning.SMALL_GRAPH_OPS + 1)
    assert op.candidates("jvp")[:2] == ["forward/tiled", "forward/vectorized"]
    assert op.candidates("vjp")[:2] == ["reverse/tiled", "reverse/vectorized"]
    assert not any("tiled" in c for c in op.candidates("hvp"))
    on_variable = build_operator(model, inputs_of("softmax32"), of="logits", wrt=["x", "variables/b0"])
    assert not any("tiled" in c for kind in ("jvp", "vjp") for c in on_variable.candidates(kind))


def test_tiled_is_refused_when_examples_interact(tmp_path, monkeypatch):
    """Tiling is valid only for independent examples: the first call's probe row catches a model whose
    examples interact (here through a batch mean) and the next label is taken."""
    from worker.engine import load_model, tuning
    from worker.engine.matfree import build_operator

    model = load_model(str(models.batch_interacting(tmp_path / "bi")))
    monkeypatch.setattr(model, "graph_ops", tuning.SMALL_GRAPH_OPS + 1)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype("float32")
    op = build_operator(model, {"x": x}, of="y", wrt="x")
    jac, _ = dense(op)
    seeds = np.random.default_rng(1).standard_normal((4, op.n_wrt))
    for kind in ("jvp", "vjp"):
        got = getattr(op, kind)(seeds).reshape(4, -1)
        np.testing.assert_allclose(got, seeds @ (jac.T if kind == "jvp" else jac), atol=2e-5 * np.abs(got).max())
        assert "tiled" not in op.labels[kind]
        assert "disagrees" in op.failures[f"{'forward' if kind == 'jvp' else 'reverse'}/tiled"]
