"""The precision guard (issue 27): float64 copies of float32 models, error estimates from float64 probes against
dense float64 references (GradientTape on the float64 copy), and ``precision: "auto"``'s promotion.

The model ``tests.precision_models.cancelling`` loses ~4 digits to cancellation in every derivative w.r.t. its
input; its derivatives w.r.t. the weights do not cancel (float32's usual ~1e-7)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from contracts import storage
from tests import models, precision_models
from tests.engine.conftest import rand

X = rand((2, 6), seed=1)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from worker.engine import load_model

    root = tmp_path_factory.mktemp("precision")
    paths = {"cancelling": precision_models.cancelling(root / "cancelling"),
             "float64": models.float64_model(root / "float64"),
             "batch_norm": precision_models.batch_norm(root / "batch_norm"),
             "training_norm": precision_models.batch_norm(root / "training_norm", training=True)}
    return {name: load_model(str(path)) for name, path in paths.items()}


def run(model, inputs, tmp_path, job_id="p", **options):
    """A job through the executors and the guard, as ``jacobian compute`` runs it: its manifest and main array."""
    from worker.engine import TFMemoryProbe
    from worker.execution import executor_for
    from worker.execution.local import local_context
    from worker.execution.precision import run_guarded

    ctx = local_context(model, inputs, results_url=str(tmp_path), job_id=job_id, probe=TFMemoryProbe(), **options)
    manifest = run_guarded(executor_for(ctx.job), ctx)
    group = storage.open_group(manifest["uri"], mode="r")
    return manifest, np.asarray(group[manifest["array"]][...]), dict(group.attrs)


def truth(model, of, wrt="x", x=X):
    """The dense float64 reference: GradientTape's Jacobian (or Hessian) of the float64 copy."""
    import tensorflow as tf

    from worker.engine.float64 import float64_model

    m64 = float64_model(model)
    xt = tf.constant(x.astype(np.float64))
    target = xt if wrt == "x" else m64.variables[wrt]
    with tf.GradientTape(persistent=True) as outer:
        outer.watch(xt)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = m64.fn(x=xt)[of]
        if of != "loss":
            return outer.jacobian(y, target).numpy() if wrt == "x" else tape.jacobian(y, target).numpy()
        g = tape.gradient(y, xt)
    return outer.jacobian(g, xt).numpy()


def relative(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def test_the_float64_copy_computes_the_same_function_in_float64(built):
    import tensorflow as tf

    from worker.engine.float64 import float64_model

    model = built["cancelling"]
    m64 = float64_model(model)
    assert float64_model(model) is m64   # built once per loaded model
    assert m64.output_specs["y"].dtype == tf.float64 and m64.variables["w1"].dtype == tf.float64
    y32 = model.fn(x=tf.constant(X))["y"].numpy()
    y64 = m64.fn(x=X.astype(np.float64))["y"].numpy()
    assert y64.dtype == np.float64 and relative(y32, y64) < 1e-3
    assert float64_model(built["float64"]) is built["float64"]   # a float64 model is its own copy


def test_fused_batch_norm_runs_in_float64_as_plain_math_and_training_mode_says_why(built):
    import tensorflow as tf

    from worker.engine.float64 import Float64Unavailable, float64_model

    model = built["batch_norm"]
    image = rand((2, 6, 6, 2), seed=3)
    y32 = model.fn(image=tf.constant(image))["y"].numpy()
    y64 = float64_model(model).fn(image=image.astype(np.float64))["y"].numpy()
    assert y64.dtype == np.float64 and relative(y32, y64) < 1e-5
    m64 = float64_model(built["training_norm"])   # its graph is built on its first call, which says why not
    with pytest.raises(Float64Unavailable, match="op FusedBatchNormV3 .*has no float64 kernel"):
        m64.fn(image=image.astype(np.float64))
    with pytest.raises(Float64Unavailable, match="op FusedBatchNormV3 .*has no float64 kernel"):
        float64_model(built["training_norm"])   # and the model remembers it


@pytest.mark.parametrize("kind,of", [("jacobian", "y"), ("hessian", "loss"), ("batch_jacobian", "y")])
def test_a_dense_estimate_has_the_order_of_the_true_float32_error(built, tmp_path, kind, of):
    manifest, stored, attrs = run(built["cancelling"], {"x": X}, tmp_path, kind=kind, of=of, wrt="x")
    want = truth(built["cancelling"], of)
    if kind == "batch_jacobian":   # (2, 6, 2, 6) -> the per-example blocks (2, 6, 6)
        want = np.stack([want[b, :, b, :] for b in range(2)])
    error = relative(stored, want)
    assert error > 1e-5   # the model really loses digits in float32
    estimate = manifest["precision_error"]
    assert error / 10 < estimate < error * 10, (estimate, error)
    assert manifest["precision_probes"] == 3 and "float64" in manifest["precision_method"]
    assert attrs["precision_error"] == estimate   # in the result group's attributes too
    on_disk = json.loads(storage.read_bytes(storage.join(storage.join(str(tmp_path), "p"), "manifest.json")))
    assert on_disk["precision_error"] == estimate and "precision_promoted" not in on_disk


def test_an_estimate_without_cancellation_is_float32_rounding(built, tmp_path):
    manifest, stored, _ = run(built["cancelling"], {"x": X}, tmp_path, kind="jacobian", of="y", wrt="variables/w2")
    assert manifest["precision_error"] < 1e-6
    assert relative(stored, truth(built["cancelling"], "y", wrt="w2")) < 1e-6


@pytest.mark.parametrize("kind,of", [("jvp", "y"), ("vjp", "y"), ("hvp", "loss")])
def test_a_product_estimate_has_the_order_of_the_true_error(built, tmp_path, kind, of):
    seeds = rand((4, 2, 6), seed=5)
    manifest, stored, _ = run(built["cancelling"], {"x": X, "__seeds__": seeds}, tmp_path, kind=kind, of=of, wrt="x")
    full = truth(built["cancelling"], of).reshape(12, 12)
    flat = seeds.reshape(4, 12).astype(np.float64)
    want = flat @ full if kind == "vjp" else flat @ full.T
    error = max(relative(stored[i], want[i].reshape(stored[i].shape)) for i in range(4))
    assert error > 1e-5 and error / 10 < manifest["precision_error"] < error * 10, (manifest["precision_error"], error)


@pytest.mark.parametrize("kind,options", [("hessian_eig", {"rank": 2}), ("hessian_trace", {}),
                                          ("hessian_diag", {})])
def test_a_spectral_kind_estimates_the_error_of_the_product_it_applies(built, tmp_path, kind, options):
    manifest, _, _ = run(built["cancelling"], {"x": X}, tmp_path, kind=kind, of="loss", wrt="x", **options)
    assert 1e-5 < manifest["precision_error"] < 1e-2
    assert "hvp products, working precision against float64" in manifest["precision_method"]


def test_auto_promotes_and_the_result_is_the_float64_truth(built, tmp_path):
    manifest, stored, attrs = run(built["cancelling"], {"x": X}, tmp_path, kind="jacobian", of="y", wrt="x",
                                  precision="auto", output_dtype="float64")
    want = truth(built["cancelling"], "y")
    assert manifest["precision_promoted"] is True and attrs["precision_promoted"] is True
    assert manifest["precision_error_before"] > manifest["precision_tol"] == 1e-5
    assert "exceeded tol" in manifest["precision_reason"]
    assert stored.dtype == np.float64 and relative(stored, want) < 1e-10
    assert manifest["precision_error"] < 1e-10


def test_auto_keeps_the_requested_dtype_and_a_result_within_tol(built, tmp_path):
    seeds = rand((3, 2, 6), seed=6)
    manifest, stored, _ = run(built["cancelling"], {"x": X, "__seeds__": seeds}, tmp_path, kind="hvp", of="loss",
                              wrt="x", precision="auto")
    assert manifest["precision_promoted"] is True and stored.dtype == np.float32
    assert manifest["precision_error"] < 1e-6   # float32 rounding of the float64 products
    kept, _, _ = run(built["cancelling"], {"x": X}, tmp_path, job_id="q", kind="jacobian", of="y",
                     wrt="variables/w2", precision="auto")
    assert kept["precision_promoted"] is False and kept["precision_error"] < kept["precision_tol"]


def test_auto_takes_the_requests_tol_where_the_kind_has_one(built, tmp_path):
    manifest, _, _ = run(built["cancelling"], {"x": X}, tmp_path, kind="hessian_eig", of="loss", wrt="x", rank=1,
                         tol=0.2, precision="auto")
    assert manifest["precision_tol"] == 0.2 and manifest["precision_promoted"] is False


def test_a_float64_model_records_no_error_and_spends_no_probe(built, tmp_path):
    x = rand((2, 5), "float64")
    manifest, _, _ = run(built["float64"], {"x": x}, tmp_path, kind="jacobian", of="y", wrt="x", precision="auto")
    assert manifest["precision_error"] == 0.0 and manifest["precision_probes"] == 0
    assert not manifest.get("precision_promoted")


def test_a_model_without_float64_kernels_succeeds_with_the_reason_and_auto_warns(built, tmp_path):
    image = rand((2, 6, 6, 2), seed=3)
    manifest, _, _ = run(built["training_norm"], {"image": image}, tmp_path, kind="jacobian", of="y", wrt="image",
                         precision="auto")
    assert manifest.get("precision_error") is None
    assert "FusedBatchNormV3" in manifest["precision_method"]
    assert "precision 'auto' could not check or promote" in manifest["warning"]


def test_the_request_takes_precision_auto():
    from pydantic import ValidationError

    from contracts.jobspec import JobOptions

    assert JobOptions(precision="auto").precision == "auto"
    with pytest.raises(ValidationError, match="precision"):
        JobOptions(precision="float64")


def test_auto_with_several_shards_is_refused_naming_shards():
    """A float64 recompute is of the whole job: ``auto`` runs in one piece (sharded jobs get the estimate from the
    finalizer, ``tests/integration/test_shards.py``)."""
    from pydantic import ValidationError

    from contracts.jobspec import JobOptions

    assert JobOptions(precision="auto", shards=1).shards == 1
    assert JobOptions(precision="highest", shards=3).shards == 3
    with pytest.raises(ValidationError, match="shards: precision 'auto' computes a job in one piece") as err:
        JobOptions(precision="auto", shards=3)
    assert "set shards to 1 or null" in str(err.value)


def test_a_keras_lstm_gets_its_estimate_after_the_job_differentiated_its_loop(tmp_path):
    """A gradient through ``while_v2`` rewrites the forward ``While`` op (accumulator outputs), after which the
    frozen graph did not import ("... was passed float from .../while:7 incompatible with expected resource"); the
    copy is then made from a fresh load: the estimate is a number, not "unavailable"."""
    import keras

    from worker.engine import load_model

    keras.utils.set_random_seed(3)
    x = keras.Input((6, 3), name="x")
    net = keras.Model(x, {"y": keras.layers.Dense(2)(keras.layers.LSTM(4, return_sequences=True)(x))})
    net.export(str(tmp_path / "lstm"), verbose=False)
    model = load_model(str(tmp_path / "lstm"))
    seq = np.random.default_rng(2).standard_normal((1, 6, 3)).astype("float32")
    manifest, _, attrs = run(model, {"x": seq}, tmp_path / "out", of="y", wrt="x")
    assert manifest["precision_probes"] == 3, manifest["precision_method"]
    assert 0 < manifest["precision_error"] < 1e-5 and attrs["precision_error"] == manifest["precision_error"]


def test_the_operator_sets_the_probes_and_zero_turns_the_estimate_off(built, tmp_path, monkeypatch):
    from contracts.settings import get_settings

    monkeypatch.setenv("JACOBIAN_PRECISION_PROBES", "5")
    get_settings.cache_clear()
    try:
        manifest, _, _ = run(built["cancelling"], {"x": X}, tmp_path / "five", of="y")
        assert manifest["precision_probes"] == 5 and manifest["precision_error"] > 0
        monkeypatch.setenv("JACOBIAN_PRECISION_PROBES", "0")
        get_settings.cache_clear()
        manifest, _, attrs = run(built["cancelling"], {"x": X}, tmp_path / "off", of="y", precision="auto")
        assert manifest["precision_probes"] == 0 and "precision_error" not in attrs
        assert manifest["precision_method"] == "no estimate: JACOBIAN_PRECISION_PROBES=0"
        assert "could not check the result" in manifest["warning"] and not manifest.get("precision_promoted")
    finally:
        monkeypatch.delenv("JACOBIAN_PRECISION_PROBES")
        get_settings.cache_clear()


def test_a_custom_gradient_in_the_model_keeps_its_estimate(tmp_path):
    """Keras' swish is ``tf.nn.silu``, a ``tf.custom_gradient`` whose registered gradient is the float32 model's: the
    float64 copy differentiates its forward ops instead (EfficientNet had "no estimate: TypeError ... Mul")."""
    import keras

    from worker.engine import load_model

    keras.utils.set_random_seed(4)
    x = keras.Input((6,), name="x")
    net = keras.Model(x, {"y": keras.layers.Dense(3, activation="swish")(keras.layers.Dense(5, activation="swish")(x))})
    net.export(str(tmp_path / "swish"), verbose=False)
    model = load_model(str(tmp_path / "swish"))
    manifest, got, _ = run(model, {"x": X}, tmp_path / "out", of="y", wrt="x")
    assert manifest["precision_probes"] == 3, manifest["precision_method"]
    assert 0 <= manifest["precision_error"] < 1e-5


@pytest.mark.parametrize("keep_copy", [True, False])
def test_the_float64_side_runs_before_the_job_and_a_one_job_process_drops_the_copy(built, tmp_path, keep_copy):
    """The guard's float64 products come first (their memory is free again when the job's chunks need theirs);
    ``jacobian compute`` (``keep_copy=False``) also drops the float64 copy before the job, a worker keeps it."""
    from worker.engine import TFMemoryProbe
    from worker.execution import executor_for
    from worker.execution.local import local_context
    from worker.execution.precision import run_guarded

    model = built["cancelling"]
    model.compiled.float64 = None
    ctx = local_context(model, {"x": X}, results_url=str(tmp_path), job_id="order", probe=TFMemoryProbe(), of="y")
    executor = executor_for(ctx.job)
    seen = {}
    job_run = executor.run

    def run_job(c):
        seen["copy during the job"] = model.compiled.float64 is not None
        return job_run(c)

    executor.run = run_job
    manifest = run_guarded(executor, ctx, keep_copy=keep_copy)
    assert seen["copy during the job"] is keep_copy
    assert (model.compiled.float64 is not None) is keep_copy
    assert manifest["precision_probes"] == 3 and manifest["precision_error"] > 1e-6   # the cancelling model's
    assert relative(np.asarray(storage.open_group(manifest["uri"], mode="r")[manifest["array"]][...]),
                    truth(model, "y")) < 1e-2


def test_a_one_job_process_has_collected_the_float64_copy_when_the_job_starts(built, tmp_path, monkeypatch):
    """Dropped is not enough: the copy's compiled probes, their Python bodies and the operator that holds the copy
    are reference cycles, which the guard's collection frees only when nothing still refers to the copy. With the
    automatic collector off (so that only the guard's own collection counts), nothing of the copy is alive when
    the job starts (MobileNetV3Small: 62 MiB of resident memory the job's chunks did not have before)."""
    import gc
    import weakref

    from worker.engine import TFMemoryProbe
    from worker.execution import executor_for, precision
    from worker.execution.local import local_context

    model = built["cancelling"]
    model.compiled.float64 = None
    ctx = local_context(model, {"x": X}, results_url=str(tmp_path), job_id="freed", probe=TFMemoryProbe(), of="y",
                        cache_dir=str(tmp_path / "cache"))   # with a cache folder the probes are compiled functions
    copies, seen, reference = [], {}, precision.reference

    def watched(ctx, ctx64):
        found = reference(ctx, ctx64)
        copies.append(weakref.ref(ctx64.load_model()))
        return found

    monkeypatch.setattr(precision, "reference", watched)
    executor = executor_for(ctx.job)
    job_run = executor.run

    def run_job(c):
        seen["copy alive during the job"] = copies[0]() is not None
        return job_run(c)

    executor.run = run_job
    gc.disable()
    try:
        manifest = precision.run_guarded(executor, ctx, keep_copy=False)
    finally:
        gc.enable()
    assert seen == {"copy alive during the job": False}
    assert manifest["precision_probes"] == 3 and manifest["precision_error"] > 1e-6


def test_auto_keeps_the_copy_it_may_promote_with_in_a_one_job_process(built, tmp_path):
    from worker.engine import TFMemoryProbe
    from worker.execution import executor_for
    from worker.execution.local import local_context
    from worker.execution.precision import run_guarded

    model = built["cancelling"]
    ctx = local_context(model, {"x": X}, results_url=str(tmp_path), job_id="auto", probe=TFMemoryProbe(), of="y",
                        precision="auto")
    manifest = run_guarded(executor_for(ctx.job), ctx, keep_copy=False)
    assert manifest["precision_promoted"] is True and model.compiled.float64 is not None
    assert relative(np.asarray(storage.open_group(manifest["uri"], mode="r")[manifest["array"]][...]),
                    truth(model, "y")) < 1e-6   # float32 rounding of the float64 truth; unpromoted: ~1e-4


def _grappler_passes() -> int:
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    config = config_pb2.ConfigProto()
    config.ParseFromString(context.context().function_call_options.config_proto_serialized)
    return config.graph_options.rewrite_options.meta_optimizer_iterations


def test_the_float64_side_is_optimized_once_in_its_own_thread_and_the_job_as_before(built, tmp_path, monkeypatch):
    """The float64 copy and its products run for a few probes: one pass of the graph optimizer (its second costs
    more than it saves there), in the guard's thread only; the job's functions, and other threads, keep theirs."""
    import threading

    from tensorflow.core.protobuf import rewriter_config_pb2

    from worker.engine import TFMemoryProbe
    from worker.execution import executor_for, precision
    from worker.execution.local import local_context

    one = rewriter_config_pb2.RewriterConfig.ONE
    model = built["cancelling"]
    model.compiled.float64 = None
    ctx = local_context(model, {"x": X}, results_url=str(tmp_path), job_id="passes", probe=TFMemoryProbe(), of="y")
    before, seen, reference = _grappler_passes(), {}, precision.reference

    def watched(*args):
        seen["guard"] = _grappler_passes()
        other = threading.Thread(target=lambda: seen.setdefault("other thread", _grappler_passes()))
        other.start()
        other.join()
        return reference(*args)

    monkeypatch.setattr(precision, "reference", watched)
    executor = executor_for(ctx.job)
    job_run = executor.run
    executor.run = lambda c: seen.setdefault("job", _grappler_passes()) and False or job_run(c)
    manifest = precision.run_guarded(executor, ctx)
    assert before != one
    assert seen == {"guard": one, "other thread": before, "job": before}
    assert manifest["precision_probes"] == 3 and manifest["precision_error"] > 1e-6


def test_one_grappler_pass_is_undone_when_the_float64_side_fails():
    from worker.engine.float64 import one_grappler_pass

    before = _grappler_passes()
    with pytest.raises(RuntimeError), one_grappler_pass():
        assert _grappler_passes() != before
        raise RuntimeError("the float64 side failed")
    assert _grappler_passes() == before
