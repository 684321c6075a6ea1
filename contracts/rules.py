"""The request rulebook: inputs, ``of``, ``wrt`` and each kind's rules, on dtype names and shapes.

One rulebook, two callers: the API applies it to the signature read from ``saved_model.pb`` and the
request's declared tensors (``app.checks``), the engine to the loaded signature and the concrete
tensors (``worker.engine.problem``). A shape is a tuple whose dims may be ``None`` (unknown), or
``None`` for an unknown rank. Every rule raises ``RuleViolation`` with the field at fault and a
message naming the fix; each side turns it into its own error type. No TensorFlow, no numpy.

The rules (docs/ENGINE_API.md, "Request rules"):

- Inputs: every signature input, with its dtype; a ``bfloat16`` input travels as ``float32`` (numpy, JSON and
  ``.npz`` have no bfloat16: ``WIRE_DTYPES``) and the engine rounds it to bfloat16.
- ``kind``: ``jacobian``, ``batch_jacobian`` or ``hessian``.
- Differentiable dtypes: ``float16``, ``bfloat16``, ``float32``, ``float64``, for ``of`` and ``wrt``.
- ``of`` may be omitted when the signature has exactly one float output; ``wrt`` when it has exactly
  one float input (a variable is never guessed).
- ``wrt: "variables/<name>"``: the full name (``:0`` optional) or a suffix that ends exactly one
  variable's name at a ``/`` (``kernel`` of the only layer that has one); the full name is returned.
  Variables the signature reads that share a name are ``<name>@<object path>`` (``w@a``, ``w@b``); the
  bare name is then refused as ambiguous, listing them.
- Hessian: ``of`` must hold exactly one element by its declared shape (``()``, ``(1,)``, ``(1, 1)``,
  ...; a ``None`` dim may be anything, so it does not qualify), or ``reduce='sum'`` (any shape).
- Batch Jacobian: ``wrt`` an input (not a variable) and ``of`` both with a batch axis (axis 0),
  of equal size where both sizes are known.
- The stored dtype (``result_dtype``): ``output_dtype`` when given, else the wider of ``of``'s and
  ``wrt``'s dtypes, the one the derivative is computed in; bfloat16 is stored as float32.

What only a run can tell (an output of unknown rank, an output batch axis of ``None``) passes here
on the signature and is decided by the same rule on the concrete shapes in the engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from contracts.jobspec import DENSE_KINDS, DIFFERENTIABLE_DTYPES, STORABLE_DTYPES
from contracts.jobspec import MATRIX_FREE_HESSIAN_KINDS as MATRIX_FREE_HESSIAN_KINDS  # the rulebook's, re-exported
from contracts.kinds import kind_spec, no_batch_axis_variable
from contracts.savedmodel import VARIABLE_PREFIX, Shape, strip_variable_suffix

KINDS = DENSE_KINDS   # the kinds this rulebook's dense rules cover (contracts.kinds: family dense)
MODES = ("auto", "reverse", "forward")
REDUCES = ("sum",)
MAX_LISTED = 10  # names listed in a message before "... and N more"


class RuleViolation(ValueError):
    """A request breaks a rule; ``field`` is the request field at fault, ``str(err)`` names the fix."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class Described(Protocol):
    """What a rule reads of a tensor, input, output or variable: its dtype name and shape."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> Shape: ...


@dataclass(frozen=True)
class Spec:
    """A dtype name (``"float32"``) and a shape (``None`` dims unknown; ``None``: unknown rank)."""

    dtype: str
    shape: Shape


@dataclass(frozen=True)
class Resolved:
    """``of`` and ``wrt`` resolved (``wrt``: an input name or ``variables/<full name>``) and their shapes."""

    of: str
    wrt: str
    of_shape: Shape
    wrt_shape: Shape

    @property
    def wrt_is_variable(self) -> bool:
        return self.wrt.startswith(VARIABLE_PREFIX)


def names(items: Iterable[str], *, limit: int = MAX_LISTED) -> str:
    """``'a', 'b'`` sorted (at most ``limit``, then ``... and N more``), or ``(none)``."""
    items = sorted(items)
    text = ", ".join(repr(n) for n in items[:limit]) or "(none)"
    return text + (f", ... and {len(items) - limit} more" if len(items) > limit else "")


def fmt_shape(shape: Shape) -> str:
    """``[None, 8]``, or ``unknown rank``."""
    return "unknown rank" if shape is None else "[" + ", ".join("None" if d is None else str(d) for d in shape) + "]"


def is_differentiable(dtype: str) -> bool:
    return dtype in DIFFERENTIABLE_DTYPES


def check_options(*, kind: str, mode: str = "auto", reduce: str | None = None,
                  output_dtype: str | None = None) -> None:
    """``kind``, ``mode``, ``reduce`` and ``output_dtype`` are among the supported values."""
    if kind not in KINDS:
        raise RuleViolation(f"kind: {kind!r} is not supported; use one of: {names(KINDS)}", field="kind")
    if mode not in MODES:
        raise RuleViolation(f"mode: {mode!r} is not supported; use one of: {names(MODES)}", field="mode")
    if reduce is not None and reduce not in REDUCES:
        raise RuleViolation(f"reduce: {reduce!r} is not supported; use 'sum' or omit it", field="reduce")
    if output_dtype is not None and output_dtype not in STORABLE_DTYPES:
        raise RuleViolation(f"output_dtype: {output_dtype!r} cannot be stored (Zarr v3 has no bfloat16); use one "
                            f"of: {names(STORABLE_DTYPES)}", field="output_dtype")


_FLOAT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def result_dtype(of_dtype: str, wrt_dtype: str, output_dtype: str | None = None) -> str:
    """The dtype a result is stored in: ``output_dtype`` when given, else the wider of ``of``'s and ``wrt``'s
    dtypes (a float16 output of a float32 input: float32, as a VJP w.r.t. it is; a float64 loss of a float32
    input: float64), as float32 where that is bfloat16 (Zarr v3 has no bfloat16) or mixes both 16-bit kinds."""
    if output_dtype is not None:
        return output_dtype
    dtypes = {of_dtype, wrt_dtype}
    widest = max(_FLOAT_BYTES.get(d, 4) for d in dtypes)
    if widest == 2:
        return "float16" if dtypes == {"float16"} else "float32"
    return "float64" if widest == 8 else "float32"


def fits(shape: Shape, declared: Shape) -> bool:
    """``shape`` is one the ``declared`` shape admits (same rank; a ``None`` dim admits any size)."""
    if declared is None:
        return True
    if shape is None:
        return False
    return len(shape) == len(declared) and all(s is None or s == d for d, s in zip(shape, declared))


WIRE_DTYPES = {"bfloat16": "float32"}  # how a tensor of this dtype travels (numpy has no bfloat16)


def wire_dtype(dtype: str) -> str:
    """The dtype a request sends for an input of ``dtype``: ``float32`` for ``bfloat16``, else ``dtype``."""
    return WIRE_DTYPES.get(dtype, dtype)


def check_inputs(given: Mapping[str, Described], declared: Mapping[str, Described], *, signature: str) -> None:
    """Every declared input given, none unknown, each with the declared dtype (or its ``wire_dtype``: float32
    for a bfloat16 input), a shape that fits and at least one element (the Jacobian of an empty input is
    empty)."""
    for name in sorted(given):  # sorted: both sides report the same input first
        if name not in declared:
            raise RuleViolation(f"inputs.{name}: signature {signature!r} has no input {name!r}; its inputs are: "
                                f"{names(declared)}", field=f"inputs.{name}")
    for name, spec in sorted(declared.items()):
        if name not in given:
            raise RuleViolation(f"inputs.{name}: required by signature {signature!r} ({spec.dtype}, shape "
                                f"{fmt_shape(spec.shape)}); add it", field=f"inputs.{name}")
        t = given[name]
        if t.dtype not in (spec.dtype, wire_dtype(spec.dtype)):
            rounded = " (rounded to bfloat16 by the worker)" if spec.dtype == "bfloat16" else ""
            raise RuleViolation(f"inputs.{name}.dtype: got {t.dtype}, the signature wants {spec.dtype}; "
                                f"send {wire_dtype(spec.dtype)}{rounded}", field=f"inputs.{name}")
        if not fits(t.shape, spec.shape):
            raise RuleViolation(f"inputs.{name}.shape: got {fmt_shape(t.shape)}, the signature wants "
                                f"{fmt_shape(spec.shape)} (None: any size); reshape the input", field=f"inputs.{name}")
        if t.shape is not None and math.prod(d or 0 for d in t.shape) == 0:
            raise RuleViolation(f"inputs.{name}.shape: {fmt_shape(t.shape)} holds no elements, and the Jacobian of "
                                "an empty input is empty; send at least one example", field=f"inputs.{name}")


def resolve_of(of: str | None, outputs: Mapping[str, Described], *, signature: str) -> str:
    """The output to differentiate: ``of``, or when omitted the signature's only float output."""
    floats = [n for n, s in outputs.items() if is_differentiable(s.dtype)]
    if of is None:
        if len(floats) == 1:
            return floats[0]
        what = "no float output" if not floats else f"several float outputs ({names(floats)})"
        raise RuleViolation(f"of: signature {signature!r} has {what}; name the output to differentiate with 'of'"
                            + (f": {names(floats)}" if floats else ""), field="of")
    return _differentiable_member("of", of, outputs, missing=f"is not an output of signature {signature!r}",
                                  not_float="has no derivative", choices=names(floats))


def _differentiable_member(field: str, name: str, specs: Mapping[str, Described], *, missing: str,
                           not_float: str, choices: str) -> str:
    """``name``, when ``specs`` has it with a float dtype; else the field's error, listing ``choices``."""
    if name not in specs:
        raise RuleViolation(f"{field}: {name!r} {missing}; choose one of: {choices}", field=field)
    dtype = specs[name].dtype
    if not is_differentiable(dtype):
        raise RuleViolation(f"{field}: {name!r} is {dtype} and {not_float}; choose one of: {choices}", field=field)
    return name


def find_variable(name: str, variables: Iterable[str] | Mapping[str, Described]) -> str:
    """The full name of the variable ``name`` names (``variables/`` prefix and ``:0`` optional): itself,
    or the one variable whose name ends with ``/<name>``. Variables that share a name are known as
    ``<name>@<object path>`` (``contracts.savedmodel.variable_names``); their bare name is ambiguous."""
    key = strip_variable_suffix(name.removeprefix(VARIABLE_PREFIX))
    known = list(variables)
    if key in known:
        return key

    def listed(found: list[str]) -> str:
        specs = variables if isinstance(variables, Mapping) else {}
        return ", ".join(f"'{VARIABLE_PREFIX}{n}'" + (f" ({specs[n].dtype} {fmt_shape(specs[n].shape)})"
                                                      if n in specs else "") for n in sorted(found))

    same = [n for n in known if n.partition("@")[0] == key]
    if same:
        raise RuleViolation(f"wrt: '{VARIABLE_PREFIX}{key}' is ambiguous: {len(same)} variables the signature reads "
                            f"are named {key!r}; name one by its object path in the SavedModel: {listed(same)}",
                            field="wrt")
    matches = [n for n in known if n.partition("@")[0].endswith("/" + key)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise RuleViolation(f"wrt: '{VARIABLE_PREFIX}{key}' is ambiguous, it ends {len(matches)} variable names; "
                            f"name one in full: {names(VARIABLE_PREFIX + n for n in matches)}", field="wrt")
    some = names(VARIABLE_PREFIX + n for n in known) if known else "(the model has no variables)"
    raise RuleViolation(f"wrt: the model has no variable {key!r} (nor one ending '/{key}'); choose one of: {some}",
                        field="wrt")


def resolve_wrt(wrt: str | None, inputs: Mapping[str, Described], variables: Mapping[str, Described], *,
                signature: str) -> str:
    """What to differentiate with respect to: a float input, or ``variables/<full name>`` of a float
    variable (see ``find_variable``); when omitted, the signature's only float input."""
    floats = [n for n, s in inputs.items() if is_differentiable(s.dtype)]
    some_variable = "a model variable as 'variables/<name>' (listed by GET /v1/models/signature)"
    choices = f"{names(floats)}, or {some_variable}" if floats else some_variable
    if wrt is None:
        if len(floats) == 1:
            return floats[0]
        what = "no float input" if not floats else f"several float inputs ({names(floats)})"
        raise RuleViolation(f"wrt: signature {signature!r} has {what}; name one with 'wrt', choose one of: "
                            f"{choices}", field="wrt")
    if wrt.startswith(VARIABLE_PREFIX):
        name = find_variable(wrt, variables)
        dtype = variables[name].dtype
        if not is_differentiable(dtype):
            float_vars = (VARIABLE_PREFIX + n for n, v in variables.items() if is_differentiable(v.dtype))
            raise RuleViolation(f"wrt: variable {name!r} is {dtype} and cannot be differentiated; choose one of: "
                                f"{names(float_vars)}", field="wrt")
        return VARIABLE_PREFIX + name
    return _differentiable_member(
        "wrt", wrt, inputs, missing=f"is neither an input of signature {signature!r} nor 'variables/<name>'",
        not_float="cannot be differentiated", choices=choices)


def one_element(shape: Shape) -> bool | None:
    """Whether a tensor of this shape holds exactly one element: ``()``, ``(1,)``, ``(1, 1)``: True; a
    ``None`` dim (any size) or another size: False; unknown rank: None (cannot be told)."""
    if shape is None:
        return None
    return all(d == 1 for d in shape)


def check_hessian(of: str, of_shape: Shape, reduce: str | None, *,
                  outputs: Mapping[str, Described] | None = None) -> None:
    """A Hessian needs ``of`` of exactly one element (``one_element``), or ``reduce='sum'``."""
    if reduce == "sum" or one_element(of_shape) is not False:
        return
    scalars = [n for n, s in (outputs or {}).items() if one_element(s.shape) and is_differentiable(s.dtype)]
    alt = f", or choose an output of one element: {names(scalars)}" if scalars else ""
    raise RuleViolation(f"of: a Hessian needs an output of exactly one element, but {of!r} has shape "
                        f"{fmt_shape(of_shape)}; set reduce='sum' for the Hessian of sum({of}){alt}", field="of")


def check_batch_axes(of: str, of_shape: Shape, wrt: str, wrt_shape: Shape) -> None:
    """A batch Jacobian needs an input ``wrt`` and an ``of`` with a batch axis (axis 0) of the same size
    (unknown sizes pass: the engine checks them again on the concrete shapes)."""
    if wrt.startswith(VARIABLE_PREFIX):
        raise RuleViolation(no_batch_axis_variable("batch_jacobian", wrt), field="wrt")
    if wrt_shape is not None and len(wrt_shape) == 0:
        raise RuleViolation(f"wrt: {wrt!r} is a scalar; batch_jacobian needs a batch axis (axis 0); "
                            "use kind='jacobian'", field="wrt")
    if of_shape is not None and len(of_shape) == 0:
        raise RuleViolation(f"of: {of!r} is a scalar; batch_jacobian needs an output with a batch axis (axis 0); "
                            "use kind='jacobian'", field="of")
    if of_shape and wrt_shape and None not in (of_shape[0], wrt_shape[0]) and of_shape[0] != wrt_shape[0]:
        raise RuleViolation(f"kind: batch_jacobian needs equal batch sizes (axis 0), but {of!r} has {of_shape[0]} "
                            f"and {wrt!r} has {wrt_shape[0]}; use kind='jacobian'", field="kind")


def check_kind(kind: str, *, of: str, of_shape: Shape, wrt: str, wrt_shape: Shape, reduce: str | None = None,
               outputs: Mapping[str, Described] | None = None) -> None:
    """The kind's own rules on the shapes of ``of`` and ``wrt`` (declared ones, or concrete ones)."""
    check_options(kind=kind, reduce=reduce)
    spec = kind_spec(kind)
    if spec.scalar_of:
        check_hessian(of, of_shape, reduce, outputs=outputs)
    elif spec.batch_axis:
        check_batch_axes(of, of_shape, wrt, wrt_shape)


def check_request(*, kind: str, of: str | None, wrt: str | None, reduce: str | None,
                  inputs: Mapping[str, Described], outputs: Mapping[str, Described],
                  variables: Mapping[str, Described], signature: str) -> Resolved:
    """``of`` and ``wrt`` resolved and the kind's rules applied to ``outputs[of]``'s declared shape and
    ``wrt``'s shape (``inputs``: the request's tensors, checked by ``check_inputs`` first)."""
    of = resolve_of(of, outputs, signature=signature)
    wrt = resolve_wrt(wrt, inputs, variables, signature=signature)
    wrt_spec = variables[wrt[len(VARIABLE_PREFIX):]] if wrt.startswith(VARIABLE_PREFIX) else inputs[wrt]
    resolved = Resolved(of=of, wrt=wrt, of_shape=outputs[of].shape, wrt_shape=wrt_spec.shape)
    check_kind(kind, of=of, of_shape=resolved.of_shape, wrt=wrt, wrt_shape=resolved.wrt_shape, reduce=reduce,
               outputs=outputs)
    return resolved
