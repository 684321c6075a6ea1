"""Sparse Jacobians (issue 15): pattern detection against the non-zeros of dense Jacobians, colourings,
compressed products against ``GradientTape.jacobian``, verification that catches a wrong pattern."""

from __future__ import annotations

import numpy as np
import pytest

from tests import sparse_models
from tests.engine.conftest import rand


@pytest.fixture(scope="module")
def sparse_loaded(tmp_path_factory):
    from worker.engine import load_model

    root = tmp_path_factory.mktemp("sparse_models")
    cache: dict[str, object] = {}

    def get(name: str, **options):
        key = name + repr(sorted(options.items()))
        if key not in cache:
            path = root / f"{name}{len(cache)}"
            builder = sparse_models.SPARSE_BUILDERS[name]
            cache[key] = load_model(str(builder(path, **options)))
        return cache[key]

    return get


def dense_jacobian(model, inputs, of, wrt):
    import tensorflow as tf

    x = tf.constant(inputs[wrt])
    others = {n: tf.constant(v) for n, v in inputs.items() if n != wrt}
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = model.fn(**{wrt: x}, **others)[of]
    j = tape.jacobian(y, x, experimental_use_pfor=False)
    return j.numpy().reshape(int(np.prod(y.shape)), -1)


def detect(model, inputs, of, wrt):
    from worker.engine.sparsity.walk import detect as run

    pattern, of_shape, wrt_shape = run(model, inputs, of=of, wrt=wrt)
    return pattern.toarray(), of_shape, wrt_shape


CONVS = [
    ("same", dict(size=9, channels=(3, 2, 3))),
    ("valid", dict(size=9, channels=(3, 2), padding="valid")),
    ("strided", dict(size=10, channels=(4, 3), strides=2)),
]


@pytest.mark.parametrize("options", [c[1] for c in CONVS], ids=[c[0] for c in CONVS])
def test_conv_pattern_is_the_dense_jacobians_nonzeros(sparse_loaded, options):
    model = sparse_loaded("conv", **options)
    size = options["size"]
    inputs = {"image": rand((2, size, size, 3))}
    pattern, of_shape, _ = detect(model, inputs, "out", "image")
    j = dense_jacobian(model, inputs, "out", "image")
    assert pattern.shape == j.shape and of_shape[0] == 2
    np.testing.assert_array_equal(pattern, j != 0)       # tanh and linear layers: structural = numerical
    assert pattern.mean() < 0.5


def test_depthwise_dilated_pooled_pattern(sparse_loaded):
    model = sparse_loaded("depthwise")
    inputs = {"image": rand((1, 12, 12, 3), seed=1)}
    pattern, _, _ = detect(model, inputs, "out", "image")
    np.testing.assert_array_equal(pattern, dense_jacobian(model, inputs, "out", "image") != 0)


def test_relu_and_max_pool_give_a_superset(sparse_loaded):
    model = sparse_loaded("relu_pool")
    inputs = {"image": rand((2, 10, 10, 2), seed=2)}
    pattern, _, _ = detect(model, inputs, "out", "image")
    nonzero = dense_jacobian(model, inputs, "out", "image") != 0
    assert not (nonzero & ~pattern).any()                # never smaller than the truth
    assert (pattern & ~nonzero).any()                    # ReLU and max pooling zero some for these values


def test_mlp_is_dense_per_example_and_block_diagonal_over_the_batch(sparse_loaded):
    model = sparse_loaded("mlp")
    inputs = {"x": rand((4, 6), seed=3)}
    pattern, _, _ = detect(model, inputs, "y", "x")
    np.testing.assert_array_equal(pattern, np.kron(np.eye(4, dtype=bool), np.ones((3, 6), bool)))
    np.testing.assert_array_equal(pattern, dense_jacobian(model, inputs, "y", "x") != 0)


@pytest.mark.parametrize("of", ["y", "z"])
def test_moves_reductions_matmul_and_broadcasting(sparse_loaded, of):
    model = sparse_loaded("array_ops")
    inputs = {"x": rand((2, 4, 5), seed=4)}
    pattern, _, _ = detect(model, inputs, of, "x")
    np.testing.assert_array_equal(pattern, dense_jacobian(model, inputs, of, "x") != 0)


def test_an_op_without_a_rule_is_conservative_still_right_and_named(sparse_loaded):
    from worker.engine.sparsity.walk import detect as run

    model = sparse_loaded("no_rule")
    inputs = {"x": rand((3, 4), seed=5)}
    no_rule: dict[str, str] = {}
    pattern = run(model, inputs, of="y", wrt="x", no_rule=no_rule)[0].toarray()
    nonzero = dense_jacobian(model, inputs, "y", "x") != 0
    assert not (nonzero & ~pattern).any()
    assert pattern.all()                                  # sort: every output reads every input of the op
    assert list(no_rule) == ["TopKV2"] and no_rule["TopKV2"].endswith("TopKV2")


@pytest.mark.parametrize("of", sorted(sparse_models.INDEX_OPS))
def test_index_op_rules_give_the_dense_jacobians_nonzeros(sparse_loaded, of):
    """Reshapes, segment reductions, scatters, gathers, cumulative ops, pads, tiles, strided slices, einsum
    (issue 30): the pattern is exactly the non-zeros, found by the op's rule (none of them is conservative)."""
    from worker.engine.sparsity.walk import detect as run

    model = sparse_loaded("index_ops")
    inputs = {"x": rand((6, 4), seed=11) + 2.0}           # away from 0: products and their gradients never vanish
    no_rule: dict[str, str] = {}
    pattern = run(model, inputs, of=of, wrt="x", no_rule=no_rule)[0].toarray()
    nonzero = dense_jacobian(model, inputs, of, "x") != 0
    assert pattern.shape == nonzero.shape
    np.testing.assert_array_equal(pattern, nonzero)
    assert no_rule == {}                                  # every op of the model had a rule
    assert not pattern.all() and pattern.any()            # not the conservative (all-dense) pattern


def test_keras_conv1d_pattern_is_exact_and_sparse(sparse_loaded):
    """Keras Conv1D (causal dilated, same, strided): ExpandDims, Conv2D, Squeeze, Pad, SpaceToBatchND all ruled."""
    from worker.engine.sparsity.walk import detect as run

    model = sparse_loaded("conv1d", length=64)
    inputs = {"x": rand((2, 64, 2), seed=12)}
    no_rule: dict[str, str] = {}
    pattern = run(model, inputs, of="y", wrt="x", no_rule=no_rule)[0].toarray()
    np.testing.assert_array_equal(pattern, dense_jacobian(model, inputs, "y", "x") != 0)
    assert no_rule == {} and pattern.mean() < 0.1


def test_colourings_are_valid_and_tight_on_a_stencil(sparse_loaded):
    import scipy.sparse as sp

    from worker.engine.sparsity.colouring import colour, lower_bounds

    model = sparse_loaded("conv", size=9, channels=(3, 2, 3))
    from worker.engine.sparsity.walk import detect as run

    pattern, _, _ = run(model, {"image": rand((1, 9, 9, 3))}, of="out", wrt="image")
    for mode in ("forward", "reverse"):
        c = colour(pattern, mode)
        dense = pattern.toarray() if mode == "forward" else pattern.toarray().T
        for k in range(c.count):                          # structurally orthogonal: no row seen twice
            assert dense[:, c.colours == k].sum(axis=1).max() <= 1
        assert c.count == lower_bounds(pattern)[0 if mode == "forward" else 1] == 147
    rng = np.random.default_rng(0)
    random = sp.random(60, 80, density=0.05, random_state=rng, format="csr").astype(bool)
    c = colour(random, "forward")
    assert all(random.toarray()[:, c.colours == k].sum(axis=1).max() <= 1 for k in range(c.count))
    assert colour(random, "forward", limit=2) is None


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_compressed_products_recover_the_jacobian(sparse_loaded, mode):
    import scipy.sparse as sp

    from worker.engine.matfree import build_operator
    from worker.engine.sparsity import compressed
    from worker.engine.sparsity.colouring import colour
    from worker.engine.sparsity.walk import detect as run

    model = sparse_loaded("depthwise")
    inputs = {"image": rand((2, 12, 12, 3), seed=6)}
    pattern, _, _ = run(model, inputs, of="out", wrt="image")
    pattern = compressed.sorted_pattern(pattern)
    op = build_operator(model, inputs, of="out", wrt="image")
    c = colour(pattern, mode)
    products = compressed.compute(op, c, chunk_rows=7)
    rows, cols, values = compressed.entries(pattern, c, products, 0, pattern.shape[0])
    assert np.all(np.diff(rows) >= 0)
    got = sp.coo_array((values, (rows, cols)), shape=pattern.shape).toarray()
    np.testing.assert_allclose(got, dense_jacobian(model, inputs, "out", "image"), rtol=1e-5, atol=1e-6)
    assert compressed.verify(op, pattern, c, products)[0]
    assert op.counts["jvp" if mode == "forward" else "vjp"] >= c.count


def test_verification_catches_a_pattern_that_misses_entries(sparse_loaded):
    import scipy.sparse as sp

    from worker.engine.matfree import build_operator
    from worker.engine.sparsity import compressed
    from worker.engine.sparsity.colouring import colour

    model = sparse_loaded("conv", size=9, channels=(3, 2, 3))
    inputs = {"image": rand((1, 9, 9, 3), seed=7)}
    truth = dense_jacobian(model, inputs, "out", "image") != 0
    # a banded guess, as a user's pattern_uri might be: misses most of the stencil
    n = truth.shape[0]
    guess = compressed.sorted_pattern(sp.csr_array(sp.eye(n, n, format="csr") + sp.eye(n, n, k=1, format="csr"))
                                      .astype(bool))
    op = build_operator(model, inputs, of="out", wrt="image")
    c = colour(guess, "forward")
    ok, worst = compressed.verify(op, guess, c, compressed.compute(op, c))
    assert not ok and worst > 1e-2


def test_plan_falls_back_when_dense(sparse_loaded):
    from worker.engine.sparsity import compressed
    from worker.engine.sparsity.walk import detect as run

    model = sparse_loaded("mlp")
    pattern, _, _ = run(model, {"x": rand((1, 6))}, of="y", wrt="x")
    plan = compressed.plan(pattern)
    assert not plan.sparse and plan.reason.startswith("dense: the pattern holds 100.0%")
    summary = plan.summary("auto")
    assert summary["nnz"] == 18 and summary["density"] == 1.0 and summary["colors"] is None
