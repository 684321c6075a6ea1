"""Models under S3 model roots, downloaded once into a content-addressed local cache that workers share.

Layout, under ``<JACOBIAN_CACHE_DIR>/models``:

- ``<key>/meta.json``: the URL, each object's name, size and ETag, the bytes, the plan fingerprint; its mtime is
  the entry's last use (LRU);
- ``<key>/model/...`` (a SavedModel's objects) or ``<key>/model.keras``;
- ``.<key>.<random>.tmp``: a download in progress, or an entry being removed.

**Content address.** ``key`` is the SHA-256 of the model's URL and its listing (every object's name, size and
ETag, ``contracts.remote_models.model_listing``: one LIST request, or one HEAD for a ``.keras`` object). S3 gives an
object a new ETag whenever its bytes change, so a model changed in the bucket has another key: it is downloaded
and scanned again. The same bytes under the same URL are downloaded once per cache folder.

**Verification.** Each object is hashed while it is downloaded: its size must be the listing's, and its MD5 the
ETag wherever the ETag is one (an object uploaded in one part; a multipart ETag, ``<md5>-<parts>``, is checked by
size only). A mismatch (the object changed during the download) is a transient error: rq retries the job, which
lists again. The entry then records the plan fingerprint of its bytes (``contracts.plans.model_fingerprint``, the
one plan keys use); each later use recomputes it (cached per file mtime) and downloads again on a mismatch (a
local copy altered on disk).

**Two workers, one folder.** A download goes to a temporary folder renamed into place (``rename`` of a folder is
atomic, and fails when another worker's copy got there first: that one is used, this one removed). A worker
holds a shared ``flock`` on the entry while it scans and loads the model; eviction takes an exclusive lock without
waiting (an entry in use is skipped), renames the entry away, then removes it; a reader that locked an entry
checks afterwards that it is still in place. Temporary folders whose worker died (no lock held, older than a
minute) are removed on the next eviction pass.

**Size bound.** ``JACOBIAN_MODEL_DOWNLOAD_CACHE_BYTES``: after each download, the least recently used entries are
removed until the rest fit (``evictions``, pure); a model larger than the bound is refused.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from contracts import storage
from contracts.keras_file import is_keras_file
from contracts.plans import default_cache_dir, model_fingerprint
from contracts.remote_models import RemoteObject, model_listing, open_object
from contracts.savedmodel import SAVED_MODEL_FILE, SavedModelError
from worker.engine.errors import EngineError, InvalidRequest

log = logging.getLogger(__name__)

MODELS_DIR = "models"
META_FILE = "meta.json"
KERAS_NAME = "model.keras"
SAVED_MODEL_NAME = "model"
SIZE_SETTING = "JACOBIAN_MODEL_DOWNLOAD_CACHE_BYTES"
_BLOCK = 8 << 20
_STALE_S = 60.0
_MD5 = re.compile(r"[0-9a-f]{32}")


class ModelDownloadFailed(EngineError):
    """The downloaded bytes are not the listing's (the model changed during the download): retried."""

    transient = True


@dataclass(frozen=True)
class CachedEntry:
    """One entry of the cache: its ``key``, its ``size`` in bytes and when it was last ``used`` (epoch seconds)."""

    key: str
    size: int
    used: float


def evictions(entries: Iterable[CachedEntry], *, limit_bytes: int, keep: Collection[str] = ()) -> list[str]:
    """The keys to remove, least recently used first (ties by key), until the entries left fit in ``limit_bytes``;
    a key in ``keep`` is never removed (the entries left may then stay over the bound)."""
    entries = list(entries)
    total = sum(e.size for e in entries)
    out: list[str] = []
    for entry in sorted(entries, key=lambda e: (e.used, e.key)):
        if total <= limit_bytes:
            break
        if entry.key not in keep:
            out.append(entry.key)
            total -= entry.size
    return out


def content_key(url: str, objects: Iterable[RemoteObject]) -> str:
    """The entry's name: SHA-256 (32 hex) of ``url`` and each object's name, size and ETag."""
    listing = [[o.name, o.size, o.etag] for o in sorted(objects)]
    return hashlib.sha256(json.dumps([storage.normalize(url), listing]).encode()).hexdigest()[:32]


def _check_name(url: str, name: str) -> None:
    """An object's name under the model must be a plain relative path (a key may hold ``..``: never a local escape)."""
    if not name or name.startswith("/") or any(part in ("", ".", "..") for part in name.split("/")):
        raise InvalidRequest(f"model.path: {url!r} holds an object named {name!r}, which is not a plain relative "
                             "path; remove it from the model's prefix", field="model.path")


def _lock(path: Path, how: int) -> int | None:
    """``path`` opened (a folder) and locked with ``how``; None when absent or, with ``LOCK_NB``, locked elsewhere."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, how)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _in_place(path: Path, fd: int) -> bool:
    """Whether ``path`` is still the folder ``fd`` has open (not renamed away since)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


class ModelDownloads:
    """The cache folder ``root/models`` of at most ``limit_bytes``; counts ``downloads`` and ``hits``."""

    def __init__(self, root: str | os.PathLike[str], *, limit_bytes: int) -> None:
        self.folder = Path(root) / MODELS_DIR
        self.limit_bytes = limit_bytes
        self.downloads = 0
        self.hits = 0

    @contextmanager
    def local(self, url: str) -> Iterator[str]:
        """The local path of the model at ``url`` (a SavedModel folder or a ``.keras`` file), downloaded unless this
        cache holds its current bytes; the entry is locked (not evicted) until the block ends.

        Raises ``InvalidRequest`` (nothing there, larger than the bound, an object name that is not a plain path),
        ``SavedModelError`` (a prefix without ``saved_model.pb``), ``ModelDownloadFailed`` (bytes not the
        listing's: transient), ``OSError`` from S3 or the local disk."""
        objects = model_listing(url)
        keras = is_keras_file(url) and len(objects) == 1 and objects[0].name == url.rstrip("/").rsplit("/", 1)[-1]
        self._check(url, objects, keras)
        key = content_key(url, objects)
        fd = self._open_verified(key)
        if fd is None:
            started = time.monotonic()
            fd = self._download(url, key, objects, keras)
            self.downloads += 1
            size = sum(o.size for o in objects)
            _count("downloaded", size)
            log.info("model %s: downloaded %d objects (%d bytes) into %s in %.1f s", url, len(objects), size,
                     self.folder / key, time.monotonic() - started)
        else:
            self.hits += 1
            _count("cached", 0)
            log.info("model %s: the local copy %s holds its current bytes; not downloaded again", url,
                     self.folder / key)
        try:
            now = time.time_ns()   # not the kernel's coarse clock: two uses within a tick keep their order
            os.utime(self.folder / key / META_FILE, ns=(now, now))
            self.evict(keep={key})
            yield str(self.folder / key / (KERAS_NAME if keras else SAVED_MODEL_NAME))
        finally:
            os.close(fd)

    def _check(self, url: str, objects: list[RemoteObject], keras: bool) -> None:
        if not objects:
            raise InvalidRequest(f"model.path: {url!r} holds nothing in the bucket (it was removed after POST?); "
                                 "put the model back or give another path", field="model.path")
        if not keras and SAVED_MODEL_FILE not in {o.name for o in objects}:
            raise SavedModelError(f"no {SAVED_MODEL_FILE} under {url!r}")
        for obj in objects:
            _check_name(url, obj.name)
        size = sum(o.size for o in objects)
        if size > self.limit_bytes:
            raise InvalidRequest(f"model.path: {url!r} is {size} bytes, more than this worker's model cache holds "
                                 f"({self.limit_bytes} bytes, {SIZE_SETTING}); ask the operator to raise it",
                                 field="model.path")

    def _open_verified(self, key: str) -> int | None:
        """The entry ``key`` share-locked, when it is in place and its bytes have the fingerprint it recorded."""
        path = self.folder / key
        fd = _lock(path, fcntl.LOCK_SH)
        if fd is None:
            return None
        if not _in_place(path, fd):
            os.close(fd)
            return None
        try:
            meta = json.loads((path / META_FILE).read_text())
            model = path / (KERAS_NAME if meta["keras"] else SAVED_MODEL_NAME)
            if model_fingerprint(model) == meta["fingerprint"]:
                return fd
        except (OSError, ValueError, KeyError, TypeError):
            pass
        log.warning("model cache: %s does not hold the bytes it recorded; downloading again", path)
        os.close(fd)
        if not self.remove(key):
            raise ModelDownloadFailed(f"model.path: the local copy {str(path)!r} is damaged and in use by another "
                                      "job; retrying", field="model.path")
        return None

    def _download(self, url: str, key: str, objects: list[RemoteObject], keras: bool) -> int:
        """Download into a temporary folder, verify, rename into place; the entry share-locked."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.folder, prefix=f".{key}.", suffix=".tmp"))
        fd = _lock(tmp, fcntl.LOCK_EX)
        if fd is None:
            raise ModelDownloadFailed(f"model.path: the download folder {str(tmp)!r} went away; retrying",
                                      field="model.path")
        try:
            model = tmp / (KERAS_NAME if keras else SAVED_MODEL_NAME)
            for obj in objects:
                _fetch(url if keras else storage.join(url, obj.name), obj, model if keras else model / obj.name)
            meta = {"url": url, "keras": keras, "bytes": sum(o.size for o in objects),
                    "objects": [list(o) for o in objects], "fingerprint": model_fingerprint(model)}
            (tmp / META_FILE).write_text(json.dumps(meta))
            os.rename(tmp, self.folder / key)
        except OSError as exc:
            os.close(fd)
            shutil.rmtree(tmp, ignore_errors=True)
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            log.info("model %s: another worker stored the same bytes first; using its copy", url)
            theirs = self._open_verified(key)
            if theirs is None:
                raise ModelDownloadFailed(f"model.path: the local copy of {url!r} went away; retrying",
                                          field="model.path") from None
            return theirs
        except BaseException:
            os.close(fd)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def entries(self) -> list[CachedEntry]:
        """The entries in place (their size from ``meta.json``, their last use its mtime)."""
        out = []
        for path in self.folder.iterdir() if self.folder.is_dir() else ():
            if path.name.startswith("."):
                continue
            try:
                meta = path / META_FILE
                out.append(CachedEntry(path.name, int(json.loads(meta.read_text())["bytes"]), meta.stat().st_mtime))
            except (OSError, ValueError, KeyError, TypeError):
                continue   # not an entry of this cache
        return out

    def evict(self, *, keep: Collection[str] = ()) -> list[str]:
        """Remove the least recently used entries beyond the bound (not those in ``keep``, nor those in use), and
        the temporary folders of workers that died; returns the keys removed."""
        self._sweep()
        return [key for key in evictions(self.entries(), limit_bytes=self.limit_bytes, keep=keep)
                if self.remove(key)]

    def remove(self, key: str) -> bool:
        """Remove the entry ``key`` unless a job holds it; True when it is gone."""
        path = self.folder / key
        fd = _lock(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if fd is None:
            return not path.exists()
        try:
            if not _in_place(path, fd):
                return not path.exists()
            grave = self.folder / f".{key}.{secrets.token_hex(4)}.tmp"
            os.rename(path, grave)
            shutil.rmtree(grave, ignore_errors=True)
            log.info("model cache: removed %s", path)
            return True
        finally:
            os.close(fd)

    def _sweep(self) -> None:
        now = time.time()
        for path in self.folder.glob(".*.tmp") if self.folder.is_dir() else ():
            try:
                if now - path.stat().st_mtime < _STALE_S:
                    continue
            except FileNotFoundError:
                continue
            fd = _lock(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if fd is not None:   # nobody downloads into it or removes it any more
                try:
                    shutil.rmtree(path, ignore_errors=True)
                finally:
                    os.close(fd)


def _fetch(url: str, obj: RemoteObject, dest: Path) -> None:
    """Copy the object at ``url`` to ``dest``, hashed on the way; raises ``ModelDownloadFailed`` when its bytes are
    not the listing's ``obj`` (size, and MD5 where the ETag is one)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    md5 = hashlib.md5(usedforsecurity=False)
    size = 0
    with open_object(url, block_size=_BLOCK) as src, open(dest, "wb") as out:
        while size <= obj.size:
            chunk = src.read(min(_BLOCK, obj.size + 1 - size))
            if not chunk:
                break
            md5.update(chunk)
            out.write(chunk)
            size += len(chunk)
    if size != obj.size or (_MD5.fullmatch(obj.etag) and md5.hexdigest() != obj.etag):
        what = f"{size} bytes, not {obj.size}" if size != obj.size else f"MD5 {md5.hexdigest()}, not {obj.etag}"
        raise ModelDownloadFailed(f"model.path: {url!r} changed while it was downloaded ({what}); retrying",
                                  field="model.path")


def _count(result: str, size: int) -> None:
    from worker import metrics

    metrics.MODEL_DOWNLOADS.labels(result).inc()
    if size:
        metrics.MODEL_DOWNLOAD_BYTES.inc(size)


@lru_cache(maxsize=4)
def _downloads(root: str, limit_bytes: int) -> ModelDownloads:
    return ModelDownloads(root, limit_bytes=limit_bytes)


def model_downloads(settings: Any) -> ModelDownloads:
    """The process-wide cache of ``settings`` (``cache_dir``, else ``default_cache_dir()``;
    ``model_download_cache_bytes``)."""
    root = str(settings.cache_dir) if settings.cache_dir else str(default_cache_dir())
    return _downloads(root, settings.model_download_cache_bytes)
