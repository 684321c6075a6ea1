"""The estimators of ``worker.engine.estimators`` on plain numpy matrices: the matrix is a parameter (``matvec``), so
the diagonal, the Lanczos quadrature, the density and log det are checked here against numpy without TensorFlow."""

from __future__ import annotations

import numpy as np
import pytest

from contracts import estimators as sizes
from worker.engine import estimators
from worker.engine.errors import InvalidRequest


def symmetric(n: int, seed: int, shift: float = 0.0) -> np.ndarray:
    a = np.random.default_rng(seed).standard_normal((n, n))
    return (a + a.T) / 2 + shift * np.eye(n)


def counted(a: np.ndarray) -> tuple[estimators.MatVec, list[int]]:
    calls: list[int] = []

    def matvec(v: np.ndarray) -> np.ndarray:
        assert v.ndim == 2 and v.shape[1] == a.shape[0]
        calls.append(len(v))
        return v @ a.T
    return matvec, calls


def test_the_exact_diagonal_takes_one_product_per_entry():
    a = symmetric(30, 0)
    matvec, calls = counted(a)
    got = estimators.diagonal(matvec, 30, probes=5)     # 30 <= EXACT_DIAGONAL_MAX: exact whatever probes says
    assert got.method == "exact" and sum(calls) == 30
    np.testing.assert_allclose(got.diagonal, np.diag(a), rtol=0, atol=1e-13)
    assert not got.stderr.any()


def test_hutchinson_entries_lie_within_four_standard_errors():
    n = sizes.EXACT_DIAGONAL_MAX + 36
    a = symmetric(n, 1) + np.diag(np.linspace(5, 50, n))
    matvec, calls = counted(a)
    got = estimators.diagonal(matvec, n, probes=300, method="hutchinson", seed=4)   # probes >= n: asked for
    assert got.method == "hutchinson" and sum(calls) == 300 and got.probes == 300
    z = np.abs(got.diagonal - np.diag(a)) / got.stderr
    assert z.max() <= 4, z.max()
    # the per-entry variance is sum_{k != j} a_jk^2: the standard errors say so
    want = np.sqrt((np.sum(a * a, axis=1) - np.diag(a) ** 2) / 300)
    np.testing.assert_allclose(got.stderr, want, rtol=0.25)


def test_the_diagonal_runs_in_blocks_of_probes_with_the_same_statistics(monkeypatch):
    n = 100
    a = symmetric(n, 2)
    whole = estimators.diagonal(counted(a)[0], n, probes=40, seed=1)
    monkeypatch.setattr(estimators, "BLOCK_BYTES", 8 * n * 7)   # 7 probes a block
    matvec, calls = counted(a)
    blocks = estimators.diagonal(matvec, n, probes=40, seed=1)
    assert max(calls) == 7 and sum(calls) == 40
    assert np.all(np.abs(blocks.diagonal - np.diag(a)) <= 4 * blocks.stderr)
    assert blocks.stderr.mean() == pytest.approx(whole.stderr.mean(), rel=0.3)


def test_slq_logdet_is_within_four_standard_errors_of_slogdet():
    n = 120
    a = symmetric(n, 3) + 25 * np.eye(n)     # positive definite
    sign, want = np.linalg.slogdet(a)
    assert sign > 0
    matvec, calls = counted(a)
    q = estimators.lanczos_quadrature(matvec, n, probes=30, steps=25, seed=2, eps=1e-12)
    assert q.nodes.shape == (30, 25) and not q.exact and sum(calls) == 30 * 25 and len(calls) == 25   # lockstep
    np.testing.assert_allclose(q.weights.sum(axis=1), 1.0, rtol=1e-12)
    value, stderr = estimators.logdet(q)
    assert stderr > 0 and abs(value - want) <= 4 * stderr, (value, stderr, want)
    shifted, _ = estimators.logdet(q, damping=3.0)
    assert abs(shifted - np.linalg.slogdet(a + 3 * np.eye(n))[1]) <= 4 * stderr


def test_unit_start_vectors_make_the_trace_exact():
    n = 40
    a = symmetric(n, 4) + 20 * np.eye(n)
    q = estimators.lanczos_quadrature(counted(a)[0], n, probes=n, steps=n, eps=1e-12)
    assert q.exact and q.nodes.shape == (n, n)
    value, stderr = estimators.logdet(q)
    assert stderr == 0 and value == pytest.approx(np.linalg.slogdet(a)[1], rel=1e-10)
    assert q.trace(lambda t: t)[0] == pytest.approx(np.trace(a), rel=1e-10)


def test_an_invariant_krylov_space_ends_a_probe_early():
    a = np.diag(np.arange(1.0, 9.0))
    matvec, calls = counted(a)
    q = estimators.lanczos_quadrature(matvec, 8, probes=8, steps=8, eps=1e-12)   # unit vectors: eigenvectors
    assert list(q.lengths) == [1] * 8 and sum(calls) == 8
    np.testing.assert_allclose(q.nodes[:, 0], np.arange(1.0, 9.0))
    assert np.isnan(q.nodes[:, 1:]).all() and not q.weights[:, 1:].any()
    assert estimators.logdet(q)[0] == pytest.approx(np.log(np.arange(1.0, 9.0)).sum())


def test_the_density_integrates_to_one_and_matches_the_smoothed_eigenvalues():
    n = 50
    a = symmetric(n, 5)
    q = estimators.lanczos_quadrature(counted(a)[0], n, probes=n, steps=n, eps=1e-12)
    grid, dens, sigma = estimators.density(q)
    lam = np.linalg.eigvalsh(a)
    assert sigma == pytest.approx(sizes.SIGMA_FRACTION * (lam.max() - lam.min()), rel=1e-8)
    assert len(grid) == sizes.DENSITY_POINTS and grid[0] < lam.min() and grid[-1] > lam.max()
    assert np.trapezoid(dens, grid) == pytest.approx(1.0, abs=1e-4)
    want = np.exp(-0.5 * ((grid[:, None] - lam[None]) / sigma) ** 2).sum(axis=1) / (n * sigma * np.sqrt(2 * np.pi))
    np.testing.assert_allclose(dens, want, rtol=0, atol=1e-8 * want.max())
    wide_grid, wide, width = estimators.density(q, sigma=1.0)
    assert width == 1.0 and np.trapezoid(wide, wide_grid) == pytest.approx(1.0, abs=1e-4)


def test_a_matrix_that_is_not_positive_definite_fails_naming_damping():
    a = np.diag([-2.0, 1.0, 3.0, 4.0])
    q = estimators.lanczos_quadrature(counted(a)[0], 4, probes=4, steps=4, eps=1e-12)
    with pytest.raises(InvalidRequest) as err:
        estimators.logdet(q, damping=1.0)
    assert err.value.field == "damping" and str(err.value).startswith("damping:") and "larger than 2" in str(err.value)
    assert estimators.logdet(q, damping=2.5)[0] == pytest.approx(np.log([0.5, 3.5, 5.5, 6.5]).sum())


def test_the_quadrature_shapes_and_products_agree_with_the_quote_rules():
    fields = ("probes", "steps", "damping")
    assert sizes.quadrature_shape(10, 50, 30) == (10, 30) and sizes.quadrature_shape(40, 5, 30) == (30, 5)
    assert sizes.shape_words(fields, 10, 50, 30) == {"probe": (10,), "step": (30,), "grid": (sizes.DENSITY_POINTS,)}
    assert sizes.products(fields, None, None, 10**6)[0] == sizes.SLQ_PROBES * sizes.SLQ_STEPS
    assert sizes.products(("probes",), None, None, 10**6)[0] == sizes.DIAGONAL_PROBES
    assert sizes.products(("probes",), 5, None, 20)[0] == 20   # small: exact
