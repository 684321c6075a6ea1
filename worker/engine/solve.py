"""``ihvp``: ``(A + damping I)^-1 v`` for each seed ``v``, ``A`` the Hessian (``hvp``) or the Gauss-Newton matrix
(``ggn_vp``), by conjugate gradients on their products; no matrix is formed.

All seeds iterate together: each iteration is one batch of products of the seeds not converged yet (a seed that
reached ``tol`` leaves the batch), the small algebra per seed in float64 on the host. A seed has converged when its
*true* relative residual ``||(A + damping I) x - v|| / ||v||``, measured with one more batch of products, is at most
``tol``: the recursive residual of CG drifts from it in floating point, so when it says converged and the true one
does not agree, CG restarts from ``x`` with the true residual (at most ``RESTARTS`` times, within
``max_iterations`` per seed). The result holds each seed's solution, true relative residual and iterations.

``precondition="diagonal"`` runs Jacobi-preconditioned CG (PCG) with ``M = diag(max(diag(A), 0) + damping)``: the
diagonal of ``A`` exact from unit-vector products (blocks of them) when the wrt size is at most
``contracts.estimators.EXACT_DIAGONAL_MAX``, else Hutchinson's estimate from ``DIAGONAL_PROBES`` Rademacher products
(``estimators.diagonal``); entries below zero (an indefinite Hessian's, or an estimate's noise) are clipped to zero
so ``M`` is positive definite. Those products are counted with the solve's and named in the attributes
(``preconditioner``, ``preconditioner_products``, ``preconditioner_clipped``). On a badly scaled ``A`` (diagonal
entries over orders of magnitude) PCG needs far fewer iterations; the stopping test is unchanged: the true,
unpreconditioned residual against ``tol``. ``"none"`` (the default) is plain CG.

Failures are loud (the job fails naming what to change): a seed still over ``tol`` after ``max_iterations``
(``NotConverged``, field ``max_iterations``), and a direction ``p`` with ``p^T (A + damping I) p <= 0``, which a
positive definite matrix cannot have (``NotPositiveDefinite``, field ``damping``): an indefinite Hessian needs a
damping above the magnitude of its most negative eigenvalue. The Gauss-Newton matrix of the losses here is positive
semi-definite, so any positive damping makes it definite.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from contracts.estimators import DIAGONAL_PROBES, EXACT_DIAGONAL_MAX
from contracts.kinds import kind_spec
from worker.engine import estimators
from worker.engine.errors import InvalidRequest, NotConverged, NotPositiveDefinite
from worker.engine.matfree import MatFreeResult, Operator

DEFAULT_TOL = 1e-5
DEFAULT_MAX_ITERATIONS = 1000
RESTARTS = 2
SHOWN = 8   # seeds named in a message
PRECONDITIONERS = ("none", "diagonal")   # the ``precondition`` field's values; None is "none"


def _checked(damping: object, tol: object, max_iterations: object) -> tuple[float, float, int]:
    """``damping`` > 0 (finite), ``tol`` in (0, 0.5), ``max_iterations`` >= 1; the defaults for None."""
    if isinstance(damping, bool) or not isinstance(damping, numbers.Real) or not math.isfinite(damping) \
            or damping <= 0:
        raise InvalidRequest(f"damping: must be a positive number, got {damping!r}; e.g. 1e-3 (larger: better "
                             "conditioned, further from the undamped inverse)", field="damping")
    if tol is None:
        tol = DEFAULT_TOL
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not 0 < tol < 0.5:
        raise InvalidRequest(f"tol: must be a relative residual between 0 and 0.5 (exclusive), got {tol!r}; the "
                             f"default is {DEFAULT_TOL}", field="tol")
    if max_iterations is None:
        max_iterations = DEFAULT_MAX_ITERATIONS
    if isinstance(max_iterations, bool) or not isinstance(max_iterations, numbers.Integral) or max_iterations < 1:
        raise InvalidRequest(f"max_iterations: must be a positive integer, got {max_iterations!r}; the default is "
                             f"{DEFAULT_MAX_ITERATIONS}", field="max_iterations")
    return float(damping), float(tol), int(max_iterations)


def conjugate_gradients(op: Operator, seeds: Any, *, damping: float, product: str = "hvp", kind: str = "ihvp",
                        tol: float | None = None, max_iterations: int | None = None, precondition: str | None = None,
                        chunk_rows: int | None = None, progress: Callable[[int, int | None], None] | None = None,
                        should_stop: Callable[[], bool] | None = None) -> MatFreeResult:
    """``(A + damping I)^-1 v`` for seeds ``(k,) + wrt.shape`` (or flat), ``A`` the matrix of ``product``:
    ``solutions (k, n_wrt)``, ``residuals (k,)`` (true, relative), ``iterations (k,)``; ``precondition``
    ``"none"`` (None) or ``"diagonal"`` (Jacobi PCG; module docstring)."""
    from worker.engine.spectra import ProductRun

    if kind_spec(product).scalar_of:
        op.require_hessian(kind)
    damping, tol, max_iterations = _checked(damping, tol, max_iterations)
    precondition = _checked_preconditioner(precondition)
    b = op.checked_seeds(kind, seeds).astype(np.float64)
    k = len(b)
    run = ProductRun(op, chunk_rows, progress, should_stop)

    def matvec(v: np.ndarray) -> np.ndarray:
        return run.apply(product, v) + damping * v

    inverse, preconditioner = (None, {"preconditioner": "none"}) if precondition == "none" or not b.any() else \
        jacobi(lambda v: run.apply(product, v), b.shape[1], damping)

    norms = np.sqrt(np.einsum("ij,ij->i", b, b))
    x = np.zeros_like(b)
    r = b.copy()                       # the true residual b - A x of x = 0
    iterations = np.zeros(k, np.int64)
    residuals = np.zeros(k)
    todo = np.flatnonzero(norms > 0)   # a zero seed is solved by zero
    residuals[todo] = 1.0
    steps = restarts = 0
    while todo.size:
        steps = _iterate(matvec, inverse, x, r, norms, iterations, todo, tol=tol, limit=max_iterations, run=run,
                         steps=steps)
        true = b[todo] - matvec(x[todo])
        r[todo] = true
        residuals[todo] = np.sqrt(np.einsum("ij,ij->i", true, true)) / norms[todo]
        todo = todo[(residuals[todo] > tol) & (iterations[todo] < max_iterations)]
        if restarts == RESTARTS:
            break
        restarts += 1
    failed = np.flatnonzero(residuals > tol)
    if failed.size:
        shown = ", ".join(f"seed {i}: {residuals[i]:.3g} after {iterations[i]}" for i in failed[:SHOWN])
        more = f" and {failed.size - SHOWN} more" if failed.size > SHOWN else ""
        raise NotConverged(f"max_iterations: conjugate gradients did not reach tol {tol:g} (relative residual "
                           f"||(A + damping I) x - v|| / ||v||) for {failed.size} of {k} seeds within {max_iterations} "
                           f"iterations ({shown}{more}); raise max_iterations, raise damping (a better conditioned "
                           "system converges faster) or loosen tol", field="max_iterations")
    solutions = x.astype(op.dtype)
    return MatFreeResult(
        kind=kind, method="conjugate gradients" if inverse is None else "preconditioned conjugate gradients",
        iterations=int(iterations.max(initial=0)), residuals=residuals,
        converged=True, products=run.products,
        arrays={"solutions": solutions, "residuals": residuals, "iterations": iterations},
        attrs={"damping": damping, "tol": tol, "max_iterations": max_iterations, "curvature": product,
               "restarts": restarts, "seeds": k, "residual": "||(A + damping I) x - v|| / ||v||",
               "precondition": precondition, **preconditioner})


def _checked_preconditioner(precondition: object) -> str:
    if precondition is None:
        return "none"
    if precondition not in PRECONDITIONERS:
        raise InvalidRequest(f"precondition: {precondition!r} is not a preconditioner; use one of "
                             + ", ".join(map(repr, PRECONDITIONERS)) + " (default 'none')", field="precondition")
    return str(precondition)


def jacobi(apply: Callable[[np.ndarray], np.ndarray], n: int, damping: float) -> tuple[np.ndarray, dict[str, Any]]:
    """The inverse of the Jacobi preconditioner ``M = diag(max(diag(A), 0) + damping)`` ``(n,)`` from ``apply(V) = A
    V`` (rows), and the attributes that say how it was made: the diagonal exact (``n`` unit-vector products) when
    ``n <= EXACT_DIAGONAL_MAX``, else Hutchinson's estimate (``DIAGONAL_PROBES`` Rademacher products)."""
    got = estimators.diagonal(apply, n, probes=DIAGONAL_PROBES, method="exact" if n <= EXACT_DIAGONAL_MAX
                              else "hutchinson")
    clipped = int(np.count_nonzero(got.diagonal < 0))
    m = np.maximum(got.diagonal, 0.0) + damping
    how = "exact diagonal" if got.method == "exact" else f"Hutchinson diagonal, {got.probes} Rademacher probes"
    return 1.0 / m, {"preconditioner": f"jacobi: diag(max(diag(A), 0) + damping), {how}",
                     "preconditioner_method": got.method, "preconditioner_products": got.probes,
                     "preconditioner_clipped": clipped}


def _iterate(matvec: Callable[[np.ndarray], np.ndarray], inverse: np.ndarray | None, x: np.ndarray, r: np.ndarray,
             norms: np.ndarray, iterations: np.ndarray, todo: np.ndarray, *, tol: float, limit: int, run: Any,
             steps: int) -> int:
    """CG (PCG with ``M^-1 = diag(inverse)`` unless None) on the seeds ``todo`` from ``x`` with residuals ``r``
    (updated in place) until each one's recursive residual is at most ``tol`` of its norm or it has run ``limit``
    iterations; returns the batched steps done so far."""
    def solve(res: np.ndarray) -> np.ndarray:   # z = M^-1 r
        return res if inverse is None else res * inverse

    p = solve(r[todo]).copy()
    rz = np.einsum("ij,ij->i", r[todo], p)
    active = np.arange(len(todo))[np.sqrt(np.einsum("ij,ij->i", r[todo], r[todo])) > tol * norms[todo]]
    while active.size:
        run.stop_point()
        rows = todo[active]
        ap = matvec(p[active])
        curvature = np.einsum("ij,ij->i", p[active], ap)
        bad = np.flatnonzero(curvature <= 0)
        if bad.size:
            i = int(rows[bad[0]])
            raise NotPositiveDefinite(
                f"damping: conjugate gradients met a direction p with p^T (A + damping I) p = {curvature[bad[0]]:.3g} "
                f"<= 0 (seed {i}, iteration {int(iterations[i]) + 1}): the damped matrix is not positive definite; "
                "raise damping above the magnitude of the most negative eigenvalue of A (hessian_eig shows it), or "
                "use curvature 'ggn' (positive semi-definite)", field="damping")
        alpha = rz[active] / curvature
        x[rows] += alpha[:, None] * p[active]
        r[rows] -= alpha[:, None] * ap
        z = solve(r[rows])
        new = np.einsum("ij,ij->i", r[rows], z)
        p[active] = z + (new / rz[active])[:, None] * p[active]
        rz[active] = new
        iterations[rows] += 1
        steps += 1
        run.report(steps, None)
        norm = new if inverse is None else np.einsum("ij,ij->i", r[rows], r[rows])
        active = active[(np.sqrt(norm) > tol * norms[rows]) & (iterations[rows] < limit)]
    return steps
