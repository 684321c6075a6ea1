"""contracts.rules on its own: shapes with None dims, dtype names, variable names; no TensorFlow.

tests/engine/test_rules_agree.py runs the same rules through the API and the engine on real models.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from contracts import rules
from contracts.rules import RuleViolation, Spec

F32 = "float32"
INPUTS = {"x": Spec(F32, (None, 3)), "mask": Spec("bool", (None, 3)), "ids": Spec("int32", (None, 3))}
OUTPUTS = {"y": Spec(F32, (None, 3)), "loss": Spec(F32, ()), "count": Spec("int64", (None,))}
VARIABLES = {"d0/kernel": Spec(F32, (3, 4)), "d0/bias": Spec(F32, (4,)), "out/kernel": Spec(F32, (4, 2)),
             "step": Spec("int64", ())}


def refused(field: str, fn, *args, **kwargs) -> str:
    with pytest.raises(RuleViolation) as info:
        fn(*args, **kwargs)
    assert info.value.field == field and str(info.value).startswith((field + ":", field + ".")), str(info.value)
    return str(info.value)


def test_the_rulebook_imports_neither_tensorflow_nor_numpy():
    code = "import sys, contracts.rules; print('tensorflow' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("shape,one", [((), True), ((1,), True), ((1, 1), True), ((2,), False), ((None,), False),
                                       ((1, None), False), ((0,), False), (None, None)])
def test_one_element(shape, one):
    assert rules.one_element(shape) is one


@pytest.mark.parametrize("shape,declared,fits", [((2, 3), (None, 3), True), ((2, 3), (2, 3), True),
                                                 ((2, 4), (None, 3), False), ((6,), (None, 3), False),
                                                 ((2, 3), None, True), ((), (), True)])
def test_fits(shape, declared, fits):
    assert rules.fits(shape, declared) is fits


@pytest.mark.parametrize("shape", [(), (1,), (1, 1), None])
def test_hessian_of_one_element_or_unknown_rank_passes(shape):
    rules.check_hessian("loss", shape, None)


@pytest.mark.parametrize("shape", [(2,), (None,), (None, 3), (1, 2)])
def test_hessian_of_more_needs_reduce_sum(shape):
    message = refused("of", rules.check_hessian, "y", shape, None, outputs=OUTPUTS)
    assert "set reduce='sum'" in message and "choose an output of one element: 'loss'" in message
    rules.check_hessian("y", shape, "sum")


def test_batch_axes():
    rules.check_batch_axes("y", (None, 3), "x", (4, 3))  # a batch axis of None: decided on the concrete shape
    rules.check_batch_axes("y", (4, 2), "x", (4, 3))
    assert "'y' has 2 and 'x' has 4" in refused("kind", rules.check_batch_axes, "y", (2, 3), "x", (4, 3))
    refused("of", rules.check_batch_axes, "loss", (), "x", (4, 3))
    refused("wrt", rules.check_batch_axes, "y", (None, 3), "x", ())
    refused("wrt", rules.check_batch_axes, "y", (None, 3), "variables/d0/kernel", (3, 4))


def test_find_variable():
    assert rules.find_variable("d0/kernel", VARIABLES) == "d0/kernel"
    assert rules.find_variable("variables/d0/kernel:0", VARIABLES) == "d0/kernel"
    assert rules.find_variable("bias", VARIABLES) == "d0/bias"
    message = refused("wrt", rules.find_variable, "kernel", VARIABLES)
    assert "ambiguous" in message and "'variables/d0/kernel', 'variables/out/kernel'" in message
    refused("wrt", rules.find_variable, "0/kernel", VARIABLES)  # a suffix starts after a '/'
    assert "(the model has no variables)" in refused("wrt", rules.find_variable, "w", {})


def test_a_long_list_is_cut():
    many = {f"layer{i:02d}/kernel": Spec(F32, (2,)) for i in range(30)}
    message = refused("wrt", rules.find_variable, "nope", many)
    assert "'variables/layer09/kernel', ... and 20 more" in message and "layer10" not in message


def test_resolve_of():
    assert rules.resolve_of("y", OUTPUTS, signature="s") == "y"
    assert rules.resolve_of(None, {"y": Spec(F32, (None,)), "n": Spec("int64", ())}, signature="s") == "y"
    assert "several float outputs ('loss', 'y')" in refused("of", rules.resolve_of, None, OUTPUTS, signature="s")
    assert "'count' is int64 and has no derivative; choose one of: 'loss', 'y'" in refused(
        "of", rules.resolve_of, "count", OUTPUTS, signature="s")
    refused("of", rules.resolve_of, "nope", OUTPUTS, signature="s")


def test_resolve_wrt():
    assert rules.resolve_wrt(None, INPUTS, VARIABLES, signature="s") == "x"
    assert rules.resolve_wrt("variables/bias", INPUTS, VARIABLES, signature="s") == "variables/d0/bias"
    assert refused("wrt", rules.resolve_wrt, "ids", INPUTS, VARIABLES, signature="s").startswith(
        "wrt: 'ids' is int32 and cannot be differentiated; choose one of: 'x', or a model variable")
    assert "'mask' is bool" in refused("wrt", rules.resolve_wrt, "mask", INPUTS, VARIABLES, signature="s")
    assert "variable 'step' is int64" in refused("wrt", rules.resolve_wrt, "variables/step", INPUTS, VARIABLES,
                                                 signature="s")
    two = {"a": Spec(F32, (2,)), "b": Spec("float16", (2,))}
    assert "several float inputs ('a', 'b')" in refused("wrt", rules.resolve_wrt, None, two, {}, signature="s")
    assert "no float input" in refused("wrt", rules.resolve_wrt, None, {"ids": INPUTS["ids"]}, {}, signature="s")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_every_float_dtype_is_differentiable(dtype):
    assert rules.resolve_wrt("x", {"x": Spec(dtype, (2,))}, {}, signature="s") == "x"


def test_check_inputs():
    declared = {"x": Spec(F32, (None, 3)), "ids": Spec("int32", (None, 3))}
    rules.check_inputs({"x": Spec(F32, (2, 3)), "ids": Spec("int32", (2, 3))}, declared, signature="s")
    assert "required by signature 's'" in refused("inputs.ids", rules.check_inputs, {"x": Spec(F32, (2, 3))},
                                                  declared, signature="s")
    refused("inputs.z", rules.check_inputs, {"x": Spec(F32, (2, 3)), "ids": Spec("int32", (2, 3)),
                                             "z": Spec(F32, ())}, declared, signature="s")
    refused("inputs.x", rules.check_inputs, {"x": Spec("float64", (2, 3)), "ids": Spec("int32", (2, 3))},
            declared, signature="s")
    refused("inputs.x", rules.check_inputs, {"x": Spec(F32, (2, 4)), "ids": Spec("int32", (2, 4))},
            {"x": declared["x"]} | {"ids": Spec("int32", None)}, signature="s")
    assert "holds no elements" in refused("inputs.x", rules.check_inputs, {"x": Spec(F32, (0, 3))},
                                          {"x": declared["x"]}, signature="s")


def test_check_options():
    rules.check_options(kind="hessian", mode="forward", reduce="sum", output_dtype="float16")
    refused("kind", rules.check_options, kind="laplacian")
    refused("mode", rules.check_options, kind="jacobian", mode="sideways")
    refused("reduce", rules.check_options, kind="hessian", reduce="mean")
    refused("output_dtype", rules.check_options, kind="jacobian", output_dtype="bfloat16")


def test_check_request_resolves_and_applies_the_kind():
    got = rules.check_request(kind="hessian", of="loss", wrt="variables/bias", reduce=None, inputs=INPUTS,
                              outputs=OUTPUTS, variables=VARIABLES, signature="s")
    assert got == rules.Resolved("loss", "variables/d0/bias", (), (4,)) and got.wrt_is_variable
    refused("of", rules.check_request, kind="hessian", of="y", wrt=None, reduce=None, inputs=INPUTS,
            outputs=OUTPUTS, variables=VARIABLES, signature="s")


@pytest.mark.parametrize("of_dtype,wrt_dtype,stored", [
    ("float32", "float32", "float32"), ("float16", "float32", "float32"), ("float32", "float16", "float32"),
    ("float64", "float32", "float64"), ("float16", "float16", "float16"), ("bfloat16", "bfloat16", "float32"),
    ("float16", "bfloat16", "float32"), ("bfloat16", "float64", "float64")])
def test_result_dtype_is_the_wider_of_of_and_wrt(of_dtype, wrt_dtype, stored):
    assert rules.result_dtype(of_dtype, wrt_dtype) == stored
    assert rules.result_dtype(of_dtype, wrt_dtype, "float16") == "float16"  # output_dtype decides when given


def test_a_bfloat16_input_travels_as_float32():
    declared = {"x": Spec("bfloat16", (None, 3))}
    rules.check_inputs({"x": Spec(F32, (2, 3))}, declared, signature="s")
    rules.check_inputs({"x": Spec("bfloat16", (2, 3))}, declared, signature="s")  # in process: ml_dtypes arrays
    message = refused("inputs.x", rules.check_inputs, {"x": Spec("float64", (2, 3))}, declared, signature="s")
    assert "wants bfloat16; send float32 (rounded to bfloat16 by the worker)" in message
    assert rules.wire_dtype("bfloat16") == F32 and rules.wire_dtype("float16") == "float16"
