"""The storage seam (``contracts.storage``): one ``Storage`` per URL kind, module functions as wrappers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from contracts import storage


class MemoryStorage:
    """An in-memory ``Storage`` twin for ``mem://`` URLs (objects in a dict; prefixes are implicit)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def normalize(self, url: str) -> str:
        return url.rstrip("/")

    def write_bytes(self, url: str, data: bytes) -> None:
        self.objects[url] = bytes(data)

    def read_bytes(self, url: str) -> bytes:
        if url not in self.objects:
            raise FileNotFoundError(url)
        return self.objects[url]

    def open_file(self, url: str) -> Any:
        import io

        return io.BytesIO(self.read_bytes(url))

    def exists(self, url: str) -> bool:
        return any(k == url or k.startswith(url.rstrip("/") + "/") for k in self.objects)

    def delete_prefix(self, url: str) -> None:
        for k in [k for k in self.objects if k == url or k.startswith(url.rstrip("/") + "/")]:
            del self.objects[k]

    def list_names(self, url: str) -> list[str]:
        prefix = url.rstrip("/") + "/"
        return sorted({k[len(prefix):].split("/", 1)[0] for k in self.objects if k.startswith(prefix)})

    def zarr_store(self, url: str, *, read_only: bool) -> Any:
        from zarr.storage import MemoryStore

        return MemoryStore(read_only=read_only)


def test_storage_for_chooses_by_scheme(tmp_path: Path, monkeypatch) -> None:
    local = storage.storage_for(str(tmp_path))
    assert isinstance(local, storage.LocalStorage) and isinstance(local, storage.Storage)
    assert storage.storage_for(f"file://{tmp_path}") is local and storage.storage_for("relative/dir") is local
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    for url in ("s3://bucket/prefix", "s3a://bucket/prefix"):
        remote = storage.storage_for(url)
        assert isinstance(remote, storage.S3Storage) and isinstance(remote, storage.Storage)
        options = dict(remote.options)
        assert options["endpoint_url"] == "http://127.0.0.1:1" and options["use_listings_cache"] is False
        assert dict(options["client_kwargs"]) == {"region_name": "eu-west-3"}
    assert storage.normalize("s3://bucket/prefix/") == "s3://bucket/prefix"  # no network for this


def test_module_functions_go_through_storage_for(monkeypatch) -> None:
    """Every module-level function asks ``storage_for`` for the URL's storage and calls it: nothing else
    branches on the scheme, so a new backend is one class and one line in ``storage_for``."""
    memory = MemoryStorage()
    real = storage.storage_for
    monkeypatch.setattr(storage, "storage_for", lambda url: memory if url.startswith("mem://") else real(url))
    storage.write_bytes("mem://b/job/committed/0", b"{}")
    storage.write_bytes("mem://b/job/manifest.json", b"m")
    assert storage.read_bytes("mem://b/job/manifest.json") == b"m"
    assert storage.open_file("mem://b/job/manifest.json").read() == b"m"
    assert storage.exists("mem://b/job") and storage.list_names("mem://b/job") == ["committed", "manifest.json"]
    assert storage.normalize("mem://b/job/") == "mem://b/job"
    storage.delete_prefix("mem://b/job/committed")
    assert storage.list_names("mem://b/job") == ["manifest.json"]
    assert type(storage.zarr_store("mem://x", read_only=True)).__name__ == "MemoryStore"
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("mem://b/job/committed/0")


def test_local_storage_edge_cases(tmp_path: Path) -> None:
    """What the local implementation promises beyond read/write: folders, absent files, temporary files."""
    local = storage.LocalStorage()
    url = str(tmp_path / "d" / "x.bin")
    local.write_bytes(url, b"abc")
    (tmp_path / "d" / ".y.bin.123.tmp").write_bytes(b"half written")
    assert local.list_names(str(tmp_path / "d")) == ["x.bin"]  # writes in progress are not listed
    with local.open_file(url) as f:
        f.seek(1)
        assert f.read() == b"bc"
    with pytest.raises(IsADirectoryError):
        local.open_file(str(tmp_path / "d"))
    with pytest.raises(FileNotFoundError):
        local.open_file(str(tmp_path / "missing"))
    assert local.normalize(f"file://{tmp_path}/d/../d") == str(tmp_path / "d")
    local.delete_prefix(url)
    local.delete_prefix(url)  # nothing there: not an error
    assert local.list_names(str(tmp_path / "d")) == [] and not local.exists(url)
