"""The precision guard's float64 rows of a dense kind, kept across processes (``precision._dense``).

A dense estimate's float64 side (``probes()`` one-hot VJPs or HVPs of the float64 copy) depends only on the model's
content, the request, the probes' seed and the inputs: a later job with all of them equal (a request run again, the
``jacobian compute`` of a script or cron) reads them here instead of loading the copy's kept traces and running them
(0.3-0.5 s of a 4 s transformer process). Files live in ``<cache_dir>/references/``, one ``.npz`` per key (a
digest of all of the above and of the engine's source, ``trace_cache.code_digest``); anything unreadable or of
another shape is a miss, and a folder that cannot be written is logged and left. A worker sees new inputs in
every job: the folder keeps the ``MAX_FILES`` most recently used files within ``MAX_BYTES`` (the oldest are
removed when one is stored), and rows larger than ``MAX_ROWS_BYTES`` are not kept.
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

from contracts.files import write_atomically
from contracts.npz import update_digest

log = logging.getLogger(__name__)

MAX_FILES = 64
MAX_BYTES = 256 << 20
MAX_ROWS_BYTES = 16 << 20   # MobileNetV3Small's 3 rows: 3.6 MB


def key(fingerprint: str, signature: str, request: dict[str, Any], product: str, probes: int, seed: int,
        inputs: dict[str, Any]) -> str:
    """A digest of everything the float64 rows depend on (the inputs by dtype, shape and bytes)."""
    from worker.engine.trace_cache import code_digest

    digest = hashlib.sha256(json.dumps([code_digest(), fingerprint, signature, request, product, probes, seed],
                                       sort_keys=True, default=str).encode())
    update_digest(digest, inputs)
    return digest.hexdigest()[:32]


def _path(cache_dir: str, name: str) -> Path:
    return Path(cache_dir) / "references" / f"{name}.npz"


def load(cache_dir: str | None, name: str | None) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]] | None:
    """``(picked, want, lead)`` kept under ``name``, or None."""
    if not cache_dir or not name:
        return None
    try:
        with np.load(_path(cache_dir, name), allow_pickle=False) as kept:
            picked, want, lead = kept["picked"], kept["want"], tuple(int(d) for d in kept["lead"])
    except (OSError, KeyError, ValueError):
        return None
    if picked.ndim != 1 or want.ndim < 1 or len(want) != len(picked) or want.dtype != np.float64:
        return None
    try:
        os.utime(_path(cache_dir, name))   # recently used: the last to be removed
    except OSError:
        pass
    return picked, want, lead


def store(cache_dir: str | None, name: str | None, picked: np.ndarray, want: np.ndarray, lead: tuple) -> None:
    """Keep ``(picked, want, lead)`` under ``name`` (nothing without a cache folder or a key)."""
    if not cache_dir or not name or np.asarray(want).size * 8 > MAX_ROWS_BYTES:
        return
    buffer = io.BytesIO()
    np.savez(buffer, picked=np.asarray(picked), want=np.asarray(want, np.float64), lead=np.asarray(lead, np.int64))
    try:
        write_atomically(_path(cache_dir, name), buffer.getvalue())
    except OSError as err:
        log.warning("precision reference cache %s is not writable (%s)", cache_dir, err)
        return
    _prune(_path(cache_dir, name).parent)


def _prune(folder: Path) -> None:
    """Remove the least recently used files beyond ``MAX_FILES`` or ``MAX_BYTES`` (another process may be doing
    the same: a file gone already is fine)."""
    files = []
    for path in folder.glob("*.npz"):
        try:
            st = path.stat()
        except OSError:
            continue
        files.append((st.st_mtime, st.st_size, path))
    files.sort(reverse=True)   # newest first
    total = 0
    for i, (_, size, path) in enumerate(files):
        total += size
        if i >= MAX_FILES or total > MAX_BYTES:
            path.unlink(missing_ok=True)
