"""Spectra without the matrix: singular values of J, eigenpairs and the trace of H, from products alone.

All three take an ``Operator`` (``worker.engine.matfree``), run its batched products chunk by chunk
(``chunk_rows`` seeds per call), keep their small dense algebra in float64 on the host, and return a
``MatFreeResult`` with the arrays in the operator's dtype, the residuals, the iterations and the
products they used. ``progress(iteration, total or None)`` hears of each iteration (``hessian_trace``:
of the products done, out of ``samples``); ``should_stop()`` is asked between iterations and between
chunks, and raises ``Stopped``; ``seed`` makes the random start vectors, hence the result, reproducible,
except that ``svd`` starts from the singular vectors of the last converged run on the same model, ``of``,
``wrt`` and input shapes when the cache folder keeps them (``trace_cache.start_vectors``; attribute ``start``):
a warm start converges in fewer iterations to the same tolerance, so results differ within ``tol``.

- ``svd``: randomized subspace iteration (Halko, Martinsson and Tropp 2011, algorithm 4.4 with the
  Rayleigh-Ritz step), ``l = rank + max(5, rank)`` vectors (at most ``min(n_of, n_wrt)``). The block is
  widened (its oversampling doubled, new random directions added) when the residuals stop shrinking fast
  enough to meet ``tol`` within half the iterations left: subspace iteration converges as
  ``(s_{l+1} / s_rank)^iterations``, and a clustered spectrum (two singular values 1 % apart) needs a wider
  block, not more iterations; at ``l = min(n_of, n_wrt)`` the Rayleigh-Ritz step is exact. Each iteration
  is one batch of ``l`` VJPs and one of ``l`` JVPs, and a block method is what batched products are good
  at: ``l`` seeds cost one vectorized call, where Lanczos bidiagonalisation would make ``2l`` sequential
  calls of one seed. After ``J^T Q = P R`` and the SVD ``R^T = U_b S V_b^T``, ``u = Q U_b`` and
  ``v = P V_b`` satisfy ``J^T u = s v`` exactly; the next batch of JVPs (``J P``) gives
  ``J v`` at no extra cost, so the residual ``||J v - s u|| / s`` is measured every iteration.
- ``hessian_eig``: Lanczos with full reorthogonalisation (twice, classical Gram-Schmidt) on HVPs: a
  Krylov method needs far fewer products than subspace iteration for the extreme eigenvalues, and
  the eigenvalues of largest magnitude of an indefinite H are the extreme ones at both ends. Ritz
  residuals come free from the tridiagonal matrix each step; the final residuals ``||H v - l v||``
  are measured with one more batch of ``rank`` HVPs.
- Convergence (both): every wanted value's residual is at most ``tol`` times the value (then a true
  singular value or eigenvalue lies within ``tol`` of it, relative), or within the rounding of the
  products (``100 eps`` of the largest value: float32 products cannot resolve less). Values that merely
  stopped changing are not enough: on a clustered spectrum (an MLP's Hessian has eigenvalues 0.07 %
  apart) a Ritz value that mixes two eigenvalues changes by less than 1e-4 per step long before
  Lanczos resolves the pair. ``max_iterations`` ends a run that does not converge: it raises
  ``NotConverged`` (the residuals, and what to change), unless ``allow_unconverged`` asked for the result
  anyway, whose ``converged`` is then false and ``attrs["warning"]`` says so.
- ``hessian_trace``: Hutch++ (Meyer, Musco, Musco and Woodruff 2021): a third of the samples sketch
  ``H`` with Rademacher vectors, a third give the trace of its projection on that range exactly, the
  last third are Hutchinson samples of the deflated rest, whose sample standard deviation gives the
  standard error. The same products also hold plain Hutchinson samples (the sketch's and the last
  third's own ``z^T H z``, as ``H P g = H g - (H Q) Q^T g``): ``auto`` reports whichever of the two
  estimates has the smaller standard error (deflation pays when a few eigenvalues dominate, as in a
  trained network's loss Hessian; on a flat spectrum, an untrained one's, it removes little and the
  plain samples win). Plain Hutchinson on request (or under 6 samples), and the exact trace (``n``
  products with unit vectors, standard error 0) when ``samples >= n_wrt``. ``attrs["estimates"]``
  holds every estimate computed.
- ``hessian_diag``, ``spectral_density``, ``logdet``: ``worker.engine.estimating`` (the diagonal, Lanczos
  quadrature) on the products the kind applies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from contracts.kinds import applied_product, kind_spec
from worker.engine import estimating, matfree_rules, trace_cache
from worker.engine.convergence import converged as _converged
from worker.engine.convergence import not_converged as _not_converged
from worker.engine.convergence import relative as _relative
from worker.engine.convergence import stalled as _stalled
from worker.engine.convergence import unconverged_attrs as _unconverged_attrs
from worker.engine.convergence import worst as _worst
from worker.engine.errors import Stopped
from worker.engine.matfree import MatFreeResult, Operator
from worker.engine.problem import _ruled
from worker.engine.solve import conjugate_gradients

Progress = Callable[[int, int | None], None]
StopCheck = Callable[[], bool]


class _Run:
    """One method's products (through ``op.apply``), its cancel and progress, and the products it used."""

    def __init__(self, op: Operator, chunk_rows: int | None, progress: Progress | None,
                 should_stop: StopCheck | None) -> None:
        self.op, self.chunk_rows, self.progress, self.should_stop = op, chunk_rows, progress, should_stop
        self.before = dict(op.counts)

    def apply(self, kind: str, seeds: np.ndarray, on_chunk: Callable[[int, np.ndarray], None] | None = None
              ) -> np.ndarray:
        out = self.op.apply(kind, seeds, chunk_rows=self.chunk_rows, should_stop=self.should_stop, on_chunk=on_chunk)
        return out.astype(np.float64)

    def stop_point(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise Stopped("canceled between iterations", field=None)

    def report(self, iteration: int, total: int | None) -> None:
        if self.progress is not None:
            self.progress(iteration, total)

    @property
    def products(self) -> dict[str, int]:
        return {k: self.op.counts[k] - self.before.get(k, 0) for k in self.op.counts}


def _signed(vectors: np.ndarray) -> np.ndarray:
    """Each row's sign fixed so that its entry of largest magnitude is positive (a reproducible sign)."""
    idx = np.argmax(np.abs(vectors), axis=1)
    signs = np.sign(vectors[np.arange(len(vectors)), idx])
    return vectors * np.where(signs == 0, 1.0, signs)[:, None]


def svd(op: Operator, rank: int, *, tol: float | None = None, oversample: int | None = None,
        max_iterations: int | None = None, allow_unconverged: bool = False, seed: int = 0,
        chunk_rows: int | None = None, progress: Progress | None = None,
        should_stop: StopCheck | None = None) -> MatFreeResult:
    """The ``rank`` largest singular values of J (``of`` w.r.t. the wrt axis): ``S (rank,)`` descending,
    ``U (rank,) + of.shape``, ``V (rank, n_wrt)``; residuals ``||J v - s u|| / s`` (see the module docstring).
    Raises ``NotConverged`` when ``tol`` does not hold within ``max_iterations`` (default 200) iterations,
    unless ``allow_unconverged``."""
    m, n = op.n_of, op.n_wrt
    rank = _ruled(matfree_rules.check_rank, "svd", rank, of_size=m, wrt_size=n)
    tol = _ruled(matfree_rules.check_tol, tol)
    limit = _ruled(matfree_rules.check_max_iterations, max_iterations, default=matfree_rules.DEFAULT_SVD_ITERATIONS)
    run = _Run(op, chunk_rows, progress, should_stop)
    full = min(m, n)
    width = min(rank + (max(5, rank) if oversample is None else max(0, int(oversample))), full)
    rng = np.random.default_rng(seed)
    omega = rng.standard_normal((width, n))
    start = trace_cache.start_vectors(op, "svd", n)   # the last converged V of this model, of and wrt
    if start is not None:
        omega[:min(len(start), rank)] = start[:rank]
    q = np.linalg.qr(run.apply("jvp", omega).T)[0]                                    # (m, l)
    iteration, converged, widened = 0, False, 0
    s = np.zeros(rank)
    u = np.zeros((m, rank))
    v = np.zeros((n, rank))
    relative = np.full(rank, np.inf)
    history: list[float] = []     # the worst residual over what tol allows, per iteration at this width
    while iteration < limit:
        run.stop_point()
        iteration += 1
        p, r = np.linalg.qr(run.apply("vjp", q.T).T)                                   # J^T Q = P R, P (n, l)
        ub, sb, vbt = np.linalg.svd(r.T)                                               # R^T = Q^T J P
        jp = run.apply("jvp", p.T).T                                                   # J P (m, l)
        s, u, v = sb[:rank], (q @ ub)[:, :rank], (p @ vbt.T)[:, :rank]
        jv = jp @ vbt.T[:, :rank]
        residuals = np.linalg.norm(jv - u * s, axis=0)
        relative = _relative(residuals, s)
        run.report(iteration, None)
        if _converged(s, residuals, tol, op.compute_dtype):
            converged = True
            break
        history.append(_worst(s, residuals, tol, op.compute_dtype))
        if width < full and iteration < limit and _stalled(history, limit - iteration):
            extra = min(full - width, max(width - rank, 5))                             # oversampling doubled
            fresh = run.apply("jvp", rng.standard_normal((extra, n))).T                  # J G: new directions
            q = np.linalg.qr(np.concatenate([jp, fresh], axis=1))[0]
            width, widened, history = width + extra, widened + 1, []
        else:
            q = np.linalg.qr(jp)[0]
    if not converged and not allow_unconverged:
        raise _not_converged("svd", relative, tol=tol, rank=rank, limit=limit,
                             how=f"randomized subspace iteration, block of {width} vectors")
    vt = _signed(v.T)
    ut = u.T * np.sign(np.sum(vt * v.T, axis=1))[:, None]    # flip u with v: J v = s u holds
    if converged:
        trace_cache.keep_start_vectors(op, "svd", vt)
    dtype = op.dtype
    return MatFreeResult(
        kind="svd", method="randomized subspace iteration", iterations=iteration, residuals=relative,
        converged=converged, products=run.products,
        arrays={"S": s.astype(dtype), "U": ut.reshape((rank,) + op.of_shape).astype(dtype), "V": vt.astype(dtype)},
        attrs={"rank": rank, "tol": tol, "oversample": width - rank, "block": width, "widened": widened,
               "seed": seed, "max_iterations": limit, "residual": "||J v - s u|| / s",
               "start": "random" if start is None else f"{min(len(start), rank)} kept vectors + random",
               **_unconverged_attrs(converged, relative, tol)})


def hessian_eig(op: Operator, rank: int, *, tol: float | None = None, max_iterations: int | None = None,
                allow_unconverged: bool = False, seed: int = 0, progress: Progress | None = None,
                should_stop: StopCheck | None = None, chunk_rows: int | None = None, product: str = "hvp",
                kind: str = "hessian_eig") -> MatFreeResult:
    """The ``rank`` eigenpairs of H (of ``sum(of)`` w.r.t. the wrt axis) of largest magnitude: ``eigenvalues
    (rank,)`` by decreasing magnitude, ``eigenvectors (rank, n_wrt)``; residuals ``||H v - l v||``. ``product``:
    the symmetric matrix's products (``hvp``; ``ggn_vp``, the Gauss-Newton matrix, for ``kind`` ``ggn_eig``).
    Raises ``NotConverged`` when ``tol`` does not hold within ``max_iterations`` Lanczos steps (default
    ``max(20 rank, 100)``; the Krylov space grows by one vector a step, up to ``n_wrt``, where it is exact),
    unless ``allow_unconverged``."""
    _require(op, product, kind)
    n = op.n_wrt
    rank = _ruled(matfree_rules.check_rank, kind, rank, of_size=op.n_of, wrt_size=n)
    tol = _ruled(matfree_rules.check_tol, tol)
    limit = _ruled(matfree_rules.check_max_iterations, max_iterations, default=max(20 * rank, 100))
    run = _Run(op, chunk_rows, progress, should_stop)
    steps = min(n, max(rank, limit))
    rng = np.random.default_rng(seed)
    basis = np.empty((steps + 1, n))
    alpha, beta = np.zeros(steps), np.zeros(steps)
    basis[0] = _unit(rng.standard_normal(n))
    converged, j, block = False, 0, 0       # block: where the current Krylov sequence started
    eps = 100 * float(np.finfo(op.compute_dtype).eps)
    theta, ritz = np.zeros(0), np.zeros((0, 0))
    while j < steps:
        run.stop_point()
        w = run.apply(product, basis[j:j + 1])[0]
        alpha[j] = np.einsum("i,i", w, basis[j])
        for _ in range(2):   # full reorthogonalisation against every basis vector, twice
            w -= basis[:j + 1].T @ (basis[:j + 1] @ w)
        beta[j] = _norm(w)
        j += 1
        run.report(j, None)
        scale = max(float(np.abs(alpha[:j]).max()), float(beta[:j].max()), np.finfo(np.float64).tiny)
        invariant = beta[j - 1] <= eps * scale     # the Krylov space is invariant (to rounding)
        if invariant:
            beta[j - 1] = 0.0
        if j >= rank:
            theta, ritz = _ritz(alpha[:j], beta[:j - 1], rank)
            if j == n or (not invariant and _converged(theta, np.abs(beta[j - 1] * ritz[-1]), tol, op.compute_dtype)):
                converged = True
                break
            if invariant and j - block == 1 and _rest_is_smaller(alpha[:j], beta[:j - 1], alpha[j - 1], rank):
                converged = True   # a random start was an eigenvector: H is alpha * I on the rest
                break
        if j == steps:
            break
        if invariant:   # its eigenvalues are exact; H on the rest is unexplored: a fresh orthogonal start
            block = j
            w = rng.standard_normal(n)
            for _ in range(2):
                w -= basis[:j].T @ (basis[:j] @ w)
        basis[j] = _unit(w)
    if theta.size < rank:   # max_iter below rank: the Ritz pairs there are
        theta, ritz = _ritz(alpha[:j], beta[:j - 1], min(rank, j))
    vectors = _signed((basis[:j].T @ ritz).T)
    hv = run.apply(product, vectors)
    residuals = np.linalg.norm(hv - vectors * theta[:, None], axis=1)
    if not converged and not allow_unconverged:
        raise _not_converged(kind, _relative(residuals, theta), tol=tol, rank=rank, limit=limit,
                             how=f"Lanczos, {j} steps")
    dtype = op.dtype
    return MatFreeResult(
        kind=kind, method="lanczos, full reorthogonalisation", iterations=j, residuals=residuals,
        converged=converged, products=run.products,
        arrays={"eigenvalues": theta.astype(dtype), "eigenvectors": vectors.astype(dtype)},
        attrs={"rank": rank, "tol": tol, "seed": seed, "max_iterations": limit, "max_iter": steps,
               "residual": "||H v - l v||", **_unconverged_attrs(converged, _relative(residuals, theta), tol)})


def _require(op: Operator, product: str, kind: str) -> None:
    """The rule of the matrix ``product`` applies: the Hessian's scalar ``of`` (or ``reduce='sum'``)."""
    if kind_spec(product).scalar_of:
        op.require_hessian(kind)


def _norm(v: np.ndarray) -> float:
    """``||v||`` without BLAS: beside TensorFlow's thread pools, OpenBLAS' threads can take milliseconds
    to wake up for a dot product of microseconds (seen on a 2-core host)."""
    return math.sqrt(float(np.einsum("i,i", v, v)))


def _unit(v: np.ndarray) -> np.ndarray:
    norm = _norm(v)
    return v / norm if norm > 0 else v


def _rest_is_smaller(alpha: np.ndarray, beta: np.ndarray, rest: float, rank: int) -> bool:
    """Whether ``rank`` eigenvalues found (of the tridiagonal ``(alpha, beta)``) are at least as large in magnitude
    as ``rest``, the eigenvalue of H on the whole unexplored space: then they are the ``rank`` largest."""
    found = np.linalg.eigvalsh(np.diag(alpha) + np.diag(beta, 1) + np.diag(beta, -1))
    return int(np.count_nonzero(np.abs(found) >= abs(rest))) >= rank


def _ritz(alpha: np.ndarray, beta: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``rank`` Ritz values of largest magnitude of the tridiagonal ``(alpha, beta)`` (decreasing
    magnitude) and their eigenvectors in the Lanczos basis (columns)."""
    t = np.diag(alpha) + np.diag(beta, 1) + np.diag(beta, -1)
    values, vectors = np.linalg.eigh(t)
    order = np.argsort(-np.abs(values), kind="stable")[:rank]
    return values[order], vectors[:, order]


def hessian_trace(op: Operator, samples: int | None = None, *, method: str = "auto", seed: int = 0,
                  chunk_rows: int | None = None, progress: Progress | None = None,
                  should_stop: StopCheck | None = None, product: str = "hvp",
                  kind: str = "hessian_trace") -> MatFreeResult:
    """tr(H) (of ``sum(of)`` w.r.t. the wrt axis) from ``samples`` HVPs: ``trace`` and its ``stderr`` (0-d).
    ``method``: ``auto`` (``exact`` when ``samples >= n_wrt``; else from 6 samples the Hutch++ products, and
    the better of their two estimates; else ``hutchinson``), ``hutch++``, ``hutchinson`` or ``exact``.
    ``product``: the symmetric matrix's products (``hvp``; ``ggn_vp`` for ``kind`` ``ggn_trace``)."""
    _require(op, product, kind)
    samples = _ruled(matfree_rules.check_samples, samples, method=method)
    n = op.n_wrt
    requested = method
    if method == "auto":
        method = ("exact" if samples >= n else "hutch++" if samples >= matfree_rules.MIN_HUTCHPP_SAMPLES
                  else "hutchinson")
    run = _Run(op, chunk_rows, progress, should_stop)
    rng = np.random.default_rng(seed)
    total = n if method == "exact" else samples
    done = 0

    def products(seeds: np.ndarray) -> np.ndarray:
        nonlocal done
        base = done

        def chunk(start: int, rows: np.ndarray) -> None:
            run.report(base + start + len(rows), total)

        out = run.apply(product, seeds, on_chunk=chunk)
        done += len(seeds)
        return out

    def rademacher(k: int) -> np.ndarray:
        return rng.choice(np.array([-1.0, 1.0]), size=(k, n))

    estimates: dict[str, dict[str, float]] = {}
    if method == "exact":
        diagonal = np.empty(n)
        step = chunk_rows or n
        for start in range(0, n, step):   # unit vectors made a chunk at a time: never an n x n array
            stop = min(n, start + step)
            eye = np.zeros((stop - start, n))
            eye[np.arange(stop - start), np.arange(start, stop)] = 1.0
            diagonal[start:stop] = np.diagonal(products(eye)[:, start:stop])
        estimates["exact"] = {"trace": float(diagonal.sum()), "stderr": 0.0}
    elif method == "hutchinson":
        z = rademacher(samples)
        estimates["hutchinson"] = _mean(np.einsum("ij,ij->i", z, products(z)))
    else:
        sketch = min(samples // 3, n)
        s = rademacher(sketch)
        hs = products(s)
        q = np.linalg.qr(hs.T)[0]                                   # an orthonormal basis of range(H S)
        hq = products(q.T)                                          # rows H q_i
        deflated = float(np.einsum("ij,ij->", q.T, hq))             # tr(Q^T H Q)
        g = rademacher(samples - 2 * sketch)
        hg = products(g)
        c = g @ q
        pg, hpg = g - c @ q.T, hg - c @ hq                          # P g and H P g = H g - (H Q) Q^T g, P = I - Q Q^T
        rest = _mean(np.einsum("ij,ij->i", pg, hpg))
        estimates["hutch++"] = {"trace": deflated + rest["trace"], "stderr": rest["stderr"]}
        # The sketch's and g's own Hutchinson samples cost nothing more: on a flat spectrum, where deflation
        # removes little, they beat Hutch++'s third of the samples, and "auto" takes them.
        estimates["hutchinson"] = _mean(np.concatenate([np.einsum("ij,ij->i", s, hs), np.einsum("ij,ij->i", g, hg)]))
        if requested == "auto":
            method = min(("hutch++", "hutchinson"), key=lambda m: estimates[m]["stderr"])
    trace, stderr = estimates[method]["trace"], estimates[method]["stderr"]
    dtype = op.dtype
    return MatFreeResult(
        kind=kind, method=method, iterations=done, converged=True, products=run.products,
        arrays={"trace": np.asarray(trace, dtype), "stderr": np.asarray(stderr, dtype)},
        attrs={"samples": samples, "seed": seed, "requested_method": requested, "estimates": estimates})


def _mean(samples: np.ndarray) -> dict[str, float]:
    """A sample mean and its standard error."""
    stderr = float(samples.std(ddof=1) / math.sqrt(len(samples))) if len(samples) > 1 else 0.0
    return {"trace": float(samples.mean()), "stderr": stderr}


def spectral(op: Operator, kind: str, **options: Any) -> MatFreeResult:
    """A spectral kind (``svd``, ``hessian_eig``, ``ggn_trace``, ``ihvp``, ...) by its spec's ``Spectrum.algorithm``
    on the products its spec applies (``contracts.kinds.applied_product``: ``hvp``, ``ggn_vp``, or the request's
    ``curvature``); ``options`` as each function takes them (``loss`` is the operator's, set by its caller)."""
    spec = kind_spec(kind)
    if spec.spectrum is None:
        raise KeyError(kind)
    options.pop("loss", None)
    product = applied_product(spec, options.pop("curvature", None))
    if product:
        options.update(product=product, kind=kind)
    return ALGORITHMS[spec.spectrum.algorithm](op, **options)


ALGORITHMS: dict[str, Callable[..., MatFreeResult]] = {"subspace_iteration": svd, "lanczos": hessian_eig,
                                                        "trace_estimate": hessian_trace,
                                                        "conjugate_gradients": conjugate_gradients,
                                                        **estimating.ALGORITHMS}
