"""A request's tensors checked against the model's signature: names, dtypes, shapes, ``of``, ``wrt``, the
kind's rules and the result size. Only shapes and dtypes are read (``Described``), so an ``.npz`` is
checked from its headers before any data is inflated; ``check_finite`` then reads the values. A job with
``sparsity`` is checked for an input ``wrt`` and, with ``pattern_from``, against the earlier job's record.

The rules are ``contracts.rules``, the engine's too (on concrete tensors): a ``RuleViolation`` is
answered as ``SignatureMismatch`` (422) with its message and field. The result size limit and the
finiteness of the values are the API's own.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np

from app.errors import InvalidRequest, NonFiniteInput, SignatureMismatch
from contracts import losses, rules
from contracts.jobspec import (
    PRODUCT_KINDS,
    SEEDS_MEMBER,
    JobOptions,
    JobStatus,
    ModelRef,
    PatternFrom,
)
from contracts.jobstore import JobNotFound, JobStore
from contracts.kinds import kind_spec, multiplies
from contracts.savedmodel import VARIABLE_PREFIX, Signature, TensorSpec


class Described(Protocol):
    """What the signature checks need of an input: an array, or an ``.npz`` member's header."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...


@contextmanager
def _as_signature_mismatch() -> Iterator[None]:
    """The rulebook's ``RuleViolation`` as the API's ``SignatureMismatch`` (422), same message and field."""
    try:
        yield
    except rules.RuleViolation as err:
        raise SignatureMismatch(str(err), field=err.field) from None


def _specs(tensors: Mapping[str, Described]) -> dict[str, rules.Spec]:
    return {name: rules.Spec(t.dtype.name, tuple(int(d) for d in t.shape)) for name, t in tensors.items()}


def check_signature(tensors: Mapping[str, Described], sig: Signature) -> None:
    """Every signature input given, none unknown, each with its dtype, a compatible shape and at least
    one element (``rules.check_inputs``). Reads shapes and dtypes only, so ``.npz`` headers are checked
    before their data."""
    with _as_signature_mismatch():
        rules.check_inputs(_specs(tensors), sig.inputs, signature=sig.name)


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
    """The float output to differentiate; may be omitted when the signature has exactly one
    (``rules.resolve_of``)."""
    with _as_signature_mismatch():
        return rules.resolve_of(of, sig.outputs, signature=sig.name)


def resolve_wrt(wrt: str | None, sig: Signature, variables: Mapping[str, TensorSpec]) -> str:
    """A float input, or ``variables/<full name>`` of a float variable (a unique suffix of its name
    works); may be omitted with one float input (``rules.resolve_wrt``)."""
    with _as_signature_mismatch():
        return rules.resolve_wrt(wrt, sig.inputs, variables, signature=sig.name)


def check_kind(options: JobOptions, sig: Signature, of: str, wrt: str, arrays: Mapping[str, Described]) -> None:
    """The kind's rules (``rules.check_kind``) on ``of``'s declared shape and ``wrt``'s given shape: a
    Hessian needs ``of`` of exactly one element (or ``reduce='sum'``); a batch Jacobian needs ``of``
    and an input ``wrt`` with batch axes of equal size."""
    wrt_shape = tuple(arrays[wrt].shape) if wrt in arrays else None
    with _as_signature_mismatch():
        rules.check_kind(options.kind.value, of=of, of_shape=sig.outputs[of].shape, wrt=wrt, wrt_shape=wrt_shape,
                         reduce=options.reduce, outputs=sig.outputs)


def check_request(options: JobOptions, sig: Signature, tensors: Mapping[str, Described],
                  variables: Mapping[str, TensorSpec], *, max_result_bytes: int) -> tuple[str, str]:
    """All the checks of a request's shapes and dtypes, in the engine's order: inputs, ``of``, ``wrt``,
    the kind's rules, the result size. Returns the resolved ``(of, wrt)``."""
    check_signature(tensors, sig)
    with _as_signature_mismatch():
        resolved = rules.check_request(kind=options.kind.value, of=options.of, wrt=options.wrt,
                                       reduce=options.reduce, inputs=_specs(tensors), outputs=sig.outputs,
                                       variables=variables, signature=sig.name)
    check_result_size(options, sig, resolved.of, resolved.wrt, tensors, variables, max_result_bytes=max_result_bytes)
    return resolved.of, resolved.wrt


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
    wrt_spec = variables[wrt[len(VARIABLE_PREFIX):]] if wrt.startswith(VARIABLE_PREFIX) else sig.inputs[wrt]
    wrt_shape = wrt_spec.shape if wrt.startswith(VARIABLE_PREFIX) else arrays[wrt].shape
    if wrt_shape is None or any(d is None for d in wrt_shape):
        return
    spec = kind_spec(options.kind)   # a dense kind: a Hessian is wrt by wrt, a batch Jacobian per example
    if spec.scalar_of:
        elements = math.prod(wrt_shape) ** 2
    elif spec.batch_axis:
        elements = wrt_shape[0] * math.prod(of_shape[1:]) * math.prod(wrt_shape[1:])
    else:
        elements = math.prod(of_shape) * math.prod(wrt_shape)
    itemsize = np.dtype(rules.result_dtype(of_spec.dtype, wrt_spec.dtype, options.output_dtype)).itemsize
    size = elements * itemsize
    if size > max_result_bytes:
        rows = math.prod(wrt_shape) if spec.scalar_of else math.prod(of_shape[1:] if spec.batch_axis else of_shape)
        fits = what_would_fit(options, size=size, rows=rows, itemsize=itemsize, max_result_bytes=max_result_bytes,
                              shared_batch=bool(of_shape and wrt_shape and of_shape[0] == wrt_shape[0] > 1),
                              wrt_is_input=not wrt.startswith(VARIABLE_PREFIX))
        raise InvalidRequest(f"inputs: the result would be {size} bytes, over the limit of {max_result_bytes} "
                             f"(JACOBIAN_MAX_RESULT_BYTES); what would fit: {fits}", field="inputs")


def what_would_fit(options: JobOptions, *, size: int, rows: int, itemsize: int, max_result_bytes: int,
                   shared_batch: bool, wrt_is_input: bool) -> str:
    """The ways a dense job of ``size`` result bytes in ``rows`` rows comes under ``max_result_bytes``, in
    words: fewer rows, ``batch_jacobian``, a matrix-free kind, ``sparsity``, a 16-bit ``output_dtype``."""
    kind = kind_spec(options.kind)
    per_row = max(1, size // max(1, rows))
    ways = [f"fewer rows: a smaller input (at most {max_result_bytes // per_row} of these {rows} rows fit)"]
    if shared_batch and not kind.batch_axis and not kind.scalar_of:
        ways.append("kind='batch_jacobian' when the examples of the batch are independent (of and wrt share their "
                    "batch axis: one block per example, the batch size times fewer bytes)")
    ways.append("a matrix-free kind: 'jvp' or 'vjp' (products with your seeds), 'svd' (the largest singular values)"
                if not kind.scalar_of else "a matrix-free kind: 'hvp', 'hessian_eig', 'hessian_trace' or "
                "'hessian_diag'")
    if kind.sparsity and wrt_is_input and options.sparsity is None:
        ways.append("sparsity='auto' (only the non-zeros are stored, as COO)")
    if itemsize > 2:
        half = size // itemsize * 2
        fit = ", which fits" if half <= max_result_bytes else ""
        ways.append(f"output_dtype='float16' or 'bfloat16' ({half} bytes{fit})")
    return "; ".join(ways)


def check_matrix_free(options: JobOptions, sig: Signature, described: Mapping[str, Described],
                      variables: Mapping[str, TensorSpec], *, seeds: Any) -> tuple[str, str | list[str]]:
    """The matrix-free kinds at POST (``jvp``, ``vjp``, ``hvp``, ``svd``, ``hessian_eig``, ``hessian_trace``):
    the inputs against the signature (the seeds aside), ``of``, each ``wrt`` (a name, a list, or
    ``variables/*``), a scalar ``of`` for the Hessian kinds, seeds for the product kinds and only for them, a
    loss' ``of`` and ``labels`` (``contracts.losses``; the labels input is not the signature's unless it names one).
    What needs the concrete shapes (the seeds' shape, ``rank`` against the sizes) the worker checks with
    the same rules (``worker.engine.matfree_rules``) and fails the job naming the field."""
    extra = {SEEDS_MEMBER} | ({options.labels} if options.labels and options.labels not in sig.inputs else set())
    check_signature({n: d for n, d in described.items() if n not in extra}, sig)
    of = resolve_of(options.of, sig)
    kind = options.kind.value
    if options.wrt == ["variables/*"] or options.wrt == "variables/*":
        if not variables:
            raise InvalidRequest("wrt: 'variables/*' but this signature reads no variables; name inputs instead",
                                 field="wrt")
        if all(getattr(v, "trainable", None) is False for v in variables.values()):
            raise InvalidRequest("wrt: 'variables/*' but every variable this signature reads is non-trainable; "
                                 "name them (variables/<name>) or inputs instead", field="wrt")
        wrt: str | list[str] = "variables/*"
    elif isinstance(options.wrt, list):
        wrt = [resolve_wrt(name, sig, variables) for name in options.wrt]
        twice = sorted({n for n in wrt if wrt.count(n) > 1})
        if twice:
            raise InvalidRequest(f"wrt: {', '.join(map(repr, twice))} given twice; name each source once",
                                 field="wrt")
    else:
        wrt = resolve_wrt(options.wrt, sig, variables)
    spec = kind_spec(kind)
    matrix = multiplies(spec, options.curvature)   # the Hessian (scalar of), a loss' curvature, or J
    with _as_signature_mismatch():
        if matrix.scalar_of:
            rules.check_hessian(of, sig.outputs[of].shape, options.reduce, outputs=sig.outputs)
        if matrix.curvature and options.loss is not None:
            losses.check_loss_of(options.loss, of, sig.outputs[of].shape)
    if options.labels is not None:
        check_labels(options, of, sig, described)
    if spec.seeds is not None and seeds is None:
        along = "(k,) + of.shape (cotangents)" if spec.seeds == "of" else "(k,) + wrt.shape (tangents)"
        raise InvalidRequest(f"seeds: kind {kind!r} needs seeds of shape {along}: the JSON field 'seeds', or the "
                             f"member {SEEDS_MEMBER!r} of the .npz", field="seeds")
    if spec.seeds is None and seeds is not None:
        raise InvalidRequest(f"seeds: only the product kinds ({', '.join(PRODUCT_KINDS)}) take seeds; remove them",
                             field="seeds")
    return of, wrt


def check_labels(options: JobOptions, of: str, sig: Signature, described: Mapping[str, Described]) -> None:
    """``labels`` names a tensor of the request that fits the loss on ``of`` (``contracts.losses.check_labels``)."""
    name = str(options.labels)
    if name not in described:
        given = ", ".join(repr(n) for n in sorted(described) if n != SEEDS_MEMBER) or "(none)"
        raise InvalidRequest(f"labels: no input {name!r} in this request (it has {given}); add the labels to inputs "
                             f"under that name (the .npz member {name!r}), or name the input that holds them",
                             field="labels")
    tensor = described[name]
    with _as_signature_mismatch():
        losses.check_labels(str(options.loss), name, tensor.dtype.name, tuple(int(d) for d in tensor.shape), of=of,
                            of_shape=sig.outputs[of].shape)


def check_sources(options: JobOptions, sig: Signature, of: str, wrt: str | list[str],
                  described: Mapping[str, Described], variables: Mapping[str, TensorSpec], *,
                  max_result_bytes: int) -> None:
    """A dense kind over several sources (``wrt`` a list or ``variables/*``): each source under the kind's rules
    (a batch Jacobian's inputs share ``of``'s batch axis) and the result, over their summed size, under
    ``max_result_bytes``."""
    names = [VARIABLE_PREFIX + n for n, v in variables.items() if getattr(v, "trainable", None) is not False] \
        if wrt == "variables/*" else list(wrt)
    of_spec = sig.outputs[of]
    kind = kind_spec(options.kind)   # a dense kind: a Hessian is wrt by wrt, a batch Jacobian per example
    total, dtype = 0, of_spec.dtype
    for name in names:
        spec = variables[name[len(VARIABLE_PREFIX):]] if name.startswith(VARIABLE_PREFIX) else None
        shape = spec.shape if spec is not None else tuple(described[name].shape)
        with _as_signature_mismatch():
            rules.check_kind(options.kind.value, of=of, of_shape=of_spec.shape, wrt=name, wrt_shape=shape,
                             reduce=options.reduce, outputs=sig.outputs)
        if shape is None or any(d is None for d in shape):
            return   # a size only the worker can know
        per = math.prod(shape[1:]) if kind.batch_axis else math.prod(shape)
        total += per
        dtype = rules.result_dtype(dtype, spec.dtype if spec is not None else described[name].dtype.name)
    if of_spec.shape is None or any(d is None for d in of_spec.shape[1:]):
        return
    batch = {described[n].shape[0] for n, s in sig.inputs.items() if s.shape and s.shape[0] is None and n in described}
    lead = of_spec.shape[0] if of_spec.shape and of_spec.shape[0] is not None else (next(iter(batch)) if batch else 1)
    of_elements = math.prod((lead,) + tuple(of_spec.shape[1:])) if of_spec.shape else 1
    elements = total * total if kind.scalar_of else of_elements * total
    size = elements * np.dtype(rules.result_dtype(dtype, dtype, options.output_dtype)).itemsize
    if size > max_result_bytes:
        itemsize = np.dtype(rules.result_dtype(dtype, dtype, options.output_dtype)).itemsize
        fits = what_would_fit(options, size=size, rows=total if kind.scalar_of else of_elements, itemsize=itemsize,
                              max_result_bytes=max_result_bytes, shared_batch=False, wrt_is_input=False)
        raise InvalidRequest(f"wrt: the result over these {len(names)} sources would be {size} bytes, over the "
                             f"limit of {max_result_bytes} (JACOBIAN_MAX_RESULT_BYTES); what would fit: fewer "
                             f"sources; {fits}", field="wrt")


# -- sparsity ------------------------------------------------------------------------------------------


def check_sparsity_wrt(options: JobOptions, wrt: str, sig: Signature) -> None:
    """A job with ``sparsity`` differentiates with respect to one input of the signature (the resolved
    ``wrt``; ``JobOptions`` has already refused a list and ``variables/...``)."""
    if options.sparsity is not None and wrt not in sig.inputs:
        raise InvalidRequest(f"sparsity: works with respect to one input of signature {sig.name!r}, and wrt is "
                             f"{wrt!r}; name one of {', '.join(map(repr, sig.inputs))} as wrt or remove sparsity",
                             field="sparsity")


def check_pattern_from(sparsity: Any, store: JobStore, *, model: ModelRef, of: str, wrt: str,
                       kind: str = "jacobian") -> None:
    """``sparsity: {"pattern_from": id}`` names an earlier job that is in the job store, has succeeded, and
    computed the same Jacobian: a ``jacobian`` of the same model directory, signature, ``of`` and ``wrt``
    (its non-zeros are this job's pattern). Anything else is ``InvalidRequest`` (422) naming the field."""
    if not isinstance(sparsity, PatternFrom):
        return
    field, job_id = "sparsity.pattern_from", sparsity.pattern_from
    try:
        record = store.get(job_id)
    except JobNotFound:
        raise InvalidRequest(f"{field}: no job {job_id!r} (unknown, or its record has expired); give the id of an "
                             "earlier succeeded job on the same model, or use sparsity='auto'", field=field) from None
    if record.status != JobStatus.succeeded:
        raise InvalidRequest(f"{field}: job {job_id!r} is {record.status.value}; its pattern can be used once its "
                             "status is 'succeeded' (or use sparsity='auto')", field=field)
    spec = record.spec
    earlier = {"model": (spec.get("model") or {}).get("path"), "signature": (spec.get("model") or {}).get("signature"),
               "kind": spec.get("kind"), "of": spec.get("of"), "wrt": spec.get("wrt")}
    this = {"model": model.path, "signature": model.signature, "kind": kind, "of": of, "wrt": wrt}
    differ = [f"{k} {earlier[k]!r} (this job: {this[k]!r})" for k in this if earlier[k] != this[k]]
    if differ:
        raise InvalidRequest(f"{field}: job {job_id!r} computed another matrix: {'; '.join(differ)}; give a job of "
                             f"kind {kind!r} on the same model, signature, of and wrt, or use sparsity='auto'",
                             field=field)
