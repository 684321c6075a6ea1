"""TensorFlow's import without what a SavedModel's Jacobian does not use: Keras, JAX, and the public API's
namespaces until they are first used.

``import tensorflow`` (2.21) ends with ``import keras.src.optimizers`` (so that tf_keras's optimizers register
with the SavedModel loader; Keras 3 registers nothing there), which imports all of Keras 3, and
``tensorflow.lite.python.util`` tries ``from jax import jit`` wherever JAX is installed. Both are guarded by
``except ImportError`` in TensorFlow. On the CI VM they are 0.8 s of a 2.4 s import and 170 MiB of a process's
peak RSS once MobileNetV3Small is loaded (``python -m bench.bench_tf_import``), paid by every ``jacobian compute``
and every worker, where a SavedModel needs neither. While TensorFlow's own module is being initialised, the finder
installed here answers an import of ``keras`` or ``jax`` with a spec whose loader raises ImportError (the spec's
origin is the real one, since TensorFlow reads Keras's folder from it), so TensorFlow goes on without them; once
TensorFlow is imported a later ``import keras`` (a ``.keras`` model, ``tf.keras``) or ``import jax`` is an
ordinary import. Where either was imported before TensorFlow, nothing changes. ``tf_keras``
(``TF_USE_LEGACY_KERAS=1``) is left alone: its registrations matter to the loader.

The rest of the import is the public API's namespaces, ``tensorflow._api.v2.*`` (``tf.linalg``, ``tf.compat.v1``,
``tf.__internal__``, ...): each imports the modules behind its names, among them ``tf.distribute``'s test
combinations, ``tf.data``'s service, feature columns and TensorFlow's own copy of Keras 2, none of which a SavedModel
needs. While TensorFlow initialises, the same finder makes each of these namespaces lazy: the module object exists,
and its code runs when one of its attributes is first read (``tf.linalg.matmul`` runs ``tf.linalg``'s), under a lock
that another thread reading it meanwhile waits on. On the 2-core EPYC a process that imports
TensorFlow and loads a small model took 0.65 s and 96 MiB less (``python -m bench.bench_tf_import``: ``engine``
against ``eager_api``); a process that never reads ``tf.compat`` never imports the v1 API (1,200 modules, 0.6 s).
What a SavedModel's load and its derivatives read from TensorFlow's registries (gradients, type specs, the loader's
revived types, pfor's converters, the structure coder's codecs) is then a full import's but for
``SKIPPED_REGISTRATIONS`` (``tests/engine/test_tf_import.py`` compares them; what only tools read stays unregistered
until its namespace runs: the profiler's flops statistics, TensorFlow's own Keras 2 dispatchers, a TPU checkpoint
saver); ``complete()`` runs every namespace left, and the model loader
calls it for a SavedModel that names one of them, or whose load failed with namespaces left (then loads it again).
``JACOBIAN_TF_EAGER_API=1`` turns the lazy namespaces off. The finder also hands back the pages of shared libraries
that only their loading read (``library_pages``): those of the libraries loaded so far as TensorFlow's import starts,
so that they are not resident under the peak that loading TensorFlow's own makes (16 MiB of it in a ``jacobian
compute`` process), and TensorFlow's at the first import after they are loaded (``NATIVE``), before its Python
modules are imported on top of them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types
from typing import Any

from worker.engine import library_pages  # imported here, not under the import lock that find_spec runs in

DEFERRED = ("keras", "jax")
API = "tensorflow._api.v2."
NATIVE = "tensorflow.python._pywrap_tensorflow_internal"   # its import loads libtensorflow_cc and _framework
# Registrations made only by modules that no namespace run during the import or the load imports (TensorFlow 2.21):
# a revived type (TensorFlow's Keras 2 optimizer, in SavedModels that kept one) and the gradients of tfdbg's and the
# audio microfrontend's ops. ``complete()`` makes them, and ``load_model`` calls it where a SavedModel names one.
SKIPPED_REGISTRATIONS = ("tf_deprecated_optimizer", "DebugGradientIdentity", "DebugGradientRefIdentity",
                         "DebugIdentityV2", "AudioMicrofrontend")
_LOCK = threading.RLock()
_RUNNING = threading.local()   # .ids: the namespaces this thread is running (it holds _LOCK meanwhile)


class _Refused(importlib.abc.Loader):
    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        raise ImportError(f"{module.__name__} is not imported while TensorFlow is (worker/engine/tf_import.py)")


# What a namespace holds before its code runs (set from its spec): reading these does not run it, so a scan of
# ``sys.modules`` for files (``inspect.getmodule``, AutoGraph's source lookup on a loop model's cold trace) or the
# import of a sub-namespace leaves it lazy.
_BEFORE_RUN = frozenset({"__name__", "__file__", "__spec__", "__path__", "__loader__", "__package__", "__cached__",
                         "__class__"})


class _LazyNamespace(types.ModuleType):
    """A namespace of TensorFlow's API whose code has not run yet: reading any name but ``_BEFORE_RUN``'s runs it,
    once, under a lock that another thread reading it meanwhile waits on (the thread running it reads it as it is
    made)."""

    def __getattribute__(self, attr: str) -> Any:
        if attr not in _BEFORE_RUN:
            with _LOCK:
                if type(self) is _LazyNamespace and id(self) not in _running():
                    _run(self)
        return types.ModuleType.__getattribute__(self, attr)

    def __delattr__(self, attr: str) -> None:
        self.__dict__   # noqa: B018 - runs the namespace first
        types.ModuleType.__delattr__(self, attr)


def _run(module: types.ModuleType) -> None:
    """Run a lazy namespace's code, keeping what was set on it meanwhile (its sub-namespaces, bound by the import),
    with Keras and JAX deferred as during TensorFlow's import (``tf.lite``'s namespace would import JAX). A run that
    raises (an interrupt, a failed import) leaves the namespace lazy as it was, so the next read runs it again."""
    spec = types.ModuleType.__getattribute__(module, "__spec__")
    before = spec.loader_state
    namespace = types.ModuleType.__getattribute__(module, "__dict__")
    kept = {k: v for k, v in namespace.items() if k not in before or before[k] is not v}
    _running().add(id(module))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        namespace.clear()
        namespace.update(before)
        namespace.update(kept)
        raise
    else:
        spec.loader_state = None
        module.__class__ = types.ModuleType
        namespace.update(kept)
    finally:
        _running().discard(id(module))


def _running() -> set[int]:
    if not hasattr(_RUNNING, "ids"):
        _RUNNING.ids = set()
    return _RUNNING.ids


class _Lazy(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__spec__.loader = module.__loader__ = self.loader
        module.__spec__.loader_state = dict(module.__dict__)
        module.__class__ = _LazyNamespace


def _tensorflow_initialising() -> bool:
    tf = sys.modules.get("tensorflow")
    return tf is not None and bool(getattr(getattr(tf, "__spec__", None), "_initializing", False))


class _DeferWhileTensorFlowImports(importlib.abc.MetaPathFinder):
    lazy_api = True
    pages_released: tuple[bool, bool] = (False, False)   # (as TensorFlow's import starts, once its libraries are in)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        before, native = self.pages_released
        if (not before and name == "tensorflow") or (not native and NATIVE in sys.modules):
            self.pages_released = (True, NATIVE in sys.modules)   # first: an import in release() comes back here
            library_pages.release()   # pages that only loading libraries read (``library_pages``)
        deferred = name in DEFERRED
        if deferred:
            if not _tensorflow_initialising() and not _running():
                return None   # an ordinary import
        elif not (self.lazy_api and name.startswith(API) and _tensorflow_initialising()):
            return None
        elif "." not in name[len(API):]:
            _import_package_of_the_same_name(name[len(API):])
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Refused() if deferred else _Lazy(spec.loader)
        return spec


# Modules that reach a real package through ``tf.<name>`` (``import tensorflow.distribute.experimental.rpc.kernels.
# gen_rpc_ops as ...`` reads the attributes ``tensorflow.distribute``, ``.experimental``, ...), which is that
# package only until ``tensorflow/__init__`` binds the namespace of the same name: imported then, as a full import
# does (46 ms). ``tests/engine/test_tf_import.py`` looks for others in TensorFlow's sources.
READ_THROUGH_PACKAGE = {"distribute": ("tensorflow.python.distribute.experimental.rpc.rpc_ops",)}


def _import_package_of_the_same_name(short: str) -> None:
    """Import ``tensorflow.<short>`` where TensorFlow has a real package of a namespace's name (``distribute``,
    ``lite``: empty ``__init__``s) before ``tensorflow/__init__`` binds the namespace as ``tf.<short>``, as a full
    import does (a first import later would bind the package over the namespace), and what reads through it."""
    import importlib
    import importlib.util

    if importlib.util.find_spec(f"tensorflow.{short}") is not None:
        importlib.import_module(f"tensorflow.{short}")
        for name in READ_THROUGH_PACKAGE.get(short, ()):
            importlib.import_module(name)


_FINDER = _DeferWhileTensorFlowImports()


def install() -> None:
    """Defer Keras, JAX and the API's namespaces in this process's TensorFlow import, unless TensorFlow is
    imported already."""
    _FINDER.lazy_api = os.environ.get("JACOBIAN_TF_EAGER_API", "") not in ("1", "true")
    if "tensorflow" not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def lazy_left() -> list[str]:
    """The API namespaces whose code has not run yet (nor is running in this thread; another thread's run holds
    _LOCK, which a read of one waits on)."""
    return sorted(name for name, module in list(sys.modules.items())
                  if name.startswith(API) and type(module) is _LazyNamespace and id(module) not in _running())


def complete() -> None:
    """Run every API namespace left lazy, as a full ``import tensorflow`` would have (its registrations with it)."""
    while left := lazy_left():
        for name in left:
            sys.modules[name].__dict__   # noqa: B018 - any name but _BEFORE_RUN's runs it


def import_for_loading() -> None:
    """Import what registers a SavedModel signature's type specs outside the namespaces the loader runs:
    ``tf.linalg``'s ``LinearOperator``s (13 ms)."""
    import tensorflow.python.ops.linalg.linalg  # noqa: F401


def names_a_skipped_registration(saved_model_dir: str) -> bool:
    """Whether the SavedModel's ``saved_model.pb`` names one of ``SKIPPED_REGISTRATIONS`` (a byte search: a name
    that only looks like one costs a ``complete()``, nothing else)."""
    import mmap

    try:
        with open(os.path.join(saved_model_dir, "saved_model.pb"), "rb") as fh, \
                mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return any(data.find(name.encode()) >= 0 for name in SKIPPED_REGISTRATIONS)
    except (OSError, ValueError):   # no such file, or an empty one: the loader says what is wrong
        return False
