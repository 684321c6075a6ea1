"""``hessian_diag``, ``spectral_density`` and ``logdet`` (issue 27) against the dense Hessian on models small enough to
form it (GradientTape, numpy ``eigh``/``slogdet``): float32 and float64, ``wrt`` an input, a variable, a list and
``variables/*``; validation naming the field, cancel, progress and reproducible seeds."""

from __future__ import annotations

import numpy as np
import pytest

from contracts import estimators as sizes
from tests.engine import test_matfree as matfree
from worker.engine.errors import InvalidRequest, Stopped

Case = matfree.Case
paths, loaded, built = matfree.paths, matfree.loaded, matfree.built   # the fixtures: models and dense references
CASES = [
    Case("softmax32", "logits", "x"),                          # float32, an input (n = 24)
    Case("softmax64", "logits", "variables/w0"),               # float64, a variable (n = 48)
    Case("softmax32", "loss", "variables/*", reduce=None),     # float32, a loss over every variable (n = 83)
    Case("float64", "y", ["variables/w", "x"]),                # float64, a list: variable + input (n = 35)
]


def scale_of(hess: np.ndarray) -> float:
    return float(np.abs(hess).max())


def rounding(op) -> float:
    """Relative rounding of the products: float32 HVPs against a float64 reference."""
    return 1e-10 if op.compute_dtype == "float64" else 1e-5


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_diagonal_exact_and_by_hutchinson(built, case):
    from worker.engine.estimating import hessian_diag

    b = built(case)
    op, want = b.op, np.diag(b.hess)
    atol = rounding(op) * scale_of(b.hess)
    exact = hessian_diag(op, op.n_wrt)                           # probes >= n: exact
    assert exact.method == "exact" and exact.products["hvp"] == op.n_wrt
    got = exact.arrays["diagonal"]
    assert got.dtype == np.dtype(op.dtype) and got.shape == (op.n_wrt,) and not exact.arrays["stderr"].any()
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=atol)
    hutch = hessian_diag(op, 200, method="hutchinson", seed=3)
    d, se = (np.asarray(hutch.arrays[k], np.float64) for k in ("diagonal", "stderr"))
    assert hutch.method == "hutchinson" and hutch.products["hvp"] == 200 and (se > 0).any()
    assert np.all(np.abs(d - want) <= 4 * se + 10 * atol), np.max(np.abs(d - want) / np.maximum(se, 1e-30))
    auto = hessian_diag(op)                                       # the default probes: exact up to the threshold
    assert auto.method == ("exact" if op.n_wrt <= max(sizes.EXACT_DIAGONAL_MAX, sizes.DIAGONAL_PROBES) else
                           "hutchinson")
    assert auto.attrs["operator"] == "hvp" and auto.attrs["requested_method"] == "auto"


def damped(hess: np.ndarray) -> tuple[float, np.ndarray]:
    """A damping that makes H + damping I positive definite and well conditioned, and that matrix."""
    lam = np.linalg.eigvalsh(hess)
    damping = max(0.0, -lam.min()) + 0.2 * np.abs(lam).max() + 1e-3
    return damping, hess + damping * np.eye(len(hess))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_logdet_by_slq_against_slogdet(built, case):
    from worker.engine.estimating import logdet

    b = built(case)
    op, n = b.op, b.op.n_wrt
    damping, a = damped(b.hess)
    sign, want = np.linalg.slogdet(a)
    assert sign > 0
    probes = min(40, n - 1)
    slq = logdet(op, probes, 30, damping, seed=1)
    value, stderr = float(slq.arrays["logdet"]), float(slq.arrays["stderr"])
    assert slq.attrs["start_vectors"] == "rademacher" and slq.products["hvp"] <= probes * min(30, n)
    assert stderr > 0 and abs(value - want) <= 4 * stderr + 1e-4 * abs(want), (value, stderr, want)
    exact = logdet(op, n, n, damping)                             # unit start vectors, every step: no sampling error
    assert exact.attrs["start_vectors"] == "unit" and float(exact.arrays["stderr"]) == 0
    assert float(exact.arrays["logdet"]) == pytest.approx(want, rel=10 * rounding(op), abs=10 * rounding(op) * n)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_spectral_density(built, case):
    from worker.engine.estimating import spectral_density

    b = built(case)
    op, n = b.op, b.op.n_wrt
    lam = np.linalg.eigvalsh(b.hess)
    slq = spectral_density(op, 6, 20, seed=2)
    grid, dens = (np.asarray(slq.arrays[k], np.float64) for k in ("grid", "density"))
    assert slq.arrays["nodes"].shape == (6, min(20, n)) == slq.arrays["weights"].shape
    assert grid.shape == dens.shape == (sizes.DENSITY_POINTS,)
    assert np.trapezoid(dens, grid) == pytest.approx(1, abs=1e-3)
    low, high = slq.attrs["ritz_range"]
    assert lam.min() - 1e-4 * scale_of(b.hess) <= low <= high <= lam.max() + 1e-4 * scale_of(b.hess)
    exact = spectral_density(op, n, n)                            # unit vectors: the eigenvalues' own measure
    grid, dens = (np.asarray(exact.arrays[k], np.float64) for k in ("grid", "density"))
    sigma = exact.attrs["sigma"]
    want = np.exp(-0.5 * ((grid[:, None] - lam[None]) / sigma) ** 2).sum(axis=1) / (n * sigma * np.sqrt(2 * np.pi))
    np.testing.assert_allclose(dens, want, rtol=0, atol=(1e-6 if op.compute_dtype == "float64" else 2e-3) * want.max())
    given = spectral_density(op, 4, 10, sigma=0.5)
    assert given.attrs["sigma"] == 0.5 and given.attrs["requested_sigma"] == 0.5


def test_logdet_fails_naming_damping_when_the_damped_hessian_is_not_positive_definite(built):
    from worker.engine.estimating import logdet

    b = built(CASES[3])                                           # float64_model: an indefinite Hessian
    lam = np.linalg.eigvalsh(b.hess)
    assert lam.min() < 0
    with pytest.raises(InvalidRequest) as err:
        logdet(b.op, b.op.n_wrt, b.op.n_wrt, damping=0.0)
    assert err.value.field == "damping" and str(err.value).startswith("damping: H + damping·I is not positive definite")


@pytest.mark.parametrize("call, field", [
    (lambda op, s: s.hessian_diag(op, 1), "probes"),
    (lambda op, s: s.logdet(op, 4, 0), "steps"),
    (lambda op, s: s.spectral_density(op, 4, 5, sigma=-1.0), "sigma"),
    (lambda op, s: s.logdet(op, 4, 5, float("nan")), "damping"),
    (lambda op, s: s.logdet(op, 4, sizes.MAX_STEPS + 1), "steps"),
    (lambda op, s: s.hessian_diag(op, 4, method="hutch++"), "method"),
])
def test_validation_names_the_field(built, call, field):
    from worker.engine import estimating as spectra

    with pytest.raises(InvalidRequest) as err:
        call(built(CASES[0]).op, spectra)
    assert err.value.field == field and str(err.value).startswith(f"{field}:")


def test_progress_seeds_and_cancel(built):
    from worker.engine.estimating import hessian_diag, logdet, spectral_density

    op = built(CASES[1]).op
    seen: list[tuple[int, int | None]] = []
    first = spectral_density(op, 5, 8, seed=7, chunk_rows=2, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1][0] == seen[-1][1] == first.products["hvp"] == 5 * 8
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    again = spectral_density(op, 5, 8, seed=7)
    np.testing.assert_array_equal(first.arrays["nodes"], again.arrays["nodes"])
    one, two = (float(logdet(op, 5, 8, 50.0, seed=s).arrays["logdet"]) for s in (1, 2))
    assert one != two
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 2

    with pytest.raises(Stopped):
        hessian_diag(op, 10, method="hutchinson", chunk_rows=2, should_stop=stop)
