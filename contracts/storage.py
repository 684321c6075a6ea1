"""URL-addressed storage for API, worker and CLI: local paths, ``file://`` and ``s3://bucket/prefix``.

One ``Storage`` protocol, two implementations (``LocalStorage`` for paths and ``file://``, ``S3Storage``
for ``s3://`` through s3fs), chosen per URL by ``storage_for``. The module-level functions
(``write_bytes``, ``read_bytes``, ``list_names``, ...) are thin wrappers over ``storage_for(url)``.
S3 credentials and endpoint come from the standard ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION`` and ``AWS_ENDPOINT_URL`` variables (the endpoint is passed to
s3fs explicitly). Filesystem objects are created on first use and cached per set of credentials;
nothing touches the network at import time. Every function may raise ``OSError`` (``FileNotFoundError``
where a read finds nothing).
"""

from __future__ import annotations

import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, runtime_checkable

from contracts.files import write_atomically

if TYPE_CHECKING:
    import zarr
    from zarr.abc.store import Store

_S3_SCHEMES = ("s3://", "s3a://")


def is_remote(url: str) -> bool:
    """True for object-storage URLs (``s3://``); False for local paths and ``file://``."""
    return url.startswith(_S3_SCHEMES)


def join(url: str, *parts: str) -> str:
    """``url`` and ``parts`` joined with ``/`` (no normalisation of the parts)."""
    out = url.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def is_under(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is ``folder`` or lies in it: two ``s3://`` URLs by their ``bucket/key`` (``s3a://`` is the
    same), two local paths resolved (symbolic links followed); a URL and a local path never."""
    path, folder = str(path), str(folder)
    if is_remote(path) or is_remote(folder):
        if not (is_remote(path) and is_remote(folder)):
            return False
        inner, outer = _s3_path(path), _s3_path(folder)
        return inner == outer or inner.startswith(f"{outer}/")
    return _local_path(path).is_relative_to(_local_path(folder))


def _local_path(url: str) -> Path:
    return Path(url.removeprefix("file://")).expanduser().resolve()


def _s3_path(url: str) -> str:
    """``bucket/key`` of an ``s3://`` URL."""
    return url.split("://", 1)[1].rstrip("/")


def s3_options_from_env() -> dict[str, Any]:
    """fsspec/s3fs options from the standard ``AWS_*`` variables (key, secret, token, endpoint, region)."""
    env = os.environ
    options: dict[str, Any] = {}
    for option, name in (("key", "AWS_ACCESS_KEY_ID"), ("secret", "AWS_SECRET_ACCESS_KEY"),
                         ("token", "AWS_SESSION_TOKEN"), ("endpoint_url", "AWS_ENDPOINT_URL")):
        if env.get(name):
            options[option] = env[name]
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        options["client_kwargs"] = {"region_name": region}
    return options


def _s3_options() -> tuple[tuple[str, Any], ...]:
    """``s3_options_from_env()`` without listings cache, hashable (for the filesystem cache key)."""
    opts: dict[str, Any] = {"use_listings_cache": False, **s3_options_from_env()}
    if "client_kwargs" in opts:
        opts["client_kwargs"] = tuple(sorted(opts["client_kwargs"].items()))
    return tuple(sorted(opts.items()))


def _expand(options: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    opts = dict(options)
    if "client_kwargs" in opts:
        opts["client_kwargs"] = dict(opts["client_kwargs"])
    return opts


S3_RETRY_HOOKS: list[Any] = []  # called with no argument per failed S3 request attempt (the worker's metrics)


def _on_needs_retry(response: Any = None, caught_exception: Any = None, **_: Any) -> None:
    """botocore's ``needs-retry`` event: an attempt that failed (connection error, timeout, 5xx, 429) is
    counted through ``S3_RETRY_HOOKS``; botocore and s3fs then try it again (their own backoff)."""
    status = getattr(response[0], "status_code", 0) if response else 0
    if caught_exception is not None or status >= 500 or status == 429:
        for hook in list(S3_RETRY_HOOKS):
            hook()


def _session() -> Any:
    """An aiobotocore session whose clients report failed attempts (``_on_needs_retry``)."""
    from aiobotocore.session import AioSession

    session = AioSession()
    session.register("needs-retry.s3", _on_needs_retry)
    return session


@lru_cache(maxsize=8)
def _s3_fs(options: tuple[tuple[str, Any], ...]) -> Any:
    """A synchronous s3fs filesystem for these options (cached)."""
    import s3fs

    return s3fs.S3FileSystem(session=_session(), **_expand(options))


@lru_cache(maxsize=8)
def _s3_async_fs(options: tuple[tuple[str, Any], ...]) -> Any:
    """An asynchronous s3fs filesystem for zarr's event loop (cached)."""
    import s3fs

    return s3fs.S3FileSystem(asynchronous=True, session=_session(), **_expand(options))


@runtime_checkable
class Storage(Protocol):
    """Objects under the URLs of one kind of storage. Every method may raise ``OSError``."""

    def normalize(self, url: str) -> str:
        """``url`` in canonical form: an absolute local path, or the ``s3://`` URL without trailing ``/``."""
        ...

    def write_bytes(self, url: str, data: bytes) -> None:
        """Write ``data`` to ``url``, replacing what is there."""
        ...

    def read_bytes(self, url: str) -> bytes:
        """The whole object at ``url``; raises ``FileNotFoundError`` when absent."""
        ...

    def open_file(self, url: str) -> BinaryIO:
        """``url`` opened for seekable binary reading; ``FileNotFoundError`` / ``IsADirectoryError``."""
        ...

    def exists(self, url: str) -> bool:
        """True when ``url`` is an object/file or a non-empty prefix/directory."""
        ...

    def delete_prefix(self, url: str) -> None:
        """Remove ``url`` and everything under it; nothing there is not an error."""
        ...

    def list_names(self, url: str) -> list[str]:
        """Sorted names directly under ``url``; ``[]`` when nothing is there."""
        ...

    def zarr_store(self, url: str, *, read_only: bool) -> Store:
        """A zarr v3 store rooted at ``url``."""
        ...


class LocalStorage:
    """Local paths and ``file://`` URLs; writes are atomic (a temporary file renamed into place)."""

    def normalize(self, url: str) -> str:
        return str(_local_path(url))

    def write_bytes(self, url: str, data: bytes) -> None:
        write_atomically(_local_path(url), data)

    def read_bytes(self, url: str) -> bytes:
        return _local_path(url).read_bytes()

    def open_file(self, url: str) -> BinaryIO:
        return open(_local_path(url), "rb")

    def exists(self, url: str) -> bool:
        return _local_path(url).exists()

    def delete_prefix(self, url: str) -> None:
        path = _local_path(url)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=False)
        elif path.exists() or path.is_symlink():
            path.unlink()

    def list_names(self, url: str) -> list[str]:
        """Names under the folder, without the temporary files of writes in progress."""
        path = _local_path(url)
        if not path.is_dir():
            return []
        return sorted(p.name for p in path.iterdir() if not (p.name.startswith(".") and p.name.endswith(".tmp")))

    def zarr_store(self, url: str, *, read_only: bool) -> Store:
        """A ``LocalStore``; its folder is created unless ``read_only``."""
        from zarr.storage import LocalStore

        path = _local_path(url)
        if not read_only:
            path.mkdir(parents=True, exist_ok=True)
        return LocalStore(path, read_only=read_only)


class S3Storage:
    """``s3://bucket/key`` URLs through s3fs, with ``options`` as made by ``_s3_options()`` (hashable);
    the filesystems are shared by every instance with the same options."""

    def __init__(self, options: tuple[tuple[str, Any], ...]) -> None:
        self.options = options

    @property
    def fs(self) -> Any:
        """The synchronous s3fs filesystem (created on first use, cached per options)."""
        return _s3_fs(self.options)

    def normalize(self, url: str) -> str:
        return url.rstrip("/")

    def write_bytes(self, url: str, data: bytes) -> None:
        self.fs.pipe_file(_s3_path(url), data)

    def read_bytes(self, url: str) -> bytes:
        return bytes(self.fs.cat_file(_s3_path(url)))

    def open_file(self, url: str) -> BinaryIO:
        """Ranges are read on demand."""
        fs, path = self.fs, _s3_path(url)
        if not fs.isfile(path):
            raise IsADirectoryError(url) if fs.isdir(path) else FileNotFoundError(url)
        return fs.open(path, "rb")  # type: ignore[no-any-return]

    def exists(self, url: str) -> bool:
        return bool(self.fs.exists(_s3_path(url)))

    def delete_prefix(self, url: str) -> None:
        try:
            self.fs.rm(_s3_path(url), recursive=True)
        except FileNotFoundError:
            pass

    def list_names(self, url: str) -> list[str]:
        """Object names and sub-prefixes, from one listing request."""
        prefix = _s3_path(url)
        try:
            entries = self.fs.ls(prefix, detail=False)
        except FileNotFoundError:
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != prefix})

    def zarr_store(self, url: str, *, read_only: bool) -> Store:
        """An ``FsspecStore`` on the asynchronous s3fs filesystem (zarr's event loop)."""
        from zarr.storage import FsspecStore

        return FsspecStore(_s3_async_fs(self.options), path=_s3_path(url), read_only=read_only)


_LOCAL = LocalStorage()


def storage_for(url: str) -> Storage:
    """The storage behind ``url``: ``S3Storage`` for ``s3://`` and ``s3a://`` (options from the ``AWS_*``
    variables as they are now), ``LocalStorage`` for anything else."""
    if is_remote(url):
        return S3Storage(_s3_options())
    return _LOCAL


# -- the module-level API: one call per operation, the storage chosen from the URL ---------------------

def normalize(url: str) -> str:
    """Local paths made absolute (``file://`` dropped); ``s3://`` URLs returned unchanged."""
    return storage_for(url).normalize(url)


def write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` to ``url``, replacing what is there; local writes are atomic (rename)."""
    storage_for(url).write_bytes(url, data)


def read_bytes(url: str) -> bytes:
    """The whole object at ``url``; raises ``FileNotFoundError`` when absent."""
    return storage_for(url).read_bytes(url)


def open_file(url: str) -> BinaryIO:
    """``url`` opened for binary reading, seekable (S3 reads ranges on demand); raises
    ``FileNotFoundError`` when absent, ``IsADirectoryError`` for a local folder."""
    return storage_for(url).open_file(url)


def exists(url: str) -> bool:
    """True when ``url`` is an object/file or a non-empty prefix/directory."""
    return storage_for(url).exists(url)


def delete_prefix(url: str) -> None:
    """Remove ``url`` and everything under it; nothing there is not an error."""
    storage_for(url).delete_prefix(url)


def list_names(url: str) -> list[str]:
    """Sorted names directly under ``url`` (files and sub-prefixes); ``[]`` when nothing is there."""
    return storage_for(url).list_names(url)


def zarr_store(url: str, *, read_only: bool) -> Store:
    """A zarr v3 store rooted at ``url``: ``LocalStore`` for paths, ``FsspecStore`` for ``s3://``."""
    return storage_for(url).zarr_store(url, read_only=read_only)


def open_array(url: str, mode: str = "r") -> zarr.Array:
    """The zarr v3 array at ``url`` (``mode`` as in ``zarr.open_array``: "r", "r+", "a", "w")."""
    import zarr

    return zarr.open_array(store=zarr_store(url, read_only=mode == "r"), mode=mode)  # type: ignore[arg-type]


def open_group(url: str, mode: str = "r") -> zarr.Group:
    """The zarr v3 group at ``url``; its consolidated metadata used when present."""
    import zarr

    return zarr.open_group(store=zarr_store(url, read_only=mode == "r"), mode=mode)  # type: ignore[arg-type]


def open_result_node(url: str) -> zarr.Group | zarr.Array:
    """What lies at a result's ``url`` (``result.uri``), read-only: its group, or an array (results stored
    before the group layout, ``{job}/jacobian.zarr``)."""
    import zarr

    return zarr.open(store=zarr_store(url, read_only=True), mode="r")


def result_array(node: zarr.Group | zarr.Array, name: str | None = None) -> zarr.Array:
    """The array ``name`` of a result group (default: its main array, ``layout.main_array``: ``values`` of a
    sparse result, the kind's ``MAIN_ARRAYS``, else ``jacobian``); an array ``node`` as it is."""
    import zarr

    from contracts.layout import main_array

    if not isinstance(node, zarr.Group):
        return node
    return node[name or main_array(node.attrs.get("kind"), node.attrs.get("format"))]


def open_result(url: str, name: str | None = None) -> zarr.Array:
    """A result's array ``name`` (default: its main array, ``result_array``), read-only, from its group at
    ``url`` (``result.uri``); an array at ``url`` itself (results stored before the group layout,
    ``{job}/jacobian.zarr``) is returned as it is."""
    return result_array(open_result_node(url), name)
