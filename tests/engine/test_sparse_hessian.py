"""Sparse Hessians (issue 27): the pattern from the gradient's graph against the non-zeros of tape Hessians, star
colouring and its symmetric recovery, and the COO result of kind ``hessian`` with ``sparsity: "auto"`` equal entry
for entry to ``GradientTape`` Hessians (float64 1e-9, float32 1e-5); a dense pattern handed back with the reason."""

from __future__ import annotations

import numpy as np
import pytest

from tests import sparse_hessian_models
from tests.engine.reference import tape_hessian


@pytest.fixture(scope="module")
def hessian_loaded(tmp_path_factory):
    from worker.engine import load_model

    root = tmp_path_factory.mktemp("hessian_models")
    cache: dict[str, object] = {}

    def get(name: str, **options):
        key = name + repr(sorted(options.items()))
        if key not in cache:
            path = root / f"{name}{len(cache)}"
            cache[key] = load_model(str(sparse_hessian_models.HESSIAN_BUILDERS[name](path, **options)))
        return cache[key]

    return get


def x_of(n: int, dtype: str = "float32", seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.5, 1.5, n).astype(dtype)


def dense_h(model, x, of="f", reduce=None) -> np.ndarray:
    h = tape_hessian(model, {"x": x}, of, "x", reduce=reduce)
    return h.reshape(x.size, x.size)


def expected_pattern(name: str, n: int) -> np.ndarray:
    p = np.eye(n, dtype=bool)
    if name == "separable":
        i = np.arange(n - 1)
        p[i, i + 1] = p[i + 1, i] = True
    elif name == "arrowhead":
        p[0, :] = p[:, 0] = True
    return p


@pytest.mark.parametrize("name", ["separable", "arrowhead"])
def test_the_pattern_is_the_tape_hessians_nonzeros(hessian_loaded, name):
    from worker.engine.sparsity.hessian import detect

    n = 11
    model = hessian_loaded(name, n=n)
    x = x_of(n)
    pattern = detect(model, {"x": x}, of="f", wrt="x").toarray()
    nonzero = dense_h(model, x) != 0
    np.testing.assert_array_equal(pattern, nonzero)
    np.testing.assert_array_equal(pattern, expected_pattern(name, n))


def test_keras_per_feature_layers_give_a_block_diagonal_pattern(hessian_loaded):
    from worker.engine.sparsity.hessian import detect

    model = hessian_loaded("keras", groups=3, width=2)
    x = x_of(6)[None, :]
    pattern = detect(model, {"x": x}, of="y", wrt="x").toarray()
    blocks = np.kron(np.eye(3, dtype=bool), np.ones((2, 2), bool))
    np.testing.assert_array_equal(pattern, blocks)
    h = tape_hessian(model, {"x": x}, "y", "x", reduce="sum").reshape(6, 6)
    np.testing.assert_array_equal(pattern, h != 0)


def test_star_colouring_recovers_every_entry_of_an_arrowhead_in_two_colours():
    import scipy.sparse as sp

    from worker.engine.sparsity import hessian

    n = 40
    pattern = sp.csr_array(expected_pattern("arrowhead", n))
    star = hessian.star_colouring(pattern)
    assert star is not None and star.count == 2 and hessian.recoverable(pattern, star)
    assert hessian.colour_hessian(pattern).mode == "star"
    # a distance-1 colouring that is not a star colouring: recovery must say no
    path = sp.csr_array(expected_pattern("separable", 6))
    two = type(star)("star", np.array([0, 1, 0, 1, 0, 1], np.int32), 2)
    assert not hessian.recoverable(path, two)
    tri = hessian.star_colouring(path)
    assert tri is not None and tri.count == 3 and hessian.recoverable(path, tri)
    rng = np.random.default_rng(1)
    h = rng.standard_normal((n, n))
    h = np.where(pattern.toarray(), h + h.T, 0.0)
    products = h @ star.seeds("float64").T   # (n, colours): H s_c as columns
    rows, cols, values = hessian.entries(hessian.symmetrized(pattern), star, products.T, 0, n)
    got = np.zeros((n, n))
    got[rows, cols] = values
    np.testing.assert_array_equal(got, h)


def test_random_symmetric_patterns_are_recovered_exactly():
    import scipy.sparse as sp

    from worker.engine.sparsity import compressed, hessian

    rng = np.random.default_rng(7)
    for trial in range(20):
        n = int(rng.integers(5, 60))
        upper = sp.random(n, n, density=float(rng.uniform(0.02, 0.3)), random_state=trial, format="csr")
        pattern = hessian.symmetrized(upper + sp.identity(n))
        colouring = hessian.colour_hessian(pattern)
        h = rng.standard_normal((n, n))
        h = (h + h.T) * pattern.toarray()
        products = (h @ colouring.seeds("float64").T).T
        rows, cols, got = compressed.entries(pattern, colouring, products, 0, n)   # star or distance-2
        np.testing.assert_allclose(got, h[rows, cols], rtol=0, atol=1e-12)
        assert colouring.count <= n


def run_sparse_hessian(model, x, tmp_path, *, of="f", reduce=None, sparsity="auto"):
    from worker.execution import executor_for
    from worker.execution.local import local_context

    options = {"kind": "hessian", "of": of, "wrt": "x", "sparsity": sparsity}
    if reduce:
        options["reduce"] = reduce
    from worker.engine import TFMemoryProbe

    ctx = local_context(model, {"x": x}, results_url=str(tmp_path), job_id="h", probe=TFMemoryProbe(), **options)
    return executor_for(ctx.job).run(ctx)


def coo(manifest) -> np.ndarray:
    import scipy.sparse as sp
    import zarr

    group = zarr.open_group(manifest["uri"], mode="r")
    return sp.coo_array((group["values"][...], (group["rows"][...], group["cols"][...])),
                        shape=tuple(group.attrs["shape"])).toarray()


@pytest.mark.parametrize("name,dtype,tol", [("separable", "float64", 1e-9), ("separable", "float32", 1e-5),
                                            ("arrowhead", "float64", 1e-9), ("arrowhead", "float32", 1e-5)])
def test_the_coo_hessian_equals_the_tape_hessian_entry_for_entry(hessian_loaded, tmp_path, name, dtype, tol):
    n = 30
    model = hessian_loaded(name, n=n, dtype=dtype)
    x = x_of(n, dtype, seed=3)
    manifest = run_sparse_hessian(model, x, tmp_path)
    info = manifest["sparsity"]
    assert manifest["format"] == "coo" and manifest["kind"] == "hessian" and manifest["dense_shape"] == [n, n]
    assert info["verified"] is True and info["source"] == "auto"
    assert info["colouring"].startswith("star") and info["colors"] == (2 if name == "arrowhead" else 3), info
    assert manifest["shape"] == [int(expected_pattern(name, n).sum())]
    want = dense_h(model, x)
    got = coo(manifest)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    np.testing.assert_array_equal(got != 0, want != 0)


def test_a_keras_models_sparse_hessian_with_reduce_sum(hessian_loaded, tmp_path):
    model = hessian_loaded("keras", groups=6, width=2)
    x = x_of(12)[None, :]
    manifest = run_sparse_hessian(model, x, tmp_path, of="y", reduce="sum")
    assert manifest["format"] == "coo" and manifest["sparsity"]["verified"] is True, manifest.get("plan")
    assert manifest["sparsity"]["colors"] == 2 and "no_rule" not in manifest["sparsity"], manifest["sparsity"]
    want = tape_hessian(model, {"x": x}, "y", "x", reduce="sum").reshape(12, 12)
    np.testing.assert_allclose(coo(manifest), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_dense_hessian_falls_back_with_the_reason(hessian_loaded, tmp_path):
    import zarr

    n = 8
    model = hessian_loaded("dense", n=n)
    x = x_of(n)
    manifest = run_sparse_hessian(model, x, tmp_path)
    info = manifest["plan"]["sparsity"]
    assert info["fallback"].startswith("dense: the pattern holds 100.0%"), info
    assert manifest.get("format") != "coo" and info["verified"] is False
    got = np.asarray(zarr.open_group(manifest["uri"], mode="r")[manifest["array"]][...]).reshape(n, n)
    np.testing.assert_allclose(got, dense_h(model, x), rtol=1e-5, atol=1e-6)


def test_a_pattern_missing_entries_fails_verification_and_is_computed_densely(hessian_loaded, tmp_path):
    """A given pattern without the off-diagonal: the HVP check catches it, the dense route computes H."""
    import zarr

    n = 12
    model = hessian_loaded("separable", n=n)
    x = x_of(n)
    np.savez(tmp_path / "diag.npz", rows=np.arange(n), cols=np.arange(n))
    manifest = run_sparse_hessian(model, x, tmp_path, sparsity={"pattern_uri": str(tmp_path / "diag.npz")})
    info = manifest["plan"]["sparsity"]
    assert "differs from direct HVPs" in info["fallback"], info
    got = np.asarray(zarr.open_group(manifest["uri"], mode="r")[manifest["array"]][...]).reshape(n, n)
    np.testing.assert_allclose(got, dense_h(model, x), rtol=1e-5, atol=1e-6)
