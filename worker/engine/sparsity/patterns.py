"""Where a job's sparsity pattern comes from (``sparsity`` option), and the cache of detected ones.

- ``"auto"``: ``walk.detect``, cached with its colouring in the local cache folder (``JACOBIAN_CACHE_DIR``,
  ``sparsity/<key>.npz``) and, in the service, in Redis for every worker (``SharedBlobs``), keyed by the
  model fingerprint, signature, ``of``, ``wrt``, the inputs' shapes and
  dtypes and a hash of the other inputs' values (they may steer gathers);
- ``{"pattern_uri": url}``: an ``.npz`` with int arrays ``rows`` and ``cols`` (flat indices of J as the 2-d
  ``(n_of, n_wrt)`` matrix);
- ``{"pattern_from": job id}``: the entries of an earlier result of the same shape (its ``rows``/``cols``, or
  the non-zeros of its dense ``jacobian``), read by the caller (``worker.sparse_job``).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from worker.engine.errors import InvalidRequest
from worker.engine.sparsity.colouring import Colouring

log = logging.getLogger(__name__)

FORMAT = 4   # of the cached files: bumped when detection changes what it finds


class CachedPattern(NamedTuple):
    """A detected pattern as cached: the pattern, ``of``'s shape, its colouring (or None) and the ops that got
    the conservative rule (type -> one op's name)."""

    pattern: Any
    of_shape: tuple[int, ...]
    colouring: Colouring | None
    no_rule: dict[str, str]


def from_entries(rows: Any, cols: Any, shape: tuple[int, int], *, field: str) -> Any:
    """A boolean CSR pattern from flat ``rows``/``cols``; raises InvalidRequest naming ``field`` when they do not
    fit ``shape``."""
    import scipy.sparse as sp

    rows, cols = np.asarray(rows).ravel(), np.asarray(cols).ravel()
    if rows.shape != cols.shape or not np.issubdtype(rows.dtype, np.integer) \
            or not np.issubdtype(cols.dtype, np.integer):
        raise InvalidRequest(f"{field}: rows and cols must be integer arrays of one length, got {rows.dtype}"
                             f"{list(rows.shape)} and {cols.dtype}{list(cols.shape)}", field=field)
    if rows.size and (rows.min() < 0 or rows.max() >= shape[0] or cols.min() < 0 or cols.max() >= shape[1]):
        raise InvalidRequest(f"{field}: entries outside the Jacobian's {shape[0]} x {shape[1]} (rows index the "
                             "flattened of, cols the flattened wrt)", field=field)
    data = np.ones(rows.size, bool)
    pattern = sp.csr_array((data, (rows.astype(np.int64), cols.astype(np.int64))), shape=shape)
    pattern.sum_duplicates()
    return pattern


def read_npz(raw: bytes, shape: tuple[int, int], *, field: str) -> Any:
    """The pattern of an uploaded ``.npz`` (``rows``, ``cols``)."""
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
            if "rows" not in npz or "cols" not in npz:
                raise InvalidRequest(f"{field}: the .npz needs arrays 'rows' and 'cols' (flat indices), it has "
                                     f"{', '.join(npz.files) or 'none'}", field=field)
            return from_entries(npz["rows"], npz["cols"], shape, field=field)
    except InvalidRequest:
        raise
    except Exception as err:  # noqa: BLE001 - not an .npz numpy can read
        raise InvalidRequest(f"{field}: not a readable .npz ({type(err).__name__}); save it with "
                             "numpy.savez(f, rows=..., cols=...)", field=field) from err


def cache_key(model: Any, inputs: dict[str, Any], *, of: str, wrt: str) -> str:
    """The detected pattern's key: model, signature, of, wrt, input shapes and dtypes, other inputs' values."""
    import tensorflow as tf

    h = hashlib.sha256()
    h.update(json.dumps([FORMAT, tf.__version__, model.fingerprint, model.path if not model.fingerprint else "",
                         model.signature, of, wrt]).encode())
    for name in sorted(inputs):
        value = np.asarray(inputs[name])
        h.update(f"|{name}:{value.dtype.str}:{value.shape}".encode())
        if name != wrt:
            h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()[:40]


SHARED_MAX_BYTES = 64 << 20   # larger patterns stay in the worker's own folder


class SharedBlobs(Protocol):
    """A cache shared by the service's workers (``worker.plan_store.RedisBlobs``): bytes by key."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes) -> None: ...


def encode(pattern: Any, of_shape: tuple[int, ...], colouring: Colouring | None,
           no_rule: dict[str, str] | None = None) -> bytes:
    """A pattern (CSR indices), ``of``'s shape, the colouring and the ops without a rule as a compressed ``.npz``."""
    extra: dict[str, Any] = {"no_rule": np.str_(json.dumps(no_rule or {}))}
    if colouring is not None:
        extra = {"colours": colouring.colours, "mode": np.str_(colouring.mode), "count": colouring.count}
    buf = io.BytesIO()
    np.savez_compressed(buf, indptr=pattern.indptr, indices=pattern.indices, shape=np.asarray(pattern.shape),
                        of_shape=np.asarray(of_shape, np.int64), **extra)
    return buf.getvalue()


def decode(raw: bytes) -> CachedPattern:
    import scipy.sparse as sp

    with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
        pattern = sp.csr_array((np.ones(len(npz["indices"]), bool), npz["indices"], npz["indptr"]),
                               shape=tuple(int(d) for d in npz["shape"]))
        of_shape = tuple(int(d) for d in npz["of_shape"])
        colouring = None
        if "colours" in npz.files:
            colouring = Colouring(str(npz["mode"]), npz["colours"], int(npz["count"]))
        no_rule = json.loads(str(npz["no_rule"])) if "no_rule" in npz.files else {}
    return CachedPattern(pattern, of_shape, colouring, no_rule)


class PatternCache:
    """Detected patterns and their colourings: ``.npz`` files in ``root/sparsity`` (None: no folder), and in
    ``shared`` (Redis, for every worker of the service) when at most ``SHARED_MAX_BYTES`` compressed."""

    def __init__(self, root: str | os.PathLike[str] | None, shared: SharedBlobs | None = None) -> None:
        self.root = None if root is None else Path(root) / "sparsity"
        self.shared = shared

    def get(self, key: str) -> CachedPattern | None:
        """The cached pattern or None: the folder first, then the shared cache (whose hit is kept in the
        folder)."""
        raw = None
        if self.root is not None:
            try:
                raw = (self.root / f"{key}.npz").read_bytes()
            except OSError:
                raw = None
        from_shared = False
        if raw is None and self.shared is not None:
            try:
                raw, from_shared = self.shared.get(key), True
            except Exception as err:  # noqa: BLE001 - the shared cache is an optimisation
                log.warning("sparsity cache: the shared cache failed (%s)", err)
        if raw is None:
            return None
        try:
            hit = decode(raw)
        except Exception as err:  # noqa: BLE001 - a damaged entry is a miss, and is replaced
            log.warning("sparsity cache %s unreadable (%s): detecting again", key, err)
            return None
        if from_shared:
            self._write(key, raw)
        return hit

    def put(self, key: str, pattern: Any, of_shape: tuple[int, ...], colouring: Colouring | None,
            no_rule: dict[str, str] | None = None) -> None:
        raw = encode(pattern, of_shape, colouring, no_rule)
        self._write(key, raw)
        if self.shared is not None and len(raw) <= SHARED_MAX_BYTES:
            try:
                self.shared.put(key, raw)
            except Exception as err:  # noqa: BLE001 - the shared cache is an optimisation
                log.warning("sparsity cache: the shared cache failed (%s)", err)

    def _write(self, key: str, raw: bytes) -> None:
        if self.root is None:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".{key}.{os.getpid()}.npz"
            tmp.write_bytes(raw)
            os.replace(tmp, self.root / f"{key}.npz")
        except OSError as err:
            log.warning("sparsity cache %s not written: %s", self.root, err)
