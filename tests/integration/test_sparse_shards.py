"""Sparse jobs in shards (colour blocks are the unit): POST with ``sparsity`` and ``shards``, a real rq worker in
this process on a real redis-server running the job, its shards and the finalizer one after the other. The COO
result equals the one-piece job's and GradientTape's; a shard that fails mid-way is retried alone and computes only
its colour blocks not committed; a pattern that does not pay shards as a dense job; a pattern that fails
verification is computed densely by the finalizer."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import zarr

from contracts import storage
from contracts.jobspec import finalizer_job_id, shard_job_id
from contracts.jobstore import JobStore
from tests import sparse_models
from tests.conftest import finished_job, tensor
from worker.engine import load_model

pytestmark = pytest.mark.integration
IMAGE = np.random.default_rng(7).standard_normal((1, 20, 20, 3)).astype("float32")
X = np.random.default_rng(8).standard_normal((2, 6)).astype("float32")
# The conv net's J is 800 x 1200 with 50 row colours (reverse mode): the compressed products are 50 rows of 1200
# float32; 5 colours a storage block make 10 colour blocks.
COLOURS, WIDTH, PER_BLOCK = 50, 1200, 5
BLOCK_BYTES = PER_BLOCK * WIDTH * 4
REUSED = re.compile(r"job (\w+): sparse: (\d+) of (\d+) colour blocks reused")


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    sparse_models.conv_net(root / "conv", size=20, channels=(3, 2))
    sparse_models.mlp(root / "mlp")
    return root


@pytest.fixture
def make_client(worker_env):
    """The API on the settings of a worker in this process, with storage blocks of ``block_bytes``."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    clients = []

    def make(block_bytes: int = BLOCK_BYTES, **settings: str) -> TestClient:
        worker_env(block_bytes, **settings)
        client = TestClient(create_app())
        clients.append(client.__enter__())
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)



def tape(model_root: Path, name: str, inputs: dict, of: str, wrt: str) -> np.ndarray:
    import tensorflow as tf

    model = load_model(str(model_root / name))
    x = tf.constant(inputs[wrt])
    with tf.GradientTape(persistent=True) as t:
        t.watch(x)
        y = model.fn(**{wrt: x})[of]
    return t.jacobian(y, x, experimental_use_pfor=False).numpy().reshape(int(np.prod(y.shape)), -1)


def coo(record: dict) -> tuple[zarr.Group, np.ndarray]:
    import scipy.sparse as sp

    group = zarr.open_group(record["result"]["uri"], mode="r")
    dense = sp.coo_array((group["values"][...], (group["rows"][...], group["cols"][...])),
                         shape=tuple(group.attrs["shape"])).toarray()
    return group, dense


def conv_job(client, **options) -> str:
    r = client.post("/v1/jobs", json={"model": {"path": "conv"}, "inputs": {"image": tensor(IMAGE)},
                                      "sparsity": "auto", **options})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def reuse_lines(caplog, job_id: str) -> list[tuple[int, int]]:
    return sorted((int(m[2]), int(m[3])) for m in (REUSED.search(r.getMessage()) for r in caplog.records)
                  if m and m[1] == job_id)


def test_sharded_sparse_job_equals_the_one_piece_job_and_gradient_tape(make_client, redis_conn, model_root,
                                                                        results, caplog):
    from rq.job import Job
    from rq.serializers import JSONSerializer

    caplog.set_level(logging.INFO, logger="worker.sparse_job")
    client = make_client()
    sharded = conv_job(client, shards=2)
    whole = conv_job(client, shards=1)
    record = finished_job(client, redis_conn, sharded)
    one = finished_job(client, redis_conn, whole)
    want = tape(model_root, "conv", {"image": IMAGE}, "out", "image")

    assert record["plan"]["shards"] == 2 and record["plan"]["strategy"] == "sparse", record["plan"]
    info = record["plan"]["sparsity"]
    assert info["verified"] is True and info["colors"] == COLOURS and info["mode"] == "reverse", info
    assert record["result"]["format"] == "coo" and record["result"]["dense_shape"] == list(want.shape)
    assert record["progress"]["rows_done"] == record["progress"]["rows_total"] == COLOURS
    assert one["plan"]["shards"] == 1 and not Job.exists(finalizer_job_id(whole), connection=redis_conn)
    store = JobStore(redis_conn)
    split = store.shard_plan(sharded)
    assert split["strategy"] == "sparse" and split["rows_total"] == COLOURS
    assert split["ranges"] == [[0, 25], [25, 50]]                      # 5 colour blocks each
    # every colour computed once, by its own shard, each shard its 5 blocks with none to reuse
    assert [p["rows_computed"] for _, p in sorted(store.shard_progress(sharded).items())] == [25, 25]
    assert reuse_lines(caplog, sharded) == [(0, 5), (0, 5)]
    for i in range(2):
        assert Job.fetch(shard_job_id(sharded, i), connection=redis_conn,
                         serializer=JSONSerializer).get_status().value == "finished"

    group, got = coo(record)
    one_group, one_dense = coo(one)
    for name in ("rows", "cols", "indptr"):
        np.testing.assert_array_equal(group[name][...], one_group[name][...])
    np.testing.assert_allclose(group["values"][...], one_group["values"][...], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert group.attrs["format"] == "coo" and "compressed" not in group      # the products replaced by COO
    assert not storage.list_names(str(results / sharded / "committed"))      # and their commit markers
    manifest = (results / sharded / "manifest.json").read_text()
    assert '"format": "coo"' in manifest and '"shards": 2' in manifest


def test_a_failed_shard_is_retried_alone_and_computes_only_its_uncommitted_colour_blocks(
        make_client, redis_conn, model_root, monkeypatch, caplog):
    from worker.storage import ResultWriter, RetryPolicy

    caplog.set_level(logging.INFO, logger="worker.sparse_job")
    monkeypatch.setattr(ResultWriter, "default_retry", RetryPolicy(attempts=2, first_delay_s=0.01))
    real_write = storage.write_bytes
    failures = {"left": 2}

    def flaky_write(url, data):  # colour block 7 (colours 35:40, the third block of shard 2) fails one attempt
        if url.endswith("/committed/7") and failures["left"] > 0:
            failures["left"] -= 1
            raise OSError("connection reset by storage")
        real_write(url, data)

    monkeypatch.setattr(storage, "write_bytes", flaky_write)
    client = make_client()
    job_id = conv_job(client, shards=2, chunk_rows=PER_BLOCK)
    record = finished_job(client, redis_conn, job_id)
    assert failures["left"] == 0
    # shard 1 and the first attempt at shard 2 reused nothing; the retry reused the 2 blocks committed before
    # block 7 and computed the other 3
    assert reuse_lines(caplog, job_id) == [(0, 5), (0, 5), (2, 5)]
    progress = JobStore(redis_conn).shard_progress(job_id)
    assert progress[0]["rows_computed"] == 25
    # the first attempt computed blocks 5 to 7 at least (and at most all 5), the retry blocks 7 to 9 only
    assert 3 * PER_BLOCK + 3 * PER_BLOCK <= progress[1]["rows_computed"] <= 25 + 3 * PER_BLOCK
    assert record["plan"]["sparsity"]["verified"] is True
    np.testing.assert_allclose(coo(record)[1], tape(model_root, "conv", {"image": IMAGE}, "out", "image"),
                               rtol=1e-5, atol=1e-6)


def test_automatic_shards_measure_the_first_colour_block_and_credit_it_to_its_shard(make_client, redis_conn,
                                                                                     model_root, caplog):
    """``shards`` null with two live workers (this one and a registered peer): the job computes the first colour
    block to measure the rate, splits (no minimum seconds a shard here), and shard 1 reuses that block."""
    from rq import Queue, Worker
    from rq.serializers import JSONSerializer

    from contracts.settings import get_settings

    caplog.set_level(logging.INFO, logger="worker.sparse_job")
    client = make_client(SHARD_MIN_SECONDS="0")
    peer = Worker([Queue(get_settings().queue_name, connection=redis_conn, serializer=JSONSerializer)],
                  connection=redis_conn, name="peer")
    peer.register_birth()
    job_id = conv_job(client)
    record = finished_job(client, redis_conn, job_id)
    assert record["plan"]["shards"] == 2 and record["plan"]["sparsity"]["verified"] is True, record["plan"]
    assert JobStore(redis_conn).shard_plan(job_id)["ranges"] == [[0, 25], [25, 50]]
    assert reuse_lines(caplog, job_id) == [(0, 5), (1, 5)]
    # the measured block counts for shard 1, computed once: every colour computed once over the job
    assert [p["rows_computed"] for _, p in sorted(JobStore(redis_conn).shard_progress(job_id).items())] == [25, 25]
    np.testing.assert_allclose(coo(record)[1], tape(model_root, "conv", {"image": IMAGE}, "out", "image"),
                               rtol=1e-5, atol=1e-6)


def test_a_pattern_that_does_not_pay_shards_as_a_dense_job(make_client, redis_conn, model_root):
    client = make_client(12 * 4)    # one row of the J of the MLP (12 float32) a storage block: 6 blocks
    r = client.post("/v1/jobs", json={"model": {"path": "mlp"}, "inputs": {"x": tensor(X)}, "sparsity": "auto",
                                      "shards": 2})
    assert r.status_code == 202, r.text
    record = finished_job(client, redis_conn, r.json()["id"])
    assert record["plan"]["shards"] == 2 and record["plan"]["strategy"] != "sparse", record["plan"]
    split = JobStore(redis_conn).shard_plan(record["id"])
    assert split["rows_total"] == 6 and split["sparsity"]["fallback"] == record["plan"]["sparsity"]["fallback"]
    # J of 2 examples is block diagonal: half its entries, over the 20 % that pays as COO
    assert record["plan"]["sparsity"]["fallback"].startswith("dense: the pattern holds 50.0%"), record["plan"]
    assert record["result"].get("format") is None and record["result"]["shape"] == [2, 3, 2, 6]
    got = zarr.open_array(record["result"]["uri"] + "/jacobian", mode="r")[...]
    np.testing.assert_allclose(got.reshape(6, 12), tape(model_root, "mlp", {"x": X}, "y", "x"), rtol=1e-5,
                               atol=1e-6)


def test_a_sharded_pattern_missing_entries_is_computed_densely_by_the_finalizer(make_client, redis_conn, model_root,
                                                                                 results):
    want = tape(model_root, "conv", {"image": IMAGE}, "out", "image")
    rows, cols = np.nonzero(want)
    keep = np.ones(rows.size, bool)
    keep[::97] = False                     # a pattern that misses one entry in 97
    results.mkdir(parents=True, exist_ok=True)
    np.savez(results / "pattern.npz", rows=rows[keep], cols=cols[keep])
    client = make_client()
    job_id = conv_job(client, shards=2, sparsity={"pattern_uri": str(results / "pattern.npz")})
    record = finished_job(client, redis_conn, job_id)
    split = JobStore(redis_conn).shard_plan(job_id)
    assert split["shards"] == 2 and split["strategy"] == "sparse", split      # split on colours, then verified
    info = record["plan"]["sparsity"]
    assert info["verified"] is False and "the pattern misses entries" in info["fallback"], info
    assert info["fallback"].endswith("computed densely in one piece by the finalizer")
    assert record["result"].get("format") is None and record["result"]["shape"] == [1, 20, 20, 2, 1, 20, 20, 3]
    got = zarr.open_array(record["result"]["uri"] + "/jacobian", mode="r")[...]
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-6)


def test_a_sparse_hessian_in_shards_equals_the_tape_hessian(make_client, redis_conn, model_root):
    """Kind ``hessian`` with ``sparsity`` and ``shards`` (issue 27): a tridiagonal H's 3 star colours, one storage
    block each, split into 3 shards of HVPs; the finalizer verifies by HVPs and writes the COO entries."""
    from tests import sparse_hessian_models
    from tests.engine.reference import tape_hessian

    n = 60
    path = sparse_hessian_models.separable(model_root / "separable", n=n)
    x = np.random.default_rng(9).uniform(0.5, 1.5, n).astype("float32")
    client = make_client(block_bytes=n * 4)
    r = client.post("/v1/jobs", json={"model": {"path": "separable"}, "inputs": {"x": tensor(x)}, "kind": "hessian",
                                      "of": "f", "wrt": "x", "sparsity": "auto", "shards": 3})
    assert r.status_code == 202, r.text
    record = finished_job(client, redis_conn, r.json()["id"])
    assert record["plan"]["shards"] == 3 and record["plan"]["strategy"] == "sparse", record["plan"]
    info = record["plan"]["sparsity"]
    assert info["verified"] is True and info["colors"] == 3 and info["mode"] == "star", info
    split = JobStore(redis_conn).shard_plan(record["id"])
    assert split["strategy"] == "sparse" and split["ranges"] == [[0, 1], [1, 2], [2, 3]]
    group, got = coo(record)
    assert group.attrs["kind"] == "hessian" and record["result"]["dense_shape"] == [n, n]
    want = tape_hessian(load_model(str(path)), {"x": x}, "f", "x").reshape(n, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
