"""The estimating spectral kinds on an ``Operator``: ``hessian_diag`` (the diagonal), ``spectral_density`` and
``logdet`` (stochastic Lanczos quadrature), by ``worker.engine.estimators`` on a ``matvec`` of the product the kind's
spec applies (``contracts.kinds.applied_product``: ``hvp`` for H; a Gauss-Newton kind passes ``ggn_vp``). Products
run batched and chunked through ``op.apply`` (``chunk_rows``; cancel between chunks raises ``Stopped``);
``progress(done, total)`` counts products; ``seed`` makes the random probes, hence the result, reproducible.
``worker.engine.spectra.spectral`` runs them by their ``Spectrum.algorithm``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from contracts.estimators import EXACT_DIAGONAL_MAX, exact_diagonal, quadrature_shape
from contracts.kinds import kind_spec
from worker.engine import estimators, matfree_rules
from worker.engine.errors import InvalidRequest
from worker.engine.matfree import MatFreeResult, Operator
from worker.engine.problem import _ruled

Progress = Callable[[int, int | None], None]
StopCheck = Callable[[], bool]
DIAGONAL_METHODS = ("auto", "exact", "hutchinson")


class _Counted:
    """``matvec``: the kind's product on a block of vectors (float64), its progress counted in products of
    ``total``; ``products``: what the run spent, by kind."""

    def __init__(self, op: Operator, kind: str, product: str, total: int, *, chunk_rows: int | None = None,
                 progress: Progress | None = None, should_stop: StopCheck | None = None) -> None:
        self.op, self.product, self.total, self.done = op, product, total, 0
        self.chunk_rows, self.progress, self.should_stop = chunk_rows, progress, should_stop
        self.before = dict(op.counts)
        if kind_spec(product).scalar_of:   # the Hessian's rule: a scalar of (or reduce='sum')
            op.require_hessian(kind)

    def report(self, done: int, total: int | None) -> None:
        if self.progress is not None:
            self.progress(done, total)

    def matvec(self, vectors: np.ndarray) -> np.ndarray:
        base = self.done

        def chunk(start: int, rows: np.ndarray) -> None:
            self.report(base + start + len(rows), self.total)

        out = self.op.apply(self.product, vectors, chunk_rows=self.chunk_rows, should_stop=self.should_stop,
                            on_chunk=chunk)
        self.done += len(vectors)
        return out.astype(np.float64)

    def result(self, kind: str, method: str, arrays: dict[str, Any], **attrs: Any) -> MatFreeResult:
        self.report(self.done, self.done)   # all done (a quadrature's invariant subspaces end it early)
        return MatFreeResult(kind=kind, method=method, iterations=self.done, converged=True,
                             products={k: self.op.counts[k] - self.before.get(k, 0) for k in self.op.counts},
                             arrays={k: np.asarray(v).astype(self.op.dtype) for k, v in arrays.items()},
                             attrs={"operator": self.product, **attrs})


def hessian_diag(op: Operator, probes: int | None = None, *, kind: str = "hessian_diag", product: str = "hvp",
                 method: str = "auto", seed: int = 0, **run: Any) -> MatFreeResult:
    """diag(A) of the applied product's matrix (``estimators.diagonal``): ``diagonal`` and ``stderr`` ``(n_wrt,)``;
    ``method`` ``auto`` (exact for a small wrt or ``probes >= n_wrt``), ``exact`` or ``hutchinson``. ``run``:
    ``chunk_rows``, ``progress``, ``should_stop``."""
    probes = _ruled(matfree_rules.check_probes, probes, kind=kind)
    if method not in DIAGONAL_METHODS:
        raise InvalidRequest(f"method: {method!r} is not a diagonal method; use one of "
                             + ", ".join(map(repr, DIAGONAL_METHODS)), field="method")
    n = op.n_wrt
    exact = method == "exact" or (method == "auto" and exact_diagonal(probes, n))
    counted = _Counted(op, kind, product, n if exact else probes, **run)
    got = estimators.diagonal(counted.matvec, n, probes=probes, method="exact" if exact else "hutchinson", seed=seed)
    return counted.result(kind, got.method, {"diagonal": got.diagonal, "stderr": got.stderr}, probes=probes,
                          seed=seed, requested_method=method, exact_max_wrt=EXACT_DIAGONAL_MAX)


def _quadrature(op: Operator, kind: str, product: str, probes: int | None, steps: int | None, seed: int,
                run: dict[str, Any]) -> tuple[_Counted, estimators.Quadrature, dict[str, Any]]:
    """Lanczos quadrature of the applied product's matrix: the run, the quadrature, the attributes every
    quadrature kind records."""
    probes = _ruled(matfree_rules.check_probes, probes, kind=kind)
    steps = _ruled(matfree_rules.check_steps, steps, n=op.n_wrt)
    used = quadrature_shape(probes, steps, op.n_wrt)
    counted = _Counted(op, kind, product, used[0] * used[1], **run)
    eps = 100 * float(np.finfo(op.compute_dtype).eps)
    q = estimators.lanczos_quadrature(counted.matvec, op.n_wrt, probes=probes, steps=steps, seed=seed, eps=eps)
    attrs = {"probes": probes, "steps": steps, "seed": seed, "start_vectors": "unit" if q.exact else "rademacher",
             "lanczos_steps": [int(k) for k in q.lengths], "ritz_range": list(q.ritz_range)}
    return counted, q, attrs


def spectral_density(op: Operator, probes: int | None = None, steps: int | None = None, sigma: float | None = None,
                     *, kind: str = "spectral_density", product: str = "hvp", seed: int = 0,
                     **run: Any) -> MatFreeResult:
    """The eigenvalue density by stochastic Lanczos quadrature: ``density`` and ``grid`` ``(points,)``, ``nodes``
    and ``weights`` ``(probes, steps)`` (at most ``n_wrt`` each); ``sigma``: the smoothing width."""
    counted, q, attrs = _quadrature(op, kind, product, probes, steps, seed, run)
    grid, values, width = estimators.density(q, sigma=_ruled(matfree_rules.check_sigma, sigma))
    return counted.result(kind, "stochastic lanczos quadrature", {"density": values, "grid": grid, "nodes": q.nodes,
                          "weights": q.weights}, sigma=width, requested_sigma=sigma,
                          grid_range=[float(grid[0]), float(grid[-1])], **attrs)


def logdet(op: Operator, probes: int | None = None, steps: int | None = None, damping: float | None = None, *,
           kind: str = "logdet", product: str = "hvp", seed: int = 0, **run: Any) -> MatFreeResult:
    """log det(A + damping I) by stochastic Lanczos quadrature: ``logdet`` and ``stderr`` (0-d); raises
    ``InvalidRequest`` naming ``damping`` when a shifted Ritz value is not positive."""
    damping = _ruled(matfree_rules.check_damping, damping)
    counted, q, attrs = _quadrature(op, kind, product, probes, steps, seed, run)
    value, stderr = estimators.logdet(q, damping)
    return counted.result(kind, "stochastic lanczos quadrature", {"logdet": value, "stderr": stderr},
                          damping=damping, **attrs)


ALGORITHMS = {"diagonal": hessian_diag, "slq_density": spectral_density, "slq_logdet": logdet}
