"""Our traced functions are built without AutoGraph: their bodies branch on Python values only, and AutoGraph
converting them, and everything they call while tracing (the float64 copy's graph rewrite is a Python loop over
thousands of nodes), was most of a cold process's tracing: MobileNetV3Small's float64 probes 9.3 s -> 3.9 s, the
cold process 32.9 s -> 25.6 s (docs/BENCHMARKS.md, eleventh session)."""

from __future__ import annotations

import pytest

from tests import precision_models
from tests.engine.conftest import rand

X = rand((2, 6), seed=3)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(precision_models.cancelling(tmp_path_factory.mktemp("autograph") / "cancelling"))


@pytest.fixture
def conversions(monkeypatch):
    """The functions of ours (modules ``worker.*``) that AutoGraph converts while the test runs (``converted_call``,
    by qualified name). TensorFlow's own (pfor's) and a test model's are not counted."""
    from tensorflow.python.autograph.impl import api

    seen: list[str] = []
    original = api.converted_call

    def counting(f, *args, **kwargs):
        module = getattr(f, "__module__", None) or getattr(getattr(f, "func", None), "__module__", None) or ""
        if module.startswith(("worker.", "bench.")) or module == __name__:
            seen.append(getattr(f, "__qualname__", repr(f)))
        return original(f, *args, **kwargs)

    monkeypatch.setattr(api, "converted_call", counting)
    return seen


@pytest.mark.parametrize("kind,of", [("jacobian", "y"), ("hvp", "loss"), ("hessian_trace", "loss")])
def test_a_guarded_job_traces_its_chunks_and_float64_probes_without_autograph(model_path, tmp_path, kind, of,
                                                                             conversions):
    from worker.engine import TFMemoryProbe, load_model
    from worker.execution import executor_for
    from worker.execution.local import local_context
    from worker.execution.precision import run_guarded

    model = load_model(model_path)
    inputs = {"x": X, "__seeds__": rand((3, 2, 6), seed=4)} if kind == "hvp" else {"x": X}
    ctx = local_context(model, inputs, results_url=str(tmp_path / "r"), job_id="j", probe=TFMemoryProbe(),
                        cache_dir=str(tmp_path / "cache"), kind=kind, of=of, wrt="x")
    manifest = run_guarded(executor_for(ctx.job), ctx, keep_copy=False)
    assert manifest["precision_probes"] > 0 and manifest["precision_error"] is not None
    assert not conversions, f"AutoGraph converted {sorted(set(conversions))[:10]}"


def test_the_count_sees_a_converted_function(conversions):
    """The check above can fail: a tf.function with AutoGraph on is seen."""
    import tensorflow as tf

    def body(x):
        return x * 2

    tf.function(body)(tf.constant(1.0))
    assert any("body" in name for name in conversions)
