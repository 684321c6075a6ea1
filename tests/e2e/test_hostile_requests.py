"""Hostile requests against the real stack: ``jacobian serve`` in its own process on the session's
redis-server, spoken to over raw HTTP (httpx; raw sockets for bodies that stall or stop).

Every answer is a 4xx whose message names the field, nothing is queued or written, no answer of the
module is a 5xx (the API's own metrics say so) and no traceback is logged, and the API's peak resident
memory (``VmHWM`` in ``/proc/<pid>/status``) grows by less than 300 MiB over the whole module, .npz
bombs that inflate to gigabytes included. The API runs with the default limits except where a case
needs a smaller one.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.e2e.hostile import (
    BOMBS,
    HUGE_RESULT_BOMB,
    HUGE_SHAPE_BOMB,
    MIB,
    UNICODE_BOMB,
    VOID_BOMB,
    WRONG_SHAPE_BOMB,
    Stack,
    bomb,
    deep_data,
    get,
    json_data,
    json_post,
    many_members,
    mlp,
    npz_bytes,
    npz_post,
    post,
    raw_upload,
    requests_counted,
    token,
    uri_post,
)

pytestmark = pytest.mark.e2e

PEAK_GROWTH_LIMIT_BYTES = 300 * MIB
BODY_READ_TIMEOUT_S = 2.0


# (case id, request as httpx.request keyword arguments given the stack, status, text the message contains)
Request = Callable[[Stack], dict[str, Any]]
CASES: list[tuple[str, Request, int, str]] = [
    ("npz void bomb", lambda s: npz_post(bomb(*VOID_BOMB)), 422, "inputs.x.dtype: dtype '|V1073741824' is not a"),
    ("npz unicode bomb", lambda s: npz_post(bomb(*UNICODE_BOMB)), 422, "inputs.x.dtype: dtype '<U134217728'"),
    ("npz huge shape bomb", lambda s: npz_post(bomb(*HUGE_SHAPE_BOMB)), 413,
     "inputs: 17179869184 elements in total, over the limit"),
    ("npz wrong shape bomb", lambda s: npz_post(bomb(*WRONG_SHAPE_BOMB)), 422, "inputs.x.shape: got [8388608, 7]"),
    ("npz huge result bomb", lambda s: npz_post(bomb(*HUGE_RESULT_BOMB)), 422, "JACOBIAN_MAX_RESULT_BYTES"),
    ("npz void bomb as inputs_uri", lambda s: uri_post(s, "void.npz"), 422, "inputs.x.dtype: dtype '|V1073741824'"),
    ("npz huge shape bomb as inputs_uri", lambda s: uri_post(s, "huge shape.npz"), 413, "inputs_uri: 17179869184"),
    ("npz wrong shape bomb as inputs_uri", lambda s: uri_post(s, "wrong shape.npz"), 422, "inputs.x.shape"),
    ("npz bytes over the limit", lambda s: npz_post(bomb("<c16", (1 << 26,), 0)), 413,
     "inputs: 1073741824 bytes of data in total, over the limit"),
    ("npz header longer than its member", lambda s: npz_post(bomb("<f4", (2, 8), 8)), 400,
     "body: not a readable .npz (member 'x.npy': holds"),
    ("npz with many members", lambda s: npz_post(many_members(1000)), 400, "body: not a readable .npz (1000 members"),
    ("npz cut short", lambda s: npz_post(npz_bytes(x=np.zeros((2, 8), np.float32))[:-40]), 400,
     "body: not a readable .npz"),
    ("npz member named like a path", lambda s: npz_post(npz_bytes(**{"../../etc/passwd": np.ones(2)})), 422,
     "inputs.../../etc/passwd: signature 'serving_default' has no input"),
    ("npz with an empty batch", lambda s: npz_post(npz_bytes(x=np.zeros((0, 8), np.float32))), 422,
     "inputs.x.shape: [0, 8] holds no elements"),
    # inputs_uri: only files under the results storage, and names the file system can take
    ("inputs_uri a folder", lambda s: uri_post(s, ""), 422, "is a folder, not a file"),
    ("inputs_uri with a NUL byte", lambda s: uri_post(s, "a\x00b.npz"), 422, "inputs_uri: contains a NUL byte"),
    ("inputs_uri with a long name", lambda s: uri_post(s, "a" * 300 + ".npz"), 422,
     "inputs_uri: has a path component of 304 bytes"),
    ("inputs_uri not UTF-8", lambda s: uri_post(s, "\ud800.npz"), 422, "inputs_uri: is not valid UTF-8"),
    # model paths
    ("signature path with a long name", lambda s: get("/v1/models/signature", path="m" * 300), 422,
     "path: has a path component of 300 bytes"),
    ("signature path with a NUL byte", lambda s: get("/v1/models/signature", path="mlp\x00"), 422,
     "path: contains a NUL byte"),
    ("model path with a long name", lambda s: json_post(mlp(model={"path": "m" * 300})), 422,
     "model.path: has a path component of 300 bytes"),
    ("model path not UTF-8", lambda s: json_post(mlp(model={"path": "\udcff"})), 422,
     "model.path: Input should be a valid string"),
    ("npz model_path with a long name", lambda s: npz_post(npz_bytes(x=np.ones((2, 8), np.float32)),
                                                            model_path="m" * 300), 422, "model_path: has a path"),
    # tensors
    ("shape of rank 65", lambda s: json_post(mlp(inputs={"x": {"shape": [1] * 65, "data": [0.5]}})), 422,
     "inputs.x.shape: 65 dimensions, more than 32"),
    ("empty batch", lambda s: json_post(mlp(inputs={"x": {"shape": [0, 8], "data": []}})), 422,
     "inputs.x.shape: [0, 8] holds no elements"),
    # options that would fail in the worker
    ("chunk_rows beyond 64 bits", lambda s: json_post(mlp(chunk_rows=2**64)), 422,
     "chunk_rows: Input should be less than or equal to 2147483647"),
    ("shards by the million", lambda s: json_post(mlp(shards=10**6)), 422,
     "shards: Input should be less than or equal to 1024"),
    ("npz shards by the million", lambda s: npz_post(npz_bytes(x=np.ones((2, 8), np.float32)), shards="1000000"),
     422, "shards: Input should be less than or equal to 1024"),
    ("memory budget beyond 64 bits", lambda s: json_post(mlp(memory_budget_bytes=2**64)), 422,
     "memory_budget_bytes: Input should be less than or equal to"),
    # JSON that parses into trouble
    ("JSON body over its limit", lambda s: json_post(b'{"model": {"path": "mlp"}, "inputs": {"x": {"shape": [2, 8], '
                                                    b'"data": [' + b"0.5," * (2 * MIB) + b'0.5]}}}'), 413,
     "is over the limit of 4194304 bytes (JACOBIAN_MAX_JSON_BODY_BYTES); send large inputs as an .npz body"),
    ("JSON body over its limit, chunked", lambda s: {**json_post(b""), "content": iter([b"[" + b"0," * MIB] * 5)},
     413, "body: more than 4194304 bytes (JACOBIAN_MAX_JSON_BODY_BYTES); send large inputs as an .npz body"),
    ("JSON at its limit, data not the shape", lambda s: json_post(json_data(b"0.5,", 4)), 422,
     "inputs.x.data: has 1048557 values but shape [2, 8] needs 16"),
    ("JSON at its limit, a million empty lists", lambda s: json_post(json_data(b"[],", 3)), 413,
     "body: 1398082 JSON arrays and objects, more than 65536; send each tensor's data as a flat list"),
    ("JSON of 65000 nested rows", lambda s: json_post(json_data(b"[0.5],", 6, rows=65_000)), 422,
     "inputs.x.data: has 65000 values but shape [2, 8] needs 16"),
    ("JSON with 100000 inputs", lambda s: json_post(mlp(inputs={f"a{i}": {"shape": [1], "data": [0]}
                                                                for i in range(100_000)})), 413,
     "body: 300003 JSON arrays and objects, more than 65536"),
    ("JSON with 65 inputs", lambda s: json_post(mlp(inputs={f"a{i}": {"shape": [1], "data": [0]} for i in range(65)})),
     422, "inputs: 65 tensors, more than 64; give one per model input"),
    ("JSON nested 30000 levels", lambda s: json_post(b"[" * 30_000 + b"]" * 30_000), 400, "body: nested too deeply"),
    ("JSON data nested 30000 levels", lambda s: json_post(deep_data(30_000)), 400, "body: nested too deeply"),
    ("JSON nested 100000 levels", lambda s: json_post(b"[" * 100_000 + b"]" * 100_000), 413,
     "body: 100000 JSON arrays and objects"),
    ("JSON integer of 5000 digits", lambda s: json_post(b'{"model": {"path": "mlp"}, "shards": ' + b"9" * 5000 + b"}"),
     400, "body: not valid JSON"),
    ("JSON field name not UTF-8", lambda s: json_post(mlp(**{"\ud800": 1})), 422,
     "body: Input should be a valid string"),
    ("input name not UTF-8", lambda s: json_post(mlp(inputs={"\ud800": {"shape": [1], "data": [1.0]}})), 422,
     "has no input"),
    ("signature name not UTF-8", lambda s: json_post(mlp(model={"path": "mlp", "signature": "\ud800"})), 422,
     "model.signature:"),
    # query parameters
    ("page token with NaN", lambda s: get("/v1/jobs", page_token=token({"before": float("nan"), "id": "0" * 32})),
     422, "page_token: not a token from a previous page"),
    ("page token with Infinity", lambda s: get("/v1/jobs", page_token=token({"before": float("inf")})), 422,
     "page_token"),
    ("page token with a string", lambda s: get("/v1/jobs", page_token=token({"before": "nan", "id": "0" * 32})), 422,
     "page_token"),
    ("page token with a foreign id", lambda s: get("/v1/jobs", page_token=token({"before": 1.0, "id": "x:shards"})),
     422, "page_token"),
    ("page token of 8000 characters", lambda s: get("/v1/jobs", page_token="A" * 8000), 422, "page_token"),
    ("list limit of 5000 digits", lambda s: get("/v1/jobs", limit="9" * 5000), 422, "limit"),
    # job ids: only those the service issued resolve, nothing else in Redis is reachable through them
    ("job id naming the shard hash", lambda s: get(f"/v1/jobs/{s.job_id}:shards"), 404, "id: no job"),
    ("cancel through the shard hash", lambda s: post(f"/v1/jobs/{s.job_id}:shards/cancel"), 404, "id: no job"),
    ("result through the shard hash", lambda s: get(f"/v1/jobs/{s.job_id}:shards/result"), 404, "id: no job"),
    ("preview through the shard hash", lambda s: get(f"/v1/jobs/{s.job_id}:shards/preview.png"), 404, "id: no job"),
    ("job id in capitals", lambda s: get(f"/v1/jobs/{s.job_id.upper()}"), 404, "id: no job"),
    ("job id of 5000 characters", lambda s: get("/v1/jobs/" + "a" * 5000), 404, "id: no job"),
    # result rows
    ("rows of 5000 digits", lambda s: get(f"/v1/jobs/{s.job_id}/result", rows="1" * 5000 + ":"), 416,
     "rows: '1111"),
    ("rows in Arabic-Indic digits", lambda s: get(f"/v1/jobs/{s.job_id}/result", rows="\u0661:\u0662"), 422,
     "rows: '\u0661:\u0662' is not a row range"),
    ("rows in full-width digits", lambda s: get(f"/v1/jobs/{s.job_id}/result", rows="\uff11"), 422,
     "is not a row range"),
    ("Idempotency-Key of 300 characters", lambda s: {**json_post(mlp()), "headers": {
        "Content-Type": "application/json", "Idempotency-Key": "k" * 300}}, 422, "Idempotency-Key: use 1 to 255"),
    # routes and methods
    ("unknown path", lambda s: get("/v1/nothing"), 404, "path: '/v1/nothing' does not exist"),
    ("method not allowed", lambda s: {"method": "DELETE", "url": "/v1/jobs"}, 405,
     "method: DELETE is not allowed on /v1/jobs; use GET, POST"),
]



# -- the stack under test ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(redis_server, model_root, tmp_path_factory):
    s = Stack(redis_server.url, model_root, tmp_path_factory.mktemp("hostile"), body_read_timeout_s=BODY_READ_TIMEOUT_S)
    try:
        s.wait_ready()
        warm_up(s)
        s.baseline_rss_bytes = s.peak_rss_bytes()
        yield s
    finally:
        s.http.close()
        s.api.stop()


def warm_up(s: Stack) -> None:
    """Requests that run the whole validation (JSON and .npz, up to the NaN check) so that what the
    first request of each kind loads is in the baseline, not counted as growth."""
    data = [0.5] * 16
    data[3] = float("nan")
    body = json.dumps({"model": {"path": "mlp"}, "inputs": {"x": {"shape": [2, 8], "data": data}}})
    for _ in range(3):
        assert s.send(json_post(body.encode())).status_code == 422
        r = s.send(npz_post(npz_bytes(x=np.full((2, 8), np.nan, np.float32))))
        assert r.status_code == 422, r.text
        assert s.http.get("/v1/models/signature", params={"path": "mlp"}).status_code == 200
        assert s.http.get("/v1/jobs").status_code == 200


@pytest.fixture(scope="module", autouse=True)
def prepared(stack):
    """Written before any check: the bombs as files under the results storage (for ``inputs_uri``), and a
    succeeded job as a worker leaves it (record, shard hash, result array) for the id and rows cases."""
    import zarr

    from contracts.jobspec import JobStatus
    from contracts.jobstore import JobRecord, JobStore

    for name, args in BOMBS.items():
        (stack.uploads / f"{name}.npz").write_bytes(bomb(*args))
    stack.job_id = uuid.uuid4().hex
    uri = str(stack.results / stack.job_id / "result.zarr")
    array = zarr.create_group(store=uri).create_array("jacobian", shape=(4, 3), dtype="float32", chunks=(2, 3),
                                                      attributes={"shape": [4, 3], "iter_start": 0, "iter_stop": 1})
    array[...] = np.arange(12, dtype=np.float32).reshape(4, 3)
    store = JobStore(stack.redis)
    store.create(JobRecord(id=stack.job_id, status=JobStatus.succeeded, created_at=1.0, finished_at=2.0,
                           spec={"kind": "jacobian", "results_url": str(stack.results)},
                           result={"uri": uri, "shape": [4, 3], "dtype": "float32"}))
    store.set_shard_plan(stack.job_id, {"shards": 2, "ranges": [[0, 2], [2, 4]], "rows_total": 4})



# -- tests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make,status,text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_request(stack, make, status, text):
    before = stack.state()
    r = stack.send(make(stack))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"type", "message"} and text in error["message"], error
    assert re.match(r"\S+: ", error["message"]), error  # "field: what is wrong; the fix"
    assert stack.state() == before


def test_client_gone_mid_upload_is_not_a_server_error(stack):
    """The client sends 1000 of 100000 bytes and closes: counted as 499 (client closed request), no 5xx,
    no traceback, nothing written."""
    before, gone_before = stack.state(), requests_counted(stack, "499")
    sock = raw_upload(stack, 100_000, b" " * 1000)
    sock.close()
    deadline = time.monotonic() + 10
    while requests_counted(stack, "499") == gone_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert requests_counted(stack, "499") == gone_before + 1
    assert requests_counted(stack, "500") == 0
    assert "Traceback" not in stack.log_text()
    assert stack.state() == before


def test_stalled_body_is_timed_out(stack):
    """A body that stops arriving is answered 408 after JACOBIAN_BODY_READ_TIMEOUT_S, and the connection closed."""
    before = stack.state()
    start = time.monotonic()
    with raw_upload(stack, 1000, b'{"model": ') as sock:
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    waited = time.monotonic() - start
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    assert json.loads(body)["error"]["message"].startswith(
        f"body: nothing received for {BODY_READ_TIMEOUT_S:g} s after 10 bytes (JACOBIAN_BODY_READ_TIMEOUT_S)")
    assert BODY_READ_TIMEOUT_S <= waited < BODY_READ_TIMEOUT_S + 10
    assert stack.state() == before


@pytest.mark.parametrize("method,url,allow", [("DELETE", "/v1/jobs", "GET, POST"), ("PUT", "/healthz", "GET"),
                                              ("GET", "/v1/jobs/{id}/cancel", "POST")])
def test_405_says_what_is_allowed(stack, method, url, allow):
    r = stack.http.request(method, url.format(id=stack.job_id))
    assert r.status_code == 405 and r.headers["allow"] == allow
    assert r.json()["error"]["message"].endswith(f"; use {allow}")


def test_no_5xx_no_traceback_and_bounded_memory(stack):
    """Last in the module: every hostile request once more (so that this test alone covers them all),
    then the API's peak memory since the warm-up, its metrics and its log."""
    for _, make, status, _ in CASES:
        assert stack.send(make(stack)).status_code == status
    growth = stack.peak_rss_bytes() - stack.baseline_rss_bytes
    print(f"\n[hostile] API peak memory (VmHWM) grew by {growth / MIB:.1f} MiB over the module "
          f"(baseline {stack.baseline_rss_bytes / MIB:.1f} MiB)")
    assert growth < PEAK_GROWTH_LIMIT_BYTES, f"VmHWM grew by {growth / MIB:.1f} MiB"
    metrics = stack.http.get("/metrics").text
    server_errors = [line for line in metrics.splitlines()
                     if line.startswith("jacobian_http_requests_total{") and 'status_code="5' in line]
    assert not server_errors, server_errors
    assert "Traceback" not in stack.log_text(), stack.api.tail()
