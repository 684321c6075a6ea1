"""The matrix-free route choices kept across processes (``worker.execution.operators``): a second load of the
model (as a new process has) with the same cache folder starts from the chosen routes and spends no checks."""

from __future__ import annotations

import json

import numpy as np

from tests import models


def _operator(path, cache_dir, x):
    from worker.engine import load_model
    from worker.execution.operators import cached_operator

    return cached_operator(load_model(str(path)), {"x": x}, cache_dir=str(cache_dir), of="y", wrt="x", kind="svd")


def test_a_new_process_starts_from_the_stored_routes(tmp_path):
    path = models.mlp(tmp_path / "mlp")
    x = np.random.default_rng(0).standard_normal((3, 8)).astype("float32")
    seeds = np.random.default_rng(1).standard_normal((4, 24))
    first = _operator(path, tmp_path / "cache", x)
    want_jvp, want_vjp = first.jvp(seeds), first.vjp(np.random.default_rng(2).standard_normal((4, 3, 4)))
    assert set(first.labels) == {"jvp", "vjp"} and first.counts["checks"] > 0
    stored = list((tmp_path / "cache" / "operators").glob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["labels"] == first.labels

    second = _operator(path, tmp_path / "cache", x)     # a fresh LoadedModel: nothing shared in memory
    assert second.model is not first.model and second.labels == first.labels
    np.testing.assert_allclose(second.jvp(seeds), want_jvp, rtol=1e-6)
    np.testing.assert_allclose(second.vjp(np.random.default_rng(2).standard_normal((4, 3, 4))), want_vjp, rtol=1e-6)
    assert second.counts["checks"] == 0 and not second.failures

    other_shape = _operator(path, tmp_path / "cache", np.ones((5, 8), "float32"))
    assert other_shape.labels == {}                         # another request: chosen again


def test_an_unreadable_or_foreign_entry_is_a_miss(tmp_path):
    path = models.mlp(tmp_path / "mlp")
    x = np.ones((2, 8), "float32")
    op = _operator(path, tmp_path / "cache", x)
    op.jvp(np.ones((1, 16)))
    (stored,) = (tmp_path / "cache" / "operators").glob("*.json")
    for text in ("{not json", json.dumps({"key": "another", "labels": {"jvp": "forward/vectorized"}}),
                 json.dumps({"key": json.loads(stored.read_text())["key"], "labels": {"jvp": "sideways/rm -rf"}})):
        stored.write_text(text)
        again = _operator(path, tmp_path / "cache", x)
        assert again.labels == {}, text


def _product_fns(op):
    return {kind: op.model.compiled.peek(op.key(kind, label)) for kind, label in op.labels.items()}


def test_a_new_process_binds_the_stored_traces_to_its_own_variables(tmp_path):
    """The chosen functions' graphs are kept (``worker.engine.trace_cache``); a fresh load runs them untraced,
    bound to its own variables (changed here, so a graph that still read the first model's would disagree)."""
    path = models.mlp(tmp_path / "mlp")
    x = np.random.default_rng(0).standard_normal((3, 8)).astype("float32")
    seeds = np.random.default_rng(1).standard_normal((4, 24))
    first = _operator(path, tmp_path / "cache", x)
    first.jvp(seeds), first.vjp(np.ones((2, 3, 4)))
    assert len(list((tmp_path / "cache" / "operators").glob("*.graph.npz"))) == 2
    assert not any(getattr(fn, "graph_from_cache", False) for fn in _product_fns(first).values())

    second = _operator(path, tmp_path / "cache", x)
    for v in second.model.variables.values():
        v.assign(v * 2.0)
    fresh = _operator(path, tmp_path / "nothing_kept", x)
    for v in fresh.model.variables.values():
        v.assign(v * 2.0)
    np.testing.assert_allclose(second.jvp(seeds), fresh.jvp(seeds), rtol=1e-5)
    np.testing.assert_allclose(second.vjp(np.ones((2, 3, 4))), fresh.vjp(np.ones((2, 3, 4))), rtol=1e-5)
    assert all(getattr(fn, "graph_from_cache", False) for fn in _product_fns(second).values())
    assert second.counts["checks"] == 0


def test_a_damaged_trace_is_traced_again(tmp_path):
    path = models.mlp(tmp_path / "mlp")
    x = np.ones((2, 8), "float32")
    seeds = np.random.default_rng(1).standard_normal((3, 16))
    want = _operator(path, tmp_path / "cache", x).jvp(seeds)
    (graph,) = (tmp_path / "cache" / "operators").glob("*.graph.npz")
    graph.write_bytes(b"PK\x03\x04 not a graph")
    again = _operator(path, tmp_path / "cache", x)
    np.testing.assert_allclose(again.jvp(seeds), want, rtol=1e-6)
    assert not any(getattr(fn, "graph_from_cache", False) for fn in _product_fns(again).values())


def test_svd_starts_from_the_last_converged_vectors(tmp_path):
    from worker.engine.spectra import svd

    path = models.mlp(tmp_path / "mlp")
    x = np.random.default_rng(0).standard_normal((3, 8)).astype("float64")
    cold = svd(_operator(path, tmp_path / "cache", x.astype("float32")), 3, tol=1e-5)
    warm = svd(_operator(path, tmp_path / "cache", x.astype("float32")), 3, tol=1e-5)
    other = svd(_operator(path, tmp_path / "cache", x.astype("float32") + 1.0), 3, tol=1e-5)
    assert cold.attrs["start"] == "random" and warm.attrs["start"] == "3 kept vectors + random"
    assert warm.converged and warm.iterations <= cold.iterations and warm.iterations == 1
    np.testing.assert_allclose(warm.arrays["S"], cold.arrays["S"], rtol=1e-4)
    assert other.converged and other.attrs["start"] == "3 kept vectors + random"   # other values, same shapes
    j = _dense(path, x.astype("float32") + 1.0)
    np.testing.assert_allclose(other.arrays["S"], np.linalg.svd(j, compute_uv=False)[:3], rtol=1e-4)


def _dense(path, x):
    import tensorflow as tf

    from worker.engine import load_model

    model = load_model(str(path))
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = model.fn(x=xt)["y"]
    return tape.jacobian(y, xt).numpy().reshape(y.shape.num_elements(), -1)
