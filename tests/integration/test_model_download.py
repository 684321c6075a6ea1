"""The workers' local cache of models under S3 roots (``worker.model_download``) against a real S3 endpoint (moto's
server): two caches on one folder (two workers) downloading the same model at once end with one complete copy and
no leftovers; least recently used copies are removed beyond the bound, never one in use; bytes that are not the
listing's are refused (retried), a local copy altered on disk is downloaded again."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import boto3
import pytest

from contracts.plans import model_fingerprint
from contracts.remote_models import RemoteObject
from worker import model_download
from worker.model_download import META_FILE, ModelDownloadFailed, ModelDownloads

pytestmark = pytest.mark.integration


def _put(bucket: str, key: str, data: bytes) -> None:
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1").put_object(
        Bucket=bucket, Key=key, Body=data)


def saved_model(bucket: str, name: str, size: int) -> str:
    """A prefix shaped like a SavedModel (the cache does not parse it): ``saved_model.pb`` and two variables files."""
    url = f"s3://{bucket}/models/{name}"
    _put(bucket, f"models/{name}/saved_model.pb", name.encode() * 8)
    _put(bucket, f"models/{name}/variables/variables.index", b"index-" + name.encode())
    _put(bucket, f"models/{name}/variables/variables.data-00000-of-00001", os.urandom(size))
    return url


def files(path: str) -> dict[str, bytes]:
    root = Path(path)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_two_workers_download_the_same_model_at_once(s3_env, tmp_path):
    url = saved_model(s3_env, "m", 3 << 20)
    caches = [ModelDownloads(tmp_path, limit_bytes=1 << 30) for _ in range(2)]
    seen: list[dict[str, bytes]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def fetch(cache: ModelDownloads) -> None:
        try:
            start.wait()
            with cache.local(url) as path:
                seen.append(files(path))
        except BaseException as exc:   # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=fetch, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(seen) == 2 and seen[0] == seen[1] and set(seen[0]) == {
        "saved_model.pb", "variables/variables.index", "variables/variables.data-00000-of-00001"}
    assert len(seen[0]["variables/variables.data-00000-of-00001"]) == 3 << 20
    assert [p.name for p in (tmp_path / "models").iterdir()] == [caches[0].entries()[0].key]   # no .tmp left
    with caches[0].local(url):
        pass
    assert caches[0].hits == 1 and caches[0].downloads + caches[1].downloads + caches[1].hits == 2


def test_least_recently_used_removed_beyond_the_bound_but_not_in_use(s3_env, tmp_path):
    urls = [saved_model(s3_env, name, 1 << 20) for name in ("a", "b", "c")]
    cache = ModelDownloads(tmp_path, limit_bytes=(5 << 20) // 2)   # two models fit, not three
    with cache.local(urls[0]):
        pass
    with cache.local(urls[1]):
        pass
    keys = {e.key: e for e in cache.entries()}
    assert len(keys) == 2
    with cache.local(urls[0]):   # a is used again: b is now the least recently used
        pass
    with cache.local(urls[2]) as c_path:
        assert Path(c_path).is_dir()
    kept = {json_url(tmp_path, e.key) for e in cache.entries()}
    assert kept == {urls[0], urls[2]}
    c_key = next(key for key in keys_of(cache) if json_url(tmp_path, key) == urls[2])
    with cache.local(urls[0]) as a_path:   # held by a job: another cache on the folder cannot remove it
        other = ModelDownloads(tmp_path, limit_bytes=0)
        assert other.evict() == [c_key]
        assert Path(a_path, "saved_model.pb").is_file() and len(cache.entries()) == 1
    assert len(ModelDownloads(tmp_path, limit_bytes=0).evict()) == 1 and cache.entries() == []
    assert not any((tmp_path / "models").iterdir())


def json_url(root: Path, key: str) -> str:
    import json

    return json.loads((root / "models" / key / META_FILE).read_text())["url"]


def keys_of(cache: ModelDownloads) -> list[str]:
    return [e.key for e in cache.entries()]


def test_a_model_larger_than_the_bound_is_refused(s3_env, tmp_path):
    from worker.engine.errors import InvalidRequest

    url = saved_model(s3_env, "big", 1 << 20)
    with pytest.raises(InvalidRequest, match="JACOBIAN_MODEL_DOWNLOAD_CACHE_BYTES"):
        with ModelDownloads(tmp_path, limit_bytes=1 << 19).local(url):
            pass
    assert not (tmp_path / "models").exists()   # refused from the listing: nothing downloaded


def test_bytes_not_the_listings_are_refused_and_nothing_is_kept(s3_env, tmp_path, monkeypatch):
    url = saved_model(s3_env, "m", 1024)
    listing = model_download.model_listing(url)
    wrong = [o if o.name != "saved_model.pb" else RemoteObject(o.name, o.size, "0" * 32) for o in listing]
    monkeypatch.setattr(model_download, "model_listing", lambda _: wrong)
    with pytest.raises(ModelDownloadFailed, match="changed while it was downloaded") as caught:
        with ModelDownloads(tmp_path, limit_bytes=1 << 30).local(url):
            pass
    assert caught.value.transient
    assert not any((tmp_path / "models").iterdir())


def test_a_local_copy_altered_on_disk_is_downloaded_again(s3_env, tmp_path):
    url = saved_model(s3_env, "m", 1024)
    cache = ModelDownloads(tmp_path, limit_bytes=1 << 30)
    with cache.local(url) as path:
        good = files(path)
        fingerprint = model_fingerprint(path)
    Path(path, "saved_model.pb").write_bytes(b"tampered")
    with cache.local(url) as again:
        assert files(again) == good and model_fingerprint(again) == fingerprint
    assert (cache.downloads, cache.hits) == (2, 0)


def test_an_object_uploaded_in_parts_is_checked_by_size(s3_env, tmp_path):
    """A multipart ETag (``<md5 of the parts' md5s>-<parts>``) is no MD5 of the bytes: the size is checked."""
    import io

    from boto3.s3.transfer import TransferConfig

    url = saved_model(s3_env, "parts", 16)
    data = os.urandom(6 << 20)
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    config = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
    client.upload_fileobj(io.BytesIO(data), s3_env, "models/parts/variables/variables.data-00000-of-00001",
                          Config=config)
    etags = {o.name: o.etag for o in model_download.model_listing(url)}
    assert etags["variables/variables.data-00000-of-00001"].endswith("-2"), etags
    with ModelDownloads(tmp_path, limit_bytes=1 << 30).local(url) as path:
        assert files(path)["variables/variables.data-00000-of-00001"] == data
