"""Request bodies -> numpy inputs (checked against the signature by ``app.checks``), and the job's ``inputs.npz``.

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
from typing import IO, Any, Self

import numpy as np
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from app.errors import BodyTimeout, BodyTooLarge, ClientClosedRequest, InvalidRequest, MalformedBody
from contracts import npz, rules, storage
from contracts.jobspec import JobCreate, JobOptions, ModelRef, RequestedOptions, TensorIn
from contracts.layout import INPUTS, job_url
from contracts.savedmodel import Signature

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
    advice = "put large inputs in storage and pass 'inputs_uri'"
    if limit_name == "JACOBIAN_MAX_JSON_BODY_BYTES":
        advice = f"send large inputs as an .npz body (Content-Type: {NPZ_MEDIA_TYPE}) or pass 'inputs_uri'"
    declared = content_length.strip() if content_length is not None else ""
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > max_bytes):
        raise BodyTooLarge(f"body: Content-Length {declared[:20]} is over the limit of {limit_text}; {advice}")
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
            raise BodyTooLarge(f"body: more than {limit_text}; {advice}")
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
    if isinstance(opts.get("wrt"), str) and "," in opts["wrt"]:  # several wrt in a query: "wrt=a,variables/w"
        opts["wrt"] = [name.strip() for name in opts["wrt"].split(",")]
    if isinstance(opts.get("sparsity"), str):
        opts["sparsity"] = sparsity_from_query(opts["sparsity"])
    if isinstance(opts.get("notify"), str):
        try:
            opts["notify"] = json.loads(opts["notify"])
        except ValueError:
            raise InvalidRequest(f"notify: {opts['notify'][:80]!r} is not a JSON object; give "
                                 'notify={"url": "https://...", "events": ["succeeded"]}', field="notify") from None
    return RequestedOptions.model_validate(opts), model


def sparsity_from_query(text: str) -> Any:
    """The ``sparsity`` query parameter of an ``.npz`` upload as the JSON form takes it: ``auto``;
    ``pattern_from:<job id>`` or ``pattern_uri:<url>`` (split at the first colon); or the JSON object
    itself (``{"pattern_uri": "s3://..."}``). ``null`` or nothing is dense, as is omitting it."""
    text = text.strip()
    if text in ("", "null"):
        return None
    if text.startswith("{"):
        try:
            return json.loads(text)
        except ValueError:
            raise InvalidRequest(f"sparsity: {text[:80]!r} is not a JSON object; use sparsity=auto, "
                                 "sparsity=pattern_from:<job id> or sparsity=pattern_uri:<url>", field="sparsity") \
                from None
    key, colon, value = text.partition(":")
    if colon and key in ("pattern_from", "pattern_uri"):
        return {key: value}
    return text  # "auto", or something JobOptions refuses with the accepted forms


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype that carries a tensor of this TensorFlow/numpy dtype name: ``float32`` for ``bfloat16``
    (``rules.wire_dtype``: numpy and ``.npz`` have no bfloat16; the worker rounds it to bfloat16)."""
    try:
        return np.dtype(rules.wire_dtype(name))
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
