"""Request bodies -> numpy inputs checked against a model signature, and the job's ``inputs.npz``.

Limits: the body is counted as it streams (``max_body_bytes``), and a body that stalls for
``body_read_timeout_s`` is answered 408. Tensors are counted in elements (``max_input_elements``)
and decoded bytes (``max_input_bytes``, itemsize x elements), all inputs together, before any of
them is materialised: from the JSON ``shape`` or from each ``.npy`` header inside an ``.npz``
(``contracts.npz``), whose shapes and dtypes are also checked against the signature before a byte
of data is inflated. Inputs holding NaN or Inf are refused (422): a Jacobian at a non-finite point
is not defined.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from typing import IO, Any, Protocol, Self

import numpy as np
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from app.errors import (BodyTimeout, BodyTooLarge, ClientClosedRequest, InvalidRequest, MalformedBody, NonFiniteInput,
                        SignatureMismatch)
from contracts import npz, storage
from contracts.jobspec import (DIFFERENTIABLE_DTYPES, JobCreate, JobOptions, Kind, ModelRef, RequestedOptions,
                               TensorIn)
from contracts.layout import INPUTS, job_url
from contracts.savedmodel import VARIABLE_PREFIX, Shape, Signature, TensorSpec, strip_variable_suffix

NPZ_MEDIA_TYPE = "application/x-npz"
MAX_JSON_CONTAINERS = 65536  # arrays and objects of one JSON body: a nested (65535, k) tensor at most


async def read_limited(stream: AsyncIterator[bytes], *, max_bytes: int, content_length: str | None,
                       read_timeout_s: float | None = None, limit_name: str = "JACOBIAN_MAX_BODY_BYTES") -> bytes:
    """The whole body, refused with ``BodyTooLarge`` once more than ``max_bytes`` have streamed in.

    ``Content-Length`` only lets an honest oversized request fail before reading; the count of
    bytes actually received is what is enforced. A body that sends nothing for ``read_timeout_s``
    raises ``BodyTimeout``; a client that goes away mid-body, ``ClientClosedRequest``. ``limit_name``
    is the setting the message names.
    """
    limit_text = f"{max_bytes} bytes ({limit_name})"
    declared = content_length.strip() if content_length is not None else ""
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > max_bytes):
        raise BodyTooLarge(f"body: Content-Length {declared[:20]} is over the limit of {limit_text}; send large "
                           f"inputs as an .npz body (Content-Type: {NPZ_MEDIA_TYPE}) or put them in storage and "
                           "pass 'inputs_uri'")
    buf = bytearray()
    chunks = stream.__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), timeout=read_timeout_s)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise BodyTimeout(f"body: nothing received for {read_timeout_s:g} s after {len(buf)} bytes "
                              "(JACOBIAN_BODY_READ_TIMEOUT_S); send the body without pausing") from None
        except ClientDisconnect:
            raise ClientClosedRequest(f"body: the client closed the connection after {len(buf)} bytes") from None
        buf += chunk
        if len(buf) > max_bytes:
            raise BodyTooLarge(f"body: more than {limit_text}; send large inputs as an .npz body "
                               f"(Content-Type: {NPZ_MEDIA_TYPE}) or put them in storage and pass 'inputs_uri'")
    return bytes(buf)


def parse_job_json(body: bytes) -> JobCreate:
    """``POST /v1/jobs`` JSON -> ``JobCreate``; ``MalformedBody`` (400) if not JSON, pydantic errors (422).

    Parsed, each JSON array or object costs about 80 bytes (27 times ``[],``): their number is
    bounded (``MAX_JSON_CONTAINERS``, counted on the raw bytes) before parsing."""
    containers = body.count(b"[") + body.count(b"{")
    if containers > MAX_JSON_CONTAINERS:
        raise BodyTooLarge(f"body: {containers} JSON arrays and objects, more than {MAX_JSON_CONTAINERS}; send each "
                           "tensor's data as a flat list with its 'shape', or as an .npz body", field="body")
    try:
        obj = json.loads(body)
    except RecursionError:
        raise MalformedBody("body: nested too deeply to parse; send tensors as flat lists with a 'shape', "
                            "or as an .npz body") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, and integers of over 4300 digits
        raise MalformedBody(f"body: not valid JSON ({str(exc)[:200]}); send a JSON object as described at /docs") \
            from None
    if not isinstance(obj, dict):
        raise MalformedBody(f"body: expected a JSON object, got {type(obj).__name__}; see /docs")
    return JobCreate.model_validate(obj)


def parse_npz_query(params: Mapping[str, str]) -> tuple[JobOptions, ModelRef]:
    """Query parameters of an ``.npz`` upload: ``model_path``, ``signature`` and the ``JobOptions``."""
    opts: dict[str, Any] = dict(params)
    path = opts.pop("model_path", None)
    signature = opts.pop("signature", "serving_default")
    if not path:
        raise InvalidRequest("model_path: required query parameter for an .npz body; add ?model_path=<dir>",
                             field="model_path")
    try:
        model = ModelRef(path=path, signature=signature)
    except ValidationError as exc:
        raise InvalidRequest(f"model_path/signature: {exc.errors()[0]['msg']}") from None
    return RequestedOptions.model_validate(opts), model


def numpy_dtype(name: str) -> np.dtype[Any]:
    """numpy dtype for a TensorFlow/numpy dtype name (bfloat16 through ml_dtypes when installed)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise InvalidRequest("dtype: bfloat16 inputs need ml_dtypes on the API host; send float32") from None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        raise InvalidRequest(f"dtype: {name!r} has no numpy equivalent; this model cannot be served") from None


def _json_dtype(name: str, t: TensorIn, sig: Signature) -> np.dtype[Any]:
    """An inline tensor's dtype: its ``dtype``, or the signature's for that input when omitted."""
    spec = sig.inputs.get(name)
    return numpy_dtype(spec.dtype if spec is not None and "dtype" not in t.model_fields_set else t.dtype)


def arrays_from_json(inputs: Mapping[str, TensorIn], sig: Signature, *, max_elements: int,
                     max_bytes: int) -> dict[str, np.ndarray]:
    """Inline tensors -> arrays; an omitted ``dtype`` takes the signature's dtype for that input.

    The declared shapes are checked against the element and byte limits before any array is built."""
    elements = sum(math.prod(t.shape) for t in inputs.values())
    if elements > max_elements:
        raise BodyTooLarge(f"inputs: {elements} elements in total, over the limit of {max_elements} "
                           "(JACOBIAN_MAX_INPUT_ELEMENTS); send smaller inputs or split the job", field="inputs")
    nbytes = sum(math.prod(t.shape) * _json_dtype(name, t, sig).itemsize for name, t in inputs.items())
    if nbytes > max_bytes:
        raise BodyTooLarge(f"inputs: {nbytes} bytes in total, over the limit of {max_bytes} "
                           "(JACOBIAN_MAX_INPUT_BYTES); send smaller inputs or split the job", field="inputs")
    out: dict[str, np.ndarray] = {}
    for name, t in inputs.items():
        field = f"inputs.{name}"
        target = _json_dtype(name, t, sig)
        want = tuple(t.shape)
        flat = isinstance(t.data, list) and not (t.data and isinstance(t.data[0], list))
        if flat and len(t.data) != math.prod(want):  # told without building an array of the wrong size
            raise InvalidRequest(f"{field}.data: has {len(t.data)} values but shape {list(want)} needs "
                                 f"{math.prod(want)}; fix 'shape' or 'data'", field=field)
        try:
            raw = np.asarray(t.data)
        except ValueError:
            raise InvalidRequest(f"{field}.data: ragged nested lists; give a flat list of prod(shape) numbers "
                                 "or nested lists of exactly that shape", field=field) from None
        if raw.dtype.kind not in "biuf":
            raise InvalidRequest(f"{field}.data: must hold numbers (or booleans), got {raw.dtype.kind!r} data",
                                 field=field)
        if raw.size != math.prod(want):
            raise InvalidRequest(f"{field}.data: has {raw.size} values but shape {list(want)} needs "
                                 f"{math.prod(want)}; fix 'shape' or 'data'", field=field)
        if raw.ndim > 1 and raw.shape != want:
            raise InvalidRequest(f"{field}.data: nested lists of shape {list(raw.shape)} do not match shape "
                                 f"{list(want)}; send a flat list or nest as {list(want)}", field=field)
        if target.kind in "iu":
            if raw.dtype.kind == "f" and not np.all(np.isfinite(raw) & (raw == np.round(raw))):
                raise InvalidRequest(f"{field}.data: {target.name} input holds non-integer values", field=field)
            info = np.iinfo(target)
            if raw.size and (raw.min() < info.min or raw.max() > info.max):
                raise InvalidRequest(f"{field}.data: values outside the {target.name} range "
                                     f"[{info.min}, {info.max}]", field=field)
        out[name] = raw.astype(target).reshape(want)
    return out


@contextmanager
def _npz_errors(field: str) -> Iterator[None]:
    """``contracts.npz`` errors as API errors naming ``field`` (or the input whose dtype is refused)."""
    try:
        yield
    except npz.NpzTooLarge as exc:
        where = "inputs" if field == "body" else field
        raise BodyTooLarge(f"{where}: {exc}; send smaller inputs or split the job", field=where) from None
    except npz.NpzDtypeRefused as exc:
        raise InvalidRequest(f"inputs.{exc.name}.dtype: {exc}", field=f"inputs.{exc.name}") from None
    except npz.NpzError as exc:
        raise MalformedBody(f"{field}: not a readable .npz ({exc}); write it with numpy.savez", field=field) from None


class NpzInputs:
    """An ``.npz`` (body or ``inputs_uri``) whose members' headers are read and checked against the
    byte and element limits on opening; ``headers`` has each input's ``shape`` and ``dtype``, so the
    request can be checked against the signature before ``arrays()`` inflates anything."""

    def __init__(self, source: bytes | IO[bytes], *, field: str, max_bytes: int, max_elements: int) -> None:
        self.field = field
        with _npz_errors(field):
            self._zip = npz.open_zip(source)
            try:
                members = npz.read_headers(self._zip)
                npz.check_limits(members, max_bytes=max_bytes, max_elements=max_elements)
            except BaseException:
                self._zip.close()
                raise
        self.headers: dict[str, npz.Member] = {m.name: m for m in members}

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays, each read up to its declared size."""
        with _npz_errors(self.field):
            return npz.read_arrays(self._zip, list(self.headers.values()))

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def check_inputs(arrays: Mapping[str, np.ndarray], sig: Signature) -> None:
    """``check_signature`` and ``check_finite``."""
    check_signature(arrays, sig)
    check_finite(arrays)


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


def encode_npz(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Arrays as an uncompressed ``.npz`` (what workers read)."""
    buf = io.BytesIO()
    np.savez(buf, **{k: np.ascontiguousarray(v) for k, v in arrays.items()})
    return buf.getvalue()


def inputs_url(results_url: str, job_id: str) -> str:
    """``{results_url}/{job_id}/inputs.npz``."""
    return f"{job_url(results_url, job_id)}/{INPUTS}"


def write_inputs(results_url: str, job_id: str, arrays: Mapping[str, np.ndarray]) -> str:
    """Store the job's inputs as ``{results_url}/{job_id}/inputs.npz``; returns that URL."""
    url = inputs_url(results_url, job_id)
    storage.write_bytes(url, encode_npz(arrays))
    return url
