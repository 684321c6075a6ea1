"""Dtypes and values at the edges, against TensorFlow's own ``tape.jacobian``: non-finite derivatives, 16-bit
and mixed-dtype models, Hessians w.r.t. variables and across dtypes, scalar (0-d) sources and results."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.conftest import rand
from tests.engine.reference import tape_hessian, tape_jacobian
from worker.engine import compute_in_memory


def _save(tf, path, module):
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.__call__})
    return path


@pytest.fixture(scope="module")
def edge_models(tmp_path_factory):
    """Small ``tf.Module`` SavedModels, built once for this module: name -> loaded model."""
    import tensorflow as tf

    from tests import models
    from worker.engine import load_model

    root = tmp_path_factory.mktemp("edge_models")

    class Sqrt(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32, name="x")])
        def __call__(self, x):
            return {"y": tf.sqrt(x)}

    class Mixed(tf.Module):
        """float32 ``x``; a float64 scalar ``loss``, a float16 ``y16``; an int32 ``count``."""

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def __call__(self, x):
            x64 = tf.cast(x, tf.float64)
            return {"loss": tf.reduce_sum(tf.sin(x64) * x64 * x64), "y16": tf.cast(tf.tanh(x) * 2.0, tf.float16),
                    "count": tf.shape(x)[0]}

    class Half(tf.Module):
        """float16 ``x`` -> float32 ``y`` (the wider dtype is ``of``'s)."""

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float16, name="x")])
        def __call__(self, x):
            return {"y": tf.cast(x * x, tf.float32) * 3.0}

    class Scalar(tf.Module):
        """A scalar input ``s`` and a vector ``x`` (3,): ``y = x * s**2`` (3,), ``cube = s**3`` ()."""

        @tf.function(input_signature=[tf.TensorSpec([], tf.float32, name="s"),
                                      tf.TensorSpec([3], tf.float32, name="x")])
        def __call__(self, s, x):
            return {"y": x * s * s, "cube": s * s * s}

    class Unused(tf.Module):
        """``b`` is never read: ``y = 2a``, ``loss = sum(a**3)``."""

        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="a"),
                                      tf.TensorSpec([None, 2], tf.float32, name="b")])
        def __call__(self, a, b):
            return {"y": 2.0 * a, "loss": tf.reduce_sum(a * a * a)}

    built = {name: _save(tf, root / name, module) for name, module in
             (("unused", Unused()), ("sqrt", Sqrt()), ("mixed", Mixed()), ("half", Half()), ("scalar", Scalar()))}
    built.update({"float64": models.float64_model(root / "float64"),
                  "mlp16": models.mlp(root / "mlp16", dtype="float16"),
                  "mlp_bf16": models.mlp(root / "mlp_bf16", dtype="bfloat16")})
    return {name: load_model(str(path)) for name, path in built.items()}


def _sqrt_inputs(shape):
    """Zeros (inf on the diagonal of the Jacobian) and a negative value (NaN), among positive values."""
    x = np.abs(rand(shape)) + 0.1
    x[::3, ::2] = 0.0
    x[1, 1] = -1.0
    return {"x": x.astype(np.float32)}


@pytest.mark.parametrize("kind", ["jacobian", "batch_jacobian"])
@pytest.mark.parametrize("start", ["tiled", "vectorized"])
def test_non_finite_derivatives_equal_the_tape_through_trials(edge_models, start, kind):
    """``tape.jacobian`` of ``sqrt`` at 0 is inf (and NaN at -1): calibration, reference rows and the
    trials that ``refine='always'`` runs all see them, and the job returns GradientTape's values."""
    from worker.engine.plan import Plan

    model = edge_models["sqrt"]
    inputs = _sqrt_inputs((64, 3) if kind == "jacobian" else (2, 192))  # 192 rows: calibration, then trials
    want = tape_jacobian(model, inputs, "y", "x", batch=kind == "batch_jacobian")
    assert np.isinf(want).any() and np.isnan(want).any()
    got, report = compute_in_memory(model, inputs, kind=kind, mode="reverse", refine="always",
                                    plan=Plan(strategy=start), check_independence=kind == "batch_jacobian")
    assert not report.failures, report.failures
    tried = {label: r.status for label, r in report.learned.strategies.items() if r.status != "untried"}
    # A trial ran, and no strategy of TensorFlow's own kernels was dropped (XLA may differ from the tape
    # where the derivative is not finite: it is then dropped, and never runs this job)
    assert {"tiled", "vectorized"} <= set(tried) and tried["tiled"] == tried["vectorized"] == "ok", tried
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
@pytest.mark.parametrize("strategy", ["vectorized", "loop", "eager", None])
def test_hessian_of_a_float64_loss_of_a_float32_input(edge_models, mode, strategy):
    """Hessian-vector seeds take ``wrt``'s dtype (float32), not ``of``'s (float64); the result is stored in
    the wider of the two."""
    model = edge_models["mixed"]
    inputs = {"x": rand((2, 3))}
    want = tape_hessian(model, inputs, "loss", "x")
    got, _ = compute_in_memory(model, inputs, of="loss", kind="hessian", mode=mode, strategy=strategy, chunk_rows=4)
    assert got.shape == (2, 3, 2, 3) and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_stored_dtype_is_the_wider_of_of_and_wrt(edge_models, mode):
    """A float16 ``of`` of a float32 ``wrt`` stores float32 (the derivative's dtype), a float32 ``of`` of a
    float16 ``wrt`` too; ``output_dtype`` still decides when given."""
    x = rand((2, 3))
    want = tape_jacobian(edge_models["mixed"], {"x": x}, "y16", "x")
    got, report = compute_in_memory(edge_models["mixed"], {"x": x}, of="y16", mode=mode, chunk_rows=4)
    assert got.dtype == np.float32 and report.learned is not None
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=2e-3, atol=2e-3)
    x16 = {"x": rand((2, 3), "float16")}
    got16, _ = compute_in_memory(edge_models["half"], x16, mode=mode, chunk_rows=4)
    assert got16.dtype == np.float32
    np.testing.assert_allclose(got16, tape_jacobian(edge_models["half"], x16, "y", "x").astype(np.float32),
                               rtol=1e-3, atol=1e-3)
    forced, _ = compute_in_memory(edge_models["mixed"], {"x": x}, of="y16", mode=mode, output_dtype="float16")
    assert forced.dtype == np.float16


@pytest.mark.parametrize("kind", ["jacobian", "batch_jacobian"])
@pytest.mark.parametrize("strategy", ["tiled", "vectorized", None])
@pytest.mark.parametrize("model_name,dtype", [("mlp16", "float16"), ("mlp_bf16", "bfloat16")])
def test_16_bit_models_match_the_tape(edge_models, model_name, dtype, strategy, kind):
    """float16 and bfloat16 models: computed in their own dtype, stored as float16 and float32 (Zarr has no
    bfloat16), equal to ``tape.jacobian`` up to the dtype's precision."""
    import tensorflow as tf

    model = edge_models[model_name]
    x = tf.cast(tf.constant(rand((3, 8))), dtype).numpy()
    want = tape_jacobian(model, {"x": x}, "y", "x", batch=kind == "batch_jacobian").astype(np.float32)
    got, report = compute_in_memory(model, {"x": x}, kind=kind, mode="reverse", strategy=strategy, chunk_rows=3,
                                    check_independence=kind == "batch_jacobian")
    assert not report.failures, report.failures
    assert got.dtype == (np.float16 if dtype == "float16" else np.float32)
    tol = (2e-3 if dtype == "float16" else 2e-2) * float(np.abs(want).max())
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=0, atol=tol)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
@pytest.mark.parametrize("strategy", ["vectorized", "loop", None])
def test_hessian_with_respect_to_a_variable(edge_models, mode, strategy):
    model = edge_models["float64"]
    inputs = {"x": rand((2, 5), "float64")}
    want = tape_hessian(model, inputs, "loss", "variables/w")
    got, report = compute_in_memory(model, inputs, of="loss", wrt="variables/w", kind="hessian", mode=mode,
                                    strategy=strategy, chunk_rows=6)
    assert got.shape == (5, 4, 5, 4)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(got.reshape(20, 20), got.reshape(20, 20).T, atol=1e-9)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_scalar_wrt_and_zero_d_results(edge_models, mode):
    """A scalar ``wrt``: ``dy/ds`` has ``y``'s shape; ``d cube/ds`` and its Hessian are 0-d arrays, shape ()."""
    model = edge_models["scalar"]
    inputs = {"s": np.float32(2.0), "x": np.array([1.0, -2.0, 0.5], np.float32)}
    got, _ = compute_in_memory(model, inputs, of="y", wrt="s", mode=mode)
    assert got.shape == (3,)
    np.testing.assert_allclose(got, tape_jacobian(model, inputs, "y", "s"), rtol=1e-6)
    cube, _ = compute_in_memory(model, inputs, of="cube", wrt="s", mode=mode)
    assert cube.shape == () and float(cube) == pytest.approx(12.0)
    hess, _ = compute_in_memory(model, inputs, of="cube", wrt="s", kind="hessian", mode=mode)
    assert hess.shape == () and float(hess) == pytest.approx(12.0)
    # 'cube' reads 's' alone, but 'x' feeds the signature's function: TensorFlow's gradient is zeros, not None
    dx, _ = compute_in_memory(model, inputs, of="cube", wrt="x", mode=mode)
    assert dx.shape == (3,) and not dx.any()
    np.testing.assert_array_equal(dx, tape_jacobian(model, inputs, "cube", "x"))


def test_integer_of_is_refused_naming_the_field(edge_models):
    from worker.engine import InvalidRequest

    with pytest.raises(InvalidRequest, match=r"^of: 'count' is int32 and has no derivative; choose one of") as info:
        compute_in_memory(edge_models["mixed"], {"x": rand((2, 3))}, of="count")
    assert info.value.field == "of"


@pytest.mark.parametrize("kind,mode", [("jacobian", "forward"), ("hessian", "reverse"), ("hessian", "forward")])
def test_unconnected_wrt_is_refused_in_every_kind_and_mode(edge_models, kind, mode):
    """An input the signature never reads has no gradient at all (None): refused, never zeros."""
    from worker.engine import InvalidRequest

    inputs = {"a": rand((2, 2)), "b": rand((2, 2), seed=1)}
    of = "loss" if kind == "hessian" else "y"
    with pytest.raises(InvalidRequest, match=rf"^wrt: '{of}' does not depend on 'b'") as info:
        compute_in_memory(edge_models["unused"], inputs, of=of, wrt="b", kind=kind, mode=mode)
    assert info.value.field == "wrt"
