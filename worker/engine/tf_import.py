"""TensorFlow's import without the two packages it imports only in case they are wanted: Keras and JAX.

``import tensorflow`` (2.21) ends with ``import keras.src.optimizers`` (so that tf_keras's optimizers register
with the SavedModel loader; Keras 3 registers nothing there), which imports all of Keras 3, and
``tensorflow.lite.python.util`` tries ``from jax import jit`` wherever JAX is installed. Both are guarded by
``except ImportError`` in TensorFlow. On the CI VM they are 0.8 s of a 2.4 s import and 170 MiB of a process's
peak RSS once MobileNetV3Small is loaded (``python -m bench.bench_tf_import``), paid by every ``jacobian compute``
and every worker, where a SavedModel needs neither. While TensorFlow's own module is being initialised, the finder
installed here answers an import of ``keras`` or ``jax`` with a spec whose loader raises ImportError (the spec's
origin is the real one, since TensorFlow reads Keras's folder from it), so TensorFlow goes on without them; once
TensorFlow is imported the finder removes itself, and a later ``import keras`` (a ``.keras`` model, ``tf.keras``) or
``import jax`` is an ordinary import. Where either was imported before TensorFlow, nothing changes. ``tf_keras``
(``TF_USE_LEGACY_KERAS=1``) is left alone: its registrations matter to the loader.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

DEFERRED = ("keras", "jax")


class _Refused(importlib.abc.Loader):
    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        raise ImportError(f"{module.__name__} is not imported while TensorFlow is (worker/engine/tf_import.py)")


class _DeferWhileTensorFlowImports(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in DEFERRED:
            return None
        tf = sys.modules.get("tensorflow")
        if tf is None:
            return None   # TensorFlow's import has not begun: an ordinary import
        if not getattr(getattr(tf, "__spec__", None), "_initializing", False):
            remove()      # TensorFlow is imported: nothing more to defer
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _Refused()
        return spec


_FINDER = _DeferWhileTensorFlowImports()


def install() -> None:
    """Defer Keras and JAX in this process's TensorFlow import, unless TensorFlow is imported already."""
    if "tensorflow" not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def remove() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
