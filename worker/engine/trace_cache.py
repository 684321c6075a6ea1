"""Traced functions kept across processes: the graph of a compiled matrix-free product or dense chunk function
(``strategies.keep_trace``), not a SavedModel.

A new process spends most of a large model's first JVP on Python tracing (MobileNetV3Small's tiled forward-mode
JVP: 3.1 s of trace, then 2.1 s of TensorFlow's own first-call work that no cache can keep). ``store`` writes the
traced function's ``GraphDef`` (its function library included) and, by name, what it captured: the model's
variables (``LoadedModel.variables``; their values are never copied, the new process binds its own) and small
constants. ``load`` imports that graph into a ``wrap_function`` bound to the variables of the model loaded in
this process: 0.3 s instead of the trace. (A SavedModel of the functions was measured before and did not pay:
saving it copies the variables, and loading re-traces its restored functions.)

Files live beside the route choices (``<cache_dir>/operators/``), keyed by the model's fingerprint, the request
(a product's key, a chunk function's ``ChunkKey``), the input shapes, the TensorFlow version and a digest of the
engine's source (``code_digest``); anything unreadable, of another model or not bindable is a miss (the
function is traced as before), and a graph whose captures are not all nameable is not stored.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from contracts.files import write_atomically

log = logging.getLogger(__name__)

MAX_CONSTANT_BYTES = 1 << 20     # a captured constant larger than this: the graph is not stored
MAX_GRAPH_BYTES = 256 << 20      # nor one whose GraphDef is larger
_STORED: set[str] = set()        # paths this process wrote or tried to: each function is stored once


@functools.cache
def code_digest() -> str:
    """A digest of the engine's source (``worker/engine/**.py``): a trace kept by other code (another release of
    the service, whose traced bodies may differ) is a miss, never loaded."""
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def loaded(fn: Any) -> bool:
    """Whether ``fn`` was loaded from a kept trace (``load``), not traced in this process."""
    return bool(getattr(fn, "graph_from_cache", False))


def keep(cache_dir: str | None, key: Any, fn: Any | None, variables: dict[str, Any]) -> bool:
    """``store`` of a function traced in this process; nothing for none, or for one loaded from a kept trace."""
    return fn is not None and key is not None and not loaded(fn) and store(cache_dir, key, fn, variables)


def has(cache_dir: str, key: Any) -> bool:
    """Whether ``cache_dir`` holds a trace stored under ``key`` (``load`` may still find it unusable)."""
    return _path(cache_dir, key).is_file()


def input_shapes(inputs: dict[str, Any]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The request's input shapes by name, as keys of kept traces and start vectors hold them."""
    return tuple(sorted((n, tuple(t.shape.as_list())) for n, t in inputs.items()))


def _path(cache_dir: str, key: Any) -> Path:
    import tensorflow as tf

    digest = hashlib.sha256(repr((key, tf.__version__)).encode()).hexdigest()[:32]
    return Path(cache_dir) / "operators" / f"{digest}.graph.npz"


def store(cache_dir: str | None, key: Any, fn: Any, variables: dict[str, Any]) -> bool:
    """Write ``fn``'s concrete function (a ``tf.function`` with an input signature) under ``key``, once per
    process; False (and nothing written) when it cannot be kept or was already."""
    path = _path(cache_dir, key) if cache_dir else None
    if path is None or str(path) in _STORED:
        return False
    _STORED.add(str(path))
    try:
        concrete = fn.get_concrete_function()
    except Exception:  # noqa: BLE001 - not a traced tf.function: nothing to keep
        return False
    graph = concrete.graph
    names = {id(v.handle): n for n, v in variables.items()}
    internal = {id(t) for t in graph.internal_captures}
    captures: list[tuple[str, str]] = []
    constants: dict[str, np.ndarray] = {}
    for external, placeholder in zip(concrete.captured_inputs, graph.internal_captures):
        if external.dtype.name == "resource":
            name = names.get(id(external))
            if name is None:
                return False
            captures.append((placeholder.name, "variable:" + name))
        else:
            value = np.asarray(external)
            if value.nbytes > MAX_CONSTANT_BYTES:
                return False
            constants[f"c{len(constants)}"] = value
            captures.append((placeholder.name, f"constant:c{len(constants) - 1}"))
    arguments = [t.name for t in graph.inputs if id(t) not in internal]
    definition = graph.as_graph_def().SerializeToString()
    if len(definition) > MAX_GRAPH_BYTES:
        return False
    buf = io.BytesIO()
    np.savez(buf, graph=np.frombuffer(definition, np.uint8), key=np.array(repr(key)),
             arguments=np.array(arguments), outputs=np.array([t.name for t in graph.outputs]),
             captures=np.array(captures, dtype=str).reshape(-1, 2),
             specs=np.array([f"{t.dtype.name}|{t.shape.as_list() if t.shape.rank is not None else None}"
                             for t in graph.inputs if id(t) not in internal]), **constants)
    try:
        write_atomically(path, buf.getvalue())
    except OSError as err:   # a full or read-only disk: the next process traces again
        log.warning("trace cache %s is not writable (%s)", cache_dir, err)
        return False
    return True


def load(cache_dir: str | None, key: Any, variables: dict[str, Any]) -> Any | None:
    """The function stored under ``key``, bound to ``variables``, called as the traced one was (``fn(*args)``
    with its structured arguments); None on a miss."""
    if not cache_dir:
        return None
    path = _path(cache_dir, key)
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            if str(data["key"]) != repr(key):
                return None
            stored = {k: data[k] for k in data.files}
        return _bind(stored, variables)
    except Exception as err:  # noqa: BLE001 - a damaged or foreign file is a miss: trace again
        log.warning("trace cache %s not used (%s): tracing again", path.name, err)
        try:
            os.unlink(path)
        except OSError:
            pass
        return None


def _bind(stored: dict[str, Any], variables: dict[str, Any]) -> Any:
    import ast

    import tensorflow as tf

    # tf.compat.v1's GraphDef, get_default_graph and wrap_function, without running tf.compat (tf_import)
    from tensorflow.core.framework.graph_pb2 import GraphDef
    from tensorflow.python.eager.wrap_function import wrap_function
    from tensorflow.python.framework.ops import get_default_graph

    definition = GraphDef()
    definition.ParseFromString(stored["graph"].tobytes())
    arguments = [str(a) for a in stored["arguments"]]
    outputs = [str(o) for o in stored["outputs"]]
    specs = []
    for spec in stored["specs"]:
        dtype, shape = str(spec).split("|")
        specs.append(tf.TensorSpec(ast.literal_eval(shape), tf.as_dtype(dtype)))
    captures = [(str(p), str(w)) for p, w in stored["captures"]]
    for _, what in captures:
        if what.startswith("variable:") and what[len("variable:"):] not in variables:
            raise KeyError(f"the model has no variable {what[len('variable:'):]!r}")

    def imported(*args: Any) -> Any:
        graph = get_default_graph()
        mapping = dict(zip(arguments, args))
        for placeholder, what in captures:
            source, name = what.split(":", 1)
            mapping[placeholder] = (graph.capture(variables[name].handle) if source == "variable"
                                    else tf.constant(stored[name]))
        return tf.graph_util.import_graph_def(definition, input_map=mapping, return_elements=outputs)

    wrapped = wrap_function(imported, specs)

    def call(*structured: Any) -> Any:
        return wrapped(*tf.nest.flatten(structured, expand_composites=True))[0]

    call.graph_from_cache = True   # type: ignore[attr-defined]
    return call


def _subspace_path(op: Any, kind: str) -> Path | None:
    if not getattr(op, "trace_dir", None) or not op.model.fingerprint:
        return None
    shapes = input_shapes(op.inputs)
    key = ("subspace", kind, op.model.fingerprint, op.model.signature, op.of, op.axis.names, op.reduce,
           op.compute_dtype, shapes)
    return Path(op.trace_dir) / "operators" / (hashlib.sha256(repr(key).encode()).hexdigest()[:32] + ".start.npy")


def start_vectors(op: Any, kind: str, size: int) -> np.ndarray | None:
    """The converged vectors (rows of length ``size``) of the last ``kind`` run on the same model, ``of``,
    ``wrt`` and input shapes (any input values): a warm start for the next; None when there are none."""
    path = _subspace_path(op, kind)
    if path is None or not path.is_file():
        return None
    try:
        rows = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        log.warning("start vectors %s not used (%s)", path.name, err)
        return None
    return rows if rows.ndim == 2 and rows.shape[1] == size and np.isfinite(rows).all() else None


def keep_start_vectors(op: Any, kind: str, rows: np.ndarray) -> None:
    """Keep ``rows`` (converged vectors of a ``kind`` run) for ``start_vectors``."""
    path = _subspace_path(op, kind)
    if path is None:
        return
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(rows))
    try:
        write_atomically(path, buf.getvalue())
    except OSError as err:
        log.warning("start vectors not kept (%s)", err)
