"""Bad job submissions: the right 4xx, a message that names the field, and nothing queued or stored."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from rq import Queue

from app.main import create_app
from contracts.settings import get_settings
from tests import models

pytestmark = pytest.mark.integration
@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    """The models, plus ``escape``: a symlink in the root to a real SavedModel outside it."""
    base = tmp_path_factory.getbasetemp()
    root = models.build_models(base)
    outside = base / "outside" / "mlp"
    if not outside.exists():
        shutil.copytree(root / "mlp", outside)
    if not (root / "escape").is_symlink():
        (root / "escape").symlink_to(outside)
    return root


@pytest.fixture
def client(redis_server, redis_conn, model_root, results, monkeypatch):
    monkeypatch.setenv("JACOBIAN_REDIS_URL", redis_server.url)
    monkeypatch.setenv("JACOBIAN_RESULTS_URL", str(results))
    monkeypatch.setenv("JACOBIAN_MODEL_ROOTS", str(model_root))
    monkeypatch.setenv("JACOBIAN_MAX_BODY_BYTES", "20000")
    monkeypatch.setenv("JACOBIAN_MAX_INPUT_ELEMENTS", "1000")
    monkeypatch.delenv("JACOBIAN_API_KEYS", raising=False)
    get_settings.cache_clear()
    with TestClient(create_app()) as c:
        yield c
    get_settings.cache_clear()


def assert_nothing_queued(redis_conn, results: Path) -> None:
    assert Queue("jacobian", connection=redis_conn).count == 0
    assert redis_conn.keys("rq:job:*") == []
    assert redis_conn.keys("jacobian:job:*") == [] and redis_conn.zcard("jacobian:jobs") == 0
    assert not results.exists() or not any(p.is_file() for p in results.rglob("*"))


def x(shape=(2, 8), **extra) -> dict:
    n = int(np.prod(shape))
    return {"shape": list(shape), "data": [0.25] * n, **extra}


def mlp(**extra) -> dict:
    return {"model": {"path": "mlp"}, "inputs": {"x": x()}, **extra}


def multi(**extra) -> dict:
    return {"model": {"path": "multi_io"}, "inputs": {"a": x((1, 4)), "b": x((1, 3))}, **extra}


def ints(**extra) -> dict:
    return {"model": {"path": "int_input"},
            "inputs": {"ids": {"shape": [1, 4], "dtype": "int32", "data": [1, 2, 3, 4]}, "x": x((1, 4))}, **extra}


def f64(**extra) -> dict:
    return {"model": {"path": "float64"}, "inputs": {"x": x((2, 5))}, **extra}


# (case id, JSON body, status, text the message must contain)
JSON_CASES = [
    ("wrong shape", mlp(inputs={"x": x((2, 7))}), 422, "inputs.x.shape"),
    ("wrong rank", mlp(inputs={"x": x((16,))}), 422, "inputs.x.shape"),
    ("wrong dtype", mlp(inputs={"x": x(dtype="float64")}), 422, "inputs.x.dtype"),
    ("unsupported dtype", mlp(inputs={"x": x(dtype="complex64")}), 422, "dtype"),
    ("unknown input", mlp(inputs={"x": x(), "z": x()}), 422, "inputs.z"),
    ("missing input", multi(inputs={"a": x((1, 4))}), 422, "inputs.b"),
    ("no inputs at all", {"model": {"path": "mlp"}}, 422, "inputs"),
    ("inputs and inputs_uri", mlp(inputs_uri="s3://b/k.npz"), 422, "inputs"),
    ("data length", mlp(inputs={"x": {"shape": [2, 8], "data": [1.0] * 15}}), 422, "inputs.x.data"),
    ("ragged data", mlp(inputs={"x": {"shape": [2, 8], "data": [[1.0] * 8, [1.0] * 7]}}), 422, "inputs.x.data"),
    ("string data", mlp(inputs={"x": {"shape": [1], "data": ["a"]}}), 422, "inputs.x.data"),
    ("fractional int", ints(inputs={"ids": {"shape": [1, 4], "dtype": "int32", "data": [1, 2.5, 3, 4]},
                                    "x": x((1, 4))}), 422, "inputs.ids.data"),
    ("negative dim", mlp(inputs={"x": {"shape": [2, -8], "data": []}}), 422, "inputs.x.shape"),
    ("unknown output", mlp(of="nope"), 422, "of"),
    ("ambiguous output", multi(), 422, "of"),
    ("integer wrt", ints(wrt="ids"), 422, "wrt: 'ids' is int32 and cannot be differentiated; choose one of: 'x'"),
    ("unknown wrt", mlp(wrt="nope"), 422, "wrt"),
    ("unknown variable", mlp(wrt="variables/nope/kernel"), 422, "wrt"),
    ("ambiguous wrt", multi(of="u"), 422, "wrt"),
    ("bad kind", mlp(kind="laplacian"), 422, "kind"),
    ("bad mode", mlp(mode="sideways"), 422, "mode"),
    ("bad reduce", f64(of="y", kind="hessian", reduce="mean"), 422, "reduce"),
    ("bad output dtype", mlp(output_dtype="int8"), 422, "output_dtype"),
    ("nonpositive budget", mlp(memory_budget_bytes=0), 422, "memory_budget_bytes"),
    ("nonpositive timeout", mlp(timeout_s=0), 422, "timeout_s"),
    ("timeout over the maximum", mlp(timeout_s=10**9), 422,
     "timeout_s: 1000000000 s is more than the 604800 s this service allows (JACOBIAN_MAX_JOB_TIMEOUT_S)"),
    ("unknown field", mlp(colour="red"), 422, "colour"),
    ("hessian of non-scalar", f64(of="y", kind="hessian"), 422, "of"),
    ("batch jacobian of scalar", f64(of="loss", kind="batch_jacobian"), 422, "of"),
    ("batch jacobian wrt variable", mlp(kind="batch_jacobian", wrt="variables/d0/kernel"), 422, "wrt"),
    ("path outside roots", mlp(model={"path": "/etc"}), 403, "model.path"),
    ("dotdot escape", mlp(model={"path": "mlp/../../outside/mlp"}), 403, "model.path"),
    ("symlink escape", mlp(model={"path": "escape"}), 403, "model.path"),
    ("no such model", mlp(model={"path": "nothing-here"}), 422, "model.path"),
    ("empty model path", mlp(model={"path": ""}), 422, "model.path: String should have at least 1 character"),
    ("unknown signature", mlp(model={"path": "mlp", "signature": "nope"}), 422, "model.signature"),
    ("too many elements", mlp(inputs={"x": x((200, 8))}), 413, "inputs"),
    ("inputs_uri outside storage", {"model": {"path": "mlp"}, "inputs_uri": "/etc/hosts"}, 422, "inputs_uri"),
]


@pytest.mark.parametrize("body,status,text", [c[1:] for c in JSON_CASES], ids=[c[0] for c in JSON_CASES])
def test_bad_json_job(client, redis_conn, results, body, status, text):
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"type", "message"}
    assert text in error["message"], error["message"]
    assert_nothing_queued(redis_conn, results)


def test_absolute_symlink_escape(client, redis_conn, results, model_root):
    r = client.post("/v1/jobs", json=mlp(model={"path": str(model_root / "escape")}))
    assert r.status_code == 403 and "symbolic link" in r.json()["error"]["message"]
    assert_nothing_queued(redis_conn, results)


@pytest.mark.parametrize("value,literal", [(float("nan"), "NaN"), (float("inf"), "Infinity")])
def test_non_finite_json_input(client, redis_conn, results, value, literal):
    data = [0.5] * 16
    data[11] = value
    text = json.dumps(mlp(inputs={"x": {"shape": [2, 8], "data": data}}))
    assert literal in text
    r = client.post("/v1/jobs", content=text, headers={"Content-Type": "application/json"})
    assert r.status_code == 422
    assert r.json()["error"]["type"] == "NonFiniteInput"
    assert r.json()["error"]["message"].startswith("inputs.x: contains NaN or Inf (first at index [1, 3])")
    assert_nothing_queued(redis_conn, results)


@pytest.mark.parametrize("body,status,text", [
    (b"{not json", 400, "body: not valid JSON"),
    (b"[1, 2]", 400, "body: expected a JSON object"),
    (b"\xff\xfe", 400, "body"),
    (b"", 400, "body"),
])
def test_malformed_json(client, redis_conn, results, body, status, text):
    r = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status and text in r.json()["error"]["message"]
    assert_nothing_queued(redis_conn, results)


def test_body_too_large_by_content_length(client, redis_conn, results):
    r = client.post("/v1/jobs", json=mlp(inputs={"x": {"shape": [2, 8], "data": [0.1] * 6000}}))
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("body:")
    assert_nothing_queued(redis_conn, results)


def test_body_too_large_streamed_without_content_length(client, redis_conn, results):
    """Chunked upload, no Content-Length: the limit holds on the bytes actually read."""
    sent = []

    def chunks():
        for _ in range(100):
            sent.append(1)
            yield b" " * 1000

    r = client.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "body" in r.json()["error"]["message"]
    assert_nothing_queued(redis_conn, results)


def test_lying_content_length_is_not_trusted(client, redis_conn, results):
    """A small Content-Length over a large stream is still cut at the limit."""
    def chunks():
        for _ in range(50):
            yield b" " * 1000

    r = client.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json",
                                                            "Content-Length": "10"})
    assert r.status_code == 413
    assert_nothing_queued(redis_conn, results)


def test_reading_stops_at_the_limit():
    """``read_limited`` stops pulling chunks as soon as the count passes the limit."""
    import asyncio

    from app.errors import BodyTooLarge
    from app.inputs import read_limited

    pulled = []

    async def stream():
        for i in range(1000):
            pulled.append(i)
            yield b"x" * 100

    with pytest.raises(BodyTooLarge, match="^body: more than 1000 bytes"):
        asyncio.run(read_limited(stream(), max_bytes=1000, content_length=None))
    assert len(pulled) == 11
    assert asyncio.run(read_limited(stream(), max_bytes=10**6, content_length="5")) == b"x" * 100_000


def npz_bytes(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


NPZ_CASES = [
    ("npz not a zip", b"hello", {"model_path": "mlp"}, 400, "body"),
    ("npz without model_path", npz_bytes(x=np.zeros((2, 8), np.float32)), {}, 422, "model_path"),
    ("npz unknown option", npz_bytes(x=np.zeros((2, 8), np.float32)), {"model_path": "mlp", "colour": "red"},
     422, "colour"),
    ("npz wrong dtype", npz_bytes(x=np.zeros((2, 8), np.float64)), {"model_path": "mlp"}, 422, "inputs.x.dtype"),
    ("npz inf input", npz_bytes(x=np.full((2, 8), np.inf, np.float32)), {"model_path": "mlp"}, 422, "inputs.x"),
    ("npz too many elements", npz_bytes(x=np.zeros((1, 1001), np.uint8)), {"model_path": "mlp"}, 413, "inputs"),
    ("npz object array", npz_bytes(x=np.array([{"pickled": 1}], dtype=object)), {"model_path": "mlp"}, 422,
     "inputs.x.dtype: dtype '|O' is not a number"),
    ("npz bad kind", npz_bytes(x=np.zeros((2, 8), np.float32)), {"model_path": "mlp", "kind": "x"}, 422, "kind"),
    ("npz path outside", npz_bytes(x=np.zeros((2, 8), np.float32)), {"model_path": "/etc"}, 403, "model_path"),
]


@pytest.mark.parametrize("body,params,status,text", [c[1:] for c in NPZ_CASES], ids=[c[0] for c in NPZ_CASES])
def test_bad_npz_job(client, redis_conn, results, body, params, status, text):
    r = client.post("/v1/jobs", content=body, params=params, headers={"Content-Type": "application/x-npz"})
    assert r.status_code == status, r.text
    assert text in r.json()["error"]["message"], r.json()
    assert_nothing_queued(redis_conn, results)


def test_result_too_large(client, redis_conn, results, monkeypatch):
    monkeypatch.setenv("JACOBIAN_MAX_RESULT_BYTES", str(2 * 4 * 2 * 8 * 4 - 1))  # one byte short for mlp 2x8
    get_settings.cache_clear()
    r = client.post("/v1/jobs", json=mlp())
    assert r.status_code == 422 and "JACOBIAN_MAX_RESULT_BYTES" in r.json()["error"]["message"]
    assert_nothing_queued(redis_conn, results)
    assert client.post("/v1/jobs", json=mlp(kind="batch_jacobian")).status_code == 202


def test_query_parameters_with_json_body_are_refused(client, redis_conn, results):
    r = client.post("/v1/jobs", json=mlp(), params={"kind": "hessian"})
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("query:")
    assert_nothing_queued(redis_conn, results)


def test_timeout_s_travels_to_the_worker_and_sets_rqs_backstop(client, redis_conn, results):
    """The request's ``timeout_s`` is in the queued spec (the worker checks it between chunks); rq's own timeout,
    the backstop for a chunk that never returns, lies 60 s past it; without one, past JACOBIAN_JOB_TIMEOUT_S."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    timed = client.post("/v1/jobs", json=mlp(timeout_s=30))
    plain = client.post("/v1/jobs", json=mlp())
    assert timed.status_code == plain.status_code == 202, (timed.text, plain.text)
    timed_job = Job.fetch(timed.json()["id"], connection=redis_conn, serializer=JSONSerializer)
    plain_job = Job.fetch(plain.json()["id"], connection=redis_conn, serializer=JSONSerializer)
    assert timed_job.args[0]["timeout_s"] == 30 and timed_job.timeout == 90
    assert plain_job.args[0]["timeout_s"] is None and plain_job.timeout == get_settings().job_timeout_s + 60
    npz = client.post("/v1/jobs", content=npz_bytes(x=np.zeros((2, 8), np.float32)),
                      params={"model_path": "mlp", "timeout_s": "7"}, headers={"Content-Type": "application/x-npz"})
    assert npz.status_code == 202, npz.text
    assert Job.fetch(npz.json()["id"], connection=redis_conn, serializer=JSONSerializer).timeout == 67
