"""A typed Python client of the Jacobian service's HTTP API (httpx and numpy; never TensorFlow).

    from jacobian.client import JacobianClient

    with JacobianClient("http://127.0.0.1:8000") as client:
        job_id = client.submit("mlp", {"x": x}, kind="batch_jacobian")
        record = client.wait(job_id, on_progress=lambda r: print(r["progress"]["fraction"]))
        first = client.result(job_id, rows=slice(0, 4))     # numpy rows 0:4 over HTTP
        J = client.result(job_id)                           # lazy zarr array straight from storage
                                                            # (a sparse Jacobian: a scipy.sparse.coo_array)

Errors of the API raise ``JacobianError`` (``.type``, ``.message``, ``.status_code``); a job that
ends ``failed`` or ``canceled`` raises ``JobFailed`` from ``wait``. Job records are checked against
``contracts.records.JobPublic`` (an answer that does not fit raises ``JacobianError`` of type
``InvalidResponse``): ``job()`` returns the typed record, ``status()``/``wait()``/``cancel()``/``list()``
its JSON as served. Connection errors are retried
a bounded number of times with exponential backoff (a POST only when it carries an
``Idempotency-Key``, which ``submit`` always sends), as are 502/503/504 answers.
"""

from __future__ import annotations

import builtins
import io
import json
import math
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import httpx
import numpy as np
from pydantic import BaseModel, ValidationError

from contracts.quote import Quote
from contracts.records import JobAccepted, JobList, JobPublic
from jacobian.events import JobEvent, follow_events
from jacobian.results import (
    coo_of,
    is_coo,
    main_array_of,
    open_coo,
    open_node,
    open_xarray,
    open_zarr,
    s3_storage_options,
)

__all__ = ["JacobianClient", "JacobianError", "JobFailed", "JobCanceled", "JobEvent", "DEFAULT_API_URL", "TERMINAL",
           "open_zarr", "open_xarray", "open_coo", "coo_of", "s3_storage_options"]

DEFAULT_API_URL = "http://127.0.0.1:8000"
TERMINAL = ("succeeded", "failed", "canceled")
NPZ_MEDIA_TYPE = "application/x-npz"
RETRY_STATUSES = (502, 503, 504)
PAGE_BYTES = 64 * 1024 * 1024  # rows are fetched in pages of at most this many bytes

ProgressCallback = Callable[[dict[str, Any]], None]


class JacobianError(Exception):
    """An error answer of the API (``{"error": {"type", "message"}}``), or the API out of reach."""

    def __init__(self, type: str, message: str, *, status_code: int | None = None) -> None:
        super().__init__(f"{type}: {message}")
        self.type = type
        self.message = message
        self.status_code = status_code


class JobFailed(JacobianError):
    """The job ended ``failed`` (or ``canceled``: ``JobCanceled``); ``.record`` is its last status."""

    def __init__(self, job_id: str, record: dict[str, Any]) -> None:
        error = record.get("error") or {}
        super().__init__(str(error.get("type") or record.get("status") or "JobFailed"),
                         str(error.get("message") or f"job {job_id} ended {record.get('status')}"))
        self.job_id = job_id
        self.record = record


class JobCanceled(JobFailed):
    """The job was canceled."""


def row_range(rows: slice | tuple[int, int] | None, rows_total: int | None) -> tuple[int, int | None]:
    """``slice(a, b)`` -> ``(a, b)`` (negative indices need ``rows_total``); ``None`` -> everything."""
    if rows is None:
        return 0, None
    if isinstance(rows, tuple):
        rows = slice(*rows)
    if not isinstance(rows, slice) or rows.step not in (None, 1):
        raise ValueError(f"rows: {rows!r} is not a row range; use slice(a, b) (step 1)")
    start, stop = rows.start, rows.stop
    if (start is not None and start < 0) or (stop is not None and stop < 0):
        if rows_total is None:
            raise ValueError("rows: negative indices need the job's rows_total, which its status lacks")
        start, stop, _ = rows.indices(rows_total)
    return int(start or 0), None if stop is None else int(stop)


class JacobianClient:
    """Client of one API. ``api_url`` defaults to ``JACOBIAN_API_URL`` (else http://127.0.0.1:8000);
    ``api_key`` is sent as ``Authorization: Bearer``. Use as a context manager or call ``close()``."""

    def __init__(self, api_url: str | None = None, api_key: str | None = None, *, timeout_s: float = 60.0,
                 retries: int = 5, backoff_s: float = 0.25, max_backoff_s: float = 5.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.api_url = (api_url or os.environ.get("JACOBIAN_API_URL") or DEFAULT_API_URL).rstrip("/")
        self.retries = max(0, retries)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.api_url, headers=headers, timeout=timeout_s, transport=transport)

    # -- plumbing --------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> JacobianClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, *, safe_to_retry: bool | None = None, **kwargs: Any) -> httpx.Response:
        """One request with bounded retries; raises ``JacobianError`` for an error answer.

        Connection failures before anything was sent are always retried; failures after the request
        may have reached the API only when ``safe_to_retry`` (default: GET).
        """
        if safe_to_retry is None:
            safe_to_retry = method == "GET"
        attempt = 0
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                failure: Exception | httpx.Response = exc
            except httpx.TransportError as exc:
                if not safe_to_retry:
                    raise JacobianError("ConnectionError", f"{method} {self.api_url}{path}: {exc!r} (not retried: "
                                        "the request may have reached the API)") from exc
                failure = exc
            else:
                if response.status_code not in RETRY_STATUSES or attempt >= self.retries:
                    return self._checked(response)
                failure = response
            if attempt >= self.retries:
                raise JacobianError("ConnectionError", f"cannot reach the API at {self.api_url} "
                                    f"({method} {path}, {attempt + 1} attempts): {failure!r}") from None
            time.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** attempt))
            attempt += 1

    @staticmethod
    def _checked(response: httpx.Response) -> httpx.Response:
        if response.is_success:
            return response
        try:
            error = response.json()["error"]
            kind, message = str(error["type"]), str(error["message"])
        except (ValueError, KeyError, TypeError):
            kind, message = f"HTTP{response.status_code}", response.text[:500] or response.reason_phrase
        raise JacobianError(kind, message, status_code=response.status_code)

    # -- jobs ------------------------------------------------------------------------------------

    def submit(self, model_path: str, inputs: Mapping[str, np.ndarray], *, signature: str = "serving_default",
               idempotency_key: str | None = None, **options: Any) -> str:
        """Queue a job; returns its id. ``inputs`` go as an ``.npz`` body; ``options`` are the job
        options (``of``, ``wrt``, ``kind``, ``mode``, ``memory_budget_bytes``, ``reduce``,
        ``check_independence``, ``output_dtype``, ``chunk_rows``, ``shards``, ``precision`` (``"highest"``,
        ``"tf32"`` or ``"auto"``: computed again in float64 when the result's float64-probe error estimate,
        ``result["precision_error"]`` of ``status``, exceeds the tolerance; README 'Precision'); the matrix-free
        kinds' ``rank``, ``tol``, ``max_iterations``, ``allow_unconverged``, ``samples`` and ``seeds``, an array
        sent as the member ``__seeds__``; the curvature kinds' ``loss``, ``damping``, ``curvature``,
        ``precondition`` and ``labels``, the name of an entry of ``inputs`` that holds the labels (sent with the
        inputs); ``wrt`` may be a list; ``sparsity``: ``"auto"``, ``{"pattern_from": job_id}`` or
        ``{"pattern_uri": url}``; ``notify``: ``{"url": ..., "events": [...]}``, webhooks, README 'Webhooks');
        ``None`` values are left out."""
        body = _npz_body(inputs, options)
        return self.submit_npz(model_path, body, signature=signature, idempotency_key=idempotency_key, **options)

    def quote(self, model_path: str, inputs: Mapping[str, np.ndarray], *, signature: str = "serving_default",
              **options: Any) -> Quote:
        """What ``submit`` with the same arguments would cost, as a typed ``Quote`` (``POST /v1/jobs?dry_run=true``):
        result arrays and bytes, passes, predicted peak memory and seconds and whether they are a guess. Every check
        of a submission runs (a refusal raises ``JacobianError`` naming what would fit); nothing is queued."""
        body = _npz_body(inputs, options)
        return self.quote_npz(model_path, body, signature=signature, **options)

    def quote_npz(self, model_path: str, npz: bytes, *, signature: str = "serving_default", **options: Any) -> Quote:
        """``quote`` with the inputs already encoded as ``.npz`` bytes."""
        params = {**_query(model_path, signature, options), "dry_run": "true"}
        response = self._request("POST", "/v1/jobs", params=params, content=npz, safe_to_retry=True,
                                 headers={"Content-Type": NPZ_MEDIA_TYPE})
        return Quote.model_validate(_checked_json(response, Quote))

    def submit_npz(self, model_path: str, npz: bytes, *, signature: str = "serving_default",
                   idempotency_key: str | None = None, **options: Any) -> str:
        """``submit`` with the inputs already encoded as ``.npz`` bytes (e.g. read from a file)."""
        params = _query(model_path, signature, options)
        # A key of our own makes retrying the POST after a dropped connection safe: same key, same job.
        key = idempotency_key or f"client-{uuid.uuid4().hex}"
        response = self._request("POST", "/v1/jobs", params=params, content=npz, safe_to_retry=True,
                                 headers={"Content-Type": NPZ_MEDIA_TYPE, "Idempotency-Key": key})
        return str(_checked_json(response, JobAccepted)["id"])

    def job(self, job_id: str) -> JobPublic:
        """``GET /v1/jobs/{id}`` as a typed record: status, progress, plan, result, error, timestamps."""
        return JobPublic.model_validate(self.status(job_id))

    def status(self, job_id: str) -> dict[str, Any]:
        """``GET /v1/jobs/{id}`` as served (JSON), checked against ``JobPublic``."""
        return _checked_json(self._request("GET", f"/v1/jobs/{job_id}"), JobPublic)

    def wait(self, job_id: str, *, on_progress: ProgressCallback | None = None, timeout_s: float | None = None,
             poll_s: float = 0.5) -> dict[str, Any]:
        """Poll until the job ends; returns its record when it succeeded, raises ``JobFailed``
        (``JobCanceled``) otherwise and ``TimeoutError`` after ``timeout_s``. ``on_progress(record)``
        is called after every poll, the last one included."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            record = self.status(job_id)
            if on_progress is not None:
                on_progress(record)
            status = record.get("status")
            if status == "succeeded":
                return record
            if status == "canceled":
                raise JobCanceled(job_id, record)
            if status == "failed":
                raise JobFailed(job_id, record)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {status} after {timeout_s:g} s")
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))

    def follow(self, job_id: str, *, last_event_id: str | None = None) -> Iterator[JobEvent]:
        """``GET /v1/jobs/{id}/events``: the job's events (``status``, ``progress`` with rows and ETA) up to and
        including ``end`` (the terminal record), resumed with ``Last-Event-ID`` when the connection drops.

            for event in client.follow(job_id):
                print(event.event, event.data["status"], event.data["progress"]["eta_seconds"])

        Raises ``JacobianError`` for an error answer (404: unknown job)."""
        return follow_events(self._http, f"/v1/jobs/{job_id}/events", checked=self._checked,
                             last_event_id=last_event_id, retries=self.retries, backoff_s=self.backoff_s,
                             max_backoff_s=self.max_backoff_s)

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Request cancellation; returns the record (``canceled`` at once if it was still queued)."""
        return _checked_json(self._request("POST", f"/v1/jobs/{job_id}/cancel", safe_to_retry=True), JobPublic)

    def list(self, status: str | None = None, limit: int = 50) -> builtins.list[dict[str, Any]]:
        """Jobs newest first (at most ``limit``, following pages as needed), optionally of one status."""
        jobs: builtins.list[dict[str, Any]] = []
        token: str | None = None
        while len(jobs) < limit:
            params: dict[str, Any] = {"limit": min(1000, limit - len(jobs))}
            if status is not None:
                params["status"] = status
            if token:
                params["page_token"] = token
            page = _checked_json(self._request("GET", "/v1/jobs", params=params), JobList)
            jobs.extend(page["jobs"])
            token = page.get("next_page_token")
            if not token or not page["jobs"]:
                break
        return jobs[:limit]

    # -- results ---------------------------------------------------------------------------------

    def result(self, job_id: str, rows: slice | tuple[int, int] | None = None, *, as_xarray: bool = False) -> Any:
        """With ``rows`` (``slice(a, b)``): those rows as a numpy array ``(b - a,) + row_shape``, read
        over HTTP. Without: the whole result, lazy, read from the job's result group (local path, or
        ``s3://`` with credentials and endpoint from the ``AWS_*`` variables): a ``zarr.Array``, or with
        ``as_xarray=True`` an ``xarray.Dataset`` with named dimensions and the request as attributes.

        A sparse Jacobian (a group of format ``coo``): without ``rows``, the matrix as a
        ``scipy.sparse.coo_array`` of shape ``(n_of, n_wrt)`` (read whole; needs scipy); with ``rows``,
        dense rows of that matrix, ``(b - a,) + wrt_shape``."""
        if as_xarray:
            if rows is not None:
                raise ValueError("rows: as_xarray=True reads the whole group lazily; select rows on the "
                                 "Dataset instead (e.g. ds.jacobian.isel(of_0=slice(a, b)))")
            return open_xarray(self._result_uri(job_id))
        if rows is None:
            node = open_node(self._result_uri(job_id))
            return coo_of(node) if is_coo(node) else main_array_of(node)
        return np.concatenate(builtins.list(self.iter_rows(job_id, rows)))

    def iter_rows(self, job_id: str, rows: slice | tuple[int, int] | None = None, *,
                  page_bytes: int = PAGE_BYTES) -> Iterator[np.ndarray]:
        """Rows ``rows`` (default all) in pages of at most ``page_bytes``, each ``(n,) + row_shape``."""
        rows_total, row_bytes = self.row_geometry(job_id)
        start, stop = row_range(rows, rows_total)
        if stop is None:
            stop = rows_total
        if rows_total is None or stop is None or row_bytes is None:  # unknown geometry: one request
            yield self._rows(job_id, f"{start}:{'' if stop is None else stop}")
            return
        per_page = max(1, page_bytes // max(1, row_bytes))
        if start >= stop:  # let the API say what is wrong with the range
            yield self._rows(job_id, f"{start}:{stop}")
            return
        for a in range(start, stop, per_page):
            yield self._rows(job_id, f"{a}:{min(stop, a + per_page)}")

    def _rows(self, job_id: str, spec: str) -> np.ndarray:
        return self._rows_answer(job_id, spec)[0]

    def _rows_answer(self, job_id: str, spec: str) -> tuple[np.ndarray, httpx.Headers]:
        response = self._request("GET", f"/v1/jobs/{job_id}/result", params={"rows": spec})
        return np.load(io.BytesIO(response.content), allow_pickle=False), response.headers

    def row_geometry(self, job_id: str) -> tuple[int | None, int | None]:
        """``(rows_total, bytes per row)`` of the job's result as ``GET .../result?rows=`` serves it, from its
        record (a sparse Jacobian's from ``result.dense_shape``); when the record does not say, from the
        API's headers on row 0 of a succeeded job (``None`` where unknown)."""
        record = self.job(job_id)
        rows_total, row_bytes = _row_geometry(record)
        if (rows_total is None or row_bytes is None) and record.status.value == "succeeded":
            try:
                row, headers = self._rows_answer(job_id, "0:1")
                rows_total = int(headers["x-rows-total"])
            except (JacobianError, KeyError, ValueError):
                return rows_total, row_bytes
            row_bytes = max(1, int(row.nbytes))
        return rows_total, row_bytes

    def open_result(self, job_id: str) -> Any:
        """The job's result as a lazy ``zarr.Array`` (nothing read until indexed): its main array (``values``
        of a sparse Jacobian; ``result()`` gives the matrix)."""
        return open_zarr(self._result_uri(job_id))

    def _result_uri(self, job_id: str) -> str:
        """The result group of a succeeded job; ``JacobianError("JobNotFinished")`` before that."""
        record = self.job(job_id)
        if record.status.value != "succeeded":
            raise JacobianError("JobNotFinished", f"id: job {job_id!r} is {record.status.value}; its result "
                                "can be read once its status is 'succeeded'", status_code=409)
        if record.result is None:
            raise JacobianError("JobNotFinished", f"id: job {job_id!r} has no result uri", status_code=409)
        return record.result.uri


def _npz_body(inputs: Mapping[str, np.ndarray], options: dict[str, Any]) -> bytes:
    """The inputs as an ``.npz`` body; ``seeds`` (popped from ``options``) as the member ``__seeds__``."""
    arrays = {name: np.asarray(value) for name, value in inputs.items()}
    seeds = options.pop("seeds", None)
    if seeds is not None:  # jvp, vjp, hvp: the .npz member the API takes seeds from
        arrays["__seeds__"] = np.asarray(seeds)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _query(model_path: str, signature: str, options: Mapping[str, Any]) -> dict[str, str]:
    """The query parameters of an ``.npz`` POST: the options (``None`` left out) in their query spelling."""
    params = {"model_path": model_path, "signature": signature}
    for name, value in options.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, (list, tuple)):  # several wrt: comma-separated in the query
            value = ",".join(map(str, value))
        elif isinstance(value, (dict, BaseModel)):  # sparsity={"pattern_from": id}: the JSON object
            value = json.dumps(value.model_dump() if isinstance(value, BaseModel) else value)
        params[name] = str(getattr(value, "value", value))
    return params


def _checked_json(response: httpx.Response, model: type[BaseModel]) -> dict[str, Any]:
    """The answer's JSON object, checked against ``model``; ``JacobianError("InvalidResponse")`` when it
    does not fit (an API of another version, or something else at that address)."""
    try:
        body = response.json()
        model.model_validate(body)
    except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
        raise JacobianError("InvalidResponse", f"{response.request.method} {response.request.url.path}: the "
                            f"answer is not a {model.__name__} ({exc}); is JACOBIAN_API_URL a Jacobian API of "
                            "this version?", status_code=response.status_code) from None
    return dict(body)


def _is_sparse_record(record: JobPublic) -> bool:
    """Whether the job's result is a sparse Jacobian: ``result.format`` is ``coo``, or ``plan.sparsity``
    is set without a ``fallback`` (the sparse path was taken)."""
    if record.result is not None and record.result.format is not None:
        return record.result.format == "coo"
    sparsity = record.plan.sparsity
    return isinstance(sparsity, dict) and not sparsity.get("fallback")


def _row_geometry(record: JobPublic) -> tuple[int | None, int | None]:
    """``(rows_total, bytes per row)`` from a job record, ``None`` where it does not say. A sparse Jacobian's
    rows are those of its ``dense_shape`` ``(n_of, n_wrt)`` (its progress counts the passes computed)."""
    if _is_sparse_record(record):
        dense = record.result.dense_shape if record.result is not None else None
        if not dense or len(dense) != 2:
            return None, None
        try:
            return dense[0], max(1, dense[1] * np.dtype(record.result.dtype).itemsize)
        except TypeError:
            return dense[0], None
    rows_total = record.progress.rows_total
    if rows_total is None or rows_total <= 0 or record.result is None:
        return rows_total, None
    try:
        total_bytes = math.prod(record.result.shape) * np.dtype(record.result.dtype).itemsize
    except TypeError:
        return rows_total, None
    return rows_total, max(1, total_bytes // rows_total)
