"""A Keras 3 ``.keras`` file loaded as a ``LoadedModel``: ``keras.saving.load_model`` in safe mode, wrapped into
a concrete function ``fn(**inputs) -> {output name: tensor}`` named as ``contracts.keras_file`` names them."""

from __future__ import annotations

import importlib
from typing import Any

from contracts.keras_file import (
    CUSTOM_OBJECTS_SETTING,
    SIGNATURE,
    SUBCLASSED_INPUT,
    SUBCLASSED_OUTPUT,
    UNSAFE_SETTING,
    custom_classes,
    read_config,
    read_keras_file,
    under,
)
from worker.engine.errors import InvalidRequest, NotDifferentiable
from worker.engine.model import LoadedModel, graph_counts, model_fingerprint, named_variables

FIELD = "model.path"


def custom_objects(module_name: str | None) -> dict[str, Any]:
    """The custom objects of ``module_name`` (``JACOBIAN_KERAS_CUSTOM_OBJECTS``): its ``CUSTOM_OBJECTS`` dict, or
    else every class it registered with ``keras.saving.register_keras_serializable`` (importing it registers
    them)."""
    if not module_name:
        return {}
    import keras

    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any failure to import is the operator's setting to fix
        raise InvalidRequest(f"{FIELD}: the custom objects module {module_name!r} ({CUSTOM_OBJECTS_SETTING}) cannot "
                             f"be imported: {type(err).__name__}: {err}", field=FIELD) from None
    given = getattr(module, "CUSTOM_OBJECTS", None)
    if isinstance(given, dict):
        return dict(given)
    return {name: obj for name, obj in keras.saving.get_custom_objects().items()
            if getattr(obj, "__module__", None) == module.__name__}


def _check_classes(config: dict[str, Any], objects: dict[str, Any], module_name: str | None) -> None:
    """Every class outside Keras that ``config`` names must be one of ``objects`` (not merely registered by some
    module this process imported)."""
    for name in custom_classes(config):
        if name in objects or name.split(">")[-1] in objects:
            continue
        where = (f"the custom objects module {module_name!r} ({CUSTOM_OBJECTS_SETTING}) does not define it"
                 if module_name else f"no custom objects module is configured ({CUSTOM_OBJECTS_SETTING})")
        raise InvalidRequest(f"{FIELD}: the model uses class {name!r}, which is not known: {where}; ask the operator "
                             "to add it there", field=FIELD)


def _names(struct: Any, fallback: list[str]) -> list[str]:
    if isinstance(struct, dict):
        return [str(k) for k in struct]
    return list(fallback)


def load_keras_model(path: str, signature: str = SIGNATURE, *, origin: str | None = None) -> LoadedModel:
    """Load the ``.keras`` file at ``path`` (``safe_mode=True`` unless it, or ``origin``, the URL it is a local copy
    of, lies in ``JACOBIAN_KERAS_UNSAFE_ROOTS``).

    Raises ``InvalidRequest`` naming ``model.path`` for a file Keras cannot load or a class that is not known
    (naming it and ``JACOBIAN_KERAS_CUSTOM_OBJECTS``), naming ``model.signature`` for another signature name."""
    import keras
    import tensorflow as tf

    from contracts.settings import get_settings

    if signature != SIGNATURE:
        raise InvalidRequest(f"model.signature: {signature!r} is not a signature of {path!r}; a .keras file has one: "
                             f"{SIGNATURE!r}", field="model.signature")
    settings = get_settings()
    config = read_config(path)
    objects = custom_objects(settings.keras_custom_objects)
    _check_classes(config, objects, settings.keras_custom_objects)
    safe = not under(origin or path, settings.keras_unsafe_roots)
    try:
        model = keras.saving.load_model(path, safe_mode=safe, custom_objects=objects, compile=False)
    except Exception as err:  # noqa: BLE001 - whatever Keras raises, the file is what the caller must fix
        hint = f"; an operator may allow it for this root with {UNSAFE_SETTING}" if safe and "safe_mode" in str(
            err) else ""
        raise InvalidRequest(f"{FIELD}: cannot load the .keras file {path!r}: {type(err).__name__}: {err}{hint}",
                             field=FIELD) from None
    in_struct = getattr(model, "_inputs_struct", None)
    if in_struct is not None:   # a functional model
        tensors = list(tf.nest.flatten(in_struct))
        names = _names(in_struct, [t.name for t in tensors])
        specs = {n: tf.TensorSpec(t.shape, t.dtype, name=n) for n, t in zip(names, tensors)}
    else:                       # a subclassed model: the shape its build recorded
        spec = read_keras_file(path).signature(SIGNATURE).inputs[SUBCLASSED_INPUT]
        if spec.shape is None:
            raise InvalidRequest(f"{FIELD}: the subclassed model in {path!r} records no input shape; build it "
                                 "(call it once) before saving", field=FIELD)
        specs = {SUBCLASSED_INPUT: tf.TensorSpec(spec.shape, spec.dtype, name=SUBCLASSED_INPUT)}
    out_struct = getattr(model, "_outputs_struct", None)
    out_names = _names(out_struct, list(getattr(model, "output_names", None) or []))

    def structured(inputs: dict[str, Any]) -> Any:
        if isinstance(in_struct, dict):
            return {n: inputs[n] for n in specs}
        if isinstance(in_struct, (list, tuple)):
            return [inputs[n] for n in specs]
        return inputs[next(iter(specs))]

    def call(**inputs: Any) -> dict[str, Any]:
        out = model(structured(inputs), training=False)
        if isinstance(out, dict):
            return {str(k): v for k, v in out.items()}
        flat = list(tf.nest.flatten(out))
        names = out_names if len(out_names) == len(flat) else (
            [SUBCLASSED_OUTPUT] if len(flat) == 1 else [f"output_{i}" for i in range(len(flat))])
        return dict(zip(names, flat))

    try:
        fn = tf.function(call).get_concrete_function(**specs)
    except (TypeError, ValueError) as err:
        raise NotDifferentiable(f"{FIELD}: the model in {path!r} cannot be traced on its inputs "
                                f"({', '.join(specs)}): {err}", field=FIELD) from None
    output_specs = {name: tf.TensorSpec(t.shape, t.dtype, name) for name, t in fn.structured_outputs.items()}
    return LoadedModel(path=path, signature=signature, loaded=model, fn=fn, input_specs=specs,
                       output_specs=output_specs, variables=named_variables(model, fn.variables),
                       fingerprint=model_fingerprint(path), **graph_counts(fn))
