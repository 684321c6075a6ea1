"""Sparse Hessians: the pattern of H, its star colouring, and the symmetric recovery of H's entries from one HVP per
colour (issue 27).

- Pattern: H is the Jacobian of the gradient, so its pattern is the index-set walk (``walk.detect``) of a graph that
  computes ``d sum(of) / d wrt``: a ``tf.function`` around the signature and a ``GradientTape``, whose concrete graph
  holds the forward call (rewritten to give its intermediates) and the backward function. Every rule of the walk is
  an over-approximation, so the pattern is a superset of H's non-zeros; it is symmetrized (``P | P^T``).
- Colouring: star colouring (Gebremedhin, Manne, Pothen 2005, algorithm 4.1: a distance-1 colouring in which every
  path on 4 vertices uses at least 3 colours), greedy in natural order, in time linear in the non-zeros (a dense hub
  row costs its length once). ``recovery`` then checks, entry by entry, that each ``H_ij`` is read from
  ``H s_{colour j}`` at ``i`` (no other neighbour of ``i`` has ``j``'s colour) or, by symmetry, from
  ``H s_{colour i}`` at ``j``; a colouring that leaves one entry unrecoverable is never used: the distance-2
  colouring of the columns (direct recovery, ``colouring.colour`` in forward mode) is taken instead.
- ``entries`` reads rows of H out of the compressed products ``(colours, n)``, row ``c`` = ``H s_c``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from worker.engine.sparsity.colouring import Colouring, colour

STAR = "star"                 # the Colouring mode of a star colouring (symmetric recovery)


def detect(model: Any, inputs: dict[str, Any], *, of: str, wrt: str, no_rule: dict[str, str] | None = None) -> Any:
    """The symmetric pattern of the Hessian of ``sum(of)`` w.r.t. input ``wrt``: a boolean CSR ``(n, n)``, ``wrt``
    flattened row-major. Raises ``walk.PatternUnknown`` (detection could not follow the gradient's graph)."""
    import tensorflow as tf

    from worker.engine.sparsity import walk

    fn = model.fn
    arrays = {name: np.asarray(v) for name, v in inputs.items()}
    specs = {name: tf.TensorSpec(v.shape, tf.as_dtype(v.dtype), name=name) for name, v in arrays.items()}

    def gradient(**kw: Any) -> dict[str, Any]:
        x = kw[wrt]
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(fn(**kw)[of])
        g = tape.gradient(y, x)
        return {"gradient": tf.zeros_like(x) if g is None else g}

    concrete = tf.function(gradient, autograph=False).get_concrete_function(**specs)
    pattern, _, _ = walk.detect(SimpleNamespace(fn=concrete), arrays, of="gradient", wrt=wrt, no_rule=no_rule)
    return symmetrized(pattern)


def symmetrized(pattern: Any) -> Any:
    """``P | P^T`` as a boolean CSR with sorted indices."""
    import scipy.sparse as sp

    p = sp.csr_array(pattern, dtype=bool)
    out = (p + p.T).tocsr().astype(bool)
    out.sum_duplicates()
    out.sort_indices()
    return out


def star_colouring(pattern: Any, *, limit: int | None = None) -> Colouring | None:
    """Greedy star colouring of the adjacency graph of the symmetric ``pattern`` (the diagonal ignored): the fewer
    colours of two orders, largest degree first (a hub, a dense row, first) and the natural order (kept on a tie);
    ``greedy_star`` colours each. None when both need more than ``limit`` colours. The natural order alone gives a
    hub that comes late as many colours as vertices before it: uncoloured, the hub forbids them all to each other."""
    csr = pattern.tocsr()
    degrees = np.diff(csr.indptr)
    first = greedy_star(csr, np.argsort(-degrees, kind="stable"), limit=limit)
    natural = greedy_star(csr, None, limit=limit if first is None else min(limit or first.count, first.count))
    return natural if natural is not None else first


def greedy_star(pattern: Any, order: np.ndarray | None = None, *, limit: int | None = None) -> Colouring | None:
    """Greedy star colouring of the adjacency graph of the symmetric ``pattern`` (the diagonal ignored), algorithm
    4.1 of Gebremedhin, Manne and Pothen (2005), the vertices taken in ``order`` (None: natural): vertex ``v`` may
    not take the colour of a neighbour ``w``, nor the colour of ``x`` two steps away when ``w`` is uncoloured or when
    ``v - w - x - y`` would be a path of two colours. None when it needs more than ``limit`` colours.

    Time O(non-zeros): nothing walks two steps from ``v``. Each vertex ``w`` keeps, as bit masks, the colours of its
    coloured neighbours (``seen``: what an uncoloured ``w`` forbids) and, once coloured, the colours of its
    neighbours ``x`` that have another neighbour of ``w``'s colour (``hubbed``: what a coloured ``w`` forbids
    beyond its own colour); each ``x`` keeps, per colour, the first neighbour of that colour (or that there are
    two). Colouring ``z`` updates them over ``z``'s own neighbours only, so a hub (a dense row: one variable
    coupled to all) costs its degree once, not at every neighbour."""
    csr = pattern.tocsr()
    n = csr.shape[0]
    rows = np.repeat(np.arange(n), np.diff(csr.indptr))
    off = rows != csr.indices                                          # the diagonal is no edge
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows[off], minlength=n))]).tolist()
    indices = csr.indices[off].tolist()
    colours = [-1] * n
    seen = [0] * n                                  # per vertex: the colours of its coloured neighbours
    hubbed = [0] * n                                # per coloured w: the colours it forbids beyond its own
    firsts: list[dict[int, int]] = [{} for _ in range(n)]   # per x: colour -> its first such neighbour; -1: two+
    count = 0
    for v in range(n) if order is None else order.tolist():
        nb = indices[indptr[v]:indptr[v + 1]]
        taken = 0
        for w in nb:
            cw = colours[w]
            taken |= seen[w] if cw < 0 else (1 << cw) | hubbed[w]
        c = (~taken & (taken + 1)).bit_length() - 1                  # the least colour not taken
        if limit is not None and c >= limit:
            return None
        colours[v] = c
        count = max(count, c + 1)
        bit, own, mine = 1 << c, 0, firsts[v]
        for x in nb:
            seen[x] |= bit
            cx, first = colours[x], firsts[x]
            f = first.get(c)
            if f is None:
                first[c] = v
            else:
                if f >= 0:                                            # f - x - v: x's second neighbour of colour c
                    first[c] = -1
                    if cx >= 0:
                        hubbed[f] |= 1 << cx
                if cx >= 0:
                    own |= 1 << cx
            if cx >= 0 and mine.get(cx) == -1:                        # x - v - y with y coloured as x
                hubbed[x] |= bit
        hubbed[v] = own
    return Colouring(STAR, np.asarray(colours, np.int32), max(count, 1))


def direct_mask(rows: np.ndarray, cols: np.ndarray, colours: np.ndarray) -> np.ndarray:
    """For entries ``(rows, cols)`` holding whole rows of the pattern: whether ``H_ij`` is alone in ``H s_{colour j}``
    at ``i`` (no other entry of row ``i`` has column colour ``colour j``)."""
    if rows.size == 0:
        return np.zeros(0, bool)
    count = int(colours.max(initial=0)) + 1
    key = (rows - rows.min()) * count + colours[cols]
    _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
    return counts[inverse.ravel()] == 1


def recoverable(pattern: Any, colouring: Colouring) -> bool:
    """Every entry of the symmetric ``pattern`` can be read from the products of ``colouring``: directly, or from
    the symmetric entry's direct position."""
    import scipy.sparse as sp

    csr = pattern.tocsr()
    rows = np.repeat(np.arange(csr.shape[0], dtype=np.int64), np.diff(csr.indptr))
    cols = csr.indices.astype(np.int64)
    direct = direct_mask(rows, cols, colouring.colours)
    codes = sp.csr_array((np.where(direct, 1, 2).astype(np.int8), csr.indices, csr.indptr), shape=csr.shape)
    transposed = codes.T.tocsr()
    transposed.sort_indices()
    if transposed.nnz != csr.nnz or not np.array_equal(transposed.indices, csr.indices):
        return False   # not symmetric
    return bool(np.all(direct | (transposed.data == 1)))


def colour_hessian(pattern: Any, *, limit: int | None = None) -> Colouring | None:
    """A star colouring whose symmetric recovery is checked, else the distance-2 colouring of the columns (direct
    recovery); None when both need more than ``limit`` colours."""
    star = star_colouring(pattern, limit=limit)
    if star is not None and recoverable(pattern, star):
        return star
    return colour(pattern, "forward", limit=limit)


def entries(pattern: Any, colouring: Colouring, products: np.ndarray, start: int, stop: int,
            dtype: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``start:stop`` of H as COO (``rows``, ``cols`` int64, row-major, columns ascending, ``values``) from the
    products ``(colours, n)``, row ``c`` = ``H s_c``: entry ``(i, j)`` is ``products[colour j, i]`` where direct,
    else ``products[colour i, j]``."""
    lo, hi = int(pattern.indptr[start]), int(pattern.indptr[stop])
    cols = pattern.indices[lo:hi].astype(np.int64)
    rows = np.repeat(np.arange(start, stop, dtype=np.int64), np.diff(pattern.indptr[start:stop + 1]))
    colours = colouring.colours
    values = products[colours[cols], rows]
    if colouring.mode == STAR:
        values = np.where(direct_mask(rows, cols, colours), values, products[colours[rows], cols])
    return rows, cols, values if dtype is None else values.astype(dtype)
