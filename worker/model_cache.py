"""Process-wide LRU cache of loaded models, keyed by (resolved path, signature, saved_model.pb or .keras file mtime);
each model's graph (a .keras file: its config, ``contracts.keras_file``) is scanned before it is loaded."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_MAX_MODELS = 4


def _default_loader(path: str, signature: str) -> Any:
    from worker.engine import load_model

    return load_model(path, signature)


def scan_model(path: str) -> None:
    """Refuse the SavedModel at ``path`` if its graph holds an op outside the allowlist and outside the
    operator's ``model_op_allow`` for its root (``contracts.graph_scan.ModelRefused``), read from the
    settings at each call. A ``saved_model.pbtxt`` without a ``saved_model.pb`` is refused
    (``SavedModelError``): the scan reads only the binary form."""
    from contracts.graph_scan import scan_saved_model
    from contracts.keras_file import is_keras_file, scan_keras_file
    from contracts.settings import get_settings

    if is_keras_file(path) and Path(path).is_file():
        settings = get_settings()
        scan_keras_file(path, custom_objects=settings.keras_custom_objects,
                        unsafe_roots=settings.keras_unsafe_roots, field="model.path")
        return
    if not any((Path(path) / name).exists() for name in ("saved_model.pb", "saved_model.pbtxt")):
        return  # nothing TensorFlow could load either: the loader names what is missing
    settings = get_settings()
    scan_saved_model(path, op_allow=settings.model_op_allow, roots=settings.model_roots, field="model.path")


class ModelCache:
    """Keeps up to ``max_models`` loaded models; a model replaced on disk (new mtime) is scanned and loaded again.

    Loading may raise what ``scan`` raises (``ModelRefused``, ``SavedModelError``), then whatever
    ``worker.engine.load_model`` raises (``EngineError``, ``OSError``); a refused model is never loaded.
    """

    def __init__(self, *, max_models: int = DEFAULT_MAX_MODELS,
                 loader: Callable[[str, str], Any] = _default_loader,
                 scan: Callable[[str], None] | None = scan_model) -> None:
        self.max_models = max(1, max_models)
        self.loader = loader
        self.scan = scan
        self._models: OrderedDict[tuple[str, str, int], Any] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(path: str, signature: str) -> tuple[str, str, int]:
        resolved = Path(path).expanduser().resolve()
        pb = resolved if resolved.is_file() else resolved / "saved_model.pb"   # a .keras file, or a SavedModel
        mtime_ns = pb.stat().st_mtime_ns if pb.exists() else 0
        return (str(resolved), signature, mtime_ns)

    def get(self, path: str, signature: str = "serving_default") -> Any:
        """The loaded model for ``(path, signature)``, loading it on a miss (evicting the oldest)."""
        key = self.key(path, signature)
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            if self.scan is not None:
                self.scan(key[0])
            model = self.loader(key[0], signature)
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


def get_model(path: str, signature: str = "serving_default") -> Any:
    """Shortcut for ``get_model_cache().get(path, signature)``."""
    return get_model_cache().get(path, signature)
