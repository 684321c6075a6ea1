"""A loaded SavedModel signature: its inputs, outputs and variables, and a cache of compiled chunks."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts import rules
from contracts.plans import model_fingerprint as model_fingerprint  # re-exported: plans are keyed by it
from contracts.savedmodel import Shape, strip_variable_suffix, variable_names
from worker.engine import tf_import
from worker.engine.errors import InvalidRequest, NotDifferentiable

log = logging.getLogger(__name__)


def shape_tuple(shape: Any) -> Shape:
    """A ``tf.TensorShape`` or a tuple as ``contracts.rules``' shape: ``None`` dims, ``None`` for unknown rank."""
    if getattr(shape, "rank", 0) is None:
        return None
    dims = shape.as_list() if hasattr(shape, "as_list") else shape
    return tuple(None if d is None else int(d) for d in dims)


def _shape_list(shape: Any) -> list[int | None] | None:
    dims = shape_tuple(shape)
    return None if dims is None else list(dims)


class CompiledChunks:
    """This process's compiled chunk functions of one loaded model, one per ``ChunkKey`` (traced once).

    Compiled functions cannot leave the process; plans (``worker.engine.plan``) carry what can.
    """

    def __init__(self) -> None:
        self._fns: dict[Any, Any] = {}
        self._sizes: dict[Any, set[int]] = {}
        self.regret_s: dict[str, float] = {}   # per plan: time lost in this process by not compiling its best
        self.choices: dict[Any, dict[str, str]] = {}   # per matrix-free request: the route each product kind chose
        self.float64: Any = None   # the model's float64 copy, or why it has none (``worker.engine.float64``)
        self.inline: Any = None    # the signature's body to import into traces, or why not (``worker.engine.inline``)
        self._lock = threading.Lock()

    def sizes(self, key: Any) -> set[int]:
        """Chunk sizes already run with ``key`` (a new size pays a slower first call)."""
        return self._sizes.setdefault(key, set())

    def get(self, key: Any, build: Callable[[], Any]) -> Any:
        with self._lock:
            fn = self._fns.get(key)
            if fn is None:
                fn = self._fns[key] = build()
                self._sizes.pop(key, None)   # a new function: no size has run with it
            return fn

    def __contains__(self, key: Any) -> bool:
        return key in self._fns

    def __len__(self) -> int:
        return len(self._fns)

    def peek(self, key: Any) -> Any | None:
        """The function compiled for ``key``, or None (nothing is built)."""
        return self._fns.get(key)

    def tracing_counts(self) -> dict[Any, int]:
        """Traces made so far per key (1 for every function used: no retracing)."""
        return {k: int(fn.experimental_get_tracing_count()) for k, fn in self._fns.items()
                if hasattr(fn, "experimental_get_tracing_count")}


@dataclass
class LoadedModel:
    """``fn(**inputs) -> dict`` is the signature's concrete function; ``loaded`` keeps it alive.

    ``fingerprint`` hashes ``saved_model.pb`` and the variables index: plans are keyed by it.
    """

    path: str
    signature: str
    loaded: Any
    fn: Any
    input_specs: dict[str, Any]
    output_specs: dict[str, Any]
    variables: dict[str, Any]
    fingerprint: str = ""
    graph_ops: int = 0               # ops of the signature's graph and its functions: how costly pfor's trace is
    graph_loops: int = 0             # While ops among them: pfor fails on their second derivatives (tuning)
    graph_list_loops: int = 0        # those of them carrying TensorLists (Keras RNNs): and on their first too
    compiled: CompiledChunks = field(default_factory=CompiledChunks)
    shapes_of: LoadedModel | None = None   # a model whose outputs have this one's shapes (a float64 copy's original)

    def find_variable(self, name: str) -> tuple[str, Any]:
        """The variable called ``name`` and its full name (``contracts.rules.find_variable``: ``:0``
        optional; a unique suffix such as ``kernel`` of one layer works); raises InvalidRequest."""
        try:
            full = rules.find_variable(name, {n: rules.Spec(v.dtype.name, shape_tuple(v.shape))
                                              for n, v in self.variables.items()})
        except rules.RuleViolation as err:
            raise InvalidRequest(str(err), field=err.field) from None
        return full, self.variables[full]


def load_model(path: str, signature: str = "serving_default", *, origin: str | None = None) -> LoadedModel:
    """Load ``signature`` of the SavedModel at ``path`` (raises InvalidRequest naming the field); ``origin``: where
    the model was named when ``path`` is a local copy of it (a ``.keras`` file's safe mode is that root's).

    GPUs get memory growth and TensorFloat-32 off first (``worker.engine.devices.prepare_gpus``; raises
    GPUMemoryReserved when TensorFlow already holds the whole GPU)."""
    from worker.engine.devices import prepare_gpus
    from worker.engine.memory import limit_malloc_arenas

    limit_malloc_arenas()
    prepare_gpus()
    import tensorflow as tf

    from worker.engine import loop_handles, resize_grads

    loop_handles.install()   # second derivatives through loops that read a captured variable
    resize_grads.install()   # second derivatives (and forward mode) through image resizing

    if str(path).endswith(".keras") and Path(path).is_file():
        from worker.engine.keras_model import load_keras_model

        return load_keras_model(str(path), signature, origin=origin)
    try:
        loaded = _load_saved_model(tf, str(path))
    except (OSError, ValueError, tf.errors.OpError) as err:
        raise InvalidRequest(f"model.path: cannot load a SavedModel from {path!r}: {err}", field="model.path") from err
    signatures = dict(getattr(loaded, "signatures", {}) or {})
    if signature not in signatures:
        names = ", ".join(repr(n) for n in sorted(signatures)) or "(none)"
        raise InvalidRequest(f"model.signature: {signature!r} is not a signature of {path!r}; choose one of: {names}",
                             field="model.signature")
    fn = signatures[signature]
    input_specs = dict(fn.structured_input_signature[1])
    outputs = fn.structured_outputs
    if not isinstance(outputs, dict):
        raise NotDifferentiable(f"model.signature: {signature!r} does not return a dict of named outputs",
                                field="model.signature")
    output_specs = {name: tf.TensorSpec(t.shape, t.dtype, name) for name, t in outputs.items()}
    return LoadedModel(path=str(path), signature=signature, loaded=loaded, fn=fn, input_specs=input_specs,
                       output_specs=output_specs, variables=named_variables(loaded, fn.variables),
                       fingerprint=model_fingerprint(path), **graph_counts(fn))


def _load_saved_model(tf: Any, path: str) -> Any:
    """``tf.saved_model.load``, with TensorFlow's API namespaces all run first where the model needs what only
    they register (``tf_import``); a load that fails while some were left lazy is tried once more after them."""
    tf_import.import_for_loading()
    if tf_import.lazy_left() and tf_import.names_a_skipped_registration(path):
        tf_import.complete()
    out_of_memory = (MemoryError, getattr(tf.errors, "ResourceExhaustedError", MemoryError))
    try:
        return tf.saved_model.load(path)
    except Exception as err:
        if isinstance(err, out_of_memory) or not tf_import.lazy_left() \
                or not (Path(path) / "saved_model.pb").is_file():
            raise   # out of memory, nothing left to run, or nothing a namespace could make loadable
        log.info("loading %s failed with TensorFlow's API namespaces lazy: again with all of them run", path)
    tf_import.complete()   # out of the handler: the first attempt's traceback and objects are gone
    return tf.saved_model.load(path)


def named_variables(loaded: Any, captured: Any) -> dict[str, Any]:
    """The variables the signature reads, named as requests name them (``contracts.savedmodel.variable_names``,
    as the API does): by name, or ``<name>@<object path>`` where several share a name."""
    unique = list({id(v): v for v in captured}.values())
    names = [strip_variable_suffix(v.name) for v in unique]
    if len(set(names)) == len(names):
        return dict(zip(names, unique))
    paths = _object_paths(loaded, {id(v) for v, n in zip(unique, names) if names.count(n) > 1})
    return dict(zip(variable_names([(n, paths.get(id(v), "?")) for v, n in zip(unique, names)]), unique))


def _object_paths(root: Any, wanted: set[int]) -> dict[int, str]:
    """``id(object) -> object path`` from ``root`` for the ``wanted`` objects: local names joined by ``.``, the
    first path found breadth-first with children in their order (as ``contracts.savedmodel`` reads the file)."""
    import tensorflow as tf

    view = tf.train.TrackableView(root)
    paths: dict[int, str] = {id(root): ""}
    queue, found = [root], {}
    for obj in queue:
        try:
            children = view.children(obj)
        except Exception:  # noqa: BLE001 - an object that cannot list its children has none to walk
            continue
        for local, child in children.items():
            if id(child) in paths:
                continue
            paths[id(child)] = f"{paths[id(obj)]}.{local}" if paths[id(obj)] else str(local)
            if id(child) in wanted:
                found[id(child)] = paths[id(child)]
                if len(found) == len(wanted):
                    return found
            queue.append(child)
    return found


def graph_counts(fn: Any) -> dict[str, int]:
    """``LoadedModel``'s ``graph_ops``, ``graph_loops`` (``While`` ops) and ``graph_list_loops`` (those with a
    ``variant`` loop variable: a ``TensorList``, as a Keras RNN's ``TensorArray`` of steps) of ``fn``'s graph and
    its functions."""
    try:
        graph_def = fn.graph.as_graph_def()
    except Exception:  # noqa: BLE001 - a size estimate only
        return {"graph_ops": 0, "graph_loops": 0, "graph_list_loops": 0}
    from tensorflow.core.framework import types_pb2

    nodes = [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]
    loops = [n for n in nodes if n.op in ("While", "StatelessWhile")]
    return {"graph_ops": len(nodes), "graph_loops": len(loops),
            "graph_list_loops": sum(types_pb2.DT_VARIANT in n.attr["T"].list.type for n in loops)}


def describe_signature(model: LoadedModel) -> dict[str, dict[str, dict[str, Any]]]:
    """Inputs, outputs and variables with dtype and shape (``None`` for free dimensions)."""
    def spec(s: Any) -> dict[str, Any]:
        return {"dtype": s.dtype.name, "shape": _shape_list(s.shape)}

    return {
        "inputs": {n: spec(s) for n, s in sorted(model.input_specs.items())},
        "outputs": {n: spec(s) for n, s in sorted(model.output_specs.items())},
        "variables": {n: spec(v) for n, v in sorted(model.variables.items())},
    }
