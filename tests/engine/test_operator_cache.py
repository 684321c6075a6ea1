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
