"""``POST /v1/jobs?dry_run=true``: the quote of a job, over a real redis-server, nothing queued or written;
its prediction is a guess before any job ran on the model and the persisted plan's after one did."""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from rq import Queue
from rq.serializers import JSONSerializer

from contracts.settings import get_settings
from tests.conftest import finished_job

pytestmark = pytest.mark.integration


def mlp(shape=(3, 8), **extra) -> dict:
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    return {"model": {"path": "mlp"}, "inputs": {"x": {"shape": list(shape), "data": data.ravel().tolist()}},
            **extra}


def snapshot(redis_conn, results: Path) -> tuple:
    """Every Redis key but the plans', the queue's length and the files under results."""
    keys = sorted(k.decode() for k in redis_conn.keys("*") if not k.startswith(b"jacobian:plan"))
    files = sorted(str(p) for p in results.rglob("*")) if results.exists() else []
    queue = Queue(get_settings().queue_name, connection=redis_conn, serializer=JSONSerializer)
    return keys, queue.count, files


def test_dry_run_quotes_a_guess_then_the_plan_and_writes_nothing(worker_client, redis_conn, tmp_path):
    client, results = worker_client, tmp_path / "results"
    before = snapshot(redis_conn, results)
    body = mlp(shape=(64, 8))   # 256 rows: enough chunks for the worker to measure its memory line
    r = client.post("/v1/jobs", params={"dry_run": "true"}, json=body, headers={"Idempotency-Key": "k-1"})
    assert r.status_code == 200, r.text
    quote = r.json()
    assert snapshot(redis_conn, results) == before   # no record, no idempotency key, no queue entry, no file
    assert quote["kind"] == "jacobian" and quote["family"] == "dense" and quote["fits"] is True
    assert quote["of"] == "y" and quote["wrt"] == "x" and quote["mode"] == "reverse"
    assert quote["arrays"] == [{"name": "jacobian", "shape": [64, 4, 64, 8], "dtype": "float32",
                                "bytes": 64 * 4 * 64 * 8 * 4}]
    assert quote["passes"] == {"unit": "rows", "count": 256, "estimate": False, "note": ""}
    assert quote["guess"] is True and "no plan for this model yet" in quote["basis"], quote
    assert quote["predicted_peak_bytes"] > 0 and quote["predicted_seconds"] is None

    job = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"})   # the key is still free
    assert job.status_code == 202, job.text
    record = finished_job(client, redis_conn, job.json()["id"])
    stored = zarr.open_array(record["result"]["uri"] + "/jacobian", mode="r")
    assert quote["result_bytes"] == stored.nbytes == math.prod(record["result"]["shape"]) * 4

    again = client.post("/v1/jobs", params={"dry_run": "1"}, json=body)
    assert again.status_code == 200, again.text
    planned = again.json()
    assert planned["guess"] is False and planned["basis"].startswith("persisted plan "), planned
    assert planned["strategy"] == record["plan"]["strategy"]
    assert planned["predicted_chunk_rows"] >= 1 and planned["predicted_seconds"] > 0
    # a fresh worker's seconds: the steady part plus the plan's measured first calls (when it measured them)
    assert planned["predicted_seconds"] >= planned["predicted_steady_seconds"] > 0
    assert "s of first calls" in planned["basis"] or "first calls not measured yet" in planned["basis"], planned
    # the plan's measured line at the quoted chunk: what the worker's status says a row costs, within 50 %
    k, measured = planned["predicted_chunk_rows"], record["plan"]["bytes_per_row"]
    expected = (record["plan"]["fixed_bytes"] or 0) + measured * k
    assert measured > 0 and abs(planned["predicted_peak_bytes"] - expected) <= 0.5 * expected, (planned, record)
    # another batch size is another request: no plan for it yet
    other = client.post("/v1/jobs", params={"dry_run": "true"}, json=mlp(shape=(5, 8))).json()
    assert other["guess"] is True and other["result_bytes"] == 5 * 4 * 5 * 8 * 4


def test_dry_run_npz_body_and_product_kind(client, redis_conn, results):
    buf = io.BytesIO()
    np.savez(buf, x=np.ones((2, 8), np.float32), __seeds__=np.ones((5, 2, 8), np.float32))
    before = snapshot(redis_conn, results)
    r = client.post("/v1/jobs", params={"dry_run": "true", "model_path": "mlp", "kind": "jvp"},
                    content=buf.getvalue(), headers={"Content-Type": "application/x-npz"})
    assert r.status_code == 200, r.text
    quote = r.json()
    assert snapshot(redis_conn, results) == before
    assert quote["family"] == "products" and quote["passes"]["unit"] == "products" and quote["passes"]["count"] == 5
    assert quote["arrays"] == [{"name": "products", "shape": [5, 2, 4], "dtype": "float32", "bytes": 5 * 2 * 4 * 4}]
    assert quote["guess"] is True


def test_dry_run_over_the_limit_answers_the_posts_refusal_naming_what_would_fit(client, redis_conn, results,
                                                                              monkeypatch):
    monkeypatch.setenv("JACOBIAN_MAX_RESULT_BYTES", str(3 * 4 * 3 * 8 * 4 - 1))   # one byte short for mlp 3x8
    get_settings.cache_clear()
    before = snapshot(redis_conn, results)
    dry = client.post("/v1/jobs", params={"dry_run": "true"}, json=mlp())
    real = client.post("/v1/jobs", json=mlp())
    assert dry.status_code == real.status_code == 422 and dry.json() == real.json()
    message = dry.json()["error"]["message"]
    assert "JACOBIAN_MAX_RESULT_BYTES" in message
    for way in ("at most 11 of these 12 rows fit", "kind='batch_jacobian'", "'jvp' or 'vjp'", "sparsity='auto'",
                "output_dtype='float16' or 'bfloat16' (576 bytes, which fits)"):
        assert way in message, message
    assert snapshot(redis_conn, results) == before
    assert client.post("/v1/jobs", params={"dry_run": "true"}, json=mlp(kind="batch_jacobian")).status_code == 200


def test_dry_run_keeps_the_other_refusals(client, redis_conn, results):
    r = client.post("/v1/jobs", params={"dry_run": "true"}, json=mlp(of="nope"))
    assert r.status_code == 422 and "of" in r.json()["error"]["message"]
    r = client.post("/v1/jobs", params={"dry_run": "true", "kind": "hessian"}, json=mlp())
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("query:")


def test_dry_run_latency_on_a_warm_api(client, capsys):
    """Not a timing assertion: the figure is printed (run with -s) for the record."""
    body = mlp()
    for _ in range(3):
        assert client.post("/v1/jobs", params={"dry_run": "true"}, json=body).status_code == 200
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        assert client.post("/v1/jobs", params={"dry_run": "true"}, json=body).status_code == 200
        times.append(time.perf_counter() - t0)
    with capsys.disabled():
        print(f"\ndry run on a warm API: median {1000 * sorted(times)[10]:.1f} ms, max {1000 * max(times):.1f} ms")


def test_client_quote_and_cli_submit_dry_run(client, redis_conn, results, monkeypatch, capsys, tmp_path):
    from jacobian import cli, cli_client
    from jacobian.client import JacobianClient, JacobianError

    x = np.ones((3, 8), np.float32)
    before = snapshot(redis_conn, results)
    with JacobianClient("http://testserver", transport=client._transport) as jc:
        quoted = jc.quote("mlp", {"x": x}, kind="batch_jacobian")
        assert quoted.kind == "batch_jacobian" and quoted.result_bytes == 3 * 4 * 8 * 4 and quoted.guess
        assert quoted.arrays[0].shape == [3, 4, 8]
        with pytest.raises(JacobianError) as refused:
            jc.quote("mlp", {"x": x}, of="nope")
        assert refused.value.status_code == 422
    monkeypatch.setattr(cli_client, "_client", lambda args: JacobianClient("http://testserver",
                                                                          transport=client._transport))
    np.savez(tmp_path / "x.npz", x=x)
    assert cli.main(["submit", "--model", "mlp", "--input", str(tmp_path / "x.npz"), "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["kind"] == "jacobian" and printed["result_bytes"] == 3 * 4 * 3 * 8 * 4
    assert snapshot(redis_conn, results) == before
