"""The numbers of the estimating kinds, shared by the API (request fields, quotes) and the engine: the diagonal
(``hessian_diag``: exact from unit vectors, else Hutchinson's estimate) and stochastic Lanczos quadrature
(``spectral_density``, ``logdet``). No TensorFlow, no numpy.

Which of the two a kind is, its fields say (``steps``: a quadrature; ``probes`` alone: a diagonal), so the same
rules serve the GGN's kinds when they take the same fields.

- Diagonal: the exact diagonal (``n`` products with the unit vectors, in blocks; standard error 0) when the wrt
  size ``n`` is at most ``EXACT_DIAGONAL_MAX`` or ``probes >= n``; else ``probes`` Rademacher probes (Hutchinson).
- Quadrature: ``min(probes, n)`` start vectors (Rademacher; the ``n`` unit vectors when ``probes >= n``, which make
  the trace exact), ``min(steps, n)`` Lanczos steps each: result arrays ``(probes used, steps used)``.
"""

from __future__ import annotations

from collections.abc import Iterable

DIAGONAL_PROBES = 100          # hessian_diag: Rademacher probes when none are asked for
EXACT_DIAGONAL_MAX = 64        # hessian_diag: wrt sizes up to this get the exact diagonal, whatever ``probes`` says
SLQ_PROBES = 10                # spectral_density, logdet: start vectors when none are asked for
SLQ_STEPS = 50                 # spectral_density, logdet: Lanczos steps per start vector when none are asked for
MAX_STEPS = 10_000             # the most Lanczos steps a request may ask for (each keeps a basis vector per probe)
DENSITY_POINTS = 512           # spectral_density: points of the grid the smoothed density is evaluated on
SIGMA_FRACTION = 0.01          # spectral_density: default Gaussian width, this fraction of the Ritz values' range
BASIS_BYTES = 2 << 30          # the Lanczos basis vectors held at once (float64): probes run in groups under it


def is_quadrature(fields: Iterable[str]) -> bool:
    """Whether a kind with request ``fields`` is a Lanczos quadrature (it takes ``steps``)."""
    return "steps" in tuple(fields)


def default_probes(fields: Iterable[str]) -> int:
    return SLQ_PROBES if is_quadrature(fields) else DIAGONAL_PROBES


def exact_diagonal(probes: int, n: int) -> bool:
    """Whether the diagonal of an ``n``-by-``n`` matrix is computed exactly (``n`` unit-vector products)."""
    return n <= EXACT_DIAGONAL_MAX or probes >= n


def quadrature_shape(probes: int, steps: int, n: int) -> tuple[int, int]:
    """``(start vectors, Lanczos steps)``: the shape of the ``nodes`` and ``weights`` arrays."""
    return min(probes, n), min(steps, n)


def shape_words(fields: Iterable[str], probes: int | None, steps: int | None,
                n: int | None) -> dict[str, tuple[int, ...] | None]:
    """The sizes of the axes ``probe``, ``step`` and ``grid`` (``KindSpec.dims`` words) of a kind with ``fields``
    (None: unknown before the worker knows ``n``)."""
    fields = tuple(fields)
    if not is_quadrature(fields):
        return {}
    p, s = probes or SLQ_PROBES, steps or SLQ_STEPS
    used = None if n is None else quadrature_shape(p, s, n)
    return {"probe": None if used is None else (used[0],), "step": None if used is None else (used[1],),
            "grid": (DENSITY_POINTS,)}


def products(fields: Iterable[str], probes: int | None, steps: int | None, n: int | None) -> tuple[int | None, str]:
    """The matrix-vector products a kind with ``fields`` spends (at most, for a quadrature), and what they are."""
    fields = tuple(fields)
    p = probes or default_probes(fields)
    if is_quadrature(fields):
        s = steps or SLQ_STEPS
        if n is None:
            return p * s, "Lanczos steps, one product each, per start vector (fewer when n is smaller)"
        used = quadrature_shape(p, s, n)
        return used[0] * used[1], "Lanczos steps, one product each, per start vector (fewer on an invariant subspace)"
    if n is None:
        return None, "the exact diagonal (n products) or the probes, by the wrt size"
    if exact_diagonal(p, n):
        return n, "the exact diagonal: one product per wrt element"
    return p, "Rademacher probes (Hutchinson), one product each"
