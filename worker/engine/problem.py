"""A Jacobian problem: the model, its inputs, what to differentiate, and the result layout.

Row conventions (``layout.iter_*``): reverse mode iterates over elements of ``of`` (rows of J),
forward mode over elements of ``wrt`` (columns of J), ``batch_jacobian`` over features (all
examples at once), ``hessian`` over elements of ``wrt``.

The request's rules (inputs, ``of``, ``wrt``, each kind's) are ``contracts.rules``, the API's too: here
they run on the signature and the concrete tensors, and again on the concrete shape of ``of`` after
one forward pass (what the signature leaves open); a ``RuleViolation`` is raised as ``InvalidRequest``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from contracts import rules
from contracts.kinds import KindSpec, kind_spec
from contracts.layout import ResultLayout, dimension_names
from worker.engine import tf_logs
from worker.engine.errors import BatchNotIndependent, InvalidRequest, NotDifferentiable
from worker.engine.model import LoadedModel, shape_tuple
from worker.engine.plan import PlanKey, batch_bucketed

T = TypeVar("T")


@dataclass
class Problem:
    model: LoadedModel
    inputs: dict[str, Any]          # name -> tf.Tensor
    of: str
    wrt: str                        # input name, or "variables/<name>"
    kind: str
    mode: str                       # "reverse" | "forward" (resolved)
    reduce: str | None
    of_shape: tuple[int, ...]       # shape of `of` (before reduce)
    wrt_shape: tuple[int, ...]
    dtype: str                      # stored result dtype (``rules.result_dtype``)
    of_dtype: str                   # ``of``'s dtype: the dtype of cotangents
    layout: ResultLayout

    @property
    def wrt_variable(self) -> Any | None:
        if not self.wrt.startswith("variables/"):
            return None
        return self.model.variables[self.wrt[len("variables/"):]]

    @property
    def spec(self) -> KindSpec:
        """The kind's ``contracts.kinds.KindSpec``."""
        return kind_spec(self.kind)

    @property
    def batch(self) -> int | None:
        return self.of_shape[0] if self.spec.batch_axis else None

    @property
    def rows_total(self) -> int:
        return self.layout.rows_total

    @property
    def seed_shape(self) -> tuple[int, ...]:
        """Shape of one seed (cotangent in reverse mode, tangent in forward mode)."""
        if self.spec.scalar_of:   # a Hessian: Hessian-vector seeds are shaped like wrt
            return self.wrt_shape
        return self.of_shape if self.mode == "reverse" else self.wrt_shape

    def checked(self) -> dict[str, Any]:
        """What validating this request found (JSON): given back to ``build_problem(checked=...)``
        for the same request, it skips the eager checks (the shards of a job validated by its planner)."""
        return {**_request_key(self.of, self.wrt, self.kind, self.reduce, self.inputs), "mode": self.mode,
                "of_shape": list(self.of_shape), "wrt_shape": list(self.wrt_shape)}

    @property
    def attrs(self) -> dict[str, Any]:
        return {
            "model": self.model.path, "signature": self.model.signature, "of": self.of, "wrt": self.wrt,
            "kind": self.kind, "mode": self.mode, "reduce": self.reduce, "of_shape": list(self.of_shape),
            "wrt_shape": list(self.wrt_shape), "shape": list(self.layout.shape), "dtype": self.dtype,
            "iter_start": self.layout.iter_start, "iter_stop": self.layout.iter_stop,
            "rows_total": self.rows_total,
            "dimension_names": dimension_names(self.kind, self.of_shape, self.wrt_shape),
        }


def ruled(rule: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``rule(...)`` of ``contracts.rules``, a ``RuleViolation`` raised as ``InvalidRequest`` (same message, field)."""
    try:
        return rule(*args, **kwargs)
    except rules.RuleViolation as err:
        raise InvalidRequest(str(err), field=err.field) from None


def _spec(t: Any) -> rules.Spec:
    """A ``tf.TensorSpec``, variable, tensor or array as the rulebook's ``Spec`` (dtype name, shape)."""
    return rules.Spec(t.dtype.name, shape_tuple(t.shape))


def convert_inputs(model: LoadedModel, inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs checked against the signature (``rules.check_inputs``) as ``tf.Tensor``s of its dtypes:
    a bfloat16 input sent as float32 (``rules.wire_dtype``) is rounded to bfloat16 here."""
    import tensorflow as tf

    arrays = {name: np.asarray(value) for name, value in inputs.items()}
    ruled(rules.check_inputs, {n: _spec(a) for n, a in arrays.items()},
           {n: _spec(s) for n, s in model.input_specs.items()}, signature=model.signature)
    return {name: tf.cast(tf.constant(arrays[name]), spec.dtype) for name, spec in model.input_specs.items()}


def described(model: LoadedModel) -> dict[str, dict[str, rules.Spec]]:
    """The signature's declared ``inputs`` and ``outputs`` and the model's ``variables``, for the rulebook."""
    return {"inputs": {n: _spec(s) for n, s in model.input_specs.items()},
            "outputs": {n: _spec(s) for n, s in model.output_specs.items()},
            "variables": {n: _spec(v) for n, v in model.variables.items()}}


def _resolve(model: LoadedModel, of: str | None, wrt: str | None) -> tuple[str, str]:
    """``of`` and ``wrt`` resolved from the signature (``rules.resolve_of``, ``rules.resolve_wrt``)."""
    d = described(model)
    return (ruled(rules.resolve_of, of, d["outputs"], signature=model.signature),
            ruled(rules.resolve_wrt, wrt, d["inputs"], d["variables"], signature=model.signature))


def _wrt_target(model: LoadedModel, inputs: dict[str, Any], wrt: str) -> Any:
    """The tensor or variable ``wrt`` (resolved) names."""
    return model.variables[wrt[len(rules.VARIABLE_PREFIX):]] if wrt.startswith(rules.VARIABLE_PREFIX) else inputs[wrt]


def _layout(kind: str, mode: str, of_shape: tuple, wrt_shape: tuple, itemsize: int) -> ResultLayout:
    spec = kind_spec(kind)
    if spec.scalar_of:   # a Hessian: wrt by wrt
        return ResultLayout(wrt_shape + wrt_shape, 0, len(wrt_shape), itemsize)
    if spec.batch_axis:
        shape = (of_shape[0],) + of_shape[1:] + wrt_shape[1:]
        if mode == "reverse":
            return ResultLayout(shape, 1, len(of_shape), itemsize)
        return ResultLayout(shape, len(of_shape), len(shape), itemsize)
    shape = of_shape + wrt_shape
    if mode == "reverse":
        return ResultLayout(shape, 0, len(of_shape), itemsize)
    return ResultLayout(shape, len(of_shape), len(shape), itemsize)


def _probe_gradient(model: LoadedModel, inputs: dict[str, Any], of: str, wrt: str, kind: str,
                    reduce: str | None) -> tuple[Any, tuple[int, ...]]:
    """One eager forward and backward pass: the shape of ``of`` and a gradient (None if unconnected)."""
    import tensorflow as tf

    target = _wrt_target(model, inputs, wrt)
    try:
        with tf.GradientTape() as tape:
            tape.watch(target)
            y = model.fn(**inputs)[of]
            s = tf.reduce_sum(y) if (not kind_spec(kind).scalar_of or reduce == "sum") else y
        grad = tape.gradient(s, target)
    except (LookupError, ValueError, TypeError, tf.errors.OpError) as err:
        raise NotDifferentiable(
            f"wrt: TensorFlow cannot differentiate {of!r} with respect to {wrt!r} in this SavedModel: "
            f"{error_summary(err)}. Re-export the model with differentiable ops (or without the op named above)",
            field="wrt") from err
    return grad, tuple(int(d) for d in y.shape)


def probe_shape(model: LoadedModel, inputs: dict[str, Any], of: str) -> tuple[int, ...]:
    """One eager forward pass, no tape: the shape of ``of`` (gradients are checked where they are built); of the
    model ``model.shapes_of`` names where there is one (a float64 copy not built yet: ``float64.float64_model``)."""
    import tensorflow as tf

    if model.shapes_of is not None:
        specs = model.shapes_of.input_specs
        return probe_shape(model.shapes_of, {n: tf.cast(v, specs[n].dtype) if n in specs else v
                                             for n, v in inputs.items()}, of)
    try:
        y = model.fn(**inputs)[of]
    except (ValueError, TypeError, tf.errors.OpError) as err:
        raise InvalidRequest(f"inputs: the model fails on these inputs ({error_summary(err)}); check their shapes "
                             "against GET /v1/models/signature", field="inputs") from err
    return tuple(int(d) for d in y.shape)


def unconnected(of: str, wrt: str) -> InvalidRequest:
    """The error for a ``wrt`` that ``of`` does not depend on."""
    return InvalidRequest(f"wrt: {of!r} does not depend on {wrt!r} (the gradient is unconnected); "
                          f"choose an input or variable that feeds {of!r}", field="wrt")


def error_summary(err: BaseException) -> str:
    """The most telling line of a TensorFlow error (they start with 'in user code:')."""
    lines = [t.strip() for t in str(err).strip().splitlines() if t.strip()]
    interesting = [t for t in lines if ("rror" in t or "gradient" in t.lower()) and "in user code" not in t]
    line = (interesting or lines or [""])[-1][:300]
    line = line if line.split(":")[0].endswith(("Error", "Exception")) else f"{type(err).__name__}: {line}"
    return line + tf_logs.note(err)   # how many of TensorFlow's own log lines were kept back


FORWARD_TEST_PAIRS = 3   # random (tangent, cotangent) pairs of the forward-mode test


def _dot_test_tolerance(*dtypes: str) -> float:
    """Relative tolerance of one dot-product test (of ``|J t| + |J^T u|``): 16-bit floats round more."""
    return 3e-2 if {"float16", "bfloat16"} & set(dtypes) else 1e-3


def _forward_agrees(model: LoadedModel, inputs: dict[str, Any], of: str, wrt: str, *,
                    pairs: int = FORWARD_TEST_PAIRS, seed: int = 1) -> str | None:
    """Dot-product test of TensorFlow's forward mode against its reverse mode on this model:
    ``<u, J t> == <J^T u, t>`` for ``pairs`` random tangents ``t`` and cotangents ``u``.

    Some SavedModels break forward mode inside TensorFlow (an error, e.g. integer gathers) or,
    worse, silently (zero JVPs w.r.t. variables captured by a loaded function). Random cotangents,
    unlike all-ones, also see outputs whose sum is constant (softmax, ``[h, -h]``): there ``J^T 1``
    is 0, so a zero JVP passed, and both sides were rounding noise that could fail a correct one.
    With standard normal ``u`` and ``t`` both sides are of the order of ``|J t|`` and ``|J^T u|``
    (whatever the sizes), and a JVP that is wrong misses by as much: the sides must agree within
    ``_dot_test_tolerance`` of ``|J t| + |J^T u|``. A side that is not finite fails the test too: at an
    infinite derivative (``sqrt`` at 0) a JVP spreads ``0 * inf = NaN`` over rows where the reverse mode
    (GradientTape's) has 0. Returns why forward mode cannot be trusted here, or None.
    """
    import tensorflow as tf

    target = _wrt_target(model, inputs, wrt)
    rng = np.random.default_rng(seed)
    for _ in range(pairs):
        tangent = tf.cast(tf.constant(rng.standard_normal(target.shape)), target.dtype)
        try:
            with tf.autodiff.ForwardAccumulator(target, tangent) as acc:
                y = model.fn(**inputs)[of]
            jvp = acc.jvp(y, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            cotangent = tf.cast(tf.constant(rng.standard_normal(y.shape)), y.dtype)
            with tf.GradientTape() as tape:  # not persistent: see strategies._row_fn
                tape.watch(target)
                y = model.fn(**inputs)[of]
            vjp = tf.convert_to_tensor(tape.gradient(y, target, output_gradients=cotangent))
        except Exception as err:  # noqa: BLE001 - any failure means: forward mode unusable here
            return error_summary(err)
        u, jt, t, jtu = (np.asarray(tf.cast(v, tf.float64)).ravel() for v in (cotangent, jvp, tangent, vjp))
        fwd, rev = float(u @ jt), float(jtu @ t)
        if not (np.isfinite(fwd) and np.isfinite(rev)):
            return (f"the derivative is not finite at these inputs (dot-product test <u, J t> vs <J^T u, t>: "
                    f"{fwd:.6g} vs {rev:.6g}), where forward mode gives NaN for reverse mode's zeros")
        scale = float(np.linalg.norm(jt) + np.linalg.norm(jtu)) * _dot_test_tolerance(y.dtype.name, target.dtype.name)
        if abs(fwd - rev) > scale:
            return f"its JVP disagrees with the VJP (dot-product test <u, J t> vs <J^T u, t>: {fwd:.6g} vs {rev:.6g})"
    return None


def _finite_max(a: np.ndarray) -> float:
    """The largest finite ``|a|`` (0.0 when none is finite)."""
    a = np.abs(np.asarray(a, np.float64))
    finite = a[np.isfinite(a)]
    return float(finite.max()) if finite.size else 0.0


def verify_independence(problem: Problem, *, tolerance: float = 1e-5, seed: int = 0) -> None:
    """Random-probe check that example ``i`` of ``of`` depends only on example ``i`` of ``wrt``.

    One VJP per probed example with a random cotangent on that example alone; any gradient on
    another example above ``tolerance`` (relative) raises BatchNotIndependent.
    """
    import tensorflow as tf

    batch = problem.of_shape[0]
    if batch < 2:
        return
    x = problem.inputs[problem.wrt]
    rng = np.random.default_rng(seed)
    for example in sorted({0, batch - 1}):
        u = np.zeros(problem.of_shape, dtype=problem.of_dtype)
        u[example] = rng.standard_normal(problem.of_shape[1:])
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = problem.model.fn(**problem.inputs)[problem.of]
        g = tape.gradient(y, x, output_gradients=tf.constant(u)).numpy().reshape(batch, -1)
        # Finite entries only: an infinite derivative of the probed example (sqrt at 0) must not widen the
        # tolerance to infinity, and 0 * inf = NaN on an independent example is no dependence.
        own = _finite_max(g[example]) or 1.0
        others = _finite_max(np.delete(g, example, axis=0))
        if others > tolerance * own:
            raise BatchNotIndependent(
                f"kind: batch_jacobian needs independent examples, but example {example} of {problem.of!r} "
                f"depends on other examples of {problem.wrt!r} (relative {others / own:.2g}); this happens with "
                f"BatchNorm in training mode or attention across the batch. Use kind 'jacobian' instead",
                field="kind")


def build_problem(model: LoadedModel, inputs: dict[str, Any], *, of: str | None = None, wrt: str | None = None,
                  kind: str = "jacobian", mode: str = "auto", reduce: str | None = None,
                  check_independence: bool = False, output_dtype: str | None = None,
                  checked: dict[str, Any] | None = None) -> Problem:
    """Validate the request against the model and fix the result layout (raises EngineError).

    ``checked`` is ``Problem.checked()`` of an earlier build of the same request (same ``of``,
    ``wrt``, kind, reduce and input shapes; mode ``auto`` or the one resolved then): the eager probe
    gradient, the forward-mode test and the independence check are then not run again, and the
    resolved mode is reused. For any other request it is ignored and the request is checked in full.
    """
    ruled(rules.check_options, kind=kind, mode=mode, reduce=reduce, output_dtype=output_dtype)
    tensors = convert_inputs(model, inputs)
    signature = {**described(model), "inputs": {n: _spec(t) for n, t in tensors.items()}}
    resolved = ruled(rules.check_request, kind=kind, of=of, wrt=wrt, reduce=reduce, signature=model.signature,
                     **signature)
    of, wrt = resolved.of, resolved.wrt
    out_dtype = model.output_specs[of].dtype.name
    request = _request_key(of, wrt, kind, reduce, tensors)
    trusted = (checked is not None and all(checked.get(k) == v for k, v in request.items())
               and mode in ("auto", checked.get("mode")))
    if trusted:
        mode, of_shape, wrt_shape = checked["mode"], tuple(checked["of_shape"]), tuple(checked["wrt_shape"])
    else:
        mode, of_shape, wrt_shape = _check_request(model, tensors, of, wrt, kind, mode, reduce)
    dtype = rules.result_dtype(out_dtype, _wrt_target(model, tensors, wrt).dtype.name, output_dtype)
    itemsize = np.dtype(dtype).itemsize
    problem = Problem(model=model, inputs=tensors, of=of, wrt=wrt, kind=kind, mode=mode, reduce=reduce,
                      of_shape=of_shape, wrt_shape=wrt_shape, dtype=dtype, of_dtype=out_dtype,
                      layout=_layout(kind, mode, of_shape, wrt_shape, itemsize))
    if problem.spec.batch_axis and check_independence and not trusted:
        verify_independence(problem)
    return problem


def plan_key(model: LoadedModel, inputs: dict[str, Any], *, of: str | None = None, wrt: str | None = None,
             kind: str = "jacobian", mode: str = "auto", reduce: str | None = None, device: str = "CPU:0") -> PlanKey:
    """The key of this request's plan, found without running the model (``of`` and ``wrt`` resolved
    from the signature; raises InvalidRequest as ``build_problem`` would). A batch Jacobian's examples
    are independent, so its batch size is bucketed: a new batch size in the bucket reuses the plan."""
    import tensorflow as tf

    from worker.engine.memory import device_kind

    of, wrt = _resolve(model, of, wrt)
    shapes = []
    for name, value in sorted(inputs.items()):
        shape = tuple(int(d) for d in value.shape)
        dtype = value.dtype.name if hasattr(value.dtype, "name") else str(value.dtype)
        shapes.append((name, batch_bucketed(shape) if kind_spec(kind).batch_axis else shape, dtype))
    return PlanKey(model=model.fingerprint, signature=model.signature, of=of, wrt=wrt, kind=kind, mode=mode,
                   reduce=reduce, inputs=tuple(shapes), device=device_kind(device), tensorflow=tf.__version__)


def _request_key(of: str, wrt: str, kind: str, reduce: str | None, tensors: dict[str, Any]) -> dict[str, Any]:
    """What makes two requests the same for ``Problem.checked()`` (JSON: it travels through Redis)."""
    return {"of": of, "wrt": wrt, "kind": kind, "reduce": reduce,
            "input_shapes": {n: [int(d) for d in t.shape] for n, t in sorted(tensors.items())}}


def _check_request(model: LoadedModel, tensors: dict[str, Any], of: str, wrt: str, kind: str, mode: str,
                   reduce: str | None) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """The eager checks of a request: ``(resolved mode, of_shape, wrt_shape)`` or an EngineError.

    One forward pass gives the shapes. In reverse mode the gradient is not probed here: building an
    eager backward function costs seconds on a large graph (2 s, 150 MB on MobileNetV3Small) and the
    chunk function builds its own; an unconnected ``wrt`` or an op without a gradient then surfaces
    from the first chunk (``unconnected``; every strategy failing). Forward mode is checked eagerly.
    """
    requested_mode = mode
    of_shape = probe_shape(model, tensors, of)
    wrt_shape = tuple(int(d) for d in _wrt_target(model, tensors, wrt).shape)
    # The rules again, on the concrete shapes: an output of unknown rank, a batch axis of None.
    ruled(rules.check_kind, kind, of=of, of_shape=of_shape, wrt=wrt, wrt_shape=wrt_shape, reduce=reduce)
    spec = kind_spec(kind)
    if spec.scalar_of:
        mode = "reverse" if mode == "auto" else mode
    elif spec.batch_axis and mode == "auto":
        mode = "reverse" if math.prod(of_shape[1:]) <= math.prod(wrt_shape[1:]) else "forward"
    elif mode == "auto":
        mode = "reverse" if math.prod(of_shape) <= math.prod(wrt_shape) else "forward"
    if mode == "forward":  # TensorFlow's forward mode can be silently wrong: checked eagerly here
        grad, _ = _probe_gradient(model, tensors, of, wrt, kind, reduce)
        if grad is None:
            raise unconnected(of, wrt)
        with tf_logs.captured("the forward-mode test"):
            why = _forward_agrees(model, tensors, of, wrt)
        if why is not None and requested_mode == "auto":
            mode = "reverse"
        elif why is not None:
            raise NotDifferentiable(f"mode: TensorFlow's forward mode fails on this SavedModel ({why}); "
                                    f"use mode 'reverse' or 'auto'", field="mode")
    return mode, of_shape, wrt_shape
