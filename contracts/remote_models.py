"""Models under S3 model roots (``s3://bucket/prefix`` entries of ``JACOBIAN_MODEL_ROOTS``), without TensorFlow.

A model there is a SavedModel prefix (``<url>/saved_model.pb``, ``<url>/variables/...``) or one ``.keras`` object.
The API checks it by bounded reads (``remote_saved_model``, ``remote_keras``): ``saved_model.pb`` (at most
``JACOBIAN_MAX_MODEL_READ_BYTES``) for the graph scan and the signature; of a ``.keras`` file, the zip's directory
and its ``config.json`` only, by ranged reads. Parsed results are cached per URL, ETag and size. The worker lists the
model (``model_listing``: names, sizes, ETags) and downloads it into its local cache (``worker/model_download.py``),
where the scan runs again on the downloaded bytes. Every function may raise ``OSError`` (``FileNotFoundError``
when the object is not there, ``PermissionError`` when the credentials may not read it).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

from contracts import storage
from contracts.graph_ops import GraphOps, parse_graph_ops
from contracts.graph_scan import check_graph
from contracts.keras_file import is_keras_file, keras_info, scan_keras_config, zip_config
from contracts.plans import FINGERPRINT_FILES, keras_fingerprint, saved_model_fingerprint
from contracts.savedmodel import SAVED_MODEL_FILE, SavedModelError, SavedModelInfo, parse_saved_model

READ_SETTING = "JACOBIAN_MAX_MODEL_READ_BYTES"
_ZIP_BLOCK = 1 << 16   # ranged reads of a .keras zip: its directory and one member, not its weights
_HASH_BLOCK = 8 << 20


class RemoteObject(NamedTuple):
    """One object of a model in the bucket: its name under the model's URL (a ``.keras`` file: its own name),
    its size and its ETag (quotes stripped; the MD5 of the bytes for an object uploaded in one part)."""

    name: str
    size: int
    etag: str


class ModelTooLarge(SavedModelError):
    """A model file the API would read is larger than ``JACOBIAN_MAX_MODEL_READ_BYTES``."""


def remote_roots(roots: Sequence[str]) -> list[str]:
    """The ``s3://`` entries of ``roots``, without trailing ``/``."""
    return [r.rstrip("/") for r in roots if storage.is_remote(r)]


def bad_key(url: str) -> bool:
    """Whether the key of ``url`` has an empty, ``.`` or ``..`` component (``a//b``, ``a/../b``): refused, so that
    a model URL means one thing to every reader."""
    key = url.split("://", 1)[1].rstrip("/")
    return any(part in ("", ".", "..") for part in key.split("/"))


def remote_root_of(url: str, roots: Sequence[str]) -> str | None:
    """The S3 root of ``roots`` that ``url`` lies under (``storage.is_under``), or None; a URL with a bad key
    (``bad_key``) lies under none."""
    if not storage.is_remote(url) or bad_key(url):
        return None
    return next((root for root in remote_roots(roots) if storage.is_under(url, root)), None)


def _fs(url: str) -> Any:
    return storage.storage_for(url).fs  # type: ignore[attr-defined]


def _key(url: str) -> str:
    return url.split("://", 1)[1].rstrip("/")


def _etag(info: Mapping[str, Any]) -> str:
    return str(info.get("ETag") or info.get("etag") or "").strip('"')


def head(url: str) -> RemoteObject:
    """The object at ``url`` (one HEAD request); ``FileNotFoundError`` when it is absent or a prefix."""
    info = _fs(url).info(_key(url))
    if info.get("type") != "file":
        raise FileNotFoundError(url)
    return RemoteObject(_key(url).rsplit("/", 1)[-1], int(info["size"]), _etag(info))


@lru_cache(maxsize=64)
def _object_sha256(url: str, etag: str, size: int, max_bytes: int) -> str:
    if size > max_bytes:
        return ""
    digest = hashlib.sha256()
    with open_object(url, block_size=_HASH_BLOCK) as f:
        for block in iter(lambda: f.read(_HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def remote_fingerprint(url: str, *, max_bytes: int) -> str:
    """``contracts.plans.model_fingerprint`` of the model at ``url``, read from the bucket: the objects it hashes
    (a ``.keras`` file; ``saved_model.pb`` and ``variables/variables.index``), each read once per ETag; ``""`` when
    one is over ``max_bytes``. Raises ``FileNotFoundError`` for a ``.keras`` object that is not there."""
    if is_keras_file(url):
        obj = head(url)
        sha = _object_sha256(url, obj.etag, obj.size, max_bytes)
        return keras_fingerprint(sha) if sha else ""
    hashes: dict[str, str | None] = {}
    for rel in FINGERPRINT_FILES:
        try:
            obj = head(storage.join(url, rel))
        except FileNotFoundError:
            hashes[rel] = None
            continue
        hashes[rel] = _object_sha256(storage.join(url, rel), obj.etag, obj.size, max_bytes)
        if not hashes[rel]:
            return ""
    return saved_model_fingerprint(hashes)


def open_object(url: str, *, block_size: int) -> Any:
    """The object at ``url`` opened for reading in ranges of ``block_size`` bytes."""
    return _fs(url).open(_key(url), "rb", block_size=block_size)


def model_exists(url: str) -> bool:
    """Whether a model is at ``url``: the ``.keras`` object, or a SavedModel's ``saved_model.pb``."""
    try:
        head(url if is_keras_file(url) else storage.join(url, SAVED_MODEL_FILE))
    except FileNotFoundError:
        return False
    return True


def model_listing(url: str) -> list[RemoteObject]:
    """The objects of the model at ``url``: the one ``.keras`` object, or every object under the prefix
    (sorted by name; ``[]`` when nothing is there)."""
    fs, key = _fs(url), _key(url)
    if is_keras_file(url):
        try:
            return [head(url)]
        except FileNotFoundError:
            pass
    found = fs.find(key, detail=True)
    return sorted(RemoteObject(name[len(key) + 1:], int(info["size"]), _etag(info))
                  for name, info in found.items()
                  if name.startswith(f"{key}/") and info.get("type") == "file" and not name.endswith("/"))


def _too_large(url: str, size: int, max_bytes: int, field: str) -> ModelTooLarge:
    return ModelTooLarge(f"{field}: {url!r} is {size} bytes, more than the {max_bytes} this service reads to check "
                         f"a model ({READ_SETTING}); ask the operator to raise it")


@lru_cache(maxsize=32)
def _saved_model(url: str, etag: str, size: int, max_bytes: int, field: str) -> tuple[GraphOps, SavedModelInfo]:
    data = bytes(_fs(url).cat_file(_key(url), start=0, end=max_bytes + 1))
    if len(data) > max_bytes:   # replaced by a larger one since the HEAD
        raise _too_large(url, len(data), max_bytes, field)
    try:
        return parse_graph_ops(data), parse_saved_model(data)
    except (SavedModelError, UnicodeDecodeError) as exc:
        raise SavedModelError(f"{url!r} is not a readable SavedModel: {exc}") from None


def remote_saved_model(url: str, *, op_allow: Mapping[str, list[str]], roots: list[str], max_bytes: int,
                       field: str = "model.path") -> SavedModelInfo:
    """Scan and read the SavedModel at the prefix ``url`` from its ``saved_model.pb`` (one HEAD, then at most
    ``max_bytes`` read once per ETag). Raises ``FileNotFoundError`` when there is no ``saved_model.pb``,
    ``ModelTooLarge``, ``SavedModelError`` when it cannot be decoded, ``ModelRefused`` (``graph_scan``)."""
    pb = storage.join(url, SAVED_MODEL_FILE)
    obj = head(pb)
    if obj.size > max_bytes:
        raise _too_large(pb, obj.size, max_bytes, field)
    graph, info = _saved_model(pb, obj.etag, obj.size, max_bytes, field)
    check_graph(graph, url, op_allow=op_allow, roots=roots, field=field)
    return info


class _Bounded(io.RawIOBase):
    """A seekable file read through, refusing to hand out more than ``budget`` bytes in all."""

    def __init__(self, file: Any, budget: int, url: str, field: str) -> None:
        self.file, self.budget, self.url, self.field = file, budget, url, field

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return int(self.file.seek(offset, whence))

    def tell(self) -> int:
        return int(self.file.tell())

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self.budget + 1
        data = self.file.read(min(size, self.budget + 1))
        self.budget -= len(data)
        if self.budget < 0:
            raise ModelTooLarge(f"{self.field}: {self.url!r}: its zip directory and config.json take more than the "
                                f"bytes this service reads to check a model ({READ_SETTING}); ask the operator to "
                                "raise it")
        return bytes(data)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


@lru_cache(maxsize=32)
def _keras_config(url: str, etag: str, size: int, max_bytes: int, field: str) -> dict[str, Any]:
    with _fs(url).open(_key(url), "rb", block_size=_ZIP_BLOCK, cache_type="bytes") as f:
        return zip_config(_Bounded(f, 2 * max_bytes + _ZIP_BLOCK, url, field), url, max_bytes=max_bytes)


def remote_keras(url: str, *, custom_objects: str | None, unsafe_roots: list[str], max_bytes: int,
                 field: str = "model.path") -> SavedModelInfo:
    """Scan and read the ``.keras`` object at ``url`` from its ``config.json`` (the zip's directory and that member
    by ranged reads, at most ``max_bytes`` for the member, once per ETag). Raises ``FileNotFoundError``,
    ``KerasFileError`` (not a ``.keras`` zip; ``KerasConfigTooLarge``), ``ModelTooLarge``, ``KerasRefused``."""
    obj = head(url)
    config = _keras_config(url, obj.etag, obj.size, max_bytes, field)
    scan_keras_config(config, url, custom_objects=custom_objects, unsafe_roots=unsafe_roots, field=field)
    return keras_info(config, url)
