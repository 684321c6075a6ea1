"""Star colouring of sparse Hessians (``worker.engine.sparsity.hessian.star_colouring``, issue 27) in time linear in
the non-zeros: the same colours as a naive reference of the same greedy (Gebremedhin, Manne and Pothen 2005,
algorithm 4.1, walking two and three steps from each vertex) in each order, never more colours than the natural order
the engine used before, a valid star colouring by brute force (adjacent
vertices differ, every path on 4 vertices uses at least 3 colours), symmetric recovery equal to the dense Hessian
entry for entry, and patterns with hubs (a dense row and column) at 10^5 variables, where the naive walk was
quadratic and gave up."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from worker.engine.sparsity import hessian


def reference(pattern, order=None) -> np.ndarray:
    """The greedy star colouring of algorithm 4.1 as the paper states it: for each vertex ``v`` in ``order``,
    forbid a coloured neighbour ``w``'s colour, and ``x``'s colour (``x`` two steps away, coloured) when ``w`` is
    uncoloured or some ``y`` next to ``x`` (``y != w``) has ``w``'s colour; take the least colour left."""
    csr = pattern.tocsr()
    n = csr.shape[0]
    nbrs = [[int(j) for j in csr.indices[csr.indptr[i]:csr.indptr[i + 1]] if j != i] for i in range(n)]
    colours = [-1] * n
    for v in range(n) if order is None else order:
        forbidden = set()
        for w in nbrs[v]:
            cw = colours[w]
            if cw >= 0:
                forbidden.add(cw)
            for x in nbrs[w]:
                if x == v or colours[x] < 0:
                    continue
                if cw < 0 or any(y != w and colours[y] == cw for y in nbrs[x]):
                    forbidden.add(colours[x])
        colours[v] = min(set(range(len(forbidden) + 1)) - forbidden)
    return np.asarray(colours)


def is_star_colouring(pattern, colours: np.ndarray) -> bool:
    """Brute force: no edge joins two vertices of one colour, and no path ``a - b - c - d`` on 4 distinct vertices
    has only two colours (``colour a == colour c`` and ``colour b == colour d``)."""
    csr = pattern.tocsr()
    nbrs = [set(csr.indices[csr.indptr[i]:csr.indptr[i + 1]].tolist()) - {i} for i in range(csr.shape[0])]
    for b, around in enumerate(nbrs):
        for c in around:
            if colours[b] == colours[c]:
                return False
            for a in around - {c}:
                for d in nbrs[c] - {a, b}:
                    if colours[a] == colours[c] and colours[b] == colours[d]:
                        return False
    return True


def random_pattern(rng: np.random.Generator, n: int, hubs: int):
    upper = sp.random(n, n, density=float(rng.uniform(0.02, 0.3)), random_state=int(rng.integers(1 << 30)),
                      format="lil")
    for hub in rng.choice(n, size=hubs, replace=False):
        upper[int(hub), :] = 1.0
    return hessian.symmetrized(upper.tocsr() + sp.identity(n))


def recovered(pattern, colouring, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random symmetric H on ``pattern`` and the one read back from its products with the colouring's seeds."""
    n = pattern.shape[0]
    h = rng.standard_normal((n, n))
    h = (h + h.T) * pattern.toarray()
    products = (h @ colouring.seeds("float64").T).T                        # (colours, n): H s_c
    rows, cols, values = hessian.entries(pattern, colouring, products, 0, n)
    got = np.zeros((n, n))
    got[rows, cols] = values
    return got, h


@pytest.mark.parametrize("hubs", [0, 1, 3])
def test_the_same_colours_as_the_naive_walk_and_a_valid_star_colouring(hubs):
    rng = np.random.default_rng(20 + hubs)
    for _ in range(25):
        pattern = random_pattern(rng, int(rng.integers(5, 45)), hubs)
        largest_first = np.argsort(-np.diff(pattern.indptr), kind="stable")
        natural = reference(pattern)
        np.testing.assert_array_equal(hessian.greedy_star(pattern).colours, natural)
        np.testing.assert_array_equal(hessian.greedy_star(pattern, largest_first).colours,
                                      reference(pattern, largest_first.tolist()))
        star = hessian.star_colouring(pattern)
        assert star.count == min(natural.max(), reference(pattern, largest_first.tolist()).max()) + 1
        assert star.count == int(star.colours.max()) + 1 <= natural.max() + 1   # never worse than natural order
        assert is_star_colouring(pattern, star.colours)
        assert hessian.recoverable(pattern, star)
        got, h = recovered(pattern, star, rng)
        np.testing.assert_array_equal(got, h)                               # entry for entry, exactly


def test_the_brute_force_check_catches_a_two_coloured_path():
    path = hessian.symmetrized(sp.diags([np.ones(5)], [1], shape=(6, 6), format="csr"))
    assert not is_star_colouring(path, np.array([0, 1, 0, 1, 0, 1]))        # proper, but 0-1-0-1 paths
    assert not is_star_colouring(path, np.array([0, 0, 1, 2, 0, 1]))        # not even proper
    assert is_star_colouring(path, hessian.star_colouring(path).colours)


def test_the_colour_limit_gives_none():
    pattern = random_pattern(np.random.default_rng(3), 30, 1)
    count = hessian.star_colouring(pattern).count
    assert hessian.star_colouring(pattern, limit=count - 1) is None
    assert hessian.star_colouring(pattern, limit=count).count == count


@pytest.mark.parametrize("hub", [0, 50_000, 99_999])
def test_a_hub_among_100k_variables_is_star_coloured(hub):
    """A tridiagonal pattern of 10^5 variables plus one coupled to all: 4 colours (3 for the path, one for the
    hub), symmetric recovery, where the walk two and three steps from each vertex crossed the hub's 10^5
    neighbours at every vertex (about 40 s before its visit limit returned None, then a dense fallback), and the
    natural order alone gives a hub at ``k`` about ``k`` colours."""
    n = 100_000
    i = np.arange(n - 1)
    rows = np.concatenate([np.arange(n), i, np.full(n, hub)])
    cols = np.concatenate([np.arange(n), i + 1, np.arange(n)])
    pattern = hessian.symmetrized(sp.csr_array((np.ones(len(rows), bool), (rows, cols)), shape=(n, n)))
    colouring = hessian.colour_hessian(pattern, limit=1000)
    assert colouring is not None and colouring.mode == hessian.STAR and colouring.count <= 4, colouring
    assert np.count_nonzero(colouring.colours == colouring.colours[hub]) == 1     # the hub's colour is its own
    h = sp.csr_array((np.random.default_rng(4).standard_normal(pattern.nnz), pattern.indices, pattern.indptr),
                     shape=(n, n))
    h = (h + h.T).tocsr()
    h.sort_indices()
    products = (h @ colouring.seeds("float64").T).T
    got_rows, got_cols, values = hessian.entries(pattern, colouring, products, 0, n)
    want = h[got_rows, got_cols]
    np.testing.assert_allclose(values, want, rtol=1e-12, atol=1e-12)
