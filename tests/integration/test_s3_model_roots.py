"""Model roots that are S3 prefixes, against a real S3 endpoint (moto's server): the signature endpoint and POST read
a SavedModel's ``saved_model.pb`` and a ``.keras`` file's config from the bucket (bounded reads, a 4xx for what is
missing, refused ops refused with nothing queued); a real worker downloads the model once into its local cache and
computes what GradientTape computes; a model changed in the bucket after POST is downloaded and scanned again."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import boto3
import numpy as np
import pytest
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from contracts.jobspec import JobStatus
from contracts.jobstore import JobStore
from tests import hostile_models, keras_models
from tests.conftest import finished_job, tensor, work_burst

pytestmark = pytest.mark.integration
X = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
TOL = {"rtol": 2e-5, "atol": 2e-5}



def _s3():
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")


def upload(bucket: str, local: Path, key: str) -> None:
    """``local`` (a file, or every file of a folder) put under ``key``, one object per file."""
    files = [(local, key)] if local.is_file() else [
        (f, f"{key}/{f.relative_to(local).as_posix()}") for f in sorted(local.rglob("*")) if f.is_file()]
    for path, name in files:
        _s3().put_object(Bucket=bucket, Key=name, Body=path.read_bytes())


def remove(bucket: str, prefix: str) -> None:
    for obj in _s3().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", []):
        _s3().delete_object(Bucket=bucket, Key=obj["Key"])


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> SimpleNamespace:
    """The models, built once on local disk: ``clean`` (y = tanh(x @ w)), ``writes`` (tf.io.write_file to a
    file outside every root), ``functional.keras``."""
    root = tmp_path_factory.mktemp("s3-models-local")
    outside = tmp_path_factory.mktemp("outside")
    hostile_models.clean(root / "clean")
    hostile_models.writes_file(root / "writes", outside / "written.txt")
    keras = keras_models.functional(root / "functional.keras")
    return SimpleNamespace(root=root, outside=outside, keras=keras)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    """The local model root next to the S3 one: empty."""
    return tmp_path_factory.mktemp("local-root")


@pytest.fixture
def bucket(s3_env, built) -> str:
    """A fresh bucket holding ``models/clean``, ``models/writes`` and ``models/functional.keras``."""
    for name in ("clean", "writes", "functional.keras"):
        upload(s3_env, built.root / name, f"models/{name}")
    return s3_env


def roots(model_root: Path, bucket: str) -> str:
    return f"{model_root},s3://{bucket}/models"


@pytest.fixture
def s3_client(env, model_root, bucket, monkeypatch):
    """The API with the roots ``model_root`` and ``s3://<bucket>/models``."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from contracts.settings import get_settings

    monkeypatch.setenv("JACOBIAN_MODEL_ROOTS", roots(model_root, bucket))
    get_settings.cache_clear()
    with TestClient(create_app()) as c:
        yield c


@pytest.fixture
def worker_api(worker_env, model_root, bucket, tmp_path):
    """The API on the settings of a worker run in this process, both with the S3 root and a cache folder of
    this test's own."""
    from fastapi.testclient import TestClient

    from app.main import create_app

    worker_env(1 << 20, MODEL_ROOTS=roots(model_root, bucket), CACHE_DIR=str(tmp_path / "cache"))
    with TestClient(create_app()) as c:
        yield c


def assert_nothing_queued(redis_conn) -> None:
    assert Queue("jacobian", connection=redis_conn).count == 0
    assert redis_conn.keys("rq:job:*") == [] and redis_conn.keys("jacobian:job:*") == []


def test_signature_of_models_in_the_bucket(s3_client, bucket):
    r = s3_client.get("/v1/models/signature", params={"path": "clean"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["path"] == f"s3://{bucket}/models/clean"
    assert body["inputs"] == {"x": {"dtype": "float32", "shape": [None, 3]}} and set(body["outputs"]) == {"y"}
    assert set(body["variables"]) == {"w"}
    url = f"s3://{bucket}/models/functional.keras"
    keras = s3_client.get("/v1/models/signature", params={"path": url})   # absolute: the URL itself
    assert keras.status_code == 200, keras.text
    assert keras.json()["path"] == url and set(keras.json()["outputs"]) == {"y", "loss"}


@pytest.mark.parametrize(("path", "status", "kind", "says"), [
    ("absent", 422, "ModelNotFound", "is in none of the model roots (looked for '/"),
    ("absent.keras", 422, "ModelNotFound", "'s3://{bucket}/models/absent.keras'); give"),
    ("s3://{bucket}/models/absent", 422, "ModelNotFound", "has no saved_model.pb in the bucket"),
    ("s3://{bucket}/models/absent.keras", 422, "ModelNotFound", "is not an object in the bucket"),
    ("s3://{bucket}/elsewhere/clean", 403, "ModelPathNotAllowed", "is outside the model roots"),
    ("s3://{bucket}/models/x/../clean", 403, "ModelPathNotAllowed", "'..' component"),
    ("s3://{bucket}/models//clean", 403, "ModelPathNotAllowed", "an empty"),
])
def test_missing_or_outside_is_a_4xx(s3_client, redis_conn, bucket, path, status, kind, says):
    path, says = path.format(bucket=bucket), says.format(bucket=bucket)
    for r, field in ((s3_client.get("/v1/models/signature", params={"path": path}), "path"),
                     (s3_client.post("/v1/jobs", json={"model": {"path": path}, "inputs": {"x": tensor(X)}}),
                      "model.path")):
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["type"] == kind and error["message"].startswith(f"{field}: ") and says in error["message"], error
    assert_nothing_queued(redis_conn)


def test_refused_op_in_the_bucket(s3_client, redis_conn, bucket, built):
    allow = f'JACOBIAN_MODEL_OP_ALLOW=\'{{"s3://{bucket}/models": ["WriteFile"]}}\''
    for r, field in ((s3_client.get("/v1/models/signature", params={"path": "writes"}), "path"),
                     (s3_client.post("/v1/jobs", json={"model": {"path": "writes"}, "inputs": {"x": tensor(X)}}),
                      "model.path")):
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["type"] == "ModelRefused", error
        assert error["message"].startswith(f"{field}: the model uses op 'WriteFile'") and allow in error["message"]
    assert_nothing_queued(redis_conn)
    assert not (built.outside / "written.txt").exists()


def test_reads_are_bounded(s3_client, redis_conn, bucket, monkeypatch):
    """Over JACOBIAN_MAX_MODEL_READ_BYTES, saved_model.pb and a .keras config are not read: 422 naming it."""
    from contracts.settings import get_settings

    monkeypatch.setenv("JACOBIAN_MAX_MODEL_READ_BYTES", "512")
    get_settings.cache_clear()
    for path in ("clean", "functional.keras"):
        r = s3_client.get("/v1/models/signature", params={"path": path})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["message"].startswith("path: ") and "JACOBIAN_MAX_MODEL_READ_BYTES" in r.text
    r = s3_client.post("/v1/jobs", json={"model": {"path": "clean"}, "inputs": {"x": tensor(X)}})
    assert r.status_code == 422 and "JACOBIAN_MAX_MODEL_READ_BYTES" in r.text, r.text
    assert_nothing_queued(redis_conn)


def tape_saved_model(path: Path, x: np.ndarray) -> np.ndarray:
    import tensorflow as tf

    loaded = tf.saved_model.load(str(path))
    xt = tf.constant(x)
    with tf.GradientTape() as t:
        t.watch(xt)
        y = loaded.signatures["serving_default"](x=xt)["y"]
    return t.jacobian(y, xt).numpy()


def tape_keras(model, x: np.ndarray) -> np.ndarray:
    import tensorflow as tf

    xt = tf.constant(x)
    with tf.GradientTape() as t:
        t.watch(xt)
        y = model(xt)["y"]
    return t.jacobian(y, xt).numpy()


def test_jobs_equal_gradient_tape_and_download_once(worker_api, redis_conn, bucket, built, caplog):
    """A SavedModel and a .keras file in the bucket: each job equals GradientTape on the local original; the second
    job on each finds the worker's local copy and downloads nothing."""
    import logging

    import xarray as xr

    from contracts.settings import get_settings
    from worker import metrics
    from worker.model_download import model_downloads

    def count(result: str) -> float:
        return metrics.MODEL_DOWNLOADS.labels(result)._value.get()

    cache = model_downloads(get_settings())
    before = {"downloaded": count("downloaded"), "cached": count("cached")}
    want = {"clean": tape_saved_model(built.root / "clean", X), "functional.keras": tape_keras(built.keras, X)}
    caplog.set_level(logging.INFO, logger="worker.model_download")
    for name in ("clean", "functional.keras", "clean", "functional.keras"):
        r = worker_api.post("/v1/jobs", json={"model": {"path": name}, "inputs": {"x": tensor(X)}, "of": "y",
                                              "wrt": "x"})
        assert r.status_code == 202, r.text
        record = finished_job(worker_api, redis_conn, r.json()["id"])
        got = np.asarray(xr.open_zarr(record["result"]["uri"])["jacobian"].values)
        np.testing.assert_allclose(got.reshape(want[name].shape), want[name], **TOL)
    assert (cache.downloads, cache.hits) == (2, 2)
    assert count("downloaded") - before["downloaded"] == 2 and count("cached") - before["cached"] == 2
    assert sum("not downloaded again" in m for m in caplog.messages) == 2, caplog.messages
    entries = sorted(p.name for p in cache.folder.iterdir())
    assert len(entries) == 2 and not any(name.startswith(".") for name in entries), entries


def test_model_changed_in_the_bucket_after_post_is_scanned_again(worker_api, redis_conn, bucket, built):
    """``swapped`` (clean) is run once, so the worker holds a copy of it; a second job on it is accepted, then the
    bucket's objects under that name are replaced by the model that writes a file. The worker lists the model, finds
    new bytes, downloads and scans them: the job fails for good as ModelRefused, nothing written, no retry."""
    upload(bucket, built.root / "clean", "models/swapped")
    r = worker_api.post("/v1/jobs", json={"model": {"path": "swapped"}, "inputs": {"x": tensor(X)}, "of": "y",
                                          "wrt": "x"})
    assert r.status_code == 202, r.text
    finished_job(worker_api, redis_conn, r.json()["id"])   # the clean bytes, cached by the worker
    again = worker_api.post("/v1/jobs", json={"model": {"path": "swapped"}, "inputs": {"x": tensor(X)}, "of": "y",
                                              "wrt": "x"})
    assert again.status_code == 202, again.text
    remove(bucket, "models/swapped")
    upload(bucket, built.root / "writes", "models/swapped")
    work_burst(redis_conn)
    job_id = again.json()["id"]
    record = JobStore(redis_conn).get(job_id)
    assert record.status == JobStatus.failed, record
    assert record.error.type == "ModelRefused", record.error
    assert record.error.message.startswith("model.path: the model uses op 'WriteFile'"), record.error
    assert f"s3://{bucket}/models" in record.error.message
    assert not (built.outside / "written.txt").exists()
    assert Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer).retries_left == 2


@pytest.mark.parametrize("name", ["clean", "functional.keras"])
def test_dry_run_finds_the_plan_a_worker_made_for_a_model_in_the_bucket(worker_api, redis_conn, built, name):
    """The API fingerprints the model from the bucket as the worker does from its copy: after one job, a dry run
    finds the persisted plan (a .keras config gives no output shapes, so its quote stays a guess, made with it)."""
    body = {"model": {"path": name}, "inputs": {"x": tensor(X)}, "of": "y", "wrt": "x"}
    first = worker_api.post("/v1/jobs", params={"dry_run": "true"}, json=body)
    assert first.status_code == 200 and "no plan for this model yet" in first.json()["basis"], first.text
    r = worker_api.post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    finished_job(worker_api, redis_conn, r.json()["id"])
    again = worker_api.post("/v1/jobs", params={"dry_run": "true"}, json=body)
    assert again.status_code == 200, again.text
    basis = again.json()["basis"]
    if name == "clean":
        assert again.json()["guess"] is False and basis.startswith("persisted plan "), basis
    else:
        assert basis.startswith("a guess: ") and "no plan for this model yet" not in basis, basis


def test_per_root_settings_apply_to_the_url(s3_client, bucket, tmp_path, monkeypatch):
    """JACOBIAN_MODEL_OP_ALLOW names an s3:// prefix: the API accepts the op there; the worker's scan of its local
    copy applies the URL's setting too (and refuses the same copy for another URL's)."""
    import json

    from contracts.graph_scan import ModelRefused
    from contracts.settings import get_settings
    from worker.model_cache import scan_model
    from worker.model_download import ModelDownloads

    url = f"s3://{bucket}/models/writes"
    monkeypatch.setenv("JACOBIAN_MODEL_OP_ALLOW", json.dumps({url: ["WriteFile"]}))
    get_settings.cache_clear()
    assert s3_client.get("/v1/models/signature", params={"path": "writes"}).status_code == 200
    with ModelDownloads(tmp_path, limit_bytes=1 << 30).local(url) as local:
        scan_model(local, origin=url)
        with pytest.raises(ModelRefused, match="WriteFile"):
            scan_model(local, origin=f"s3://{bucket}/models/elsewhere")
        with pytest.raises(ModelRefused, match="WriteFile"):
            scan_model(local)
