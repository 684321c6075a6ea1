"""Where a job's sparsity pattern comes from (``sparsity`` option), and the cache of detected ones.

- ``"auto"``: ``walk.detect``, cached with its colouring in the local cache folder (``JACOBIAN_CACHE_DIR``,
  ``sparsity/<key>.npz``), keyed by the model fingerprint, signature, ``of``, ``wrt``, the inputs' shapes and
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
from typing import Any

import numpy as np

from worker.engine.errors import InvalidRequest
from worker.engine.sparsity.colouring import Colouring

log = logging.getLogger(__name__)

FORMAT = 1   # of the cached files: bumped when detection changes what it finds


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
    h = hashlib.sha256()
    h.update(json.dumps([FORMAT, model.fingerprint, model.path if not model.fingerprint else "", model.signature,
                         of, wrt]).encode())
    for name in sorted(inputs):
        value = np.asarray(inputs[name])
        h.update(f"|{name}:{value.dtype.str}:{value.shape}".encode())
        if name != wrt:
            h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()[:40]


class PatternCache:
    """Detected patterns and their colourings as ``.npz`` files in ``root/sparsity`` (None: no cache)."""

    def __init__(self, root: str | os.PathLike[str] | None) -> None:
        self.root = None if root is None else Path(root) / "sparsity"

    def get(self, key: str) -> tuple[Any, tuple[int, ...], Colouring | None] | None:
        """``(pattern, of_shape, colouring or None)`` or None."""
        import scipy.sparse as sp

        if self.root is None:
            return None
        path = self.root / f"{key}.npz"
        try:
            with np.load(path, allow_pickle=False) as npz:
                pattern = sp.csr_array((np.ones(len(npz["indices"]), bool), npz["indices"], npz["indptr"]),
                                       shape=tuple(int(d) for d in npz["shape"]))
                of_shape = tuple(int(d) for d in npz["of_shape"])
                colouring = None
                if "colours" in npz.files:
                    colouring = Colouring(str(npz["mode"]), npz["colours"], int(npz["count"]))
        except FileNotFoundError:
            return None
        except Exception as err:  # noqa: BLE001 - a damaged cache file is a miss, and is replaced
            log.warning("sparsity cache %s unreadable (%s): detecting again", path, err)
            return None
        return pattern, of_shape, colouring

    def put(self, key: str, pattern: Any, of_shape: tuple[int, ...], colouring: Colouring | None) -> None:
        if self.root is None:
            return
        extra: dict[str, Any] = {}
        if colouring is not None:
            extra = {"colours": colouring.colours, "mode": np.str_(colouring.mode), "count": colouring.count}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".{key}.{os.getpid()}.npz"
            np.savez(tmp, indptr=pattern.indptr, indices=pattern.indices, shape=np.asarray(pattern.shape),
                     of_shape=np.asarray(of_shape, np.int64), **extra)
            os.replace(tmp, self.root / f"{key}.npz")
        except OSError as err:
            log.warning("sparsity cache %s not written: %s", self.root, err)
