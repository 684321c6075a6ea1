"""A request's tensors checked against the model's signature: names, dtypes, shapes, ``of``, ``wrt``, the
kind's rules and the result size. Only shapes and dtypes are read (``Described``), so an ``.npz`` is
checked from its headers before any data is inflated; ``check_finite`` then reads the values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from app.errors import InvalidRequest, NonFiniteInput, SignatureMismatch
from app.inputs import numpy_dtype
from contracts.jobspec import DIFFERENTIABLE_DTYPES, JobOptions, Kind
from contracts.savedmodel import VARIABLE_PREFIX, Shape, Signature, TensorSpec, strip_variable_suffix


def _fmt(shape: Shape) -> str:
    return "unknown rank" if shape is None else "[" + ", ".join("None" if d is None else str(d) for d in shape) + "]"


def _names(names: list[str] | Any) -> str:
    return ", ".join(repr(n) for n in names) or "(none)"


def _compatible(shape: tuple[int, ...], spec: Shape) -> bool:
    if spec is None:
        return True
    return len(shape) == len(spec) and all(s is None or s == d for d, s in zip(shape, spec))


class Described(Protocol):
    """What the signature checks need of an input: an array, or an ``.npz`` member's header."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...


def check_signature(tensors: Mapping[str, Described], sig: Signature) -> None:
    """Every signature input given, none unknown, each with its dtype, a compatible shape and at least
    one element. Reads shapes and dtypes only, so ``.npz`` headers are checked before their data."""
    for name in tensors:
        if name not in sig.inputs:
            raise SignatureMismatch(f"inputs.{name}: signature {sig.name!r} has no input {name!r}; its inputs are: "
                                    f"{_names(list(sig.inputs))}", field=f"inputs.{name}")
    for name, spec in sig.inputs.items():
        if name not in tensors:
            raise SignatureMismatch(f"inputs.{name}: required by signature {sig.name!r} ({spec.dtype}, shape "
                                    f"{_fmt(spec.shape)}); add it", field=f"inputs.{name}")
        t = tensors[name]
        if t.dtype != numpy_dtype(spec.dtype):
            raise SignatureMismatch(f"inputs.{name}.dtype: got {t.dtype.name}, the signature wants {spec.dtype}; "
                                    f"send {spec.dtype}", field=f"inputs.{name}")
        if not _compatible(t.shape, spec.shape):
            raise SignatureMismatch(f"inputs.{name}.shape: got {list(t.shape)}, the signature wants "
                                    f"{_fmt(spec.shape)} (None: any size); reshape the input",
                                    field=f"inputs.{name}")
        if math.prod(t.shape) == 0:
            raise SignatureMismatch(f"inputs.{name}.shape: {list(t.shape)} holds no elements, and the Jacobian of "
                                    "an empty input is empty; send at least one example", field=f"inputs.{name}")


def check_finite(arrays: Mapping[str, np.ndarray]) -> None:
    """No float input holds NaN or Inf (``NonFiniteInput`` names the first index)."""
    for name, arr in arrays.items():
        if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16":
            finite = np.isfinite(arr.astype(np.float32) if arr.dtype.name == "bfloat16" else arr)
            if not finite.all():
                first = np.unravel_index(int(np.argmin(finite)), arr.shape) if arr.ndim else ()
                raise NonFiniteInput(f"inputs.{name}: contains NaN or Inf (first at index {list(map(int, first))}); "
                                     "replace non-finite values, the Jacobian is not defined there",
                                     field=f"inputs.{name}")


def resolve_of(of: str | None, sig: Signature) -> str:
    """The output to differentiate; may be omitted when the signature has exactly one output."""
    outputs = list(sig.outputs)
    if of is None:
        if len(outputs) == 1:
            return outputs[0]
        raise SignatureMismatch(f"of: signature {sig.name!r} has outputs {_names(outputs)}; name one with 'of'",
                                field="of")
    if of not in sig.outputs:
        raise SignatureMismatch(f"of: {of!r} is not an output of signature {sig.name!r}; choose one of: "
                                f"{_names(outputs)}", field="of")
    return of


def resolve_wrt(wrt: str | None, sig: Signature, variables: Mapping[str, TensorSpec]) -> str:
    """A float input, or ``variables/<name>`` of a float variable; may be omitted with one float input."""
    floats = [n for n, s in sig.inputs.items() if s.dtype in DIFFERENTIABLE_DTYPES]
    choices = _names(floats) if floats else "a model variable as 'variables/<name>' (see GET /v1/models/signature)"
    if wrt is None:
        if len(floats) == 1:
            return floats[0]
        what = "no float input" if not floats else f"several float inputs ({_names(floats)})"
        raise SignatureMismatch(f"wrt: signature {sig.name!r} has {what}; name one with 'wrt': {choices}",
                                field="wrt")
    if wrt.startswith(VARIABLE_PREFIX):
        name = strip_variable_suffix(wrt[len(VARIABLE_PREFIX):])
        var = variables.get(name)
        if var is None:
            some = _names([VARIABLE_PREFIX + v for v in list(variables)[:10]])
            raise SignatureMismatch(f"wrt: the model has no variable {name!r}; choose one of: {some}", field="wrt")
        if var.dtype not in DIFFERENTIABLE_DTYPES:
            raise SignatureMismatch(f"wrt: variable {name!r} is {var.dtype} and cannot be differentiated; "
                                    f"choose one of: {choices}", field="wrt")
        return VARIABLE_PREFIX + name
    spec = sig.inputs.get(wrt)
    if spec is None:
        raise SignatureMismatch(f"wrt: {wrt!r} is neither an input of signature {sig.name!r} nor "
                                f"'variables/<name>'; choose one of: {choices}", field="wrt")
    if spec.dtype not in DIFFERENTIABLE_DTYPES:
        raise SignatureMismatch(f"wrt: {wrt!r} is {spec.dtype} and cannot be differentiated; choose one of: "
                                f"{choices}", field="wrt")
    return wrt


def _is_scalar(shape: Shape) -> bool:
    return shape is None or all(d is not None for d in shape) and math.prod(d or 0 for d in shape) == 1


def check_kind(options: JobOptions, sig: Signature, of: str, wrt: str,
               arrays: Mapping[str, Described], variables: Mapping[str, TensorSpec]) -> None:
    """Kind-specific rules: a Hessian needs a scalar ``of`` (or ``reduce='sum'``); a batch Jacobian
    needs ``of`` and ``wrt`` with batch axes of equal size."""
    of_shape = sig.outputs[of].shape
    if options.kind == Kind.hessian and options.reduce != "sum" and not _is_scalar(of_shape):
        scalars = [n for n, s in sig.outputs.items() if s.shape == ()]
        alt = f", or choose a scalar output: {_names(scalars)}" if scalars else ""
        raise SignatureMismatch(f"of: {of!r} has shape {_fmt(of_shape)}, but a Hessian needs a scalar output; "
                                f"set reduce='sum' for the Hessian of sum({of}){alt}", field="of")
    if options.kind != Kind.batch_jacobian:
        return
    if wrt.startswith(VARIABLE_PREFIX):
        raise SignatureMismatch("wrt: batch_jacobian needs an input with a batch axis, not a variable; use "
                                "kind='jacobian' for a Jacobian with respect to a variable", field="wrt")
    batch_shape = arrays[wrt].shape
    if not batch_shape:
        raise SignatureMismatch(f"wrt: {wrt!r} is a scalar; batch_jacobian needs a batch axis (axis 0); "
                                "use kind='jacobian'", field="wrt")
    if of_shape is not None and len(of_shape) == 0:
        raise SignatureMismatch(f"of: {of!r} is a scalar; batch_jacobian needs an output with a batch axis; "
                                "use kind='jacobian'", field="of")
    if of_shape is not None and of_shape[0] is not None and of_shape[0] != batch_shape[0]:
        raise SignatureMismatch(f"of: {of!r} has batch axis {of_shape[0]} but wrt {wrt!r} has {batch_shape[0]}; "
                                "batch_jacobian needs equal batch sizes, use kind='jacobian'", field="of")


def check_result_size(options: JobOptions, sig: Signature, of: str, wrt: str, arrays: Mapping[str, Described],
                      variables: Mapping[str, TensorSpec], *, max_result_bytes: int) -> None:
    """Refuse a job whose result would pass ``max_result_bytes``, when its size can be known here.

    ``of``'s unknown dims are taken as the batch size when every input with an unknown leading
    dim has the same leading size; otherwise the check is left to the worker.
    """
    of_spec = sig.outputs[of]
    if of_spec.shape is None:
        return
    batch = {arrays[n].shape[0] for n, s in sig.inputs.items() if s.shape and s.shape[0] is None and n in arrays}
    if any(d is None for d in of_spec.shape[1:]) or (of_spec.shape and of_spec.shape[0] is None and len(batch) != 1):
        return
    of_shape = tuple(d if d is not None else next(iter(batch)) for d in of_spec.shape)
    wrt_shape = variables[wrt[len(VARIABLE_PREFIX):]].shape if wrt.startswith(VARIABLE_PREFIX) else arrays[wrt].shape
    if wrt_shape is None or any(d is None for d in wrt_shape):
        return
    if options.kind == Kind.hessian:
        elements = math.prod(wrt_shape) ** 2
    elif options.kind == Kind.batch_jacobian:
        elements = wrt_shape[0] * math.prod(of_shape[1:]) * math.prod(wrt_shape[1:])
    else:
        elements = math.prod(of_shape) * math.prod(wrt_shape)
    size = elements * numpy_dtype(options.output_dtype or of_spec.dtype).itemsize
    if size > max_result_bytes:
        raise InvalidRequest(f"inputs: the result would be {size} bytes, over the limit of {max_result_bytes} "
                             "(JACOBIAN_MAX_RESULT_BYTES); use smaller inputs, kind='batch_jacobian' for "
                             "independent examples, or output_dtype='float16'", field="inputs")
