"""``ihvp`` with ``precondition: "diagonal"`` (Jacobi PCG, issue 27) against ``numpy.linalg.solve`` on dense
references small enough to form: the Hessian of ``0.5 x^T a x`` is ``a``, so the test sets a badly scaled ``a``
(``D^1/2 C D^1/2``, ``D`` over orders of magnitude, ``C`` well conditioned) and PCG must converge in far fewer
iterations than plain CG, to the same solution; float32 and float64; the diagonal exact (small wrt) and by
Hutchinson's estimate (wrt over ``EXACT_DIAGONAL_MAX``); negative diagonal entries clipped; the Gauss-Newton matrix.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import models
from tests.engine.conftest import loader


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("ihvp_precondition")
    paths = {"q40_64": models.quadratic_form(root / "q40_64", n=40),
             "q40_32": models.quadratic_form(root / "q40_32", n=40, dtype="float32"),
             "q100_64": models.quadratic_form(root / "q100_64", n=100),
             "softmax64": models.softmax_mlp(root / "softmax64", dtype="float64")}
    return loader(paths)


def badly_scaled(n: int, decades: float) -> np.ndarray:
    """``D^1/2 C D^1/2``: ``D`` from 1 to ``10^decades`` (ascending), ``C`` tridiagonal 1, 0.3 (eigenvalues in
    (0.4, 1.6)): condition ~ ``4 x 10^decades``, and ~4 once scaled by its diagonal."""
    c = np.eye(n) + 0.3 * (np.eye(n, k=1) + np.eye(n, k=-1))
    s = np.sqrt(np.logspace(0, decades, n))
    return s[:, None] * c * s[None, :]


def operator(loaded, name: str, a: np.ndarray):
    from worker.engine.matfree import build_operator

    dtype = "float32" if name.endswith("32") else "float64"
    n = len(a)
    inputs = {"x": np.linspace(-1, 1, n).astype(dtype), "a": a.astype(dtype)}
    return build_operator(loaded(name), inputs, of="loss", wrt="x")


def solve(op, seeds, **options):
    from worker.engine import spectra

    return spectra.spectral(op, "ihvp", seeds=seeds, **options)


def rel(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("name,decades,tol,close", [("q40_64", 4, 1e-10, 1e-7), ("q40_32", 3, 1e-4, 1e-3)])
def test_pcg_with_the_exact_diagonal_converges_in_fewer_iterations(loaded, name, decades, tol, close):
    a = badly_scaled(40, decades)
    op = operator(loaded, name, a)
    seeds = np.random.default_rng(4).standard_normal((3, 40))
    damping = 1e-3
    want = np.linalg.solve(a + damping * np.eye(40), seeds.T).T
    plain = solve(op, seeds, damping=damping, tol=tol)
    pcg = solve(op, seeds, damping=damping, tol=tol, precondition="diagonal")
    for result in (plain, pcg):
        assert rel(result.arrays["solutions"], want) < close
        assert np.all(result.arrays["residuals"] <= tol)
    assert plain.attrs["preconditioner"] == "none" and plain.method == "conjugate gradients"
    assert pcg.method == "preconditioned conjugate gradients" and pcg.attrs["precondition"] == "diagonal"
    assert pcg.attrs["preconditioner_method"] == "exact" and pcg.attrs["preconditioner_products"] == 40
    assert pcg.attrs["preconditioner"].startswith("jacobi") and pcg.attrs["preconditioner_clipped"] == 0
    # the badly scaled system: a few tens of plain CG iterations, under a third of them preconditioned
    assert np.all(3 * pcg.arrays["iterations"] <= plain.arrays["iterations"]), \
        (pcg.arrays["iterations"], plain.arrays["iterations"])
    # products counted: the diagonal's 40, one per seed and iteration, the true residual checks (a seed each)
    spent = pcg.products["hvp"] - 40 - int(pcg.arrays["iterations"].sum())
    assert 3 <= spent <= 3 * 3, pcg.products
    assert plain.products["hvp"] - int(plain.arrays["iterations"].sum()) >= 3


def test_pcg_with_the_hutchinson_diagonal_on_a_wrt_over_the_exact_limit(loaded):
    from contracts.estimators import DIAGONAL_PROBES, EXACT_DIAGONAL_MAX

    n = 100
    assert n > EXACT_DIAGONAL_MAX
    a = badly_scaled(n, 4)
    op = operator(loaded, "q100_64", a)
    seeds = np.random.default_rng(5).standard_normal((2, n))
    damping, tol = 1e-2, 1e-9
    want = np.linalg.solve(a + damping * np.eye(n), seeds.T).T
    plain = solve(op, seeds, damping=damping, tol=tol)
    pcg = solve(op, seeds, damping=damping, tol=tol, precondition="diagonal")
    assert pcg.attrs["preconditioner_method"] == "hutchinson"
    assert pcg.attrs["preconditioner_products"] == DIAGONAL_PROBES and "Hutchinson" in pcg.attrs["preconditioner"]
    assert rel(pcg.arrays["solutions"], want) < 1e-6 and np.all(pcg.arrays["residuals"] <= tol)
    assert pcg.products["hvp"] >= DIAGONAL_PROBES + int(pcg.arrays["iterations"].sum())
    assert np.all(2 * pcg.arrays["iterations"] <= plain.arrays["iterations"]), \
        (pcg.arrays["iterations"], plain.arrays["iterations"])


def test_negative_diagonal_entries_are_clipped_and_the_solve_stays_exact(loaded):
    """An indefinite H, damped past its most negative eigenvalue: M = diag(max(diag(H), 0) + damping) > 0."""
    rng = np.random.default_rng(6)
    d = np.concatenate([-np.linspace(0.1, 0.5, 10), np.logspace(0, 3, 30)])
    q = np.linalg.qr(rng.standard_normal((40, 40)))[0]
    a = np.diag(d) + 1e-2 * (q @ np.diag(rng.uniform(0, 1, 40)) @ q.T)
    a = (a + a.T) / 2
    damping = 1.0
    op = operator(loaded, "q40_64", a)
    seeds = rng.standard_normal((2, 40))
    result = solve(op, seeds, damping=damping, tol=1e-10, precondition="diagonal")
    assert result.attrs["preconditioner_clipped"] == int(np.count_nonzero(np.diag(a) < 0)) == 10
    want = np.linalg.solve(a + damping * np.eye(40), seeds.T).T
    assert rel(result.arrays["solutions"], want) < 1e-8


def test_pcg_of_the_gauss_newton_matrix(loaded):
    from worker.engine.curvature import loss_curvature, middles
    from worker.engine.matfree import build_operator

    x = np.random.default_rng(7).standard_normal((4, 6))
    op = build_operator(loaded("softmax64"), {"x": x, "labels": np.array([0, 2, 1, 2], "int32")}, of="logits",
                        wrt="variables/*")
    op.middles = middles(loss_curvature(op, "softmax_cross_entropy"))
    n = op.n_wrt
    g = np.asarray(op.apply("ggn_vp", np.eye(n)), np.float64)   # the engine's G (its products are tested against
    g = (g + g.T) / 2                                            # tape references in test_curvature)
    seeds = np.random.default_rng(8).standard_normal((2, n))
    damping = 1e-2
    result = solve(op, seeds, damping=damping, tol=1e-9, curvature="ggn", loss="softmax_cross_entropy",
                   precondition="diagonal")
    want = np.linalg.solve(g + damping * np.eye(n), seeds.T).T
    assert rel(result.arrays["solutions"], want) < 1e-6
    assert result.products["ggn_vp"] > 0 and result.products["hvp"] == 0
    assert result.attrs["preconditioner_method"] == ("exact" if n <= 64 else "hutchinson")


def test_an_unknown_preconditioner_is_refused_naming_the_field(loaded):
    from worker.engine.errors import InvalidRequest

    op = operator(loaded, "q40_64", badly_scaled(40, 1))
    with pytest.raises(InvalidRequest) as err:
        solve(op, np.ones((1, 40)), damping=1.0, precondition="jacobi")
    assert err.value.field == "precondition" and "'diagonal'" in str(err.value)
