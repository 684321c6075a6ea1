"""Process-wide LRU cache of loaded models, keyed by (resolved path, signature, saved_model.pb or .keras file mtime,
origin); each model's graph (a .keras file: its config, ``contracts.keras_file``) is scanned before it is loaded. A
model under an S3 root is first made local by ``worker.model_download`` (``get_job_model``); its ``origin`` (the
``s3://`` URL) is what the operator's settings per root apply to."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_MAX_MODELS = 4


def _default_loader(path: str, signature: str, origin: str | None) -> Any:
    from worker.engine import load_model

    return load_model(path, signature, origin=origin)


def scan_model(path: str, origin: str | None = None) -> None:
    """Refuse the SavedModel at ``path`` if its graph holds an op outside the allowlist and outside the
    operator's ``model_op_allow`` for its root (``contracts.graph_scan.ModelRefused``; the root of ``origin``
    when ``path`` is a local copy), read from the settings at each call. A ``saved_model.pbtxt`` without a
    ``saved_model.pb`` is refused (``SavedModelError``): the scan reads only the binary form."""
    from contracts.graph_scan import scan_saved_model
    from contracts.keras_file import is_keras_file, scan_keras_file
    from contracts.settings import get_settings

    if is_keras_file(path) and Path(path).is_file():
        settings = get_settings()
        scan_keras_file(path, custom_objects=settings.keras_custom_objects,
                        unsafe_roots=settings.keras_unsafe_roots, field="model.path", origin=origin)
        return
    if not any((Path(path) / name).exists() for name in ("saved_model.pb", "saved_model.pbtxt")):
        return  # nothing TensorFlow could load either: the loader names what is missing
    settings = get_settings()
    scan_saved_model(path, op_allow=settings.model_op_allow, roots=settings.model_roots, field="model.path",
                     origin=origin)


class ModelCache:
    """Keeps up to ``max_models`` loaded models; a model replaced on disk (new mtime) is scanned and loaded again.

    Loading may raise what ``scan`` raises (``ModelRefused``, ``SavedModelError``), then whatever
    ``worker.engine.load_model`` raises (``EngineError``, ``OSError``); a refused model is never loaded.
    """

    def __init__(self, *, max_models: int = DEFAULT_MAX_MODELS,
                 loader: Callable[[str, str, str | None], Any] = _default_loader,
                 scan: Callable[[str, str | None], None] | None = scan_model) -> None:
        self.max_models = max(1, max_models)
        self.loader = loader
        self.scan = scan
        self._models: OrderedDict[tuple[str, str, int, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(path: str, signature: str, origin: str | None = None) -> tuple[str, str, int, str]:
        resolved = Path(path).expanduser().resolve()
        pb = resolved if resolved.is_file() else resolved / "saved_model.pb"   # a .keras file, or a SavedModel
        mtime_ns = pb.stat().st_mtime_ns if pb.exists() else 0
        return (str(resolved), signature, mtime_ns, origin or "")

    def get(self, path: str, signature: str = "serving_default", *, origin: str | None = None) -> Any:
        """The loaded model for ``(path, signature)``, loading it on a miss (evicting the oldest); ``origin``: the
        URL ``path`` is a local copy of (the model's root and its settings are that URL's)."""
        key = self.key(path, signature, origin)
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            if self.scan is not None:
                self.scan(key[0], origin)
            model = self.loader(key[0], signature, origin)
            self._models[key] = model
            while len(self._models) > self.max_models:
                self._models.popitem(last=False)
            return model

    def clear(self) -> None:
        with self._lock:
            self._models.clear()

    def __len__(self) -> int:
        return len(self._models)


_cache: ModelCache | None = None


def get_model_cache() -> ModelCache:
    """The process-wide cache (outlives jobs in a ``SimpleWorker``), of ``Settings.model_cache_size`` models."""
    global _cache
    if _cache is None:
        from contracts.settings import get_settings

        _cache = ModelCache(max_models=get_settings().model_cache_size)
    return _cache


def get_model(path: str, signature: str = "serving_default", *, origin: str | None = None) -> Any:
    """Shortcut for ``get_model_cache().get(path, signature, origin=origin)``."""
    return get_model_cache().get(path, signature, origin=origin)


def get_job_model(path: str, signature: str, settings: Any) -> Any:
    """The loaded model of a job's ``model.path``, checked under ``settings.model_roots``
    (``worker.inputs.check_model_path``); under an S3 root, from this worker's local copy of its current bytes
    (``worker.model_download``: listed at every call, so a model changed in the bucket is downloaded and scanned
    again), scanned with the URL's settings."""
    from contracts import storage
    from worker.inputs import check_model_path

    checked = check_model_path(path, settings.model_roots)
    if not storage.is_remote(checked):
        return get_model(checked, signature)
    from worker.model_download import model_downloads

    with model_downloads(settings).local(checked) as local:
        return get_model(local, signature, origin=checked)
