"""The API and the engine judge a request alike: one rulebook (``contracts.rules``), both sides.

Every case is run on the same small SavedModels, built here, through the API's validation of a
``POST /v1/jobs`` body (``app.submit.validate``: signature read without TensorFlow, shapes from
the request) and through the engine's ``build_problem`` on the very same arrays. Either both refuse,
naming the same field, or the API accepts and the engine builds the problem with the same ``of`` and
``wrt``. Each case also states the expected verdict, so a rule that changes on both sides shows too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from app import checks
from app.errors import ApiError, SignatureMismatch, validation_message
from app.submit import validate
from contracts.jobspec import JobOptions
from contracts.savedmodel import read_saved_model
from contracts.settings import Settings
from worker.engine import EngineError, build_problem, compute_in_memory, load_model

ACCEPT = "accept"


def shapes_model(path: Path) -> Path:
    """Inputs ``x`` float32 (None, 3), ``ids`` int32 (None, 3), ``mask`` bool (None, 3). Outputs: ``y``
    (None, 3); ``s`` (), ``s1`` (1,), ``s11`` (1, 1), ``two`` (2,); ``head`` (2, 3): the first two
    examples; ``dbl`` (None, 3): every example twice (2B rows); ``count`` int32 (None,). Variables
    ``dense/kernel``, ``dense/bias``, ``proj/kernel`` (float32) and ``step`` (int32)."""
    import tensorflow as tf

    class Shapes(tf.Module):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(0)
            self.kernel = tf.Variable(rng.normal(size=(3, 3)).astype("float32"), name="dense/kernel")
            self.bias = tf.Variable(rng.normal(size=(3,)).astype("float32"), name="dense/bias")
            self.proj = tf.Variable(rng.normal(size=(3, 3)).astype("float32"), name="proj/kernel")
            self.step = tf.Variable(2, dtype=tf.int32, name="step")

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x"),
                                      tf.TensorSpec([None, 3], tf.int32, name="ids"),
                                      tf.TensorSpec([None, 3], tf.bool, name="mask")])
        def __call__(self, x, ids, mask):
            h = tf.tanh(x @ self.kernel + self.bias) @ self.proj * tf.cast(self.step, tf.float32)
            y = tf.where(mask, h, h + 0.1 * tf.cast(ids, tf.float32))
            s = tf.reduce_sum(y * y)
            return {"y": y, "s": s, "s1": tf.reshape(s, [1]), "s11": tf.reshape(s, [1, 1]),
                    "two": tf.stack([s, tf.reduce_sum(y)]), "head": tf.reshape(y[:2], [2, 3]),
                    "dbl": tf.concat([y, y], axis=0), "count": tf.reduce_sum(ids, axis=1)}

    m = Shapes()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def fixed_model(path: Path) -> Path:
    """A fixed batch: ``x`` float32 (2, 3) -> ``z`` (2, 4) float32 and ``label`` (2,) int64."""
    import tensorflow as tf

    class Fixed(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(np.linspace(-1, 1, 12, dtype="float32").reshape(3, 4), name="w")

        @tf.function(input_signature=[tf.TensorSpec([2, 3], tf.float32, name="x")])
        def __call__(self, x):
            z = tf.sin(x @ self.w)
            return {"z": z, "label": tf.argmax(z, axis=1)}

    m = Fixed()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def two_inputs_model(path: Path) -> Path:
    """Two float inputs ``a``, ``b`` (None, 2) -> one output ``p`` = a * b (None, 2)."""
    import tensorflow as tf

    class Two(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="a"),
                                      tf.TensorSpec([None, 2], tf.float32, name="b")])
        def __call__(self, a, b):
            return {"p": a * b}

    m = Two()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


def twins_model(path: Path) -> Path:
    """Two variables named ``w``: ``a`` (2,) and ``b`` (1, 3); ``unread`` is saved but never read. ``x`` (None, 2)
    -> ``y = tanh(x a) 1 * b`` (None, 3)."""
    import tensorflow as tf

    class Twins(tf.Module):
        def __init__(self):
            super().__init__()
            self.a = tf.Variable([1.0, -2.0], name="w")
            self.b = tf.Variable([[0.5, -1.0, 2.0]], name="w")
            self.unread = tf.Variable(3.0, name="unread")

        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x")])
        def __call__(self, x):
            return {"y": tf.tanh(x * self.a) @ tf.ones([2, 3]) * self.b}

    m = Twins()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.__call__})
    return path


BUILDERS = {"shapes": shapes_model, "fixed": fixed_model, "two": two_inputs_model, "twins": twins_model}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("rules-models")
    for name, build in BUILDERS.items():
        build(base / name)
    return base


@pytest.fixture(scope="module")
def engine_model(root):
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_model(str(root / name))
        return cache[name]

    return get


def tensor(shape, dtype="float32", seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.startswith("int"):
        return rng.integers(0, 5, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def shapes_inputs(batch: int = 3, **override) -> dict[str, np.ndarray]:
    inputs = {"x": tensor((batch, 3)), "ids": tensor((batch, 3), "int32"), "mask": tensor((batch, 3), "bool")}
    inputs.update(override)
    return {k: v for k, v in inputs.items() if v is not None}


# (case id, model, inputs, options, expected: ACCEPT with the resolved (of, wrt), or the refused field)
CASES = [
    # each kind
    ("jacobian", "shapes", shapes_inputs(), {"of": "y"}, (ACCEPT, "y", "x")),
    ("batch_jacobian", "shapes", shapes_inputs(), {"of": "y", "kind": "batch_jacobian"}, (ACCEPT, "y", "x")),
    ("hessian", "shapes", shapes_inputs(), {"of": "s", "kind": "hessian"}, (ACCEPT, "s", "x")),
    ("unknown kind", "shapes", shapes_inputs(), {"of": "y", "kind": "laplacian"}, "kind"),
    ("hessian wrt variable", "shapes", shapes_inputs(), {"of": "s", "kind": "hessian", "wrt": "variables/dense/bias"},
     (ACCEPT, "s", "variables/dense/bias")),
    # the Hessian's rule: an output of exactly one element, or reduce='sum'
    *[(f"hessian of {of} {shape}{' reduce' if reduce else ''}", "shapes", shapes_inputs(),
       {"of": of, "kind": "hessian", **({"reduce": "sum"} if reduce else {})},
       (ACCEPT, of, "x") if reduce or one else "of")
      for of, shape, one in (("s", "()", True), ("s1", "(1,)", True), ("s11", "(1,1)", True), ("two", "(2,)", False),
                             ("y", "(None,3)", False))
      for reduce in (False, True)],
    # the batch axis of a batch Jacobian
    ("batch_jacobian batch None", "shapes", shapes_inputs(5), {"of": "y", "kind": "batch_jacobian"},
     (ACCEPT, "y", "x")),
    ("batch_jacobian batch fixed", "fixed", {"x": tensor((2, 3))}, {"of": "z", "kind": "batch_jacobian"},
     (ACCEPT, "z", "x")),
    ("batch_jacobian fixed of, same batch", "shapes", shapes_inputs(2), {"of": "head", "kind": "batch_jacobian"},
     (ACCEPT, "head", "x")),
    ("batch_jacobian mismatched batch sizes", "shapes", shapes_inputs(4), {"of": "head", "kind": "batch_jacobian"},
     "kind"),
    ("batch_jacobian of a scalar", "shapes", shapes_inputs(), {"of": "s", "kind": "batch_jacobian"}, "of"),
    ("batch_jacobian wrt a variable", "shapes", shapes_inputs(),
     {"of": "y", "kind": "batch_jacobian", "wrt": "variables/dense/kernel"}, "wrt"),
    # wrt: variables by full name, unique suffix, ambiguous suffix, missing
    ("wrt variable full name", "shapes", shapes_inputs(), {"of": "y", "wrt": "variables/dense/kernel"},
     (ACCEPT, "y", "variables/dense/kernel")),
    ("wrt variable with :0", "shapes", shapes_inputs(), {"of": "y", "wrt": "variables/proj/kernel:0"},
     (ACCEPT, "y", "variables/proj/kernel")),
    ("wrt variable unique suffix", "shapes", shapes_inputs(), {"of": "y", "wrt": "variables/bias"},
     (ACCEPT, "y", "variables/dense/bias")),
    ("wrt variable ambiguous suffix", "shapes", shapes_inputs(), {"of": "y", "wrt": "variables/kernel"}, "wrt"),
    ("wrt variable missing", "shapes", shapes_inputs(), {"of": "y", "wrt": "variables/nope"}, "wrt"),
    ("wrt variable suffix not at a /", "shapes", shapes_inputs(), {"of": "y", "wrt": "variables/ense/kernel"}, "wrt"),
    ("wrt integer variable", "shapes", shapes_inputs(), {"of": "y", "wrt": "variables/step"}, "wrt"),
    # two variables of one name: each by its object path, the bare name ambiguous; one the signature never reads
    ("wrt two variables of one name", "twins", {"x": tensor((2, 2))}, {"wrt": "variables/w"}, "wrt"),
    *[(f"wrt variable w at {at}", "twins", {"x": tensor((2, 2))}, {"wrt": f"variables/w@{at}"},
       (ACCEPT, "y", f"variables/w@{at}")) for at in ("a", "b")],
    ("wrt a variable the signature never reads", "twins", {"x": tensor((2, 2))}, {"wrt": "variables/unread"}, "wrt"),
    # dtypes
    ("wrt int32 input", "shapes", shapes_inputs(), {"of": "y", "wrt": "ids"}, "wrt"),
    ("wrt bool input", "shapes", shapes_inputs(), {"of": "y", "wrt": "mask"}, "wrt"),
    ("of an int32 output", "shapes", shapes_inputs(), {"of": "count"}, "of"),
    ("wrt unknown", "shapes", shapes_inputs(), {"of": "y", "wrt": "nope"}, "wrt"),
    ("of unknown", "shapes", shapes_inputs(), {"of": "nope"}, "of"),
    # of / wrt omitted: one candidate or several
    ("of omitted, several float outputs", "shapes", shapes_inputs(), {}, "of"),
    ("wrt omitted, one float input among int and bool", "shapes", shapes_inputs(), {"of": "y"}, (ACCEPT, "y", "x")),
    ("of omitted, one float output and an int one", "fixed", {"x": tensor((2, 3))}, {}, (ACCEPT, "z", "x")),
    ("wrt omitted, several float inputs", "two", {"a": tensor((2, 2)), "b": tensor((2, 2), seed=1)}, {}, "wrt"),
    ("wrt given, several float inputs", "two", {"a": tensor((2, 2)), "b": tensor((2, 2), seed=1)}, {"wrt": "b"},
     (ACCEPT, "p", "b")),
    # inputs
    ("input missing", "shapes", shapes_inputs(mask=None), {"of": "y"}, "inputs.mask"),
    ("input unknown", "two", {"a": tensor((2, 2)), "b": tensor((2, 2)), "c": tensor((2, 2))}, {"wrt": "a"},
     "inputs.c"),
    ("input dtype", "shapes", shapes_inputs(x=tensor((3, 3), "float64")), {"of": "y"}, "inputs.x"),
    ("input shape", "fixed", {"x": tensor((3, 3))}, {}, "inputs.x"),
    ("input empty", "shapes", shapes_inputs(0), {"of": "y"}, "inputs.ids"),  # inputs checked by name
]


def body(model: str, inputs: dict[str, np.ndarray], options: dict) -> bytes:
    tensors = {n: {"shape": list(a.shape), "dtype": a.dtype.name, "data": a.ravel().tolist()}
               for n, a in inputs.items()}
    return json.dumps({"model": {"path": model}, "inputs": tensors, **options}).encode()


def api_verdict(root: Path, tmp_path: Path, model: str, inputs: dict[str, np.ndarray], options: dict):
    """``(ACCEPT, of, wrt)`` or ``(field, message)`` from the API's validation of the JSON body."""
    settings = Settings(model_roots=[str(root)], results_url=str(tmp_path / "results"))
    try:
        queued, _ = validate(body(model, inputs, options), "application/json", {}, settings)
    except ApiError as err:
        assert err.field is not None and err.message.startswith(err.field), err.message
        return err.field, err.message
    except ValidationError as err:  # pydantic: the request's own schema (kind, mode, ...)
        message = validation_message(list(err.errors()))
        return message.split(":")[0], message
    return ACCEPT, queued.of, queued.wrt


def engine_verdict(model, inputs: dict[str, np.ndarray], options: dict):
    """``(ACCEPT, of, wrt)`` or ``(field, message)`` from ``build_problem`` on the same arrays."""
    try:
        problem = build_problem(model, inputs, **options)
    except EngineError as err:
        assert err.field is not None and str(err).startswith(err.field), str(err)
        return err.field, str(err)
    return ACCEPT, problem.of, problem.wrt


@pytest.mark.parametrize("model,inputs,options,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_api_and_engine_agree(root, tmp_path, engine_model, model, inputs, options, expected):
    api = api_verdict(root, tmp_path, model, inputs, options)
    engine = engine_verdict(engine_model(model), inputs, options)
    if api[0] == ACCEPT:
        assert engine == api, f"the API accepts {api}, the engine: {engine}"
    else:
        assert engine[0] == api[0], f"the API refuses {api}, the engine: {engine}"
        if "laplacian" not in json.dumps(options):  # the schema's message is pydantic's, the rest the rulebook's
            assert engine[1] == api[1]
    assert (api if api[0] == ACCEPT else api[0]) == expected, api


def test_the_route_and_check_request_agree(root, tmp_path):
    """``app.checks.check_request`` (one call for all the rules) judges every case as the route does."""
    for name, model, inputs, options, expected in CASES:
        if "kind" in options and options["kind"] == "laplacian":
            continue
        info = read_saved_model(root / model)
        sig = info.signature("serving_default")
        try:
            got = (ACCEPT, *checks.check_request(JobOptions(**options), sig, inputs, info.variables_of(sig.name),
                                                 max_result_bytes=1 << 40))
        except SignatureMismatch as err:
            got = err.field
        except ValidationError as err:   # refused by the request's own rules (the schema), before the signature
            got = str(err.errors()[0]["msg"]).removeprefix("Value error, ").split(":")[0]
        assert got == expected, name


def test_integer_wrt_message_names_the_field_and_the_choices(root, tmp_path, engine_model):
    inputs = shapes_inputs()
    want = "wrt: 'ids' is int32 and cannot be differentiated; choose one of: 'x'"
    assert api_verdict(root, tmp_path, "shapes", inputs, {"of": "y", "wrt": "ids"})[1].startswith(want)
    assert engine_verdict(engine_model("shapes"), inputs, {"of": "y", "wrt": "ids"})[1].startswith(want)


def test_ambiguous_suffix_lists_the_full_names(engine_model):
    _, message = engine_verdict(engine_model("shapes"), shapes_inputs(), {"of": "y", "wrt": "variables/kernel"})
    assert "'variables/dense/kernel', 'variables/proj/kernel'" in message


def test_a_batch_axis_only_a_run_can_tell_is_left_to_the_engine(root, tmp_path, engine_model):
    """``dbl`` is declared (None, 3) but has 2B rows: the signature cannot tell the API, the engine's
    forward pass tells it, and the engine refuses with the rulebook's batch-axis rule."""
    inputs, options = shapes_inputs(2), {"of": "dbl", "kind": "batch_jacobian"}
    assert api_verdict(root, tmp_path, "shapes", inputs, options) == (ACCEPT, "dbl", "x")
    field, message = engine_verdict(engine_model("shapes"), inputs, options)
    assert field == "kind" and "'dbl' has 4 and 'x' has 2" in message


@pytest.mark.parametrize("of", ["s1", "s11"])
def test_hessian_of_a_one_element_output_is_that_of_its_element(engine_model, of):
    """Known answer: ``s1`` and ``s11`` are ``s`` reshaped, so their Hessians are the Hessian of ``s``."""
    model, inputs = engine_model("shapes"), shapes_inputs(2)
    want, _ = compute_in_memory(model, inputs, of="s", kind="hessian")
    got, _ = compute_in_memory(model, inputs, of=of, kind="hessian")
    assert got.shape == (2, 3, 2, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_unique_suffix_differentiates_that_variable(engine_model):
    model, inputs = engine_model("shapes"), shapes_inputs(2)
    want, _ = compute_in_memory(model, inputs, of="y", wrt="variables/dense/bias")
    got, _ = compute_in_memory(model, inputs, of="y", wrt="variables/bias")
    np.testing.assert_array_equal(got, want)


def test_two_variables_of_one_name_are_named_by_their_object_paths(root, tmp_path, engine_model):
    """The first of two variables called ``w`` silently won. The bare name is ambiguous on both sides, the
    message naming each and how to address it; each, so addressed, is the variable at that path."""
    import tensorflow as tf

    model, inputs = engine_model("twins"), {"x": tensor((2, 2))}
    _, message = api_verdict(root, tmp_path, "twins", inputs, {"wrt": "variables/w"})
    assert message == ("wrt: 'variables/w' is ambiguous: 2 variables the signature reads are named 'w'; name one by "
                       "its object path in the SavedModel: 'variables/w@a' (float32 [2]), 'variables/w@b' "
                       "(float32 [1, 3])"), message
    assert read_saved_model(root / "twins").describe("serving_default")["variables"] == {
        "w@a": {"dtype": "float32", "shape": [2], "trainable": True},
        "w@b": {"dtype": "float32", "shape": [1, 3], "trainable": True}}
    for at in ("a", "b"):
        got, _ = compute_in_memory(model, inputs, wrt=f"variables/w@{at}")
        variable = getattr(model.loaded, at)
        with tf.GradientTape() as tape:
            y = model.fn(x=tf.constant(inputs["x"]))["y"]
        np.testing.assert_allclose(got, tape.jacobian(y, variable).numpy(), rtol=1e-6)
