"""``ihvp``: ``(A + damping I)^-1 v`` for each seed ``v``, ``A`` the Hessian (``hvp``) or the Gauss-Newton matrix
(``ggn_vp``), by conjugate gradients on their products; no matrix is formed.

All seeds iterate together: each iteration is one batch of products of the seeds not converged yet (a seed that
reached ``tol`` leaves the batch), the small algebra per seed in float64 on the host. A seed has converged when its
*true* relative residual ``||(A + damping I) x - v|| / ||v||``, measured with one more batch of products, is at most
``tol``: the recursive residual of CG drifts from it in floating point, so when it says converged and the true one
does not agree, CG restarts from ``x`` with the true residual (at most ``RESTARTS`` times, within
``max_iterations`` per seed). The result holds each seed's solution, true relative residual and iterations.

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

from contracts.kinds import kind_spec
from worker.engine.errors import InvalidRequest, NotConverged, NotPositiveDefinite
from worker.engine.matfree import MatFreeResult, Operator

DEFAULT_TOL = 1e-5
DEFAULT_MAX_ITERATIONS = 1000
RESTARTS = 2
SHOWN = 8   # seeds named in a message


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
                        tol: float | None = None, max_iterations: int | None = None, chunk_rows: int | None = None,
                        progress: Callable[[int, int | None], None] | None = None,
                        should_stop: Callable[[], bool] | None = None) -> MatFreeResult:
    """``(A + damping I)^-1 v`` for seeds ``(k,) + wrt.shape`` (or flat), ``A`` the matrix of ``product``:
    ``solutions (k, n_wrt)``, ``residuals (k,)`` (true, relative), ``iterations (k,)`` (module docstring)."""
    from worker.engine.spectra import _Run

    if kind_spec(product).scalar_of:
        op.require_hessian(kind)
    damping, tol, max_iterations = _checked(damping, tol, max_iterations)
    b = op._seeds(kind, seeds).astype(np.float64)
    k = len(b)
    run = _Run(op, chunk_rows, progress, should_stop)

    def matvec(v: np.ndarray) -> np.ndarray:
        return run.apply(product, v) + damping * v

    norms = np.sqrt(np.einsum("ij,ij->i", b, b))
    x = np.zeros_like(b)
    r = b.copy()                       # the true residual b - A x of x = 0
    iterations = np.zeros(k, np.int64)
    residuals = np.zeros(k)
    todo = np.flatnonzero(norms > 0)   # a zero seed is solved by zero
    residuals[todo] = 1.0
    steps = restarts = 0
    while todo.size:
        steps = _iterate(matvec, x, r, norms, iterations, todo, tol=tol, limit=max_iterations, run=run, steps=steps)
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
        kind=kind, method="conjugate gradients", iterations=int(iterations.max(initial=0)), residuals=residuals,
        converged=True, products=run.products,
        arrays={"solutions": solutions, "residuals": residuals, "iterations": iterations},
        attrs={"damping": damping, "tol": tol, "max_iterations": max_iterations, "curvature": product,
               "restarts": restarts, "seeds": k, "residual": "||(A + damping I) x - v|| / ||v||"})


def _iterate(matvec: Callable[[np.ndarray], np.ndarray], x: np.ndarray, r: np.ndarray, norms: np.ndarray,
             iterations: np.ndarray, todo: np.ndarray, *, tol: float, limit: int, run: Any, steps: int) -> int:
    """CG on the seeds ``todo`` from ``x`` with residuals ``r`` (updated in place) until each one's recursive residual
    is at most ``tol`` of its norm or it has run ``limit`` iterations; returns the batched steps done so far."""
    p = r[todo].copy()
    rs = np.einsum("ij,ij->i", p, p)
    active = np.arange(len(todo))[np.sqrt(rs) > tol * norms[todo]]
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
        alpha = rs[active] / curvature
        x[rows] += alpha[:, None] * p[active]
        r[rows] -= alpha[:, None] * ap
        new = np.einsum("ij,ij->i", r[rows], r[rows])
        p[active] = r[rows] + (new / rs[active])[:, None] * p[active]
        rs[active] = new
        iterations[rows] += 1
        steps += 1
        run.report(steps, None)
        active = active[(np.sqrt(new) > tol * norms[rows]) & (iterations[rows] < limit)]
    return steps
