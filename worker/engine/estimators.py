"""Estimates of a symmetric matrix ``A`` that is only applied, never formed: its diagonal, and stochastic Lanczos
quadrature (SLQ) for its spectral density and ``log det``. The matrix is a parameter, ``matvec(V) -> A V`` on a
block of ``k`` vectors ``(k, n) -> (k, n)`` (float64): ``worker.engine.spectra`` passes the Hessian's batched HVPs,
and any other symmetric operator over the wrt axis (a Gauss-Newton matrix) plugs in the same way. The sizes and
defaults are ``contracts.estimators``'.

- ``diagonal``: exact (the unit vectors, ``n`` products in blocks) or Hutchinson's estimator
  ``diag(A) ~ mean_i z_i * (A z_i)`` over Rademacher ``z_i`` (Bekas, Kokiopoulou and Saad 2007), whose per-entry
  sample standard deviation over ``sqrt(probes)`` is the standard error. Entry ``j``'s variance is
  ``sum_{k != j} A_jk^2``: small where ``A`` is diagonally dominant. Probes are run in blocks and folded into a
  running mean and sum of squares (Chan et al.), so memory is a block, not ``probes x n``.
- ``lanczos_quadrature``: for each start vector ``v = z / ||z||``, ``m`` Lanczos steps with full
  reorthogonalisation (twice, classical Gram-Schmidt, as ``spectra.hessian_eig``) give the tridiagonal ``T``;
  its eigenvalues are the nodes ``theta_k`` and the squared first components of its eigenvectors the weights
  ``tau_k`` (summing to 1) of the Gauss quadrature ``v^T f(A) v ~ sum_k tau_k f(theta_k)`` (Golub and Meurant;
  Ubaru, Chen and Saad 2017). Start vectors run in lockstep, a batch of products a step, in groups whose
  basis vectors fit ``contracts.estimators.BASIS_BYTES``. A probe whose Krylov space becomes invariant stops
  early (its quadrature is then exact): its remaining nodes are NaN with weight 0. With ``probes >= n`` the
  start vectors are the ``n`` unit vectors: ``tr f(A) = sum_i e_i^T f(A) e_i`` has no sampling error.
- ``Quadrature.trace(f)``: ``tr f(A) ~ n * mean_i sum_k tau_ik f(theta_ik)`` (``||z||^2 = n`` for Rademacher
  ``z``) with the standard error of the probes' mean (0 with unit vectors).
- ``density``: ``(1/probes) sum_i sum_k tau_ik N(t; theta_ik, sigma^2)`` on an even grid from 5 sigma below the
  smallest node to 5 sigma above the largest; it integrates to 1. ``sigma``: given, else
  ``SIGMA_FRACTION`` of the nodes' range (of their largest magnitude when they are all equal; 1 when all zero).
- ``logdet``: ``tr log(A + damping I)`` from the nodes shifted by ``damping``; a shifted Ritz value ``<= 0``
  proves ``A + damping I`` is not positive definite (Ritz values lie within the spectrum), and the request fails
  naming ``damping`` with the shift that would be needed at least.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from contracts import estimators as sizes
from worker.engine.errors import InvalidRequest

MatVec = Callable[[np.ndarray], np.ndarray]
BLOCK_BYTES = 64 << 20   # probes or unit vectors held at once (float64), besides the products of one block


def block_rows(n: int, total: int) -> int:
    """Vectors of size ``n`` a block holds: ``BLOCK_BYTES`` of float64, at least one, at most ``total``."""
    return max(1, min(total, BLOCK_BYTES // max(1, 8 * n)))


def rademacher(rng: np.random.Generator, k: int, n: int) -> np.ndarray:
    return rng.integers(0, 2, size=(k, n)).astype(np.float64) * 2.0 - 1.0


@dataclass
class Diagonal:
    """``diagonal`` and ``stderr`` ``(n,)``; ``method``: ``exact`` or ``hutchinson``; ``probes``: products spent."""

    diagonal: np.ndarray
    stderr: np.ndarray
    method: str
    probes: int


def diagonal(matvec: MatVec, n: int, *, probes: int, method: str = "auto", seed: int = 0) -> Diagonal:
    """``diag(A)`` ``(n,)``: ``exact`` (``n`` unit-vector products) or ``hutchinson`` (``probes`` Rademacher
    products, per-entry standard error); ``auto``: exact when ``contracts.estimators.exact_diagonal``."""
    if method == "auto":
        method = "exact" if sizes.exact_diagonal(probes, n) else "hutchinson"
    if method == "exact":
        out = np.empty(n)
        step = block_rows(n, n)
        for start in range(0, n, step):
            stop = min(n, start + step)
            eye = np.zeros((stop - start, n))
            eye[np.arange(stop - start), np.arange(start, stop)] = 1.0
            out[start:stop] = np.diagonal(matvec(eye)[:, start:stop])
        return Diagonal(out, np.zeros(n), "exact", n)
    rng = np.random.default_rng(seed)
    mean, m2, count = np.zeros(n), np.zeros(n), 0
    step = block_rows(n, probes)
    while count < probes:
        k = min(step, probes - count)
        z = rademacher(rng, k, n)
        samples = z * matvec(z)                                   # (k, n): z_i * (A z_i)
        block_mean = samples.mean(axis=0)
        block_m2 = ((samples - block_mean) ** 2).sum(axis=0)
        delta = block_mean - mean
        total = count + k
        mean += delta * (k / total)
        m2 += block_m2 + delta ** 2 * (count * k / total)
        count = total
    stderr = np.sqrt(m2 / (count - 1) / count) if count > 1 else np.full(n, np.inf)
    return Diagonal(mean, stderr, "hutchinson", count)


@dataclass
class Quadrature:
    """Lanczos quadrature nodes and weights ``(probes, steps)`` (NaN nodes and zero weights past a probe's
    invariant subspace) of an ``n``-by-``n`` matrix; ``exact``: the start vectors were the unit vectors."""

    nodes: np.ndarray
    weights: np.ndarray
    n: int
    exact: bool
    lengths: np.ndarray    # (probes,): Lanczos steps each probe took

    def trace(self, f: Callable[[np.ndarray], np.ndarray]) -> tuple[float, float]:
        """``tr f(A)`` and its standard error (0 with unit vectors): ``n * mean_i sum_k tau_ik f(theta_ik)``."""
        mask = self.weights > 0
        values = np.zeros_like(self.weights)
        values[mask] = self.weights[mask] * f(self.nodes[mask])
        per_probe = self.n * values.sum(axis=1)
        p = len(per_probe)
        stderr = 0.0 if self.exact or p < 2 else float(per_probe.std(ddof=1) / math.sqrt(p))
        return float(per_probe.mean()), stderr

    @property
    def ritz_range(self) -> tuple[float, float]:
        """The smallest and largest node (Ritz value) of any probe."""
        return float(np.nanmin(self.nodes)), float(np.nanmax(self.nodes))


def lanczos_quadrature(matvec: MatVec, n: int, *, probes: int, steps: int, seed: int = 0, eps: float = 1e-12,
                       on_step: Callable[[int], None] | None = None) -> Quadrature:
    """Nodes and weights of ``min(probes, n)`` start vectors (Rademacher; the unit vectors when ``probes >= n``),
    ``min(steps, n)`` Lanczos steps each (module docstring). ``eps``: the relative size of a residual taken as an
    invariant subspace (the products' rounding); ``on_step(products)`` hears of each batch of products."""
    p, m = sizes.quadrature_shape(probes, steps, n)
    exact = probes >= n
    rng = np.random.default_rng(seed)
    nodes, weights = np.full((p, m), np.nan), np.zeros((p, m))
    lengths = np.zeros(p, np.int64)
    group = max(1, min(p, sizes.BASIS_BYTES // max(1, 8 * (m + 1) * n)))
    for start in range(0, p, group):
        g = min(group, p - start)
        if exact:
            starts = np.zeros((g, n))
            starts[np.arange(g), np.arange(start, start + g)] = 1.0
        else:
            starts = rademacher(rng, g, n) / math.sqrt(n)
        alpha, beta, length = _lanczos(matvec, starts, m, eps, on_step)
        for i in range(g):
            k = int(length[i])
            t = np.diag(alpha[i, :k]) + np.diag(beta[i, :k - 1], 1) + np.diag(beta[i, :k - 1], -1)
            theta, vectors = np.linalg.eigh(t)
            nodes[start + i, :k], weights[start + i, :k] = theta, vectors[0] ** 2
            lengths[start + i] = k
    return Quadrature(nodes, weights, n, exact, lengths)


def _lanczos(matvec: MatVec, starts: np.ndarray, steps: int, eps: float,
             on_step: Callable[[int], None] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lanczos from each row of ``starts`` (unit vectors) in lockstep, full reorthogonalisation: ``alpha``,
    ``beta`` ``(g, steps)`` and each start's number of steps (fewer when its Krylov space is invariant)."""
    g, n = starts.shape
    basis = np.empty((g, steps, n))
    basis[:, 0] = starts
    alpha, beta = np.zeros((g, steps)), np.zeros((g, steps))
    length = np.full(g, steps, np.int64)
    active = list(range(g))
    for j in range(steps):
        w = matvec(basis[active, j])
        if on_step is not None:
            on_step(len(active))
        still = []
        for r, i in enumerate(active):
            wi = w[r]
            alpha[i, j] = float(wi @ basis[i, j])
            q = basis[i, :j + 1]
            for _ in range(2):   # full reorthogonalisation against every basis vector, twice
                wi -= q.T @ (q @ wi)
            beta[i, j] = math.sqrt(float(wi @ wi))
            if j + 1 == steps:
                continue
            scale = max(float(np.abs(alpha[i, :j + 1]).max()), float(beta[i, :j + 1].max()), np.finfo(float).tiny)
            if beta[i, j] <= eps * scale:   # invariant (to rounding): this start's quadrature is exact
                length[i] = j + 1
                continue
            basis[i, j + 1] = wi / beta[i, j]
            still.append(i)
        active = still
        if not active:
            break
    return alpha, beta, length


def sigma_for(quadrature: Quadrature, sigma: float | None = None) -> float:
    """The Gaussian width of ``density``: ``sigma`` when given, else ``SIGMA_FRACTION`` of the nodes' range."""
    if sigma is not None:
        return float(sigma)
    low, high = quadrature.ritz_range
    width = high - low
    if not width > 0:
        width = max(abs(low), abs(high)) or 1.0
    return sizes.SIGMA_FRACTION * width


def density(quadrature: Quadrature, *, sigma: float | None = None,
            points: int = sizes.DENSITY_POINTS) -> tuple[np.ndarray, np.ndarray, float]:
    """``(grid, density, sigma)``: the probes' quadrature measures, averaged and smoothed by a Gaussian of width
    ``sigma`` (``sigma_for``), on ``points`` even points from 5 sigma below the smallest node to 5 above the largest."""
    sigma = sigma_for(quadrature, sigma)
    low, high = quadrature.ritz_range
    grid = np.linspace(low - 5 * sigma, high + 5 * sigma, points)
    mask = quadrature.weights > 0
    theta, tau = quadrature.nodes[mask], quadrature.weights[mask]
    out = np.zeros(points)
    step = max(1, (32 << 20) // (8 * points))   # nodes per pass: at most 32 MiB of kernel values at once
    for start in range(0, len(theta), step):
        z = (grid[:, None] - theta[None, start:start + step]) / sigma
        out += np.exp(-0.5 * z * z) @ tau[start:start + step]
    out /= quadrature.nodes.shape[0] * sigma * math.sqrt(2 * math.pi)
    return grid, out, sigma


def logdet(quadrature: Quadrature, damping: float = 0.0) -> tuple[float, float]:
    """``log det(A + damping I)`` and its standard error; raises ``InvalidRequest`` naming ``damping`` when a
    shifted Ritz value is not positive (the damped matrix is not positive definite)."""
    low = quadrature.ritz_range[0]
    if not low + damping > 0:
        raise InvalidRequest(
            f"damping: H + damping·I is not positive definite with damping={damping:g}: it has a Ritz value "
            f"{low + damping:.6g} <= 0 (H has an eigenvalue at or below {low:.6g}), and log det needs every "
            f"eigenvalue positive; give damping larger than {-low:.6g} (with a margin: the smallest eigenvalue "
            "may lie further down)", field="damping")
    return quadrature.trace(lambda theta: np.log(theta + damping))
