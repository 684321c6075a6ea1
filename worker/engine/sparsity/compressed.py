"""A sparse Jacobian from compressed products: one JVP (VJP) per colour of the pattern's columns (rows),
decompressed on the host into the pattern's entries, then verified by random projections.

``plan`` decides from the pattern whether the sparse path pays (``SparsePlan.sparse``; else the reason to
compute densely); ``compute`` runs the compressed products through a ``worker.engine.matfree.Operator``
(seeds per call planned from memory, halved on out-of-memory, like the matrix-free kinds) and returns the
entries as a CSR matrix in the pattern's order (row-major, columns ascending); ``verify`` compares ``u^T J``
of a few random ``u`` computed directly (VJPs) with the sparse matrix's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from worker.engine.sparsity.colouring import Colouring, choose_mode, colour

# The sparse path is taken when its products are at most this share of the dense path's rows and the pattern
# at most this dense. Measured (docs/BENCHMARKS.md, "Sparse Jacobians"): on conv nets the sparse path was
# still faster at 77 % density (147 products for 192 rows); the density bound is storage's, COO's 20 bytes an
# entry (int64 rows and cols, float32 values) against the dense array's 4.
MAX_COLOUR_SHARE = 0.8
MAX_DENSITY = 0.2
VERIFY_SAMPLES = 2
VERIFY_SEED = 20261124


@dataclass
class SparsePlan:
    """What the pattern says: ``colouring`` (None when the sparse path does not pay: ``reason``)."""

    nnz: int
    shape: tuple[int, int]
    colouring: Colouring | None
    reason: str = ""

    @property
    def density(self) -> float:
        return self.nnz / max(1, self.shape[0] * self.shape[1])

    @property
    def sparse(self) -> bool:
        return self.colouring is not None

    def summary(self, source: str) -> dict[str, Any]:
        """``plan.sparsity``: ``source``, ``nnz``, ``density``, ``colors``, ``mode`` (and ``fallback``)."""
        out: dict[str, Any] = {"source": source, "nnz": int(self.nnz), "density": round(self.density, 9),
                               "colors": None if self.colouring is None else int(self.colouring.count),
                               "mode": None if self.colouring is None else self.colouring.mode,
                               "verified": False}
        if self.reason:
            out["fallback"] = self.reason
        return out


def plan(pattern: Any, colouring: Colouring | None = None, *, symmetric: bool = False) -> SparsePlan:
    """Colour ``pattern`` (unless ``colouring`` is given) and say whether the sparse path pays. ``symmetric``: a
    Hessian's pattern, star-coloured for HVPs (``hessian.colour_hessian``)."""
    n_of, n_wrt = pattern.shape
    dense_passes = min(n_of, n_wrt)
    sp_plan = SparsePlan(nnz=int(pattern.nnz), shape=(n_of, n_wrt), colouring=None)
    if sp_plan.density > MAX_DENSITY:
        sp_plan.reason = (f"dense: the pattern holds {sp_plan.density:.1%} of the entries, over "
                          f"{MAX_DENSITY:.0%}: stored as COO it would outgrow the dense array")
        return sp_plan
    limit = max(1, int(MAX_COLOUR_SHARE * dense_passes))
    if colouring is None and symmetric:
        from worker.engine.sparsity.hessian import colour_hessian

        colouring = colour_hessian(pattern, limit=limit)
    elif colouring is None:
        colouring = colour(pattern, choose_mode(pattern), limit=limit)
    if colouring is None or colouring.count > limit:
        sp_plan.reason = (f"dense: the pattern needs more than {limit} compressed products ({MAX_COLOUR_SHARE:.0%} "
                          f"of the dense path's {dense_passes}): no gain")
        return sp_plan
    sp_plan.colouring = colouring
    return sp_plan


def compute(op: Any, colouring: Colouring, *, chunk_rows: int | None = None,
            should_stop: Callable[[], bool] | None = None,
            progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """The compressed products, one per colour: ``(colours, n_of)`` (forward: ``J s_c``) or ``(colours,
    n_wrt)`` (reverse: ``s_c^T J``) in ``op.compute_dtype``; ``entries`` reads the Jacobian out of them."""
    def keep(start: int, products: np.ndarray) -> None:
        if progress is not None:
            progress(start + len(products), colouring.count)

    kind = "jvp" if colouring.mode == "forward" else "vjp"
    products = op.apply(kind, colouring.seeds(op.compute_dtype), chunk_rows=chunk_rows, should_stop=should_stop,
                        on_chunk=keep)
    return np.asarray(products).reshape(colouring.count, -1)


def entries(pattern: Any, colouring: Colouring, products: np.ndarray, start: int, stop: int,
            dtype: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``start:stop`` of J as COO: ``rows``, ``cols`` (int64, row-major, columns ascending) and
    ``values``: entry ``(i, j)`` of the pattern lies in product ``colour[j]`` at ``i`` (forward) or
    ``colour[i]`` at ``j`` (reverse); a Hessian's star colouring: ``hessian.entries``. ``pattern``: CSR with sorted
    indices."""
    if colouring.mode == "star":
        from worker.engine.sparsity import hessian

        return hessian.entries(pattern, colouring, products, start, stop, dtype)
    lo, hi = int(pattern.indptr[start]), int(pattern.indptr[stop])
    cols = pattern.indices[lo:hi].astype(np.int64)
    rows = np.repeat(np.arange(start, stop, dtype=np.int64), np.diff(pattern.indptr[start:stop + 1]))
    if colouring.mode == "forward":
        values = products[colouring.colours[cols], rows]
    else:
        values = products[colouring.colours[rows], cols]
    return rows, cols, values if dtype is None else values.astype(dtype)


def row_blocks(pattern: Any, entries_per_block: int) -> list[tuple[int, int]]:
    """Row ranges holding about ``entries_per_block`` entries each (at least one row)."""
    n = pattern.shape[0]
    out, start = [], 0
    while start < n:
        target = int(pattern.indptr[start]) + entries_per_block
        stop = int(np.searchsorted(pattern.indptr, target, side="right")) - 1
        stop = min(n, max(stop, start + 1))
        out.append((start, stop))
        start = stop
    return out


def verify(op: Any, pattern: Any, colouring: Colouring, products: np.ndarray,
           samples: int = VERIFY_SAMPLES, block_entries: int = 1 << 22, direct_kind: str = "vjp") -> tuple[bool, float]:
    """``u^T J`` for ``samples`` random ``u``, by VJPs (a Hessian's ``direct_kind="hvp"``: ``H u = u^T H``) and
    from the sparse entries, compared column by column:
    column ``j`` agrees when ``|ours_j - direct_j| <= tol * max(|direct_j|, sum_i |u_i J_ij|)`` (a floor of
    1e-7 of the largest such scale), so an entry missed in a column of small values is not hidden by large
    ones elsewhere; NaN where the other has NaN. Returns whether all agree and the largest relative
    difference (``tolerance`` gives ``tol`` by the compute dtype)."""
    n_of, n_wrt = pattern.shape
    rng = np.random.default_rng(VERIFY_SEED)
    u = rng.standard_normal((samples, n_of)).astype(op.compute_dtype)
    direct = np.asarray(op.apply(direct_kind, u), np.float64)
    ours = np.zeros((samples, n_wrt), np.float64)
    size = np.zeros((samples, n_wrt), np.float64)
    for start, stop in row_blocks(pattern, block_entries):
        rows, cols, values = entries(pattern, colouring, products, start, stop)
        values = values.astype(np.float64)
        for k in range(samples):
            weights = u[k, rows].astype(np.float64)
            ours[k] += np.bincount(cols, weights=values * weights, minlength=n_wrt)
            size[k] += np.bincount(cols, weights=np.abs(values * weights), minlength=n_wrt)
    tol = tolerance(op.compute_dtype)
    if not np.array_equal(np.isnan(ours), np.isnan(direct)):
        return False, float("inf")
    finite = np.isfinite(ours) & np.isfinite(direct)
    scale = np.maximum(np.abs(direct), size)
    scale = np.maximum(scale, 1e-7 * float(scale[finite].max(initial=0.0)) or np.finfo(np.float64).tiny)
    relative = np.where(finite, np.abs(ours - direct) / scale, 0.0)
    infinite_ok = np.array_equal(ours[~finite & ~np.isnan(ours)], direct[~finite & ~np.isnan(direct)])
    worst = float(relative.max(initial=0.0))
    return bool(worst <= tol and infinite_ok), worst


def tolerance(dtype: Any) -> float:
    """Verification's relative tolerance for products computed in ``dtype`` (TensorFloat-32 widens it)."""
    from worker.engine.agreement import TF32_TOLERANCE, tf32_enabled

    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:   # bfloat16 by name
        itemsize = 2
    tol = {2: 3e-2, 4: 1e-3}.get(itemsize, 1e-6)
    return max(tol, TF32_TOLERANCE) if tf32_enabled() else tol


def sorted_pattern(pattern: Any) -> Any:
    """``pattern`` as CSR with sorted column indices (the order of the stored entries)."""
    pattern = pattern.tocsr()
    if not pattern.has_sorted_indices:
        pattern = pattern.copy()
        pattern.sort_indices()
    return pattern
